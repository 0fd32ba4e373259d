"""Requests (worker → coordinator) and responses (coordinator → workers), and their wire codec.

The codec is compact JSON lists — no pickle: a malicious or corrupted frame can only fail validation, which
raises :class:`~horovod.common.exceptions.WireError`.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field

import numpy as np

from horovod.common.exceptions import WireError

__all__ = ["RequestType", "Request", "Response", "DTYPES", "dtype_code", "dtype_name",
           "encode_requests", "decode_requests", "encode_responses", "decode_responses"]


class RequestType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    JOIN = 3
    ADASUM = 4
    ALLTOALL = 5
    BARRIER = 6
    REDUCESCATTER = 7
    # Internal collectives that reuse negotiation (dynamic process sets).
    ADD_PROCESS_SET = 20
    REMOVE_PROCESS_SET = 21
    # Responses only.
    ERROR = 30


_REQUEST_TYPES = {t.value for t in RequestType if t != RequestType.ERROR}
_RESPONSE_TYPES = {t.value for t in RequestType}

OP_DISPLAY = {  # names used in upstream's error texts ("One rank did an ALLREDUCE")
    RequestType.ALLREDUCE: "ALLREDUCE", RequestType.ALLGATHER: "ALLGATHER",
    RequestType.BROADCAST: "BROADCAST", RequestType.JOIN: "JOIN", RequestType.ADASUM: "ADASUM",
    RequestType.ALLTOALL: "ALLTOALL", RequestType.BARRIER: "BARRIER",
    RequestType.REDUCESCATTER: "REDUCESCATTER", RequestType.ADD_PROCESS_SET: "ADD_PROCESS_SET",
    RequestType.REMOVE_PROCESS_SET: "REMOVE_PROCESS_SET", RequestType.ERROR: "ERROR",
}


def _dtypes() -> list[np.dtype]:
    names = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
    dtypes = [np.dtype(n) for n in names]
    try:
        import ml_dtypes

        dtypes.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:  # bfloat16 is optional
        pass
    return dtypes


DTYPES: list[np.dtype] = _dtypes()
_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}


def dtype_code(dtype: np.dtype) -> int:
    """Wire code of a numpy dtype; ValueError for unsupported dtypes."""
    try:
        return _DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"Tensor type {np.dtype(dtype)} is not supported.") from None


def dtype_name(code: int) -> str:
    return str(DTYPES[code])


@dataclass(slots=True)
class Request:
    """One rank's announcement that a named tensor is ready for a collective."""

    type: int
    process_set_id: int
    name: str
    dtype: int = 0
    shape: tuple[int, ...] = ()
    root_rank: int = -1
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    group_id: int = -1
    splits: tuple[int, ...] = ()
    device: int = -1
    rank: int = -1  # global rank of the sender; filled in by the coordinator from the channel
    inline: int = -1  # index of the tensor's bytes among the frame's blobs (small allreduces), -1 = none

    def signature(self) -> tuple:
        """Everything that must match for a cached response to be reused."""
        return (self.type, self.dtype, self.shape, self.root_rank, self.reduce_op, self.prescale,
                self.postscale, self.splits, self.device)

    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    def to_list(self) -> list:
        return [self.type, self.process_set_id, self.name, self.dtype, list(self.shape), self.root_rank,
                self.reduce_op, self.prescale, self.postscale, self.group_id, list(self.splits), self.device,
                self.inline]

    @classmethod
    def from_list(cls, item: list, rank: int) -> Request:
        try:
            (rtype, ps, name, dtype, shape, root, op, pre, post, group, splits, device, inline) = item
            req = cls(int(rtype), int(ps), str(name), int(dtype), tuple(int(d) for d in shape), int(root),
                      int(op), float(pre), float(post), int(group), tuple(int(s) for s in splits),
                      int(device), rank, int(inline))
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise WireError(f"malformed request from rank {rank}: {e}") from None
        if not 0 <= req.dtype < len(DTYPES) or any(d < 0 for d in req.shape) or req.type not in _REQUEST_TYPES:
            raise WireError(f"malformed request from rank {rank}: bad type, dtype or shape")
        return req


