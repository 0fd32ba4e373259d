"""One submit function per collective, shared by every adapter.

Adapters turn their tensors into numpy arrays (zero-copy where the framework allows), call these, and wrap
the result.  Each function validates its arguments with upstream's messages, builds the request and
enqueues it; the sync, async, in-place and grouped variants of the adapters are thin wrappers.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Sequence

import numpy as np

from horovod.base import adasum
from horovod.base.reduce_ops import ReduceOp
from horovod.common import basics
from horovod.common.naming import auto_name
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.runtime.messages import Request, RequestType, dtype_code
from horovod.runtime.queue import Handle
from horovod.transport.buffers import Pieces

__all__ = [
    "handle_average_backwards_compatibility", "allreduce", "grouped_allreduce", "allgather",
    "grouped_allgather", "broadcast", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "auto_name", "Pieces", "check_adasum",
]

_OP_NAMES = {RequestType.ALLREDUCE: "Allreduce", RequestType.ALLGATHER: "Allgather",
             RequestType.BROADCAST: "Broadcast", RequestType.ALLTOALL: "Alltoall",
             RequestType.REDUCESCATTER: "Reducescatter", RequestType.BARRIER: "Barrier",
             RequestType.JOIN: "Join"}
_group_ids = itertools.count(1)


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE


def _set_id(process_set: ProcessSet, rtype: int) -> tuple[int, list[int]]:
    engine = basics.engine()
    op_name = _OP_NAMES.get(rtype, "Operation")
    ps_id = process_set.process_set_id
    ranks = engine.set_ranks(ps_id) if ps_id is not None else None
    if ranks is None:
        raise ValueError(f"{op_name}: Process set provided does not exist, or has not been registered.")
    if engine.rank not in ranks:
        raise ValueError(f"{op_name}: Rank {engine.rank} is not a member of the provided process set.")
    return ps_id, ranks


def _array(tensor) -> np.ndarray:
    """The input as a C-contiguous array: a strided view (``x[::2]``, ``m.T``) is copied once here, since every
    data plane reads and sends flat bytes (mpi4py and the sockets refuse strided buffers)."""
    arr = tensor if type(tensor) is np.ndarray else np.asarray(tensor)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _tensor_name(name, prefix: str, ps_id: int) -> str:
    """``name``, or a generated one when it is empty.  A name the other ranks cannot be sent (not a ``str``,
    or not encodable as UTF-8: a lone surrogate from a file name) is refused here, at the call, as upstream's
    ``name.encode()`` refused it: found by the engine's next send, it failed every rank's operations and
    ended the job."""
    if not name:
        return auto_name(prefix, ps_id)
    if not isinstance(name, str):
        raise TypeError(f"a tensor name must be a str, got {type(name).__name__} {name!r}")
    if not name.isascii():
        try:
            name.encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"the tensor name {name!r} cannot be encoded as UTF-8 to be sent to the other "
                             f"ranks: {e.reason} at position {e.start}") from None
    return name


def _enqueue(items: list[tuple[Request, np.ndarray | None, np.ndarray | None]]) -> list[Handle]:
    return basics.engine().enqueue(items)


_PLAIN_OPS = frozenset((ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT))


def check_adasum(dtype) -> None:
    """Adasum reduces float tensors only (ValueError), as upstream's core."""
    adasum.check_dtype(dtype)


def _check_op(op: int, rtype: int) -> None:
    if op in _PLAIN_OPS and rtype != RequestType.REDUCESCATTER:
        return
    if op == ReduceOp.ADASUM and rtype == RequestType.ALLREDUCE:
        return  # check_adasum needs the dtype: the caller checks
    if op not in _PLAIN_OPS and op != ReduceOp.ADASUM:
        raise ValueError(f"Unknown reduction op {op}")
    if rtype == RequestType.REDUCESCATTER and op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("Reducescatter currently only supports AVERAGE and SUM.")


