"""The parameters of Horovod's Spark estimators and of the models they return, as pyspark.ml ``Params``.

How an estimator uses it: ``HorovodEstimator`` (:mod:`horovod.spark.common.estimator`) mixes in
:class:`EstimatorParams`; a framework's estimator adds its own ``Param`` objects with :func:`param` and lists
their defaults and accessor names in ``_extra_params()``; every ``Param`` gets upstream's ``get<Name>`` /
``set<Name>`` pair from :func:`add_accessors` (the table below, not a hand-written pair per parameter).  The
returned ``HorovodModel`` mixes in :class:`ModelParams` (``getModel``, ``getHistory``, ``getOutputCols`` ...).
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import HasOutputCols

__all__ = ["EstimatorParams", "ModelParams", "param", "add_accessors", "check_validation"]


def param(name: str, doc: str, converter: Any = None) -> Param:
    """A class-level ``Param`` (pyspark binds it to each instance)."""
    if converter is None:
        return Param(Params._dummy(), name, doc)
    return Param(Params._dummy(), name, doc, typeConverter=converter)


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def add_accessors(cls: type, names: dict[str, str | None]) -> type:
    """Give ``cls`` ``get<Name>``/``set<Name>`` for each param name (``None``: CamelCase of it; else that name).

    The setter returns the instance (pyspark's convention), so calls chain.
    """
    for name, accessor in names.items():
        suffix = accessor or _camel(name)

        def getter(self: Params, _name: str = name) -> Any:
            return self.getOrDefault(self.getParam(_name))

        def setter(self: Params, value: Any, _name: str = name) -> Params:
            return self._set(**{_name: value})

        getter.__name__, setter.__name__ = f"get{suffix}", f"set{suffix}"
        getter.__doc__, setter.__doc__ = f"The value of ``{name}``.", f"Set ``{name}``; returns self."
        for method in (getter, setter):
            if method.__name__ not in cls.__dict__:
                setattr(cls, method.__name__, method)
    return cls


def check_validation(validation: Any) -> None:
    """``validation`` must be None, a fraction in [0, 1) or a column name (upstream's rule and texts)."""
    if validation is None or isinstance(validation, str):
        return
    if isinstance(validation, bool) or not isinstance(validation, (int, float)):
        raise ValueError(f"Param validation must be of type 'float' or 'str', found: {type(validation)}")
    if not 0 <= validation < 1:
        raise ValueError(f"Validation split {validation} must be in the range: [0, 1)")


# name -> (default, doc, type converter, accessor suffix or None for CamelCase)
_ESTIMATOR_PARAMS: dict[str, tuple[Any, str, Any, str | None]] = {
    "num_proc": (None, "number of processes (exclusive with backend)", None, None),
    "backend": (None, "backend running the training function (default: SparkBackend(num_proc))", None, None),
    "store": (None, "store for intermediate data, checkpoints and logs", None, None),
    "model": (None, "model to train", None, None),
    "optimizer": (None, "optimizer", None, None),
    "loss": (None, "loss", None, None),
    "loss_weights": (None, "weights of the losses of several outputs", TypeConverters.toListFloat, None),
    "sample_weight_col": (None, "name of the column of sample weights", TypeConverters.toString, None),
    "metrics": ([], "metrics", None, None),
    "feature_cols": (None, "feature column names", TypeConverters.toListString, None),
    "label_cols": (None, "label column names", TypeConverters.toListString, None),
    "validation": (None, "validation split in [0, 1) or the name of a validation indicator column", None, None),
    "callbacks": ([], "callbacks", None, None),
    "batch_size": (32, "batch size", TypeConverters.toInt, None),
    "val_batch_size": (None, "validation batch size (default: batch_size)", TypeConverters.toInt, None),
    "epochs": (1, "epochs", TypeConverters.toInt, None),
    "train_steps_per_epoch": (None, "training steps (batches) per epoch", TypeConverters.toInt, None),
    "validation_steps_per_epoch": (None, "validation steps (batches) per epoch", TypeConverters.toInt, None),
    "verbose": (1, "verbosity (0 silent)", TypeConverters.toInt, None),
    "gradient_compression": (None, "Horovod gradient compression", None, None),
    "compress_sparse_cols": (False, "accepted for compatibility; sparse vectors are stored dense",
                             TypeConverters.toBoolean, None),
    "random_seed": (None, "random seed of the frameworks and the readers' shuffling", TypeConverters.toInt, None),
    "shuffle_buffer_size": (None, "(deprecated, ignored) shuffling buffer size", TypeConverters.toInt,
                            "ShufflingBufferSize"),
    "shuffle": (True, "whether to shuffle the training rows each epoch", TypeConverters.toBoolean, None),
    "partitions_per_process": (10, "Parquet partitions of the DataFrame per process", TypeConverters.toInt, None),
    "run_id": (None, "ID of the run; a run whose checkpoint exists in the store is resumed",
               TypeConverters.toString, None),
    "transformation_fn": (None, "function applied to every batch (a pandas DataFrame) before training", None, None),
    "train_reader_num_workers": (2, "accepted for compatibility (readers are pyarrow, in the worker)",
                                 TypeConverters.toInt, "TrainReaderNumWorker"),
    "val_reader_num_workers": (2, "accepted for compatibility", TypeConverters.toInt, "ValReaderNumWorker"),
    "reader_pool_type": ("thread", "accepted for compatibility", None, None),
    "label_shapes": (None, "shape of each label column", None, None),
    "inmemory_cache_all": (False, "keep each rank's shard in memory after the first epoch",
                           TypeConverters.toBoolean, "InMemoryCacheAll"),
    "use_gpu": (True, "whether to train on the GPU when there is one", TypeConverters.toBoolean, None),
    "mp_start_method": (None, "multiprocessing start method set first in each worker", TypeConverters.toString,
                        None),
}


class EstimatorParams(Params):
    """Upstream's common estimator parameters (spec 3.1) with their defaults and accessors."""

    for _name, (_default, _doc, _conv, _acc) in _ESTIMATOR_PARAMS.items():
        locals()[_name] = param(_name, _doc, _conv)
    del _name, _default, _doc, _conv, _acc

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(**{name: spec[0] for name, spec in _ESTIMATOR_PARAMS.items()})

    def setParams(self, **kwargs: Any) -> EstimatorParams:
        """Set any of the parameters by name (unknown names are a ``TypeError`` naming them)."""
        unknown = sorted(k for k in kwargs if not self.hasParam(k))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected parameter(s) {unknown}")
        return self._set(**kwargs)


add_accessors(EstimatorParams, {name: spec[3] for name, spec in _ESTIMATOR_PARAMS.items()})


class ModelParams(HasOutputCols):
    """The returned model's parameters (spec 3.6): history, model, columns, run ID and the data's metadata."""

    history = param("history", "training history")
    model = param("model", "the trained model")
    feature_columns = param("feature_columns", "feature column names")
    label_columns = param("label_columns", "label column names")
    run_id = param("run_id", "ID of the run that trained the model", TypeConverters.toString)
    _metadata = param("_metadata", "shape and type of the input and output columns")

    def setParams(self, **kwargs: Any) -> ModelParams:
        return self._set(**kwargs)

    def _get_metadata(self) -> dict[str, Any]:
        return self.getOrDefault(self._metadata)

    def setOutputCols(self, value: list[str]) -> ModelParams:
        """The prediction columns, one per label (default ``<label>__output``)."""
        return self._set(outputCols=value)

    def setLabelColoumns(self, value: list[str]) -> ModelParams:
        """Upstream's setter, typo included."""
        return self._set(label_columns=value)


add_accessors(ModelParams, {"history": None, "model": None, "feature_columns": None, "label_columns": None,
                            "run_id": None})
