"""Broadcasting model parameters, optimizer state and Python objects from one rank to the others."""

from __future__ import annotations

import logging
from typing import Any

import torch

from horovod.common import basics
from horovod.common.objects import allgather_object as _allgather_object
from horovod.common.objects import broadcast_object as _broadcast_object
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch.mpi_ops import _run_outside_compile, broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]

log = logging.getLogger(__name__)


def broadcast_parameters(params, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` in place with ``root_rank``'s values (all broadcasts run together).

    ``params`` is a dict such as ``model.state_dict()`` (sorted by name), or a list of tensors or of
    ``(name, tensor)`` pairs such as ``model.named_parameters()``.

    Example::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):  # model.parameters() or list(model.named_parameters())
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, p in items:
        if p is None:
            continue
        handles.append(broadcast_async_(p, root_rank, name=name, process_set=process_set))
    for h in handles:
        synchronize(h)


def _split_state(state_dict: dict) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """Replace every tensor in the optimizer's ``state`` by a placeholder; return the skeleton and tensors."""
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton_state = {}
    for pid, pstate in state_dict["state"].items():
        entry = {}
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                entry[key] = ("__tensor__", len(tensors), tuple(value.shape), value.dtype)
                tensors.append((f"{pid}.{key}", value))
            else:
                entry[key] = value
        skeleton_state[pid] = entry
    return {"state": skeleton_state, "param_groups": state_dict["param_groups"]}, tensors


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state (moments, step counts, param-group options) equal ``root_rank``'s.

    Unlike upstream, this never runs ``optimizer.step()``: the root's state is not touched at all (results
    with and without Horovod are bit-identical at np=1), and the other ranks load the root's state dict, so a
    fresh optimizer receives the state of a resumed one.  ``model`` is accepted for compatibility.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if process_set.size() == 1:
        return
    is_root = basics.rank() == root_rank
    kind = f"{optimizer.__class__.__module__}.{optimizer.__class__.__qualname__}"  # a DistributedOptimizer's: its own
    skeleton, tensors = _split_state(optimizer.state_dict()) if is_root else (None, [])
    if is_root:
        skeleton["horovod.optimizer"] = kind
    skeleton = _broadcast_object(skeleton, root_rank, name="optimizer_state.skeleton", process_set=process_set)
    root_kind = skeleton.pop("horovod.optimizer", kind)
    if not is_root:
        tensors = []
        for pid, entry in skeleton["state"].items():
            for key, value in entry.items():
                if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
                    _, _, shape, dtype = value
                    t = torch.empty(shape, dtype=dtype)
                    entry[key] = t
                    tensors.append((f"{pid}.{key}", t))
    handles = [broadcast_async_(t if t.is_contiguous() else t.contiguous(), root_rank,
                                name=f"optimizer_state.{name}", process_set=process_set)
               for name, t in tensors]
    for h in handles:
        synchronize(h)
    if root_kind != kind:  # after the broadcasts, which the root waits for: its state is right, this rank's is not
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer is a {root_kind}, this rank's "
                         f"(rank {basics.rank()}) a {kind}: every rank must build the same optimizer")
    if not is_root:
        optimizer.load_state_dict(skeleton)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` (any picklable object) on every member of ``process_set``."""
    return _broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every member's ``obj``, ordered by rank."""
    return _allgather_object(obj, name, process_set)


_run_outside_compile(globals(), __all__)  # collectives inside torch.compile run eagerly (mpi_ops)
