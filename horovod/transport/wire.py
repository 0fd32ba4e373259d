"""Framed, authenticated-by-construction byte stream to one peer.

A :class:`Channel` wraps a connected, already authenticated socket (see ``mesh``).  Two kinds of traffic
share it, always in the same order on both sides:

* frames: ``b"HV"``, version u8, kind u8, payload length u32 (big endian), payload — the control plane and
  the handshake;
* raw buffers (``send_buffer``/``recv_buffer_into``): the bytes of a numpy array, no header and no copy,
  whose size both sides already know from the collective they run.

The socket stays in blocking mode (one syscall per call, no poll before it) and gets its deadline from the
kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``), so every wait is bounded by ``timeout`` without any Python-side
polling; a receive sleeps in slices of it and counts the peer's silence (see :meth:`Channel._recv_exact`).
Collectives that must send and receive at once use :func:`exchange`, which drives several
channels with non-blocking calls (:meth:`Channel.try_send`, :meth:`Channel.try_recv_into`) and ``poll`` so
large messages never deadlock on full socket buffers.

:class:`TlsChannel` is the same contract over an ``ssl.SSLSocket`` (``horovodrun --tls``).  ``SSLSocket``
takes no ``MSG_*`` flags and ignores the kernel's ``SO_RCVTIMEO`` (OpenSSL retries the read), so its socket
stays non-blocking and every wait is a ``poll`` with the channel's deadline.  Frames stay aligned with TLS
records: every send is written with its own ``SSL_write`` calls and OpenSSL reads exactly one record at a
time from the kernel, so once a whole frame was read nothing of the next one sits decrypted inside the SSL
object -- a selector on :meth:`Channel.fileno` (the engine's control loop) sees every frame that arrives
(:meth:`Channel.pending` says how many bytes are buffered; tests check that it is 0 after each frame).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.base.cores import Spin
from horovod.base.exceptions import WireError
from horovod.transport.communicator import PeerFailure

__all__ = ["Channel", "TlsChannel", "make_channel", "TruncatedFrame", "MAGIC", "VERSION", "HEADER", "MAX_FRAME",
           "byte_view", "frame_parts", "FrameReader", "new_scratch", "READ_CHUNK", "exchange",
           "Transfer"]

logger = logging.getLogger(__name__)

MAGIC = b"HV"
# The layout of every frame and record after the mesh handshake (this module's and the control plane's, in
# horovod.runtime.messages): bump it with any change of them.  The handshake's frames keep their layout in
# every version and carry the sender's VERSION, so that ranks of different versions name each other
# (horovod.transport.mesh).  2: Request.group_size in the request record.
VERSION = 2
HEADER = struct.Struct("!2sBBI")
MAX_FRAME = 256 * 1024 * 1024
# Payloads up to this size are sent together with their header in one syscall.
_SMALL = 64 * 1024
# Bytes a FrameReader takes from the socket per call: many small control frames, or one frame with 64 KiB of
# inline tensors, in one syscall (a larger payload is received straight into its own buffer).
READ_CHUNK = 256 * 1024
_TIMEVAL = struct.Struct("ll")
# A blocking receive of a plain channel sleeps in slices of its deadline (see Channel._recv_exact): a peer that
# stopped is reported at most a slice after the deadline, and a peer that is merely slow costs a wake-up a slice.
_SLICES = 8
_MIN_SLICE = 0.05
_WAITALL = socket.MSG_WAITALL
_DONTWAIT = socket.MSG_DONTWAIT
# Plaintext bytes handed to one SSL_write: bounds what a non-blocking send must retry unchanged, and lets
# :func:`exchange` see progress (and reset its deadline) while a large buffer is being encrypted and sent.
_TLS_CHUNK = 256 * 1024
_WANT = (ssl.SSLWantReadError, ssl.SSLWantWriteError)
_TLS_EOF = (ssl.SSLEOFError, ssl.SSLZeroReturnError)


class TruncatedFrame(PeerFailure, WireError):
    """The peer's stream ended inside a frame: both a malformed frame and a lost peer."""