def allreduce(tensor, output: np.ndarray | None = None, *, name: str | None = None, op: int = ReduceOp.AVERAGE,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, wake: bool = True, send_now: bool = False) -> Handle:
    """Enqueue an allreduce; ``output`` (may be ``tensor`` itself) receives the result in place.

    ``tensor`` may be :class:`~horovod.transport.buffers.Pieces` (several arrays reduced as their 1-D
    concatenation, which the shared-memory transport never makes).

    ``wake=False`` when the caller calls ``wait()`` right away: the waiting thread runs the engine's round
    itself, so waking the engine thread would only cost a thread hand-over.  ``send_now=True`` when another
    thread waits for it: the request leaves from this thread at once (see ``Engine._send_now``)."""
    arr = tensor if type(tensor) is Pieces else _array(tensor)
    if op not in _PLAIN_OPS:
        _check_op(op, RequestType.ALLREDUCE)
        if op == ReduceOp.ADASUM:
            check_adasum(arr.dtype)
    if process_set is global_process_set:  # always registered, every rank a member: no lookup
        engine = basics.engine()
        ps_id = 0
    else:
        ps_id, _ = _set_id(process_set, RequestType.ALLREDUCE)
        engine = basics.engine()
    req = Request(RequestType.ALLREDUCE, ps_id, _tensor_name(name, "allreduce", ps_id), dtype_code(arr.dtype),
                  arr.shape, -1, op, float(prescale_factor), float(postscale_factor))
    return engine.enqueue_one(req, arr, output, wake, send_now)


def grouped_allreduce(tensors: Sequence, outputs: Sequence | None = None, *, name: str | None = None,
                      op: int = ReduceOp.AVERAGE, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, _grouped: bool = True) -> list[Handle]:
    _check_op(op, RequestType.ALLREDUCE)
    arrays = [_array(t) for t in tensors]
    if op == ReduceOp.ADASUM:
        for arr in arrays:
            check_adasum(arr.dtype)
    ps_id, _ = _set_id(process_set, RequestType.ALLREDUCE)
    base = _tensor_name(name, "grouped_allreduce" if _grouped else "allreduce", ps_id)
    group_id = next(_group_ids) if _grouped and len(arrays) > 1 else -1
    group_size = len(arrays) if _grouped else 0
    items = []
    for i, arr in enumerate(arrays):
        tname = f"{base}_{i + 1}of{len(arrays)}" if _grouped else base
        req = Request(RequestType.ALLREDUCE, ps_id, tname, dtype_code(arr.dtype), arr.shape, -1, op,
                      float(prescale_factor), float(postscale_factor), group_id, group_size=group_size)
        items.append((req, arr, None if outputs is None else outputs[i]))
    return _enqueue(items)


def allgather(tensor, *, name: str | None = None, process_set: ProcessSet = global_process_set,
              wake: bool = True) -> Handle:
    """Enqueue an allgather; ``wake=False`` when the caller waits for it right away (see :func:`allreduce`)."""
    ps_id, _ = _set_id(process_set, RequestType.ALLGATHER)
    arr = _array(tensor)
    req = Request(RequestType.ALLGATHER, ps_id, _tensor_name(name, "allgather", ps_id), dtype_code(arr.dtype),
                  arr.shape)
    return basics.engine().enqueue_one(req, arr, None, wake)


def grouped_allgather(tensors: Sequence, *, name: str | None = None,
                      process_set: ProcessSet = global_process_set, _grouped: bool = True) -> list[Handle]:
    ps_id, _ = _set_id(process_set, RequestType.ALLGATHER)
    arrays = [_array(t) for t in tensors]
    base = _tensor_name(name, "grouped_allgather" if _grouped else "allgather", ps_id)
    group_size = len(arrays) if _grouped else 0
    items = []
    for i, arr in enumerate(arrays):
        tname = f"{base}_{i + 1}of{len(arrays)}" if _grouped else base
        items.append((Request(RequestType.ALLGATHER, ps_id, tname, dtype_code(arr.dtype), arr.shape,
                              group_size=group_size), arr, None))
    return _enqueue(items)


