"""The Keras estimator's training function: what every Horovod process runs inside its Spark task.

:func:`make_trainer` turns a :class:`TrainSpec` (plain, picklable data made on the driver) into the
function ``horovod.spark.run`` ships.  Each process

1. initialises Horovod, pins its GPU (local rank), seeds, and loads the model with ``hvd.load_model`` (its
   optimizer comes back distributed, with its state when resuming);
2. multiplies the learning rate by ``hvd.size()`` (upstream's rule, :mod:`.learning_rate`);
3. trains with upstream's callbacks: broadcast from rank 0, metric averaging, the user's; on rank 0 a
   checkpoint per epoch (the user's ``checkpoint_callback`` with its ``filepath`` redirected, else a
   ``ModelCheckpoint``) into a local directory, TensorBoard logs (when ``tensorboard`` is installed or the user
   passed a ``TensorBoard`` callback), and a copy of that directory to the store's run path after every epoch;
4. on rank 0 returns ``(history, checkpoint bytes, size)`` -- the model of the checkpoint (the last epoch,
   or the best one with a ``save_best_only`` user callback); the other ranks return None.

Steps per epoch are ``ceil(rows / batch_size / size)`` from the total row count the driver measured, the
same on every rank, and the datasets repeat (:mod:`.dataset`): no rank runs out of batches before the others.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from horovod.spark.common.data import Dataset
from horovod.spark.common.store import RemoteStore

__all__ = ["TrainSpec", "make_trainer", "train"]


@dataclass
class TrainSpec:
    """What the driver hands to every worker (no Spark objects: it is pickled into the job)."""

    model_bytes: bytes
    dataset: Dataset
    remote_store: RemoteStore
    feature_cols: list[str]
    label_cols: list[str]
    input_shapes: list[tuple | None]
    label_shapes: list[tuple | None]
    batch_size: int
    epochs: int
    val_batch_size: int | None = None
    sample_weight_col: str | None = None
    custom_objects: dict[str, Any] = field(default_factory=dict)
    callbacks: list[Any] = field(default_factory=list)
    checkpoint_callback: Any = None
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    shuffle: bool = True
    random_seed: int | None = None
    verbose: int = 1
    inmemory_cache_all: bool = False
    prefetch: int = 0
    floatx: str = "float32"
    use_gpu: bool = True
    transformation_fn: Callable[[Any], Any] | None = None
    gradient_compression: Any = None
    """``hvd.Compression.fp16`` etc. for the DistributedOptimizer (None: no compression)."""


def _pin_gpu(tf: Any, local_rank: int) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")


def _sync_callback(keras: Any, directory: str, sync: Callable[[str], None]) -> Any:
    class SyncCallback(keras.callbacks.Callback):
        """Copies rank 0's checkpoint and logs to the store after every epoch (a failed run resumes from it)."""

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            sync(directory)

    return SyncCallback()


def _rank0_callbacks(keras: Any, spec: TrainSpec, callbacks: list, directory: str) -> tuple[list, str]:
    """Rank 0's additions: the checkpoint, and when the store keeps runs TensorBoard logs and the sync."""
    from horovod.spark.keras.serialization import checkpoint_filename

    remote = spec.remote_store
    checkpoint = os.path.join(directory, checkpoint_filename(remote.checkpoint_filename))
    if spec.checkpoint_callback is not None:
        spec.checkpoint_callback.filepath = checkpoint
        callbacks.append(spec.checkpoint_callback)
    else:
        callbacks.append(keras.callbacks.ModelCheckpoint(checkpoint))
    if remote.saving_runs:
        logs = os.path.join(directory, remote.logs_subdir)
        boards = [c for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)]
        for board in boards:  # the user's goes last, writing where the store keeps the logs
            callbacks.remove(board)
            board.log_dir = logs
        if boards:
            callbacks.append(boards[0])
        elif importlib.util.find_spec("tensorboard") is not None:  # Keras' TensorBoard callback needs it
            callbacks.append(keras.callbacks.TensorBoard(logs))
        callbacks.append(_sync_callback(keras, directory, remote.sync))
    return callbacks, checkpoint


