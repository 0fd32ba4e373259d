"""``horovod.numpy``: Horovod's collectives on numpy arrays, with the torch adapter's names.

    import numpy as np
    import horovod.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.ones(3), op=hvd.Sum)      # == hvd.size() everywhere
    h = hvd.allreduce_async(np.arange(4.0), name="x")
    mean = hvd.synchronize(h)

Async functions return integer handles; ``synchronize(handle)`` returns the result (``(output,
received_splits)`` for alltoall with splits, a tuple for grouped handles) and raises the collective's error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from horovod.base.exceptions import HorovodInternalError
from horovod.common import ops as _ops
from horovod.common.basics import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    sycl_built,
)
from horovod.common.handles import Group, HandleMap
from horovod.common.objects import allgather_object, broadcast_object
from horovod.common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "synchronize", "poll", "join", "barrier", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline",
]


_handles = HandleMap()


def _resolve_op(op: int | None, average: bool | None) -> int:
    return _ops.handle_average_backwards_compatibility(op, average)


def poll(handle: int) -> bool:
    """True once the operation behind ``handle`` has completed (successfully or not)."""
    return _handles.poll(handle)


def synchronize(handle: int):
    """Wait for ``handle`` and return its result (a tuple for grouped handles, as upstream's torch); raises the
    collective's error."""
    return _handles.synchronize(handle)


# ---------------------------------------------------------------------- allreduce
def allreduce_async(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    return _handles.add(_ops.allreduce(tensor, name=name, op=_resolve_op(op, average),
                                       prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                       process_set=process_set))


def allreduce(tensor: np.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``tensor`` across the process set (default: average) and return a new array."""
    return _ops.allreduce(tensor, name=name, op=_resolve_op(op, average), prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set, wake=False).wait()


def allreduce_async_(tensor: np.ndarray, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    _require_writable(tensor)
    if average is None:  # the common case, without the deprecation shim's call
        op = Average if op is None else op
    else:
        op = _resolve_op(op, average)
    return _handles.add(_ops.allreduce(tensor, tensor, name=name, op=op, prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor, process_set=process_set))


def allreduce_(tensor: np.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place allreduce: the result is written into ``tensor``, which is returned."""
    _require_writable(tensor)
    return _ops.allreduce(tensor, tensor, name=name, op=_resolve_op(op, average), prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set, wake=False).wait()


def _require_writable(tensor: np.ndarray) -> None:
    if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous or not tensor.flags.writeable:
        raise ValueError("Tensor is required to be contiguous.")


def grouped_allreduce_async(tensors: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    return _handles.add(Group(_ops.grouped_allreduce(tensors, name=name, op=_resolve_op(op, average),
                                                     prescale_factor=prescale_factor,
                                                     postscale_factor=postscale_factor, process_set=process_set)))


def grouped_allreduce(tensors: Sequence[np.ndarray], average: bool | None = None, name: str | None = None,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    if not tensors:
        return list(tensors)
    return list(synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                                    postscale_factor, process_set)))


# ---------------------------------------------------------------------- allgather
def allgather_async(tensor: np.ndarray, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _handles.add(_ops.allgather(tensor, name=name, process_set=process_set))


def allgather(tensor: np.ndarray, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every member's ``tensor`` along the first dimension (sizes may differ per rank)."""
    return _ops.allgather(tensor, name=name, process_set=process_set, wake=False).wait()


def grouped_allgather_async(tensors: Sequence[np.ndarray], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    return _handles.add(Group(_ops.grouped_allgather(tensors, name=name, process_set=process_set)))


def grouped_allgather(tensors: Sequence[np.ndarray], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    if not tensors:
        return list(tensors)
    return list(synchronize(grouped_allgather_async(tensors, name, process_set)))


# ---------------------------------------------------------------------- broadcast
def broadcast_async(tensor: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _handles.add(_ops.broadcast(tensor, root_rank, name=name, process_set=process_set))


def broadcast(tensor: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return ``root_rank``'s ``tensor`` on every member (``root_rank`` is a global rank)."""
    return _ops.broadcast(tensor, root_rank, name=name, process_set=process_set, wake=False).wait()


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    _require_writable(tensor)
    return _handles.add(_ops.broadcast(tensor, root_rank, tensor, name=name, process_set=process_set))


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------- alltoall / reducescatter
def alltoall_async(tensor: np.ndarray, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    handle = _ops.alltoall(tensor, splits, name=name, process_set=process_set)
    return _handles.add(_AlltoallHandle(handle, splits is not None))


def alltoall(tensor: np.ndarray, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Scatter slices of ``tensor`` to every member; returns ``(output, received_splits)`` if ``splits``."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


class _AlltoallHandle:
    """Returns ``output`` alone unless the caller passed splits (upstream's convention)."""

    def __init__(self, handle, with_splits: bool) -> None:
        self._handle = handle
        self._with_splits = with_splits

    def done(self) -> bool:
        return self._handle.done()

    def wait(self):
        output, received = self._handle.wait()
        return (output, received) if self._with_splits else output


def reducescatter_async(tensor: np.ndarray, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    return _handles.add(_ops.reducescatter(tensor, name=name, op=op, prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor, process_set=process_set))


def reducescatter(tensor: np.ndarray, name: str | None = None, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce across members and return this member's block of the first dimension."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))


def grouped_reducescatter_async(tensors: Sequence[np.ndarray], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _handles.add(Group(_ops.grouped_reducescatter(tensors, name=name, op=op,
                                                         prescale_factor=prescale_factor,
                                                         postscale_factor=postscale_factor, process_set=process_set)))


def grouped_reducescatter(tensors: Sequence[np.ndarray], name: str | None = None, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[np.ndarray]:
    if not tensors:
        return list(tensors)
    return list(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                        postscale_factor)))


# ---------------------------------------------------------------------- join / barrier
def join() -> int:
    """Stop contributing (other ranks' allreduces see zeros from this rank) until every rank has joined.

    Returns the global rank that joined last."""
    return _ops.join().wait()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    _ops.barrier(process_set).wait()
