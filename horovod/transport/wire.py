"""Framed, authenticated-by-construction byte stream to one peer.

A :class:`Channel` wraps a connected, already authenticated socket (see ``mesh``).  Two kinds of traffic
share it, always in the same order on both sides:

* frames: ``b"HV"``, version u8, kind u8, payload length u32 (big endian), payload — the control plane and
  the handshake;
* raw buffers (``send_buffer``/``recv_buffer_into``): the bytes of a numpy array, no header and no copy,
  whose size both sides already know from the collective they run.

The socket stays in blocking mode (one syscall per call, no poll before it) and gets its deadline from the
kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``), so every wait is bounded by ``timeout`` without any Python-side
polling.  Collectives that must send and receive at once use :func:`exchange`, which drives several
channels with ``MSG_DONTWAIT`` and ``poll`` so large messages never deadlock on full socket buffers.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.exceptions import WireError
from horovod.transport.communicator import PeerFailure

__all__ = ["Channel", "TruncatedFrame", "MAGIC", "VERSION", "HEADER", "MAX_FRAME", "byte_view", "exchange",
           "Transfer"]

logger = logging.getLogger(__name__)

MAGIC = b"HV"
VERSION = 1
HEADER = struct.Struct("!2sBBI")
MAX_FRAME = 256 * 1024 * 1024
# Payloads up to this size are sent together with their header in one syscall.
_SMALL = 64 * 1024
_TIMEVAL = struct.Struct("ll")
_WAITALL = socket.MSG_WAITALL
_DONTWAIT = socket.MSG_DONTWAIT


class TruncatedFrame(PeerFailure, WireError):
    """The peer's stream ended inside a frame: both a malformed frame and a lost peer."""


def byte_view(buf: Any) -> memoryview:
    """A flat writable-if-possible byte view of ``buf`` (numpy array of any dtype, incl. bfloat16)."""
    if isinstance(buf, np.ndarray):
        return memoryview(buf.reshape(-1).view(np.uint8))
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _timeval(seconds: float | None) -> bytes:
    if seconds is None or seconds <= 0:
        return _TIMEVAL.pack(0, 0)  # 0 = wait forever
    whole = int(seconds)
    usec = int((seconds - whole) * 1e6)
    return _TIMEVAL.pack(whole, usec if whole or usec else 1)