def _datasets(spec: TrainSpec, rank: int, size: int, steps: int, val_steps: int | None) -> tuple[Any, Any]:
    """The training dataset (shuffled anew each pass) and the validation one (the same rows every epoch)."""
    from horovod.spark.common.reader import ShardReader
    from horovod.spark.keras.dataset import make_dataset

    columns = list(dict.fromkeys([*spec.feature_cols, *spec.label_cols,
                                  *([spec.sample_weight_col] if spec.sample_weight_col else [])]))
    shapes = dict(feature_cols=spec.feature_cols, label_cols=spec.label_cols, input_shapes=spec.input_shapes,
                  label_shapes=spec.label_shapes, sample_weight_col=spec.sample_weight_col, prefetch=spec.prefetch,
                  floatx=spec.floatx)

    def reader(path: str, batch_size: int, shuffle: bool) -> ShardReader:
        return ShardReader(spec.remote_store.filesystem, path, columns, rank, size, batch_size, shuffle=shuffle,
                           seed=spec.random_seed, metadata=spec.dataset.metadata,
                           transformation_fn=spec.transformation_fn, cache=spec.inmemory_cache_all)

    train_reader = reader(spec.dataset.train_data_path, spec.batch_size, spec.shuffle)
    train = make_dataset(lambda: train_reader.batches(ENDLESS), **shapes)
    val = None
    if val_steps is not None and spec.dataset.val_data_path:
        val_reader = reader(spec.dataset.val_data_path, spec.val_batch_size or spec.batch_size, False)

        def val_batches() -> Iterator[Mapping[str, Any]]:
            while True:  # Keras keeps one iterator across epochs: each epoch's val_steps start the shard again
                val_reader.reset()
                yield from val_reader.batches(val_steps)

        val = make_dataset(val_batches, **shapes)
    return train, val


ENDLESS = 1 << 62
"""Steps asked of the training reader: Keras takes ``steps_per_epoch`` of them each epoch."""


def train(spec: TrainSpec) -> tuple[dict[str, list[float]], bytes, int] | None:
    """The body every process runs (see the module's docstring)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    import horovod.tensorflow.keras as hvd
    from horovod.spark.common.reader import steps_per_epoch
    from horovod.spark.keras.learning_rate import scale_learning_rate
    from horovod.spark.keras.serialization import model_from_bytes, stored_checkpoint

    keras.backend.set_floatx(spec.floatx)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    verbose = spec.verbose if rank == 0 else 0
    if spec.use_gpu:
        _pin_gpu(tf, hvd.local_rank())
    if spec.random_seed is not None:
        keras.utils.set_random_seed(spec.random_seed)
    compression = spec.gradient_compression or hvd.Compression.none
    model = model_from_bytes(spec.model_bytes, spec.custom_objects,
                             load=lambda path, **kw: hvd.load_model(path, compression=compression, **kw))
    user_callbacks = list(spec.callbacks)
    scaled_lr = scale_learning_rate(model.optimizer, size, user_callbacks)

    dataset = spec.dataset
    val_batch = spec.val_batch_size or spec.batch_size
    steps = steps_per_epoch(dataset.train_rows, spec.batch_size, size, spec.train_steps_per_epoch, ceil=True)
    val_steps = None
    if dataset.val_data_path and dataset.val_rows:
        val_steps = steps_per_epoch(dataset.val_rows, val_batch, size, spec.validation_steps_per_epoch, ceil=True)
    if verbose:
        print(f"Training parameters: Epochs: {spec.epochs}, Scaled lr: {scaled_lr}, Shuffle: {spec.shuffle}, "
              f"random_seed: {spec.random_seed}\nTrain rows: {dataset.train_rows}, Train batch size: "
              f"{spec.batch_size}, Train_steps_per_epoch: {steps}\nVal rows: {dataset.val_rows}, Val batch size: "
              f"{val_batch}, Val_steps_per_epoch: {val_steps}\n"
              f"Checkpoint file: {stored_checkpoint(spec.remote_store)}, Logs dir: {spec.remote_store.logs_path}",
              flush=True)
    train_data, val_data = _datasets(spec, rank, size, steps, val_steps)
    with spec.remote_store.get_local_output_dir() as directory:
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=0),
                     hvd.callbacks.MetricAverageCallback(), *user_callbacks]
        checkpoint = None
        if rank == 0:
            callbacks, checkpoint = _rank0_callbacks(keras, spec, callbacks, directory)
        history = model.fit(train_data, validation_data=val_data, epochs=spec.epochs, steps_per_epoch=steps,
                            validation_steps=val_steps, callbacks=callbacks, verbose=verbose, shuffle=False)
        if rank != 0:
            return None
        if not os.path.exists(checkpoint):  # e.g. a save_best_only callback whose metric never came
            model.save(checkpoint)
        with open(checkpoint, "rb") as f:
            return _plain(history.history), f.read(), size


def _plain(history: Mapping[str, Sequence[Any]]) -> dict[str, list[float]]:
    """Keras' history with Python floats (no tensors or numpy scalars travel back to the driver)."""
    return {k: [float(v) for v in values] for k, values in history.items()}


def make_trainer(spec: TrainSpec) -> Callable[[], tuple[dict[str, list[float]], bytes, int] | None]:
    """The function ``horovod.spark.run`` runs on every process."""
    def trainer() -> tuple[dict[str, list[float]], bytes, int] | None:
        return train(spec)

    return trainer