def frame_parts(peer: int, kind: int, payload: bytes | bytearray | memoryview = b"") -> list[memoryview]:
    """The bytes of one frame to ``peer``: header and payload in one piece when small (one syscall), else
    the header and the payload itself (not copied)."""
    n = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes to rank {peer} exceeds the {MAX_FRAME}-byte limit")
    header = HEADER.pack(MAGIC, VERSION, kind, n)
    if n <= _SMALL:
        return [memoryview(header + payload if n else header)]
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    return [memoryview(header), view if view.format == "B" and view.ndim == 1 else view.cast("B")]


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

    __slots__ = ("sock", "peer", "_timeout", "_slice", "_hdr", "_hdr_view", "is_unix")

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
        """Bound every blocking send/recv to ``seconds`` (None: no bound) in the kernel, not in Python; a
        receive to ``seconds`` of the peer's silence."""
        self._timeout = seconds
        # A blocking receive sleeps a slice of the deadline at a time and counts the silence (see _recv_exact).
        self._slice = None if seconds is None or seconds <= 0 else min(seconds, max(_MIN_SLICE, seconds / _SLICES))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self._slice))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))

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
        try:
            for part in frame_parts(self.peer, kind, payload):
                self._sendall(part)
        except OSError as e:
            raise self._fail(e, "sending a frame") from e

    def recv_msg(self, max_len: int = MAX_FRAME) -> tuple[int, bytes]:
        """Receive one frame: ``(kind, payload)``; payloads over ``max_len`` are a WireError."""
        version, kind, payload = self.recv_frame(max_len)
        if version != VERSION:
            raise WireError(f"unsupported frame version {version} from rank {self.peer}")
        return kind, payload

    def recv_frame(self, max_len: int = MAX_FRAME) -> tuple[int, int, bytes]:
        """Receive one frame of any version: ``(version, kind, payload)`` (the handshake reads the peer's)."""
        self._recv_exact(self._hdr_view, "receiving a frame header")
        magic, version, kind, n = HEADER.unpack_from(self._hdr)
        if magic != MAGIC:
            raise WireError(f"bad frame magic {bytes(magic)!r} from rank {self.peer}")
        if n > max_len:
            raise WireError(f"frame of {n} bytes from rank {self.peer} exceeds the {max_len}-byte limit")
        if n == 0:
            return version, kind, b""
        return version, kind, self._recv_payload(n)

    def _recv_payload(self, n: int) -> bytes:
        try:
            data = self.sock.recv(n, _WAITALL)
        except (BlockingIOError, TimeoutError):
            data = b""  # a slice of the deadline passed: _recv_exact waits for the rest
        except OSError as e:
            raise self._fail(e, "receiving a frame payload") from e
        if len(data) == n:
            return data
        rest = bytearray(n - len(data))
        self._recv_exact(memoryview(rest), "receiving a frame payload", in_frame=True)
        return data + rest

    # -- raw buffers ---------------------------------------------------------------------------------
    def send_buffer(self, buf: Any) -> None:
        """Send the raw bytes of ``buf`` (no header, no copy)."""
        view = byte_view(buf)
        if not view.nbytes:
            return
        try:
            self._sendall(view)
        except OSError as e:
            raise self._fail(e, f"sending {view.nbytes} bytes") from e

    def recv_buffer_into(self, buf: Any, what: str | None = None) -> None:
        """Fill ``buf`` with exactly ``buf.nbytes`` raw bytes from the peer (``what``: the wait, for errors)."""
        view = byte_view(buf)
        if view.nbytes:
            self._recv_exact(view, what or f"receiving {view.nbytes} bytes")

    def _recv_exact(self, view: memoryview, what: str, in_frame: bool = False) -> None:
        """Fill ``view``; EOF after part of a frame (``in_frame`` or a partial read) is a TruncatedFrame.

        The deadline counts the peer's silence, not the whole receive.  A ``MSG_WAITALL`` call returns what
        arrived only once its deadline ran out, and the next call waits a whole deadline again: a peer that
        stopped after part of a buffer was reported after up to twice the deadline -- late enough for the
        ranks waiting on *this* one (a ring) to time out first and blame a live rank.  So the kernel's
        deadline is a slice of the channel's (``_slice``), and the receive fails once slices without any
        data add up to it; a slice that ends with part of the data says the peer spoke less than a slice ago.
        """
        got, n = 0, view.nbytes
        recv_into = self._recv_into
        silent = 0.0
        while got < n:
            try:
                k = recv_into(view[got:] if got else view, n - got)
            except (BlockingIOError, TimeoutError) as e:
                silent = self._still_waiting(e, silent, what)
                continue
            except OSError as e:
                raise self._fail(e, what) from e
            if k == 0:
                if in_frame or got:
                    raise TruncatedFrame(self.peer, f"connection closed in the middle of a frame while {what}",
                                         closed=True)
                raise self._fail(None, what)
            got += k
            silent = 0.0

    def _still_waiting(self, e: OSError, silent: float, what: str) -> float:
        """A blocking receive's slice ended without data: the silence so far, or the timeout's PeerFailure."""
        if self._slice is not None:
            silent += self._slice
            if silent < self._timeout:  # type: ignore[operator]
                return silent
        raise self._fail(e, what) from e

    # -- socket primitives (TlsChannel overrides these) ----------------------------------------------
    def _sendall(self, data: bytes | bytearray | memoryview) -> None:
        self.sock.sendall(data)

    def _recv_into(self, view: memoryview, n: int) -> int:
        """Blocking receive of up to ``n`` bytes (all of them unless EOF or the deadline); 0 = EOF."""
        return self.sock.recv_into(view, n, _WAITALL)

    def try_send(self, view: memoryview) -> int | None:
        """Send what the socket takes now without waiting: bytes sent, or None if it would block.

        A None must be followed by a retry with the same bytes at the same position (TLS requires it).
        """
        try:
            return self.sock.send(view, _DONTWAIT)
        except BlockingIOError:
            return None

    def try_recv_into(self, view: memoryview, n: int) -> int | None:
        """Receive what has arrived, up to ``n`` bytes, without waiting: bytes received (0 = EOF) or None."""
        try:
            return self.sock.recv_into(view, n, _DONTWAIT)
        except BlockingIOError:
            return None

    def pending(self) -> int:
        """Bytes already received and buffered in user space (always 0 without TLS)."""
        return 0

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
        silent = 0.0
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, HEADER.size, 1)
                break
            except (BlockingIOError, TimeoutError) as e:
                silent = self._still_waiting(e, silent, "receiving a file descriptor")
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


