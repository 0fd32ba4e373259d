"""``horovod.spark.torch.TorchEstimator`` on a real local Spark, 2 Horovod processes: tasks with known answers.

* regression ``y = X @ w + b``: the trained weights within 0.02 of ``w``/``b``; ``transform`` row by row equal to
  the returned model run here in one process; the validation column's rows are the validation data;
* a checkpoint resume: a second ``fit`` with the same ``run_id`` trains ``epochs`` more epochs from the checkpoint;
* classification with sample weights: rows with wrong labels and weight 0 do not move the boundary (accuracy on
  the true labels >= 0.95; a reference run here without the weights gets < 0.8), a metric in the history;
* ``backward_passes_per_step=2``: half as many optimizer steps as batches;
* bad input: upstream's errors.
"""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'horovod[spark]')", exc_type=ImportError)
pytest.importorskip("pyarrow")

from estimator_checks import check_regression, regression_frame, run_example  # noqa: E402
from pyspark import cloudpickle as spark_cloudpickle  # noqa: E402

from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.torch import TorchEstimator, TorchModel  # noqa: E402

for _pickler in (cloudpickle, spark_cloudpickle):
    _pickler.register_pickle_by_value(sys.modules[__name__])  # executors and workers cannot import this module



@pytest.fixture(scope="module")
def regression(estimator_spark):
    return regression_frame(estimator_spark)


def _linear_estimator(store, model, **kwargs):
    params = dict(num_proc=2, store=store, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                  loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["y"], batch_size=16,
                  random_seed=1, partitions_per_process=2, verbose=1)
    params.update(kwargs)
    return TorchEstimator(**params)


