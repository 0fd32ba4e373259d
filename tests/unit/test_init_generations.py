"""Generations of init(): the store view that names a rank in another generation, and the mesh handshake.

Ranks meet in the store scope ``init.<g>`` of their own init() count; these tests drive the bootstrap's
store view with an in-memory store from threads (what each rank would publish) and check which waits end
at once, which at the deadline, and what the errors say.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from horovod.base.exceptions import WireError
from horovod.common.bootstrap import GenerationMismatch, _GenerationStore, _key_rank
from horovod.transport import build_mesh
from horovod.transport.store import InMemoryStore, StoreError

KEY = b"k" * 32


def _state(store, rank, generation, error=None):
    store.put(f"init/state.{rank}", json.dumps({"generation": generation, "error": error}).encode())


def test_key_rank():
    assert _key_rank("init.3/addr.1") == 1
    assert _key_rank("init.12/process_sets.10") == 10
    assert _key_rank("init/other") is None


def test_present_key_is_returned_whatever_the_peer_state():
    store = InMemoryStore()
    _state(store, 1, 9)
    store.put("init.2/addr.1", b"x")
    assert _GenerationStore(store, 0, 2).get("init.2/addr.1", timeout=1.0) == b"x"


def test_peer_past_this_generation_fails_at_once():
    store = InMemoryStore()
    _state(store, 1, 5)
    view = _GenerationStore(store, 0, 4)
    t0 = time.monotonic()
    with pytest.raises(GenerationMismatch) as info:
        view.get("init.4/process_sets.1", timeout=20.0)
    assert time.monotonic() - t0 < 5.0
    assert info.value.peer == 1
    assert isinstance(info.value, ValueError)  # upstream's init() fails with one: `except ValueError` catches it
    msg = str(info.value)
    assert "rank 1 is at generation 5" in msg and "rank 0" in msg and "generation 4" in msg


def test_peer_that_failed_this_generation_fails_at_once_with_its_cause():
    store = InMemoryStore()
    _state(store, 2, 3, "ValueError: different process_sets")
    t0 = time.monotonic()
    with pytest.raises(GenerationMismatch, match=r"rank 2 failed to initialize generation 3: ValueError: diff"):
        _GenerationStore(store, 1, 3).get("init.3/addr.2", timeout=20.0)
    assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("peer_generation", [None, 2])
def test_peer_behind_is_named_at_the_deadline(peer_generation):
    store = InMemoryStore()
    if peer_generation is not None:
        _state(store, 1, peer_generation)
    t0 = time.monotonic()
    with pytest.raises(GenerationMismatch) as info:
        _GenerationStore(store, 0, 3).get("init.3/process_sets.1", timeout=1.5)
    elapsed = time.monotonic() - t0
    assert 1.4 <= elapsed < 6.0
    where = "never called init()" if peer_generation is None else f"is at generation {peer_generation}"
    assert f"rank 1 {where}" in str(info.value) and "rank 0 waited" in str(info.value)
    # a peer that never reached init() may just be slow to start: upstream's start-timeout errors say
    # "You may need to increase the --start-timeout parameter"
    assert ("increase the --start-timeout parameter" in str(info.value)) == (peer_generation is None)


def test_same_generation_but_missing_key_is_a_plain_timeout():
    store = InMemoryStore()
    _state(store, 1, 3)
    with pytest.raises(StoreError, match="timed out waiting"):
        _GenerationStore(store, 0, 3).get("init.3/addr.1", timeout=1.0)


def test_peer_that_arrives_late_is_waited_for():
    store = InMemoryStore()
    _state(store, 1, 2)

    def peer():
        time.sleep(1.2)
        _state(store, 1, 3)
        store.put("init.3/addr.1", b"rec")

    t = threading.Thread(target=peer)
    t.start()
    try:
        assert _GenerationStore(store, 0, 3).get("init.3/addr.1", timeout=10.0) == b"rec"
    finally:
        t.join()


def test_key_put_just_before_moving_on_is_still_found():
    """The peer put the key and moved on between our two looks: the key wins over its newer state."""
    store = _FirstLookMisses("init.3/addr.1")
    store.put("init.3/addr.1", b"rec")
    _state(store, 1, 4)
    assert _GenerationStore(store, 0, 3).get("init.3/addr.1", timeout=10.0) == b"rec"
    assert store.looks == 2


class _FirstLookMisses(InMemoryStore):
    """The first look at ``key`` finds nothing, as if it raced the peer's put."""

    def __init__(self, key):
        super().__init__()
        self.key, self.looks = key, 0

    def get(self, key, timeout=30.0):
        if key == self.key:
            self.looks += 1
            if self.looks == 1:
                raise StoreError(f"timed out waiting for key {key!r}")
        return super().get(key, timeout)


def test_forget_previous_deletes_only_own_keys_of_the_last_generation():
    store = InMemoryStore()
    for key in ("init.1/addr.0", "init.1/process_sets.0", "init.1/addr.1", "init.2/addr.0"):
        store.put(key, b"x")
    _GenerationStore(store, 0, 2).forget_previous()
    assert sorted(store._data) == ["init.1/addr.1", "init.2/addr.0"]


