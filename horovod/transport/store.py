"""Client side of the rendezvous key/value store, and an in-memory store with the same API.

Every HTTP request is signed: ``X-Horovod-Nonce`` (fresh random hex) and ``X-Horovod-Digest`` =
hex(HMAC-SHA256(job key, method, path, nonce, sha256(body))) — see :func:`request_digest`.  The server
(``horovod.runner.rendezvous``) verifies it with the same function and refuses anything else.
"""

from __future__ import annotations

import hashlib
import http.client
import threading
import time
import urllib.parse

from horovod.common import auth

__all__ = ["StoreClient", "InMemoryStore", "request_digest", "StoreError"]

NONCE_HEADER = "X-Horovod-Nonce"
DIGEST_HEADER = "X-Horovod-Digest"


class StoreError(RuntimeError):
    """The store could not be reached, refused the request, or the key did not appear in time."""


def request_digest(key: bytes, method: str, path: str, nonce: bytes, body: bytes) -> bytes:
    """The HMAC a request must carry; shared by client and server so the scheme cannot drift."""
    return auth.digest(key, method.upper().encode(), path.encode(), nonce, hashlib.sha256(body).digest())


class StoreClient:
    """Talks to the launcher's rendezvous store.  Keys are ``scope/name`` strings."""

    def __init__(self, addr: str, port: int, key: bytes, timeout: float = 30.0) -> None:
        self.addr = addr
        self.port = int(port)
        self.key = key
        self.timeout = timeout

    def _request(self, method: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
        path = "/" + urllib.parse.quote(key)
        nonce = auth.nonce()
        headers = {
            NONCE_HEADER: nonce.hex(),
            DIGEST_HEADER: request_digest(self.key, method, path, nonce, body).hex(),
            "Content-Length": str(len(body)),
        }
        conn = http.client.HTTPConnection(self.addr, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except OSError as e:
            raise StoreError(f"rendezvous store at {self.addr}:{self.port} unreachable: {e}") from e
        finally:
            conn.close()

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

    def delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)
