"""Upstream's ``horovod.spark.common.util``: ``prepare_data`` and the helpers user code and custom estimators import.

Adapter over :mod:`horovod.spark.common.data`: upstream's :func:`prepare_data` yields a *dataset index* and
:func:`get_dataset_properties` maps the index to ``(train_rows, val_rows, metadata, avg_row_size)``; ours yields
a :class:`~horovod.spark.common.data.Dataset` holding the same facts.  This module keeps upstream's calling
convention on top of it (the ``Dataset`` of every index prepared in this driver is remembered here)::

    with util.prepare_data(num_proc, store, df, label_columns=["y"], feature_columns=["x"]) as idx:
        train_rows, val_rows, metadata, avg_row_size = util.get_dataset_properties(idx)
        path = store.get_train_data_path(idx)              # Parquet, readable by any Parquet reader

Differences from upstream (docs/compatibility.md): ``metadata[col]["spark_data_type"]`` is the Spark type's
*name* (``"DoubleType"``, ``"VectorUDT"``), not the class; vectors are stored as ``array<double>`` (the
``intermediate_format`` is ``"array"``, never ``"custom_sparse_format"``: ``compress_sparse`` is ignored).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from horovod.spark.common import data as _data
from horovod.spark.common import params as _params
from horovod.spark.common.store import Store
from horovod.spark.task import host_hash

__all__ = ["prepare_data", "get_dataset_properties", "clear_training_cache", "get_simple_meta_from_parquet",
           "check_validation", "check_shape_compatibility", "to_list", "is_databricks", "host_hash",
           "data_type_to_str", "data_type_to_numpy", "numpy_type_to_str", "spark_scalar_to_python_type",
           "pyarrow_to_spark_data_type"]

_datasets: dict[int, _data.Dataset] = {}  # dataset index -> what prepare_data wrote there (this driver)


@contextlib.contextmanager
def prepare_data(num_processes: int, store: Store, df: Any, label_columns: Sequence[str] | None,
                 feature_columns: Sequence[str] | None, validation: float | str | None = None,
                 sample_weight_col: str | None = None, compress_sparse: bool = False,
                 partitions_per_process: int = 10, verbose: int = 0) -> Iterator[int]:
    """Write ``df`` as Parquet at ``store.get_{train,val}_data_path(idx)`` (once per DataFrame) and yield ``idx``.

    The index stays reserved for this DataFrame until the block ends (another ``prepare_data`` meanwhile takes
    another index).  ``feature_columns=None``: every column but the labels, the weight and a validation column.

    Raises:
        ValueError: no label columns, a missing column, a bad ``validation``, ``num_processes`` or
            ``partitions_per_process`` < 1, vectors of different sizes in a column, no rows.
    """
    if partitions_per_process <= 0:
        raise ValueError(f"num_proc={num_processes} and partitions_per_process={partitions_per_process} must both "
                         f"be > 0")
    check_validation(validation, df=df)
    with _data.prepare_data(num_processes, store, df, label_columns=label_columns, feature_columns=feature_columns,
                            validation=validation, sample_weight_col=sample_weight_col,
                            compress_sparse=compress_sparse, partitions_per_process=partitions_per_process,
                            verbose=verbose) as dataset:
        _datasets[dataset.dataset_idx] = dataset
        yield dataset.dataset_idx


def get_dataset_properties(dataset_idx: int) -> tuple[int, int, dict[str, dict[str, Any]], float]:
    """``(train_rows, val_rows, metadata, avg_row_size)`` of the data :func:`prepare_data` wrote at ``dataset_idx``.

    Raises:
        KeyError: no ``prepare_data`` of this driver wrote that index (or :func:`clear_training_cache` forgot it).
    """
    try:
        d = _datasets[dataset_idx]
    except KeyError:
        raise KeyError(f"dataset index {dataset_idx!r} was not prepared by prepare_data in this driver "
                       f"(prepared: {sorted(_datasets)})") from None
    return d.train_rows, d.val_rows, d.metadata, d.avg_row_size


def clear_training_cache() -> None:
    """Forget every prepared DataFrame: the next ``prepare_data`` writes its data again (files stay until then)."""
    _data.clear_cache()
    _datasets.clear()


def get_simple_meta_from_parquet(store: Store, label_columns: Sequence[str], feature_columns: Sequence[str],
                                 sample_weight_col: str | None, dataset_idx: int | None = None
                                 ) -> tuple[int, int, dict[str, dict[str, Any]], float]:
    """``(train_rows, val_rows, metadata, avg_row_size)`` of Parquet data already at the store's train (and val)
    paths, as ``fit_on_parquet`` sees it.

    Raises:
        ValueError: ``"<path> path does not exist in the store"``, missing columns, no rows.
    """
    d = _data.dataset_from_parquet(store, label_columns, feature_columns, sample_weight_col, dataset_idx)
    return d.train_rows, d.val_rows, d.metadata, d.avg_row_size


def check_validation(validation: Any, df: Any = None) -> None:
    """``validation`` must be None, a fraction in [0, 1) or a column name (of ``df``, when given).

    Raises:
        ValueError: with upstream's texts.
    """
    _params.check_validation(validation)
    if isinstance(validation, str) and df is not None and validation not in df.columns:
        raise ValueError(f"Validation column {validation} does not exist in the DataFrame")


def _size(shape: Any) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return abs(size)


def check_shape_compatibility(metadata: dict[str, dict[str, Any]], feature_columns: Sequence[str],
                              label_columns: Sequence[str], input_shapes: Sequence[Any] | None = None,
                              output_shapes: Sequence[Any] | None = None,
                              label_shapes: Sequence[Any] | None = None) -> None:
    """The columns fit the model: one feature column per input of the same flattened size (``-1`` dimensions
    count as 1), one label column per label shape (else per output) of the same size.  A column whose
    ``shape`` is None (data from ``fit_on_parquet``) is not checked.

    Raises:
        ValueError: naming the column and both sizes (upstream's texts).
    """
    def check(kind: str, columns: Sequence[str], shapes: Sequence[Any], what: str) -> None:
        if len(columns) != len(shapes):
            raise ValueError(f"{kind} column count {len(columns)} must equal model {what}s count {len(shapes)}")
        for idx, (col, shape) in enumerate(zip(columns, shapes)):
            col_size = metadata[col]["shape"]
            if col_size is not None and col_size != _size(shape):
                raise ValueError(f"{kind} column '{col}' with size {col_size} must equal that of the model {what} "
                                 f"at index {idx} with size {_size(shape)}")

    if input_shapes is not None:
        check("Feature", feature_columns, input_shapes, "input")
    if label_shapes is not None:
        check("Label", label_columns, label_shapes, "label_shape")
    elif output_shapes is not None:
        check("Label", label_columns, output_shapes, "output")


def to_list(var: Any, length: int) -> list | None:
    """``var`` as a list of ``length`` items: None stays None, one item (or a one-item list) is repeated.

    Raises:
        ValueError: a list of another length.
    """
    if var is None:
        return None
    items = var if isinstance(var, list) else [var]
    if len(items) == 1:
        return items * length
    if len(items) != length:
        raise ValueError("loss_constructors and loss functions must be a list with length that matches the length "
                         "of label_cols")
    return items


def is_databricks() -> bool:
    """Running on Databricks (``DATABRICKS_RUNTIME_VERSION`` set)."""
    return "DATABRICKS_RUNTIME_VERSION" in os.environ


# --- Spark / numpy / Arrow type names (upstream's helpers; they take Spark type *classes*) ---------------------

def _spark_types() -> dict[str, tuple[str, str, type]]:
    """Spark type class name -> (upstream's short name, numpy dtype, Python type)."""
    return {"IntegerType": ("Int", "int32", int), "LongType": ("Long", "int64", int),
            "FloatType": ("Float", "float32", float), "DoubleType": ("Double", "float64", float),
            "BooleanType": ("Boolean", "bool", bool), "StringType": ("String", "uint8", str),
            "BinaryType": ("Binary", "uint8", bytes)}


def _type_name(dtype: Any) -> str:
    return dtype.__name__ if isinstance(dtype, type) else type(dtype).__name__


def data_type_to_str(dtype: Any) -> str:
    """``'Vector'``, ``'Int'``, ``'Long'``, ``'Float'``, ``'Double'``, ``'Boolean'``, ``'String'``, ``'Binary'``."""
    name = _type_name(dtype)
    if name in ("VectorUDT", "SparseVector", "DenseVector"):
        return "Vector"
    if name not in _spark_types():
        raise ValueError(f"Unrecognized data type: {dtype}")
    return _spark_types()[name][0]


def data_type_to_numpy(dtype: Any) -> Any:
    """The numpy dtype of a Spark type's values (vectors and arrays: float64; strings: uint8, as upstream)."""
    import numpy as np

    name = _type_name(dtype)
    if name in ("VectorUDT", "SparseVector", "DenseVector", "ArrayType"):
        return np.float64
    if name not in _spark_types():
        raise ValueError(f"Unrecognized data type: {dtype}")
    return getattr(np, _spark_types()[name][1]) if name != "BooleanType" else np.bool_


def numpy_type_to_str(dtype: Any) -> str:
    """Upstream's short Spark name of a numpy dtype (``np.float32`` -> ``'Float'``, ``np.uint8`` -> ``'Binary'``)."""
    import numpy as np

    names = {np.dtype("int32"): "Int", np.dtype("float32"): "Float", np.dtype("uint8"): "Binary",
             np.dtype("float64"): "Double", np.dtype("int64"): "Long", np.dtype("bool"): "Boolean"}
    try:
        return names[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"Cannot convert numpy data type to Spark string: {dtype}") from None


def spark_scalar_to_python_type(dtype: Any) -> type:
    """The Python type of a scalar Spark type's values (``IntegerType`` -> ``int`` ...)."""
    name = _type_name(dtype)
    if name not in _spark_types():
        raise ValueError(f"cannot convert Spark data Type {dtype} to native python type")
    return _spark_types()[name][2]


def pyarrow_to_spark_data_type(dtype: Any) -> type:
    """The Spark type class of an Arrow type; Arrow lists are ``DenseVector`` (ML features, as upstream)."""
    import pyarrow as pa
    from pyspark.ml.linalg import DenseVector

    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype):
        return DenseVector
    try:
        from pyspark.sql.pandas.types import from_arrow_type
    except ImportError:  # pyspark < 3
        from pyspark.sql.types import from_arrow_type
    return type(from_arrow_type(dtype))
