"""Requests (worker → coordinator) and responses (coordinator → workers), and their binary wire codec.

The codec is fixed little-endian ``struct`` records — no pickle, no JSON: encoding and decoding a batch is a
handful of C calls plus one small loop per full request, and a repeated step costs almost nothing: a cache
hit travels as three int32s, and a response made only of entries every member has cached travels as its
cache ids (the receiver rebuilds names, shapes and parameters from its own cache).  A malicious or
corrupted frame can only fail validation, which raises :class:`~horovod.base.exceptions.WireError`.  Any change
of these layouts bumps :data:`horovod.transport.wire.VERSION`, so that ranks of different versions refuse each
other by name when the mesh forms instead of misreading each other's records.

Request batch (worker → coordinator)::

    head    u32 ack, u32 full requests, u32 cache hits, u32 blobs, i32 shutdown length (-1: none)
    utf-8   shutdown reason
    full    per request: _REQ record, name (utf-8), shape (i64 each), splits (i64 each)
    hits    per hit: i32 process set, i32 cache id, i32 blob index (-1: none)
    blobs   u64 length each, then the bytes of every blob (inline tensors of small allreduces)

Response batch (coordinator → worker)::

    head    u32 sequence number, u32 responses, u32 evictions, u32 blobs, i32 shutdown length (-1: none)
    utf-8   shutdown reason
    per response, either
      full:   _FULL record, names (u32 length + utf-8 each), shapes (u8 rank + i64 dims each),
              rank_dims and splits (u32 count + i64 each, per row), error (utf-8), cache ids (i32),
              payload (i64)
      cached: _CACHED record, cache ids (i32): the receiver's cache holds everything else
    evictions  i32 process set, i32 cache id each
    blobs   u64 length each, then the bytes (results the coordinator reduced)
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import numpy as np

from horovod.base.dtypes import DTYPE_COUNT, DTYPES, dtype_code, dtype_of
from horovod.base.exceptions import WireError
from horovod.base.reduce_ops import ReduceOp

__all__ = ["RequestType", "Request", "Response", "DTYPES", "DTYPE_COUNT", "dtype_code", "dtype_name", "dtype_of",
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
    CACHED = 31  # decoded compact response: ``cached_ids`` only, rebuilt from the receiver's cache


_REQUEST_TYPES = frozenset(t.value for t in RequestType if t not in (RequestType.ERROR, RequestType.CACHED))
_RESPONSE_TYPES = frozenset(t.value for t in RequestType if t != RequestType.CACHED)

OP_DISPLAY = {  # names used in upstream's error texts ("One rank did an ALLREDUCE")
    RequestType.ALLREDUCE: "ALLREDUCE", RequestType.ALLGATHER: "ALLGATHER",
    RequestType.BROADCAST: "BROADCAST", RequestType.JOIN: "JOIN", RequestType.ADASUM: "ADASUM",
    RequestType.ALLTOALL: "ALLTOALL", RequestType.BARRIER: "BARRIER",
    RequestType.REDUCESCATTER: "REDUCESCATTER", RequestType.ADD_PROCESS_SET: "ADD_PROCESS_SET",
    RequestType.REMOVE_PROCESS_SET: "REMOVE_PROCESS_SET", RequestType.ERROR: "ERROR",
    RequestType.CACHED: "CACHED",
}


def dtype_name(code: int) -> str:
    return str(dtype_of(code))


@dataclass(slots=True)
class Request:
    """One rank's announcement that a named tensor is ready for a collective."""

    type: int
    process_set_id: int
    name: str
    dtype: int = 0
    shape: tuple[int, ...] = ()
    root_rank: int = -1
    reduce_op: int = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    group_id: int = -1
    splits: tuple[int, ...] = ()
    device: int = -1
    rank: int = -1  # global rank of the sender; filled in by the coordinator from the channel
    inline: int = -1  # index of the tensor's bytes among the frame's blobs (small allreduces), -1 = none
    # Tensors of the grouped call this one belongs to (its name is ``<base>_<i>of<group_size>``), 0: not
    # grouped.  It travels so that the coordinator can tell a group from a name that only looks like one, and
    # fail at once ranks that grouped different numbers of tensors under one base name.
    group_size: int = 0

    def signature(self) -> tuple:
        """Everything that must match for a cached response to be reused."""
        return (self.type, self.dtype, self.shape, self.root_rank, self.reduce_op, self.prescale,
                self.postscale, self.splits, self.device, self.group_size)

    def nbytes(self) -> int:
        n = dtype_of(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class Response:
    """What every member of a process set executes, in the order the coordinator sent it.

    ``shapes``: per tensor, the shape every rank used (allreduce/broadcast/reducescatter) — joined ranks
    synthesise zeros from it.  ``rank_dims``: per tensor, each member's first dimension (allgather).
    ``splits``: alltoall matrix, row i = member i's splits.  ``cache_ids``: cache slot per tensor (-1 = not
    cached, -2 = already cached).  ``cached_ids``: set when the response is made only of cache entries every
    member holds; it then travels as these ids alone.  ``data``: the result when the coordinator reduced the
    tensors itself (one flat array for all of them, in order).
    """

    type: int
    process_set_id: int
    names: list[str]
    dtype: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    root_rank: int = -1
    reduce_op: int = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    rank_dims: list[list[int]] = field(default_factory=list)
    splits: list[list[int]] = field(default_factory=list)
    error: str = ""
    last_joined_rank: int = -1
    cache_ids: list[int] = field(default_factory=list)
    payload: list = field(default_factory=list)  # ADD/REMOVE_PROCESS_SET: [set id, ranks...]
    inline: int = -1  # index of the result's bytes among the frame's blobs (reduced by the coordinator)
    data: object = None  # the coordinator-reduced result (numpy array or received bytes), travels as a blob
    cached_ids: list[int] = field(default_factory=list)  # every tensor is this cache entry on every member

    def nbytes(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total * dtype_of(self.dtype).itemsize


# ----------------------------------------------------------------------------------------------- codec
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEAD = struct.Struct("<IIIIi")
# type, dtype, ndim, (pad), set, root, op, group, group size, device, inline, prescale, postscale, name bytes,
# splits
_REQ = struct.Struct("<BBBxiiiiiiiddII")
# form 0, type, dtype, (pad), set, root, op, last joined, inline, prescale, postscale, names, shapes,
# rank_dims rows, splits rows, error bytes, cache ids, payload
_FULL = struct.Struct("<BBBxiiiiiddIIIIIII")
_CACHED = struct.Struct("<BxxxiiI")  # form 1, set, inline, ids
_FORM_FULL = 0
_FORM_CACHED = 1
_NO_TEXT = -1


def _fmt(code: str, n: int) -> str:
    return f"<{n}{code}"


class _Reader:
    """Sequential reads from one frame; every overrun or bad value becomes a WireError."""

    __slots__ = ("data", "view", "pos", "end")

    def __init__(self, data) -> None:
        self.data = data
        self.view = memoryview(data)
        self.pos = 0
        self.end = self.view.nbytes

    def unpack(self, st: struct.Struct) -> tuple:
        pos = self.pos
        if pos + st.size > self.end:
            raise WireError("truncated frame")
        self.pos = pos + st.size
        return st.unpack_from(self.data, pos)

    def array(self, code: str, n: int, size: int) -> tuple:
        if n < 0 or self.pos + n * size > self.end:
            raise WireError("truncated frame")
        pos = self.pos
        self.pos = pos + n * size
        return struct.unpack_from(_fmt(code, n), self.data, pos) if n else ()

    def raw(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise WireError("truncated frame")
        pos = self.pos
        self.pos = pos + n
        return self.view[pos:pos + n]

    def text(self, n: int) -> str:
        try:
            return str(self.raw(n), "utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"malformed text: {e}") from None

    def optional_text(self, n: int) -> str | None:
        if n == _NO_TEXT:
            return None
        return self.text(n)

    def blobs(self, n: int) -> list[memoryview]:
        lengths = self.array("Q", n, 8)
        blobs = [self.raw(length) for length in lengths]
        if self.pos != self.end:
            raise WireError(f"{self.end - self.pos} trailing bytes after the frame")
        return blobs


def _text_bytes(text: str | None) -> tuple[int, bytes]:
    if text is None:
        return _NO_TEXT, b""
    data = text.encode()
    return len(data), data


def _blob_parts(blobs: list) -> list:
    views = [memoryview(b).cast("B") if not isinstance(b, (bytes, bytearray)) else b for b in blobs]
    lengths = [len(v) for v in views]
    return [struct.pack(_fmt("Q", len(lengths)), *lengths), *views]


def _check_count(n: int, reader: _Reader, min_size: int) -> None:
    """A count can never promise more records than the bytes left could hold (no huge loops or lists)."""
    if n * min_size > reader.end - reader.pos:
        raise WireError("truncated frame")


def encode_requests(ack: int, shutdown: str | None, requests: list[Request],
                    cached: list[tuple[int, int, int]], blobs: list | None = None) -> bytes:
    """A worker's batch: its last seen response sequence, shutdown reason, full requests, cache hits as
    (process set id, cache id, blob index), and the inline tensors' bytes."""
    blobs = blobs or []
    n_text, text = _text_bytes(shutdown)
    parts = [_HEAD.pack(ack, len(requests), len(cached), len(blobs), n_text), text]
    for r in requests:
        name = r.name.encode()
        parts.append(_REQ.pack(r.type, r.dtype, len(r.shape), r.process_set_id, r.root_rank, r.reduce_op,
                               r.group_id, r.group_size, r.device, r.inline, r.prescale, r.postscale,
                               len(name), len(r.splits)))
        parts.append(name)
        if r.shape:
            parts.append(struct.pack(_fmt("q", len(r.shape)), *r.shape))
        if r.splits:
            parts.append(struct.pack(_fmt("q", len(r.splits)), *r.splits))
    if cached:
        flat = [x for hit in cached for x in hit]
        parts.append(struct.pack(_fmt("i", len(flat)), *flat))
    parts.extend(_blob_parts(blobs))
    return b"".join(parts)


def _decode_hits_only(data, rank: int) -> tuple | None:
    """The batch of a repeated step (cache hits and their inline bytes, nothing else) without the general
    reader; None for anything else, which the general path decodes (or rejects)."""
    end = len(data)
    if end < _HEAD.size:
        return None
    ack, n_full, n_hits, n_blobs, n_text = _HEAD.unpack_from(data, 0)
    pos = _HEAD.size + 12 * n_hits
    if n_full or n_text != _NO_TEXT or pos + 8 * n_blobs > end:
        return None
    flat = struct.unpack_from(_fmt("i", 3 * n_hits), data, _HEAD.size)
    lengths = struct.unpack_from(_fmt("Q", n_blobs), data, pos)
    pos += 8 * n_blobs
    if pos + sum(lengths) != end:
        return None
    view = memoryview(data)
    blobs = []
    for length in lengths:
        blobs.append(view[pos:pos + length])
        pos += length
    blob_ids = flat[2::3]
    if blob_ids and (max(blob_ids) >= n_blobs or min(blob_ids) < -1):
        return None
    return ack, None, [], list(zip(flat[0::3], flat[1::3], blob_ids)), blobs


def decode_requests(data, rank: int) -> tuple[int, str | None, list[Request], list[tuple[int, int, int]],
                                             list[memoryview]]:
    """Inverse of :func:`encode_requests`; ``rank`` (the channel's peer) is stamped into every request."""
    fast = _decode_hits_only(data, rank)
    if fast is not None:
        return fast
    try:
        rd = _Reader(data)
        ack, n_full, n_hits, n_blobs, n_text = rd.unpack(_HEAD)
        shutdown = rd.optional_text(n_text)
        _check_count(n_full, rd, _REQ.size)
        requests = []
        for _ in range(n_full):
            (rtype, dtype, ndim, ps, root, op, group, group_size, device, inline, pre, post, n_name,
             n_splits) = rd.unpack(_REQ)
            name = rd.text(n_name)
            shape = rd.array("q", ndim, 8)
            splits = rd.array("q", n_splits, 8)
            if rtype not in _REQUEST_TYPES or dtype >= DTYPE_COUNT or any(d < 0 for d in shape) or group_size < 0:
                raise WireError(f"malformed request from rank {rank}: bad type, dtype, shape or group size")
            requests.append(Request(rtype, ps, name, dtype, shape, root, op, pre, post, group, splits, device,
                                    rank, inline, group_size))
        flat = rd.array("i", 3 * n_hits, 4)
        cached = list(zip(flat[0::3], flat[1::3], flat[2::3]))
        _check_count(n_blobs, rd, 8)
        blobs = rd.blobs(n_blobs)
    except WireError as e:
        raise WireError(f"malformed request batch from rank {rank}: {e}") from None
    except (struct.error, ValueError, OverflowError) as e:
        raise WireError(f"malformed request batch from rank {rank}: {e}") from None
    for r in requests:
        if r.inline >= n_blobs or r.inline < -1:
            raise WireError(f"request batch from rank {rank} refers to a missing blob")
        if r.inline >= 0 and blobs[r.inline].nbytes != r.nbytes():
            raise WireError(f"request from rank {rank} carries {blobs[r.inline].nbytes} bytes for a tensor of "
                            f"{r.nbytes()} bytes")
    for _, _, b in cached:
        if b >= n_blobs or b < -1:
            raise WireError(f"request batch from rank {rank} refers to a missing blob")
    return ack, shutdown, requests, cached, blobs


def _encode_full(r: Response, parts: list) -> None:
    names = [n.encode() for n in r.names]
    error = r.error.encode()
    parts.append(_FULL.pack(_FORM_FULL, r.type, r.dtype, r.process_set_id, r.root_rank, r.reduce_op,
                            r.last_joined_rank, r.inline, r.prescale, r.postscale, len(names), len(r.shapes),
                            len(r.rank_dims), len(r.splits), len(error), len(r.cache_ids), len(r.payload)))
    for n in names:
        parts.append(_U32.pack(len(n)))
        parts.append(n)
    for shape in r.shapes:
        parts.append(struct.pack(f"<B{len(shape)}q", len(shape), *shape))
    for rows in (r.rank_dims, r.splits):
        for row in rows:
            parts.append(struct.pack(f"<I{len(row)}q", len(row), *row))
    parts.append(error)
    parts.append(struct.pack(_fmt("i", len(r.cache_ids)), *r.cache_ids))
    parts.append(struct.pack(_fmt("q", len(r.payload)), *r.payload))


def encode_responses(seq: int, responses: list[Response], shutdown: str | None,
                     evicted: list[tuple[int, int]]) -> bytes:
    """One frame for one worker; responses with ``cached_ids`` travel as those ids only."""
    if len(responses) == 1 and not evicted and shutdown is None and responses[0].cached_ids:
        r = responses[0]  # the frame of a repeated step
        cids = r.cached_ids
        head = _HEAD.pack(seq, 1, 0, 0 if r.data is None else 1, _NO_TEXT) + \
            _CACHED.pack(_FORM_CACHED, r.process_set_id, -1 if r.data is None else 0, len(cids)) + \
            struct.pack(_fmt("i", len(cids)), *cids)
        if r.data is None:
            return head
        data = r.data.view(np.uint8).reshape(-1) if isinstance(r.data, np.ndarray) else memoryview(r.data).cast("B")
        return b"".join((head, _U64.pack(len(data)), data))
    blobs: list = []
    n_text, text = _text_bytes(shutdown)
    parts = [_HEAD.pack(seq, len(responses), len(evicted), 0, n_text), text]
    for r in responses:
        inline = -1
        if r.data is not None:
            inline = len(blobs)
            blobs.append(r.data.view(np.uint8).reshape(-1) if isinstance(r.data, np.ndarray) else r.data)
        if r.cached_ids:
            parts.append(_CACHED.pack(_FORM_CACHED, r.process_set_id, inline, len(r.cached_ids)))
            parts.append(struct.pack(_fmt("i", len(r.cached_ids)), *r.cached_ids))
        else:
            r.inline = inline
            _encode_full(r, parts)
    if evicted:
        flat = [x for pair in evicted for x in pair]
        parts.append(struct.pack(_fmt("i", len(flat)), *flat))
    parts[0] = _HEAD.pack(seq, len(responses), len(evicted), len(blobs), n_text)
    parts.extend(_blob_parts(blobs))
    return b"".join(parts)


def _decode_full(rd: _Reader) -> Response:
    (_, rtype, dtype, ps, root, op, last_joined, inline, pre, post, n_names, n_shapes, n_dims, n_splits, n_error,
     n_cids, n_payload) = rd.unpack(_FULL)
    _check_count(n_names, rd, 4)
    names = [rd.text(rd.unpack(_U32)[0]) for _ in range(n_names)]
    _check_count(n_shapes, rd, 1)
    shapes = []
    for _ in range(n_shapes):
        ndim = rd.raw(1)[0]
        shapes.append(rd.array("q", ndim, 8))
    rows = []
    for n in (n_dims, n_splits):
        _check_count(n, rd, 4)
        rows.append([list(rd.array("q", rd.unpack(_U32)[0], 8)) for _ in range(n)])
    error = rd.text(n_error)
    cache_ids = list(rd.array("i", n_cids, 4))
    payload = list(rd.array("q", n_payload, 8))
    if rtype not in _RESPONSE_TYPES or dtype >= DTYPE_COUNT or any(d < 0 for s in shapes for d in s):
        raise WireError("malformed response: bad type, dtype or shape")
    return Response(rtype, ps, names, dtype, shapes, root, op, pre, post, rows[0], rows[1], error, last_joined,
                    cache_ids, payload, inline)


def _decode_one_cached(data) -> tuple | None:
    """The frame of a repeated step (one compact response, nothing else) without the general reader; None
    for anything else, which the general path decodes (or rejects)."""
    end = len(data)
    if end < _HEAD.size + _CACHED.size or data[_HEAD.size] != _FORM_CACHED:
        return None
    seq, n_resp, n_evicted, n_blobs, n_text = _HEAD.unpack_from(data, 0)
    if n_resp != 1 or n_evicted or n_text != _NO_TEXT or n_blobs > 1:
        return None
    _, ps, inline, n = _CACHED.unpack_from(data, _HEAD.size)
    pos = _HEAD.size + _CACHED.size + 4 * n
    if n < 1 or pos + 8 * n_blobs > end:
        return None
    cids = list(struct.unpack_from(_fmt("i", n), data, _HEAD.size + _CACHED.size))
    blob = None
    if n_blobs:
        (length,) = _U64.unpack_from(data, pos)
        pos += 8
        if pos + length != end or inline != 0:
            return None
        blob = memoryview(data)[pos:]
    elif pos != end or inline != -1:
        return None
    return seq, [Response(RequestType.CACHED, ps, [], inline=inline, data=blob, cached_ids=cids)], None, []


def decode_responses(data) -> tuple[int, list[Response], str | None, list[tuple[int, int]]]:
    """Inverse of :func:`encode_responses`.  A compact response comes back as type ``CACHED`` with only
    ``process_set_id``, ``cached_ids`` and its data: the engine rebuilds it from its cache."""
    fast = _decode_one_cached(data)
    if fast is not None:
        return fast
    try:
        rd = _Reader(data)
        seq, n_resp, n_evicted, n_blobs, n_text = rd.unpack(_HEAD)
        shutdown = rd.optional_text(n_text)
        _check_count(n_resp, rd, _CACHED.size)
        responses = []
        for _ in range(n_resp):
            form = rd.raw(1)[0]
            rd.pos -= 1
            if form == _FORM_CACHED:
                _, ps, inline, n = rd.unpack(_CACHED)
                cids = list(rd.array("i", n, 4))
                if not cids:
                    raise WireError("malformed response: empty cached response")
                responses.append(Response(RequestType.CACHED, ps, [], inline=inline, cached_ids=cids))
            elif form == _FORM_FULL:
                responses.append(_decode_full(rd))
            else:
                raise WireError(f"malformed response: unknown form {form}")
        flat = rd.array("i", 2 * n_evicted, 4)
        evicted = list(zip(flat[0::2], flat[1::2]))
        _check_count(n_blobs, rd, 8)
        blobs = rd.blobs(n_blobs)
    except WireError as e:
        raise WireError(f"malformed response batch: {e}") from None
    except (struct.error, ValueError, OverflowError) as e:
        raise WireError(f"malformed response batch: {e}") from None
    for r in responses:
        if r.inline >= 0:
            if r.inline >= n_blobs:
                raise WireError("response refers to a missing blob")
            r.data = blobs[r.inline]
        elif r.inline < -1:
            raise WireError("response refers to a missing blob")
    return seq, responses, shutdown, evicted
