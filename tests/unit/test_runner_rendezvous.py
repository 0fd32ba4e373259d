"""The rendezvous store server: signed requests only, and no input can crash or disturb it."""

import http.client
import logging
import random
import socket
import time

import pytest

from horovod.runner.rendezvous import RendezvousServer
from horovod.transport.store import DIGEST_HEADER, NONCE_HEADER, StoreClient, StoreError, sign_request

KEY = b"k" * 32


@pytest.fixture
def server():
    srv = RendezvousServer(KEY, max_body=4096, read_timeout=0.5)
    srv.start()
    yield srv
    srv.stop()


def _raw(server, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _signed(method, path, body=b"", key=KEY, nonce=None):
    return sign_request(key, method, path, body, nonce=nonce)


def test_client_roundtrip(server):
    client = StoreClient("127.0.0.1", server.port, KEY, timeout=2)
    client.put("global/addr.0", b"\x00\x01value")
    assert client.get("global/addr.0") == b"\x00\x01value"
    client.put("scope/a/b c/d?e#f%", b"nested")          # further '/' and characters that need quoting
    assert client.get("scope/a/b c/d?e#f%") == b"nested"
    assert server.get("scope/a/b c/d?e#f%") == b"nested"
    server.put("runfunc/func", b"in-process")
    assert client.get("runfunc/func") == b"in-process"
    client.delete("global/addr.0")
    assert server.get("global/addr.0") is None
    client.delete("global/absent")                        # 404 is fine for delete
    with pytest.raises(StoreError, match="timed out"):
        client.get("global/never", timeout=0.05)


def test_exists_asks_once_and_never_mistakes_a_refusal_for_absence(server):
    from horovod.transport.store import InMemoryStore

    client = StoreClient("127.0.0.1", server.port, KEY, timeout=5)
    start = time.monotonic()
    assert client.exists("s/flag") is False
    assert time.monotonic() - start < 1.0  # no waiting for the key, unlike get()
    server.put("s/flag", b"")
    assert client.exists("s/flag") is True
    client.delete("s/flag")
    assert client.exists("s/flag") is False
    # A client with the wrong key is refused: that is an error, not "the key is absent" (an elastic worker that
    # read it as absent would keep training in a generation the driver ended).
    with pytest.raises(StoreError, match="not signed with this job's key"):
        StoreClient("127.0.0.1", server.port, b"x" * 32, timeout=5).exists("s/flag")
    local = InMemoryStore()
    assert local.exists("s/flag") is False
    local.put("s/flag", b"1")
    assert local.exists("s/flag") is True
    local.delete("s/flag")
    assert local.exists("s/flag") is False


def test_client_waits_for_key(server):
    client = StoreClient("127.0.0.1", server.port, KEY, timeout=5)
    import threading

    threading.Timer(0.2, server.put, args=("s/late", b"x")).start()
    assert client.get("s/late") == b"x"


def test_unsigned_and_wrong_key_refused_and_logged(server, caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runner.rendezvous")
    server.put("s/secret", b"v")
    assert _raw(server, "GET", "/s/secret")[0] == 403
    wrong_key = _signed("PUT", "/s/secret", b"evil", key=b"x" * 32)
    assert _raw(server, "PUT", "/s/secret", b"evil", wrong_key)[0] == 403
    assert _raw(server, "GET", "/s/secret", headers={NONCE_HEADER: "zz", DIGEST_HEADER: "00"})[0] == 403
    # A digest over another body must not authorise this one.
    assert _raw(server, "PUT", "/s/secret", b"evil", _signed("PUT", "/s/secret", b"good"))[0] == 403
    # ...nor over another path or method.
    assert _raw(server, "GET", "/s/secret", headers=_signed("GET", "/s/other"))[0] == 403
    assert _raw(server, "DELETE", "/s/secret", headers=_signed("GET", "/s/secret"))[0] == 403
    assert server.get("s/secret") == b"v"
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 6
    assert all("127.0.0.1" in r.getMessage() for r in refusals)
    with pytest.raises(StoreError, match="403"):
        StoreClient("127.0.0.1", server.port, b"wrong" * 8, timeout=2).get("s/secret")


def test_replayed_nonce_refused(server, caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runner.rendezvous")
    headers = _signed("PUT", "/s/k", b"once")
    assert _raw(server, "PUT", "/s/k", b"once", headers)[0] == 200
    server.delete("s/k")
    assert _raw(server, "PUT", "/s/k", b"once", headers)[0] == 403
    assert server.get("s/k") is None
    assert any("replayed" in r.getMessage() for r in caplog.records)


def test_bad_paths_and_sizes(server):
    for path in ("/", "/scope", "/scope/", "//key"):
        assert _raw(server, "GET", path, headers=_signed("GET", path))[0] == 400, path
    body = b"x" * 5000
    assert _raw(server, "PUT", "/s/big", body, _signed("PUT", "/s/big", body))[0] == 413
    assert server.get("s/big") is None
    assert _raw(server, "POST", "/s/k", b"", _signed("POST", "/s/k"))[0] == 501


def _send_raw(port, data, shutdown=True, timeout=5.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if shutdown:
                sock.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:  # the server may reset a connection it refused
            return b""
        return b"".join(chunks)


def test_body_read_timeout_408(server):
    start = time.monotonic()
    signed = _signed("PUT", "/s/slow", b"x" * 100)
    head = "".join(f"{k}: {v}\r\n" for k, v in signed.items()).encode()
    request = b"PUT /s/slow HTTP/1.1\r\nContent-Length: 100\r\n" + head + b"\r\nonly-part"
    reply = _send_raw(server.port, request, shutdown=False)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - start < 3
    assert server.get("s/slow") is None


def test_garbage_does_not_disturb_server(server):
    client = StoreClient("127.0.0.1", server.port, KEY, timeout=5)
    client.put("s/before", b"1")
    rng = random.Random(1234)
    samples = [
        b"", b"\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x00" * 100, b"\xff\xfe" * 500,
        b"PUT /s/k HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc",            # truncated body
        b"PUT /s/k HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"PUT /s/k HTTP/1.1\r\nContent-Length: zzz\r\n\r\n",
        b"PUT /s/k HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"GET /s/k HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",            # too many headers
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",                      # request line too long
        b"GET /s/k HTTP/1.1\r\nX-Horovod-Nonce: " + b"f" * 10000 + b"\r\nX-Horovod-Digest: 00\r\n\r\n",
        b"GET /s/k HTTP/1.1\r\nX-Horovod-Nonce: 00\r\n",                    # headers never end
        b"GET /%zz%00/..%2f HTTP/1.1\r\n\r\n",
    ]
    for _ in range(300):
        n = rng.choice([1, 10, 100, 1000, 5000])
        data = bytes(rng.getrandbits(8) for _ in range(n))
        if rng.random() < 0.5:
            heads = [b"GET /s/k HTTP/1.1\r\n", b"PUT /s/k HTTP/1.0\r\nContent-Length: 10\r\n"]
            data = rng.choice(heads) + data
        samples.append(data)
    start = time.monotonic()
    for data in samples:
        reply = _send_raw(server.port, data)
        assert not reply.startswith(b"HTTP/1.0 200"), (data[:80], reply[:80])
    assert time.monotonic() - start < 30
    # Still serving, and the store is intact.
    assert client.get("s/before") == b"1"
    client.put("s/after", b"2")
    assert client.get("s/after") == b"2"
    assert server.get("s/k") is None


def test_stop_is_idempotent():
    srv = RendezvousServer(KEY)
    port = srv.start()
    assert srv.start() == port
    srv.stop()
    srv.stop()
    with pytest.raises(StoreError):
        StoreClient("127.0.0.1", port, KEY, timeout=0.5).put("s/k", b"v")
