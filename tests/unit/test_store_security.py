"""The rendezvous store as an attacker on the same host sees it (issue 10, items 1, 3 and 4).

* answers prove the key too: a fake store, an altered answer or an answer to another request is refused
  before anything is unpickled;
* the server reads and allocates nothing beyond a small bound, and spends no thread, before a request proved
  the key (memory and threads of a server process measured under unsigned 64 MiB PUTs and 300 half-open
  connections), and the elastic store never listens on all interfaces;
* refusals are logged escaped and rate-limited;
* a captured request cannot be replayed, not even after many other requests, nor after its time window.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import psutil
import pytest

from horovod.base import auth
from horovod.runner import rendezvous
from horovod.runner.rendezvous import RendezvousServer
from horovod.transport import store as store_mod
from horovod.transport.store import StoreClient, StoreError, sign_request

KEY = b"k" * 32
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def server():
    srv = RendezvousServer(KEY, max_body=1 << 20, read_timeout=1.0)
    srv.start()
    yield srv
    srv.stop()


def _raw(port, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _read_request(sock: socket.socket) -> bytes:
    """A whole request (head and Content-Length body) from a client socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += sock.recv(65536)
    return data


class FakeServer:
    """Listens on 127.0.0.1 and answers every request with ``respond(request bytes) -> answer bytes``."""

    def __init__(self, respond) -> None:
        self.respond = respond
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    request = _read_request(conn)
                    self.requests.append(request)
                    conn.sendall(self.respond(request))
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _forward(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


class _Payload:
    """Unpickling it creates a file: proof that code chosen by whoever answered ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plain_answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


# ---------------------------------------------------------------------------------------- 1: answers are signed
@pytest.mark.parametrize("forge", ["plain", "forged-digest"])
def test_fake_store_cannot_make_a_worker_run_code(tmp_path, monkeypatch, capsys, forge):
    """horovod.run's worker, pointed at a store that does not know the key: refused, nothing unpickled."""
    from horovod.runner import run_task

    marker = tmp_path / "pwned"
    payload = cloudpickle.dumps(_Payload(str(marker)))
    extra = b""
    if forge == "forged-digest":  # every header present and well-formed, the digest made without the key
        extra = b"X-Horovod-Body-SHA256: %s\r\nX-Horovod-Digest: %s\r\n" % (
            hashlib.sha256(payload).hexdigest().encode(), os.urandom(32).hex().encode())
    fake = FakeServer(lambda request: _plain_answer(payload, extra))
    try:
        monkeypatch.setenv(auth.SECRET_KEY_ENV, KEY.hex())
        monkeypatch.setenv("HOROVOD_START_TIMEOUT", "5")
        rc = run_task.main(["127.0.0.1", str(fake.port)])
    finally:
        fake.close()
    err = capsys.readouterr().err
    assert not marker.exists(), "the fake store's pickle was unpickled"
    assert rc == 1
    assert "not signed with this job's key" in err, err
    assert len(fake.requests) == 1


def test_client_reads_a_bounded_head_from_a_stranger():
    """An answer whose head never ends is refused after a few KiB, not buffered without bound."""
    sent = []

    def respond(request):
        junk = b"HTTP/1.1 200 OK\r\n" + b"X-Junk: " + b"a" * (4 << 20)
        sent.append(len(junk))
        return junk

    fake = FakeServer(respond)
    try:
        with pytest.raises(StoreError, match="oversized head"):
            StoreClient("127.0.0.1", fake.port, KEY, timeout=5).get("runfunc/func")
    finally:
        fake.close()


def _tamper_proxy(port: int, transform):
    """A store in the middle: forwards each request to the real store and passes ``transform`` the answer."""
    state: dict[str, bytes] = {}
    return FakeServer(lambda request: transform(state, request, _forward(port, request)))


def _flip_last_byte(state, request, answer):
    return answer[:-1] + bytes([answer[-1] ^ 1])


def _replay_first(state, request, answer):
    state.setdefault("first", answer)
    return state["first"]


def _status_404_to_200(state, request, answer):
    return re.sub(rb"^(HTTP/1\.[01]) 404 Not Found", rb"\1 200 OK", answer, count=1)


@pytest.mark.parametrize("transform,expected", [
    (_flip_last_byte, "does not match its signed digest"),
    (_replay_first, "not signed"),
    (_status_404_to_200, "not signed"),
])
def test_altered_or_replayed_answer_refused(server, transform, expected):
    server.put("s/value", b"genuine value")
    server.put("s/other", b"another value")
    proxy = _tamper_proxy(server.port, transform)
    try:
        client = StoreClient("127.0.0.1", proxy.port, KEY, timeout=5)
        if transform is _replay_first:
            assert client.get("s/other") == b"another value"  # the first answer is passed on as it is
            with pytest.raises(StoreError, match=expected):    # ...and replayed for the next request
                client.get("s/value")
            with pytest.raises(StoreError, match=expected):    # same path, new nonce: refused as well
                client.get("s/other")
        elif transform is _status_404_to_200:
            with pytest.raises(StoreError, match=expected):
                client.get("s/absent", timeout=1)
        else:
            with pytest.raises(StoreError, match=expected):
                client.get("s/value")
    finally:
        proxy.close()


# ---------------------------------------------------------------------------------------- 3: bounded before the key
_SERVER_SCRIPT = textwrap.dedent("""
    import sys
    from horovod.runner.rendezvous import RendezvousServer
    srv = RendezvousServer(bytes.fromhex(sys.argv[1]), read_timeout=float(sys.argv[2]))
    print(srv.start(), flush=True)
    sys.stdin.read()
    srv.stop()
""")


@pytest.fixture
def server_process():
    """A store in its own process, so its memory and threads can be measured: yields (psutil.Process, port)."""
    procs = []

    def start(read_timeout=3.0):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT, KEY.hex(), str(read_timeout)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        port = int(proc.stdout.readline())
        return psutil.Process(proc.pid), port

    yield start
    for proc in procs:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _big_unsigned_put(port: int, body: memoryview, headers: bytes, results: list) -> None:
    head = b"PUT /s/big HTTP/1.1\r\nContent-Length: %d\r\n%s\r\n" % (len(body), headers)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head)
            try:
                sock.sendall(body)
            except OSError:
                pass
            results.append(sock.recv(4096))
    except OSError as e:
        results.append(repr(e).encode())


