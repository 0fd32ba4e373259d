"""The rendezvous store: an authenticated key/value store over HTTP, run by the launcher.

Workers publish their addresses here and poll for each other's (the client, ``horovod.transport.store``,
polls; the server never blocks a request).  Requests and answers are signed with the job key (the scheme is in
:mod:`horovod.transport.store`), so a process without the key can neither read (the values include connection
addresses and horovod.run's pickled function), nor write, nor pose as the store.

Anyone who can reach the port may connect, so until a request proved the key it costs the server little:

* one I/O thread reads the heads (request line and headers) of all connections with non-blocking sockets --
  at most :data:`MAX_HEAD_BYTES` each, within ``read_timeout`` seconds in total (slow-loris connections are
  closed, never waited for), and at most :data:`MAX_PENDING_CONNECTIONS` of them (a new one pushes out the
  oldest);
* the signature is checked from the head alone -- before any byte of the body is read -- together with the
  timestamp window, the nonce cache and the declared Content-Length (at most ``max_body``);
* only then is the request handed to a fixed pool of :data:`WORKER_THREADS` threads, which read its body
  (checked against the signed hash), apply it and send the signed answer;
* refusals are logged with the attacker's bytes escaped and truncated, at most :data:`LOG_BURST` lines per
  :data:`LOG_INTERVAL_SECONDS` (then one line counting the rest).

A signed request is accepted only if its timestamp is within :data:`WINDOW_SECONDS` of the server's clock and
its nonce was not seen; nonces are remembered until their timestamp left the window, so a captured request can
never be replayed (beyond :data:`NONCE_MEMORY` live nonces new requests are refused with 503, nothing is
forgotten early).

With ``tls`` (``horovodrun --tls``) every connection is mutual TLS with the job's certificate
(:mod:`horovod.transport.tls`).  The I/O thread drives the server's handshakes non-blocking, inside the
same ``read_timeout`` and pending-connection bounds as the heads (a handshake is a few CPU-bound steps,
never a wait), so a stranger cannot pin it: a plaintext or certificate-less client is refused at its first
bytes.  The request's signature is then checked as without TLS.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import hmac
import http
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from horovod.transport import store as store_mod
from horovod.transport import tls as tls_mod
from horovod.transport.store import (
    BODY_HASH_HEADER,
    DIGEST_HEADER,
    NONCE_HEADER,
    TIME_HEADER,
    answer_digest,
    request_digest,
)

__all__ = ["RendezvousServer", "MAX_BODY_BYTES", "WINDOW_SECONDS"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest value a PUT may carry (horovod.run's results go through the store)."""

READ_TIMEOUT_SECONDS = 3.0
"""How long a client may take to send its request line and headers, in total (upstream: 3 s -> 408)."""

BODY_MIN_RATE = 1 << 20
"""Bytes per second a signed body may be as slow as (its deadline is read_timeout + length / this)."""

WINDOW_SECONDS = 60.0
"""A request's signed timestamp may be this far from the server's clock (hosts' clocks must agree this well)."""

NONCE_MEMORY = 1 << 18
"""Most nonces remembered at once.  A nonce is kept until its timestamp left the window; when this many are
live, new requests are refused (503, the client retries) instead of forgetting one that could be replayed."""

MAX_HEAD_BYTES = 16 * 1024
"""Most bytes read from a connection before its request proved the key."""

MAX_PENDING_CONNECTIONS = 256
"""Most connections whose request did not prove the key yet; a new one closes the oldest."""

WORKER_THREADS = 4
"""Threads serving authenticated requests (a connection gets one only after its signature verified)."""

QUEUE_SIZE = 256
"""Authenticated requests waiting for a worker thread; beyond it they are answered 503 (the client retries)."""

LOG_BURST = 10
LOG_INTERVAL_SECONDS = 10.0
"""At most LOG_BURST lines about refused requests per LOG_INTERVAL_SECONDS, then one line counting the rest."""

