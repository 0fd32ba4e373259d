"""Keras callbacks shared by both front-ends; each factory takes the ``keras`` module.

The front-ends call :func:`make_callbacks` once and export the returned classes, so the logic exists once.
"""

from __future__ import annotations

import logging
import zlib
from types import SimpleNamespace

import numpy as np
import tensorflow as tf

from horovod._keras import require_tensorflow_backend
from horovod.base.exceptions import PreconditionError
from horovod.common import basics as _basics
from horovod.common import ops as _ops
from horovod.common.process_sets import global_process_set

__all__ = ["make_callbacks"]

log = logging.getLogger(__name__)


def _broadcast_model_state(model, root_rank: int, local_variables=(), build_optimizer: bool = True) -> None:
    from horovod.tensorflow.functions import broadcast_variables

    skip = {id(v) for v in local_variables}
    opt = getattr(model, "optimizer", None)
    if build_optimizer and opt is not None and not opt.built and model.built and model.trainable_variables:
        opt.build(model.trainable_variables)
    variables = [v for v in model.variables if id(v) not in skip]
    if opt is not None:
        variables += [v for v in opt.variables if id(v) not in skip]
    broadcast_variables(variables, root_rank)


def _lr_var(optimizer):
    return optimizer.learning_rate


def _get_lr(optimizer) -> float:
    return float(np.asarray(optimizer.learning_rate))


def _set_lr(optimizer, value: float) -> None:
    lr = optimizer.learning_rate
    if hasattr(optimizer, "_learning_rate") and callable(getattr(optimizer, "_learning_rate", None)):
        raise ValueError("LearningRateScheduleCallback cannot adjust a LearningRateSchedule; pass a float "
                         "learning rate to the optimizer.")
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value


