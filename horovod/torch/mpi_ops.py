"""Horovod's collectives on torch tensors: thin wrappers around :mod:`horovod.common.ops`.

Every collective has one body, :func:`_submit`, which checks the tensors (upstream's error texts), hands
CPU tensors to the engine without a copy (``tensor.numpy()``; bfloat16 as a bit-identical ``ml_dtypes``
view), routes device tensors through :mod:`horovod.torch.device` and wraps the engine handles in a
:class:`_Pending` that turns numpy results back into tensors.  Sync, async, in-place and grouped variants
are a few lines each on top of it.

Async calls return integer handles.  ``_handle_map`` keeps each pending operation — and through it the
input and output tensors — alive until ``synchronize``: the engine reads and writes those buffers after
the async call has returned, so they must not be freed or reused earlier.

``torch.compile``: every public function here (and in ``horovod.torch.functions``) runs outside Dynamo
(:func:`_outside_compile`): a collective inside a compiled function is a graph break and runs eagerly, as
upstream's C++ op did, instead of Dynamo tracing the engine's numpy code that this thread may run.

Dtypes: upstream's (allreduce/reducescatter: int32, int64, float16, float32, float64; allgather,
broadcast, alltoall also uint8, int8, int16), plus bfloat16 everywhere and bool for allgather, broadcast
and alltoall (documented in docs/torch.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.base import dtypes as _dtypes
from horovod.base.exceptions import HorovodInternalError
from horovod.base.reduce_ops import data_plane_op
from horovod.common import basics
from horovod.common import ops as _ops
from horovod.common.basics import Adasum, Average, Max, Min, Product, Sum
from horovod.common.handles import HandleMap
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch import device as _device
from horovod.torch.compression import Compression

__all__ = [
    "init", "shutdown", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async", "join", "barrier", "poll", "synchronize",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
]

_REDUCE_DTYPES = frozenset({torch.int32, torch.int64, torch.float16, torch.float32, torch.float64} |
                           ({torch.bfloat16} if _dtypes.HAS_BFLOAT16 else set()))
_MOVE_DTYPES = _REDUCE_DTYPES | {torch.uint8, torch.int8, torch.int16, torch.bool}

_handle_map = HandleMap()
_basics = basics.HorovodBasics()  # upstream's module attribute (its tests call _basics._get_process_set_ids...)


# ---------------------------------------------------------------------- init / shutdown
def init(comm=None, process_sets=None) -> None:
    """Start Horovod (see ``horovod.common.basics.init``); handle numbering restarts at 1."""
    if not basics.is_initialized():
        _handle_map.reset()
    basics.init(comm, process_sets)


def shutdown() -> None:
    """Stop Horovod; pending operations fail with the shut-down error."""
    basics.shutdown()
    _handle_map.reset()


# ---------------------------------------------------------------------- tensors <-> numpy
def _as_array(tensor: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_dtypes.bfloat16())  # (ml_dtypes, imported now)
    return tensor.numpy()


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over an engine result."""
    if not array.flags.writeable:
        array = array.copy()
    if _dtypes.is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _check(tensor: torch.Tensor, dtypes: frozenset, inplace: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"Expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.dtype not in dtypes:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    if inplace and not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def _name(prefix: str, name: str | None) -> str | None:
    """Upstream's core names: ``allreduce.<name>``; unnamed ones are numbered by ``ops.auto_name``."""
    return None if name is None else f"{prefix}.{name}"


class _Pending:
    """Engine handles of one call plus how to turn their numpy results into the caller's tensors."""

    __slots__ = ("_handles", "_finish", "_keep")

    def __init__(self, handles: Sequence[Any], finish: Callable[[list], Any], keep: Any = None) -> None:
        self._handles = handles
        self._finish = finish
        self._keep = keep  # inputs/outputs (and staging copies) stay alive until completion

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self) -> Any:
        try:
            results = [h.wait() for h in self._handles]
        except (HorovodInternalError, ValueError):
            raise
        except RuntimeError as e:
            raise HorovodInternalError(e) from e
        return self._finish(results)


