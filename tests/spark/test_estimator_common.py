"""The estimators' common layer (horovod.spark.common): stores, parameters, Parquet preparation, shard readers,
``transform`` and save/load -- checked against values computed here, on a real local Spark where Spark is needed.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys

import cloudpickle
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'horovod[spark]')",
                              exc_type=ImportError)
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from pyspark import cloudpickle as spark_cloudpickle  # noqa: E402

from horovod.spark.common import data as data_mod  # noqa: E402
from horovod.spark.common import serialization  # noqa: E402
from horovod.spark.common.backend import Backend, SparkBackend  # noqa: E402
from horovod.spark.common.estimator import HorovodEstimator, HorovodModel  # noqa: E402
from horovod.spark.common.params import EstimatorParams  # noqa: E402
from horovod.spark.common.reader import ShardReader, steps_per_epoch  # noqa: E402
from horovod.spark.common.store import (  # noqa: E402
    DBFSLocalStore,
    FilesystemStore,
    HDFSStore,
    LocalStore,
    RemoteStore,
    Store,
)

for _pickler in (cloudpickle, spark_cloudpickle):
    _pickler.register_pickle_by_value(sys.modules[__name__])  # executors cannot import this test module


# --- stores --------------------------------------------------------------------------------------------------

def test_store_paths_and_files(tmp_path):
    store = Store.create(str(tmp_path))
    assert type(store) is FilesystemStore
    prefix = str(tmp_path)
    uri = f"file://{prefix}"  # upstream: a bare local path becomes a file:// URI for every remote-facing path
    assert store.prefix_path == uri
    assert store.get_train_data_path() == f"{uri}/intermediate_train_data"
    assert store.get_train_data_path(3) == f"{uri}/intermediate_train_data.3"
    assert store.get_val_data_path(0) == f"{uri}/intermediate_val_data.0"
    assert store.get_test_data_path() == f"{uri}/intermediate_test_data"
    assert store.get_runs_path() == f"{uri}/runs"
    assert store.get_run_path("r1") == f"{uri}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{uri}/runs/r1/checkpoint"
    assert store.get_logs_path("r1") == f"{uri}/runs/r1/logs"
    assert store.get_localized_path(store.get_run_path("r1")) == f"{prefix}/runs/r1"
    assert store.spark_path(store.get_train_data_path()) == f"file://{prefix}/intermediate_train_data"
    assert Store.create(f"file://{prefix}").get_run_path("x") == f"{uri}/runs/x"
    no_runs = LocalStore(prefix, save_runs=False)
    assert no_runs.get_checkpoint_path("r1") is None and no_runs.get_logs_path("r1") is None

    path = store.get_checkpoint_path("r1")
    assert not store.exists(path)
    store.write_text(path, "hello")
    assert store.exists(path) and store.read(path) == b"hello"
    store.write(f"{store.get_run_path('r1')}/a.ckpt", b"1")
    store.write(f"{store.get_run_path('r1')}/b.ckpt", b"2")
    assert [os.path.basename(p) for p in store.get_checkpoints("r1")] == ["a.ckpt", "b.ckpt"]
    store.delete(store.get_run_path("r1"))
    assert not store.exists(path)


def test_store_sync_and_remote(tmp_path):
    store = LocalStore(str(tmp_path / "store"))
    remote = store.to_remote("run7", 2)
    remote = pickle.loads(pickle.dumps(remote))  # travels to the workers
    assert isinstance(remote, RemoteStore)
    assert remote.train_data_path == store.get_train_data_path(2) and remote.run_path == store.get_run_path("run7")
    with remote.get_local_output_dir() as local:
        os.makedirs(os.path.join(local, "logs"))
        with open(os.path.join(local, "checkpoint"), "wb") as f:
            f.write(b"v1")
        with open(os.path.join(local, "logs", "events"), "w") as f:
            f.write("e")
        remote.sync(local)
        with open(os.path.join(local, "checkpoint"), "wb") as f:
            f.write(b"v2")
        remote.sync(local)  # overwrites
    assert not os.path.exists(local)
    assert store.read(store.get_checkpoint_path("run7")) == b"v2"
    assert store.read(f"{store.get_logs_path('run7')}/events") == b"e"


def test_store_create_dispatch(tmp_path, monkeypatch):
    hdfs = Store.create("hdfs://namenode:8020/user/me/store")
    assert type(hdfs) is HDFSStore
    assert hdfs.get_run_path("r") == "hdfs://namenode:8020/user/me/store/runs/r"
    assert Store.create("hdfs:///user/me").prefix_path == "hdfs://default/user/me"
    with pytest.raises(ValueError, match="not an hdfs"):
        HDFSStore("s3://bucket/path")
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    assert type(Store.create("/dbfs/tmp/x")) is FilesystemStore
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "13.3")
    dbfs = Store.create("dbfs:/tmp/x")
    assert type(dbfs) is DBFSLocalStore and dbfs.prefix_path == "file:///dbfs/tmp/x"
    with pytest.raises(ValueError, match="not a dbfs"):
        DBFSLocalStore("/tmp/x")


# --- parameters ----------------------------------------------------------------------------------------------

def test_params_defaults_and_accessors():
    params = EstimatorParams()
    assert (params.getBatchSize(), params.getEpochs(), params.getVerbose(), params.getShuffle()) == (32, 1, 1, True)
    assert params.getMetrics() == [] and params.getCallbacks() == [] and params.getValBatchSize() is None
    assert params.getPartitionsPerProcess() == 10 and params.getShufflingBufferSize() is None
    assert params.setBatchSize(8).setEpochs(3) is params and (params.getBatchSize(), params.getEpochs()) == (8, 3)
    params.setFeatureCols(["a", "b"]).setLabelCols(["y"]).setValidation(0.25)
    assert params.getFeatureCols() == ["a", "b"] and params.getLabelCols() == ["y"] and params.getValidation() == 0.25
    with pytest.raises(TypeError, match="unexpected parameter"):
        params.setParams(batchsize=3)


# --- shard readers -------------------------------------------------------------------------------------------

def _write_parquet(path, n, files, group_rows):
    os.makedirs(path)
    ids = np.arange(n)
    for k, part in enumerate(np.array_split(ids, files)):
        table = pa.table({"id": pa.array(part, pa.int64()),
                          "vec": pa.array([[float(i), -float(i)] for i in part], pa.list_(pa.float64()))})
        pq.write_table(table, os.path.join(path, f"part-{k:05d}.parquet"), row_group_size=group_rows)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_reader_shards_cover_every_row_once(tmp_path, size):
    path = str(tmp_path / "data")
    _write_parquet(path, 103, files=4, group_rows=7)
    fs = LocalStore(str(tmp_path)).filesystem
    seen = []
    for rank in range(size):
        reader = ShardReader(fs, path, ["id", "vec"], rank, size, batch_size=5, shuffle=False)
        assert reader.rows in (103 // size, 103 // size + 1)
        rows = []
        for batch in reader.batches(-(-reader.rows // 5)):
            assert batch["vec"].shape == (5, 2)
            np.testing.assert_array_equal(batch["vec"][:, 0], batch["id"].astype(float))
            rows.extend(batch["id"].tolist())
        seen.extend(rows[:reader.rows])
        assert rows[reader.rows:] == rows[:len(rows) - reader.rows]  # cycles over its own shard
    assert sorted(seen) == list(range(103))


def test_reader_shuffles_per_epoch_with_seed(tmp_path):
    path = str(tmp_path / "data")
    _write_parquet(path, 40, files=2, group_rows=10)
    fs = LocalStore(str(tmp_path)).filesystem

    def epochs(seed):
        reader = ShardReader(fs, path, ["id"], 0, 1, batch_size=40, shuffle=True, seed=seed)
        return [next(reader.batches(1))["id"].tolist() for _ in range(2)]

    first, second = epochs(5)
    assert sorted(first) == sorted(second) == list(range(40))  # each epoch is one pass over the shard
    assert first != second and first != list(range(40))
    assert epochs(5) == [first, second] and epochs(6) != [first, second]


def test_reader_transformation_fn(tmp_path):
    pytest.importorskip("pandas")
    path = str(tmp_path / "data")
    _write_parquet(path, 12, files=1, group_rows=12)
    fs = LocalStore(str(tmp_path)).filesystem

    def double(frame):
        frame["id"] = frame["id"] * 2
        return frame

    reader = ShardReader(fs, path, ["id", "vec"], 0, 1, batch_size=12, shuffle=False, transformation_fn=double)
    batch = next(reader.batches(1))
    np.testing.assert_array_equal(batch["id"], np.arange(12) * 2)
    assert batch["vec"].shape == (12, 2)


def test_steps_per_epoch():
    assert steps_per_epoch(100, 10, 2) == 5 and steps_per_epoch(109, 10, 2) == 5
    assert steps_per_epoch(101, 10, 2, ceil=True) == 6 and steps_per_epoch(5, 10, 2) == 1
    assert steps_per_epoch(100, 10, 2, given=3) == 3
    with pytest.raises(ValueError):
        steps_per_epoch(100, 10, 2, given=0)


# --- a numpy "framework" for the estimator and model plumbing -------------------------------------------------

W = np.array([[1.0, -2.0], [0.5, 3.0]])


class LinearModel(HorovodModel):
    """Predicts ``x @ W`` for the vector label and ``x.sum()`` for the scalar ones."""

    def _predict_fn(self):
        weights = self.getModel()

        def predict(batch):
            x = batch["x"]
            return [x @ weights, x.sum(axis=1), x.sum(axis=1), x @ weights]
        return predict


class RecordingBackend(Backend):
    """Runs nothing; what an estimator would hand to the workers is checked by the test."""

    def num_processes(self):
        return 2


class FakeEstimator(HorovodEstimator):
    _run_id_prefix = "fake"

    def _fit_on_prepared_data(self, backend, dataset):
        self.seen = dataset
        return LinearModel(model=W, history=[{"loss": 1.0}], feature_columns=self.getFeatureCols(),
                           label_columns=self.getLabelCols(), run_id=self._resolve_run_id(), _metadata=dataset.metadata)


@pytest.fixture(scope="module")
def frame(estimator_spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(60, 2))
    rows = [(Vectors.dense(x.tolist()), Vectors.dense((x @ W).tolist()), float(x.sum()), int(round(x.sum())),
             [float(v) for v in x @ W], i % 4 == 0) for i, x in enumerate(xs)]
    return estimator_spark.createDataFrame(rows, ["x", "yv", "yd", "yi", "ya", "is_val"])


def test_prepare_data_split_by_column_and_cache(frame, tmp_path):
    store = LocalStore(str(tmp_path))
    with data_mod.prepare_data(2, store, frame, label_columns=["yv", "yd"], feature_columns=["x"],
                               validation="is_val") as dataset:
        assert (dataset.train_rows, dataset.val_rows) == (45, 15)
        assert dataset.metadata["x"]["shape"] == 2 and dataset.metadata["x"]["intermediate_format"] == "array"
        assert dataset.metadata["yd"]["shape"] == 1 and dataset.metadata["yd"]["dtype"] == "float64"
        assert dataset.metadata["yv"]["spark_data_type"] == "VectorUDT"
        files = store.list_files(dataset.train_data_path, ".parquet")
        assert len(files) >= 2
        val = pq.read_table([f for f in store.list_files(dataset.val_data_path, ".parquet")]).to_pydict()
        assert sorted(val) == ["x", "yd", "yv"]  # the indicator column is not stored
        expected = sorted(r["yd"] for r in frame.filter("is_val").collect())
        assert sorted(val["yd"]) == pytest.approx(expected)
        stamp = os.path.getmtime(store.get_data_metadata_path(dataset.train_data_path))
    with data_mod.prepare_data(2, store, frame, label_columns=["yv", "yd"], feature_columns=["x"],
                               validation="is_val") as again:
        assert again == dataset  # reused, not written again
        assert os.path.getmtime(store.get_data_metadata_path(again.train_data_path)) == stamp
    with data_mod.prepare_data(2, store, frame, label_columns=["yd"], feature_columns=["x"],
                               validation=0.25, random_seed=1) as split:
        assert split.dataset_idx == dataset.dataset_idx  # a new DataFrame takes the lowest idle index
        assert split.train_rows + split.val_rows == 60 and 5 <= split.val_rows <= 25


def test_prepare_data_errors(frame, estimator_spark, tmp_path):
    from pyspark.ml.linalg import Vectors

    store = LocalStore(str(tmp_path))
    with pytest.raises(ValueError, match=r"Column\(s\) \['nope'\] not found"):
        with data_mod.prepare_data(2, store, frame, label_columns=["nope"], feature_columns=["x"]):
            pass
    with pytest.raises(ValueError, match="range"):
        with data_mod.prepare_data(2, store, frame, label_columns=["yd"], validation=1.5):
            pass
    ragged = estimator_spark.createDataFrame([(Vectors.dense([1.0]), 1.0), (Vectors.dense([1.0, 2.0]), 2.0)],
                                             ["x", "y"])
    with pytest.raises(ValueError, match="different sizes"):
        with data_mod.prepare_data(2, store, ragged, label_columns=["y"]):
            pass


def test_fit_transform_output_types_and_save_load(frame, tmp_path):
    from pyspark.ml.linalg import DenseVector

    store = LocalStore(str(tmp_path))
    labels = ["yv", "yd", "yi", "ya"]
    with pytest.raises(ValueError, match='At most one of parameters "backend" and "num_proc" may be specified'):
        FakeEstimator(model=W, store=store, num_proc=2, backend=RecordingBackend(), label_cols=labels).fit(frame)
    with pytest.raises(ValueError, match="Model parameter is required"):
        FakeEstimator(store=store, backend=RecordingBackend(), label_cols=labels).fit(frame)
    for bad, problem in ((dict(batch_size=0), "batch_size must be >= 1, got 0"),
                         (dict(val_batch_size=-2), "val_batch_size must be >= 1, got -2"),
                         (dict(epochs=-1), "epochs must be >= 0, got -1"),
                         (dict(train_steps_per_epoch=0), "train_steps_per_epoch must be >= 1, got 0")):
        before = list(tmp_path.rglob("*"))  # refused before any data is written (the workers found it after)
        with pytest.raises(ValueError, match=re.escape(problem)):
            FakeEstimator(model=W, store=store, backend=RecordingBackend(), feature_cols=["x"], label_cols=labels,
                          **bad).fit(frame)
        assert list(tmp_path.rglob("*")) == before
    estimator = FakeEstimator(model=W, store=store, backend=RecordingBackend(), feature_cols=["x"],
                              label_cols=labels, validation=0.2, run_id="fake_run")
    model = estimator.fit(frame.drop("is_val"))
    assert estimator.seen.train_rows + estimator.seen.val_rows == 60 and estimator.seen.val_rows > 0
    assert model.getRunId() == "fake_run" and model.getHistory() == [{"loss": 1.0}]
    assert model.getOutputCols() == [f"{c}__output" for c in labels]
    out = model.transform(frame.select("x"))
    assert out.columns == ["x"] + model.getOutputCols()
    types = {f.name: type(f.dataType).__name__ for f in out.schema.fields}
    assert [types[c] for c in model.getOutputCols()] == ["VectorUDT", "DoubleType", "LongType", "ArrayType"]
    rows = out.collect()
    assert len(rows) == 60
    for row in rows:
        x = row["x"].toArray()
        assert isinstance(row["yv__output"], DenseVector)
        np.testing.assert_allclose(row["yv__output"].toArray(), x @ W)
        assert row["yd__output"] == pytest.approx(x.sum())
        assert row["yi__output"] == int(round(x.sum()))
        np.testing.assert_allclose(row["ya__output"], x @ W)
    renamed = model.setOutputCols(["a", "b", "c", "d"]).transform(frame.select("x"))
    assert renamed.columns == ["x", "a", "b", "c", "d"]
    with pytest.raises(ValueError, match="already exist"):
        model.transform(renamed.select("x", "a"))

    path = str(tmp_path / "saved" / "model")
    model.save(path)  # Spark ML's layout: <path>/metadata/part-00000, one JSON line
    metadata = json.loads(open(os.path.join(path, "metadata", "part-00000")).read())
    assert metadata["class"] == f"{__name__}.LinearModel" and metadata["uid"] == model.uid
    loaded = LinearModel.load(path)
    np.testing.assert_array_equal(loaded.getModel(), W)
    assert loaded.getOutputCols() == ["a", "b", "c", "d"] and loaded.getRunId() == "fake_run"
    assert loaded.uid == model.uid


def test_sparse_vector_label_predicts_sparse_vectors(estimator_spark, tmp_path):
    """As upstream's transform: a label column whose rows are all SparseVectors gets SparseVector predictions
    (the non-zero values of the prediction), one with dense rows too gets DenseVectors (it gave DenseVectors for
    both)."""
    from pyspark.ml.linalg import DenseVector, SparseVector, Vectors

    xs = np.array([[0.0, 0.0], [3.0, 2.0], [1.0, 1.0], [-2.0, 0.5], [0.5, -1.0], [3.0, 2.0]])

    def sparse(v):
        return Vectors.sparse(len(v), {i: float(x) for i, x in enumerate(v) if x})

    rows = [(Vectors.dense(x.tolist()), sparse(x @ W), float(x.sum()), int(round(x.sum())),
             sparse(x @ W) if i % 2 else Vectors.dense((x @ W).tolist())) for i, x in enumerate(xs)]
    df = estimator_spark.createDataFrame(rows, ["x", "ys", "yd", "yi", "ym"])
    model = FakeEstimator(model=W, store=LocalStore(str(tmp_path)), backend=RecordingBackend(), feature_cols=["x"],
                          label_cols=["ys", "yd", "yi", "ym"]).fit(df)
    out = model.transform(df.select("x")).collect()
    assert len(out) == len(xs)
    for row in out:
        expected = row["x"].toArray() @ W
        assert isinstance(row["ys__output"], SparseVector) and isinstance(row["ym__output"], DenseVector)
        assert row["ys__output"].size == 2
        assert list(row["ys__output"].indices) == list(np.flatnonzero(expected))
        np.testing.assert_allclose(row["ys__output"].toArray(), expected)
        np.testing.assert_allclose(row["ym__output"].toArray(), expected)


def _assembled_pipeline(store):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    estimator = FakeEstimator(model=W, store=store, backend=RecordingBackend(), feature_cols=["x"],
                              label_cols=["yv", "yd", "yi", "ya"], batch_size=7, run_id="piped")
    return Pipeline(stages=[VectorAssembler(inputCols=["x0", "x1"], outputCol="x"), estimator])


def test_pipeline_and_estimator_persistence(frame, tmp_path):
    """Upstream's models and estimators are Spark ML MLWritable/MLReadable: a PipelineModel holding a Horovod
    model saves and loads like any other (Spark's DefaultParamsReader finds the stage's class in
    <path>/metadata), ``write().overwrite()`` replaces a saved path, and an estimator saves its parameters."""
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.sql import functions as F

    store = LocalStore(str(tmp_path / "store"))
    xs = frame.select(F.udf(lambda v: float(v[0]), "double")("x").alias("x0"),
                      F.udf(lambda v: float(v[1]), "double")("x").alias("x1"), "yv", "yd", "yi", "ya")
    fitted = _assembled_pipeline(store).fit(xs)
    path = str(tmp_path / "pipeline_model")
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert type(loaded.stages[1]) is LinearModel and loaded.stages[1].uid == fitted.stages[1].uid
    rows = loaded.transform(xs).collect()
    assert len(rows) == 60
    for row in rows:
        x = np.array([row["x0"], row["x1"]])
        np.testing.assert_allclose(row["yv__output"].toArray(), x @ W)
        assert row["yd__output"] == pytest.approx(x.sum()) and row["yi__output"] == int(round(x.sum()))

    model = fitted.stages[1]
    single = str(tmp_path / "model")
    model.save(single)
    with pytest.raises(OSError, match="already exists. To overwrite it, please use write"):
        model.save(single)
    model.setOutputCols(["p", "q", "r", "s"]).write().overwrite().save(single)
    assert LinearModel.read().load(single).getOutputCols() == ["p", "q", "r", "s"]

    pipeline_path = str(tmp_path / "pipeline")
    _assembled_pipeline(store).save(pipeline_path)  # an unfitted pipeline: the estimator's parameters
    estimator = Pipeline.load(pipeline_path).getStages()[1]
    assert type(estimator) is FakeEstimator and estimator.getStore() is None  # stores are not saved (upstream)
    np.testing.assert_array_equal(estimator.getModel(), W)
    assert (estimator.getBatchSize(), estimator.getRunId(), estimator.getLabelCols()) == (7, "piped",
                                                                                         ["yv", "yd", "yi", "ya"])

    old = tmp_path / "old.json"  # the single JSON file earlier versions of this package wrote still loads
    old.write_text(json.dumps({"class": "LinearModel", "params": {
        "model": serialization.dumps_b64(W), "label_columns": serialization.dumps_b64(["yv"]),
        "feature_columns": serialization.dumps_b64(["x"])}}))
    np.testing.assert_array_equal(LinearModel.load(str(old)).getModel(), W)


def test_spark_backend_runs_with_horovod(estimator_spark):
    backend = SparkBackend(num_proc=2, env={"HOROVOD_TEST_ESTIMATOR": "yes"})
    assert backend.num_processes() == 2
    assert SparkBackend().num_processes() == estimator_spark.sparkContext.defaultParallelism

    def job():
        import horovod.numpy as hvd

        hvd.init()
        return hvd.rank(), hvd.size(), os.environ.get("HOROVOD_TEST_ESTIMATOR")

    assert backend.run(job) == [(0, 2, "yes"), (1, 2, "yes")]


def test_fit_on_parquet(frame, tmp_path):
    store = LocalStore(str(tmp_path))
    estimator = FakeEstimator(model=W, store=store, backend=RecordingBackend(), feature_cols=["x"],
                              label_cols=["yv", "yd"])
    with pytest.raises(ValueError, match=r"intermediate_train_data path does not exist in the store"):
        estimator.fit_on_parquet()
    frame.select("x", "yv", "yd", "is_val").filter("not is_val").drop("is_val").write.parquet(
        store.spark_path(store.get_train_data_path()))
    frame.select("x", "yv", "yd", "is_val").filter("is_val").drop("is_val").write.parquet(
        store.spark_path(store.get_val_data_path()))
    model = estimator.fit_on_parquet()
    seen = estimator.seen
    assert (seen.train_rows, seen.val_rows) == (45, 15)
    # Spark wrote the vector columns as its vector structs: read as dense arrays, typed as vectors again.
    assert seen.metadata["x"]["shape"] == 2 and seen.metadata["yv"]["spark_data_type"] == "VectorUDT"
    assert (seen.metadata["yd"]["shape"], seen.metadata["yd"]["intermediate_format"]) == (1, "nochange")
    reader = ShardReader(store.filesystem, seen.train_data_path, ["x", "yv"], 0, 1, batch_size=45, shuffle=False)
    batch = next(reader.batches(1))
    np.testing.assert_allclose(batch["yv"], batch["x"] @ W)
    row = model.transform(frame.select("x")).first()
    np.testing.assert_allclose(row["yv__output"].toArray(), row["x"].toArray() @ W)
