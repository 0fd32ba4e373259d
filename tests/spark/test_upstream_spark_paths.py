"""Upstream's horovod.spark module paths used the way upstream user code uses them, on a real local Spark.

``horovod.spark.conf`` against Spark's own configuration registry, ``horovod.spark.common.util.prepare_data``
(dataset index + ``get_dataset_properties``) against the DataFrame's rows read back with pyarrow, the store's
paths against the forms upstream documents (``file://`` URIs, ``<localized>_<host hash>_cached_metadata.pkl``),
and the small helpers against upstream's documented results.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import socket

import numpy as np
import pyarrow.parquet as pq
import pytest

from horovod.spark import conf
from horovod.spark.common import constants, util
from horovod.spark.common.store import AbstractFilesystemStore, FilesystemStore, LocalStore, Store

pytestmark = pytest.mark.timeout(300)


def _spark_default(spark, key):
    """Spark's registered default of ``key`` (its own ConfigEntry), None if Spark does not know the key."""
    entries = getattr(getattr(spark.sparkContext._jvm.org.apache.spark.internal.config, "ConfigEntry$"), "MODULE$")
    entry = entries.findEntry(key)
    return None if entry is None else entry.defaultValueString()


def test_conf_defaults_are_sparks(estimator_spark):
    assert conf.SPARK_CONF_MAX_INT == str(2**31 - 1) and conf.SPARK_CONF_MAX_INT_MINUS_ONE == str(2**31 - 2)
    assert conf.SPARK_CONF_ALWAYS_RESTART_FAILED_TASK == ("spark.task.maxFailures", conf.SPARK_CONF_MAX_INT)
    assert _spark_default(estimator_spark, "spark.task.maxFailures") == conf.SPARK_CONF_DEFAULT_VALUES[
        "spark.task.maxFailures"]
    # Spark 3.1+ registers the blacklist keys as spark.excludeOnFailure.*: same defaults (enabled is unset there)
    checked = 0
    for key, value in conf.SPARK_CONF_DEFAULT_VALUES.items():
        if key.startswith("spark.blacklist.") and key != "spark.blacklist.enabled":
            new_key, _ = conf.exclude_on_failure((key, value))
            assert _spark_default(estimator_spark, new_key) == value, new_key
            checked += 1
    assert checked == 6
    pairs = [v for k, v in vars(conf).items() if k.startswith("SPARK_CONF_") and isinstance(v, tuple)]
    assert len(pairs) == 17 and all(k in conf.SPARK_CONF_DEFAULT_VALUES for k, _ in pairs)


def _frame(spark):
    from pyspark.ml.linalg import Vectors

    rows = [(i, Vectors.dense([float(i), i * 2.0, -i]), i * 0.5, i % 4 == 0) for i in range(40)]
    return spark.createDataFrame(rows, ["id", "x", "y", "is_val"]), rows


def _read(store, path):
    files = sorted(p for p in os.listdir(store.get_localized_path(path)) if p.endswith(".parquet"))
    return pq.read_table([os.path.join(store.get_localized_path(path), f) for f in files]).to_pylist()


def test_prepare_data_yields_an_index_and_its_properties(estimator_spark, tmp_path):
    util.clear_training_cache()
    store = Store.create(str(tmp_path / "store"))
    df, rows = _frame(estimator_spark)
    with util.prepare_data(2, store, df, label_columns=["y"], feature_columns=["x"], validation="is_val",
                           partitions_per_process=1) as idx:
        assert isinstance(idx, int)
        train_rows, val_rows, metadata, avg_row_size = util.get_dataset_properties(idx)
        train = _read(store, store.get_train_data_path(idx))
        val = _read(store, store.get_val_data_path(idx))
    expected_train = sorted((list(r[1]), r[2]) for r in rows if not r[3])
    expected_val = sorted((list(r[1]), r[2]) for r in rows if r[3])
    assert sorted((r["x"], r["y"]) for r in train) == expected_train  # vectors stored as lists, as upstream
    assert sorted((r["x"], r["y"]) for r in val) == expected_val
    assert set(train[0]) == {"x", "y"}  # only the feature and label columns (the validation column dropped)
    assert (train_rows, val_rows) == (30, 10)
    assert metadata["x"]["shape"] == 3 and metadata["x"]["intermediate_format"] == constants.ARRAY
    assert metadata["y"]["shape"] == 1 and metadata["y"]["intermediate_format"] == constants.NOCHANGE
    footers = [pq.ParquetFile(os.path.join(store.get_localized_path(store.get_train_data_path(idx)), f)).metadata
               for f in os.listdir(store.get_localized_path(store.get_train_data_path(idx))) if f.endswith(".parquet")]
    size = sum(m.row_group(i).total_byte_size for m in footers for i in range(m.num_row_groups))
    assert avg_row_size == pytest.approx(size / 30)
    # get_simple_meta_from_parquet (fit_on_parquet's view) agrees on the rows
    simple = util.get_simple_meta_from_parquet(store, ["y"], ["x"], None, idx)
    assert simple[:2] == (30, 10) and simple[2]["x"]["shape"] == 3
    # the same DataFrame again: the same index, the data not rewritten
    with util.prepare_data(2, store, df, label_columns=["y"], feature_columns=["x"], validation="is_val",
                           partitions_per_process=1) as again:
        assert again == idx
    util.clear_training_cache()
    with pytest.raises(KeyError, match="not prepared"):
        util.get_dataset_properties(idx)


