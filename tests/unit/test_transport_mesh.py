"""Mesh formation inside one process (threads + InMemoryStore): topology, AF_UNIX vs TCP, refusals."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time

import pytest
from transport_harness import FileStore, run_ranks

from horovod.base.exceptions import WireError
from horovod.transport import build_mesh
from horovod.transport.mesh import advertise_address
from horovod.transport.store import InMemoryStore
from horovod.transport.wire import HEADER, VERSION, Channel

KEY = b"secret" * 4


def _form(size, hosts=None, disable_shm=False, store=None, gate=None, key=KEY):
    store = store or InMemoryStore()
    meshes, errors = [None] * size, []

    def run(r):
        try:
            if gate is not None and r > 0:
                gate.wait(10)
            meshes[r] = build_mesh(r, size, hosts[r] if hosts else "h", store, key, scope="s", timeout=10.0,
                                   disable_shm=disable_shm)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    return store, meshes, errors, threads


def _join(threads, errors, meshes):
    for t in threads:
        t.join(20)
    assert not errors, errors
    return meshes


def test_size_one_needs_no_sockets():
    mesh = build_mesh(0, 1, "h", InMemoryStore(), KEY, scope="s", timeout=1.0)
    assert mesh.size == 1 and mesh.ctrl == {} and mesh.data == {} and mesh.hostnames == ["h"]
    mesh.close()


@pytest.mark.parametrize("disable_shm", [False, True])
def test_topology(disable_shm):
    hosts = ["a", "a", "b", "a"]
    _, meshes, errors, threads = _form(4, hosts, disable_shm)
    meshes = _join(threads, errors, meshes)
    try:
        for m in meshes:
            assert m.hostnames == hosts
            assert sorted(m.data) == [r for r in range(4) if r != m.rank]
            assert sorted(m.ctrl) == ([1, 2, 3] if m.rank == 0 else [0])
            for peer, ch in m.data.items():
                assert ch.peer == peer
                assert ch.is_unix == (not disable_shm and hosts[peer] == hosts[m.rank])
        # Channels are wired to each other: what 3 sends on data[1], 1 reads on data[3].
        meshes[3].data[1].send_msg(5, b"hi")
        assert meshes[1].data[3].recv_msg() == (5, b"hi")
        meshes[2].ctrl[0].send_msg(6, b"ctl")
        assert meshes[0].ctrl[2].recv_msg() == (6, b"ctl")
    finally:
        for m in meshes:
            m.close()


def _attack(store, caplog_records_expected):
    rec = json.loads(store.get("s/addr.0", timeout=10))
    attempts = []
    # 1. random garbage on TCP
    s = socket.create_connection(("127.0.0.1", rec["port"]))
    s.sendall(os.urandom(64))
    attempts.append(s)
    # 2. a well-formed frame with a huge length
    s = socket.create_connection(("127.0.0.1", rec["port"]))
    s.sendall(HEADER.pack(b"HV", VERSION, 0xF2, 1 << 30))
    attempts.append(s)
    # 3. the right protocol with the wrong key, over AF_UNIX
    u = socket.socket(socket.AF_UNIX)
    u.connect("\0" + rec["unix"])
    from horovod.transport.mesh import _client_handshake

    with pytest.raises((WireError, ConnectionError)):
        _client_handshake(Channel(u, 0, 5.0), b"wrong key", "s", 1, 0, 1)
    attempts.append(u)
    # 4. a stranger that connects and closes at once
    s = socket.create_connection(("127.0.0.1", rec["port"]))
    s.close()
    return attempts


def test_refuses_strangers_and_still_forms(caplog):
    caplog.set_level(logging.WARNING, logger="horovod.transport.mesh")
    gate = threading.Event()
    store, meshes, errors, threads = _form(3, gate=gate)
    try:
        socks = _attack(store, 3)
    finally:
        gate.set()
    meshes = _join(threads, errors, meshes)
    try:
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) >= 3, [r.getMessage() for r in caplog.records]
        meshes[1].data[0].send_msg(1, b"ok")
        assert meshes[0].data[1].recv_msg() == (1, b"ok")
    finally:
        for s in socks:
            s.close()
        for m in meshes:
            m.close()


def test_wrong_key_peer_fails():
    store = InMemoryStore()
    errors = []

    def run(r, key):
        try:
            build_mesh(r, 2, "h", store, key, scope="s", timeout=2.0).close()
        except Exception as e:
            errors.append((r, e))

    threads = [threading.Thread(target=run, args=(0, KEY)), threading.Thread(target=run, args=(1, b"bad"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {r for r, _ in errors} == {0, 1}
    assert any(isinstance(e, (WireError, ConnectionError)) for _, e in errors)


class _GenerationOver(Exception):
    pass


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("disable_shm", [False, True])
def test_abort_ends_the_wait_for_a_dead_peer(rank, disable_shm):
    """The peer published its address and died: rank 0 waits for its connection, rank 1 retries its closed
    listener.  Both give up when ``abort`` raises (elastic: the driver ended the generation), not at the
    30 s timeout."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there any more
    store = InMemoryStore()
    peer = 1 - rank
    store.put(f"s/addr.{peer}", json.dumps({"host": "h", "port": port, "unix": f"gone.{os.getpid()}",
                                             "addr": "127.0.0.1"}).encode())
    over_at = time.monotonic() + 0.5
    calls = []

    def abort():
        calls.append(time.monotonic())
        if time.monotonic() > over_at:
            raise _GenerationOver

    started = time.monotonic()
    with pytest.raises(_GenerationOver):
        build_mesh(rank, 2, "h", store, KEY, scope="s", timeout=30.0, disable_shm=disable_shm, abort=abort)
    assert time.monotonic() - started < 2.0
    assert len(calls) >= 2  # consulted while waiting, not once at the end