def _submit(kind: str, tensors: Sequence[torch.Tensor], *, inplace: bool, grouped: bool,
            process_set: ProcessSet, wake: bool = True, **kwargs: Any) -> _Pending:
    """The one body behind every collective: check, stage, enqueue, and describe how to finish.

    ``wait()`` of the result returns a list with one entry per tensor (a tensor; ``(output,
    received_splits)`` for alltoall).  ``wake=False`` (a lone allgather or broadcast waited for right away):
    the waiting thread runs the engine's round itself (see ``horovod.common.ops.allreduce``)."""
    tensors = list(tensors)
    dtypes = _REDUCE_DTYPES if kind in ("allreduce", "reducescatter") else _MOVE_DTYPES
    for t in tensors:
        _check(t, dtypes, inplace)
    if grouped and len({t.device for t in tensors}) > 1:
        raise RuntimeError("Tensors in list must be on same device.")
    backend = _device.device_backend_for(kind, tensors, process_set)
    if backend is not None:
        handle = backend.submit(kind, tensors, tensors if inplace else None, process_set=process_set, **kwargs)
        return _Pending([handle], lambda results: results[0], tensors)
    hosts = [t if _device.on_host(t) else _device.staging.to_host(t) for t in tensors]
    hosts = [h if h.is_contiguous() else h.contiguous() for h in hosts]
    arrays = [_as_array(h) for h in hosts]
    outputs = arrays if inplace else None
    if kind == "allreduce":
        handles = _ops.grouped_allreduce(arrays, outputs, process_set=process_set, _grouped=grouped, **kwargs)
    elif kind == "allgather" and not grouped and len(arrays) == 1:
        handles = [_ops.allgather(arrays[0], process_set=process_set, wake=wake, **kwargs)]
    elif kind == "allgather":
        handles = _ops.grouped_allgather(arrays, process_set=process_set, _grouped=grouped, **kwargs)
    elif kind == "reducescatter":
        handles = _ops.grouped_reducescatter(arrays, process_set=process_set, _grouped=grouped, **kwargs)
    elif kind == "broadcast":
        handles = [_ops.broadcast(arrays[0], kwargs.pop("root_rank"), outputs[0] if inplace else None,
                                  process_set=process_set, wake=wake, **kwargs)]
    elif kind == "alltoall":
        handles = [_ops.alltoall(arrays[0], kwargs.pop("splits"), process_set=process_set, **kwargs)]
    else:  # pragma: no cover - internal misuse
        raise ValueError(f"unknown collective {kind}")

    def finish(results: list) -> list:
        out = []
        for original, host, result in zip(tensors, hosts, results):
            if kind == "alltoall":
                result, received = result
                out.append((_deliver(original, host, result, False), torch.from_numpy(received)))
            else:
                out.append(_deliver(original, host, result, inplace))
        return out

    return _Pending(handles, finish, (tensors, hosts, arrays))


def _deliver(original: torch.Tensor, host: torch.Tensor, result: np.ndarray, inplace: bool) -> torch.Tensor:
    if inplace:  # the engine wrote into ``host``: the caller's memory, or a staging copy of it
        if host is not original and not _device.on_host(original):
            _device.staging.copy_back(host, original)
        return original
    out = _as_tensor(result)
    return out if _device.on_host(original) else _device.staging.to_device(out, original)


def _single(pending: _Pending) -> _Pending:
    """The same pending operation, returning its only result instead of a one-element list."""
    return _Pending([pending], lambda results: results[0][0])


def _tuple(pending: _Pending) -> _Pending:
    return _Pending([pending], lambda results: tuple(results[0]))


# ---------------------------------------------------------------------- handles
def poll(handle: int) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed (with or without error)."""
    return _handle_map.poll(handle)


def synchronize(handle: int):
    """Wait for an asynchronous operation and return its output (a tuple for grouped handles and for
    ``alltoall``: ``(output, received_splits)``).  Raises ``HorovodInternalError`` if it failed, and
    ``ValueError`` for an unknown or already synchronized handle (upstream returned None)."""
    return _handle_map.synchronize(handle)


# ---------------------------------------------------------------------- allreduce
def _allreduce_pending(tensors, inplace, grouped, average, name, op, prescale_factor, postscale_factor,
                       process_set) -> _Pending:
    op = _ops.handle_average_backwards_compatibility(op, average)
    prefix = "grouped_allreduce" if grouped else "allreduce"
    return _submit("allreduce", tensors, inplace=inplace, grouped=grouped, process_set=process_set,
                   name=_name(prefix, name), op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start averaging (default), summing, ... ``tensor`` over the process set; returns a handle for
    ``synchronize``, whose result is a new tensor."""
    return _handle_map.add(_single(_allreduce_pending([tensor], False, False, average, name, op, prescale_factor,
                                                      postscale_factor, process_set)))