def make_callbacks(keras) -> SimpleNamespace:
    """Build the callback classes for ``keras`` (Keras 3 via ``tf.keras`` or ``import keras``)."""

    class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
        """Broadcast model and optimizer variables from ``root_rank`` so every rank starts alike.

        Broadcasts at the start of training when the model is already built (before any update), otherwise
        after the first batch (upstream's behaviour), once.
        """

        def __init__(self, root_rank: int, device: str = "", local_variables=None) -> None:
            require_tensorflow_backend("BroadcastGlobalVariablesCallback")
            super().__init__()
            self.root_rank = root_rank
            self.device = device
            self.broadcast_done = False
            if local_variables is None:
                local_variables = []
            elif not isinstance(local_variables, (list, tuple)):
                local_variables = [local_variables]
            for v in local_variables:
                if not isinstance(v, (tf.Variable, keras.Variable)):
                    raise ValueError("Every local variable must be a tf.Variable or keras.Variable, got "
                                     f"{type(v).__name__}")
            self.local_variables = list(local_variables)

        def _broadcast(self) -> None:
            if not self.broadcast_done:
                _broadcast_model_state(self.model, self.root_rank, self.local_variables)
                self.broadcast_done = True

        def on_train_begin(self, logs=None) -> None:
            if self.model.built and self.model.variables:
                self._broadcast()

        def on_batch_end(self, batch, logs=None) -> None:
            self._broadcast()

        on_train_batch_end = on_batch_end

    class MetricAverageCallback(keras.callbacks.Callback):
        """Average every metric in ``logs`` across ranks at the end of each epoch (sorted by name)."""

        def __init__(self, device: str = "", process_set=global_process_set) -> None:
            super().__init__()
            self.device = device
            self.process_set = process_set

        def _average(self, logs, epoch) -> None:
            if logs is None or _basics.size() <= 1:
                return
            keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.isscalar(np.asarray(v).item()))
            # One row per rank, [crc of the metric names, values...], gathered under one name: ranks whose logs
            # hold other metrics (a callback writing into logs on rank 0 only, placed before this one; metrics
            # compiled on some ranks) get an error on every rank, where reductions named after the metrics
            # never paired up and every rank waited forever.
            tag = float(zlib.crc32("\0".join(keys).encode()))
            row = np.array([[tag] + [float(np.asarray(logs[k])) for k in keys]], dtype=np.float64)
            mismatch = ValueError(
                f"MetricAverageCallback: the ranks' logs hold different metrics at the end of epoch {epoch + 1} "
                f"(this rank's: {keys}); every rank must compile the same metrics, and a callback that writes "
                "into logs on some ranks only must come after MetricAverageCallback in the callbacks list")
            try:
                rows = _ops.allgather(row, name="MetricAverageCallback", process_set=self.process_set).wait()
            except PreconditionError as e:  # another number of metrics: the rows' shapes differ
                raise mismatch from e
            if np.any(rows[:, 0] != tag):
                raise mismatch
            for k, v in zip(keys, rows[:, 1:].mean(axis=0)):
                logs[k] = float(v)

        def on_epoch_end(self, epoch, logs=None) -> None:
            self._average(logs, epoch)

    class LearningRateScheduleCallback(keras.callbacks.Callback):
        """Multiply the initial learning rate by ``multiplier`` (a constant ``m`` means
        ``m ** (epoch - start_epoch)``, or a function of the epoch) in ``[start_epoch, end_epoch)``."""

        def __init__(self, initial_lr, multiplier, start_epoch: int = 0, end_epoch=None, staircase: bool = True,
                     momentum_correction: bool = True, steps_per_epoch=None) -> None:
            super().__init__()
            if initial_lr is None:
                raise ValueError("Parameter `initial_lr` is required")
            self.initial_lr = initial_lr
            self.start_epoch = start_epoch
            self.end_epoch = end_epoch
            self.staircase = staircase
            self.momentum_correction = momentum_correction
            self.steps_per_epoch = steps_per_epoch
            self.current_epoch = None
            self.restore_momentum = None
            if not callable(multiplier):
                self.staircase = True
                self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
            else:
                self.multiplier = multiplier

        def _autodetect_steps_per_epoch(self) -> int:
            if self.params.get("steps"):
                return self.params["steps"]
            if self.params.get("samples") and self.params.get("batch_size"):
                return self.params["samples"] // self.params["batch_size"]
            raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                             f"steps_per_epoch parameter to the {type(self).__name__}() or upgrade to the latest "
                             "version of Keras.")

        def _adjust_learning_rate(self, epoch) -> None:
            opt = self.model.optimizer
            old_lr = _get_lr(opt)
            new_lr = self.initial_lr * self.multiplier(epoch)
            _set_lr(opt, new_lr)
            if hasattr(opt, "momentum") and self.momentum_correction and old_lr > 0:
                momentum = opt.momentum
                if not hasattr(momentum, "assign"):
                    # Keras 3's momentum is a Python float that the first traced step bakes in: a corrected
                    # value set now would stay the momentum of the whole run, not of this batch
                    self._warn_float_momentum()
                    return
                self.restore_momentum = float(np.asarray(momentum))
                momentum.assign(self.restore_momentum * new_lr / old_lr)

        def _warn_float_momentum(self) -> None:
            if not getattr(self, "_warned_float_momentum", False):
                self._warned_float_momentum = True
                log.warning("%s: momentum_correction is skipped: the optimizer's momentum is a Python float, "
                            "fixed in the compiled training step (Keras 3); pass momentum_correction=False to "
                            "silence this", type(self).__name__)

        def _restore_momentum_if_needed(self) -> None:
            if self.restore_momentum is not None:
                self.model.optimizer.momentum.assign(self.restore_momentum)
                self.restore_momentum = None

        def on_train_begin(self, logs=None) -> None:
            if self.initial_lr is None:
                self.initial_lr = _get_lr(self.model.optimizer)
            if not self.staircase and not self.steps_per_epoch:
                self.steps_per_epoch = self._autodetect_steps_per_epoch()

        def on_epoch_begin(self, epoch, logs=None) -> None:
            self.current_epoch = epoch

        def on_batch_begin(self, batch, logs=None) -> None:
            if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                         and self.current_epoch >= self.end_epoch):
                return
            if self.staircase and batch == 0:
                self._adjust_learning_rate(self.current_epoch)
            elif not self.staircase:
                epoch = self.current_epoch + float(batch) / self.steps_per_epoch
                self._adjust_learning_rate(epoch)

        def on_batch_end(self, batch, logs=None) -> None:
            self._restore_momentum_if_needed()

        on_train_batch_begin = on_batch_begin
        on_train_batch_end = on_batch_end

        def on_epoch_end(self, epoch, logs=None) -> None:
            if logs is not None:
                logs["lr"] = _get_lr(self.model.optimizer)

    class LearningRateWarmupCallback(LearningRateScheduleCallback):
        """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``
        (Goyal et al., "Accurate, Large Minibatch SGD")."""

        def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                     steps_per_epoch=None, verbose: int = 0) -> None:
            def multiplier(epoch):
                epoch += 1.0 / self.steps_per_epoch  # the first batch already uses the raised rate
                return 1.0 / _basics.size() * (epoch * (_basics.size() - 1) / warmup_epochs + 1)

            super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                             momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
            self.verbose = verbose

        def on_epoch_end(self, epoch, logs=None) -> None:
            super().on_epoch_end(epoch, logs)
            if epoch == self.end_epoch - 1 and self.verbose > 0 and _basics.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "  # upstream's text
                      f"{_get_lr(self.model.optimizer):g}.")

    class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
        """ModelCheckpoint that keeps only the best model; ``filepath`` is assigned later (upstream's Spark
        estimator pattern), so set ``callback.filepath`` before ``fit``."""

        def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                     mode: str = "auto", save_freq="epoch", filepath: str | None = None) -> None:
            # Keras 3 checks the suffix when the callback is made: a placeholder it accepts until one is set
            placeholder = "best.weights.h5" if save_weights_only else "best.keras"
            super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                             save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                             save_freq=save_freq)
            if filepath is None:
                self.filepath = None

    return SimpleNamespace(
        BroadcastGlobalVariablesCallback=BroadcastGlobalVariablesCallback,
        MetricAverageCallback=MetricAverageCallback,
        LearningRateScheduleCallback=LearningRateScheduleCallback,
        LearningRateWarmupCallback=LearningRateWarmupCallback,
        BestModelCheckpoint=BestModelCheckpoint,
    )