def test_prepare_data_checks_like_upstream(estimator_spark, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    df, _ = _frame(estimator_spark)
    with pytest.raises(ValueError, match="Validation column nope does not exist in the DataFrame"):
        with util.prepare_data(2, store, df, ["y"], ["x"], validation="nope"):
            pass
    with pytest.raises(ValueError, match=r"must be in the range: \[0, 1\)"):
        with util.prepare_data(2, store, df, ["y"], ["x"], validation=1.5):
            pass
    with pytest.raises(ValueError, match="partitions_per_process=0 must both be > 0"):
        with util.prepare_data(2, store, df, ["y"], ["x"], partitions_per_process=0):
            pass


def test_store_paths_are_upstreams(tmp_path):
    prefix = str(tmp_path / "store")
    uri = pathlib.Path(prefix).as_uri()
    for store in (Store.create(prefix), FilesystemStore(prefix), LocalStore(uri)):
        assert isinstance(store, AbstractFilesystemStore)
        assert store.prefix_path == uri
        assert store.get_train_data_path(1) == f"{uri}/intermediate_train_data.1"
        assert store.get_run_path("r") == f"{uri}/runs/r"
        assert store.get_logs_path("r") == f"{uri}/runs/r/logs"
        assert store.get_full_path(prefix) == uri and store.get_localized_path(uri) == prefix
        assert store.get_filesystem() is store.fs
    store = Store.create(prefix)
    meta = store.get_data_metadata_path(store.get_train_data_path(0) + "/")
    short = socket.gethostname().split(".")[0]
    assert re.fullmatch(re.escape(f"{prefix}/intermediate_train_data.0_{short}-") + r"[0-9a-f]{32}"
                        + re.escape("_cached_metadata.pkl"), meta), meta
    store.write_text(store.get_checkpoint_path("r"), "x")  # a URI path reads and writes like upstream's
    assert os.path.exists(os.path.join(prefix, "runs", "r", "checkpoint")) and store.read(
        store.get_checkpoint_path("r")) == b"x"


def test_runner_module_has_both_launchers():
    import horovod.spark
    from horovod.spark import runner

    assert runner.run_elastic.__module__ == "horovod.spark.elastic"  # the implementation horovod.spark uses
    assert list(inspect.signature(runner.run_elastic).parameters) == [
        "fn", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "start_timeout", "elastic_timeout",
        "reset_limit", "env", "stdout", "stderr", "verbose", "nics", "prefix_output_with_timestamp", "min_np",
        "max_np"]  # upstream's signature (HOROVOD_SPEC_SPARK_RAY.md section 1)
    assert callable(horovod.spark.run_elastic)


def test_helpers_match_upstream():
    from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT
    from pyspark.sql.types import BooleanType, DoubleType, FloatType, IntegerType, LongType, StringType

    assert util.to_list(None, 3) is None
    assert util.to_list("mse", 3) == ["mse"] * 3 and util.to_list(["mse"], 2) == ["mse", "mse"]
    assert util.to_list([1, 2], 2) == [1, 2]
    with pytest.raises(ValueError, match="must be a list with length that matches the length of label_cols"):
        util.to_list([1, 2], 3)
    util.check_validation(None)
    util.check_validation(0.2)
    with pytest.raises(ValueError, match="must be of type"):
        util.check_validation([0.2])

    meta = {"x": {"shape": 6}, "y": {"shape": 1}, "p": {"shape": None}}
    util.check_shape_compatibility(meta, ["x"], ["y"], input_shapes=[[-1, 2, 3]], output_shapes=[[-1, 1]])
    util.check_shape_compatibility(meta, ["p"], ["y"], input_shapes=[[5]])  # no shape known: not checked
    with pytest.raises(ValueError, match="Feature column 'x' with size 6 must equal that of the model input at "
                                         "index 0 with size 5"):
        util.check_shape_compatibility(meta, ["x"], ["y"], input_shapes=[[5]])
    with pytest.raises(ValueError, match="Label column count 1 must equal model outputs count 2"):
        util.check_shape_compatibility(meta, ["x"], ["y"], output_shapes=[[1], [1]])

    assert [util.data_type_to_str(t) for t in (VectorUDT, DenseVector, IntegerType, LongType, FloatType,
                                               DoubleType, BooleanType, StringType)] == [
        "Vector", "Vector", "Int", "Long", "Float", "Double", "Boolean", "String"]
    assert util.data_type_to_numpy(SparseVector) is np.float64 and util.data_type_to_numpy(IntegerType) is np.int32
    assert util.numpy_type_to_str(np.float32) == "Float" and util.numpy_type_to_str(np.int64) == "Long"
    assert util.spark_scalar_to_python_type(LongType) is int and util.spark_scalar_to_python_type(BooleanType) is bool
    with pytest.raises(ValueError, match="Unrecognized data type"):
        util.data_type_to_str(object)
    import pyarrow as pa

    assert util.pyarrow_to_spark_data_type(pa.list_(pa.float64())) is DenseVector
    assert util.pyarrow_to_spark_data_type(pa.float32()) is FloatType
    assert util.host_hash() == util.host_hash() and util.is_databricks() == ("DATABRICKS_RUNTIME_VERSION" in
                                                                             os.environ)
