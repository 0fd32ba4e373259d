"""``KerasEstimator``: fit a Keras 3 model on a Spark DataFrame with Horovod; ``KerasModel``: its result.

How it runs (the framework-free steps are :class:`horovod.spark.common.estimator.HorovodEstimator`'s)::

    fit(df) -> prepare_data (Parquet in the store, once per DataFrame)
            -> the driver compiles a copy of the model with optimizer/loss/metrics (resuming: the weights and
               optimizer state of the run's checkpoint in the store) and ships its ``.keras`` bytes
            -> horovod.spark.run(remote.train) on num_proc processes (see horovod.spark.keras.remote)
            -> rank 0's checkpoint comes back: KerasModel(history, model with the learning rate / size, ...)

``KerasModel.transform(df)`` loads the model once per Spark partition (CPU) and appends ``<label>__output``
columns (:meth:`HorovodModel.transform`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pyspark.ml.param import TypeConverters

from horovod.spark.common import serialization as common_serialization
from horovod.spark.common.backend import Backend
from horovod.spark.common.data import Dataset
from horovod.spark.common.estimator import HorovodEstimator, HorovodModel
from horovod.spark.common.params import add_accessors, param

__all__ = ["KerasEstimator", "KerasModel"]

logger = logging.getLogger("horovod.spark")

_KERAS_PARAMS: dict[str, tuple[Any, str, Any]] = {
    "custom_objects": ({}, "custom objects (layers, losses, metrics ...) the model needs to load", None),
    "checkpoint_callback": (None, "a keras.callbacks.ModelCheckpoint whose filepath rank 0 redirects to the "
                                  "run's checkpoint (e.g. save_best_only=True: fit returns the best model)", None),
    "backend_env": ({"LIBHDFS_OPTS": "-Xms2048m -Xmx2048m"}, "environment of the training processes", None),
    "tensorflow_dataset_prefetch_buffer_size": (0, "batches each rank prefetches (0: tf.data.AUTOTUNE)",
                                                TypeConverters.toInt),
    "data_module": (None, "not supported (upstream: Petastorm/NVTabular data modules); batches come from "
                          "pyarrow", None),
}


def _shape(tensor: Any) -> tuple | None:
    shape = getattr(tensor, "shape", None)
    return None if shape is None else tuple(None if d is None else int(d) for d in shape)


def _size(shape: tuple | None) -> int | None:
    if shape is None or any(d is None for d in shape[1:]):
        return None
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def _model_tensors(model: Any, name: str) -> list[Any]:
    try:
        return list(getattr(model, name) or [])
    except (AttributeError, ValueError):  # a subclassed model that was never called has neither
        return []


class KerasEstimator(HorovodEstimator):
    """Train a Keras 3 model on a Spark DataFrame with Horovod (upstream's ``horovod.spark.keras.KerasEstimator``).

    Example::

        from horovod.spark.common.store import Store
        from horovod.spark.keras import KerasEstimator

        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        estimator = KerasEstimator(num_proc=2, store=Store.create("/shared/hvd"), model=model,
                                   optimizer=keras.optimizers.SGD(0.1), loss="mse", feature_cols=["features"],
                                   label_cols=["y"], batch_size=32, epochs=10, validation=0.1)
        keras_model = estimator.fit(df)                     # a KerasModel (Spark ML Model)
        predictions = keras_model.transform(df)             # + a "y__output" column

    Parameters (keyword only, all optional as upstream; unset ones have upstream's defaults): ``num_proc`` or
    ``backend``, ``store``, ``model``, ``optimizer`` (default: the compiled model's), ``loss``, ``loss_weights``,
    ``metrics``, ``feature_cols`` (one per model input), ``label_cols`` (one per output), ``sample_weight_col``,
    ``validation`` (fraction or column), ``batch_size``, ``val_batch_size``, ``epochs``, ``callbacks``,
    ``random_seed``, ``shuffle``, ``shuffle_buffer_size`` (ignored), ``partitions_per_process``, ``run_id``,
    ``train_steps_per_epoch``, ``validation_steps_per_epoch``, ``transformation_fn`` (pandas DataFrame of a row
    group -> DataFrame), ``label_shapes``, ``inmemory_cache_all``, ``use_gpu``, ``verbose``, ``custom_objects``,
    ``checkpoint_callback``, ``backend_env``, ``tensorflow_dataset_prefetch_buffer_size``; the reader knobs
    (``*_reader_num_workers``, ``reader_pool_type``) are accepted and unused.

    Each process trains with ``lr x num_proc`` (upstream's rule); the returned model has the rate divided back.
    A ``run_id`` whose run in the store has a checkpoint resumes from its weights and optimizer state.
    """

    _run_id_prefix = "keras"

    for _name, (_default, _doc, _conv) in _KERAS_PARAMS.items():
        locals()[_name] = param(_name, _doc, _conv)
    del _name, _default, _doc, _conv

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def _extra_defaults(self) -> dict[str, Any]:
        return {name: spec[0] for name, spec in _KERAS_PARAMS.items()}

    # --- checks --------------------------------------------------------------------------------------------

    def _check_params(self) -> None:
        import keras

        super()._check_params()
        model = self.getModel()
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a Keras 3 model (keras.Model / tf.keras.Model), got "
                             f"{type(model).__name__}")
        if not self.getLoss():
            raise ValueError("Loss parameter is required for the model to compile")
        if self.getOptimizer() is None and getattr(model, "optimizer", None) is None:
            raise ValueError("Optimizer must be provided either as a parameter or as part of a compiled model")
        if self.getDataModule() is not None:
            raise ValueError("data_module is not supported: the training processes read the Parquet data with "
                             "pyarrow (use transformation_fn to change batches)")
        if self.getTensorflowDatasetPrefetchBufferSize() < 0:
            raise ValueError("tensorflow_dataset_prefetch_buffer_size must be >= 0 (0: AUTOTUNE), got "
                             f"{self.getTensorflowDatasetPrefetchBufferSize()}")

    def _input_output_shapes(self) -> tuple[list[tuple | None], list[tuple | None]]:
        model = self.getModel()
        return ([_shape(t) for t in _model_tensors(model, "inputs")],
                [_shape(t) for t in _model_tensors(model, "outputs")])

    def _check_metadata_compatibility(self, dataset: Dataset) -> None:
        super()._check_metadata_compatibility(dataset)
        inputs, outputs = self._input_output_shapes()
        features, labels = list(self.getFeatureCols()), list(self.getLabelCols())
        if inputs and len(inputs) != len(features):
            raise ValueError(f"Feature column count {len(features)} ({features}) must equal the model's input count "
                             f"{len(inputs)}")
        for col, shape in zip(features, inputs):
            size, want = dataset.metadata[col]["shape"], _size(shape)
            if want is not None and size != want:
                raise ValueError(f"Feature column {col!r} has size {size} but the model's input has shape {shape} "
                                 f"({want} values)")
        label_shapes = self.getLabelShapes()
        count = len(label_shapes) if label_shapes else len(outputs)
        if count and count != len(labels):
            raise ValueError(f"Label column count {len(labels)} ({labels}) must equal the model's output count "
                             f"{count}" + (" (label_shapes)" if label_shapes else ""))

    def _label_shapes(self, dataset: Dataset) -> list[tuple | None]:
        """How each label column is reshaped: ``label_shapes`` if given, else the model's output shape when the
        sizes agree (a class id for a softmax output stays a scalar)."""
        given = self.getLabelShapes()
        if given:
            return [(None, *shape) for shape in given]
        _, outputs = self._input_output_shapes()
        shapes = []
        for i, col in enumerate(self.getLabelCols()):
            shape = outputs[i] if i < len(outputs) else None
            shapes.append(shape if _size(shape) == dataset.metadata[col]["shape"] else None)
        return shapes

    # --- training ------------------------------------------------------------------------------------------

    def _compiled_model_bytes(self, run_id: str) -> bytes:
        """A compiled copy of the model as ``.keras`` bytes, from the run's checkpoint when the store has one."""
        import keras

        from horovod.spark.keras.serialization import model_from_bytes, model_to_bytes, stored_checkpoint

        objects = self.getCustomObjects()
        model = model_from_bytes(model_to_bytes(self.getModel()), objects)  # the user's model stays untouched
        optimizer = self.getOptimizer()
        if isinstance(optimizer, keras.optimizers.Optimizer):  # a fresh one of the same config
            optimizer = optimizer.__class__.from_config(optimizer.get_config())
        elif optimizer is not None:  # a name ("adam") or a config dict
            optimizer = keras.optimizers.get(optimizer)
        else:
            optimizer = model.optimizer
        if optimizer is None:
            raise ValueError("Optimizer must be provided either as a parameter or as part of a compiled model")
        model.compile(optimizer=optimizer, loss=self.getLoss(), loss_weights=self.getLossWeights(),
                      metrics=self.getMetrics())
        if model.built and not optimizer.built:  # saved with its (zero) slots, so the workers load it whole
            optimizer.build(model.trainable_variables)
        store = self.getStore()
        checkpoint = stored_checkpoint(store.to_remote(run_id))
        if checkpoint is not None and store.exists(checkpoint):
            logger.info("horovod.spark: resuming run %s from its checkpoint %s", run_id, checkpoint)
            _restore(model, model_from_bytes(store.read(checkpoint), objects), run_id)
        return model_to_bytes(model)

    def _fit_on_prepared_data(self, backend: Backend, dataset: Dataset) -> KerasModel:
        import keras

        from horovod.spark.keras.learning_rate import scale_learning_rate
        from horovod.spark.keras.remote import TrainSpec, make_trainer
        from horovod.spark.keras.serialization import model_from_bytes, shipped_custom_objects

        run_id = self._resolve_run_id()
        inputs, _ = self._input_output_shapes()
        spec = TrainSpec(
            model_bytes=self._compiled_model_bytes(run_id), dataset=dataset,
            remote_store=self.getStore().to_remote(run_id, dataset.dataset_idx),
            feature_cols=list(self.getFeatureCols()), label_cols=list(self.getLabelCols()),
            input_shapes=inputs or [None] * len(self.getFeatureCols()), label_shapes=self._label_shapes(dataset),
            batch_size=self.getBatchSize(), val_batch_size=self.getValBatchSize(), epochs=self.getEpochs(),
            sample_weight_col=self.getSampleWeightCol(), custom_objects=shipped_custom_objects(self.getCustomObjects()),
            callbacks=list(self.getCallbacks() or []), checkpoint_callback=self.getCheckpointCallback(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(), shuffle=self.getShuffle(),
            random_seed=self.getRandomSeed(), verbose=self.getVerbose(), inmemory_cache_all=self.getInMemoryCacheAll(),
            prefetch=self.getTensorflowDatasetPrefetchBufferSize(), floatx=keras.backend.floatx(),
            use_gpu=self.getUseGpu(), transformation_fn=self.getTransformationFn(),
            gradient_compression=self.getGradientCompression())
        results = backend.run(make_trainer(spec), env=self.getBackendEnv())
        history, checkpoint, size = results[0]
        model = model_from_bytes(checkpoint, self.getCustomObjects())
        scale_learning_rate(model.optimizer, 1.0 / size)
        return KerasModel(history=history, model=model, feature_columns=list(self.getFeatureCols()),
                          label_columns=list(self.getLabelCols()), custom_objects=self.getCustomObjects(),
                          run_id=run_id, _metadata=dataset.metadata, _floatx=keras.backend.floatx())


def _restore(model: Any, checkpoint: Any, run_id: str) -> None:
    """``model`` takes the checkpoint's weights and, when the optimizers are alike, its optimizer state (step
    count, moments) -- not its learning rate, which the checkpoint holds multiplied by the processes."""
    model.set_weights(checkpoint.get_weights())
    saved, optimizer = getattr(checkpoint, "optimizer", None), model.optimizer
    if saved is None or not saved.built or type(saved) is not type(optimizer):
        logger.warning("horovod.spark: run %s resumes with the checkpoint's weights but a fresh %s (the "
                       "checkpoint's optimizer is %s)", run_id, type(optimizer).__name__, type(saved).__name__)
        return
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    new, old = list(optimizer.variables), list(saved.variables)
    if [tuple(v.shape) for v in new] != [tuple(v.shape) for v in old]:
        logger.warning("horovod.spark: run %s: the checkpoint's optimizer state does not fit the model; it "
                       "starts fresh", run_id)
        return
    for target, value in zip(new, old):
        if not target.path.endswith("learning_rate"):
            target.assign(value)


class _KerasModelBytes:
    """A saved ``KerasModel``'s model until ``KerasModel`` loads it with its custom objects."""

    def __init__(self, data: bytes) -> None:
        self.data = data


_loaded: dict[str, Any] = {}
"""The model a Python worker last loaded for ``transform`` (by digest): one load per worker, not per partition."""


class _Predictor:
    """``transform``'s picklable prediction function: {feature column: batch} -> one array per label."""

    def __init__(self, model_bytes: bytes, custom_objects: dict[str, Any], features: Sequence[str],
                 input_shapes: Sequence[tuple | None], labels: int, floatx: str) -> None:
        self.model_bytes = model_bytes
        self.digest = hashlib.sha256(model_bytes).hexdigest()
        self.custom_objects = custom_objects
        self.features = list(features)
        self.input_shapes = list(input_shapes)
        self.labels = labels
        self.floatx = floatx

    def _model(self) -> Any:
        model = _loaded.get(self.digest)
        if model is None:
            if "tensorflow" not in sys.modules:  # an executor's Python worker: predict on the CPU, one thread
                os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
                import tensorflow as tf

                # not CUDA_VISIBLE_DEVICES: the Python worker's environment is inherited by later training tasks
                tf.config.set_visible_devices([], "GPU")
                tf.config.threading.set_intra_op_parallelism_threads(1)
                tf.config.threading.set_inter_op_parallelism_threads(1)
            from horovod.spark.keras.serialization import model_from_bytes

            model = model_from_bytes(self.model_bytes, self.custom_objects, compile=False)
            _loaded.clear()
            _loaded[self.digest] = model
        return model

    def __call__(self, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        from horovod.spark.keras.dataset import shape_columns

        model = self._model()
        inputs = shape_columns(batch, self.features, self.input_shapes, self.floatx)
        predictions = model.predict_on_batch(inputs[0] if len(inputs) == 1 else list(inputs))
        predictions = list(predictions) if isinstance(predictions, (list, tuple)) else [predictions]
        if len(predictions) != self.labels:
            raise ValueError(f"The model has {len(predictions)} output(s) but {self.labels} label column(s)")
        return [np.asarray(p) for p in predictions]


class KerasModel(HorovodModel):
    """The trained Keras model as a Spark ML ``Model`` (upstream's ``horovod.spark.keras.KerasModel``).

    ``getModel()`` is a Keras model with the trained weights (its optimizer has the user's learning rate),
    ``getHistory()`` Keras' history dict (metrics averaged over the processes, ``val_*`` with validation),
    ``getRunId()`` the run in the store; ``transform(df)`` appends one prediction column per label
    (``<label>__output``, see ``setOutputCols``).
    """

    custom_objects = param("custom_objects", "custom objects the model needs to load")
    _floatx = param("_floatx", "Keras float type of the training")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._setDefault(custom_objects={}, _floatx="float32")
        model = self.getModel()
        if isinstance(model, _KerasModelBytes):  # from KerasModel.load
            from horovod.spark.keras.serialization import model_from_bytes

            self._set(model=model_from_bytes(model.data, self.getCustomObjects()))

    def _predict_fn(self) -> Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]:
        from horovod.spark.keras.serialization import model_to_bytes, shipped_custom_objects

        model = self.getModel()
        inputs = [_shape(t) for t in _model_tensors(model, "inputs")]
        features = list(self.getFeatureColumns())
        return _Predictor(model_to_bytes(model), shipped_custom_objects(self.getCustomObjects()), features,
                          inputs or [None] * len(features), len(self.getLabelColumns()),
                          self.getOrDefault(self._floatx))

    def _encode_param(self, name: str, value: Any) -> str:
        if name == "model":
            from horovod.spark.keras.serialization import model_to_bytes

            return common_serialization.dumps_b64(_KerasModelBytes(model_to_bytes(value)))
        return super()._encode_param(name, value)


add_accessors(KerasEstimator, {name: None for name in _KERAS_PARAMS})
add_accessors(KerasModel, {"custom_objects": None})
