"""Turn every rank's request for one tensor name into a response, or into upstream's exact error text.

Pure functions of the requests, so they are unit-tested without any process.  Checks run in upstream's
order; the first failure wins and becomes an ERROR response delivered to every member.  (Checks across the
names of a grouped collective are :mod:`horovod.runtime.group_check`'s.)
"""

from __future__ import annotations

from horovod.base.reduce_ops import ReduceOp
from horovod.runtime.messages import OP_DISPLAY, Request, RequestType, Response, dtype_name

__all__ = ["build_response", "process_set_ranks_error", "shape_str"]

_SAME_SHAPE_TYPES = {RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.BROADCAST,
                     RequestType.REDUCESCATTER}
_SCALED_TYPES = {RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.REDUCESCATTER}


def shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def process_set_ranks_error(ranks: list[int], world_size: int) -> str | None:
    """Upstream core's text for a process set's bad ranks (static at ``init`` or added at run time), or None."""
    for r in ranks:
        if r < 0 or r >= world_size:
            return f"Tried to register process set with invalid rank: {r}"
    seen: set[int] = set()
    for r in ranks:
        if r in seen:
            return f"Tried to register process set with duplicate rank: {r}"
        seen.add(r)
    return None


def _factor(x: float) -> str:
    return f"{x:g}"


def _error(first: Request, names: list[str], message: str) -> Response:
    return Response(RequestType.ERROR, first.process_set_id, names, first.dtype, error=message)


def build_response(requests: list[Request], member_ranks: list[int], joined: set[int]) -> Response:
    """Validate ``requests`` (one per submitting member, any order) and build the response.

    ``member_ranks`` are the set's global ranks in set order; ``joined`` the global ranks that have joined
    (they contribute zeros and sent no request).
    """
    requests = sorted(requests, key=lambda r: r.rank)
    first = requests[0]
    names = [first.name]
    rtype = first.type
    for req in requests[1:]:
        if req.dtype != first.dtype:
            return _error(first, names, f"Mismatched data types: One rank had type {dtype_name(first.dtype)}, "
                                        f"but another rank had type {dtype_name(req.dtype)}.")
    for req in requests[1:]:
        if req.type != rtype:
            return _error(first, names, f"Mismatched operations: One rank did an {OP_DISPLAY[rtype]}, but "
                                        f"another rank did an {OP_DISPLAY[req.type]}.")
    if rtype in _SAME_SHAPE_TYPES:
        for req in requests[1:]:
            if req.shape != first.shape:
                return _error(first, names, f"Mismatched {OP_DISPLAY[rtype]} tensor shapes: One rank sent a "
                                            f"tensor of shape {shape_str(first.shape)}, but another rank sent "
                                            f"a tensor of shape {shape_str(req.shape)}.")
    if rtype in _SCALED_TYPES:
        for req in requests[1:]:
            if (req.prescale, req.postscale) != (first.prescale, first.postscale):
                return _error(first, names, "Mismatched prescale and/or postscale factors: One rank sent "
                                            f"factors ({_factor(first.prescale)}, {_factor(first.postscale)}), "
                                            f"but another rank sent factors ({_factor(req.prescale)}, "
                                            f"{_factor(req.postscale)}).")
        for req in requests[1:]:
            if req.reduce_op != first.reduce_op:
                return _error(first, names, f"Mismatched reduction operation: One rank sent reduction op "
                                            f"{first.reduce_op}, but another rank sent reduction op "
                                            f"{req.reduce_op}.")
    joined_here = bool(joined.intersection(member_ranks))
    if rtype in (RequestType.ALLGATHER, RequestType.ALLTOALL):
        response = _gather_like(requests, member_ranks, joined_here)
        if response.type != RequestType.ERROR:
            device_error = _check_devices(requests, names)
            if device_error.type == RequestType.ERROR:
                return device_error
        return response
    if rtype == RequestType.REDUCESCATTER:
        if joined_here:
            return _error(first, names, "Reducescatter is not supported with Join at this time.")
        if len(first.shape) == 0:
            return _error(first, names, "Process-set rank zero tried to REDUCESCATTER a rank-zero tensor.")
        if first.reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            return _error(first, names, "Reducescatter currently only supports AVERAGE and SUM.")
    if rtype == RequestType.BROADCAST:
        if joined_here:
            return _error(first, names, "Broadcast is not supported with Join at this time.")
        for req in requests[1:]:
            if req.root_rank != first.root_rank:
                return _error(first, names, f"Mismatched BROADCAST root ranks: One rank specified root rank "
                                            f"{first.root_rank}, but another rank specified root rank "
                                            f"{req.root_rank}.")
    if rtype in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET):
        for req in requests[1:]:
            if req.splits != first.splits:
                return _error(first, names, f"Mismatched process set arguments: One rank sent "
                                            f"{list(first.splits)}, but another rank sent {list(req.splits)}.")
    device_error = _check_devices(requests, names)
    if device_error.type == RequestType.ERROR:
        return device_error
    payload = list(first.splits) if rtype in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET) \
        else []
    return Response(rtype, first.process_set_id, names, first.dtype, [first.shape], first.root_rank,
                    first.reduce_op, first.prescale, first.postscale, payload=payload)


def _check_devices(requests: list[Request], names: list[str]) -> Response:
    """Upstream checks CPU/GPU agreement last; returns an ERROR response or a blank ALLREDUCE marker."""
    first = requests[0]
    for req in requests[1:]:
        if req.device != first.device:
            return _error(first, names, f"Mismatched {OP_DISPLAY[first.type]} CPU/GPU device selection: One "
                                        f"rank specified device {_device(first.device)}, but another rank "
                                        f"specified device {_device(req.device)}.")
    return Response(RequestType.ALLREDUCE, first.process_set_id, names)


def _device(device: int) -> str:
    return "CPU" if device < 0 else "GPU"


def _gather_like(requests: list[Request], member_ranks: list[int], joined_here: bool) -> Response:
    first = requests[0]
    names = [first.name]
    op = OP_DISPLAY[first.type]
    if joined_here:
        if first.type == RequestType.ALLGATHER:
            return _error(first, names, "Allgather is not supported with Join at this time. Specify "
                                        "sparse_to_dense=True if using DistributedOptimizer")
        return _error(first, names, "Alltoall is not supported with Join at this time.")
    by_rank = {r.rank: r for r in requests}
    root = by_rank[member_ranks[0]]
    if len(root.shape) == 0:
        return _error(first, names, f"Process-set rank zero tried to {op} a rank-zero tensor.")
    for req in requests:
        if len(req.shape) != len(root.shape):
            return _error(first, names, f"Mismatched {op} tensor shapes: One rank sent a tensor of rank "
                                        f"{len(root.shape)}, but another rank sent a tensor of rank "
                                        f"{len(req.shape)}.")
        for dim in range(1, len(root.shape)):
            if req.shape[dim] != root.shape[dim]:
                return _error(first, names, f"Mismatched {op} tensor shapes: One rank sent a tensor with "
                                            f"dimension {dim} equal to {root.shape[dim]}, but another rank "
                                            f"sent a tensor with dimension {dim} equal to {req.shape[dim]}.")
    ordered = [by_rank[r] for r in member_ranks]
    response = Response(first.type, first.process_set_id, names, first.dtype, [root.shape])
    if first.type == RequestType.ALLGATHER:
        response.rank_dims = [[r.shape[0] for r in ordered]]
    else:
        response.splits = [list(r.splits) for r in ordered]
    return response

