"""The opt-in encrypted data plane and store (``horovodrun --tls``, horovod/transport/tls.py), in one process.

* the job's credentials: a self-signed certificate that is its own only trust anchor; the key never shows in
  ``repr`` or errors; workers read them from the environment;
* a mesh over TLS (three ranks in threads, TCP between them): collectives give numpy-checked results, the
  control frames stay aligned with TLS records (nothing left decrypted for a selector to miss);
* strangers: a peer with another job's certificate, a plaintext peer holding the job key, a TLS client
  without a certificate -- refused at the TLS handshake, before any frame of ours, while the mesh forms;
* the store over TLS: a plaintext client (even one with the key) is refused at its first bytes, silent and
  stalled handshakes do not pin the server's I/O thread, another job's certificate is refused both ways;
* on the wire (a recording proxy between two channels, and between a store client and server): marker bytes
  of tensors and values are visible in clear without TLS and never with it; a flipped byte in a TLS stream
  is a PeerFailure, never altered data.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import ssl
import sys
import threading
import time

import numpy as np
import pytest

from horovod.base.config import EnvVarError, RuntimeConfig
from horovod.base.exceptions import WireError
from horovod.runner.rendezvous import RendezvousServer
from horovod.transport import tls as tls_mod
from horovod.transport.communicator import PeerFailure, ReduceOp
from horovod.transport.mesh import HEADER, build_mesh
from horovod.transport.store import InMemoryStore, StoreClient, StoreError, sign_request
from horovod.transport.tcp import TcpCommunicator
from horovod.transport.wire import VERSION, Channel, TlsChannel, Transfer, exchange

pytest.importorskip("cryptography", reason="pip install 'horovod[tls]'")

KEY = b"tls-test" * 4
MARKER = b"\x8bMARKER-7f3a9c\x01"


@pytest.fixture(scope="module")
def creds() -> tls_mod.JobCredentials:
    return tls_mod.make_credentials()


@pytest.fixture(scope="module")
def job(creds) -> tls_mod.JobTls:
    return tls_mod.JobTls(creds)


@pytest.fixture(scope="module")
def other_job() -> tls_mod.JobTls:
    return tls_mod.JobTls(tls_mod.make_credentials())


# ---------------------------------------------------------------------------------------------- credentials
def test_credentials_never_show_the_key(creds):
    assert b"-----BEGIN CERTIFICATE-----" in creds.cert_pem and b"PRIVATE KEY-----" in creds.key_pem
    body = creds.key_pem.split(b"\n")[1].decode()
    assert body not in repr(creds) and body not in repr(tls_mod.JobTls(creds))
    assert creds.fingerprint[:16] in repr(creds)


def test_credentials_travel_in_the_environment(creds):
    env = tls_mod.worker_env(creds)
    assert env["HOROVOD_TLS"] == "1"
    assert tls_mod.credentials_from_env(env) == creds
    assert tls_mod.credentials_from_env({}) is None
    assert tls_mod.credentials_from_env({**env, "HOROVOD_TLS": "0"}) is None
    with pytest.raises(EnvVarError, match="HOROVOD_TLS_KEY is not set but HOROVOD_TLS=1.*horovodrun --tls"):
        tls_mod.credentials_from_env({"HOROVOD_TLS": "1", "HOROVOD_TLS_CERT": env["HOROVOD_TLS_CERT"]})
    garbage = {**env, "HOROVOD_TLS_KEY": "secret-ish garbage"}
    with pytest.raises(EnvVarError, match="HOROVOD_TLS_KEY is not a PEM private key") as info:
        tls_mod.credentials_from_env(garbage)
    assert "secret-ish" not in str(info.value)


def test_mesh_and_store_refuse_tls_knob_without_credentials(monkeypatch):
    """``HOROVOD_TLS=1`` without the launcher's certificate (e.g. under mpirun): a clear error, not clear text."""
    monkeypatch.setenv("HOROVOD_TLS", "1")
    monkeypatch.delenv("HOROVOD_TLS_CERT", raising=False)
    with pytest.raises(EnvVarError, match="HOROVOD_TLS_CERT is not set.*not available under mpirun"):
        build_mesh(0, 2, "h", InMemoryStore(), KEY, scope="s", timeout=1.0)
    with pytest.raises(EnvVarError, match="HOROVOD_TLS_CERT"):
        StoreClient("127.0.0.1", 1, KEY)