def test_meshes_of_different_generations_refuse_each_other_by_name():
    """Rank 1 finds rank 0's listener of another scope (a reused port): the error names both meshes."""
    store = InMemoryStore()
    errors = {}

    def run(rank, scope, real_scope):
        try:
            build_mesh(rank, 2, "h", _Redirect(store, scope, real_scope), KEY, scope=scope, timeout=2.0).close()
        except Exception as e:  # noqa: BLE001 - checked below
            errors[rank] = e

    # Rank 1 (in init.5) reads rank 0's address from init.4, as if the old port had been reused.
    threads = [threading.Thread(target=run, args=(0, "init.4", "init.4")),
               threading.Thread(target=run, args=(1, "init.5", "init.4"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert isinstance(errors.get(1), WireError), errors
    assert "'init.4'" in str(errors[1]) and "'init.5'" in str(errors[1])
    assert 0 in errors  # rank 0 never got a valid peer: its deadline ends it


class _Redirect:
    """Reads rank 0's address record from another scope."""

    def __init__(self, store, scope, real_scope):
        self.store, self.scope, self.real_scope = store, scope, real_scope

    def put(self, key, value):
        self.store.put(key, value)

    def get(self, key, timeout=None):
        if key == f"{self.scope}/addr.0":
            key = f"{self.real_scope}/addr.0"
        return self.store.get(key, timeout=timeout)


def test_engine_wake_pipe_is_closed_once():
    """A second close() or a wake() after close() must not touch descriptors that reused the numbers (the
    stopped engine of one generation used to close or write into sockets of the next one)."""
    import os

    from horovod.runtime.queue import TensorQueue

    q = TensorQueue()
    old = {q.wake_fd, q._wake_w}
    q.close()
    a, b = os.pipe()  # the lowest free numbers: normally the ones just closed
    try:
        if {a, b} != old:
            pytest.skip("the descriptor numbers were not reused")
        q.close()
        q.wake()
        os.fstat(a), os.fstat(b)  # still open
        os.set_blocking(a, False)
        with pytest.raises(BlockingIOError):  # and nothing was written into them
            os.read(a, 1)
    finally:
        os.close(a)
        os.close(b)


def _launch_env(monkeypatch, port="4000", local_rank="1"):
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", port)
    monkeypatch.setenv("HOROVOD_HOSTNAME", "localhost")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", local_rank)
    monkeypatch.setenv("HOROVOD_RANK", local_rank)


def test_a_copy_of_a_live_rank_is_refused_and_other_processes_are_not(monkeypatch):
    """Only a process whose launch slot a *live other* process initialized is refused: a new job (another
    store port or slot), a dead owner, the owner itself (re-init, elastic) and a single process go on."""
    import os
    import subprocess
    import sys

    from horovod.common import bootstrap

    monkeypatch.delenv(bootstrap.RANK_OWNER_ENV, raising=False)  # restored to absent afterwards
    _launch_env(monkeypatch)
    bootstrap.claim_rank()  # this process initialized the slot: its own re-init is fine
    bootstrap.refuse_a_copy_of_a_rank()
    owner = os.environ[bootstrap.RANK_OWNER_ENV]
    assert owner.split(" ")[0] == str(os.getpid())
    # a live other process (the parent of this one) owns the slot: refused, naming both pids and the fix
    monkeypatch.setenv(bootstrap.RANK_OWNER_ENV, f"{os.getppid()} {owner.split(' ', 1)[1]}")
    with pytest.raises(RuntimeError, match=rf"this process \(pid {os.getpid()}\) has the environment of rank 1, "
                                           rf"which process {os.getppid()} already initialized.*__main__"):
        bootstrap.refuse_a_copy_of_a_rank()
    for other in (lambda: _launch_env(monkeypatch, port="4001"),  # another job's store
                  lambda: _launch_env(monkeypatch, local_rank="0"),  # another slot
                  lambda: monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR")):  # no launcher, or MPI
        other()
        bootstrap.refuse_a_copy_of_a_rank()
        _launch_env(monkeypatch)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    monkeypatch.setenv(bootstrap.RANK_OWNER_ENV, f"{dead.stdout.strip()} {owner.split(' ', 1)[1]}")
    bootstrap.refuse_a_copy_of_a_rank()  # the owner is gone: this process may take its place


def test_elastic_mesh_given_up_at_a_reset_says_so():
    """A peer that never arrives in an elastic generation the driver ended: the survivor gives up at the reset
    and says why.  It said "no address in the rendezvous store within 30.0 s: elastic/reset.1" after a second,
    naming a timeout that never ran out."""
    from horovod.common.elastic_init import _AbortableStore

    store = InMemoryStore()
    view = _AbortableStore(store, 1)
    threading.Timer(0.5, store.put, args=("elastic/reset.1", b"1")).start()
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        build_mesh(0, 2, "h", view, KEY, scope="elastic.1", timeout=30.0, abort=view.check)
    assert time.monotonic() - t0 < 10
    msg = str(info.value)
    assert "within 30" not in msg and "rank 1" in msg and "the elastic driver ended generation 1" in msg, msg
