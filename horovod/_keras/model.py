"""``DistributedModel``: make an existing Keras model's compile/fit/evaluate/predict data-parallel.

Upstream Horovod never had it (seed 001 uses it).  Design: the user's model object is returned *itself*,
with ``compile``, ``fit``, ``evaluate`` and ``predict`` replaced on the instance by wrappers that call the
original methods.  Its class, config, weights, ``summary()``, attribute access and ``save``/``load_model``
are untouched, so a saved model reloads as the plain model without Horovod.  The wrappers:

* ``compile``: wraps the optimizer in ``DistributedOptimizer`` unless it already is one; turns XLA
  (``jit_compile``) off with a logged notice, because Horovod's ops cannot be compiled by XLA.
* ``fit``: prepends ``BroadcastGlobalVariablesCallback(root_rank)`` (initial weights and optimizer state
  come from rank 0 when training starts) and ``MetricAverageCallback`` (epoch metrics averaged across
  ranks), shows progress on rank 0 only (``verbose=0`` elsewhere), drops ``ModelCheckpoint``/``BackupAndRestore``
  callbacks on other ranks (checkpoints are written by rank 0 only), and, if ``shard_data=True``, gives
  every rank its own shard of the input (``sample_weight`` too).
* ``evaluate``: rank-0 progress, metrics averaged across ranks.
* ``predict``: rank-0 progress; each rank predicts its own input (results are not gathered).

Sharding default (``shard_data=False``): the data a user passes is used as is.  Horovod users usually shard
themselves (``dataset.shard(hvd.size(), hvd.rank())``); sharding again would silently train on ``1/size**2``
of the data.  Pass ``shard_data=True`` to shard ``tf.data.Dataset`` inputs with ``Dataset.shard`` (whole
batches round-robin) and numpy inputs by rows.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import tensorflow as tf

from horovod.common import basics as _basics
from horovod.common.process_sets import global_process_set

__all__ = ["make_distributed_model_class"]

log = logging.getLogger(__name__)

_ATTR = "_hvd_distributed"


def _shard(x, rank: int, size: int):
    if x is None or size <= 1:
        return x
    if isinstance(x, tf.data.Dataset):
        return x.shard(size, rank)
    if isinstance(x, np.ndarray) or (hasattr(x, "shape") and hasattr(x, "__getitem__") and not tf.is_tensor(x)):
        return x[rank::size]
    if tf.is_tensor(x):
        return x[rank::size]
    if isinstance(x, dict):
        return {k: _shard(v, rank, size) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_shard(v, rank, size) for v in x)
    return x  # generators, PyDatasets: the user's responsibility


def _average_results(result: Any, process_set) -> Any:
    if _basics.size() <= 1:
        return result
    from horovod.common import ops

    if isinstance(result, dict):
        keys = sorted(result)
        vals = np.array([float(np.asarray(result[k])) for k in keys], np.float64)
        avg = ops.allreduce(vals, name="DistributedModel.evaluate." + ".".join(keys)[:200],
                            process_set=process_set).wait()
        return {k: float(v) for k, v in zip(keys, avg)}
    scalar = np.ndim(result) == 0
    vals = np.atleast_1d(np.asarray(result, np.float64))
    avg = ops.allreduce(vals, name=f"DistributedModel.evaluate.{vals.size}", process_set=process_set).wait()
    return float(avg[0]) if scalar else [float(v) for v in avg]


def make_distributed_model_class(keras, create_optimizer, callbacks):
    """Build ``DistributedModel`` for ``keras``; ``create_optimizer(opt)`` wraps an optimizer."""
    from horovod._keras import is_distributed_optimizer

    checkpoint_types = tuple(t for t in (getattr(keras.callbacks, "ModelCheckpoint", None),
                                         getattr(keras.callbacks, "BackupAndRestore", None)) if t)

    def disable_jit(model) -> None:
        try:
            jit = model.jit_compile
        except Exception:  # noqa: BLE001 - not compiled yet
            return
        if jit:
            log.warning("Horovod: turning off XLA (jit_compile) for model %r: Horovod's collectives run outside "
                        "XLA and cannot be compiled into it.", getattr(model, "name", "?"))
            model.jit_compile = False

    def wrap(model, *, shard_data: bool = False, root_rank: int = 0, average_metrics: bool = True,
             process_set=global_process_set, **optimizer_kwargs):
        if not isinstance(model, keras.Model):
            raise ValueError(f"DistributedModel expects a keras.Model, got {type(model).__name__}")
        if getattr(model, _ATTR, None) is not None:
            return model
        original = {name: getattr(model, name) for name in ("compile", "fit", "evaluate", "predict")}

        @functools.wraps(original["compile"])
        def compile(*args, **kwargs):  # noqa: A001 - Keras' method name
            args = list(args)
            opt = kwargs.get("optimizer", args[0] if args else "rmsprop")
            if opt is not None:
                opt = keras.optimizers.get(opt)
                if not is_distributed_optimizer(opt):
                    opt = create_optimizer(opt, process_set=process_set, **optimizer_kwargs)
                if args:
                    args[0] = opt
                else:
                    kwargs["optimizer"] = opt
            result = original["compile"](*args, **kwargs)
            disable_jit(model)
            return result

        def _callbacks(user, training: bool) -> list:
            user = list(user or [])
            if _basics.rank() != 0:
                user = [cb for cb in user if not isinstance(cb, checkpoint_types)]
            extra = []
            if training and not any(isinstance(cb, callbacks.BroadcastGlobalVariablesCallback) for cb in user):
                extra.append(callbacks.BroadcastGlobalVariablesCallback(root_rank))
            if training and average_metrics and \
                    not any(isinstance(cb, callbacks.MetricAverageCallback) for cb in user):
                extra.append(callbacks.MetricAverageCallback(process_set=process_set))
            return extra + user

        def _verbose(kwargs, default) -> None:
            if _basics.rank() != 0:
                kwargs["verbose"] = 0
            else:
                kwargs.setdefault("verbose", default)

        def _data(args, kwargs, names) -> tuple[list, dict]:
            if not shard_data:
                return list(args), kwargs
            args = list(args)
            rank, size = _basics.rank(), _basics.size()
            for i, name in enumerate(names):
                if i < len(args):
                    args[i] = _shard(args[i], rank, size)
                elif name in kwargs:
                    kwargs[name] = _shard(kwargs[name], rank, size)
            for name in ("sample_weight", "validation_data"):  # per-sample like x and y
                if name in kwargs:
                    kwargs[name] = _shard(kwargs[name], rank, size)
            return args, kwargs

        @functools.wraps(original["fit"])
        def fit(*args, **kwargs):
            disable_jit(model)
            _verbose(kwargs, "auto")
            kwargs["callbacks"] = _callbacks(kwargs.get("callbacks"), training=True)
            args, kwargs = _data(args, kwargs, ("x", "y"))
            return original["fit"](*args, **kwargs)

        @functools.wraps(original["evaluate"])
        def evaluate(*args, **kwargs):
            if kwargs.get("_use_cached_eval_dataset"):
                # fit's validation pass: fit's own CallbackList and its validation data (sharded by fit);
                # MetricAverageCallback averages the val_ metrics at the epoch's end
                return original["evaluate"](*args, **kwargs)
            _verbose(kwargs, "auto")
            kwargs["callbacks"] = _callbacks(kwargs.get("callbacks"), training=False)
            args, kwargs = _data(args, kwargs, ("x", "y"))
            result = original["evaluate"](*args, **kwargs)
            return _average_results(result, process_set) if average_metrics else result

        @functools.wraps(original["predict"])
        def predict(*args, **kwargs):
            _verbose(kwargs, "auto")
            return original["predict"](*args, **kwargs)

        for name, fn in (("compile", compile), ("fit", fit), ("evaluate", evaluate), ("predict", predict)):
            object.__setattr__(model, name, fn)
        object.__setattr__(model, _ATTR, {"shard_data": shard_data, "root_rank": root_rank})
        if getattr(model, "optimizer", None) is not None and model.compiled and \
                not is_distributed_optimizer(model.optimizer):
            log.warning("Horovod: DistributedModel got an already compiled model; call compile() again to "
                        "distribute its optimizer.")
        return model

    class _Meta(type):
        def __instancecheck__(cls, obj) -> bool:
            return getattr(obj, _ATTR, None) is not None

    class DistributedModel(metaclass=_Meta):
        """Make ``model`` data-parallel: ``hvd.DistributedModel(model)`` returns the same model object whose
        ``compile/fit/evaluate/predict`` are distributed (see the module docstring and docs/tensorflow.md).

        Args:
            model: a ``keras.Model``.
            shard_data: give each rank its own shard of ``x``/``y``/``sample_weight``/``validation_data``
                (default False).
            root_rank: rank whose initial weights and optimizer state every rank starts from.
            average_metrics: average epoch metrics and ``evaluate`` results across ranks.
            process_set: the process set that trains together.
            **optimizer_kwargs: passed to ``DistributedOptimizer`` when ``compile`` wraps the optimizer.

        Example::

            model = hvd.DistributedModel(model)
            model.compile(optimizer=keras.optimizers.Adam(0.001 * hvd.size()), loss="mse")
            model.fit(dataset, epochs=3)
        """

        def __new__(cls, model, **kwargs):
            return wrap(model, **kwargs)

    return DistributedModel
