"""Client side of the rendezvous key/value store, and an in-memory store with the same API.

Both directions prove the job key (docs/architecture.md, "Rendezvous store"):

* a **request** carries ``X-Horovod-Nonce`` (fresh random), ``X-Horovod-Time`` (milliseconds since the epoch),
  ``X-Horovod-Body-SHA256`` and ``X-Horovod-Digest`` = HMAC(key, "request", method, path, nonce, time, length,
  sha256(body)) -- see :func:`request_digest`.  The server checks it from the headers alone, before it reads a
  byte of the body, and refuses a time more than its window away from its clock or a nonce it already saw.
* an **answer** carries ``X-Horovod-Body-SHA256`` and ``X-Horovod-Digest`` = HMAC(key, "answer", the request's
  nonce, method, path, status, length, sha256(body)) -- see :func:`answer_digest`.  The client reads the status
  line and headers (at most :data:`MAX_ANSWER_HEAD_BYTES`), checks the digest before it reads the body, then
  checks the body against the signed hash.  So an answer from something without the key, an answer to another
  request (replayed) or an altered one is refused before its bytes reach the caller -- which may unpickle them
  (``horovod.run`` does).

With ``horovodrun --tls`` (``HOROVOD_TLS=1``; :mod:`horovod.transport.tls`) the same HTTP exchange runs inside
mutual TLS with the job's certificate, so values (addresses, ``horovod.run``'s pickled function and results)
are also hidden from the network; every signature is still checked.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import threading
import time
import urllib.parse

from horovod.base import auth
from horovod.transport import tls as tls_mod

__all__ = ["StoreClient", "InMemoryStore", "StoreError", "UnprovenAnswer", "request_digest", "answer_digest",
           "sign_request", "NONCE_HEADER", "TIME_HEADER", "BODY_HASH_HEADER", "DIGEST_HEADER", "REFUSAL_HEADER"]

NONCE_HEADER = "X-Horovod-Nonce"
TIME_HEADER = "X-Horovod-Time"
BODY_HASH_HEADER = "X-Horovod-Body-SHA256"
DIGEST_HEADER = "X-Horovod-Digest"
REFUSAL_HEADER = "X-Horovod-Store"
"""On the store's unsigned refusals of requests that did not prove the key: tells a client with the wrong key
from one that reached some other program (unauthenticated: it only words the client's error)."""

MAX_ANSWER_HEAD_BYTES = 8 * 1024
"""Most bytes of an answer's status line and headers read before its signature is checked."""

MAX_ANSWER_BYTES = 1 << 31
"""Largest answer body accepted (its length is signed, so only a key holder can make the client allocate it)."""

MAX_HEADERS = 32
"""Most header lines in a request or an answer."""

_REQUEST = b"horovod-store-request-v2"
_ANSWER = b"horovod-store-answer-v2"
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class StoreError(RuntimeError):
    """The store could not be reached, refused the request, answered without proof of the key, or the key
    did not appear in time."""


class UnprovenAnswer(StoreError):
    """The answer does not prove the job's key.  ``refused``: it says it is a Horovod store's refusal of the
    request's signature (this process has the wrong key); otherwise whatever answered is no Horovod store."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


def _now_ms() -> int:
    return int(time.time() * 1000)


def request_digest(key: bytes, method: str, path: str, nonce: bytes, timestamp_ms: int, length: int,
                   body_sha256: bytes) -> bytes:
    """The HMAC a request carries; shared by client and server so the scheme cannot drift."""
    return auth.digest(key, _REQUEST, method.upper().encode(), path.encode("latin-1"), nonce,
                       str(timestamp_ms).encode(), str(length).encode(), body_sha256)


def answer_digest(key: bytes, nonce: bytes, method: str, path: str, status: int, length: int,
                  body_sha256: bytes) -> bytes:
    """The HMAC an answer carries: bound to the request's nonce, method and path, so it answers that request only."""
    return auth.digest(key, _ANSWER, nonce, method.upper().encode(), path.encode("latin-1"),
                       str(status).encode(), str(length).encode(), body_sha256)


def sign_request(key: bytes, method: str, path: str, body: bytes = b"", *, nonce: bytes | None = None,
                 timestamp_ms: int | None = None) -> dict[str, str]:
    """The signature headers of a request (``path`` exactly as sent on the request line)."""
    nonce = auth.nonce() if nonce is None else nonce
    timestamp_ms = _now_ms() if timestamp_ms is None else timestamp_ms
    body_sha = hashlib.sha256(body).digest()
    return {
        NONCE_HEADER: nonce.hex(),
        TIME_HEADER: str(timestamp_ms),
        BODY_HASH_HEADER: body_sha.hex(),
        DIGEST_HEADER: request_digest(key, method, path, nonce, timestamp_ms, len(body), body_sha).hex(),
    }


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """Split an HTTP head (without the final blank line) into its first line and headers (lower-case names).

    Strict on purpose: a name that is not a token, a folded line, a repeated header or more than
    :data:`MAX_HEADERS` lines is a ValueError.
    """
    lines = head.decode("latin-1").split("\r\n")
    if len(lines) - 1 > MAX_HEADERS:
        raise ValueError("too many header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN:
            raise ValueError("malformed header line")
        name = name.lower()
        if name in headers:
            raise ValueError(f"repeated header {name}")
        headers[name] = value.strip(" \t")
    return lines[0], headers


def parse_length(text: str | None, limit: int) -> int:
    """A Content-Length value: plain digits, at most ``limit`` (ValueError otherwise; absent = 0)."""
    if text is None:
        return 0
    if not text.isdigit() or not text.isascii() or len(text) > 19:
        raise ValueError("bad Content-Length")
    length = int(text)
    if length > limit:
        raise OverflowError(length)
    return length


def _hex(headers: dict[str, str], name: str, size: int | tuple[int, int]) -> bytes:
    low, high = (size, size) if isinstance(size, int) else size
    text = headers.get(name.lower(), "")
    if not low * 2 <= len(text) <= high * 2:
        raise ValueError(name)
    return bytes.fromhex(text)


class StoreClient:
    """Talks to the launcher's rendezvous store.  Keys are ``scope/name`` strings.

    ``tls``: talk TLS with this job identity (default: ``HOROVOD_TLS`` and the credentials the launcher put
    in the environment; False: never).

    Raises (constructor):
        ValueError: ``HOROVOD_TLS`` is on but the environment has no job certificate.
    """

    def __init__(self, addr: str, port: int, key: bytes, timeout: float = 30.0, *,
                 tls: tls_mod.JobTls | bool | None = None) -> None:
        self.addr = addr
        self.port = int(port)
        self.key = key
        self.timeout = timeout
        self.tls = tls_mod.resolve(tls)

    def _where(self) -> str:
        return f"rendezvous store at {self.addr}:{self.port}"

    def _request(self, method: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
        """One signed request; retries while the store is overloaded (503) until ``timeout``."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            status, answer = self._request_once(method, key, body)
            if status != 503 or time.monotonic() + delay > deadline:
                return status, answer
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _request_once(self, method: str, key: str, body: bytes) -> tuple[int, bytes]:
        path = "/" + urllib.parse.quote(key)
        signed = sign_request(self.key, method, path, body)
        nonce = bytes.fromhex(signed[NONCE_HEADER])
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.addr}:{self.port}", "Connection: close",
                 f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in signed.items())]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        deadline = time.monotonic() + self.timeout
        try:
            sock = socket.create_connection((self.addr, self.port), timeout=self.timeout)
        except OSError as e:
            raise StoreError(f"{self._where()} unreachable: {e}") from e
        if self.tls is not None:
            sock = self._tls_handshake(sock)
        with sock:
            try:
                sock.sendall(head)
                if body:
                    sock.sendall(body)
            except OSError as e:  # the store may refuse and close before taking the body: read its answer
                send_error: OSError | None = e
            else:
                send_error = None
            try:
                return self._read_answer(sock, method, path, nonce, deadline)
            except OSError as e:
                raise StoreError(f"{self._where()} unreachable: {send_error or e}") from e

    def _tls_handshake(self, sock: socket.socket) -> ssl.SSLSocket:
        try:
            return self.tls.client_socket(sock)  # type: ignore[union-attr]
        except (ssl.SSLCertVerificationError, tls_mod.TlsError) as e:
            raise StoreError(f"{self._where()} did not present this job's TLS certificate ({e}); refusing it") \
                from None
        except ssl.SSLError as e:
            raise StoreError(f"TLS handshake with the {self._where()} failed: {e} (is the store running without "
                             "--tls, or for another job?)") from None
        except OSError as e:
            raise StoreError(f"{self._where()} unreachable (TLS handshake): {e}") from e
        finally:
            sock.close()  # detached into the TLS socket on success: a no-op then

    def _read_answer(self, sock: socket.socket, method: str, path: str, nonce: bytes,
                     deadline: float) -> tuple[int, bytes]:
        """Status and body of a signed answer; the body is read only after the head's signature verified."""
        buf = bytearray()
        scanned = 0
        while (end := buf.find(b"\r\n\r\n", scanned)) < 0:
            scanned = max(0, len(buf) - 3)
            if len(buf) > MAX_ANSWER_HEAD_BYTES:
                raise StoreError(f"{self._where()}: answer to {method} {path} has an oversized head; refusing it")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreError(f"{self._where()}: no answer to {method} {path} within {self.timeout:g} s")
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(MAX_ANSWER_HEAD_BYTES + 4 - len(buf))
            except TimeoutError:
                continue
            if not chunk:
                raise StoreError(f"{self._where()} closed the connection without answering {method} {path}")
            buf += chunk
        try:
            status_line, headers = parse_head(bytes(buf[:end]))
            version, status_text, *_ = status_line.split(" ", 2) + [""]
            if not version.startswith("HTTP/1.") or not status_text.isdigit() or len(status_text) != 3:
                raise ValueError("bad status line")
            status = int(status_text)
            length = parse_length(headers.get("content-length"), MAX_ANSWER_BYTES)
        except (ValueError, OverflowError):
            raise StoreError(f"{self._where()}: malformed answer to {method} {path}; refusing it") from None
        try:
            body_sha = _hex(headers, BODY_HASH_HEADER, 32)
            digest = _hex(headers, DIGEST_HEADER, 32)
        except ValueError:
            digest = body_sha = b""
        expected = answer_digest(self.key, nonce, method, path, status, length, body_sha)
        if not body_sha or not hmac.compare_digest(expected, digest):
            refused = status == 403 and headers.get(REFUSAL_HEADER.lower()) == "refused"
            raise UnprovenAnswer(
                f"{self._where()}: the answer to {method} {path} (HTTP {status}) is not signed with this job's key; "
                "refusing it.  " + ("It says the store refused this request's signature: this process's "
                                    "HOROVOD_SECRET_KEY is not the job's key." if refused else
                                    "Either this process's HOROVOD_SECRET_KEY is not the job's key (the store then "
                                    "refuses the request), or what answered on that port is not the job's "
                                    "rendezvous store."), refused)
        body = bytearray(length)
        got = min(length, len(buf) - end - 4)
        body[:got] = buf[end + 4:end + 4 + got]
        view = memoryview(body)
        sock.settimeout(self.timeout)
        while got < length:
            try:
                n = sock.recv_into(view[got:], min(length - got, 1 << 20))
            except TimeoutError as e:
                raise StoreError(f"{self._where()}: timed out reading the answer to {method} {path}") from e
            if not n:
                raise StoreError(f"{self._where()}: truncated answer to {method} {path}")
            got += n
        if not hmac.compare_digest(hashlib.sha256(body).digest(), body_sha):
            raise StoreError(f"{self._where()}: the body of the answer to {method} {path} does not match its "
                             "signed digest (altered in transit?); refusing it")
        return status, bytes(body)

    def put(self, key: str, value: bytes) -> None:
        status, body = self._request("PUT", key, bytes(value))
        if status != 200:
            raise StoreError(f"rendezvous store refused PUT {key}: HTTP {status} {body[:200]!r}")

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting (with backoff) until it exists or ``timeout`` passes."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delay = 0.005
        while True:
            status, body = self._request("GET", key)
            if status == 200:
                return body
            if status != 404:
                raise StoreError(f"rendezvous store refused GET {key}: HTTP {status} {body[:200]!r}")
            if time.monotonic() >= deadline:
                raise StoreError(f"timed out waiting for key {key!r} in the rendezvous store")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def exists(self, key: str) -> bool:
        """Whether ``key`` is in the store now (one request, no waiting)."""
        status, body = self._request("GET", key)
        if status not in (200, 404):
            raise StoreError(f"rendezvous store refused GET {key}: HTTP {status} {body[:200]!r}")
        return status == 200

    def delete(self, key: str) -> None:
        status, body = self._request("DELETE", key)
        if status not in (200, 404):
            raise StoreError(f"rendezvous store refused DELETE {key}: HTTP {status} {body[:200]!r}")


class InMemoryStore:
    """The same API inside one process (size-1 jobs, threads in unit tests)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def put(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = 30.0) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, timeout=timeout):
                raise StoreError(f"timed out waiting for key {key!r}")
            return self._data[key]

    def exists(self, key: str) -> bool:
        with self._cond:
            return key in self._data

    def delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)
