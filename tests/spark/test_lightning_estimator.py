"""``horovod.spark.lightning.TorchEstimator`` and its ``HorovodStrategy``.

* the strategy under ``horovodrun -np 2`` (ranks start from different weights and train on different rows) ends
  with the weights of a single-process reference run here: rank 0's initial weights, each step the average of
  the two ranks' gradients, the learning rate x 2;
* the estimator on a real local Spark at np=2: a ``LightningModule`` learns ``y = X @ w + b`` to within 0.02,
  ``transform`` equals the returned module run here, the validation metric is logged, and a second ``fit`` with
  the same ``run_id`` resumes from the checkpoint (the module sees the trainer start at epoch 2) for ``epochs``
  more epochs;
* bad input: not a LightningModule, an ``optimizer`` or ``loss`` next to one.
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'horovod[lightning]')")
pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'horovod[spark]')", exc_type=ImportError)
pytest.importorskip("pyarrow")

import lightning_strategy_job as job  # noqa: E402
from estimator_checks import check_regression, regression_frame  # noqa: E402
from launch_util import clean_env, launch  # noqa: E402
from pyspark import cloudpickle as spark_cloudpickle  # noqa: E402

from horovod.spark.common.store import Store  # noqa: E402
from horovod.spark.lightning import TorchEstimator, TorchModel  # noqa: E402

for _pickler in (cloudpickle, spark_cloudpickle):
    _pickler.register_pickle_by_value(sys.modules[__name__])  # executors and workers cannot import this module



@pytest.mark.parametrize("flavour", ["lightning.pytorch", "pytorch_lightning"])
def test_strategy_matches_single_process_reference(flavour):
    """Also for a module of ``pytorch_lightning`` (upstream's examples import it; ``lightning`` installs it as a
    second package with classes of its own)."""
    pytest.importorskip(flavour)
    code, out, _ = launch(2, [sys.executable, os.path.join(os.path.dirname(__file__), "lightning_strategy_job.py")],
                          env=clean_env(TEST_LIGHTNING=flavour), timeout=240)
    assert code == 0, out[-4000:]
    line = next(ln for ln in out.splitlines() if "RESULT " in ln)
    result = json.loads(line.split("RESULT ", 1)[1])
    ranks = np.array(result["weights"])
    np.testing.assert_array_equal(ranks[0], ranks[1])  # one model on every rank
    # ranks hold 1 and 2; torch's ReduceOp.SUM (an enum whose value is 0) was taken for the default, the mean, so
    # every all-ranks decision (a user ModelCheckpoint's "new best") came out False on 2 ranks
    assert result["reductions"] == {"mean": 1.5, "sum": 3.0, "max": 2.0, "min": 1.0, "ReduceOp.SUM": 3.0}
    assert result["decisions"] == [True, False, True, False]

    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 1)
    data = [job.rank_data(r) for r in range(2)]
    for _ in range(job.EPOCHS):
        for step in range(job.STEPS):
            grads = []
            for x, y in data:
                reference.zero_grad()
                rows = slice(step * job.BATCH, (step + 1) * job.BATCH)
                torch.nn.functional.mse_loss(reference(x[rows]), y[rows]).backward()
                grads.append([p.grad.clone() for p in reference.parameters()])
            with torch.no_grad():
                for p, g0, g1 in zip(reference.parameters(), *grads):
                    p -= job.LR * 2 * (g0 + g1) / 2
    expected = torch.cat([reference.weight.detach().ravel(), reference.bias.detach()]).numpy()
    np.testing.assert_allclose(ranks[0], expected, rtol=1e-5, atol=1e-6)


def test_strategy_accumulates_gradients():
    """``accumulate_grad_batches=2``: one step per two batches, with the average over the ranks of the two batches'
    gradients (Lightning divides each loss by 2).  The strategy used to claim ``handles_gradient_accumulation``,
    so Lightning called ``step()`` on every batch and ``zero_grad()`` never: each rank stepped with its first
    batch's gradient alone, then again with both, and the weights ended far from the reference."""
    code, out, _ = launch(2, [sys.executable, os.path.join(os.path.dirname(__file__), "lightning_strategy_job.py")],
                          env=clean_env(TEST_LIGHTNING="lightning.pytorch", TEST_ACCUMULATE="2"), timeout=240)
    assert code == 0, out[-4000:]
    line = next(ln for ln in out.splitlines() if "RESULT " in ln)
    ranks = np.array(json.loads(line.split("RESULT ", 1)[1])["weights"])
    np.testing.assert_array_equal(ranks[0], ranks[1])

    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 1)
    data = [job.rank_data(r) for r in range(2)]
    for _ in range(job.EPOCHS):
        for step in range(0, job.STEPS, 2):
            reference.zero_grad()
            for x, y in data:
                for k in (step, step + 1):
                    rows = slice(k * job.BATCH, (k + 1) * job.BATCH)
                    (torch.nn.functional.mse_loss(reference(x[rows]), y[rows]) / 2).backward()
            with torch.no_grad():
                for p in reference.parameters():
                    p -= job.LR * 2 * p.grad / 2
    expected = torch.cat([reference.weight.detach().ravel(), reference.bias.detach()]).numpy()
    np.testing.assert_allclose(ranks[0], expected, rtol=1e-5, atol=1e-6)