def test_missing_cryptography_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(RuntimeError, match=r"horovod\[tls\]"):
        tls_mod.make_credentials()


# ---------------------------------------------------------------------------------------------- helpers
def _tls_pair(server: tls_mod.JobTls, client: tls_mod.JobTls, port_of=None) -> tuple[TlsChannel, TlsChannel]:
    """(server-side, client-side) channels; ``port_of(port)`` may redirect the client (a proxy)."""
    lst = socket.create_server(("127.0.0.1", 0))
    got: dict[str, ssl.SSLSocket] = {}

    def accept() -> None:
        conn, _ = lst.accept()
        conn = server.server_socket(conn)
        conn.settimeout(5)
        conn.do_handshake()
        server.check_peer(conn)
        got["s"] = conn

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    port = lst.getsockname()[1]
    c = client.client_socket(socket.create_connection(("127.0.0.1", port_of(port) if port_of else port), timeout=5))
    t.join(5)
    lst.close()
    return TlsChannel(got["s"], 1, 5.0), TlsChannel(c, 0, 5.0)


def _plain_pair(port_of=None) -> tuple[Channel, Channel]:
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port_of(port) if port_of else port), timeout=5)
    s, _ = lst.accept()
    lst.close()
    return Channel(s, 1, 5.0), Channel(c, 0, 5.0)


class _Proxy:
    """A TCP proxy to ``target`` that records both directions; ``flip_at`` alters one byte client->server."""

    def __init__(self, target: int, flip_at: int | None = None) -> None:
        self.target, self.flip_at = target, flip_at
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.seen = bytearray()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.lst.settimeout(0.2)
        while not self._stop:
            try:
                a, _ = self.lst.accept()
            except OSError:
                continue
            b = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        upstream = 0  # client -> server bytes so far
        with a, b:
            while not self._stop:
                ready, _, _ = select.select([a, b], [], [], 0.2)
                for src in ready:
                    try:
                        data = src.recv(1 << 16)
                    except OSError:  # the far side reset (e.g. after an altered record)
                        return
                    if not data:
                        return
                    if src is a and self.flip_at is not None and upstream <= self.flip_at < upstream + len(data):
                        i = self.flip_at - upstream
                        data = data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1:]
                    if src is a:
                        upstream += len(data)
                    self.seen += data
                    try:
                        (b if src is a else a).sendall(data)
                    except OSError:
                        return

    def close(self) -> None:
        self._stop = True
        self.lst.close()
        self._thread.join(2)


# ---------------------------------------------------------------------------------------------- channels
def test_channel_frames_stay_aligned_with_records(job):
    """After each frame nothing of the next is left decrypted in the SSL object, so the engine's selector on
    the socket sees every control frame; a keep-alive thread may send while the other side reads."""
    a, b = _tls_pair(job, job)
    try:
        sizes = [0, 1, 7, 100, 16 * 1024 - 8, 16 * 1024, 65_000, 70_000, 300_000]

        def sender() -> None:
            for n in sizes:
                b.send_msg(3, os.urandom(n))
                b.send_msg(4, b"tail")

        def keepalive() -> None:
            for _ in range(200):
                a.send_msg(9, b"k" * 8)

        threads = [threading.Thread(target=sender), threading.Thread(target=keepalive)]
        for t in threads:
            t.start()
        for n in sizes:
            kind, payload = a.recv_msg()
            assert (kind, len(payload)) == (3, n)
            assert a.pending() == 0
            assert a.recv_msg() == (4, b"tail") and a.pending() == 0
        for _ in range(200):
            assert b.recv_msg() == (9, b"k" * 8)
        for t in threads:
            t.join(10)
    finally:
        a.close()
        b.close()


def test_outbox_and_frame_reader_over_tls(job):
    """The control plane's non-blocking pair over TLS: sends never wait for a reader that does not read,
    and the reader gets every frame whole and in order, nothing left decrypted inside the SSL object."""
    from test_transport_outbox import _frames, pump

    from horovod.transport.outbox import Outbox
    from horovod.transport.wire import FrameReader

    a, b = _tls_pair(job, job)
    try:
        box = Outbox({1: b}, lambda ch, on: None)
        frames = _frames(120, 2)  # more than the two socket buffers hold
        start = time.monotonic()
        for kind, payload in frames:
            box.send(1, kind, payload)
        assert time.monotonic() - start < 3.0 and box.waiting()
        reader = FrameReader(a)
        assert pump(box, 1, b, reader, len(frames)) == frames
        assert a.pending() == 0 and not box.waiting()
    finally:
        a.close()
        b.close()