class TlsChannel(Channel):
    """A :class:`Channel` over a connected ``ssl.SSLSocket`` that completed its handshake (``--tls``).

    The socket is kept non-blocking: a call that cannot go on waits in ``poll`` until the socket is ready
    or ``timeout`` passed without progress (the deadline the kernel enforces for a plain channel).
    Decryption errors (an altered record) and TLS alerts are :class:`PeerFailure`, like a reset.

    One thread may receive while another sends (the engine reads a control channel while the keep-alive
    thread writes to it), but an OpenSSL connection must not be used by two threads at once: every SSL
    call -- never a wait, they do not block -- runs under the channel's lock.
    """

    __slots__ = ("_lock",)

    def __init__(self, sock: socket.socket, peer: int, timeout: float | None = None) -> None:
        self._lock = threading.Lock()
        super().__init__(sock, peer, timeout)

    def settimeout(self, seconds: float | None) -> None:
        """Bound every wait without progress to ``seconds`` (None: no bound), checked in ``poll``."""
        self._timeout = seconds
        self._slice = None  # each wait in poll already measures silence (it restarts with every record)
        self.sock.setblocking(False)

    def __repr__(self) -> str:
        return f"TlsChannel(peer={self.peer}, fd={self.sock.fileno()})"

    def close(self) -> None:
        with self._lock:  # not in the middle of another thread's SSL call
            super().close()

    def _deadline(self) -> float | None:
        t = self._timeout
        return None if t is None or t <= 0 else time.monotonic() + t

    def _wait(self, events: int, deadline: float | None) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError("timed out")
        poller = select.poll()
        poller.register(self.sock.fileno(), events)
        poller.poll(None if remaining is None else remaining * 1000.0)

    def _sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        done, n = 0, view.nbytes
        send, lock = self.sock.send, self._lock
        deadline = self._deadline()
        while done < n:
            try:
                with lock:
                    done += send(view[done:done + _TLS_CHUNK])  # after a "want", the same bytes again
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT, deadline)
                continue
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, deadline)
                continue
            deadline = self._deadline()

    def _recv_into(self, view: memoryview, n: int) -> int:
        deadline = self._deadline()
        while True:
            try:
                with self._lock:
                    return self.sock.recv_into(view, n)
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, deadline)
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT, deadline)
            except _TLS_EOF:
                return 0

    def _recv_payload(self, n: int) -> bytes:
        buf = bytearray(n)
        self._recv_exact(memoryview(buf), "receiving a frame payload", in_frame=True)
        return bytes(buf)

    def try_send(self, view: memoryview) -> int | None:
        try:
            with self._lock:
                return self.sock.send(view[:_TLS_CHUNK])
        except _WANT:
            return None

    def try_recv_into(self, view: memoryview, n: int) -> int | None:
        # One SSL read returns one record (16 KiB at most): take what has arrived, up to _TLS_CHUNK, in one
        # call, so that exchange() does not go round (and retry its sends) once per record.
        got, recv_into = 0, self.sock.recv_into
        want = min(n, _TLS_CHUNK)
        with self._lock:
            while got < want:
                try:
                    k = recv_into(view[got:] if got else view, n - got)
                except _WANT:
                    break
                except _TLS_EOF:
                    k = 0
                if not k:
                    return got or 0
                got += k
        return got or None

    def pending(self) -> int:
        with self._lock:
            return self.sock.pending()