@dataclass(slots=True)
class Response:
    """What every member of a process set executes, in the order the coordinator sent it.

    ``shapes``: per tensor, the shape every rank used (allreduce/broadcast/reducescatter) — joined ranks
    synthesise zeros from it.  ``rank_dims``: per tensor, each member's first dimension (allgather).
    ``splits``: alltoall matrix, row i = member i's splits.  ``cache_ids``: cache slot per tensor (-1 = not
    cached).
    """

    type: int
    process_set_id: int
    names: list[str]
    dtype: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    root_rank: int = -1
    reduce_op: int = 1
    prescale: float = 1.0
    postscale: float = 1.0
    rank_dims: list[list[int]] = field(default_factory=list)
    splits: list[list[int]] = field(default_factory=list)
    error: str = ""
    last_joined_rank: int = -1
    cache_ids: list[int] = field(default_factory=list)
    payload: list = field(default_factory=list)  # ADD/REMOVE_PROCESS_SET: [set id, ranks...]
    inline: int = -1  # index of the result's bytes among the frame's blobs (reduced by the coordinator)
    data: object = None  # the coordinator-reduced result (numpy array), not part of the JSON

    def nbytes(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total * DTYPES[self.dtype].itemsize

    def to_list(self) -> list:
        return [self.type, self.process_set_id, self.names, self.dtype, [list(s) for s in self.shapes],
                self.root_rank, self.reduce_op, self.prescale, self.postscale, self.rank_dims, self.splits,
                self.error, self.last_joined_rank, self.cache_ids, self.payload, self.inline]

    @classmethod
    def from_list(cls, item: list) -> Response:
        try:
            (rtype, ps, names, dtype, shapes, root, op, pre, post, rank_dims, splits, error, last_joined,
             cache_ids, payload, inline) = item
            response = cls(int(rtype), int(ps), [str(n) for n in names], int(dtype),
                       [tuple(int(d) for d in s) for s in shapes], int(root), int(op), float(pre),
                       float(post), [[int(d) for d in r] for r in rank_dims],
                       [[int(d) for d in r] for r in splits], str(error), int(last_joined),
                       [int(c) for c in cache_ids], [int(p) for p in payload], int(inline))
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise WireError(f"malformed response: {e}") from None
        if response.type not in _RESPONSE_TYPES or not 0 <= response.dtype < len(DTYPES) or any(
                d < 0 for shape in response.shapes for d in shape):
            raise WireError("malformed response: bad type, dtype or shape")
        return response


_dumps = json.JSONEncoder(separators=(",", ":")).encode
_HEADER = struct.Struct("<I")


def _pack(obj: list, blobs: list) -> bytes:
    """``u32 json length, json (with the blob lengths appended), blob bytes...``."""
    obj.append([memoryview(b).nbytes for b in blobs])
    head = _dumps(obj).encode()
    return b"".join([_HEADER.pack(len(head)), head, *(memoryview(b).cast("B") for b in blobs)])


def _unpack(data: bytes) -> tuple[list, list[memoryview]]:
    if len(data) < _HEADER.size:
        raise WireError("truncated frame")
    (n,) = _HEADER.unpack_from(data)
    end = _HEADER.size + n
    if end > len(data):
        raise WireError("truncated frame")
    try:
        obj = json.loads(bytes(data[_HEADER.size:end]))
    except (ValueError, RecursionError) as e:
        raise WireError(f"malformed frame: {e}") from None
    if not isinstance(obj, list) or not obj or not isinstance(obj[-1], list):
        raise WireError("malformed frame")
    lengths = obj.pop()
    view = memoryview(data)
    blobs = []
    for length in lengths:
        length = int(length)
        if length < 0 or end + length > len(data):
            raise WireError("truncated blob")
        blobs.append(view[end:end + length])
        end += length
    return obj, blobs


def encode_requests(ack: int, shutdown: str | None, requests: list[Request],
                    cached: list[tuple[int, int, int, int]], blobs: list | None = None) -> bytes:
    """A worker's batch: its last seen response sequence, shutdown reason, full requests, cache hits as
    (process set id, cache id, group id, blob index), and the inline tensors' bytes."""
    return _pack([ack, shutdown, [r.to_list() for r in requests], cached], blobs or [])


def decode_requests(data: bytes, rank: int) -> tuple[int, str | None, list[Request],
                                                    list[tuple[int, int, int, int]], list[memoryview]]:
    try:
        (ack, shutdown, reqs, cached), blobs = _unpack(data)
        cached = [(int(ps), int(cid), int(g), int(b)) for ps, cid, g, b in cached]
        if shutdown is not None:
            shutdown = str(shutdown)
        requests = [Request.from_list(r, rank) for r in reqs]
        if any(r.inline >= len(blobs) for r in requests) or any(c[3] >= len(blobs) for c in cached):
            raise WireError(f"request batch from rank {rank} refers to a missing blob")
        for r in requests:
            if r.inline >= 0 and blobs[r.inline].nbytes != r.nbytes():
                raise WireError(f"request from rank {rank} carries {blobs[r.inline].nbytes} bytes for a tensor of "
                                f"{r.nbytes()} bytes")
        return int(ack), shutdown, requests, cached, blobs
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise WireError(f"malformed request batch from rank {rank}: {e}") from None


def encode_responses(seq: int, responses: list[Response], shutdown: str | None,
                     evicted: list[tuple[int, int]]) -> bytes:
    blobs = []
    for r in responses:
        if r.data is not None:
            r.inline = len(blobs)
            blobs.append(r.data.view(np.uint8) if isinstance(r.data, np.ndarray) else r.data)
    return _pack([seq, [r.to_list() for r in responses], shutdown, evicted], blobs)


def decode_responses(data: bytes) -> tuple[int, list[Response], str | None, list[tuple[int, int]]]:
    try:
        (seq, responses, shutdown, evicted), blobs = _unpack(data)
        responses = [Response.from_list(r) for r in responses]
        for r in responses:
            if r.inline >= 0:
                if r.inline >= len(blobs):
                    raise WireError("response refers to a missing blob")
                r.data = blobs[r.inline]
        return (int(seq), responses, None if shutdown is None else str(shutdown),
                [(int(p), int(c)) for p, c in evicted])
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise WireError(f"malformed response batch: {e}") from None