def test_channel_timeout_and_eof(job):
    a, b = _tls_pair(job, job)
    a.settimeout(0.3)
    started = time.monotonic()
    with pytest.raises(PeerFailure, match="timed out after 0.3 s"):
        a.recv_msg()
    assert time.monotonic() - started < 2
    b.close()
    with pytest.raises(PeerFailure, match="closed by peer"):
        a.recv_msg()
    a.close()


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_marker_never_on_the_wire_with_tls(job, encrypted):
    """A recording proxy between two channels: the tensor's bytes show in clear, and never with TLS."""
    proxy: list[_Proxy] = []

    def via(port: int) -> int:
        proxy.append(_Proxy(port))
        return proxy[0].port

    a, b = _tls_pair(job, job, via) if encrypted else _plain_pair(via)
    try:
        x = np.frombuffer(MARKER * 20_000, np.uint8).copy()
        y = np.zeros_like(x)
        t = threading.Thread(target=exchange, args=([Transfer(b, x)], [], 5.0))
        t.start()
        a.recv_buffer_into(y)
        t.join()
        b.send_msg(5, MARKER + b" in a control frame")
        assert a.recv_msg() == (5, MARKER + b" in a control frame")
        np.testing.assert_array_equal(x, y)
        time.sleep(0.05)
        assert len(proxy[0].seen) > x.nbytes
        assert (MARKER in proxy[0].seen) is not encrypted
    finally:
        a.close()
        b.close()
        proxy[0].close()


def test_altered_record_is_a_peer_failure(job):
    proxy: list[_Proxy] = []

    def via(port: int) -> int:
        proxy.append(_Proxy(port, flip_at=20_000))  # well past the handshake, inside the buffer's records
        return proxy[0].port

    a, b = _tls_pair(job, job, via)
    try:
        x = np.arange(100_000, dtype=np.float32)
        y = np.zeros_like(x)
        def send() -> None:
            try:
                exchange([Transfer(b, x)], [], 5.0)
            except PeerFailure:  # the receiver gave up on the altered stream
                pass

        t = threading.Thread(target=send, daemon=True)
        t.start()
        with pytest.raises(PeerFailure, match="SSLError|BAD_RECORD_MAC|DECRYPTION"):
            a.recv_buffer_into(y)
    finally:
        a.close()
        b.close()
        proxy[0].close()


# ---------------------------------------------------------------------------------------------- mesh
def _form(size: int, tls_of, store=None, timeout: float = 10.0) -> tuple[dict, dict]:
    store = store or InMemoryStore()
    meshes: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            meshes[r] = build_mesh(r, size, "h", store, KEY, scope="s", timeout=timeout, disable_shm=True,
                                   tls=tls_of(r))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return meshes, errors


def test_collectives_over_tls_mesh(job):
    size = 3
    meshes, errors = _form(size, lambda r: job)
    assert not errors, errors
    try:
        for m in meshes.values():
            assert m.tls and all(isinstance(ch, TlsChannel) for ch in [*m.data.values(), *m.ctrl.values()])
        results: dict[int, bool] = {}

        def work(r: int) -> None:
            comm = TcpCommunicator(meshes[r], list(range(size)), RuntimeConfig(op_timeout=20.0),
                                   small_bytes=1024, piece_bytes=4096)
            for n in (5, 1000, 300_001):  # direct exchange, ring with pieces
                x = np.arange(n, dtype=np.float64) * (r + 1)
                out = np.empty_like(x)
                comm.allreduce(x, out, ReduceOp.SUM)
                np.testing.assert_array_equal(out, np.arange(n, dtype=np.float64) * 6)
                b = np.full(n, r, np.int32)
                comm.broadcast(b, 2)  # a pipelined chain above small_bytes
                assert (b == 2).all()
            counts = [1000 * (i + 1) for i in range(size)]
            g = np.empty(sum(counts), np.float32)
            comm.allgatherv(np.full(counts[r], r, np.float32), g, counts)
            np.testing.assert_array_equal(g, np.repeat(np.arange(size, dtype=np.float32), counts))
            a2a = np.empty(size * 7, np.int64)
            comm.alltoallv(np.repeat(np.arange(size) + 10 * r, 7), [7] * size, a2a, [7] * size)
            np.testing.assert_array_equal(a2a, np.repeat(np.arange(size) * 10 + r, 7))
            rs = np.empty(500, np.float32)
            comm.reducescatterv(np.ones(500 * size, np.float32) * (r + 1), rs, [500] * size, ReduceOp.SUM)
            assert (rs == 6).all()
            comm.barrier()
            results[r] = True

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == {0: True, 1: True, 2: True}
    finally:
        for m in meshes.values():
            m.close()