def test_advertise_address():
    assert advertise_address("10.1.2.3") == "10.1.2.3"
    assert advertise_address(None, "127.0.0.1") == "127.0.0.1"
    assert advertise_address(None, None, "localhost").startswith("127.")


def _speak_version(other_rank: int, version: int, rank: int, store: FileStore) -> None:
    """``before_mesh`` of the harness: rank ``other_rank`` runs wire version ``version``."""
    from horovod.transport import mesh, wire

    if rank == other_rank:
        wire.VERSION = mesh.VERSION = version


def _never_reached(ctx) -> None:  # pragma: no cover - the mesh must not form
    raise AssertionError("the mesh formed across wire versions")


@pytest.mark.parametrize("other_rank,disable_shm", [(1, False), (0, False), (1, True)],
                         ids=["client-newer", "server-newer", "client-newer-tcp"])
def test_ranks_of_another_wire_version_name_it_at_once_on_both_sides(other_rank, disable_shm):
    """Rank 0 accepts, rank 1 connects; one of them runs another wire version (a newer horovod).  Before,
    the client failed with "unsupported frame version" and the server waited for the whole formation timeout
    (20 s here) to say that rank 1 "did not connect".  Both name the versions now, within a round trip."""
    other = VERSION + 1
    started = time.monotonic()
    got = run_ranks(2, _never_reached, before_mesh=functools.partial(_speak_version, other_rank, other),
                    disable_shm=disable_shm, expect_fail={0, 1}, timeout=30.0)
    assert time.monotonic() - started < 10.0  # (process start-up included)
    mine = {other_rank: other, 1 - other_rank: VERSION}
    for rank, peer in ((0, 1), (1, 0)):
        status, trace, _ = got[rank]
        assert status == "error", (rank, got[rank])
        assert (f"WireError: rank {peer} runs a different horovod wire version ({mine[peer]}) than rank {rank} "
                f"(version {mine[rank]}): ") in trace, trace
        assert "every rank of a job must run the same horovod version" in trace