def test_unsigned_64mib_puts_do_not_grow_server_memory(server_process):
    proc, port = server_process()
    client = StoreClient("127.0.0.1", port, KEY, timeout=5)
    client.put("s/warm", b"x")  # every code path imported and warmed up
    before = proc.memory_info().rss
    body = memoryview(bytearray(64 << 20))
    forged = b"X-Horovod-Nonce: %s\r\nX-Horovod-Time: %d\r\nX-Horovod-Body-SHA256: %s\r\nX-Horovod-Digest: %s\r\n" % (
        os.urandom(32).hex().encode(), int(time.time() * 1000), hashlib.sha256(body).hexdigest().encode(),
        os.urandom(32).hex().encode())
    results: list[bytes] = []
    threads = [threading.Thread(target=_big_unsigned_put, args=(port, body, b"" if i % 2 else forged, results))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    growth = proc.memory_info().rss - before
    assert growth < 30 << 20, f"server RSS grew by {growth >> 20} MiB under 4 unsigned 64 MiB PUTs"
    assert all(not r.startswith(b"HTTP/1.1 200") for r in results), results
    assert client.get("s/warm") == b"x"
    with pytest.raises(StoreError, match="timed out"):
        client.get("s/big", timeout=0.1)


def test_unsigned_put_refused_before_its_body_arrives(server):
    """The refusal comes from the head alone: the server does not wait for (or read) the declared body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(b"PUT /s/k HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (512 << 10))  # under max_body
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 403"), reply
    assert time.monotonic() - start < 0.5


def test_half_open_connections_use_no_threads_and_do_not_block_the_job(server_process):
    proc, port = server_process(read_timeout=2.0)
    client = StoreClient("127.0.0.1", port, KEY, timeout=5)
    client.put("s/warm", b"x")
    threads_before = proc.num_threads()
    socks = []
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"PUT /s/k HTTP/1.1\r\nContent-Le" if i % 2 else b"G")
            socks.append(sock)
        time.sleep(0.3)
        threads_during = proc.num_threads()
        started = time.monotonic()
        client.put("s/during", b"served")
        assert client.get("s/during") == b"served"
        assert time.monotonic() - started < 3
        assert threads_during <= threads_before + 2, (threads_before, threads_during)
        # Slow-loris: a byte every 0.2 s does not keep a connection past the head deadline (2 s in total).
        trickle = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(trickle)
        opened = time.monotonic()
        closed_after = None
        for byte in b"GET /s/warm HTTP/1.1\r\n" + b"X" * 100:
            try:
                trickle.sendall(bytes([byte]))
                if select.select([trickle], [], [], 0.2)[0]:  # the server answered (408) or closed
                    closed_after = time.monotonic() - opened
                    break
            except OSError:
                closed_after = time.monotonic() - opened
                break
        assert closed_after is not None and closed_after < 2.0 + 1.0, closed_after
    finally:
        for sock in socks:
            sock.close()


def test_elastic_store_never_listens_on_all_interfaces(tmp_path, monkeypatch):
    from horovod.runner import network
    from horovod.runner.elastic import driver as driver_mod
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)

    def make(nics=None):
        d = driver_mod.ElasticDriver(HostDiscoveryScript(str(script), None), ["true"], num_proc=2, min_np=1,
                                     max_np=2, base_env={}, knobs={}, start_timeout=30, elastic_timeout=30,
                                     reset_limit=None, cooldown_range=None, nics=nics)
        d.hosts.update_available_hosts()
        return d

    assert make()._bind_address() == "127.0.0.1"  # only this host known: loopback, not 0.0.0.0
    assert make(["lo"])._bind_address() == "127.0.0.1"  # the chosen interface's address

    # A host named later, reached through another interface: the store listens there too, and only there.
    monkeypatch.setattr(network, "choose_interface",
                        lambda remote, nics=(): network.Interface("fake0", "127.0.0.2" if remote else "127.0.0.1"))
    monkeypatch.setattr(driver_mod.hosts_mod, "is_local_host", lambda host: host == "localhost")
    d = make()
    d.server = RendezvousServer(KEY, addr=d._bind_address())
    d.server.start()
    try:
        assert d._store_endpoint("localhost") == ("127.0.0.1", d.server.port)
        addr, port = d._store_endpoint("far-host")
        assert addr == "127.0.0.2" and d._store_endpoint("far-host") == (addr, port)
        StoreClient(addr, port, KEY, timeout=2).put("s/x", b"1")
        assert d.server.get("s/x") == b"1"
        ports = set(d.server.addresses.values())
        listening = {c.laddr for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}
    finally:
        d.server.stop()
    assert {a.ip for a in listening} == {"127.0.0.1", "127.0.0.2"}, listening


def test_refusals_logged_escaped_and_rate_limited(monkeypatch, caplog):
    monkeypatch.setattr(rendezvous, "LOG_BURST", 5, raising=False)
    monkeypatch.setattr(rendezvous, "LOG_INTERVAL_SECONDS", 1.0, raising=False)
    caplog.set_level(logging.DEBUG, logger="horovod.runner.rendezvous")
    srv = RendezvousServer(KEY, read_timeout=1.0)
    port = srv.start()
    try:
        evil = b"/s/\x1b[2J\x1b]0;owned\x07\x9b31m" + b"A" * 5000
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET " + evil + b" HTTP/1.1\r\nX-Horovod-Nonce: \x1b[5m\r\n\r\n")
                sock.recv(4096)
        time.sleep(1.6)  # the next interval: the suppressed count is reported
    finally:
        srv.stop()
    messages = [r.getMessage() for r in caplog.records if r.name == "horovod.runner.rendezvous"]
    refused = [m for m in messages if "refused" in m and "suppressed" not in m]
    suppressed = [int(m.split()[3]) for m in messages if "suppressed" in m]
    assert suppressed and len(refused) + sum(suppressed) == 30, messages
    assert len(refused) <= 5 * len(suppressed), messages  # at most LOG_BURST lines per interval
    for m in messages:
        assert not any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in m), repr(m)
        assert len(m) < 400, len(m)
    assert "\\x1b[2J" in refused[0]


# ---------------------------------------------------------------------------------------- 4: no replay, ever
def _status(port, method, path, body=b"", **sign):
    return _raw(port, method, path, body, sign_request(KEY, method, path, body, **sign))[0]


def test_replay_refused_after_many_requests_and_after_the_window(monkeypatch):
    monkeypatch.setattr(rendezvous, "NONCE_MEMORY", 8)
    monkeypatch.setattr(rendezvous, "WINDOW_SECONDS", 1.5, raising=False)
    srv = RendezvousServer(KEY)
    port = srv.start()
    try:
        captured = sign_request(KEY, "PUT", "/s/k", b"once")
        assert _raw(port, "PUT", "/s/k", b"once", captured)[0] == 200
        srv.delete("s/k")
        others = [_status(port, "GET", f"/s/other{i}") for i in range(20)]  # would roll a FIFO of 8 over
        assert set(others) <= {404, 503} and 503 in others, others  # full within the window: refuse, not forget
        assert _raw(port, "PUT", "/s/k", b"once", captured)[0] == 403
        assert srv.get("s/k") is None
        time.sleep(1.7)  # every nonce's timestamp left the window: forgotten, and their requests too old
        assert _status(port, "GET", "/s/fresh") == 404
        assert _raw(port, "PUT", "/s/k", b"once", captured)[0] == 403
        assert srv.get("s/k") is None
        # A client retries 503 until it is served.
        client = StoreClient("127.0.0.1", port, KEY, timeout=5)
        for i in range(12):
            client.put(f"s/many{i}", b"v")
        assert srv.get("s/many11") == b"v"
    finally:
        srv.stop()


def test_timestamps_outside_the_window_refused(server, monkeypatch):
    now = int(time.time() * 1000)
    assert _status(server.port, "PUT", "/s/t", b"1", timestamp_ms=now) == 200
    assert _status(server.port, "PUT", "/s/t", b"2", timestamp_ms=now - 120_000) == 403
    assert _status(server.port, "PUT", "/s/t", b"3", timestamp_ms=now + 120_000) == 403
    assert server.get("s/t") == b"1"
    # A client whose clock is off is told why, in an answer it can trust.
    monkeypatch.setattr(store_mod, "_now_ms", lambda: int(time.time() * 1000) - 300_000)
    with pytest.raises(StoreError, match="clock"):
        StoreClient("127.0.0.1", server.port, KEY, timeout=2).put("s/t", b"4")
    assert server.get("s/t") == b"1"

