"""Elastic training for TensorFlow: ``run``, ``TensorFlowKerasState``, ``TensorFlowState`` (docs/elastic.md)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import SHUT_DOWN_MESSAGE, HorovodInternalError

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState"]

_HOROVOD_OPS = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast", SHUT_DOWN_MESSAGE[:30])
# how a PreconditionError of a collective inside tf.function reads in the UnknownError TensorFlow makes of it
_MISMATCH = "\nFailedPreconditionError: "


def _reset() -> None:
    from horovod.common import basics

    basics.shutdown()
    basics.init()


@contextlib.contextmanager
def _collective_failures() -> Iterator[None]:
    """A ``tf.errors.UnknownError`` from a Horovod op counts as a ``HorovodInternalError`` (the op failed
    because a peer is gone): the elastic loop rolls back and resets instead of ending the worker.  Not one
    that wraps a mismatch between the ranks (``FailedPreconditionError``, as eager mode raises it): the same
    mismatch would follow every reset."""
    try:
        yield
    except tf.errors.UnknownError as e:
        text = str(e)
        if _MISMATCH in text:  # a mismatch inside tf.function (numpy_function's UnknownError): not a fault
            raise
        if any(op in text for op in _HOROVOD_OPS):
            raise HorovodInternalError(e) from e
        raise


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Like ``horovod.common.elastic.run_fn``, with TensorFlow's op errors translated (``_collective_failures``)."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _collective_failures():
            return func(*args, **kwargs)

    return run_fn(wrapped, _reset)


def _rank() -> int:
    from horovod.common.basics import rank

    return rank()


def _bcast_object(obj: Any, root_rank: int = 0) -> Any:
    from horovod.common.objects import broadcast_object

    return broadcast_object(obj, root_rank)


def _optimizer_variables(optimizer: Any) -> list:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """State of a Keras model and optimizer (and plain attributes / an ``ElasticSampler``).

    ``save`` copies the variables' values, ``restore`` assigns them back, ``sync`` broadcasts rank 0's.

    Raises:
        ValueError: the model is not built yet (upstream's text).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._saved_model_state: list = []
        self._saved_optimizer_state: list = []
        super().__init__(bcast_object=_bcast_object, get_rank=_rank, **kwargs)

    def _variables(self) -> tuple[list, list]:
        opt = self.optimizer
        if opt is not None and not getattr(opt, "built", True) and self.model.trainable_variables:
            # a worker that joined has not trained yet: its slots must exist to receive rank 0's
            opt.build(self.model.trainable_variables)
        return list(self.model.variables), _optimizer_variables(opt)

    def save(self) -> None:
        model_vars, opt_vars = self._variables()
        self._saved_model_state = [v.numpy().copy() for v in model_vars]
        self._saved_optimizer_state = [v.numpy().copy() for v in opt_vars]
        super().save()

    def restore(self) -> None:
        model_vars, opt_vars = self._variables()
        for v, value in zip(model_vars, self._saved_model_state):
            v.assign(value)
        for v, value in zip(opt_vars, self._saved_optimizer_state):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        from horovod.tensorflow.functions import broadcast_variables

        model_vars, opt_vars = self._variables()
        with _collective_failures():
            broadcast_variables(model_vars + opt_vars, root_rank=0)
            super().sync()
        self.save()


class TensorFlowState(ObjectState):
    """State of a list of ``tf.Variable``s (eager; ``session`` is accepted for compatibility)."""

    def __init__(self, variables: list | None = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables or [])
        self.session = session
        self._values: list = []
        super().__init__(bcast_object=_bcast_object, get_rank=_rank, **kwargs)

    def save(self) -> None:
        self._values = [v.numpy().copy() for v in self.variables]
        super().save()

    def restore(self) -> None:
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        from horovod.tensorflow.functions import broadcast_variables

        with _collective_failures():
            if self.variables:
                broadcast_variables(self.variables, root_rank=0)
            super().sync()
        self.save()
