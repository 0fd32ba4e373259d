"""The framework-free halves of Horovod's Spark estimators: ``HorovodEstimator.fit`` and ``HorovodModel.transform``.

How a framework's estimator uses it (``horovod.spark.torch``, ``horovod.spark.keras``, ``horovod.spark.lightning``)::

    class TorchEstimator(HorovodEstimator):
        _run_id_prefix = "pytorch"
        def _fit_on_prepared_data(self, backend, dataset):      # dataset: common.data.Dataset
            run_id = self._resolve_run_id()
            remote_store = self.getStore().to_remote(run_id, dataset.dataset_idx)
            results = backend.run(train_fn, args=(...,))     # the workers read with common.reader
            return TorchModel(history=..., model=..., feature_columns=..., label_columns=..., run_id=run_id,
                              _metadata=dataset.metadata)

    class TorchModel(HorovodModel):
        def _predict_fn(self):        # picklable: {feature column: numpy batch} -> one numpy array per output
            ...

``fit(df)`` checks the parameters, materialises ``df`` in the store (:func:`~horovod.spark.common.data.prepare_data`)
and calls ``_fit_on_prepared_data``; ``fit_on_parquet()`` does the same with Parquet data already in the store.
``transform(df)`` runs ``_predict_fn()`` over the rows in ``mapPartitions`` (batches of ``TRANSFORM_BATCH`` rows)
and appends one column per label, typed like the label (vectors stay vectors, sparse ones when every row of the
label was a ``SparseVector``; a vector prediction of a scalar label is a ``DenseVector``).  ``save(path)`` /
``Class.load(path)`` persist a returned model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLWritable

from horovod.spark.common import serialization
from horovod.spark.common.backend import Backend, SparkBackend
from horovod.spark.common.data import Dataset, dataset_from_parquet, prepare_data
from horovod.spark.common.params import EstimatorParams, ModelParams

__all__ = ["HorovodEstimator", "HorovodModel", "TRANSFORM_BATCH"]

logger = logging.getLogger("horovod.spark")

TRANSFORM_BATCH = 1024
"""Rows per call of the model in ``transform`` (per Spark partition)."""


class _Persistence(MLWritable, MLReadable):
    """Spark ML persistence of models and estimators (serialization.py has the layout): ``save(path)``,
    ``write().overwrite().save(path)``, ``Class.load(path)``, ``Class.read().load(path)``."""

    def _encode_param(self, name: str, value: Any) -> str:
        return serialization.dumps_b64(value)

    @classmethod
    def _decode_param(cls, name: str, text: str) -> Any:
        return serialization.loads_b64(text)

    def write(self) -> serialization.HorovodParamsWriter:
        """A Spark ML writer of this object (``.overwrite()`` to replace an existing path)."""
        return serialization.HorovodParamsWriter(self)

    def save(self, path: str) -> None:
        """Write the parameters (the model among them; not backend or store) to ``path`` (local path or fsspec
        URL), which must not exist (``write().overwrite().save(path)`` replaces it)."""
        self.write().save(path)

    @classmethod
    def read(cls) -> serialization.HorovodParamsReader:
        return serialization.HorovodParamsReader(cls)

    @classmethod
    def load(cls, path: str) -> Any:
        """What :meth:`save` wrote at ``path`` (unpickles: only load files you trust)."""
        return cls.read().load(path)


class HorovodEstimator(Estimator, EstimatorParams, _Persistence):
    """A pyspark.ml ``Estimator`` training with Horovod; subclasses implement ``_fit_on_prepared_data``."""

    _run_id_prefix = "horovod"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(**self._extra_defaults())
        self.setParams(**kwargs)

    def _extra_defaults(self) -> dict[str, Any]:
        """Defaults of the framework's own parameters."""
        return {}

    def fit(self, df: Any, params: dict | None = None) -> HorovodModel:
        """Train on the DataFrame ``df``; return the trained model as a Spark ML ``Model``."""
        return super().fit(df, params)

    def fit_on_parquet(self, params: dict | None = None, dataset_idx: int | None = None) -> HorovodModel:
        """Train on Parquet data already at the store's train (and val) paths (``get_train_data_path(idx)``)."""
        estimator = self.copy(params) if params else self
        return estimator._fit_on_parquet(dataset_idx)

    def _fit_on_parquet(self, dataset_idx: int | None) -> HorovodModel:
        backend = self._get_or_create_backend()
        self._check_params()
        dataset = dataset_from_parquet(self.getStore(), self.getLabelCols(), self.getFeatureCols(),
                                       self.getSampleWeightCol(), dataset_idx)
        self._check_metadata_compatibility(dataset)
        return self._fit_on_prepared_data(backend, dataset)

    def _fit(self, df: Any) -> HorovodModel:
        backend = self._get_or_create_backend()
        self._check_params()
        with prepare_data(backend.num_processes(), self.getStore(), df, label_columns=self.getLabelCols(),
                          feature_columns=self.getFeatureCols(), validation=self.getValidation(),
                          sample_weight_col=self.getSampleWeightCol(), compress_sparse=self.getCompressSparseCols(),
                          partitions_per_process=self.getPartitionsPerProcess(), verbose=self.getVerbose(),
                          random_seed=self.getRandomSeed()) as dataset:
            self._check_metadata_compatibility(dataset)
            return self._fit_on_prepared_data(backend, dataset)

    def _fit_on_prepared_data(self, backend: Backend, dataset: Dataset) -> HorovodModel:
        """Train on ``dataset`` with ``backend``; return the model (the framework's part)."""
        raise NotImplementedError()

    def _check_params(self) -> None:
        """Upstream's checks before any data is written (subclasses add theirs)."""
        if self.getModel() is None:
            raise ValueError("Model parameter is required")
        if self.getStore() is None:
            raise ValueError("Store parameter is required (e.g. store=Store.create('/shared/path'))")
        for name, minimum in (("batch_size", 1), ("val_batch_size", 1), ("epochs", 0),
                              ("train_steps_per_epoch", 1), ("validation_steps_per_epoch", 1)):
            value = self.getOrDefault(name) if self.hasParam(name) else None
            if value is not None and value < minimum:  # found by the workers only after the data is written
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if self.getShufflingBufferSize() is not None:
            logger.warning("horovod.spark: shuffle_buffer_size is deprecated and ignored; each rank shuffles its "
                           "shard every epoch (shuffle=True)")

    def _check_metadata_compatibility(self, dataset: Dataset) -> None:
        """Checks of the data against the model (subclasses: shapes against inputs and outputs)."""
        if not self.getFeatureCols():
            self._set(feature_cols=list(dataset.feature_columns))

    def _get_or_create_backend(self) -> Backend:
        backend = self.getBackend()
        if backend is None:
            return SparkBackend(self.getNumProc(), verbose=self.getVerbose())
        if self.getNumProc() is not None:
            raise ValueError('At most one of parameters "backend" and "num_proc" may be specified')
        return backend

    def _resolve_run_id(self) -> str:
        """The run's ID: the ``run_id`` parameter, else ``<framework>_<unix time>`` (upstream's default)."""
        return self.getRunId() or f"{self._run_id_prefix}_{int(time.time())}"

    def _read_checkpoint(self, run_id: str) -> bytes | None:
        """The bytes of ``run_id``'s checkpoint in the store (the run resumes from them), None without one."""
        if not self._has_checkpoint(run_id):
            return None
        store = self.getStore()
        logger.info("horovod.spark: resuming run %s from its checkpoint", run_id)
        return store.read(store.get_checkpoint_path(run_id))

    def _has_checkpoint(self, run_id: str) -> bool:
        """Whether the store holds a checkpoint of ``run_id`` (``fit`` then resumes from it)."""
        store = self.getStore()
        path = store.get_checkpoint_path(run_id)
        return path is not None and store.exists(path)


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "toArray"):
        return value.toArray()
    return np.asarray(value)