class Regression(pl.LightningModule):
    """``y = features @ w + b``; records the epochs its trainer started and ended at."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.register_buffer("started_at", torch.tensor(-1))
        self.register_buffer("ended_at", torch.tensor(-1))
        self.register_buffer("mpi_started", torch.tensor(-1))

    def forward(self, features):
        return self.linear(features)

    def on_train_start(self):
        self.started_at.fill_(self.current_epoch)
        mpi = sys.modules.get("mpi4py.MPI")  # Lightning's MPI probe would have imported (and initialised) it
        self.mpi_started.fill_(int(mpi is not None and mpi.Is_initialized()))

    def on_train_end(self):
        self.ended_at.fill_(self.current_epoch)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.fixture(scope="module")
def regression(estimator_spark):
    return regression_frame(estimator_spark)


def _estimator(store, epochs, **kwargs):
    torch.manual_seed(0)
    params = dict(num_proc=2, store=store, model=Regression(), feature_cols=["features"], label_cols=["y"],
                  batch_size=16, epochs=epochs, validation="is_val", run_id="lightning_run", random_seed=1,
                  partitions_per_process=2, verbose=0)
    params.update(kwargs)
    return TorchEstimator(**params)


def test_estimator_learns_transform_matches_and_resumes(regression, tmp_path, capsys):
    store = Store.create(str(tmp_path))
    first = _estimator(store, 2).fit(regression)
    # the per-epoch checkpoint asks for the full checkpoint: no Lightning notice on every rank every epoch
    assert "`weights_only` was not set" not in capsys.readouterr().err
    assert isinstance(first, TorchModel) and first.getRunId() == "lightning_run"
    assert set(first.getHistory()) >= {"train_loss", "val_loss"}
    assert (int(first.getModel().started_at), int(first.getModel().ended_at)) == (0, 2)
    assert int(first.getModel().mpi_started) == 0  # no MPI_Init in the workers: the ranks are Horovod's
    assert store.exists(store.get_checkpoint_path("lightning_run"))
    assert store.list_files(store.get_logs_path("lightning_run"))  # the logger's files reached the store

    resumed = _estimator(store, 3).fit(regression)
    trained = resumed.getModel()
    assert (int(trained.started_at), int(trained.ended_at)) == (2, 5)  # after the checkpoint's 2 epochs, 3 more
    assert resumed.getHistory()["val_loss"] < first.getHistory()["val_loss"]
    check_regression(resumed, regression, trained, trained.linear.weight, trained.linear.bias)


def test_a_user_model_checkpoint_gives_the_best_module(regression, tmp_path):
    """With a user ``ModelCheckpoint`` the returned module is its best checkpoint's (upstream's behaviour):
    ``mode="max"`` makes that the first epoch's, whose validation error, computed here, is above the last's."""
    store = Store.create(str(tmp_path))
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="val_loss", mode="max", save_top_k=1)
    fitted = _estimator(store, 3, callbacks=[checkpoint]).fit(regression)
    saved = [f for f in store.list_files(store.get_run_path("lightning_run")) if f.endswith(".ckpt")]
    assert [os.path.basename(f) for f in saved] == ["epoch=0-step=8.ckpt"], saved
    with open(store.get_localized_path(saved[0]), "rb") as f:
        best = torch.load(f, map_location="cpu", weights_only=False)["state_dict"]
    returned = fitted.getModel().state_dict()
    for name in ("linear.weight", "linear.bias"):
        torch.testing.assert_close(returned[name], best[name])
    rows = regression.filter("is_val").collect()
    x, y = np.stack([r["features"].toArray() for r in rows]), np.array([r["y"] for r in rows])
    w, b = returned["linear.weight"].numpy().ravel(), returned["linear.bias"].numpy()
    assert np.mean((x @ w + b - y) ** 2) > 2 * fitted.getHistory()["val_loss"]  # not the last epoch's module


def test_a_pytorch_lightning_module_is_accepted(tmp_path):
    """Upstream's examples subclass ``pytorch_lightning.LightningModule`` (a class distinct from
    ``lightning.pytorch``'s when both are installed): the estimator takes it and trains it with that package."""
    from horovod.spark.lightning.compat import flavour_of
    from horovod.spark.lightning.estimator import MIN_PL_VERSION  # where upstream's examples import it
    from horovod.spark.lightning.strategy import strategy_for

    legacy = pytest.importorskip("pytorch_lightning")
    assert tuple(int(v) for v in legacy.__version__.split(".")[:2]) >= tuple(map(int, MIN_PL_VERSION.split(".")[:2]))

    class Legacy(legacy.LightningModule):
        pass

    model = Legacy()
    assert flavour_of(model) is legacy and flavour_of(Regression()) is pl
    assert issubclass(strategy_for(legacy), legacy.strategies.ParallelStrategy)
    _estimator(Store.create(str(tmp_path)), 1, model=model)._check_params()  # no ValueError


def test_bad_input(regression, tmp_path):
    store = Store.create(str(tmp_path))
    with pytest.raises(ValueError, match="model must be a LightningModule"):
        _estimator(store, 1, model=torch.nn.Linear(3, 1)).fit(regression)
    model = Regression()
    with pytest.raises(ValueError, match=r"\['optimizer'\] must not be given with a LightningModule"):
        _estimator(store, 1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).fit(regression)
    with pytest.raises(ValueError, match='At most one of parameters "backend" and "num_proc" may be specified'):
        from horovod.spark.common.backend import SparkBackend

        _estimator(store, 1, backend=SparkBackend(2)).fit(regression)
