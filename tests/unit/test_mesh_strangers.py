"""Strangers without the key cannot hold up mesh formation (issue 10, item 2).

Three ranks (threads, one in-memory store) publish their addresses and wait at a gate; the test then
points silent, trickling (one byte a second), flooding and garbage-sending connections at every rank's
TCP port and abstract AF_UNIX socket (a local user finds the latter in /proc/net/unix), opens the gate and
checks that the mesh still forms within its deadline and that collectives run on it.  The old acceptor
handshook one connection at a time with a per-recv timeout that every byte restarted, so each of these
blocked it until the deadline.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time

import numpy as np
import pytest

from horovod.base.config import RuntimeConfig
from horovod.transport import ReduceOp, build_mesh, make_communicator
from horovod.transport.mesh import _MAX_PREAUTH, _MAX_PREAUTH_BYTES, _PREAUTH_TIMEOUT
from horovod.transport.store import InMemoryStore
from horovod.transport.wire import HEADER, VERSION

KEY = b"strangers" * 4
SIZE = 3
MESH_TIMEOUT = 8.0  # seconds for the whole formation, gate included
# A plausible start of an AUTH frame (magic, version, kind, a length within the pre-auth bound).
AUTH_HEADER = HEADER.pack(b"HV", VERSION, 0xF2, _MAX_PREAUTH_BYTES - HEADER.size)


class _GatedStore:
    """Addresses are published at once but nobody reads them before ``gate`` opens."""

    def __init__(self) -> None:
        self.inner = InMemoryStore()
        self.gate = threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.inner.put(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self.gate.wait(timeout)
        return self.inner.get(key, timeout=timeout)


class _Job:
    """SIZE ranks forming a mesh in threads, then running one allreduce; ``errors`` collects failures."""

    def __init__(self, disable_shm: bool = False) -> None:
        self.store = _GatedStore()
        self.errors: list[BaseException] = []
        self.sums: dict[int, float] = {}
        self.formed_at: dict[int, float] = {}
        self.threads = [threading.Thread(target=self._rank, args=(r, disable_shm), daemon=True)
                        for r in range(SIZE)]
        for t in self.threads:
            t.start()
        self.records = [json.loads(self.store.inner.get(f"s/addr.{r}", timeout=10)) for r in range(SIZE)]

    def _rank(self, rank: int, disable_shm: bool) -> None:
        try:
            mesh = build_mesh(rank, SIZE, "h", self.store, KEY, scope="s", timeout=MESH_TIMEOUT,
                              disable_shm=disable_shm)
            self.formed_at[rank] = time.monotonic()
            try:
                comm = make_communicator(mesh, list(range(SIZE)), RuntimeConfig(op_timeout=10.0,
                                                                                disable_shm=disable_shm))
                out = np.empty(1000)
                comm.allreduce(np.full(1000, rank + 1.0), out, ReduceOp.SUM)
                self.sums[rank] = float(out.mean())
                comm.close()
            finally:
                mesh.close()
        except BaseException as e:  # reported by finish()
            self.errors.append(e)

    def finish(self) -> float:
        """Open the gate, wait for every rank; the seconds from the gate to the last mesh formed."""
        opened = time.monotonic()
        self.store.gate.set()
        for t in self.threads:
            t.join(MESH_TIMEOUT + 10)
        assert not self.errors, self.errors
        assert self.sums == {r: 6.0 for r in range(SIZE)}
        return max(self.formed_at.values()) - opened


def _tcp(rec: dict) -> socket.socket:
    return socket.create_connection(("127.0.0.1", rec["port"]), timeout=5)


def _unix(rec: dict) -> socket.socket:
    deadline = time.monotonic() + 5
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect("\0" + rec["unix"])
            return s
        except BlockingIOError:  # the backlog is full (AF_UNIX does not wait): the listener catches up
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the other end closed or reset the connection (whatever it sent before is drained)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_closed(socks: list[socket.socket], within: float, allowed: int = 0) -> list[socket.socket]:
    """The sockets the peer still keeps open once at most ``allowed`` are left, or after ``within`` s."""
    deadline = time.monotonic() + within
    left = list(socks)
    while len(left) > allowed and time.monotonic() < deadline:
        left = [s for s in left if not _closed_by_peer(s)]
        time.sleep(0.05)
    return left


class _Trickler(threading.Thread):
    """Sends the next byte of an AUTH frame to each socket once a second: a per-read timeout never fires."""

    def __init__(self, socks: list[socket.socket], period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.socks, self.period, self.halt = socks, period, threading.Event()
        self.payload = AUTH_HEADER + b"\0" * (_MAX_PREAUTH_BYTES - HEADER.size)

    def run(self) -> None:
        i = 0
        while not self.halt.is_set():
            for s in self.socks:
                try:
                    s.send(self.payload[i % len(self.payload):][:1])
                except OSError:
                    pass
            i += 1
            self.halt.wait(self.period)


@pytest.mark.parametrize("disable_shm", [False, True], ids=["unix-data", "tcp-data"])
def test_silent_and_trickling_strangers_on_every_listener(disable_shm):
    job = _Job(disable_shm)
    silent, trickling = [], []
    for rec in job.records:
        for connect in (_tcp, _unix):
            silent += [connect(rec) for _ in range(5)]
            trickling += [connect(rec) for _ in range(5)]
    trickler = _Trickler(trickling)
    trickler.start()
    time.sleep(0.3)  # every listener has the strangers in hand before the real peers come
    try:
        took = job.finish()
        assert took < MESH_TIMEOUT / 2, f"the mesh took {took:.1f} s to form"
        # No connection that never proved the key outlives the formation.
        assert not _wait_closed(silent + trickling, 3.0)
    finally:
        trickler.halt.set()
        for s in silent + trickling:
            s.close()


def test_trickler_is_dropped_at_a_total_deadline():
    """One byte a second keeps a per-read timeout alive forever; the pre-auth deadline is for the whole."""
    job = _Job()
    socks = [_tcp(job.records[0]), _unix(job.records[0])]
    trickler = _Trickler(socks, period=0.5)
    start = time.monotonic()
    trickler.start()
    try:
        assert not _wait_closed(socks, _PREAUTH_TIMEOUT + 2.0), "a trickling stranger was kept past its deadline"
        assert time.monotonic() - start >= _PREAUTH_TIMEOUT - 0.5
        job.finish()
    finally:
        trickler.halt.set()
        for s in socks:
            s.close()


def test_a_flood_of_silent_connections_is_bounded_and_the_mesh_still_forms():
    job = _Job()
    flood = []
    for _ in range(3 * _MAX_PREAUTH):
        flood.append(_tcp(job.records[0]))
        flood.append(_unix(job.records[1]))
    try:
        # Each rank holds at most _MAX_PREAUTH of them; the oldest beyond that are dropped at once.
        still_open = _wait_closed(flood, 3.0, allowed=2 * _MAX_PREAUTH)
        assert len(still_open) <= 2 * _MAX_PREAUTH, len(still_open)
        job.finish()
    finally:
        for s in flood:
            s.close()


def test_a_megabyte_of_garbage_is_cut_off_after_a_small_bound(caplog):
    caplog.set_level(logging.DEBUG, logger="horovod.transport.mesh")
    job = _Job()
    rec = job.records[0]
    silent = [connect(rec) for connect in (_tcp, _unix) for _ in range(5)]
    results: dict[str, tuple[float, int]] = {}

    def flood(name: str, sock: socket.socket, data: bytes) -> None:
        start, sent = time.monotonic(), 0
        sock.settimeout(0.2)
        try:
            while sent < len(data) and time.monotonic() - start < 6:
                try:
                    sent += sock.send(data[sent:sent + 65536])
                except TimeoutError:
                    continue
            while time.monotonic() - start < 6:  # everything was buffered: wait for the server's verdict
                try:
                    if not sock.recv(65536):
                        break
                except TimeoutError:
                    continue
        except OSError:
            pass
        results[name] = (time.monotonic() - start, sent)

    garbage = os.urandom(1 << 20)
    tcp = _tcp(rec)
    port = tcp.getsockname()[1]
    senders = [threading.Thread(target=flood, args=("tcp", tcp, AUTH_HEADER + garbage)),
               threading.Thread(target=flood, args=("unix", _unix(rec), garbage))]
    for t in senders:
        t.start()
    for t in senders:
        t.join(10)
    try:
        for name, (took, _sent) in results.items():
            assert took < 2.0, f"the {name} garbage sender was served for {took:.1f} s"
        assert set(results) == {"tcp", "unix"}
        read = [int(n) for n in re.findall(r"refused a connection from .* after (\d+) bytes", caplog.text)]
        assert read and max(read) <= _MAX_PREAUTH_BYTES, read
        assert re.search(rf"from 127\.0\.0\.1:{port} after {_MAX_PREAUTH_BYTES} bytes", caplog.text), caplog.text
        job.finish()
    finally:
        for s in silent + [tcp]:
            s.close()
