"""Control frames that never block their sender (Outbox) and are read without waiting (FrameReader), on
socket pairs inside one process.  The engine-level deadlocks they remove are in tests/test_engine_paths.py."""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time

import pytest

from horovod.base.exceptions import WireError
from horovod.transport.communicator import PeerFailure
from horovod.transport.outbox import Outbox
from horovod.transport.wire import HEADER, VERSION, Channel, FrameReader, TruncatedFrame


def _socket_pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "unix":
        return socket.socketpair()
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    return a, b


@pytest.fixture(params=["unix", "tcp"])
def pair(request):
    a, b = _socket_pair(request.param)
    ca, cb = Channel(a, 1, 5.0), Channel(b, 0, 5.0)
    yield ca, cb
    ca.close()
    cb.close()


def _frames(count: int, seed: int) -> list[tuple[int, bytes]]:
    """Frames of every size class: empty, tiny, up to the one-syscall limit, and larger than a read chunk."""
    rng = __import__("random").Random(seed)
    sizes = [0, 1, 7, 65_536, 65_537, 300_000, 1_100_000]
    out = []
    for i in range(count):
        n = sizes[i % len(sizes)] if i < len(sizes) else rng.choice([0, 13, 900, 20_000, 70_000, 400_000])
        out.append((i % 250, os.urandom(n)))
    return out


def _wire(frames: list[tuple[int, bytes]]) -> bytes:
    return b"".join(HEADER.pack(b"HV", VERSION, k, len(p)) + p for k, p in frames)


def pump(outbox: Outbox, peer: int, sender: Channel, reader: FrameReader, want: int,
         timeout: float = 20.0) -> list[tuple[int, bytes]]:
    """Read on one side and flush the outbox when the socket is writable again, as the engine's rounds do."""
    got: list[tuple[int, bytes]] = []
    poller = select.poll()
    poller.register(reader.channel.fileno(), select.POLLIN)
    deadline = time.monotonic() + timeout
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {len(got)} of {want} frames arrived"
        if outbox.waiting():
            outbox.flush(peer)
        if poller.poll(10):
            got.extend(reader.read())
    return got


def test_sends_never_block_and_frames_arrive_whole_and_in_order(pair):
    a, b = pair
    watched = []
    box = Outbox({1: a}, lambda ch, on: watched.append((ch.peer, on)))
    frames = _frames(60, 1)
    start = time.monotonic()
    for kind, payload in frames:  # nobody reads yet: a blocking send would wait for the 5 s timeout
        box.send(1, kind, payload)
    assert time.monotonic() - start < 2.0
    assert box.waiting() and box.backlog(1) > 0 and watched == [(1, True)]
    got = pump(box, 1, a, FrameReader(b), len(frames))
    assert got == frames
    assert not box.waiting() and box.backlog(1) == 0 and watched == [(1, True), (1, False)]


def test_frames_sent_from_two_threads_never_interleave(pair):
    a, b = pair
    box = Outbox({1: a}, lambda ch, on: None)
    frames = {t: [(t, os.urandom(n)) for n in (5, 70_000, 0, 200_000, 33) * 8] for t in (1, 2)}
    threads = [threading.Thread(target=lambda t=t: [box.send(1, k, p) for k, p in frames[t]]) for t in frames]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    got = pump(box, 1, a, FrameReader(b), 80)
    for t in frames:
        assert [f for f in got if f[0] == t] == frames[t]


def test_reader_returns_partial_frames_later_without_waiting(pair):
    """Bytes that trickle in (one at a time) never make ``read`` wait; each frame comes out once whole."""
    a, b = pair
    reader = FrameReader(b)
    frames = [(3, b"hello"), (4, b""), (5, bytes(range(256)) * 3)]
    wire = _wire(frames)
    got = []
    for i in range(len(wire)):
        a.sock.sendall(wire[i:i + 1])
        time.sleep(0.0002) if i % 97 == 0 else None
        start = time.monotonic()
        got.extend(reader.read())
        assert time.monotonic() - start < 0.5
    deadline = time.monotonic() + 5
    while len(got) < len(frames) and time.monotonic() < deadline:  # the last byte may still travel (TCP)
        got.extend(reader.read())
    assert got == frames


def test_reader_takes_many_frames_in_one_call(pair):
    """A backlog of small frames (24 KB) comes out of one call: one system call, not two per frame."""
    a, b = pair
    frames = [(7, struct.pack("!I", i) * 10) for i in range(500)]
    a.sock.sendall(_wire(frames))
    time.sleep(0.05)
    assert FrameReader(b).read() == frames