def test_peer_with_another_jobs_certificate_is_refused(job, other_job):
    started = time.monotonic()
    meshes, errors = _form(2, lambda r: job if r == 0 else other_job, timeout=2.0)
    for m in meshes.values():
        m.close()
    assert isinstance(errors.get(1), WireError), errors
    assert "did not present this job's TLS certificate" in str(errors[1])
    assert isinstance(errors.get(0), PeerFailure) and "rank 1" in str(errors[0]), errors
    assert time.monotonic() - started < 6


class _GatedStore:
    def __init__(self) -> None:
        self.inner, self.gate = InMemoryStore(), threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self.gate.wait(timeout)
        return self.inner.get(key, timeout=timeout)


def test_strangers_refused_at_the_tls_handshake(job, other_job, caplog):
    """While two ranks form a TLS mesh: a plaintext peer that even holds the job key, a TLS client without a
    certificate and one with another job's certificate are dropped at once, before any frame of ours (no
    HELLO, so not even the nonce or scope), and the mesh forms."""
    store = _GatedStore()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(zip("me", _form(2, lambda r: job, store, 8.0))),
                              daemon=True)
    with caplog.at_level(logging.WARNING, logger="horovod.transport.mesh"):
        thread.start()
        rec = json.loads(store.inner.get("s/addr.0", timeout=5))
        addr = (rec["addr"], rec["port"])

        plain = socket.create_connection(addr, timeout=3)
        plain.sendall(HEADER.pack(b"HV", VERSION, 0xF2, 100) + b"\0" * 100)  # an AUTH frame in clear
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        no_cert.check_hostname, no_cert.verify_mode = False, ssl.CERT_NONE
        foreign = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        foreign.check_hostname, foreign.verify_mode = False, ssl.CERT_NONE
        tls_mod._load_chain(foreign, other_job.creds)
        seen = {}
        started = time.monotonic()
        for name, ctx in (("no certificate", no_cert), ("another job's certificate", foreign)):
            s = ctx.wrap_socket(socket.create_connection(addr, timeout=3))  # TLS 1.3: the client finishes first
            try:
                seen[name] = s.recv(100)
            except (ssl.SSLError, OSError) as e:
                seen[name] = repr(e)
            s.close()
        try:
            seen["plain"] = plain.recv(100)
        except OSError as e:
            seen["plain"] = repr(e)
        plain.close()
        elapsed = time.monotonic() - started
        store.gate.set()
        thread.join(15)
    assert all(not isinstance(v, bytes) or v == b"" for v in seen.values()), seen  # no byte of a HELLO
    assert elapsed < 1.5, elapsed  # refused at once, not at the 2 s pre-auth deadline
    assert not result["e"], result["e"]
    for m in result["m"].values():
        m.close()
    refusals = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(refusals) == 3, refusals


@pytest.fixture
def tls_env(monkeypatch, creds):
    """The environment horovodrun --tls gives a worker: build_mesh() then defaults to TLS."""
    for name, value in tls_mod.worker_env(creds).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("attack", ["silent-and-trickling", "total-deadline", "flood"])
def test_stranger_suite_over_tls(tls_env, attack):
    """test_mesh_strangers.py's silent, trickling and flooding strangers against ranks that handshake TLS
    first: the TLS handshake runs inside the same total deadline and slots, so the mesh still forms on time."""
    import test_mesh_strangers as strangers

    {"silent-and-trickling": lambda: strangers.test_silent_and_trickling_strangers_on_every_listener(True),
     "total-deadline": strangers.test_trickler_is_dropped_at_a_total_deadline,
     "flood": strangers.test_a_flood_of_silent_connections_is_bounded_and_the_mesh_still_forms}[attack]()


# ---------------------------------------------------------------------------------------------- store
@pytest.fixture
def tls_server(job):
    srv = RendezvousServer(KEY, read_timeout=1.0, tls=job)
    srv.start()
    yield srv
    srv.stop()