_DRAIN_BYTES = 256 * 1024
_DRAIN_SECONDS = 1.0
_METHODS = ("GET", "PUT", "DELETE")
_MAX_NONCE = 64
_MIN_NONCE = 16
_WANT = (ssl.SSLWantReadError, ssl.SSLWantWriteError)


def printable(text: str | bytes, limit: int = 100) -> str:
    """``text`` safe for a log line: control and non-ASCII characters escaped, at most ``limit`` characters."""
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    out = []
    for c in text[:limit]:
        if c == "\\":
            out.append("\\\\")
        elif " " <= c <= "~":
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "".join(out) + ("..." if len(text) > limit else "")


class _RefusalLog:
    """Rate-limited log lines about refused requests: a flood of them must not flood the job's output."""

    def __init__(self, burst: int, interval: float) -> None:
        self.burst = burst
        self.interval = interval
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._count = 0
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: object) -> None:
        with self._lock:
            self._roll(time.monotonic())
            if self._count >= self.burst:
                self._suppressed += 1
                return
            self._count += 1
        logger.log(level, msg, *args)

    def tick(self) -> None:
        with self._lock:
            self._roll(time.monotonic())

    def flush(self) -> None:
        with self._lock:
            self._roll(time.monotonic(), force=True)

    def _roll(self, now: float, force: bool = False) -> None:
        if now - self._start < self.interval and not force:
            return
        if self._suppressed:
            logger.warning("rendezvous store: suppressed %d more refused-request messages in the last %.0f s",
                           self._suppressed, now - self._start)
        self._start, self._count, self._suppressed = now, 0, 0


class _NonceCache:
    """Nonces of accepted requests, each kept until its request's timestamp left the window."""

    def __init__(self, capacity: int, window: float) -> None:
        self._capacity = capacity
        self._window = window
        self._expiry: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()
        self._high = 0.0

    def now(self) -> float:
        """The wall clock, never going back: after a clock step backwards no evicted nonce becomes valid again."""
        with self._lock:
            self._high = max(self._high, time.time())
            return self._high

    def add(self, nonce: bytes, timestamp: float, now: float) -> str | None:
        """Record ``nonce``; None if accepted, else "replayed" or "full"."""
        with self._lock:
            while self._heap and self._heap[0][0] < now:
                del self._expiry[heapq.heappop(self._heap)[1]]
            if nonce in self._expiry:
                return "replayed"
            if len(self._expiry) >= self._capacity:
                return "full"
            expiry = timestamp + self._window
            self._expiry[nonce] = expiry
            heapq.heappush(self._heap, (expiry, nonce))
            return None

    def __len__(self) -> int:
        return len(self._expiry)