def test_regression_learns_transform_matches_and_resumes(regression, tmp_path):
    store = Store.create(str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    untouched = {k: v.clone() for k, v in model.state_dict().items()}
    first = _linear_estimator(store, model, epochs=2, validation="is_val", run_id="linear").fit(regression)
    assert isinstance(first, TorchModel) and first.getRunId() == "linear"
    for k, v in model.state_dict().items():  # the user's model is not trained in place
        torch.testing.assert_close(v, untouched[k])
    history = first.getHistory()
    assert [h["epoch"] for h in history] == [0, 1]
    assert all("validation" in h for h in history)
    assert history[1]["train"]["loss"] < history[0]["train"]["loss"]

    # The validation rows (every fifth id) are the validation data, never the training data.
    import pyarrow.parquet as pq

    meta = store.get_data_metadata_path(store.get_train_data_path(0))
    assert store.exists(meta)
    val_y = sorted(pq.read_table(store.list_files(store.get_val_data_path(0), ".parquet")).column("y").to_pylist())
    train_y = pq.read_table(store.list_files(store.get_train_data_path(0), ".parquet")).column("y").to_pylist()
    expected_val = sorted(r["y"] for r in regression.filter("is_val").collect())
    assert val_y == pytest.approx(expected_val) and len(train_y) == 256
    assert not set(np.round(train_y, 9)) & set(np.round(val_y, 9))
    assert store.exists(store.get_checkpoint_path("linear"))

    # Same run_id: resumes after epoch 1 from the checkpoint (model, optimizer, history), 4 epochs more.
    resumed = _linear_estimator(store, model, epochs=4, validation="is_val", run_id="linear").fit(regression)
    history = resumed.getHistory()
    assert [h["epoch"] for h in history] == list(range(6))
    assert history[:2] == first.getHistory()
    assert history[2]["train"]["loss"] < first.getHistory()[0]["train"]["loss"] / 10
    trained = resumed.getModel()
    check_regression(resumed, regression, trained, trained.weight, trained.bias)


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


class TwoInputs(torch.nn.Module):
    """Logistic regression over two scalar feature columns (one input tensor each)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, a, b):
        return self.linear(torch.cat([a, b], dim=1))


def test_classification_sample_weights_and_metrics(estimator_spark, tmp_path):
    from pyspark.ml.linalg import DenseVector

    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, size=(600, 2))
    x = x[np.abs(x[:, 0] + x[:, 1]) > 0.3][:400]
    truth = (x[:, 0] + x[:, 1] > 0).astype(int)
    wrong = x[:, 0] > 0.8                        # a region whose labels are flipped ...
    label = np.where(wrong, 1 - truth, truth)
    weight = np.where(wrong, 0.0, 1.0)            # ... and weighted out
    df = estimator_spark.createDataFrame(
        [(float(a), float(b), int(t), float(w)) for (a, b), t, w in zip(x, label, weight)], ["a", "b", "label", "w"])

    torch.manual_seed(0)
    model = TwoInputs()
    weighted = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path)), model=model,
                              optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                              loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy], feature_cols=["a", "b"],
                              input_shapes=[[-1, 1], [-1, 1]], label_cols=["label"], sample_weight_col="w",
                              batch_size=16, epochs=8, random_seed=2, partitions_per_process=2, verbose=0).fit(df)
    history = weighted.getHistory()
    assert set(history[-1]["train"]["all_metrics"]) == {"group_0_label"}
    # Accuracy against the given labels: a model that learned the truth is right on the rows not flipped.
    assert history[-1]["train"]["all_metrics"]["group_0_label"] == pytest.approx(1 - wrong.mean(), abs=0.06)
    out = weighted.transform(df.select("a", "b")).collect()
    assert isinstance(out[0]["label__output"], DenseVector)  # a vector prediction of a scalar label
    predicted = np.array([r["label__output"].toArray() for r in out])
    features = np.array([[r["a"], r["b"]] for r in out])
    with torch.no_grad():
        a, b = torch.from_numpy(features[:, :1]).float(), torch.from_numpy(features[:, 1:]).float()
        local = weighted.getModel()(a, b)
    np.testing.assert_allclose(predicted, local.numpy(), rtol=1e-5, atol=1e-6)
    true_of = {(round(a, 9), round(b, 9)): t for (a, b), t in zip(x, truth)}
    labels = np.array([true_of[(round(a, 9), round(b, 9))] for a, b in features])
    assert (predicted.argmax(axis=1) == labels).mean() >= 0.95

    # The same data without the weights misleads a model (a single-process reference run): the check above can fail.
    torch.manual_seed(0)
    reference = TwoInputs()
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    a, b = torch.from_numpy(x[:, :1]).float(), torch.from_numpy(x[:, 1:]).float()
    for _ in range(200):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(a, b), torch.from_numpy(label)).backward()
        optimizer.step()
    with torch.no_grad():
        assert (reference(a, b).argmax(dim=1).numpy() == truth).mean() < 0.8


class TwoLinear(torch.nn.Module):
    """A linear map of two feature columns, each through a layer of its own: an integer one (``LongType``) and a
    float one."""

    def __init__(self):
        super().__init__()
        self.count = torch.nn.Linear(1, 1)
        self.x = torch.nn.Linear(1, 1, bias=False)

    def forward(self, count, x):
        return self.count(count) + self.x(x)


def test_integer_feature_column_is_fed_as_floats(estimator_spark, tmp_path):
    """Upstream feeds every feature column as floats (``row[col].float()``): an integer column into a Linear
    layer trains and transforms (it failed: ``mat1 and mat2 must have the same dtype``)."""
    rng = np.random.default_rng(3)
    count = rng.integers(-5, 6, size=320)
    x = rng.normal(size=320)
    y = 0.5 * count - 2.0 * x + 1.0
    df = estimator_spark.createDataFrame([(int(c), float(v), float(t)) for c, v, t in zip(count, x, y)],
                                         ["count", "x", "y"])
    torch.manual_seed(0)
    model = TwoLinear()
    fitted = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path)), model=model,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.02), loss=torch.nn.functional.mse_loss,
                            feature_cols=["count", "x"], label_cols=["y"], batch_size=16, epochs=10, random_seed=1,
                            partitions_per_process=2, verbose=0).fit(df)
    trained = fitted.getModel()
    assert abs(float(trained.count.weight) - 0.5) < 0.05 and abs(float(trained.x.weight) + 2.0) < 0.05
    assert abs(float(trained.count.bias) - 1.0) < 0.05
    out = fitted.transform(df).collect()
    with torch.no_grad():
        local = fitted.getModel()(torch.tensor([[float(r["count"])] for r in out]),
                                  torch.tensor([[r["x"]] for r in out], dtype=torch.float32))
    np.testing.assert_allclose([r["y__output"] for r in out], local.numpy().ravel(), rtol=1e-5, atol=1e-5)


def test_training_metric_compares_labels_shaped_like_the_outputs(regression, tmp_path):
    """A model off by exactly 0.1 on every row (learning rate 0): the mean absolute error is 0.1 in training
    as in validation.  The training metric got the labels as read, ``(batch,)`` against outputs ``(batch, 1)``,
    and broadcast them to every pair of rows (about 3 here)."""
    from estimator_checks import B, W

    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([W.tolist()]))
        model.bias.fill_(B + 0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    fitted = _linear_estimator(Store.create(str(tmp_path)), model, optimizer=optimizer,
                               metrics=[lambda output, label: (output - label).abs().mean()], epochs=1,
                               validation="is_val").fit(regression)
    record = fitted.getHistory()[0]
    assert record["validation"]["all_metrics"]["group_0_y"] == pytest.approx(0.1, abs=1e-5)
    assert record["train"]["all_metrics"]["group_0_y"] == pytest.approx(0.1, abs=1e-5)
    assert record["train"]["loss"] == pytest.approx(0.01, abs=1e-5)


def test_one_forward_pass_per_training_step(regression, tmp_path):
    """Each training step runs the model once: a fix of the metrics' labels ran the validation branch's forward
    pass again after every step that had no metrics (its loss, after the step, reported as the step's)."""

    class Counting(torch.nn.Linear):
        def __init__(self):
            super().__init__(3, 1)
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.calls += 1
            return super().forward(x)

    fitted = _linear_estimator(Store.create(str(tmp_path)), Counting(), epochs=2,
                               train_steps_per_epoch=3).fit(regression.drop("is_val"))  # no metrics: the case it hit
    assert int(fitted.getModel().calls) == 6


def test_whole_tensor_input_shape_transforms_row_by_row(regression, tmp_path):
    """``input_shapes=[[3]]`` (no -1: the whole tensor, upstream's tests with ``batch_size=1``) trains one row per
    step, and ``transform`` feeds the model one row shaped ``(3,)`` at a time, as upstream's does: it reshaped a
    batch of rows to ``[3]`` (``shape '[3]' is invalid for input of size ...``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    fitted = _linear_estimator(Store.create(str(tmp_path)), model, input_shapes=[[3]], batch_size=1, epochs=1,
                               train_steps_per_epoch=20).fit(regression.drop("is_val"))
    out = fitted.transform(regression.select("id", "features")).orderBy("id").collect()
    assert len(out) == regression.count()
    x = np.stack([r["features"].toArray() for r in out])
    trained = fitted.getModel()
    expected = x @ trained.weight.detach().numpy().ravel() + float(trained.bias)
    np.testing.assert_allclose([r["y__output"] for r in out], expected, rtol=1e-5, atol=1e-5)


def test_backward_passes_per_step(regression, tmp_path):
    """320 rows, batch 16, 2 processes: 10 batches per epoch, gradients of 2 batches per optimizer step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    fitted = _linear_estimator(Store.create(str(tmp_path)), model, optimizer=torch.optim.Adam(model.parameters()),
                               epochs=1, backward_passes_per_step=2, feature_cols=["features"],
                               label_cols=["y"]).fit(regression.drop("is_val"))
    state = fitted.getOptimizer().state_dict()["state"]
    assert [int(s["step"]) for s in state.values()] == [5, 5]
    assert fitted.getHistory()[0]["train"]["loss"] > 0


def test_bad_input(regression, tmp_path):
    store = Store.create(str(tmp_path))
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match='At most one of parameters "backend" and "num_proc" may be specified'):
        from horovod.spark.common.backend import SparkBackend

        _linear_estimator(store, model, backend=SparkBackend(2)).fit(regression)
    with pytest.raises(ValueError, match=r"Column\(s\) \['nope'\] not found in the DataFrame"):
        _linear_estimator(store, model, label_cols=["nope"]).fit(regression)
    with pytest.raises(ValueError, match="only one of loss_constructors and loss parameters can be specified."):
        _linear_estimator(store, model, loss_constructors=[torch.nn.MSELoss]).fit(regression)
    with pytest.raises(ValueError, match="Optimizer parameter is required"):
        _linear_estimator(store, model, optimizer=None).fit(regression)
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        _linear_estimator(store, model, backward_passes_per_step=0).fit(regression)
    with pytest.raises(TypeError, match="unexpected parameter"):
        _linear_estimator(store, model, epoch=3)


@pytest.mark.slow
def test_example_runs_as_written(estimator_spark, monkeypatch, capsys):
    """examples/spark/pytorch_spark_estimator.py learns the answer it prints.  (Its ``--lightning`` variant
    builds the estimator tests/spark/test_lightning_estimator.py trains and checks.)"""
    import os
    import re

    from launch_util import REPO

    out = run_example(os.path.join(REPO, "examples", "spark", "pytorch_spark_estimator.py"), ["--epochs", "3"],
                      monkeypatch, capsys)
    match = re.search(r"learned weights \[\s*([-\d.]+)\s+([-\d.]+)\s+([-\d.]+)\s*\], bias ([-\d.]+)", out)
    assert match, out[-3000:]
    np.testing.assert_allclose([float(v) for v in match.groups()], [0.5, -1.0, 2.0, -0.4], atol=0.05)
    error = re.search(r"largest prediction error over 1000 rows: ([\d.]+)", out)
    assert error and float(error.group(1)) < 0.1, out[-3000:]