def root_rank_index(root_rank) -> int:
    """``root_rank`` as an int: an int, numpy integer or integer 0-d tensor; anything else (``'0'``, ``0.5``)
    is a TypeError saying so, not a conversion to some rank or a misleading "invalid root rank"."""
    try:
        return operator.index(root_rank)
    except TypeError:
        raise TypeError(f"broadcast's root_rank must be an int (a global rank), got {type(root_rank).__name__} "
                        f"{root_rank!r}") from None


def broadcast(tensor, root_rank: int, output: np.ndarray | None = None, *, name: str | None = None,
              process_set: ProcessSet = global_process_set, wake: bool = True) -> Handle:
    """Enqueue a broadcast; ``wake=False`` when the caller waits for it right away (see :func:`allreduce`)."""
    ps_id, ranks = _set_id(process_set, RequestType.BROADCAST)
    root_rank = root_rank_index(root_rank)
    if root_rank not in ranks:
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set")
    arr = _array(tensor)
    req = Request(RequestType.BROADCAST, ps_id, _tensor_name(name, "broadcast", ps_id), dtype_code(arr.dtype),
                  arr.shape, root_rank)
    return basics.engine().enqueue_one(req, arr, output, wake)


def alltoall(tensor, splits=None, *, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Handle:
    """Result of the handle: ``(output, received_splits)``."""
    ps_id, ranks = _set_id(process_set, RequestType.ALLTOALL)
    arr = _array(tensor)
    n = len(ranks)
    dim0 = arr.shape[0] if arr.ndim else 0
    if splits is None:
        if arr.ndim == 0 or dim0 % n != 0:
            raise ValueError("splits not provided, but first dimension of tensor is not an even multiple of "
                             "the number of workers.")
        split_list = [dim0 // n] * n
    else:
        s = np.asarray(splits)
        if s.ndim != 1:
            raise ValueError("alltoall expects a 1D splits tensor")
        if s.dtype.kind not in "iu":
            raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
        split_list = [int(x) for x in s]
        if len(split_list) != n:
            raise ValueError("Number of entries in splits does not equal number of workers.")
        if any(x < 0 for x in split_list):
            raise ValueError("alltoall expects non-negative splits.")
        if sum(split_list) > dim0:
            raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    req = Request(RequestType.ALLTOALL, ps_id, _tensor_name(name, "alltoall", ps_id), dtype_code(arr.dtype), arr.shape,
                  splits=tuple(split_list))
    return _enqueue([(req, arr, None)])[0]


def reducescatter(tensor, *, name: str | None = None, op: int = ReduceOp.AVERAGE, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Handle:
    return grouped_reducescatter([tensor], name=name, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set,
                                 _grouped=False)[0]


def grouped_reducescatter(tensors: Sequence, *, name: str | None = None, op: int = ReduceOp.AVERAGE,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set, _grouped: bool = True) -> list[Handle]:
    _check_op(op, RequestType.REDUCESCATTER)
    ps_id, _ = _set_id(process_set, RequestType.REDUCESCATTER)
    arrays = [_array(t) for t in tensors]
    base = _tensor_name(name, "grouped_reducescatter" if _grouped else "reducescatter", ps_id)
    group_size = len(arrays) if _grouped else 0
    items = []
    for i, arr in enumerate(arrays):
        tname = f"{base}_{i + 1}of{len(arrays)}" if _grouped else base
        items.append((Request(RequestType.REDUCESCATTER, ps_id, tname, dtype_code(arr.dtype), arr.shape, -1, op,
                              float(prescale_factor), float(postscale_factor), group_size=group_size), arr, None))
    return _enqueue(items)


def join() -> Handle:
    """Result: the global rank that joined last."""
    basics.engine()
    return _enqueue([(Request(RequestType.JOIN, 0, "join.noname"), None, None)])[0]


def barrier(process_set: ProcessSet = global_process_set) -> Handle:
    ps_id, _ = _set_id(process_set, RequestType.BARRIER)
    return _enqueue([(Request(RequestType.BARRIER, ps_id, "barrier.noname"), None, None)])[0]
