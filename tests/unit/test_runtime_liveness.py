"""Liveness pieces behind tests/test_freeze.py: keep-alive clocks, the coordinator settling failure reports,
deadlines derived from the knobs, the transport's timeout/closed distinction, and engines whose peer is
silent (connected, but no engine answers) in two real processes."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from transport_harness import Ctx, run_ranks

from horovod.base.config import RuntimeConfig
from horovod.runtime.coordinator import Coordinator, collective_failure
from horovod.runtime.engine import _PeerClock, liveness_deadline
from horovod.runtime.messages import Request, RequestType, dtype_code
from horovod.transport.communicator import PeerFailure
from horovod.transport.wire import Channel, Transfer, exchange

F32 = dtype_code(np.float32)


def _coordinator(size: int, settle: float = 0.5, wait: float = 3.0) -> Coordinator:
    return Coordinator(size, {0: list(range(size))}, cache_capacity=16, fusion_threshold=1 << 20,
                       failure_settle=settle, failure_wait=wait)


def _timeout(rank: int, peer: int) -> str:
    return collective_failure(rank, PeerFailure(peer, "timed out after 3 s waiting for the peer"))


# -- coordinator: failure reports -------------------------------------------------------------------------

def test_plain_shutdown_reasons_apply_at_once():
    c = _coordinator(3)
    c.submit(1, 0, "rank 1 called shutdown()", [], [])
    assert c.shutdown_reason == "rank 1 called shutdown()"


def _stopped(rank):
    return lambda r: r != rank  # every rank sends keep-alives except ``rank``


@pytest.mark.parametrize("order", [(0, 2), (2, 0)])
def test_a_rank_that_waited_for_a_live_rank_is_not_believed(order):
    # Rank 1 stopped; rank 2 timed out on it, and rank 0 (waiting for rank 2 in a ring) timed out on rank 2 --
    # possibly first, while rank 2 was still draining what rank 1 had sent before it stopped.
    c = _coordinator(3, settle=0.5, wait=3.0)
    blame = {0: _timeout(0, 2), 2: _timeout(2, 1)}
    c.report(order[0], blame[order[0]], now=10.0)
    c.settle(now=10.1, alive=_stopped(1))
    if order[0] == 2:  # rank 1 is silent: believed at once
        assert c.shutdown_reason == blame[2]
        return
    assert c.shutdown_reason is None and c.failures_pending
    c.settle(now=12.0, alive=_stopped(1))  # rank 2 is alive: wait for it (up to ``failure_wait``)
    assert c.shutdown_reason is None
    c.report(2, blame[2], now=12.5)
    c.settle(now=12.5, alive=_stopped(1))
    assert c.shutdown_reason == blame[2]


def test_an_unconfirmed_report_is_taken_after_the_wait():
    c = _coordinator(3, settle=0.5, wait=3.0)
    c.report(0, _timeout(0, 2), now=10.0)
    c.settle(now=12.9, alive=lambda r: True)
    assert c.shutdown_reason is None
    c.settle(now=13.1, alive=lambda r: True)
    assert c.shutdown_reason == _timeout(0, 2)


def test_an_exiting_complainer_is_not_a_suspect():
    c = _coordinator(4, settle=0.5)
    c.report(2, _timeout(2, 1), now=100.0)
    c.settle(now=100.2, alive=lambda r: True)
    assert c.shutdown_reason is None
    c.peer_lost(2, "rank 2 on host h exited or lost its connection")  # the complainer exits: expected
    c.settle(now=100.3, alive=lambda r: r not in (2,))
    assert c.shutdown_reason is None
    c.peer_lost(1, "rank 1 on host h exited or lost its connection")  # the suspect is gone: believed
    c.settle(now=100.4, alive=lambda r: r not in (1, 2))
    assert c.shutdown_reason == _timeout(2, 1)


def test_a_silent_rank_found_by_the_coordinator_is_a_suspect_not_a_complainer():
    c = _coordinator(3, settle=60.0, wait=60.0)
    c.report(2, _timeout(2, 0))  # ranks 0 and 2 each waited for the other (both waited for rank 1)
    c.report(0, _timeout(0, 2))
    c.settle(alive=_stopped(1))
    assert c.shutdown_reason is None
    c.peer_lost(1, "rank 1 on host h has been unresponsive for 3.2 s while other ranks waited for it")
    c.settle(alive=_stopped(1))
    assert c.shutdown_reason.startswith("rank 1 on host h has been unresponsive")


def test_without_a_believable_blame_the_first_report_wins():
    c = _coordinator(3, settle=0.1)
    c.report(1, collective_failure(1, PeerFailure(2, "connection closed by peer", closed=True)), now=5.0)
    c.report(2, "rank 2 on host h exited or lost its connection", now=5.05)
    c.settle(now=5.2, alive=lambda r: True)
    assert c.shutdown_reason.startswith("rank 1: collective failed: rank 2: connection closed")


def test_waiting_on_lists_ranks_missing_from_pending_tensors():
    c = _coordinator(3)
    c.submit(0, 0, None, [Request(RequestType.ALLREDUCE, 0, "t", F32, (4,))], [])
    c.submit(2, 0, None, [Request(RequestType.ALLREDUCE, 0, "t", F32, (4,))], [])
    assert c.waiting_on() == {1}
    c.submit(1, 0, None, [Request(RequestType.JOIN, 0, "join.noname")], [])
    assert c.waiting_on() == set()


# -- keep-alive clock and deadlines ----------------------------------------------------------------------

def test_peer_clock_does_not_count_stale_keepalives_as_fresh():
    clock = _PeerClock(now=0.0)
    for t in (1.0, 2.0, 3.0):  # read promptly: 2 ms in flight (and the peer's clock is 500 s behind)
        clock.heard(sent=t - 500.0, now=t + 0.002)
    assert clock.alive_at == pytest.approx(3.002, abs=1e-6)
    # The engine was busy for 10 s; the keep-alives sent meanwhile (the last at 6 s) are read at 13 s.
    for t in (4.0, 5.0, 6.0):
        clock.heard(sent=t - 500.0, now=13.0)
    assert clock.alive_at == pytest.approx(6.002, abs=0.01)
    assert 13.0 - clock.alive_at > 6.9  # silent for 7 s, not "just heard"


def test_deadline_defaults():
    assert liveness_deadline(RuntimeConfig()) == (30.0, "HOROVOD_GLOO_TIMEOUT_SECONDS")
    assert liveness_deadline(RuntimeConfig(op_timeout=3.0)) == (3.0, "HOROVOD_GLOO_TIMEOUT_SECONDS")
    assert liveness_deadline(RuntimeConfig(op_timeout=0.0)) == (300.0, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    assert liveness_deadline(RuntimeConfig(op_timeout=0.0, stall_shutdown_time=0.0)) == (None, "")


# -- transport: timeouts and closed connections ----------------------------------------------------------

def _pair(timeout: float) -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, 1, timeout), Channel(b, 0, timeout)


def test_exchange_timeout_names_the_peer_and_the_seconds():
    a, _b = _pair(0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerFailure) as info:
        exchange([], [Transfer(a, np.empty(10, np.uint8), lambda done: None)], 0.3)
    assert time.monotonic() - t0 < 2.0
    assert info.value.peer == 1 and "timed out after 0.3 s" in str(info.value) and not info.value.closed


def test_closed_peer_is_marked_closed():
    a, b = _pair(5.0)
    b.close()
    with pytest.raises(PeerFailure) as info:
        a.recv_buffer_into(np.empty(10, np.uint8))
    assert info.value.closed
    with pytest.raises(PeerFailure) as info:
        exchange([], [Transfer(a, np.empty(10, np.uint8), lambda done: None)], 5.0)
    assert info.value.closed


def test_exchange_without_timeout_waits():
    a, b = _pair(None)
    got = np.zeros(4, np.uint8)
    threading.Timer(0.3, lambda: b.send_buffer(np.arange(4, dtype=np.uint8))).start()
    exchange([], [Transfer(a, got, lambda done: None)], 0.0)  # 0: no deadline (it used to fail at once)
    assert got.tolist() == [0, 1, 2, 3]


# -- engines with a silent peer (two processes, real mesh) -----------------------------------------------

def _silent_peer(ctx: Ctx):
    """``ctx.args`` is the silent rank: connected, but without an engine (as if stopped)."""
    from horovod.runtime.engine import Engine, Topology

    if ctx.rank == ctx.args:
        ctx.store.get("silent.over", timeout=30)  # silent until the other rank has its outcome
        return None
    ctx.config.op_timeout = 1.0
    engine = Engine(Topology(ctx.rank, ctx.size), ctx.config, ctx.mesh)
    engine.start()
    t0 = time.monotonic()
    x = np.ones(4, np.float32)
    handle = engine.enqueue([(Request(RequestType.ALLREDUCE, 0, "x", F32, (4,)), x, None)])[0]
    try:
        handle.wait(timeout=20)
        return "no error", 0.0
    except Exception as e:  # noqa: BLE001 - the test checks the type
        return f"{type(e).__name__}: {e}", time.monotonic() - t0
    finally:
        engine.shutdown(timeout=5)
        ctx.store.put("silent.over", b"1")


@pytest.mark.parametrize("silent", [0, 1])
def test_silent_peer_ends_the_wait(silent):
    res = run_ranks(2, _silent_peer, silent, timeout=60)
    text, took = res[1 - silent][1]
    assert text.startswith("ShutdownError: Horovod has been shut down."), text
    who = "the coordinator (rank 0" if silent == 0 else "rank 1 on host"
    assert who in text and "has been unresponsive" in text, text
    assert 0.9 < took < 3.5, (took, text)
