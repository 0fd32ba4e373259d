"""The driver's half of an estimator's data: a Spark DataFrame written once as Parquet in the store, and its metadata.

How an estimator uses it (``HorovodEstimator._fit``)::

    with prepare_data(num_proc, store, df, label_columns=..., feature_columns=..., validation=...) as dataset:
        model = self._fit_on_prepared_data(backend, dataset)      # dataset: a picklable Dataset

:func:`prepare_data` keeps the feature, label and sample-weight columns, turns ``VectorUDT`` columns into
fixed-size ``array<double>`` columns (every row must have the same size), splits off the validation rows (a
fraction: a seeded ``randomSplit``; a column: rows where it is true / > 0), and has Spark write
``intermediate_{train,val}_data.<idx>`` with ``num_proc * partitions_per_process`` files at most (coalesced, never
shuffled into more).  The row counts
and byte sizes come from the Parquet footers; the per-column metadata (Spark type, flattened size, numpy dtype)
is written beside the data as JSON.  A second ``fit`` of the same DataFrame (same plan, columns and split) in
this driver reuses the files while they exist; a new one takes the lowest index no running fit holds.

:func:`dataset_from_parquet` describes Parquet data already in the store (``fit_on_parquet``).  The workers
read their shards with :mod:`horovod.spark.common.reader`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from horovod.spark.common.constants import ARRAY as ARRAY_FORMAT
from horovod.spark.common.constants import NOCHANGE as NOCHANGE_FORMAT
from horovod.spark.common.params import check_validation
from horovod.spark.common.store import Store

__all__ = ["Dataset", "prepare_data", "dataset_from_parquet", "clear_cache"]

logger = logging.getLogger("horovod.spark")


@dataclass
class Dataset:
    """Prepared data as the estimators and workers see it: where it is, how many rows, what each column holds.

    ``metadata[col]`` = ``{"spark_data_type": type name, "spark_type_json": Spark's JSON of the type (None when
    unknown), "shape": flattened size (1 for scalars), "dtype": numpy dtype of the values, "intermediate_format":
    "array" (vector or array column, stored as a list) or "nochange", "max_size": same as shape}``; a vector
    label column also has ``"is_sparse_vector_only"`` (every row a ``SparseVector``: its predictions are sparse).
    """

    train_data_path: str
    val_data_path: str | None
    train_rows: int
    val_rows: int
    metadata: dict[str, dict[str, Any]]
    avg_row_size: float
    dataset_idx: int | None = None
    feature_columns: list[str] = field(default_factory=list)
    label_columns: list[str] = field(default_factory=list)
    sample_weight_col: str | None = None


_cache_lock = threading.Lock()
_cache: dict[tuple, int] = {}      # key of a prepared DataFrame -> its dataset index
_in_use: dict[int, int] = {}       # dataset index -> number of running fits holding it


def clear_cache() -> None:
    """Forget which DataFrames were prepared (their files stay until overwritten)."""
    with _cache_lock:
        _cache.clear()


@contextlib.contextmanager
def _hold_index(key: tuple) -> Iterator[tuple[int, bool]]:
    """The dataset index for ``key`` and whether its files may be reused; held until the block ends."""
    with _cache_lock:
        idx = _cache.get(key)
        reuse = idx is not None
        if idx is None:
            idx = 0
            while _in_use.get(idx):
                idx += 1
            for other, other_idx in list(_cache.items()):
                if other_idx == idx:
                    del _cache[other]  # its files are about to be overwritten
        _in_use[idx] = _in_use.get(idx, 0) + 1
    try:
        yield idx, reuse
    except BaseException:
        with _cache_lock:
            _cache.pop(key, None)
        raise
    else:
        with _cache_lock:
            _cache[key] = idx
    finally:
        with _cache_lock:
            _in_use[idx] -= 1


def _check_columns(df: Any, label_columns: Sequence[str] | None, feature_columns: Sequence[str] | None,
                   validation: Any, sample_weight_col: str | None) -> tuple[list[str], list[str]]:
    if not label_columns:
        raise ValueError("Parameter label_cols is required: the DataFrame's label column name(s)")
    check_validation(validation)
    labels = list(label_columns)
    extra = [c for c in (sample_weight_col, validation if isinstance(validation, str) else None) if c]
    features = list(feature_columns) if feature_columns else [c for c in df.columns
                                                                  if c not in labels and c not in extra]
    missing = [c for c in features + labels + extra if c not in df.columns]
    if missing:
        raise ValueError(f"Column(s) {missing} not found in the DataFrame (its columns: {df.columns})")
    return features, labels


def _column_metadata(df: Any, columns: Sequence[str], sparse_check: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Per column: Spark type, numpy dtype, flattened size (one aggregation pass for vector/array columns) and,
    for the vector columns in ``sparse_check`` (the labels), whether every row is a ``SparseVector``."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType

    sized = [c for c in columns if isinstance(df.schema[c].dataType, (VectorUDT, ArrayType))]
    sizes: dict[str, tuple[int, int]] = {}
    sparse_only: dict[str, bool] = {}
    if sized:
        exprs = []
        for c in sized:
            col = vector_to_array(F.col(c)) if isinstance(df.schema[c].dataType, VectorUDT) else F.col(c)
            exprs += [F.min(F.size(col)).alias(f"min_{len(exprs)}"), F.max(F.size(col)).alias(f"max_{len(exprs)}")]
        # A vector's "type" is 0 for sparse, 1 for dense (VectorUDT's SQL struct, reached through its JSON):
        # predictions of a label whose rows are all sparse are SparseVectors, as upstream's.
        vectors = [c for c in sized if c in sparse_check and isinstance(df.schema[c].dataType, VectorUDT)]
        exprs += [F.max(F.get_json_object(F.to_json(F.struct(F.col(c).alias("v"))), "$.v.type").cast("int"))
                  .alias(f"dense_{i}") for i, c in enumerate(vectors)]
        row = df.agg(*exprs).first()
        for i, c in enumerate(sized):
            sizes[c] = (int(row[2 * i] if row[2 * i] is not None else 0),
                        int(row[2 * i + 1] if row[2 * i + 1] is not None else 0))
        sparse_only = {c: row[f"dense_{i}"] == 0 for i, c in enumerate(vectors)}
    metadata = {}
    for c in columns:
        dtype = df.schema[c].dataType
        if c in sizes:
            low, high = sizes[c]
            if low != high:
                raise ValueError(f"Column {c!r} holds vectors/arrays of different sizes ({low} to {high}); every "
                                 f"row of a feature or label column must have the same size")
            element = dtype.elementType if isinstance(dtype, ArrayType) else None
            metadata[c] = {"spark_data_type": type(dtype).__name__, "spark_type_json": dtype.json(),
                           "shape": high, "max_size": high, "intermediate_format": ARRAY_FORMAT,
                           "dtype": _numpy_dtype(element) if element is not None else "float64",
                           "is_sparse_vector_only": sparse_only.get(c, False)}
        else:
            metadata[c] = {"spark_data_type": type(dtype).__name__, "spark_type_json": dtype.json(), "shape": 1,
                           "max_size": 1, "intermediate_format": NOCHANGE_FORMAT, "dtype": _numpy_dtype(dtype)}
    return metadata


def _numpy_dtype(spark_type: Any) -> str:
    return {"FloatType": "float32", "DoubleType": "float64", "IntegerType": "int32", "LongType": "int64",
            "ShortType": "int16", "ByteType": "int8", "BooleanType": "bool"}.get(type(spark_type).__name__, "object")


def _parquet_counts(store: Store, path: str) -> tuple[int, int]:
    """Rows and uncompressed bytes of the Parquet dataset at ``path``, from its footers."""
    import pyarrow.parquet as pq

    rows = size = 0
    for file in store.list_files(path, ".parquet"):
        with store.filesystem.open(file, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        rows += meta.num_rows
        size += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return rows, size


def _to_storable(df: Any, columns: Sequence[str]) -> Any:
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F

    return df.select(*[vector_to_array(F.col(c)).alias(c) if isinstance(df.schema[c].dataType, VectorUDT)
                       else F.col(c) for c in columns])


@contextlib.contextmanager
def prepare_data(num_processes: int, store: Store, df: Any, label_columns: Sequence[str] | None = None,
                 feature_columns: Sequence[str] | None = None, validation: float | str | None = None,
                 sample_weight_col: str | None = None, compress_sparse: bool = False,
                 partitions_per_process: int = 10, verbose: int = 0,
                 random_seed: int | None = None) -> Iterator[Dataset]:
    """Materialise ``df`` as Parquet in ``store`` (once per DataFrame) and yield its :class:`Dataset`.

    Raises:
        ValueError: no label columns, a missing column, a bad ``validation``, vectors of different sizes, no
            training rows, or a validation split that left no validation rows.
    """
    from pyspark.sql import functions as F

    features, labels = _check_columns(df, label_columns, feature_columns, validation, sample_weight_col)
    if num_processes < 1:
        raise ValueError(f"num_proc={num_processes} must be at least 1")
    if compress_sparse:
        logger.warning("horovod.spark: compress_sparse_cols is ignored; sparse vectors are stored dense")
    columns = list(dict.fromkeys(features + labels + ([sample_weight_col] if sample_weight_col else [])))
    key = (store.prefix_path, store.get_train_data_path(), df.semanticHash(), df.schema.json(), tuple(features),
           tuple(labels), sample_weight_col, validation, random_seed)
    with _hold_index(key) as (idx, reuse):
        train_path, val_path = store.get_train_data_path(idx), store.get_val_data_path(idx)
        meta_path = store.get_data_metadata_path(train_path)
        if reuse and store.exists(meta_path):
            dataset = Dataset(**json.loads(store.read_text(meta_path)))
            if verbose:
                logger.info("horovod.spark: reusing the prepared data at %s", train_path)
            yield dataset
            return
        metadata = _column_metadata(df, columns, sparse_check=labels)
        if isinstance(validation, str):
            flag = F.col(validation)
            is_val = flag if dict(df.dtypes)[validation] == "boolean" else flag > 0
            train_df, val_df = df.filter(~F.coalesce(is_val, F.lit(False))), df.filter(F.coalesce(is_val, F.lit(False)))
        elif validation:
            train_df, val_df = df.randomSplit([1.0 - validation, validation], seed=random_seed)
        else:
            train_df, val_df = df, None
        total = max(num_processes * partitions_per_process, num_processes)
        ratio = float(validation) if validation and not isinstance(validation, str) else 0.5 if validation else 0.0
        _write(store, _to_storable(train_df, columns), train_path, max(int(total * (1 - ratio)), num_processes))
        train_rows, train_bytes = _parquet_counts(store, train_path)
        if train_rows == 0:
            raise ValueError("The training DataFrame is empty (after the validation split)")
        val_rows = 0
        if val_df is not None:
            _write(store, _to_storable(val_df, columns), val_path, max(int(total * ratio), num_processes))
            val_rows, _ = _parquet_counts(store, val_path)
            if val_rows == 0:
                raise ValueError(f"Validation {validation!r} left no validation rows; use a larger fraction or "
                                 f"mark some rows in the column")
        else:
            store.delete(val_path)
        dataset = Dataset(train_data_path=train_path, val_data_path=val_path if val_df is not None else None,
                          train_rows=train_rows, val_rows=val_rows, metadata=metadata,
                          avg_row_size=train_bytes / train_rows, dataset_idx=idx, feature_columns=features,
                          label_columns=labels, sample_weight_col=sample_weight_col)
        store.write_text(meta_path, json.dumps(dataset.__dict__))
        if verbose:
            logger.info("horovod.spark: prepared %d training and %d validation rows at %s", train_rows, val_rows,
                        train_path)
        yield dataset


def _write(store: Store, df: Any, path: str, partitions: int) -> None:
    """Write ``df`` as Parquet at ``path`` in at most ``partitions`` files (fewer partitions are not shuffled into
    more: the readers shard by rows, so any number of files gives every rank its rows)."""
    if df.rdd.getNumPartitions() > partitions:
        df = df.coalesce(partitions)
    store.delete(store.get_data_metadata_path(path))
    df.write.mode("overwrite").parquet(store.spark_path(path))


def dataset_from_parquet(store: Store, label_columns: Sequence[str] | None, feature_columns: Sequence[str] | None,
                         sample_weight_col: str | None = None, dataset_idx: int | None = None) -> Dataset:
    """The :class:`Dataset` of Parquet files already at the store's train (and val, if present) paths.

    Column sizes come from the first row of the training data (list and vector columns must have one size);
    vector columns Spark wrote as such (structs) are read as dense arrays.

    Raises:
        ValueError: ``<path> path does not exist in the store`` (upstream's text), missing columns, or no rows.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.ml.linalg import VectorUDT

    from horovod.spark.common.reader import is_vector_struct

    train_path, val_path = store.get_train_data_path(dataset_idx), store.get_val_data_path(dataset_idx)
    if not store.is_parquet_dataset(train_path):
        raise ValueError(f"{train_path} path does not exist in the store")
    if not label_columns or not feature_columns:
        raise ValueError("fit_on_parquet needs feature_cols and label_cols")
    columns = list(dict.fromkeys([*feature_columns, *label_columns, *([sample_weight_col] if sample_weight_col
                                                                       else [])]))
    files = store.list_files(train_path, ".parquet")
    with store.filesystem.open(files[0], "rb") as f:
        parquet = pq.ParquetFile(f)
        schema = parquet.schema_arrow
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise ValueError(f"Column(s) {missing} not found in the Parquet data at {train_path} "
                             f"(its columns: {schema.names})")
        first = parquet.read_row_group(0, columns=columns).slice(0, 1).to_pylist() if parquet.num_row_groups else []
    metadata = {}
    for c in columns:
        kind = schema.field(c).type
        if is_vector_struct(kind):
            value = first[0][c] if first else None
            size = 0 if value is None else int(value["size"]) if value["type"] == 0 else len(value["values"])
            metadata[c] = {"spark_data_type": "VectorUDT", "spark_type_json": VectorUDT().json(), "shape": size,
                           "max_size": size, "intermediate_format": ARRAY_FORMAT, "dtype": "float64"}
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            size = len(first[0][c]) if first and first[0][c] is not None else 0
            metadata[c] = {"spark_data_type": "ArrayType", "spark_type_json": None, "shape": size, "max_size": size,
                           "intermediate_format": ARRAY_FORMAT, "dtype": kind.value_type.to_pandas_dtype().__name__}
        else:
            metadata[c] = {"spark_data_type": str(kind), "spark_type_json": None, "shape": 1, "max_size": 1,
                           "intermediate_format": NOCHANGE_FORMAT, "dtype": kind.to_pandas_dtype().__name__}
    train_rows, train_bytes = _parquet_counts(store, train_path)
    if train_rows == 0:
        raise ValueError(f"{train_path} holds no rows")
    has_val = store.is_parquet_dataset(val_path)
    val_rows = _parquet_counts(store, val_path)[0] if has_val else 0
    return Dataset(train_data_path=train_path, val_data_path=val_path if has_val else None, train_rows=train_rows,
                   val_rows=val_rows, metadata=metadata, avg_row_size=train_bytes / train_rows,
                   dataset_idx=dataset_idx, feature_columns=list(feature_columns), label_columns=list(label_columns),
                   sample_weight_col=sample_weight_col)