def test_store_roundtrip_and_refusals(tls_server, job, other_job):
    client = StoreClient("127.0.0.1", tls_server.port, KEY, timeout=5, tls=job)
    value = os.urandom(3 << 20)
    client.put("s/big", value)
    assert client.get("s/big") == value
    with pytest.raises(StoreError, match="did not present this job's TLS certificate"):
        StoreClient("127.0.0.1", tls_server.port, KEY, timeout=5, tls=other_job).get("s/big")
    started = time.monotonic()
    with pytest.raises(StoreError):  # the job key alone is not enough: no TLS, no answer
        StoreClient("127.0.0.1", tls_server.port, KEY, timeout=5, tls=False).get("s/big")
    assert time.monotonic() - started < 1


def test_plain_store_named_to_a_tls_client(job):
    with RendezvousServer(KEY, read_timeout=0.5) as srv:
        with pytest.raises(StoreError, match="TLS handshake with the rendezvous store.*failed.*without --tls"):
            StoreClient("127.0.0.1", srv.port, KEY, timeout=5, tls=job).get("s/x")


def test_store_not_pinned_by_plaintext_silent_or_stalled_clients(tls_server, job):
    """Plaintext requests signed with the job key are refused at their first bytes; 40 silent connections
    and 40 that stall inside their ClientHello leave the single I/O thread free for a real client."""
    held = [socket.create_connection(("127.0.0.1", tls_server.port)) for _ in range(40)]
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", tls_server.port))
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello, then nothing
        held.append(s)
    try:
        refused_in = []
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", tls_server.port), timeout=3)
            headers = sign_request(KEY, "GET", "/s/x")
            s.sendall(("GET /s/x HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
                      .encode())
            started = time.monotonic()
            try:
                data = s.recv(1000)
            except ConnectionResetError:
                data = b""
            refused_in.append(time.monotonic() - started)
            assert b"HTTP" not in data  # no answer of ours, signed or not
            s.close()
        assert max(refused_in) < 0.5, refused_in
        client = StoreClient("127.0.0.1", tls_server.port, KEY, timeout=5, tls=job)
        started = time.monotonic()
        for i in range(5):
            client.put(f"s/k{i}", b"v")
            assert client.get(f"s/k{i}") == b"v"
        assert time.monotonic() - started < 2
        assert sum(t.name.startswith("horovod-rendezvous") for t in threading.enumerate()) == 5
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_store_values_never_on_the_wire_with_tls(job, encrypted):
    with RendezvousServer(KEY, tls=job if encrypted else None) as srv:
        proxy = _Proxy(srv.port)
        try:
            client = StoreClient("127.0.0.1", proxy.port, KEY, timeout=5, tls=job if encrypted else False)
            client.put("s/pickled", MARKER * 3)
            assert client.get("s/pickled") == MARKER * 3
            time.sleep(0.05)
            assert len(proxy.seen) > 2 * len(MARKER) * 3
            assert (MARKER in proxy.seen) is not encrypted
            assert (b"/s/pickled" in proxy.seen) is not encrypted  # the keys too
        finally:
            proxy.close()


# ---------------------------------------------------------------------------------------------- launcher
def test_launcher_flag_env_and_mpi_refusal(creds, monkeypatch):
    from horovod.runner import launch
    from horovod.runner.hosts import SlotInfo

    monkeypatch.delenv("HOROVOD_TLS", raising=False)
    args = launch.parse_args(["-np", "2", "--tls", "true"])
    assert args.knob_env()["HOROVOD_TLS"] == "1"
    assert args.tls_requested()
    args = launch.parse_args(["-np", "2", "--tls", "--mpi", "true"])
    with pytest.raises(ValueError, match="--tls.*under --mpi.*not encrypted"):
        launch._run(args)
    slot = SlotInfo(hostname="localhost", rank=0, local_rank=0, cross_rank=0, size=1, local_size=1, cross_size=1)
    stale = {"PATH": "/bin", "HOROVOD_TLS_CERT": "stale", "HOROVOD_TLS_KEY": "stale"}
    env = launch.worker_env(slot, base=stale, store_addr="h", store_port=1, key=b"k", knobs={}, start_timeout=1)
    assert "HOROVOD_TLS_CERT" not in env and "HOROVOD_TLS_KEY" not in env
    env = launch.worker_env(slot, base=stale, store_addr="h", store_port=1, key=b"k", knobs={}, start_timeout=1,
                            tls=creds)
    assert tls_mod.credentials_from_env(env) == creds