class Channel:
    """One framed, blocking socket to ``peer`` (a global rank) with a per-call deadline.

    Raises (all methods):
        PeerFailure: the peer closed or reset the connection, or did not answer within ``timeout``.
        WireError: (``recv_msg``) the bytes are not a frame of our protocol.
    """

    __slots__ = ("sock", "peer", "_timeout", "_hdr", "_hdr_view", "is_unix")

    def __init__(self, sock: socket.socket, peer: int, timeout: float | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.is_unix = sock.family == socket.AF_UNIX
        self._hdr = bytearray(HEADER.size)
        self._hdr_view = memoryview(self._hdr)
        self._timeout: float | None = None
        sock.setblocking(True)
        if not self.is_unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.settimeout(timeout)

    # -- configuration -------------------------------------------------------------------------------
    @property
    def timeout(self) -> float | None:
        return self._timeout

    def settimeout(self, seconds: float | None) -> None:
        """Bound every blocking send/recv to ``seconds`` (None: no bound) in the kernel, not in Python."""
        self._timeout = seconds
        tv = _timeval(seconds)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover - closing a broken socket
            pass

    def __repr__(self) -> str:
        kind = "unix" if self.is_unix else "tcp"
        return f"Channel(peer={self.peer}, {kind}, fd={self.sock.fileno()})"

    # -- failures ------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException | None, what: str) -> PeerFailure:
        if isinstance(exc, (BlockingIOError, TimeoutError)):
            limit = f"{self._timeout:g} s" if self._timeout else "the deadline"
            return PeerFailure(self.peer, f"timed out after {limit} while {what}")
        if exc is None:
            return PeerFailure(self.peer, f"connection closed by peer while {what}", closed=True)
        return PeerFailure(self.peer, f"{type(exc).__name__} while {what}: {exc}",
                           closed=isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)))

    # -- frames --------------------------------------------------------------------------------------
    def send_msg(self, kind: int, payload: bytes | bytearray | memoryview = b"") -> None:
        """Send one frame; small payloads go out with their header in a single syscall."""
        n = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        if n > MAX_FRAME:
            raise WireError(f"frame of {n} bytes to rank {self.peer} exceeds the {MAX_FRAME}-byte limit")
        header = HEADER.pack(MAGIC, VERSION, kind, n)
        try:
            if n <= _SMALL:
                self.sock.sendall(header + payload if n else header)
            else:
                self.sock.sendall(header)
                self.sock.sendall(payload)
        except OSError as e:
            raise self._fail(e, "sending a frame") from e

    def recv_msg(self, max_len: int = MAX_FRAME) -> tuple[int, bytes]:
        """Receive one frame: ``(kind, payload)``; payloads over ``max_len`` are a WireError."""
        self._recv_exact(self._hdr_view, "receiving a frame header")
        magic, version, kind, n = HEADER.unpack_from(self._hdr)
        if magic != MAGIC:
            raise WireError(f"bad frame magic {bytes(magic)!r} from rank {self.peer}")
        if version != VERSION:
            raise WireError(f"unsupported frame version {version} from rank {self.peer}")
        if n > max_len:
            raise WireError(f"frame of {n} bytes from rank {self.peer} exceeds the {max_len}-byte limit")
        if n == 0:
            return kind, b""
        try:
            data = self.sock.recv(n, _WAITALL)
        except OSError as e:
            raise self._fail(e, "receiving a frame payload") from e
        if len(data) == n:
            return kind, data
        rest = bytearray(n - len(data))
        self._recv_exact(memoryview(rest), "receiving a frame payload", in_frame=True)
        return kind, data + rest

    # -- raw buffers ---------------------------------------------------------------------------------
    def send_buffer(self, buf: Any) -> None:
        """Send the raw bytes of ``buf`` (no header, no copy)."""
        view = byte_view(buf)
        if not view.nbytes:
            return
        try:
            self.sock.sendall(view)
        except OSError as e:
            raise self._fail(e, f"sending {view.nbytes} bytes") from e

    def recv_buffer_into(self, buf: Any) -> None:
        """Fill ``buf`` with exactly ``buf.nbytes`` raw bytes from the peer."""
        view = byte_view(buf)
        if view.nbytes:
            self._recv_exact(view, f"receiving {view.nbytes} bytes")

    def _recv_exact(self, view: memoryview, what: str, in_frame: bool = False) -> None:
        """Fill ``view``; EOF after part of a frame (``in_frame`` or a partial read) is a TruncatedFrame."""
        got, n = 0, view.nbytes
        recv_into = self.sock.recv_into
        while got < n:
            try:
                k = recv_into(view[got:] if got else view, n - got, _WAITALL)
            except OSError as e:
                raise self._fail(e, what) from e
            if k == 0:
                if in_frame or got:
                    raise TruncatedFrame(self.peer, f"connection closed in the middle of a frame while {what}",
                                         closed=True)
                raise self._fail(None, what)
            got += k

    # -- file descriptors (AF_UNIX only) ---------------------------------------------------------------
    def send_fd(self, kind: int, fd: int, payload: bytes = b"") -> None:
        """Send a frame with ``fd`` attached (SCM_RIGHTS); the peer gets its own descriptor."""
        if not self.is_unix:
            raise WireError(f"cannot pass file descriptors to rank {self.peer} over TCP")
        frame = HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload
        try:
            sent = socket.send_fds(self.sock, [frame], [fd])
            if sent < len(frame):
                self.sock.sendall(frame[sent:])
        except OSError as e:
            raise self._fail(e, "passing a file descriptor") from e

    def recv_fd(self, kind: int) -> tuple[int, bytes]:
        """Receive a frame of ``kind`` sent by :meth:`send_fd`: ``(fd, payload)``."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, HEADER.size, 1)
        except OSError as e:
            raise self._fail(e, "receiving a file descriptor") from e
        if not data:
            raise self._fail(None, "receiving a file descriptor")
        if len(data) < HEADER.size:
            rest = bytearray(HEADER.size - len(data))
            self._recv_exact(memoryview(rest), "receiving a file descriptor")
            data += rest
        magic, version, got_kind, n = HEADER.unpack(data)
        if magic != MAGIC or version != VERSION or got_kind != kind or n > MAX_FRAME or not fds:
            for fd in fds:
                _close_fd(fd)
            raise WireError(f"expected a descriptor frame of kind {kind} from rank {self.peer}")
        payload = b""
        if n:
            buf = bytearray(n)
            self._recv_exact(memoryview(buf), "receiving a descriptor payload")
            payload = bytes(buf)
        return fds[0], payload


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:  # pragma: no cover
        pass


class Transfer:
    """One direction of an :func:`exchange`: ``view`` is sent to / filled from ``channel``.

    ``on_progress(done_bytes)`` (receives only) is called whenever more bytes arrived, so callers can
    reduce finished pieces while the rest is still in flight.  ``limit`` (sends only) is how many bytes
    may be sent so far; a receive's callback may raise it to forward data as it arrives.
    """

    __slots__ = ("channel", "view", "done", "on_progress", "limit")

    def __init__(self, channel: Channel, buf: Any,
                 on_progress: Callable[[int], None] | None = None) -> None:
        self.channel = channel
        self.view = buf if isinstance(buf, memoryview) else byte_view(buf)
        self.done = 0
        self.on_progress = on_progress
        self.limit = self.view.nbytes


def exchange(sends: Sequence[Transfer], recvs: Sequence[Transfer], timeout: float) -> None:
    """Send and receive several raw buffers at once without deadlocking on full socket buffers.

    Non-blocking syscalls (``MSG_DONTWAIT``) make progress on every transfer; when none can progress the
    caller sleeps in ``poll`` until a socket is ready.  ``timeout`` bounds the time without any progress
    (``<= 0``: no bound, like :meth:`Channel.settimeout`).

    Raises:
        PeerFailure: a peer closed its socket, or nothing moved for ``timeout`` seconds (names the peer).
    """
    pending_s = [t for t in sends if t.done < t.view.nbytes]
    pending_r = [t for t in recvs if t.done < t.view.nbytes]
    bounded = timeout > 0
    deadline = time.monotonic() + timeout
    while pending_s or pending_r:
        progressed = False
        for t in pending_s:
            if t.done >= t.limit:
                continue
            try:
                k = t.channel.sock.send(t.view[t.done:t.limit], _DONTWAIT)
            except BlockingIOError:
                continue
            except OSError as e:
                raise t.channel._fail(e, "sending") from e
            t.done += k
            progressed = True
        if progressed:
            pending_s = [t for t in pending_s if t.done < t.view.nbytes]
        if not pending_s and len(pending_r) == 1 and pending_r[0].on_progress is None:
            break  # the common two-member case: one blocking receive, no poll
        for t in pending_r:
            try:
                k = t.channel.sock.recv_into(t.view[t.done:], t.view.nbytes - t.done, _DONTWAIT)
            except BlockingIOError:
                continue
            except OSError as e:
                raise t.channel._fail(e, "receiving") from e
            if k == 0:
                raise t.channel._fail(None, "receiving")
            t.done += k
            progressed = True
            if t.on_progress is not None:
                t.on_progress(t.done)
        if progressed:
            pending_s = [t for t in pending_s if t.done < t.view.nbytes]
            pending_r = [t for t in pending_r if t.done < t.view.nbytes]
            deadline = time.monotonic() + timeout
            continue
        remaining = deadline - time.monotonic() if bounded else -1.0
        if bounded and remaining <= 0:
            t = (pending_r or pending_s)[0]
            raise PeerFailure(t.channel.peer, f"timed out after {timeout:g} s waiting for the peer inside a "
                              f"collective ({'receiving' if pending_r else 'sending'})")
        masks: dict[int, int] = {}
        for t in pending_s:
            if t.done < t.limit:
                fd = t.channel.sock.fileno()
                masks[fd] = masks.get(fd, 0) | select.POLLOUT
        for t in pending_r:
            fd = t.channel.sock.fileno()
            masks[fd] = masks.get(fd, 0) | select.POLLIN
        poller = select.poll()
        for fd, mask in masks.items():
            poller.register(fd, mask)
        poller.poll(remaining * 1000.0 if bounded else None)
    if pending_r:
        # Everything we owe is sent, so blocking on the last receive cannot deadlock; the socket's
        # SO_RCVTIMEO (the channel's timeout) bounds it.
        t = pending_r[0]
        t.channel._recv_exact(t.view[t.done:], "receiving")
        t.done = t.view.nbytes
