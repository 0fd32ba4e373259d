"""The rendezvous store: an authenticated key/value store over HTTP, run by the launcher.

Workers publish their addresses here and poll for each other's (the client, ``horovod.transport.store``,
polls; the server never blocks a request).  Every request must carry a fresh nonce and an HMAC under the
job key computed by :func:`horovod.transport.store.request_digest`, so a process without the key can
neither read (the values include connection addresses) nor write.  Anything else -- unsigned, replayed,
oversized, malformed or slow requests -- is answered with an error status and never disturbs the store.
"""

from __future__ import annotations

import collections
import hmac
import http.server
import logging
import socket
import threading
import time
import urllib.parse

from horovod.transport.store import DIGEST_HEADER, NONCE_HEADER, request_digest

__all__ = ["RendezvousServer", "MAX_BODY_BYTES"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest value a PUT may carry (horovod.run's pickled function and results go through the store)."""

READ_TIMEOUT_SECONDS = 3.0
"""How long a client may take to send its request line, headers and body (upstream: 3 s → 408)."""

NONCE_MEMORY = 1 << 18
"""How many recent nonces are remembered to refuse replays; the oldest are forgotten first."""

_MAX_NONCE_HEX = 128


class _NonceCache:
    """Recently seen nonces, bounded so that a long job cannot exhaust memory."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._seen: set[bytes] = set()
        self._order: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()

    def add(self, nonce: bytes) -> bool:
        """Record ``nonce``; False if it was already seen (a replay)."""
        with self._lock:
            if nonce in self._seen:
                return False
            self._seen.add(nonce)
            self._order.append(nonce)
            if len(self._order) > self._capacity:
                self._seen.discard(self._order.popleft())
            return True


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = READ_TIMEOUT_SECONDS
    server_version = "HorovodRendezvous/1"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout  # per-server, so tests can shorten it
        super().setup()

    def do_GET(self) -> None:
        self._serve("GET")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _read_body(self) -> bytes | None:
        """The request body, or None after an error reply (bad length, too big, too slow)."""
        text = self.headers.get("Content-Length")
        if text is None:
            return b""
        try:
            length = int(text)
            if length < 0:
                raise ValueError(text)
        except ValueError:
            self._reply(400, b"bad Content-Length")
            return None
        if length > self.server.max_body:
            self._reply(413, b"body too large")
            self.close_connection = True
            return None
        chunks, remaining = [], length
        deadline = time.monotonic() + self.server.read_timeout
        try:
            while remaining:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = self.rfile.read1(min(remaining, 1 << 20))
                if not chunk:
                    self._reply(400, b"truncated body")
                    return None
                chunks.append(chunk)
                remaining -= len(chunk)
        except TimeoutError:
            self._reply(408, b"timed out reading the body")
            return None
        return b"".join(chunks)

    def _authentic(self, method: str, body: bytes) -> bool:
        nonce_hex = self.headers.get(NONCE_HEADER, "")
        digest_hex = self.headers.get(DIGEST_HEADER, "")
        reason = None
        try:
            if not nonce_hex or not digest_hex or len(nonce_hex) > _MAX_NONCE_HEX:
                raise ValueError
            nonce, digest = bytes.fromhex(nonce_hex), bytes.fromhex(digest_hex)
        except ValueError:
            reason = "missing or malformed signature"
        else:
            expected = request_digest(self.server.key, method, self.path, nonce, body)
            if not hmac.compare_digest(expected, digest):
                reason = "invalid signature (wrong job key?)"
            elif not self.server.nonces.add(nonce):
                reason = "replayed nonce"
        if reason is None:
            return True
        logger.warning("rendezvous store refused %s %s from %s:%s: %s", method, self.path[:200],
                       *self.client_address[:2], reason)
        self._reply(403, b"forbidden")
        return False

    def _raw_path(self) -> str:
        # http.server collapses a leading '//' in self.path; the digest covers the path as sent.
        words = self.requestline.split()
        return words[1] if len(words) >= 2 else self.path

    def _serve(self, method: str) -> None:
        self.path = self._raw_path()
        body = self._read_body()
        if body is None or not self._authentic(method, body):
            return
        key = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        scope, _, name = key.partition("/")
        if not scope or not name:
            self._reply(400, b"path must be /<scope>/<key>")
            return
        store = self.server.store
        if method == "GET":
            value = store.get(key)
            self._reply(404 if value is None else 200, b"" if value is None else value)
        elif method == "PUT":
            store.put(key, body)
            self._reply(200)
        else:
            self._reply(200 if store.delete(key) else 404)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("rendezvous %s: " + format, self.address_string(), *args)


class _Store:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], key: bytes, max_body: int, read_timeout: float) -> None:
        self.key = key
        self.max_body = max_body
        self.read_timeout = read_timeout
        self.store = _Store()
        self.nonces = _NonceCache(NONCE_MEMORY)
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that vanished or sent garbage must not print tracebacks over the job's output.
        logger.debug("rendezvous store: error serving %s", client_address, exc_info=True)


class RendezvousServer:
    """The launcher's key/value store.  Keys are ``scope/name`` (names may contain '/').

    Example::

        server = RendezvousServer(key)
        port = server.start()          # serve in a background thread
        server.put("runfunc/func", payload)
        ...
        server.stop()
    """

    def __init__(self, key: bytes, addr: str = "127.0.0.1", port: int = 0,
                 max_body: int = MAX_BODY_BYTES, read_timeout: float = READ_TIMEOUT_SECONDS) -> None:
        self.key = key
        self.addr = addr
        self._port = port
        self._max_body = max_body
        self._read_timeout = read_timeout
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("RendezvousServer is not started")
        return self._httpd.server_address[1]

    def start(self) -> int:
        """Bind (port 0 = a free port chosen by the OS), serve in a daemon thread, return the port."""
        if self._httpd is not None:
            return self.port
        family = socket.AF_INET6 if ":" in self.addr else socket.AF_INET
        server_cls = type("_Server", (_HTTPServer,), {"address_family": family})
        self._httpd = server_cls((self.addr, self._port), self.key, self._max_body, self._read_timeout)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="horovod-rendezvous", daemon=True)
        self._thread.start()
        logger.debug("rendezvous store listening on %s:%d", self.addr, self.port)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket; safe to call twice."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _store(self) -> _Store:
        if self._httpd is None:
            raise RuntimeError("RendezvousServer is not started")
        return self._httpd.store

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``scope/name`` from inside the launcher (no HTTP round trip)."""
        self._store().put(key, value)

    def get(self, key: str) -> bytes | None:
        """The value under ``scope/name``, or None if absent."""
        return self._store().get(key)

    def delete(self, key: str) -> bool:
        return self._store().delete(key)

    def __enter__(self) -> RendezvousServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
