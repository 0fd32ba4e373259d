"""The control-plane codec: round trips, and malformed input always raises WireError (never anything else)."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from horovod.base.exceptions import WireError
from horovod.base.reduce_ops import ReduceOp
from horovod.runtime.messages import (
    DTYPES,
    Request,
    RequestType,
    Response,
    decode_requests,
    decode_responses,
    dtype_code,
    dtype_name,
    encode_requests,
    encode_responses,
)


def sample_requests():
    return [
        Request(RequestType.ALLREDUCE, 0, "allreduce.grad.0", dtype_code(np.float32), (3, 4), -1, 0, 0.5, 2.0, 7),
        Request(RequestType.ALLGATHER, 1, "ag", dtype_code(np.int64), (0, 5)),
        Request(RequestType.BROADCAST, 0, "bcast \u00e9\u4e2d", dtype_code(np.uint8), (), 2),
        Request(RequestType.ALLTOALL, 2, "a2a", dtype_code(np.bool_), (6,), splits=(1, 2, 3)),
        Request(RequestType.REDUCESCATTER, 0, "rs", dtype_code(np.float16), (9, 1), reduce_op=ReduceOp.SUM, device=0),
        Request(RequestType.JOIN, 0, "join.noname"),
        Request(RequestType.BARRIER, 3, "barrier.noname"),
    ]


def sample_responses():
    return [
        Response(RequestType.ALLREDUCE, 0, ["a", "b"], dtype_code(np.float64), [(2,), (3, 3)], -1, 0, 1.5, 0.25,
                 cache_ids=[4, -1]),
        Response(RequestType.ALLGATHER, 1, ["g"], dtype_code(np.int8), [(1, 2)], rank_dims=[[1, 0, 4]]),
        Response(RequestType.ALLTOALL, 0, ["x"], 0, [(3,)], splits=[[1, 2], [0, 3]]),
        Response(RequestType.ERROR, 0, ["bad"], error="Mismatched data types: One rank had type float32, but "
                                                       "another rank had type int32."),
        Response(RequestType.JOIN, 0, ["join.noname"], last_joined_rank=3),
        Response(RequestType.ADD_PROCESS_SET, 0, ["process_set.add.1"], payload=[2, 0, 1]),
    ]


def test_dtype_table():
    for i, dt in enumerate(DTYPES):
        assert dtype_code(dt) == i
        assert dtype_name(i) == str(dt)
    for name in ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]:
        assert dtype_name(dtype_code(np.dtype(name))) == name


@pytest.mark.parametrize("dtype", [np.complex64, np.uint32, np.uint64, np.object_, np.str_])
def test_unsupported_dtype(dtype):
    with pytest.raises(ValueError, match=r"^Tensor type .* is not supported\.$"):
        dtype_code(np.dtype(dtype))


def test_requests_round_trip():
    reqs = sample_requests()
    cached = [(0, 5, -1), (2, 17, -1)]
    data = encode_requests(12, None, reqs, cached)
    assert isinstance(data, bytes)
    ack, shutdown, decoded, decoded_cached, blobs = decode_requests(data, 3)
    assert (ack, shutdown, decoded_cached, list(blobs)) == (12, None, cached, [])
    assert len(decoded) == len(reqs)
    for a, b in zip(reqs, decoded):
        assert b.rank == 3  # filled in from the channel, never from the payload
        a.rank = 3
        assert a == b
        assert a.signature() == b.signature()


def test_requests_round_trip_with_shutdown_reason():
    ack, shutdown, reqs, cached, blobs = decode_requests(encode_requests(0, "rank 2 called shutdown()", [], []), 2)
    assert (ack, shutdown, reqs, cached, list(blobs)) == (0, "rank 2 called shutdown()", [], [], [])
    # an empty reason is a reason, not "no reason"
    assert decode_requests(encode_requests(0, "", [], []), 2)[1] == ""


def test_inline_blobs_round_trip():
    x = np.arange(6, dtype=np.float32)
    y = np.array([1, -2], np.int64)
    reqs = [Request(RequestType.ALLREDUCE, 0, "x", dtype_code(x.dtype), x.shape, inline=0),
            Request(RequestType.ALLREDUCE, 0, "y", dtype_code(y.dtype), y.shape)]
    data = encode_requests(1, None, reqs, [(0, 3, 1)], [x, y])
    _, _, decoded, cached, blobs = decode_requests(data, 1)
    assert decoded[0].inline == 0 and cached == [(0, 3, 1)]
    np.testing.assert_array_equal(np.frombuffer(blobs[0], np.float32), x)
    np.testing.assert_array_equal(np.frombuffer(blobs[1], np.int64), y)


def test_response_data_round_trip():
    result = np.array([0.5, 1.5, -3.0], np.float64)
    resp = Response(RequestType.ALLREDUCE, 0, ["r"], dtype_code(result.dtype), [(3,)], data=result)
    plain = Response(RequestType.BROADCAST, 0, ["b"], 0, [(1,)], root_rank=1)
    _, [back, back_plain], _, _ = decode_responses(encode_responses(5, [resp, plain], None, []))
    np.testing.assert_array_equal(np.frombuffer(back.data, np.float64), result)
    assert back_plain.data is None and back_plain.root_rank == 1


def test_responses_round_trip():
    resps = sample_responses()
    evicted = [(0, 3), (1, 9)]
    seq, decoded, shutdown, decoded_evicted = decode_responses(encode_responses(41, resps, "why", evicted))
    assert (seq, shutdown, decoded_evicted) == (41, "why", evicted)
    for a, b in zip(resps, decoded):
        a.inline, a.data = b.inline, b.data
    assert decoded == resps


def test_cached_response_travels_as_its_ids():
    """A response made only of cache entries every member holds is sent as its ids (and its data)."""
    names = [f"allreduce.layer{i}.weight.grad" for i in range(100)]
    full = Response(RequestType.ALLREDUCE, 2, names, dtype_code(np.float32), [(256, 256)] * 100, -1, 0, 1.0, 0.5,
                    cache_ids=[-2] * 100)
    compact = Response(RequestType.ALLREDUCE, 2, list(names), dtype_code(np.float32), [(256, 256)] * 100, -1, 0,
                       1.0, 0.5, cache_ids=[-2] * 100, cached_ids=list(range(1000, 1100)),
                       data=np.arange(4, dtype=np.float32))
    big, small = encode_responses(1, [full], None, []), encode_responses(1, [compact], None, [])
    assert len(small) < 4 * 100 + 64 + 16 < len(big) / 5
    _, [back], _, _ = decode_responses(small)
    assert back.type == RequestType.CACHED and back.process_set_id == 2 and back.names == []
    assert back.cached_ids == list(range(1000, 1100))
    np.testing.assert_array_equal(np.frombuffer(back.data, np.float32), np.arange(4, dtype=np.float32))


def test_repeated_step_frames_round_trip():
    """The frames of a repeated step (decoded without the general reader) carry exactly what was sent."""
    x, y = np.arange(5, dtype=np.float32), np.array([7], np.int64)
    ack, shutdown, reqs, hits, blobs = decode_requests(encode_requests(9, None, [], [(0, 4, 1), (3, 8, -1),
                                                                                    (0, 5, 0)], [x, y]), 2)
    assert (ack, shutdown, reqs, hits) == (9, None, [], [(0, 4, 1), (3, 8, -1), (0, 5, 0)])
    np.testing.assert_array_equal(np.frombuffer(blobs[0], np.float32), x)
    np.testing.assert_array_equal(np.frombuffer(blobs[1], np.int64), y)
    for data in (None, np.arange(3, dtype=np.float64)):
        resp = Response(RequestType.ALLREDUCE, 1, ["a", "b"], 0, [(1,), (2,)], cached_ids=[11, 12], data=data)
        seq, [back], shutdown, evicted = decode_responses(encode_responses(33, [resp], None, []))
        assert (seq, back.type, back.process_set_id, back.cached_ids, shutdown, evicted) == \
            (33, RequestType.CACHED, 1, [11, 12], None, [])
        if data is None:
            assert back.data is None and back.inline == -1
        else:
            np.testing.assert_array_equal(np.frombuffer(back.data, np.float64), data)


def test_cache_hits_are_small():
    hits = [(0, i, -1) for i in range(200)]
    assert len(encode_requests(7, None, [], hits)) <= 200 * 12 + 32


def test_float_factors_round_trip_exactly():
    for factor in (1 / 3, 1e-300, 123456.789, -0.0):
        req = Request(RequestType.ALLREDUCE, 0, "f", prescale=factor, postscale=factor / 7)
        (_, _, [back], _, _) = decode_requests(encode_requests(0, None, [req], []), 0)
        assert back.prescale == factor and back.postscale == factor / 7


def test_signature_ignores_name_and_group():
    a = Request(RequestType.ALLREDUCE, 0, "a", 1, (2,), group_id=1)
    b = Request(RequestType.ALLREDUCE, 0, "b", 1, (2,), group_id=2)
    assert a.signature() == b.signature()
    c = Request(RequestType.ALLREDUCE, 0, "a", 1, (3,))
    assert a.signature() != c.signature()


# ------------------------------------------------------------------------------------------ malformed input
# The layout (documented in horovod/runtime/messages.py), rebuilt here independently of the encoder.
HEAD = struct.Struct("<IIIIi")
REQ = struct.Struct("<BBBxiiiiiiiddII")
FULL = struct.Struct("<BBBxiiiiiddIIIIIII")
CACHED = struct.Struct("<BxxxiiI")


def req_frame(reqs=(), hits=(), blobs=(), ack=1, shutdown=None, n_full=None, n_hits=None, n_blobs=None,
              text_len=None, tail=b""):
    """``reqs``: (type, dtype, shape, inline, name bytes, splits) tuples."""
    text = b"" if shutdown is None else shutdown
    parts = [HEAD.pack(ack, len(reqs) if n_full is None else n_full, len(hits) if n_hits is None else n_hits,
                       len(blobs) if n_blobs is None else n_blobs,
                       (-1 if shutdown is None else len(text)) if text_len is None else text_len), text]
    for rtype, dtype, shape, inline, name, splits in reqs:
        parts.append(REQ.pack(rtype, dtype, len(shape), 0, -1, 1, -1, 0, -1, inline, 1.0, 1.0, len(name),
                              len(splits)))
        parts.append(name + struct.pack(f"<{len(shape)}q", *shape) + struct.pack(f"<{len(splits)}q", *splits))
    for h in hits:
        parts.append(struct.pack("<3i", *h))
    parts.append(struct.pack(f"<{len(blobs)}Q", *[len(b) for b in blobs]))
    parts.extend(blobs)
    return b"".join(parts) + tail


OK_REQ = (0, 0, (1,), -1, b"n", ())


def test_req_frame_helper_builds_valid_frames():
    _, _, [r], hits, blobs = decode_requests(req_frame([OK_REQ, ], [(0, 1, 0)], [b"x"]), 1)
    assert (r.name, r.shape, hits, bytes(blobs[0])) == ("n", (1,), [(0, 1, 0)], b"x")


BAD_REQUEST_BATCHES = [
    b"",
    b"\x01\x00",
    HEAD.pack(1, 0, 0, 0, -1)[:-1],
    req_frame(n_full=1),  # a request that is not there
    req_frame(n_full=10**9),  # more requests than bytes
    req_frame(n_hits=1),
    req_frame(n_hits=2**31),
    req_frame(n_blobs=1),
    req_frame(text_len=5),  # shutdown text beyond the end
    req_frame(shutdown=b"\xff\xfe"),  # not utf-8
    req_frame(tail=b"junk"),  # trailing bytes
    req_frame([(0, 0, (1,), -1, b"\xff", ())]),  # name not utf-8
    req_frame([(0, 99, (1,), -1, b"n", ())]),  # dtype out of range
    req_frame([(0, 0, (-1,), -1, b"n", ())]),  # negative dimension
    req_frame([(99, 0, (1,), -1, b"n", ())]),  # unknown request type
    req_frame([(int(RequestType.ERROR), 0, (1,), -1, b"n", ())]),  # only the coordinator sends errors
    req_frame([(int(RequestType.CACHED), 0, (1,), -1, b"n", ())]),
    req_frame([(0, 0, (1,), 0, b"n", ())]),  # inline blob that is not there
    req_frame([(0, 0, (1,), -5, b"n", ())]),
    req_frame([(0, 0, (8,), 0, b"n", ())], blobs=[b"\x00" * 3]),  # inline blob of the wrong size
    req_frame(hits=[(0, 1, 0)]),  # cached hit with a missing blob
    req_frame(hits=[(0, 1, -7)]),
]


@pytest.mark.parametrize("data", BAD_REQUEST_BATCHES)
def test_bad_request_batches(data):
    with pytest.raises(WireError):
        decode_requests(data, 1)


def resp_frame(body=b"", n_resp=1, n_evicted=0, evicted=(), blobs=(), n_blobs=None, tail=b""):
    return (HEAD.pack(1, n_resp, n_evicted, len(blobs) if n_blobs is None else n_blobs, -1) + body +
            struct.pack(f"<{2 * len(evicted)}i", *[x for e in evicted for x in e]) +
            struct.pack(f"<{len(blobs)}Q", *[len(b) for b in blobs]) + b"".join(blobs) + tail)


def full(rtype=0, dtype=0, names=(b"a",), shapes=((1,),), inline=-1, error=b"", counts=None):
    n = counts or (len(names), len(shapes), 0, 0, len(error), 0, 0)
    body = FULL.pack(0, rtype, dtype, 0, -1, 1, -1, inline, 1.0, 1.0, *n)
    for name in names:
        body += struct.pack("<I", len(name)) + name
    for shape in shapes:
        body += struct.pack(f"<B{len(shape)}q", len(shape), *shape)
    return body + error


def test_resp_frame_helper_builds_valid_frames():
    _, [r], _, evicted = decode_responses(resp_frame(full(), n_evicted=1, evicted=[(0, 4)]))
    assert (r.names, r.shapes, evicted) == (["a"], [(1,)], [(0, 4)])
    _, [c], _, _ = decode_responses(resp_frame(CACHED.pack(1, 0, 0, 2) + struct.pack("<2i", 4, 5), blobs=[b"ab"]))
    assert (c.type, c.cached_ids, bytes(c.data)) == (RequestType.CACHED, [4, 5], b"ab")


BAD_RESPONSE_BATCHES = [
    b"",
    b"\x01\x00",
    resp_frame(n_resp=1),  # a response that is not there
    resp_frame(n_resp=10**9),
    resp_frame(full(), n_evicted=1),  # an eviction that is not there
    resp_frame(full(), n_blobs=1),
    resp_frame(full(), tail=b"x"),
    resp_frame(b"\x07" + full()[1:]),  # unknown form
    resp_frame(full(rtype=99)),  # unknown response type
    resp_frame(full(rtype=int(RequestType.CACHED))),  # compact responses only in the compact form
    resp_frame(full(dtype=99)),  # dtype out of range
    resp_frame(full(shapes=((-2,),))),
    resp_frame(full(names=(b"\xff",))),
    resp_frame(full(inline=0)),  # result blob that is not there
    resp_frame(full(inline=-3)),
    resp_frame(full(counts=(1, 1, 5, 0, 0, 0, 0))),  # rank_dims rows that are not there
    resp_frame(full(counts=(1, 1, 0, 0, 0, 7, 0))),  # cache ids that are not there
    resp_frame(full(counts=(1, 1, 0, 0, 0, 0, 2**31))),  # payload that is not there
    resp_frame(full(counts=(2**31, 1, 0, 0, 0, 0, 0))),
    resp_frame(CACHED.pack(1, 0, -1, 0)),  # a compact response of nothing
    resp_frame(CACHED.pack(1, 0, -1, 3) + struct.pack("<2i", 1, 2)),  # fewer ids than announced
    resp_frame(CACHED.pack(1, 0, 2, 1) + struct.pack("<i", 1)),  # missing blob
]


@pytest.mark.parametrize("data", BAD_RESPONSE_BATCHES)
def test_bad_response_batches(data):
    with pytest.raises(WireError):
        decode_responses(data)


# ------------------------------------------------------------------------------------------------ fuzzing
def _decode_or_wire_error(fn, data):
    try:
        fn(data)
    except WireError:
        pass
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{fn.__name__} raised {type(e).__name__}: {e!r} for input {data[:200]!r}")


def _decode_requests(data):
    return decode_requests(data, 1)


def _valid_frames():
    blob = np.arange(12, dtype=np.float32)  # matches sample_requests()[0]: float32 (3, 4)
    reqs = sample_requests()
    reqs[0].inline = 0
    req_data = encode_requests(3, "x", reqs, [(0, 1, -1), (1, 2, 0)], [blob])
    resps = sample_responses() + [Response(RequestType.ALLREDUCE, 0, ["c", "d"], 0, [(1,), (1,)],
                                           cached_ids=[3, 4], data=np.zeros(2, np.uint8))]
    resp_data = encode_responses(3, resps, "why", [(0, 2)])
    return req_data, resp_data


def test_truncated_frames():
    req_data, resp_data = _valid_frames()
    for cut in range(len(req_data)):
        _decode_or_wire_error(_decode_requests, req_data[:cut])
    for cut in range(len(resp_data)):
        _decode_or_wire_error(decode_responses, resp_data[:cut])


def test_fuzz_random_bytes_and_mutations():
    rng = random.Random(99)
    req_data, resp_data = _valid_frames()
    for _ in range(500):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        _decode_or_wire_error(_decode_requests, blob)
        _decode_or_wire_error(decode_responses, blob)
    for _ in range(3000):  # flip one to three bytes of a valid frame (often a count, a length or a code)
        for data, fn in ((req_data, _decode_requests), (resp_data, decode_responses)):
            mutated = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
            _decode_or_wire_error(fn, bytes(mutated))
    for _ in range(500):  # splice: a valid frame's head with another's body
        cut = rng.randrange(len(req_data))
        _decode_or_wire_error(_decode_requests, req_data[:cut] + resp_data[cut:])
        _decode_or_wire_error(decode_responses, resp_data[:cut] + req_data[cut:])


def test_group_size_travels_and_is_part_of_the_signature():
    req = Request(RequestType.ALLREDUCE, 0, "g_1of3", 1, (2,), group_id=5, group_size=3)
    (_, _, [back], _, _) = decode_requests(encode_requests(0, None, [req], []), 0)
    assert back.group_size == 3 and back.group_id == 5
    assert req.signature() != Request(RequestType.ALLREDUCE, 0, "g_1of3", 1, (2,)).signature()
