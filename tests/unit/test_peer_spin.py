"""A member waiting for a peer polls briefly before it sleeps (horovod.base.cores.Spin; the shared-memory
communicator's token wait, ShmCommunicator._recv_token)."""

from __future__ import annotations

import socket
import threading

import pytest

import horovod.base.cores as cores
from horovod.base.cores import PEER_SPIN_US, Spin
from horovod.transport.shm import ShmCommunicator


class _Socket:
    """A channel (and its socket) that records how it was read: ``ready_after`` non-blocking reads fail
    before the token is there; the blocking read is the channel's."""

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after = ready_after
        self.polls = 0
        self.blocking_reads = 0
        self.sock = self

    def recv_into(self, buf: bytearray, n: int, flags: int = 0) -> int:
        assert flags & socket.MSG_DONTWAIT
        self.polls += 1
        if self.ready_after is None or self.polls <= self.ready_after:
            raise BlockingIOError
        buf[0] = 1
        return 1

    def recv_buffer_into(self, buf: bytearray, what: str) -> None:
        self.blocking_reads += 1
        buf[0] = 1


def _member(spin: float) -> ShmCommunicator:
    member = ShmCommunicator.__new__(ShmCommunicator)  # only the token wait's state
    member._spin = Spin(spin)
    return member


def test_a_token_that_comes_while_polling_is_taken_without_sleeping():
    member, sock, tok = _member(10.0), _Socket(ready_after=3), bytearray(1)
    assert member._recv_token(sock, tok) == 1 and tok[0] == 1
    assert (sock.polls, sock.blocking_reads) == (4, 0)
    assert (member._spin._skip, member._spin._backoff) == (0, 1)


def test_a_poll_that_finds_nothing_sleeps_and_backs_off():
    member, sock, tok = _member(200e-6), _Socket(ready_after=None), bytearray(1)
    skipped = []
    for _ in range(8):
        polls = sock.polls
        assert member._recv_token(sock, tok) == 1
        skipped.append(sock.polls == polls)
    assert sock.blocking_reads == 8  # every wait ended in the socket's own (bounded) read
    # poll, then sleep at once for 1, 2, 4 waits before polling again
    assert skipped == [False, True, False, True, True, False, True, True]
    member._spin._skip, member._spin._backoff = 0, 64
    member._recv_token(sock, tok)
    assert member._spin._backoff == 64  # the longest back-off

    found = _Socket(ready_after=0)
    member._spin._skip = 0
    member._recv_token(found, tok)
    assert found.blocking_reads == 0 and member._spin._backoff == 1  # a poll that succeeds resets it


def test_without_spin_the_member_sleeps_in_the_socket_at_once():
    member, sock = _member(0.0), _Socket(ready_after=0)
    member._recv_token(sock, bytearray(1))
    assert (sock.polls, sock.blocking_reads) == (0, 1)


def test_peer_spin_follows_the_knob_and_the_cores(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert Spin.for_peers(500.0, 2).seconds == pytest.approx(PEER_SPIN_US * 1e-6)
    assert Spin.for_peers(30.0, 2).seconds == pytest.approx(30e-6)  # never longer than HOROVOD_SPIN_WAIT_US
    assert Spin.for_peers(0.0, 2).seconds == 0.0  # the knob turns spinning off
    assert Spin.for_peers(500.0, 3).seconds == 0.0  # more ranks on this host than cores


def test_real_socket_pair():
    """The non-blocking poll works on a real channel's socket (blocking, SO_RCVTIMEO set)."""
    from horovod.transport.communicator import PeerFailure
    from horovod.transport.wire import Channel

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ch = Channel(b, peer=1, timeout=0.2)
    try:
        member, tok = _member(0.05), bytearray(1)
        a.sendall(b"\x01")
        assert member._recv_token(ch, tok) == 1 and member._spin._backoff == 1
        # nothing sent: the poll gives up, the channel's bounded read times out
        with pytest.raises(PeerFailure, match="rank 1: timed out after 0.2 s while waiting for a shared-memory"):
            member._recv_token(ch, tok)
        assert member._spin._skip == 1
    finally:
        a.close()
        b.close()


def _channel_pair():
    from horovod.transport.wire import Channel

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a, Channel(b, peer=1, timeout=2.0)


def test_the_last_receive_of_an_exchange_polls_before_it_sleeps(monkeypatch):
    import numpy as np

    from horovod.transport.wire import Channel, Transfer, exchange

    a, ch = _channel_pair()
    try:
        slept = []
        original = Channel._recv_exact
        monkeypatch.setattr(Channel, "_recv_exact", lambda *args: slept.append(1) or original(*args))
        data = np.arange(1000, dtype=np.float32)
        a.sendall(data.tobytes())  # already there: the poll takes all of it
        got = np.empty_like(data)
        exchange([], [Transfer(ch, got)], 2.0, Spin(0.05))
        np.testing.assert_array_equal(got, data)
        assert not slept
        a.sendall(data[:500].tobytes())  # half there: the poll takes it, the bounded read the rest
        rest = threading.Timer(0.1, lambda: a.sendall(data[500:].tobytes()))
        rest.start()
        got[:] = 0
        exchange([], [Transfer(ch, got)], 2.0, Spin(0.05))
        rest.join()
        np.testing.assert_array_equal(got, data)
        assert slept == [1]
    finally:
        a.close()
        ch.sock.close()


def test_a_peer_that_closes_while_polled_is_named():
    import numpy as np

    from horovod.transport.communicator import PeerFailure
    from horovod.transport.wire import Transfer, exchange

    a, ch = _channel_pair()
    try:
        a.close()
        with pytest.raises(PeerFailure, match="rank 1"):
            exchange([], [Transfer(ch, np.empty(10, np.uint8))], 2.0, Spin(0.05))
    finally:
        ch.sock.close()


def test_a_peer_that_resets_while_polled_is_named():
    import numpy as np

    from horovod.transport.communicator import PeerFailure
    from horovod.transport.wire import Transfer, exchange

    a, ch = _channel_pair()
    try:
        ch.sock.sendall(b"unread")  # closing with unread bytes resets the connection (ECONNRESET here)
        a.close()
        with pytest.raises(PeerFailure, match="rank 1"):
            exchange([], [Transfer(ch, np.empty(10, np.uint8))], 2.0, Spin(0.05))
    finally:
        ch.sock.close()
