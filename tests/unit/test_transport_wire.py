"""Channel framing, failures and the non-blocking exchange, on socket pairs inside one process."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from horovod.base.exceptions import WireError
from horovod.transport.communicator import PeerFailure
from horovod.transport.wire import HEADER, MAX_FRAME, VERSION, Channel, Transfer, TruncatedFrame, exchange


@pytest.fixture(params=["unix", "tcp"])
def pair(request):
    if request.param == "unix":
        a, b = socket.socketpair()
    else:
        lst = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
        lst.close()
    ca, cb = Channel(a, 1, 5.0), Channel(b, 0, 5.0)
    yield ca, cb
    ca.close()
    cb.close()


def test_frames_roundtrip(pair):
    a, b = pair
    for kind, payload in [(0, b""), (7, b"x"), (255, os.urandom(70_000)), (3, bytearray(b"abc"))]:
        a.send_msg(kind, payload)
        assert b.recv_msg() == (kind, bytes(payload))
    a.send_msg(9, memoryview(b"view"))
    assert b.recv_msg() == (9, b"view")


def test_buffers_roundtrip_all_dtypes(pair):
    a, b = pair
    dtypes = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, np.float32,
              np.float64, np.bool_]
    try:
        import ml_dtypes

        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover
        pass
    for dt in dtypes:
        x = (np.arange(1001) % 3).astype(dt)
        y = np.zeros_like(x)
        t = threading.Thread(target=a.send_buffer, args=(x,))
        t.start()
        b.recv_buffer_into(y)
        t.join()
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("header", [
    b"XX" + bytes([VERSION, 0]) + struct.pack("!I", 0),          # bad magic
    b"HV" + bytes([9, 0]) + struct.pack("!I", 0),          # bad version
    b"HV" + bytes([VERSION, 0]) + struct.pack("!I", MAX_FRAME + 1),  # oversized
])
def test_malformed_frames_are_wire_errors(pair, header):
    a, b = pair
    a.sock.sendall(header)
    with pytest.raises(WireError):
        b.recv_msg()


def test_truncated_frame(pair):
    a, b = pair
    a.sock.sendall(HEADER.pack(b"HV", VERSION, 2, 100) + b"only part")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(WireError) as info:
        b.recv_msg()
    assert isinstance(info.value, TruncatedFrame) and isinstance(info.value, PeerFailure)


def test_truncated_header(pair):
    a, b = pair
    a.sock.sendall(b"HV\x01")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(WireError):
        b.recv_msg()


def test_eof_is_peer_failure(pair):
    a, b = pair
    a.close()
    with pytest.raises(PeerFailure) as info:
        b.recv_msg()
    assert info.value.peer == b.peer
    assert "closed" in str(info.value)


def test_timeout_names_peer(pair):
    a, b = pair
    b.settimeout(0.2)
    t0 = time.monotonic()
    with pytest.raises(PeerFailure) as info:
        b.recv_buffer_into(np.zeros(10, np.uint8))
    assert time.monotonic() - t0 < 2.0
    assert info.value.peer == b.peer and "timed out" in info.value.reason


@pytest.mark.parametrize("receive", ["buffer", "frame", "exchange"])
def test_the_deadline_counts_the_silence_after_the_last_byte(pair, receive):
    """A peer that sends part of a buffer and stops is reported one deadline after its last byte, not after
    up to two (a blocking MSG_WAITALL read returns the part only when its own deadline ran out), and a peer
    that keeps trickling bytes is never reported, however long the whole receive takes."""
    a, b = pair
    timeout = 1.0
    b.settimeout(timeout)
    data = np.arange(1 << 18, dtype=np.uint8)  # 256 KiB
    stop = threading.Event()

    def trickle(pause: float, chunks: int, then_all: bool) -> None:
        for i in range(chunks):
            if stop.wait(pause):
                return
            a.sock.sendall(data[i * 10:(i + 1) * 10])
        if then_all:
            a.sock.sendall(data[chunks * 10:])

    def receive_all() -> np.ndarray:
        got = np.zeros_like(data)
        if receive == "buffer":
            b.recv_buffer_into(got)
        elif receive == "frame":
            got[:] = np.frombuffer(b._recv_payload(data.nbytes), np.uint8)
        else:
            exchange([], [Transfer(b, got)], timeout)
        return got

    # silent 0.6 s between chunks for 1.8 s in all: longer than the deadline, never silent for as long
    sender = threading.Thread(target=trickle, args=(0.6, 3, True))
    sender.start()
    np.testing.assert_array_equal(receive_all(), data)
    sender.join()

    # one chunk, then silence: reported within the deadline plus a slice of it after the chunk
    sender = threading.Thread(target=trickle, args=(0.3, 1, False))
    sender.start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="timed out") as info:
        receive_all()
    waited = time.monotonic() - t0
    stop.set()
    sender.join()
    assert info.value.peer == b.peer
    assert 0.3 + timeout * 0.95 <= waited <= 0.3 + timeout * 1.5, waited


def test_exchange_large_both_ways_does_not_deadlock(pair):
    a, b = pair
    n = 16 * 1024 * 1024  # far beyond any socket buffer
    xa, xb = np.full(n, 1, np.uint8), np.full(n, 2, np.uint8)
    ya, yb = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    t = threading.Thread(target=exchange, args=([Transfer(b, xb)], [Transfer(b, yb)], 10.0))
    t.start()
    exchange([Transfer(a, xa)], [Transfer(a, ya)], 10.0)
    t.join()
    assert (ya == 2).all() and (yb == 1).all()


def test_exchange_progress_and_limit(pair):
    a, b = pair
    n = 4 * 1024 * 1024
    x = np.arange(n, dtype=np.uint8)
    y = np.zeros(n, np.uint8)
    seen = []
    t = threading.Thread(target=a.send_buffer, args=(x,))
    t.start()
    exchange([], [Transfer(b, y, seen.append)], 10.0)
    t.join()
    assert seen and seen[-1] == n and seen == sorted(seen)
    assert (x == y).all()


def test_exchange_eof(pair):
    a, b = pair
    a.close()
    with pytest.raises(PeerFailure):
        exchange([], [Transfer(b, np.zeros(100, np.uint8))], 5.0)


def test_exchange_timeout(pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(PeerFailure) as info:
        exchange([], [Transfer(b, np.zeros(10, np.uint8), lambda _: None)], 0.2)
    assert time.monotonic() - t0 < 2.0 and "timed out" in info.value.reason


def test_fd_passing():
    a, b = socket.socketpair()
    ca, cb = Channel(a, 1, 5.0), Channel(b, 0, 5.0)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    ca.send_fd(0x51, fd, b"meta")
    got, payload = cb.recv_fd(0x51)
    assert payload == b"meta"
    m1, m2 = mmap.mmap(fd, 4096), mmap.mmap(got, 4096)
    m1[:5] = b"hello"
    assert m2[:5] == b"hello"
    for x in (m1, m2):
        x.close()
    os.close(fd)
    os.close(got)
    ca.close()
    cb.close()
