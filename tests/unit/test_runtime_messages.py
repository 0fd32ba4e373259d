"""The control-plane codec: round trips, and malformed input always raises WireError (never anything else)."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from horovod.common.exceptions import WireError
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
        Request(RequestType.REDUCESCATTER, 0, "rs", dtype_code(np.float16), (9, 1), reduce_op=1, device=0),
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


def frame(obj, blobs=()):
    """Our framing of a logical batch (documented in messages._pack): ``u32 length, json + blob lengths, blobs``."""
    head = json.dumps(list(obj) + [[len(b) for b in blobs]]).encode()
    return struct.pack("<I", len(head)) + head + b"".join(blobs)


def raw_frame(text: bytes) -> bytes:
    return struct.pack("<I", len(text)) + text


def test_requests_round_trip():
    reqs = sample_requests()
    cached = [(0, 5, -1, -1), (2, 17, 3, -1)]
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


def test_inline_blobs_round_trip():
    x = np.arange(6, dtype=np.float32)
    y = np.array([1, -2], np.int64)
    reqs = [Request(RequestType.ALLREDUCE, 0, "x", dtype_code(x.dtype), x.shape, inline=0),
            Request(RequestType.ALLREDUCE, 0, "y", dtype_code(y.dtype), y.shape)]
    data = encode_requests(1, None, reqs, [(0, 3, -1, 1)], [x, y])
    _, _, decoded, cached, blobs = decode_requests(data, 1)
    assert decoded[0].inline == 0 and cached == [(0, 3, -1, 1)]
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
REQ = [0, 0, "n", 0, [1], -1, 1, 1.0, 1.0, -1, [], -1, -1]  # a valid request as a JSON list


def req_with(index, value):
    item = list(REQ)
    item[index] = value
    return item


BAD_FRAMES = [
    b"",
    b"\x01\x00",
    struct.pack("<I", 10) + b"[1]",  # length beyond the end
    raw_frame(b"["),
    raw_frame(b"null"),
    raw_frame(b"{}"),
    raw_frame(b"[]"),
    raw_frame(b"[1, 2]"),  # blob lengths missing
    raw_frame(b"\xff\xfe\x00"),
    raw_frame(b"[1, null, [], [], [5]]"),  # a blob longer than the frame
    raw_frame(b"[1, null, [], [], [-1]]"),
    raw_frame(b"[1, null, [], [], [\"x\"]]"),
]

BAD_REQUEST_BATCHES = BAD_FRAMES + [
    frame([1, None, []]),
    frame([1, None, [], [], 5]),
    frame(["x", None, [], []]),
    frame([1, None, 7, []]),
    frame([1, None, [[0, 0, "n"]], []]),
    frame([1, None, [req_with(3, 99)], []]),  # dtype out of range
    frame([1, None, [req_with(3, -1)], []]),
    frame([1, None, [req_with(4, [-1])], []]),  # negative dimension
    frame([1, None, [req_with(4, 5)], []]),  # shape not a list
    frame([1, None, [req_with(4, ["a"])], []]),
    frame([1, None, [req_with(0, 99)], []]),  # unknown request type
    frame([1, None, [req_with(0, int(RequestType.ERROR))], []]),  # only the coordinator sends errors
    frame([1, None, [req_with(12, 0)], []]),  # inline blob that is not there
    frame([1, None, [], [[0, 1]]]),
    frame([1, None, [], [[0, "x", 1, -1]]]),
    frame([1, None, [], [[0, 1, -1, 0]]]),  # cached hit with a missing blob
    frame([1, None, [], 3]),
]


@pytest.mark.parametrize("data", BAD_REQUEST_BATCHES)
def test_bad_request_batches(data):
    with pytest.raises(WireError):
        decode_requests(data, 1)


RESP = [0, 0, ["a"], 0, [[1]], -1, 1, 1.0, 1.0, [], [], "", -1, [], [], -1]


def resp_with(index, value):
    item = list(RESP)
    item[index] = value
    return item


BAD_RESPONSE_BATCHES = BAD_FRAMES + [
    frame([1, [], None]),
    frame([1, [[0]], None, []]),
    frame([1, 5, None, []]),
    frame([1, [], None, [[1]]]),
    frame(["seq", [], None, []]),
    frame([1, [resp_with(14, "p")], None, []]),
    frame([1, [resp_with(4, [["x"]])], None, []]),
    frame([1, [resp_with(3, 99)], None, []]),  # dtype out of range
    frame([1, [resp_with(4, [[-2]])], None, []]),
    frame([1, [resp_with(0, 99)], None, []]),
    frame([1, [resp_with(15, 0)], None, []]),  # result blob that is not there
]


@pytest.mark.parametrize("data", BAD_RESPONSE_BATCHES)
def test_bad_response_batches(data):
    with pytest.raises(WireError):
        decode_responses(data)


def test_non_finite_numbers_are_wire_errors():
    # JSON from Python accepts Infinity/NaN; int(inf) raises OverflowError, which must not escape.
    with pytest.raises(WireError):
        decode_requests(raw_frame(b"[Infinity, null, [], [], []]"), 1)
    with pytest.raises(WireError):
        decode_requests(frame([1, None, [req_with(4, [float("inf")])], []]), 1)
    with pytest.raises(WireError):
        decode_responses(raw_frame(b"[Infinity, [], null, [], []]"))
    with pytest.raises(WireError):
        decode_responses(raw_frame(b"[1, [], null, [], [1e400]]"))


def test_deeply_nested_input_is_a_wire_error():
    deep = raw_frame(b"[" * 100000 + b"]" * 100000)
    with pytest.raises(WireError):
        decode_requests(deep, 1)
    with pytest.raises(WireError):
        decode_responses(deep)


def test_inline_blob_of_the_wrong_size_is_a_wire_error():
    # The coordinator reduces inline blobs with np.frombuffer(blob, dtype, count): a short blob would raise
    # inside rank 0's engine loop, so the codec must reject it.
    item = req_with(12, 0)  # dtype 0 = uint8, shape [8] -> 8 bytes expected
    item[4] = [8]
    with pytest.raises(WireError):
        decode_requests(frame([1, None, [item], []], [b"\x00" * 3]), 1)


# ------------------------------------------------------------------------------------------------ fuzzing
def _random_json(rng: random.Random, depth: int = 0):
    choice = rng.randrange(9 if depth < 4 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice([0, 1, -1, 7, 2**31, -(2**63), 2**70, rng.randrange(-100, 100)])
    if choice == 3:
        return rng.choice([0.0, 1.5, -2.25, 1e308, float("inf"), float("nan"), float("-inf")])
    if choice == 4:
        return rng.choice(["", "n", "allreduce.x", "\u00e9", "1", "[]"])
    if choice == 5:
        return []
    if choice == 6:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    if choice == 7:
        return {str(k): _random_json(rng, depth + 1) for k in range(rng.randrange(4))}
    return [_random_json(rng, depth + 1) for _ in range(rng.choice([4, 12, 15]))]


def _mutate(rng: random.Random, value):
    """Replace one random node of a JSON tree with a random value."""
    if not isinstance(value, list) or not value or rng.random() < 0.2:
        return _random_json(rng)
    value = list(value)
    i = rng.randrange(len(value))
    value[i] = _mutate(rng, value[i])
    return value


def _frame_any(value) -> bytes:
    """Frame any JSON value: lists get the blob-length list appended (sometimes a bogus one)."""
    if isinstance(value, list):
        return frame(value)
    return raw_frame(json.dumps(value).encode())


def _decode_or_wire_error(fn, data):
    try:
        fn(data)
    except WireError:
        pass
    except Exception as e:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{fn.__name__} raised {type(e).__name__}: {e!r} for input {data[:200]!r}")


def test_fuzz_request_batches():
    rng = random.Random(1234)
    valid = [3, None, [r.to_list() for r in sample_requests()], [[0, 1, -1, -1]]]
    decode = lambda d: decode_requests(d, 1)  # noqa: E731
    decode.__name__ = "decode_requests"
    for _ in range(3000):
        mutated = _mutate(rng, valid)
        _decode_or_wire_error(decode, _frame_any(mutated))
    for _ in range(300):
        _decode_or_wire_error(decode, _frame_any(_random_json(rng)))


def test_fuzz_response_batches():
    rng = random.Random(4321)
    valid = [3, [r.to_list() for r in sample_responses()], None, [[0, 2]]]
    for _ in range(3000):
        mutated = _mutate(rng, valid)
        _decode_or_wire_error(decode_responses, _frame_any(mutated))


def test_truncated_and_random_bytes():
    rng = random.Random(99)
    blob = np.arange(12, dtype=np.float32)  # matches sample_requests()[0]: float32 (3, 4)
    reqs = sample_requests()
    reqs[0].inline = 0
    req_data = encode_requests(3, "x", reqs, [(0, 1, -1, -1)], [blob])
    resp_data = encode_responses(3, sample_responses(), None, [(0, 2)])
    decode = lambda d: decode_requests(d, 1)  # noqa: E731
    decode.__name__ = "decode_requests"
    for cut in range(len(req_data)):
        _decode_or_wire_error(decode, req_data[:cut])
    for cut in range(len(resp_data)):
        _decode_or_wire_error(decode_responses, resp_data[:cut])
    for _ in range(500):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        _decode_or_wire_error(decode, blob)
        _decode_or_wire_error(decode_responses, blob)
    for _ in range(500):  # flip one byte of a valid frame
        data = bytearray(req_data)
        data[rng.randrange(len(data))] = rng.randrange(256)
        _decode_or_wire_error(decode, bytes(data))
        data = bytearray(resp_data)
        data[rng.randrange(len(data))] = rng.randrange(256)
        _decode_or_wire_error(decode_responses, bytes(data))