def _label_type(meta: dict[str, Any] | None) -> Any:
    from pyspark.sql.types import _parse_datatype_json_string

    if meta and meta.get("spark_type_json"):
        return _parse_datatype_json_string(meta["spark_type_json"])
    return None


def _output_converter(label_type: Any, vector_prediction: bool, sparse: bool = False
                      ) -> tuple[Any, Callable[[np.ndarray], Any]]:
    """The output column's Spark type and the function turning one row's prediction into its value (``sparse``:
    the label's rows were all SparseVectors, so are the predictions: their non-zero values, as upstream)."""
    from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT
    from pyspark.sql import types as T

    if isinstance(label_type, VectorUDT) and sparse:
        def to_sparse(p: np.ndarray) -> SparseVector:
            values = np.asarray(p, dtype=np.float64).reshape(-1)
            nonzero = values.nonzero()[0]
            return SparseVector(len(values), nonzero, values[nonzero])

        return VectorUDT(), to_sparse
    if isinstance(label_type, VectorUDT) or (vector_prediction and not isinstance(label_type, T.ArrayType)):
        return VectorUDT(), lambda p: DenseVector(np.asarray(p, dtype=np.float64).reshape(-1))
    if isinstance(label_type, T.ArrayType):
        element = label_type.elementType
        cast = _scalar_cast(element)
        return T.ArrayType(element, True), lambda p: [cast(v) for v in np.asarray(p).reshape(-1)]
    if label_type is None:
        label_type = T.DoubleType()
    cast = _scalar_cast(label_type)
    return label_type, lambda p: cast(np.asarray(p).reshape(-1)[0])