def test_frames_before_the_end_of_the_stream_come_first(pair):
    """A peer that sends its last words and closes: the frames, then the closed connection."""
    a, b = pair
    a.send_msg(9, b"last words")
    a.close()
    reader = FrameReader(b)
    time.sleep(0.05)
    assert reader.read() == [(9, b"last words")]
    with pytest.raises(PeerFailure) as info:
        reader.read()
    assert info.value.closed and not isinstance(info.value, TruncatedFrame)


@pytest.mark.parametrize("cut", [3, HEADER.size + 4])
def test_stream_ending_inside_a_frame_is_truncated(pair, cut):
    a, b = pair
    a.sock.sendall((HEADER.pack(b"HV", VERSION, 2, 100) + b"x" * 100)[:cut])
    a.sock.shutdown(socket.SHUT_WR)
    reader = FrameReader(b)
    time.sleep(0.05)
    assert reader.read() == []  # the bytes there (the end of the stream is seen by the next call)
    with pytest.raises(TruncatedFrame):
        reader.read()


@pytest.mark.parametrize("header", [
    b"XX" + bytes([VERSION, 0]) + struct.pack("!I", 0),      # bad magic
    b"HV" + bytes([9, 0]) + struct.pack("!I", 0),      # bad version
    b"HV" + bytes([VERSION, 0]) + struct.pack("!I", 4097),  # over the reader's limit: refused before allocating
])
def test_malformed_headers_are_wire_errors(pair, header):
    a, b = pair
    a.sock.sendall(header)
    time.sleep(0.05)
    with pytest.raises(WireError):
        FrameReader(b, max_len=4096).read()


def _read_one_frame_in_background(sock: socket.socket, got: list) -> threading.Thread:
    """A peer that reads until one frame (or more, when they arrived together) is whole, then stops reading."""
    reader = FrameReader(Channel(sock, 0, 5.0))

    def read() -> None:
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            select.select([sock], [], [], 0.05)
            got.extend(reader.read())

    t = threading.Thread(target=read)
    t.start()
    return t


def test_drain_waits_for_the_named_peers_and_serves_the_others():
    """``drain(peers=...)`` returns once those peers took their bytes; another peer's queue is sent while
    it waits (one peer's frame may be what the other waits for), and a peer that never reads is named."""
    (a1, b1), (a2, b2) = _socket_pair("unix"), _socket_pair("unix")
    ch = {1: Channel(a1, 1, 5.0), 2: Channel(a2, 2, 5.0)}
    box = Outbox(ch, lambda c, on: None)
    big = os.urandom(3_000_000)
    box.send(1, 1, big)
    box.send(2, 2, big)
    got2: list = []
    t = _read_one_frame_in_background(b2, got2)
    start = time.monotonic()
    assert box.drain(0.5, peers={1}) == [1]  # peer 1 never reads
    assert 0.4 < time.monotonic() - start < 3
    assert box.drain(5.0, peers={2}) == []
    t.join(10)
    assert got2 == [(2, big)] and box.backlog(1) > 0 and box.backlog(2) == 0
    for c in (*ch.values(), b1):
        c.close()


def test_drain_until_a_mark_leaves_later_frames_queued():
    """``drain(until=...)`` waits for the frames up to a point of the stream and no others: the peer reads the
    first frame, then (as a rank inside the collective that frame named) reads nothing more; waiting for the
    later frames too would never end."""
    a, b = _socket_pair("unix")
    box = Outbox({1: Channel(a, 1, 5.0)}, lambda c, on: None)
    first, later = os.urandom(2_000_000), os.urandom(3_000_000)
    mark = {1: box.send(1, 1, first)}
    assert box.send(1, 2, later) == 2 * HEADER.size + len(first) + len(later)
    assert mark == {1: HEADER.size + len(first)}
    got: list = []
    t = _read_one_frame_in_background(b, got)
    start = time.monotonic()
    assert box.drain(5.0, peers={1}, until=mark) == []
    assert time.monotonic() - start < 3
    t.join(10)
    assert got[0] == (1, first) and box.waiting() and box.backlog(1) > 0  # the later frame still waits
    assert box.drain(0.3, peers={1}) == [1]  # all of it: the peer no longer reads
    box.flush(1)
    b.close()  # the peer is gone: what waited for it is dropped, and nobody waits for it any more
    deadline = time.monotonic() + 5
    while box.waiting() and time.monotonic() < deadline:
        select.select([], [a], [], 0.1)
        box.flush(1)
    assert not box.waiting() and box.drain(0.1, peers={1}, until={1: 1 << 40}) == []
    a.close()