class _InPlace:
    """The pending in-place allreduce of one CPU tensor (the per-gradient path): the engine writes into the
    tensor's own memory, so finishing is returning it."""

    __slots__ = ("_handle", "_tensor")

    def __init__(self, handle: Any, tensor: torch.Tensor) -> None:
        self._handle = handle
        self._tensor = tensor  # keeps the memory the engine writes alive until synchronize

    def done(self) -> bool:
        return self._handle.done()

    def wait(self) -> torch.Tensor:
        try:
            self._handle.wait()
        except (HorovodInternalError, ValueError):
            raise
        except RuntimeError as e:
            raise HorovodInternalError(e) from e
        return self._tensor


# In-place allreduces of these go to the engine without the general path's staging and wrapping.
_DIRECT_DTYPES = frozenset({torch.int32, torch.int64, torch.float16, torch.float32, torch.float64})


def _inplace_direct(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                    wake: bool = True) -> _InPlace | None:
    """The general path's result for a dense, contiguous CPU tensor that needs no gradient, in a fraction of
    its time (this runs once per gradient per step); None for anything else, which takes the general path
    (and gets its checks and error texts)."""
    if type(tensor) is not torch.Tensor or tensor.dtype not in _DIRECT_DTYPES or tensor.layout != torch.strided \
            or tensor.requires_grad or not tensor.is_contiguous() or not _device.on_host(tensor):
        return None
    if average is None:
        op = Average if op is None else op
    else:
        op = _ops.handle_average_backwards_compatibility(op, average)
    arr = tensor.numpy()
    handle = _ops.allreduce(arr, arr, name=None if name is None else f"allreduce.{name}", op=op,
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            process_set=process_set, wake=wake)
    return _InPlace(handle, tensor)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place ``allreduce_async``: the result is written into ``tensor``."""
    direct = _inplace_direct(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    if direct is not None:
        return _handle_map.add(direct)
    return _handle_map.add(_single(_allreduce_pending([tensor], True, False, average, name, op, prescale_factor,
                                                      postscale_factor, process_set)))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce (not differentiable); returns ``tensor``."""
    direct = _inplace_direct(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                             wake=False)  # waited for right away: this thread runs the engine's round
    if direct is not None:
        return direct.wait()
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Differentiable allreduce returning a new tensor; the gradient is the same allreduce of the gradient.

    Example::

        total = hvd.allreduce(torch.ones(3), op=hvd.Sum)   # == hvd.size() everywhere
    """
    compressed, ctx = compression.compress(tensor)
    reduced = _HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                                      process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one allreduce of several tensors (negotiated and fused together); ``synchronize`` returns a
    tuple."""
    return _handle_map.add(_tuple(_allreduce_pending(tensors, False, True, average, name, op, prescale_factor,
                                                     postscale_factor, process_set)))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """In-place ``grouped_allreduce_async``."""
    return _handle_map.add(_tuple(_allreduce_pending(tensors, True, True, average, name, op, prescale_factor,
                                                     postscale_factor, process_set)))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the list of (updated) input tensors."""
    if not tensors:
        return list(tensors)
    return list(synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                     postscale_factor, process_set)))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression=Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Differentiable allreduce of a list of tensors in one negotiation; returns a list."""
    if not tensors:
        return list(tensors)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                             *[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# ---------------------------------------------------------------------- allgather
def _allgather_pending(tensors, grouped, name, process_set, wake: bool = True) -> _Pending:
    return _submit("allgather", tensors, inplace=False, grouped=grouped, process_set=process_set, wake=wake,
                   name=_name("grouped_allgather" if grouped else "allgather", name))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every member's ``tensor`` along dimension 0 (first dims may differ)."""
    return _handle_map.add(_single(_allgather_pending([tensor], False, name, process_set)))


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Differentiable allgather; the gradient is the averaged gradient's slice of this rank."""
    return _HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return _handle_map.add(_tuple(_allgather_pending(tensors, True, name, process_set)))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Differentiable allgather of several tensors in one negotiation; returns a list."""
    if not tensors:
        return list(tensors)
    return list(_HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ---------------------------------------------------------------------- broadcast
def _broadcast_pending(tensor, root_rank, inplace, name, process_set, wake: bool = True) -> _Pending:
    return _single(_submit("broadcast", [tensor], inplace=inplace, grouped=False, process_set=process_set,
                           wake=wake, root_rank=root_rank, name=_name("broadcast", name)))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``root_rank``'s ``tensor`` (a global rank) to every member; result is a new tensor."""
    return _handle_map.add(_broadcast_pending(tensor, root_rank, False, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """In-place ``broadcast_async``: ``tensor`` receives the root's values."""
    return _handle_map.add(_broadcast_pending(tensor, root_rank, True, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Differentiable broadcast; the gradient is the averaged gradient on the root and zero elsewhere."""
    return _HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast (not differentiable); returns ``tensor``."""
    return _broadcast_pending(tensor, root_rank, True, name, process_set, wake=False).wait()


# ---------------------------------------------------------------------- alltoall
def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[i]`` rows of ``tensor`` to member ``i`` (even split if None);
    ``synchronize`` returns ``(output, received_splits)``."""
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    return _handle_map.add(_single(_submit("alltoall", [tensor], inplace=False, grouped=False,
                                           process_set=process_set, splits=splits,
                                           name=_name("alltoall", name))))


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Differentiable alltoall; returns ``output``, or ``(output, received_splits)`` if ``splits`` is given."""
    output, received = _HorovodAlltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ---------------------------------------------------------------------- reducescatter
def _reducescatter_pending(tensors, grouped, name, op, process_set, prescale_factor, postscale_factor):
    return _submit("reducescatter", tensors, inplace=False, grouped=grouped, process_set=process_set,
                   name=_name("grouped_reducescatter" if grouped else "reducescatter", name), op=op,
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing over the members; each gets its block of dimension 0 (the first ``dim0 % n``
    members one row more)."""
    return _handle_map.add(_single(_reducescatter_pending([tensor], False, name, op, process_set, prescale_factor,
                                                          postscale_factor)))


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Differentiable reducescatter; gradient: scaled like the forward, then allgathered."""
    compressed, ctx = compression.compress(tensor)
    out = _HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _handle_map.add(_tuple(_reducescatter_pending(tensors, True, name, op, process_set, prescale_factor,
                                                         postscale_factor)))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None, compression=Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Differentiable reducescatter of several tensors in one negotiation; returns a list."""
    if not tensors:
        return list(tensors)
    pairs = [compression.compress(t) for t in tensors]
    out = _HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                             *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs)]


# ---------------------------------------------------------------------- sparse, join, barrier
def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Allreduce a sparse COO tensor as two allgathers (indices, values); returns a callable that waits
    and returns the (uncoalesced) sparse result.  Only Sum and Average."""
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with sparse allreduce")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates along dim 0, so send the indices transposed (one row per non-zero)
    indices = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    values = t.values()
    _, post = data_plane_op(op, 1.0, process_set.size())  # Average: Sum, then / size
    if post != 1.0:
        values = values * post
    values_handle = allgather_async(values.contiguous(), name=f"{name}.values", process_set=process_set)

    def wait() -> torch.Tensor:
        idx = synchronize(indices)
        vals = synchronize(values_handle)
        # gathered from valid sparse tensors; an implicit setting makes torch warn once on every rank
        return torch.sparse_coo_tensor(idx.t(), vals, t.size(), check_invariants=False)

    return wait


def join(device: int = -1) -> int:
    """Stop contributing until every rank has joined (joined ranks add zeros to allreduces); returns the
    rank that joined last.  ``device`` is accepted for compatibility."""
    try:
        return int(_ops.join().wait())
    except (HorovodInternalError, ValueError):
        raise
    except RuntimeError as e:
        raise HorovodInternalError(e) from e


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of ``process_set`` has reached the barrier."""
    _ops.barrier(process_set).wait()


# ---------------------------------------------------------------------- autograd
def _wait(pending: _Pending) -> list:
    return pending.wait()


class _HorovodAllreduce(torch.autograd.Function):
    """Allreduce; the gradient is the same allreduce (op and factors) of the incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return _wait(_allreduce_pending([tensor], False, False, average, name, op, prescale_factor,
                                        postscale_factor, process_set))[0]

    @staticmethod
    def backward(ctx, grad_output):
        average, op, pre, post, ps = ctx.args
        grad = allreduce(grad_output.contiguous(), average=average, op=op, prescale_factor=pre,
                         postscale_factor=post, process_set=ps)
        return grad, None, None, None, None, None, None


class _HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(_wait(_allreduce_pending(tensors, False, True, average, name, op, prescale_factor,
                                              postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, pre, post, ps = ctx.args
        out = grouped_allreduce([g.contiguous() for g in grads], average=average, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=ps)
        return (None,) * 6 + tuple(out)


def _allgather_grad(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """Upstream's allgather gradient: average the gradient over the set, keep this member's rows."""
    reduced = allreduce(grad.contiguous(), op=Average, process_set=process_set)
    counts = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offset = int(counts[:process_set.rank()].sum())
    return reduced.narrow(0, offset, rows)


class _HorovodAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return _wait(_allgather_pending([tensor], False, name, process_set, wake=False))[0]

    @staticmethod
    def backward(ctx, grad_output):
        return _allgather_grad(grad_output, ctx.rows, ctx.process_set), None, None


class _HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(_wait(_allgather_pending(tensors, True, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_allgather_grad(g, r, ctx.process_set) for g, r in zip(grads, ctx.rows))


class _HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return _wait(_broadcast_pending(tensor, root_rank, False, name, process_set, wake=False))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


class _HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        if isinstance(splits, torch.Tensor):
            splits = splits.detach().cpu().numpy()
        pending = _submit("alltoall", [tensor], inplace=False, grouped=False, process_set=process_set,
                          splits=splits, name=_name("alltoall", name))
        output, received = _wait(pending)[0]
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_dead):
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def _reducescatter_grad(grad: torch.Tensor, op: int, process_set: ProcessSet, pre: float,
                        post: float) -> torch.Tensor:
    """Upstream's reducescatter gradient: × set size for Sum, × the factors, then allgather."""
    if op == Sum:
        grad = grad * process_set.size()
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return allgather(grad.contiguous(), process_set=process_set)


class _HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return _wait(_reducescatter_pending([tensor], False, name, op, process_set, prescale_factor,
                                            postscale_factor))[0]

    @staticmethod
    def backward(ctx, grad_output):
        return (_reducescatter_grad(grad_output, *ctx.args),) + (None,) * 5


class _HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(_wait(_reducescatter_pending(tensors, True, name, op, process_set, prescale_factor,
                                                  postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 5 + tuple(_reducescatter_grad(g, *ctx.args) for g in grads)


# ---------------------------------------------------------------------- torch.compile
def _outside_compile(fn: Callable) -> Callable:
    """``fn`` run outside Dynamo (``torch.compiler.disable``, recursive): inside a compiled function the call
    is a graph break and everything below it -- the engine's round, which the waiting thread may run itself,
    numpy, sockets -- runs eagerly instead of being traced.  The disabled wrapper is made on the first call,
    so importing ``horovod.torch`` does not import ``torch._dynamo`` (a second of start-up; a torch optimizer
    imports it anyway); an eager call costs well under a microsecond more."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


def _run_outside_compile(namespace: dict[str, Any], names: Sequence[str]) -> None:
    """Replace the functions among ``names`` in a module's ``namespace`` by :func:`_outside_compile` ones, so
    that every importer (``horovod.torch``, ``SyncBatchNorm``, ``DistributedOptimizer``'s hooks) gets them."""
    for name in names:
        if inspect.isfunction(namespace[name]):
            namespace[name] = _outside_compile(namespace[name])


_run_outside_compile(globals(), __all__)