def _scalar_cast(spark_type: Any) -> Callable[[Any], Any]:
    from pyspark.sql import types as T

    if isinstance(spark_type, T.BooleanType):
        return lambda v: bool(round(float(v)))
    if isinstance(spark_type, (T.IntegerType, T.LongType, T.ShortType, T.ByteType)):
        return lambda v: int(round(float(v)))
    return float


class HorovodModel(Model, ModelParams, _Persistence):
    """A trained model as a pyspark.ml ``Model``; subclasses implement ``_predict_fn``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        labels = kwargs.get("label_columns") or []
        self._setDefault(outputCols=[f"{label}__output" for label in labels], history=None, run_id=None,
                         _metadata=None)
        self.setParams(**kwargs)

    def _predict_fn(self) -> Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]:
        """A picklable function: {feature column: batch array} -> one array of predictions per label."""
        raise NotImplementedError()

    def transform(self, df: Any, params: dict | None = None) -> Any:
        """``df`` with a prediction column per label (``getOutputCols()``, default ``<label>__output``)."""
        return super().transform(df, params)

    def _transform(self, df: Any) -> Any:
        from pyspark.sql.types import StructField, StructType

        features, labels = list(self.getFeatureColumns()), list(self.getLabelColumns())
        outputs = list(self.getOutputCols())
        if len(outputs) != len(labels):
            raise ValueError(f"{len(outputs)} output columns {outputs} for {len(labels)} label columns {labels}")
        clash = [c for c in outputs if c in df.columns]
        if clash:
            raise ValueError(f"Output column(s) {clash} already exist in the DataFrame; choose others with "
                             f"setOutputCols")
        missing = [c for c in features if c not in df.columns]
        if missing:
            raise ValueError(f"Feature column(s) {missing} not found in the DataFrame (its columns: {df.columns})")
        predict = self._predict_fn()
        metadata = self._get_metadata() or {}
        batch = self._probe_batch(df, features, metadata)
        probe = predict(batch) if batch is not None else [np.zeros((1, 1))] * len(labels)
        vector = [np.asarray(p).reshape(len(np.asarray(p)), -1).shape[1] > 1 for p in probe]
        converters = [_output_converter(_label_type(metadata.get(label)), vec,
                                        bool((metadata.get(label) or {}).get("is_sparse_vector_only")))
                      for label, vec in zip(labels, vector)]
        schema = StructType(list(df.schema.fields) + [StructField(out, kind, True)
                                                      for out, (kind, _) in zip(outputs, converters)])
        positions = [df.columns.index(c) for c in features]
        convert = [fn for _, fn in converters]

        def flush(rows: list[Any]) -> list[tuple]:
            batch = {c: np.stack([_as_numpy(r[i]) for r in rows]) for c, i in zip(features, positions)}
            predictions = [np.asarray(p) for p in predict(batch)]
            return [tuple(row) + tuple(fn(p[j]) for fn, p in zip(convert, predictions)) for j, row in enumerate(rows)]

        def partition(rows: Any) -> Any:
            buffer = []
            for row in rows:
                buffer.append(row)
                if len(buffer) == TRANSFORM_BATCH:
                    yield from flush(buffer)
                    buffer = []
            if buffer:
                yield from flush(buffer)

        return df.sparkSession.createDataFrame(df.rdd.mapPartitions(partition), schema)

    @staticmethod
    def _probe_batch(df: Any, features: Sequence[str], metadata: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """One row of zeros shaped as the training data (no Spark job), else the DataFrame's first row (None:
        empty); the model's answer to it tells which outputs are vectors."""
        if all(c in metadata for c in features):
            return {c: np.zeros((1, int(metadata[c]["shape"])) if metadata[c]["intermediate_format"] == "array"
                                else (1,), dtype=metadata[c]["dtype"] if metadata[c]["dtype"] != "object" else None)
                    for c in features}
        first = df.select(*features).first()
        if first is None:
            return None
        return {c: np.stack([_as_numpy(first[c])]) for c in features}
