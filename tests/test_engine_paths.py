"""The engine's fast paths under the launcher: what a user sees must not change with them.

* every tensor of every step still shows its negotiation (with each rank's tick) and its processing in the
  timeline, whether it was fused, reduced by the coordinator or sent alone, and whether it travelled as a
  cache id or in full;
* a waiting caller runs the engine's rounds itself: an exception from a signal handler while it sleeps leaves
  the engine intact, one that cuts a round short ends the job with that cause (never a hang);
* threads that enqueue and wait at the same time (some driving, some waiting for the engine thread) all get
  their own, correct results, and a thread that only polls is served while another drives;
* control frames never deadlock a collective: neither a rank blocked sending to a rank 0 that waits for it,
  nor a rank that missed the tail of rank 0's answer; a rank that never reads fails the job in seconds;
* repeated steps are right whether the coordinator replays them whole (batched alike on every rank) or some
  rank splits its batch (the general path), at np=2/3/4.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections import Counter, defaultdict

import pytest
from launch_util import clean_env, launch, marked_processes

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

PRELUDE = """\
import json, os, signal, sys, threading, time
import numpy as np
import horovod.numpy as hvd
OUT = sys.argv[1]

def report(**kw):
    with open(os.path.join(OUT, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(kw, f)
"""


def _run(tmp_path, np_, body, timeout=120.0, **env):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    code, out, marker = launch(np_, [sys.executable, str(script), str(tmp_path)], env=clean_env(**env),
                               timeout=timeout)
    assert not marked_processes(marker), "processes left behind"
    assert code is not None, f"the job did not finish within {timeout:.0f} s:\n{out}"
    reports = {}
    for r in range(np_):
        p = tmp_path / f"rank{r}.json"
        if p.exists():
            reports[r] = json.loads(p.read_text())
    return code, out, reports


def timeline_rows(path) -> dict[str, list[dict]]:
    """The timeline file's begin/end/tick events per row (tensor) name, in file order (valid JSON as written)."""
    records = json.loads(path.read_text())
    pid_name = {r["pid"]: r["args"]["name"] for r in records if r.get("name") == "process_name" and r["pid"]}
    events = defaultdict(list)
    for r in records:
        if r.get("ph") in ("B", "E", "X") and r.get("pid") in pid_name:
            events[pid_name[r["pid"]]].append(r)
    return events


def assert_allreduce_row(events: dict[str, list[dict]], row: str, steps: int, ranks: int = 2) -> None:
    """``row`` shows ``steps`` negotiations (a tick of every rank each) and ``steps`` allreduces, bars balanced."""
    evs = events[row]
    begins = Counter(e["name"] for e in evs if e["ph"] == "B")
    ticks = Counter(e["name"] for e in evs if e["ph"] == "X")
    assert begins["NEGOTIATE_ALLREDUCE"] == steps and begins["ALLREDUCE"] == steps, (row, begins)
    assert ticks == {str(r): steps for r in range(ranks)}, (row, ticks)
    assert sum(begins.values()) == sum(1 for e in evs if e["ph"] == "E"), (row, "unbalanced bars")


STEPS = 4


def test_timeline_shows_every_tensor_of_every_step(tmp_path):
    timeline = tmp_path / "timeline.json"
    body = f"""
        hvd.init()
        n = hvd.size()
        small = [np.full(256, float(i), np.float32) for i in range(40)]   # 1 KiB: reduced by the coordinator
        big = [np.full(50_000, float(i), np.float32) for i in range(3)]   # 200 KB: fused on the data plane
        for step in range({STEPS}):
            xs = [x.copy() for x in small + big]
            names = [f"small.{{i}}" for i in range(40)] + [f"big.{{i}}" for i in range(3)]
            handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=k) for x, k in zip(xs, names)]
            for h in handles:
                hvd.synchronize(h)
            for x, orig in zip(xs, small + big):
                assert np.array_equal(x, orig * n), (step, x[:3], orig[:3])
            assert hvd.allreduce(np.ones(3), op=hvd.Sum, name="lone").tolist() == [float(n)] * 3
            assert hvd.allgather(np.full(2, hvd.rank()), name="gather").tolist() == [r for r in range(n) for _ in "ab"]
            assert hvd.broadcast(np.full(3, hvd.rank() + step), 1, name="bcast").tolist() == [1 + step] * 3
        hvd.barrier()
        report(ok=True)
    """
    code, out, reports = _run(tmp_path, 2, body, HOROVOD_TIMELINE=str(timeline))
    assert code == 0, out
    assert set(reports) == {0, 1}, out
    events = timeline_rows(timeline)
    names = [f"small.{i}" for i in range(40)] + [f"big.{i}" for i in range(3)] + ["lone"]
    fused_somewhere = False
    for name in names:
        evs = sorted(events[name], key=lambda e: e["ts"])
        begins = Counter(e["name"] for e in evs if e["ph"] == "B")
        ticks = Counter(e["name"] for e in evs if e["ph"] == "X")
        assert begins["NEGOTIATE_ALLREDUCE"] == STEPS, (name, begins)
        assert begins["ALLREDUCE"] == STEPS, (name, begins)
        assert ticks == {"0": STEPS, "1": STEPS}, (name, ticks)  # every rank's readiness, every step
        assert sum(begins.values()) == sum(1 for e in evs if e["ph"] == "E"), (name, "unbalanced bars")
        # each step: negotiation ends before processing starts, and processing ends with dtype and shape
        depth, top = 0, []
        for e in evs:
            if e["ph"] == "B":
                if depth == 0:
                    top.append(e["name"])
                depth += 1
            elif e["ph"] == "E":
                depth -= 1
                if depth == 0 and top[-1] == "ALLREDUCE":
                    assert e["args"]["dtype"] == ("float64" if name == "lone" else "float32"), e
        assert top == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"] * STEPS, (name, top)
        if name.startswith("big."):
            assert begins["GLOO_ALLREDUCE"] == STEPS, (name, begins)
            fused_somewhere |= begins["MEMCPY_IN_FUSION_BUFFER"] > 0
    assert fused_somewhere, "the large tensors were never fused"
    for name, op, inner in (("gather", "ALLGATHER", "GLOO_ALLGATHER"), ("bcast", "BROADCAST", "GLOO_BCAST")):
        evs = sorted(events[name], key=lambda e: e["ts"])
        phases = [e["name"] for e in evs if e["ph"] == "B"]
        assert phases == [f"NEGOTIATE_{op}", op, inner] * STEPS, (name, phases)  # the transport's part nested
        assert len(phases) == sum(1 for e in evs if e["ph"] == "E"), (name, "unbalanced bars")


def test_an_interrupted_wait_leaves_the_engine_intact(tmp_path):
    body = """
        from horovod.common import ops

        class Tick(Exception):
            pass

        def on_alarm(*_):
            raise Tick()

        hvd.init()
        hvd.allreduce(np.ones(2), name="warmup")
        if hvd.rank() == 1:
            time.sleep(1.5)
        h = ops.allreduce(np.ones(4, np.float32), name="late", op=hvd.Sum)
        interrupted = 0
        if hvd.rank() == 0:  # the alarm fires while this thread waits for rank 1 (in the engine's poll)
            signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, 0.4)
            try:
                h.wait()
            except Tick:
                interrupted += 1
        out = h.wait()
        assert out.tolist() == [2.0] * 4, out
        for i in range(50):
            assert hvd.allreduce(np.full(3, float(i)), op=hvd.Sum, name=f"after.{i}").tolist() == [2.0 * i] * 3
        report(ok=True, interrupted=interrupted)
    """
    code, out, reports = _run(tmp_path, 2, body)
    assert code == 0, out
    assert reports[0] == {"ok": True, "interrupted": 1}, out
    assert reports[1] == {"ok": True, "interrupted": 0}, out


def test_an_interrupt_inside_a_round_ends_the_job_with_its_cause(tmp_path):
    body = """
        from horovod.runtime import executor

        hvd.init()
        hvd.allreduce(np.ones(2), name="warmup")
        if hvd.rank() == 1:  # the next round run by this (waiting) thread is cut short, as by Ctrl-C
            original = executor.Executor.execute

            def cut(self, resp):
                if threading.current_thread() is threading.main_thread():
                    executor.Executor.execute = original
                    raise KeyboardInterrupt
                return original(self, resp)

            executor.Executor.execute = cut
        t0 = time.monotonic()
        seen = []
        for i in range(200):
            try:
                hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"op.{i}")
            except BaseException as e:  # noqa: BLE001 - the test records what the user sees
                seen.append(f"{type(e).__name__}: {e}")
                if len(seen) == 2:
                    break
        report(seen=seen, elapsed=time.monotonic() - t0)
    """
    code, out, reports = _run(tmp_path, 2, body, timeout=90.0)
    assert set(reports) == {0, 1}, out
    cause = "rank 1: KeyboardInterrupt interrupted the engine in the middle of its work"
    r1 = reports[1]["seen"]
    assert r1[0] == "KeyboardInterrupt: ", r1
    assert r1[1].startswith("ShutdownError: Horovod has been shut down.") and cause in r1[1], r1
    r0 = reports[0]["seen"]
    assert r0 and all(s.startswith("ShutdownError: Horovod has been shut down.") and cause in s for s in r0), r0
    assert reports[0]["elapsed"] < 30 and reports[1]["elapsed"] < 30


def test_threads_enqueue_and_wait_at_once(tmp_path):
    body = """
        from horovod.common import ops

        hvd.init()
        n, r = hvd.size(), hvd.rank()
        errors = []

        def work(t):
            try:
                for i in range(150):
                    x = np.full(17 + t, float(i + t), np.float32)
                    kind = (i + t) % 3
                    if kind == 0:  # synchronous: this thread runs the engine's rounds itself
                        out = hvd.allreduce(x, op=hvd.Sum, name=f"t{t}.s{i}")
                        assert out.tolist() == (x * n).tolist(), (t, i)
                    elif kind == 1:  # a burst of async ops, then waits
                        hs = [hvd.allreduce_async(x + k, op=hvd.Sum, name=f"t{t}.a{i}.{k}") for k in range(5)]
                        for k, h in enumerate(hs):
                            assert hvd.synchronize(h).tolist() == ((x + k) * n).tolist(), (t, i, k)
                    else:  # an in-place op waited for with a deadline
                        y = x.copy()
                        h = ops.allreduce(y, y, name=f"t{t}.i{i}", op=hvd.Sum)
                        h.wait(timeout=60)
                        assert y.tolist() == (x * n).tolist(), (t, i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        work(4)
        for th in threads:
            th.join(120)
        report(errors=errors, alive=sum(th.is_alive() for th in threads))
    """
    code, out, reports = _run(tmp_path, 3, body, timeout=240.0)
    assert code == 0, out
    for r in range(3):
        assert reports[r] == {"errors": [], "alive": 0}, (r, reports[r])


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_control_frames_never_wait_for_a_rank_inside_a_collective(tmp_path, np_):
    """A rank's control frames must not wait for rank 0 to read them: rank 0 reads control frames only
    between collectives, so a rank blocked in sending requests (its socket buffer full) while rank 0 waits
    for it inside a collective is a deadlock.  ``HOROVOD_CYCLE_TIME=0`` makes one frame per enqueued tensor
    (each carrying a 16 KiB tensor inline): before the outbox this job hung in its first steps (rank 0
    timed out in the collective, rank 1 sat in ``sendall``)."""
    body = """
        hvd.init()
        n, r = hvd.size(), hvd.rank()
        bad, start = [], time.monotonic()
        for step in range(25):
            xs = [np.arange(4096, dtype=np.float32) * (r + 1) + (step * 100 + i) for i in range(100)]
            hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"burst.{i}") for i, x in enumerate(xs)]
            for i, h in enumerate(hs):
                want = np.arange(4096, dtype=np.float64) * (n * (n + 1) / 2) + n * (step * 100 + i)
                if not np.array_equal(hvd.synchronize(h), want.astype(np.float32)):
                    bad.append((step, i))
        report(bad=bad, elapsed=time.monotonic() - start)
    """
    code, out, reports = _run(tmp_path, np_, body, timeout=120.0, HOROVOD_CYCLE_TIME="0",
                              HOROVOD_GLOO_TIMEOUT_SECONDS="20")
    assert code == 0, out
    for r in range(np_):
        assert reports[r]["bad"] == [], (r, reports[r]["bad"][:5])
        assert reports[r]["elapsed"] < 20, reports[r]


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_repeated_steps_batched_alike_or_not_give_every_rank_the_right_sums(tmp_path, np_):
    """A step that repeats the last one, batched alike on every rank, is replayed by the coordinator as a
    whole; batched differently (a rank pauses among its enqueues: its batch splits), its tensors go the
    general way, and a replay some ranks sent waits for the others without a hang.  Small tensors travel
    inline, bigger ones through the data plane, and a process set of all ranks but the last replays too."""
    body = """
        from horovod.common.basics import engine
        hvd.init()
        n, r = hvd.size(), hvd.rank()
        sub = hvd.add_process_set(list(range(n - 1))) if n > 2 else None
        rng = np.random.default_rng(r)
        sizes = [64 if i % 3 else 20_000 for i in range(160)]  # a real model's count of parameter tensors
        bad, replays = [], 0
        for step in range(40):
            pause = step % 4 == 3 and rng.random() < 0.7  # some steps: this rank splits its batch
            xs = [np.arange(k, dtype=np.float32) + (r + 1) * (step + i) for i, k in enumerate(sizes)]
            hs = []
            for i, x in enumerate(xs):
                hs.append(hvd.allreduce_async(x, op=hvd.Sum, name=f"rep.{i}"))
                if pause and i == int(rng.integers(1, 159)):
                    time.sleep(0.01)
            sh = None
            if sub is not None and r in sub.ranks:
                sh = hvd.allreduce_async(np.full(5, float(r + step), np.float32), op=hvd.Sum, name="sub",
                                         process_set=sub)
            for i, h in enumerate(hs):
                want = np.arange(sizes[i], dtype=np.float64) * n + n * (n + 1) / 2 * (step + i)
                if not np.array_equal(hvd.synchronize(h), want.astype(np.float32)):
                    bad.append((step, i))
            if sh is not None and not np.array_equal(hvd.synchronize(sh), np.full(
                    5, sum(q + step for q in sub.ranks), np.float32)):
                bad.append((step, "sub"))
        if r == 0:
            replays = len(engine().coordinator._replays)
        hvd.barrier()
        report(bad=bad, replays=replays)
    """
    code, out, reports = _run(tmp_path, np_, body, timeout=120.0, HOROVOD_GLOO_TIMEOUT_SECONDS="20",
                              HOROVOD_DYNAMIC_PROCESS_SETS="1")
    assert code == 0, out
    for r in range(np_):
        assert reports[r]["bad"] == [], (r, reports[r]["bad"][:5])
    assert reports[0]["replays"] >= 1, reports[0]


_BUSY_RANK_BODY = """
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    pids = hvd.allgather_object(os.getpid())
    xs = [np.full(4096, float(i + r), np.float32) for i in range(600)]
    big = np.arange(1_000_000, dtype=np.float32) + r

    def enqueue():
        hs = []
        for i, x in enumerate(xs):  # one at a time: each request leaves alone, its tensor inline
            hs.append(hvd.allreduce_async(x, op=hvd.Sum, name=f"small.{i}"))
            time.sleep(0.001)
        return hs, hvd.allreduce_async(big, op=hvd.Sum, name="big")

    if r == 1:
        hs, hb = enqueue()
        time.sleep(0.3)  # the last requests leave
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until rank 1 is stopped: every answer to it stays unread
            with open(f"/proc/{pids[1]}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in "Tt":
                    break
            time.sleep(0.01)
        if r == 2 and RESUME:
            threading.Timer(2.0, os.kill, (pids[1], signal.SIGCONT)).start()
        hs, hb = enqueue()
    start = time.monotonic()
    try:
        bad = [i for i, h in enumerate(hs) if not np.array_equal(hvd.synchronize(h),
               np.full(4096, n * i + n * (n - 1) / 2, np.float32))]
        ok_big = np.array_equal(hvd.synchronize(hb), np.arange(1_000_000, dtype=np.float64) * n + n * (n - 1) / 2)
        report(bad=bad, ok_big=bool(ok_big), waited=time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - reported, then the rank fails as a user's would
        report(error=f"{type(e).__name__}: {e}", waited=time.monotonic() - start)
        raise
"""


def test_rank_0_completes_its_answer_to_a_busy_rank_before_waiting_for_it(tmp_path):
    """Rank 0's answers to a rank that does not read (here: stopped for 2 s, as a rank busy in a long
    collective of other ranks would be) fill that rank's socket and the rest waits in rank 0's outbox.  If
    rank 0 then entered the next collective with that rank, the rank would never learn of it (rank 0
    flushes between collectives): rank 0 must first deliver the whole answer.  One tensor per request frame
    (``HOROVOD_CYCLE_TIME=0``), each 16 KiB travelling inline, makes ~10 MB of answers."""
    code, out, reports = _run(tmp_path, 3, "    RESUME = True\n" + _BUSY_RANK_BODY, timeout=120.0,
                              HOROVOD_CYCLE_TIME="0", HOROVOD_GLOO_TIMEOUT_SECONDS="15")
    assert code == 0, out
    for r in range(3):
        assert reports[r]["bad"] == [] and reports[r]["ok_big"], (r, reports[r])
        assert reports[r]["waited"] < 12, reports[r]


def test_a_rank_that_never_reads_its_answers_fails_the_job_in_seconds(tmp_path):
    """The same rank stopped for good: rank 0 waits for it to take the answer frames at most the collective
    timeout, then the job ends with a cause naming it on the other ranks (no hang, nothing left behind)."""
    code, out, reports = _run(tmp_path, 3, "    RESUME = False\n" + _BUSY_RANK_BODY, timeout=120.0,
                              HOROVOD_CYCLE_TIME="0", HOROVOD_GLOO_TIMEOUT_SECONDS="4")
    assert code != 0
    for r in (0, 2):
        error = reports[r]["error"]
        assert error.startswith("ShutdownError") and "rank 1" in error, (r, error)
        assert reports[r]["waited"] < 15, reports[r]


@pytest.mark.parametrize("cycle", ["1", "0"])
def test_a_polling_thread_is_served_while_another_thread_drives(tmp_path, cycle):
    """One thread keeps running the engine's rounds (back-to-back synchronous ops) while another only
    enqueues and polls.  The engine thread goes back to sleep while a caller drives (``queue.park``), and the
    driving caller wakes it after releasing the lock when entries are left: an entry queued at the end of a
    drive must not wait for the next keep-alive (1 s) -- every polled op completes within a fraction of it."""
    body = """
        hvd.init()
        n, r = hvd.size(), hvd.rank()
        errors = []

        def driver():
            try:
                for i in range(1500):
                    out = hvd.allreduce(np.full(10, 1.0, np.float32), op=hvd.Sum, name=f"d.{i % 50}")
                    assert out[0] == n, out
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        th = threading.Thread(target=driver)
        th.start()
        lat = []
        for k in range(300):
            h = hvd.allreduce_async(np.full(5, float(k), np.float32), op=hvd.Sum, name=f"p.{k % 20}")
            t = time.monotonic()
            while not hvd.poll(h) and time.monotonic() - t < 30:
                time.sleep(0.0002)
            lat.append(time.monotonic() - t)
            if hvd.synchronize(h)[0] != n * k:
                errors.append(f"op {k}")
            time.sleep(0.001 * (k % 3))
        th.join(60)
        report(errors=errors, alive=th.is_alive(), worst=max(lat))
    """
    code, out, reports = _run(tmp_path, 3, body, timeout=120.0, HOROVOD_CYCLE_TIME=cycle)
    assert code == 0, out
    for r in range(3):
        assert reports[r]["errors"] == [] and not reports[r]["alive"], (r, reports[r])
        assert reports[r]["worst"] < 0.5, (r, reports[r])