def new_scratch() -> memoryview:
    """A receive buffer for :class:`FrameReader` (one per thread that reads; readers may share it)."""
    return memoryview(bytearray(READ_CHUNK))


class FrameReader:
    """The frames of one channel, read without ever waiting for the rest of a frame.

    :meth:`Channel.recv_msg` blocks until a whole frame is there; a reader that blocks on a frame its peer
    could not finish sending (the peer's :class:`~horovod.transport.outbox.Outbox` holds the rest) waits
    for a peer that may itself be waiting for the reader inside a collective.  :meth:`read` takes what has
    arrived -- every complete frame, in order, in as few system calls as it can -- and keeps a partial frame
    for the next call.  A header is checked before its payload is allocated (``max_len``).
    """

    __slots__ = ("channel", "_max", "_scratch", "_head", "_have", "_kind", "_payload", "_got", "_error")

    def __init__(self, channel: Channel, max_len: int = MAX_FRAME, scratch: memoryview | None = None) -> None:
        """``scratch``: a buffer of at least :data:`READ_CHUNK` bytes that readers used by one thread at a time
        may share (what is left in it between calls is copied out)."""
        self.channel = channel
        self._max = max_len
        self._scratch = scratch if scratch is not None else new_scratch()
        self._head = bytearray(HEADER.size)
        self._have = 0  # header bytes held
        self._kind = 0
        self._payload: bytearray | None = None  # a payload being filled, and its bytes so far
        self._got = 0
        self._error: BaseException | None = None  # met after complete frames: raised by the next call

    def read(self) -> list[tuple[int, bytes]]:
        """The frames complete now, ``(kind, payload)`` each ([] if none).

        Raises PeerFailure when the peer closed or reset the connection (TruncatedFrame inside a frame) and
        WireError for bytes that are not a frame; frames complete before either are returned first.
        """
        if self._error is not None:
            raise self._error
        channel, frames = self.channel, []
        try:
            while True:
                payload = self._payload
                if payload is not None and len(payload) - self._got >= READ_CHUNK:
                    k = channel.try_recv_into(memoryview(payload)[self._got:], len(payload) - self._got)
                    if k:
                        self._got += k
                        if self._got == len(payload):
                            frames.append((self._kind, bytes(payload)))
                            self._payload = None
                        continue
                else:
                    k = channel.try_recv_into(self._scratch, READ_CHUNK)
                    if k:
                        self._feed(self._scratch[:k], frames)
                        if k == READ_CHUNK or channel.pending():
                            continue
                        return frames
                if k is None:
                    return frames
                if self._have or self._payload is not None:
                    raise TruncatedFrame(channel.peer, "connection closed in the middle of a frame", closed=True)
                raise channel._fail(None, "receiving a frame header")
        except OSError as e:
            error = e if isinstance(e, (PeerFailure, WireError)) else channel._fail(e, "receiving a frame")
            if not frames:
                raise error from None
            self._error = error
            return frames

    def _feed(self, view: memoryview, frames: list[tuple[int, bytes]]) -> None:
        pos, n, head = 0, len(view), self._head
        while pos < n:
            payload = self._payload
            if payload is None:
                if not self._have and n - pos >= HEADER.size:  # the common case: a whole header here
                    magic, version, kind, length = HEADER.unpack_from(view, pos)
                    pos += HEADER.size
                else:
                    take = min(HEADER.size - self._have, n - pos)
                    head[self._have:self._have + take] = view[pos:pos + take]
                    self._have += take
                    pos += take
                    if self._have < HEADER.size:
                        return
                    self._have = 0
                    magic, version, kind, length = HEADER.unpack(head)
                if magic != MAGIC:
                    raise WireError(f"bad frame magic {bytes(magic)!r} from rank {self.channel.peer}")
                if version != VERSION:
                    raise WireError(f"unsupported frame version {version} from rank {self.channel.peer}")
                if length > self._max:
                    raise WireError(f"frame of {length} bytes from rank {self.channel.peer} exceeds the "
                                    f"{self._max}-byte limit")
                if n - pos >= length:  # the whole payload is here: no staging copy
                    frames.append((kind, bytes(view[pos:pos + length])))
                    pos += length
                    continue
                self._kind, self._payload, self._got = kind, bytearray(length), 0
            else:
                take = min(len(payload) - self._got, n - pos)
                payload[self._got:self._got + take] = view[pos:pos + take]
                self._got += take
                pos += take
                if self._got == len(payload):
                    frames.append((self._kind, bytes(payload)))
                    self._payload = None


