"""Engine pieces without processes: the waiting caller's bounded spin, the wake pipe, handles that run rounds."""

from __future__ import annotations

import select
import threading
import time
import types

import numpy as np
import pytest

from horovod.base.config import RuntimeConfig
from horovod.base.exceptions import PreconditionError
from horovod.runtime.engine import Engine, Topology
from horovod.runtime.messages import Request, RequestType, dtype_code
from horovod.runtime.queue import TensorEntry, TensorQueue

F32 = dtype_code(np.float32)


def _spinner(spin_us: float = 200.0):
    return types.SimpleNamespace(_spin_time=spin_us * 1e-6, _spin_skip=0, _spin_backoff=1)


def test_spin_returns_what_arrives_while_it_polls():
    eng = _spinner()
    calls = []

    def poll(timeout):
        assert timeout == 0  # never sleeps
        calls.append(time.perf_counter())
        return [(5, 1)] if len(calls) == 3 else []

    assert Engine._spin(eng, poll) == [(5, 1)]
    assert len(calls) == 3 and (eng._spin_skip, eng._spin_backoff) == (0, 1)


def test_spin_is_bounded_and_backs_off_after_finding_nothing():
    eng = _spinner(spin_us=300.0)
    polls = []

    def empty(timeout):
        polls.append(timeout)
        return []

    t0 = time.perf_counter()
    assert Engine._spin(eng, empty) is None
    assert time.perf_counter() - t0 < 0.05 and polls  # bounded by the spin time (plus scheduling)
    # failures skip 1, 2, 4 ... waits before the next spin, up to 64
    skipped = []
    for _ in range(8):
        n = 0
        while True:
            before = len(polls)
            Engine._spin(eng, empty)
            if len(polls) > before:
                break
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 16, 32, 64, 64]
    # a success resets the backoff
    eng._spin_skip = 0
    assert Engine._spin(eng, lambda t: [(1, 1)]) == [(1, 1)]
    assert eng._spin_backoff == 1


def test_spin_disabled_by_zero():
    eng = _spinner(spin_us=0)
    assert Engine._spin(eng, lambda t: pytest.fail("polled")) is None


def test_drain_empties_the_pipe_it_was_poked_through():
    q = TensorQueue()
    try:
        e = TensorEntry(Request(RequestType.ALLREDUCE, 0, "x", F32, (1,)), np.zeros(1, np.float32), None, q)
        assert q.push_one(e) is None
        assert select.select([q.wake_fd], [], [], 0)[0]  # the engine thread would wake
        assert q.drain() == [e]
        assert not select.select([q.wake_fd], [], [], 0)[0]  # and not wake again for nothing
        assert q.drain() == []
    finally:
        q.close()


def test_push_without_waking_and_ensure_awake():
    q = TensorQueue()
    try:
        e = TensorEntry(Request(RequestType.ALLREDUCE, 0, "x", F32, (1,)), np.zeros(1, np.float32), None, q)
        assert q.push_one(e, wake=False) is None
        assert not select.select([q.wake_fd], [], [], 0)[0]  # the caller will run the round itself
        q.ensure_awake()  # ... but could not: now the engine thread is told
        assert select.select([q.wake_fd], [], [], 0)[0]
        q.mark_woken()
        assert q.drain() == [e]
        q.ensure_awake()  # nothing queued: no wake-up
        assert not select.select([q.wake_fd], [], [], 0)[0]
    finally:
        q.close()


def test_single_rank_engine_runs_rounds_in_the_waiting_thread():
    """With one rank a lone synchronous op never involves the engine thread: the caller runs the round."""
    eng = Engine(Topology(0, 1), RuntimeConfig())
    eng.start()
    try:
        threads = set()
        original = eng._round

        def round_(*a, **k):
            threads.add(threading.current_thread().name)
            return original(*a, **k)

        eng._round = round_
        for i in range(20):
            x = np.full(3, float(i), np.float32)
            h = eng.enqueue_one(Request(RequestType.ALLREDUCE, 0, f"x.{i}", F32, (3,), -1, 1), x, None, wake=False)
            assert h.wait(timeout=10).tolist() == [float(i)] * 3
        assert threads == {threading.current_thread().name}
        # an error answer reaches the waiting thread the same way
        h = eng.enqueue_one(Request(RequestType.ALLGATHER, 7, "bad set", F32, (3,)), np.zeros(3, np.float32),
                            None)
        with pytest.raises(PreconditionError, match="Process set provided does not exist"):
            h.wait(timeout=10)
    finally:
        eng.shutdown()
    assert eng.stopped.is_set()