class _Store:
    """Values with their SHA-256 (computed once, so a GET of a large value costs no hashing)."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bytes, bytes] | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, value: bytes, sha: bytes | None = None) -> None:
        value = bytes(value)
        entry = (value, sha if sha is not None else hashlib.sha256(value).digest())
        with self._lock:
            self._data[key] = entry

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None


@dataclass
class _Request:
    method: str
    target: str
    nonce: bytes
    length: int
    body_sha: bytes
    peer: str


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    deadline: float
    buf: bytearray
    draining: bool = False
    drain_left: int = 0
    req: _Request | None = None
    handshaking: bool = False  # TLS handshake not complete yet
    want_write: bool = False  # the handshake waits for the socket to become writable


class RendezvousServer:
    """The launcher's key/value store.  Keys are ``scope/name`` (names may contain '/').

    Example::

        server = RendezvousServer(key)
        port = server.start()          # serve in background threads
        server.put("runfunc/func", payload)
        ...
        server.stop()
    """

    def __init__(self, key: bytes, addr: str = "127.0.0.1", port: int = 0,
                 max_body: int = MAX_BODY_BYTES, read_timeout: float = READ_TIMEOUT_SECONDS,
                 tls: tls_mod.JobTls | None = None) -> None:
        self.key = key
        self.tls = tls
        self.addr = addr
        self._port = port
        self.max_body = max_body
        self.read_timeout = read_timeout
        # Module constants are read here, so tests can shrink them.
        self.window = WINDOW_SECONDS
        self.max_pending = MAX_PENDING_CONNECTIONS
        self._store = _Store()
        self._nonces = _NonceCache(NONCE_MEMORY, WINDOW_SECONDS)
        self._log = _RefusalLog(LOG_BURST, LOG_INTERVAL_SECONDS)
        self._listeners: dict[str, socket.socket] = {}
        self._new_listeners: list[socket.socket] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[_Conn, _Request, bytes] | None] = queue.Queue(QUEUE_SIZE)
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        """The port of the first address."""
        if not self._listeners:
            raise RuntimeError("RendezvousServer is not started")
        return self._listeners[self.addr].getsockname()[1]

    @property
    def addresses(self) -> dict[str, int]:
        """Every address listened on, with its port."""
        with self._lock:
            return {a: s.getsockname()[1] for a, s in self._listeners.items()}

    def start(self) -> int:
        """Bind ``addr`` (port 0 = a free port chosen by the OS), serve in daemon threads, return the port."""
        if self._listeners:
            return self.port
        listener = self._bind(self.addr, self._port)
        self._listeners[self.addr] = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping.clear()
        self._threads = [threading.Thread(target=self._io_loop, args=(listener,), name="horovod-rendezvous-io",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._worker, name=f"horovod-rendezvous-{i}", daemon=True)
                          for i in range(WORKER_THREADS)]
        for t in self._threads:
            t.start()
        logger.debug("rendezvous store listening on %s:%d", self.addr, self.port)
        return self.port

    def listen(self, addr: str) -> int:
        """Also accept connections on ``addr`` (a port chosen by the OS); returns its port.  Idempotent.

        The elastic driver uses it when a discovery script names a host reached through another interface:
        the store listens on the addresses the job uses, never on all interfaces.
        """
        with self._lock:
            if not self._listeners:
                raise RuntimeError("RendezvousServer is not started")
            if addr in self._listeners:
                return self._listeners[addr].getsockname()[1]
            sock = self._bind(addr, 0)
            self._listeners[addr] = sock
            self._new_listeners.append(sock)
        self._wake()
        logger.debug("rendezvous store also listening on %s:%d", addr, sock.getsockname()[1])
        return sock.getsockname()[1]

    def stop(self) -> None:
        """Stop serving and close the sockets; safe to call twice."""
        if not self._listeners:
            return
        self._stopping.set()
        self._wake()
        for _ in range(WORKER_THREADS):
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=1)
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            for sock in self._listeners.values():
                sock.close()
            self._listeners.clear()
            self._new_listeners.clear()
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._log.flush()

    @staticmethod
    def _bind(addr: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    # ------------------------------------------------------------------ in-process API
    def _check_started(self) -> None:
        if not self._listeners:
            raise RuntimeError("RendezvousServer is not started")

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``scope/name`` from inside the launcher (no HTTP round trip)."""
        self._check_started()
        self._store.put(key, value)

    def get(self, key: str) -> bytes | None:
        """The value under ``scope/name``, or None if absent."""
        self._check_started()
        entry = self._store.get(key)
        return None if entry is None else entry[0]

    def delete(self, key: str) -> bool:
        self._check_started()
        return self._store.delete(key)

    def __enter__(self) -> RendezvousServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ I/O thread: heads, before the key
    def _io_loop(self, listener: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        pending: dict[int, _Conn] = {}  # insertion order = oldest first
        sel.register(listener, selectors.EVENT_READ, "listen")
        assert self._wake_r is not None
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")

        def close(conn: _Conn) -> None:
            pending.pop(conn.sock.fileno(), None)
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(conn.sock)
            conn.sock.close()

        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                timeout = min([0.5] + [c.deadline - now for c in pending.values()])
                for skey, _ in sel.select(max(timeout, 0.0)):
                    if isinstance(skey.data, _Conn):
                        conn = skey.data
                        if pending.get(conn.sock.fileno()) is not conn:
                            continue  # closed earlier in this round
                        was_waiting = conn.want_write
                        done = self._on_readable(conn)
                        if done == "close":
                            close(conn)
                        elif done == "handed":
                            pending.pop(conn.sock.fileno(), None)
                            sel.unregister(conn.sock)
                            self._hand_over(conn)
                        elif conn.want_write != was_waiting:
                            sel.modify(conn.sock, selectors.EVENT_WRITE if conn.want_write else selectors.EVENT_READ,
                                       conn)
                    elif skey.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                        with self._lock:
                            new, self._new_listeners = self._new_listeners, []
                        for sock in new:
                            sel.register(sock, selectors.EVENT_READ, "listen")
                    else:
                        self._accept(skey.fileobj, sel, pending, close)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c in pending.values() if c.deadline <= now]:
                    if not conn.draining:
                        self._refuse(conn, 408, "headers not complete within "
                                     f"{self.read_timeout:g} s", logging.DEBUG)
                    close(conn)
                self._log.tick()
        except Exception:  # noqa: BLE001 - the store must not die silently
            logger.exception("rendezvous store: I/O thread failed")
        finally:
            for conn in list(pending.values()):
                close(conn)
            sel.close()

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector, pending: dict[int, _Conn],
                close: Callable[[_Conn], None]) -> None:
        for _ in range(64):
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # EMFILE and the like: make room, try again later
                logger.debug("rendezvous store: accept failed: %s", e)
                if pending:
                    close(next(iter(pending.values())))
                return
            if len(pending) >= self.max_pending:
                oldest = next(iter(pending.values()))
                self._log.log(logging.DEBUG, "rendezvous store: too many connections without a complete "
                              "request; dropping the oldest, from %s", oldest.peer)
                close(oldest)
            sock.setblocking(False)
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
            if self.tls is not None:
                try:
                    sock = self.tls.server_socket(sock)
                except (OSError, ValueError) as e:  # pragma: no cover - wrapping does no I/O
                    logger.debug("rendezvous store: cannot wrap the connection from %s in TLS: %s", peer, e)
                    sock.close()
                    continue
            conn = _Conn(sock, peer, time.monotonic() + self.read_timeout, bytearray(),
                         handshaking=self.tls is not None)
            pending[sock.fileno()] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _on_readable(self, conn: _Conn) -> str | None:
        """Read what is there; "close", "handed" (an authenticated request, now the workers'), or None."""
        if conn.draining:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, *_WANT):
                return None
            except OSError:
                return "close"
            conn.drain_left -= len(data)
            return "close" if not data or conn.drain_left <= 0 else None
        if conn.handshaking:
            state = self._tls_step(conn)
            if state != "done":
                return state
        while True:
            before = len(conn.buf)
            try:
                data = conn.sock.recv(MAX_HEAD_BYTES + 4 - before)
            except (BlockingIOError, *_WANT):
                return None
            except OSError:
                return "close"
            if not data:
                return "close"
            conn.buf += data
            end = conn.buf.find(b"\r\n\r\n", max(0, before - 3))
            if end >= 0:
                break
            if len(conn.buf) > MAX_HEAD_BYTES:
                self._refuse(conn, 431, f"request head over {MAX_HEAD_BYTES} bytes", logging.DEBUG)
                return None
            if not (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
                return None  # else: a TLS record held more than we asked for; the selector would not tell
        head, rest = bytes(conn.buf[:end]), bytes(conn.buf[end + 4:])
        conn.buf = bytearray()
        return self._check_head(conn, head, rest)

    def _tls_step(self, conn: _Conn) -> str | None:
        """One non-blocking step of the TLS handshake: "done" (the peer has the job's certificate), "close"
        (refused), or None (wait for the socket)."""
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
            self.tls.check_peer(conn.sock)  # type: ignore[union-attr,arg-type]
        except ssl.SSLWantReadError:
            conn.want_write = False
            return None
        except ssl.SSLWantWriteError:
            conn.want_write = True
            return None
        except OSError as e:  # not TLS, no certificate, another job's certificate, reset ...
            reason = getattr(e, "reason", None) or type(e).__name__
            self._log.log(logging.WARNING, "rendezvous store refused a connection from %s: TLS handshake failed "
                          "(%s)", conn.peer, printable(str(reason), 120))
            return "close"
        conn.handshaking = False
        conn.want_write = False
        return "done"

    def _check_head(self, conn: _Conn, head: bytes, rest: bytes) -> str | None:
        """Parse and authenticate a request head; "handed" when the request may proceed to a worker."""
        try:
            first, headers = store_mod.parse_head(head)
            method, target, version = first.split(" ")
            if not version.startswith("HTTP/1.") or not target.startswith("/") or not method.isalpha():
                raise ValueError("bad request line")
            if "transfer-encoding" in headers:
                raise ValueError("Transfer-Encoding is not supported")
        except ValueError as e:
            self._refuse(conn, 400, f"malformed request ({e})", logging.DEBUG, what=head.split(b"\r\n", 1)[0])
            return None
        what = f"{method} {target}"
        try:
            nonce = store_mod._hex(headers, NONCE_HEADER, (_MIN_NONCE, _MAX_NONCE))
            stamp_text = headers.get(TIME_HEADER.lower(), "")
            if not stamp_text.isdigit() or not stamp_text.isascii() or len(stamp_text) > 16:
                raise ValueError(TIME_HEADER)
            stamp = int(stamp_text)
            body_sha = store_mod._hex(headers, BODY_HASH_HEADER, 32)
            digest = store_mod._hex(headers, DIGEST_HEADER, 32)
            declared = store_mod.parse_length(headers.get("content-length"), 1 << 62)
        except (ValueError, OverflowError):
            self._refuse(conn, 403, "missing or malformed signature", logging.WARNING, what=what)
            return None
        expected = request_digest(self.key, method, target, nonce, stamp, declared, body_sha)
        if not hmac.compare_digest(expected, digest):
            self._refuse(conn, 403, "invalid signature (wrong job key?)", logging.WARNING, what=what)
            return None
        # From here the request proved the key: answers are signed so its client can trust them.
        req = _Request(method, target, nonce, declared, body_sha, conn.peer)
        now = self._nonces.now()
        skew = stamp / 1000.0 - now
        if abs(skew) > self.window:
            self._refuse(conn, 403, f"request timestamp {skew:+.0f} s off the store's clock (window "
                         f"+-{self.window:g} s; replayed, or are the hosts' clocks out of sync?)",
                         logging.WARNING, what=what, req=req)
            return None
        verdict = self._nonces.add(nonce, stamp / 1000.0, now)
        if verdict == "replayed":
            self._refuse(conn, 403, "replayed nonce", logging.WARNING, what=what, req=req)
            return None
        if verdict == "full":
            self._refuse(conn, 503, f"more than {len(self._nonces)} requests within {self.window:g} s; "
                         "retry later", logging.WARNING, what=what, req=req)
            return None
        if declared > self.max_body:
            self._refuse(conn, 413, f"body of {declared} bytes over the limit of {self.max_body}",
                         logging.WARNING, what=what, req=req)
            return None
        if method not in _METHODS:
            self._refuse(conn, 501, "unsupported method", logging.DEBUG, what=what, req=req)
            return None
        conn.buf = bytearray(rest[:declared])  # body bytes that came with the head (at most MAX_HEAD_BYTES)
        conn.req = req
        return "handed"

    def _hand_over(self, conn: _Conn) -> None:
        req = conn.req
        assert req is not None
        try:
            self._queue.put_nowait((conn, req, bytes(conn.buf)))
        except queue.Full:
            with contextlib.suppress(OSError):
                conn.sock.setblocking(True)
                conn.sock.settimeout(1.0)
                conn.sock.sendall(self._answer(req, 503, b"store busy; retry"))
            conn.sock.close()

    def _refuse(self, conn: _Conn, status: int, reason: str, level: int, what: str | bytes = "",
                req: _Request | None = None) -> None:
        """Answer ``status`` (signed only for a request that proved the key), log, and drain the connection."""
        self._log.log(level, "rendezvous store refused %s from %s: HTTP %d %s", printable(what), conn.peer,
                      status, printable(reason, 200))
        body = reason.encode("ascii", "backslashreplace") if req is not None else b""
        data = self._answer(req, status, body) if req is not None else _unsigned(status)
        with contextlib.suppress(OSError):
            conn.sock.send(data)
            conn.sock.shutdown(socket.SHUT_WR)
        conn.draining = True
        conn.drain_left = _DRAIN_BYTES
        conn.deadline = time.monotonic() + _DRAIN_SECONDS

    def _answer(self, req: _Request, status: int, body: bytes = b"", sha: bytes | None = None) -> bytes:
        """The signed head (and body, if small) of an answer to ``req``."""
        sha = hashlib.sha256(body).digest() if sha is None else sha
        digest = answer_digest(self.key, req.nonce, req.method, req.target, status, len(body), sha)
        head = (f"HTTP/1.1 {status} {_phrase(status)}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                f"{BODY_HASH_HEADER}: {sha.hex()}\r\n{DIGEST_HEADER}: {digest.hex()}\r\n\r\n").encode("latin-1")
        return head + body if len(body) <= 65536 else head

    # ------------------------------------------------------------------ worker threads: after the key
    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            conn, req, rest = item
            try:
                self._serve(conn, req, rest)
            except Exception:  # noqa: BLE001 - a client that vanished must not print tracebacks over the job
                logger.debug("rendezvous store: error serving %s", req.peer, exc_info=True)
            finally:
                conn.sock.close()

    def _send(self, conn: _Conn, req: _Request, status: int, body: bytes = b"", sha: bytes | None = None) -> None:
        data = self._answer(req, status, body, sha)
        conn.sock.settimeout(self.read_timeout + len(body) / BODY_MIN_RATE)
        conn.sock.sendall(data)
        if len(body) > 65536:
            conn.sock.sendall(body)

    def _serve(self, conn: _Conn, req: _Request, rest: bytes) -> None:
        sock = conn.sock
        sock.setblocking(True)
        length = req.length
        deadline = time.monotonic() + self.read_timeout + length / BODY_MIN_RATE
        body = bytearray(length)
        got = len(rest)
        body[:got] = rest
        view = memoryview(body)
        while got < length:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._log.log(logging.WARNING, "rendezvous store refused %s from %s: body not received in time",
                              printable(f"{req.method} {req.target}"), req.peer)
                self._send(conn, req, 408, b"timed out reading the body")
                return
            sock.settimeout(remaining)
            try:
                n = sock.recv_into(view[got:], min(length - got, 1 << 20))
            except TimeoutError:
                continue
            if not n:
                return  # the client went away
            got += n
        view.release()
        sha = hashlib.sha256(body).digest()
        if not hmac.compare_digest(sha, req.body_sha):
            self._log.log(logging.WARNING, "rendezvous store refused %s from %s: body does not match its signed "
                          "digest", printable(f"{req.method} {req.target}"), req.peer)
            self._send(conn, req, 403, b"body does not match its signed digest")
            return
        try:
            key = urllib.parse.unquote(urllib.parse.urlsplit(req.target).path).lstrip("/")
        except ValueError:
            key = ""
        scope, _, name = key.partition("/")
        if not scope or not name:
            self._send(conn, req, 400, b"path must be /<scope>/<key>")
            return
        if req.method == "GET":
            entry = self._store.get(key)
            if entry is None:
                self._send(conn, req, 404)
            else:
                self._send(conn, req, 200, entry[0], entry[1])
        elif req.method == "PUT":
            self._store.put(key, bytes(body), sha)
            self._send(conn, req, 200)
        else:
            self._send(conn, req, 200 if self._store.delete(key) else 404)


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _unsigned(status: int) -> bytes:
    """A refusal of a request that did not prove the key (so it cannot be signed for its sender)."""
    return (f"HTTP/1.1 {status} {_phrase(status)}\r\n{store_mod.REFUSAL_HEADER}: refused\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n").encode("latin-1")