def make_channel(sock: socket.socket, peer: int, timeout: float | None = None) -> Channel:
    """The channel type for ``sock``: :class:`TlsChannel` for an ``ssl.SSLSocket``, else :class:`Channel`."""
    if isinstance(sock, ssl.SSLSocket):
        return TlsChannel(sock, peer, timeout)
    return Channel(sock, peer, timeout)


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


def exchange(sends: Sequence[Transfer], recvs: Sequence[Transfer], timeout: float,
             spin: Spin | None = None) -> None:
    """Send and receive several raw buffers at once without deadlocking on full socket buffers.

    Non-blocking syscalls (``MSG_DONTWAIT``) make progress on every transfer; when none can progress the
    caller sleeps in ``poll`` until a socket is ready.  ``timeout`` bounds the time without any progress
    (``<= 0``: no bound, like :meth:`Channel.settimeout`).  The last receive, once everything is sent, polls
    its socket under ``spin`` before it sleeps in it: the peer is usually microseconds away, and a sleeping
    thread's wake-up costs a VM 20-100 us.

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
                k = t.channel.try_send(t.view[t.done:t.limit])
            except OSError as e:
                raise t.channel._fail(e, "sending") from e
            if k is None:
                continue
            t.done += k
            progressed = True
        if progressed:
            pending_s = [t for t in pending_s if t.done < t.view.nbytes]
        if not pending_s and len(pending_r) == 1 and pending_r[0].on_progress is None:
            break  # the common two-member case: one blocking receive, no poll
        for t in pending_r:
            try:
                k = t.channel.try_recv_into(t.view[t.done:], t.view.nbytes - t.done)
            except OSError as e:
                raise t.channel._fail(e, "receiving") from e
            if k is None:
                continue
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
        # Everything we owe is sent, so blocking on the last receive cannot deadlock; the channel's
        # deadline bounds the peer's silence in it (Channel._recv_exact).
        t = pending_r[0]
        if spin is not None and spin.seconds:
            try:
                got = spin.poll(lambda: t.channel.try_recv_into(t.view[t.done:], t.view.nbytes - t.done))
            except OSError as e:
                raise t.channel._fail(e, "receiving") from e
            if got == 0:
                raise t.channel._fail(None, "receiving")
            t.done += got or 0
        if t.done < t.view.nbytes:
            t.channel._recv_exact(t.view[t.done:], "receiving")
        t.done = t.view.nbytes
