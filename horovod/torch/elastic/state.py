"""``TorchState``: model, optimizer, sampler and plain attributes committed and restored together."""

from __future__ import annotations

import copy
from typing import Any

import torch

from horovod.common.elastic import ObjectState

__all__ = ["TorchState"]


class _ModelHandler:
    def __init__(self, value: torch.nn.Module) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        # A copy: Optimizer.load_state_dict keeps the tensors it is given (the momentum buffer became the
        # snapshot, and the next steps changed the commit in place for a second restore).
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        from horovod.torch.functions import broadcast_parameters

        broadcast_parameters(self.value.state_dict(), root_rank=0)
        self.save()


class _OptimizerHandler(_ModelHandler):
    def sync(self) -> None:
        from horovod.torch.functions import broadcast_optimizer_state

        broadcast_optimizer_state(self.value, root_rank=0)
        self.save()


def _handler(value: Any) -> _ModelHandler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    return None


class TorchState(ObjectState):
    """State of a torch job: ``TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)``.

    Modules and optimizers are snapshotted as deep-copied ``state_dict``s and synchronised with
    ``broadcast_parameters``/``broadcast_optimizer_state`` from rank 0; an ``ElasticSampler`` (any object
    with ``state_dict``/``load_state_dict``) and plain values go through :class:`ObjectState`.  Assigning a
    new module or optimizer to a handled attribute re-snapshots it.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        from horovod.common.basics import rank
        from horovod.torch.functions import broadcast_object

        if model is not None:
            kwargs["model"] = model
        if optimizer is not None:
            kwargs["optimizer"] = optimizer
        handlers = {}
        for name in list(kwargs):
            handler = _handler(kwargs[name])
            if handler is not None:
                handlers[name] = handler
                object.__setattr__(self, name, kwargs.pop(name))
        object.__setattr__(self, "_handlers", handlers)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name] = _handler(value) or handlers[name]
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
