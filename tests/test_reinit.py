"""Generations of init()/shutdown() under the launcher: cycles in lockstep, shutdowns that meet waiting
peers, and ranks that disagree about the generation.

The lockstep cycles are tests/parallel/test_reinit.py at np=2/3/4.  The other tests launch a small script
(not in lockstep) and check what every rank reported, how fast, and that nothing was left behind.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from launch_util import clean_env, launch, marked_processes

from horovod.common.basics import NOT_INITIALIZED
from horovod.common.exceptions import SHUT_DOWN_MESSAGE

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

TIMEOUT = 150.0


@pytest.mark.parametrize("np_", [2, 4])
def test_reinit_cycles_in_lockstep(np_):
    path = os.path.join("tests", "parallel", "test_reinit.py")
    code, out, marker = launch(np_, [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", path],
                               env=clean_env(OMP_NUM_THREADS="1"), timeout=TIMEOUT)
    leftovers = marked_processes(marker)
    if code != 0 or leftovers:
        print(out)
    assert code is not None, f"-np {np_} did not finish within {TIMEOUT:.0f} s"
    assert code == 0, f"-np {np_} failed (exit status {code}); output above"
    assert not leftovers, f"processes left behind: {leftovers}"


def _run(tmp_path, np_, body, timeout=90.0, **env):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""\
        import json, os, sys, time
        import numpy as np
        import horovod.numpy as hvd
        from horovod.common import basics
        OUT = sys.argv[1]
        RANK = int(os.environ["HOROVOD_RANK"])

        def report(**kw):
            with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
                json.dump(kw, f)

        def attempt(fn):
            t0 = time.monotonic()
            try:
                fn()
                return {"ok": True, "elapsed": time.monotonic() - t0}
            except Exception as e:
                return {"error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - t0}
        """) + textwrap.dedent(body))
    code, out, marker = launch(np_, [sys.executable, str(script), str(tmp_path)], env=clean_env(**env),
                               timeout=timeout)
    leftovers = marked_processes(marker)
    print(out)
    assert code is not None, f"the job did not finish within {timeout} s"
    assert not leftovers, f"processes left behind: {leftovers}"
    reports = {}
    for r in range(np_):
        p = tmp_path / f"rank{r}.json"
        if p.exists():
            reports[r] = json.loads(p.read_text())
    return code, out, reports


@pytest.mark.parametrize("quitter", [0, 1])
def test_shutdown_while_peers_wait_in_a_collective(tmp_path, quitter):
    """One rank shuts down while the others wait in an allreduce: they end with ShutdownError in seconds,
    naming the rank that shut down; the quitter's own later collective fails as before init(), with upstream's
    not-initialized text (its horovod_shutdown() clears initialization_done)."""
    body = f"""
        hvd.init()
        hvd.allreduce(np.ones(2), name="warm")
        if RANK == {quitter}:
            time.sleep(1.0)  # the others are inside their allreduce by now
            t0 = time.monotonic()
            hvd.shutdown()
            shut = time.monotonic() - t0
            res = attempt(lambda: hvd.allreduce(np.ones(2), name="late"))
            res["shutdown_s"] = shut
        else:
            res = attempt(lambda: hvd.allreduce(np.ones(2), name="waits"))
        report(**res)
        """
    code, _, reports = _run(tmp_path, 3, body)
    assert code == 0
    assert sorted(reports) == [0, 1, 2]
    for r, rep in reports.items():
        if r == quitter:
            assert (rep.get("type"), rep.get("error")) == ("ValueError", NOT_INITIALIZED), rep
            assert rep["elapsed"] < 1.0 and rep["shutdown_s"] < 8.0, rep
        else:
            assert rep.get("type") == "ShutdownError", (r, rep)
            assert rep["error"].startswith(SHUT_DOWN_MESSAGE), rep
            assert rep["error"].endswith(f"Cause: rank {quitter} called shutdown()"), rep
            assert rep["elapsed"] < 1.0 + 8.0, rep  # 1 s before the shutdown, then seconds at most


def test_rank_in_another_generation_is_named(tmp_path):
    """Rank 1 re-initialises, rank 0 does not: rank 0's collectives of the old generation fail at once
    (also after a no-op init()), and rank 1's init() names both generations within the start timeout
    (rank 0 stays alive meanwhile: once its process exits, horovodrun's exit record names that instead)."""
    body = """
        hvd.init()
        hvd.allreduce(np.ones(2), name="warm")
        if RANK == 1:
            hvd.shutdown()
            res = attempt(hvd.init)
        else:
            time.sleep(1.0)
            first = attempt(lambda: hvd.allreduce(np.ones(2), name="old.generation"))
            hvd.init()  # no-op: this rank never called shutdown(), it is still in generation 1
            second = attempt(lambda: hvd.allreduce(np.ones(2), name="still.old"))
            res = {"first": first, "second": second, "initialized": hvd.is_initialized(),
                   "generation": basics.generation()}
        report(**res)
        deadline = time.monotonic() + 30
        while RANK == 0 and not os.path.exists(os.path.join(OUT, "rank1.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        """
    code, _, reports = _run(tmp_path, 2, body, HOROVOD_START_TIMEOUT="6")
    assert sorted(reports) == [0, 1]
    r0, r1 = reports[0], reports[1]
    for res in (r0["first"], r0["second"]):
        assert res.get("type") == "ShutdownError" and res["error"].endswith("Cause: rank 1 called shutdown()")
        assert res["elapsed"] < 1.0, res
    assert r0["initialized"] is True and r0["generation"] == 1
    assert r1.get("type") == "GenerationMismatch", r1
    assert "rank 0 is at generation 1" in r1["error"] and "rank 1 waited 6 s at generation 2" in r1["error"]
    assert 5.0 <= r1["elapsed"] < 6.0 + 10.0, r1


def test_failed_init_on_one_rank_ends_the_others_at_once(tmp_path):
    """Rank 2 passes other process sets: rank 1 (whose comparison with rank 0 passed) does not wait for the
    start timeout but fails at once with rank 0's cause."""
    body = """
        sets = [hvd.ProcessSet([0, 1])] if RANK == 2 else [hvd.ProcessSet([0, 2])]
        report(**attempt(lambda: hvd.init(process_sets=sets)))
        """
    code, _, reports = _run(tmp_path, 3, body, HOROVOD_START_TIMEOUT="60")
    assert sorted(reports) == [0, 1, 2]
    for r in (0, 2):
        assert reports[r].get("type") == "ValueError" and "different process_sets" in reports[r]["error"]
    r1 = reports[1]
    assert r1.get("type") == "GenerationMismatch", r1
    assert "rank 0 failed to initialize generation 1: ValueError" in r1["error"], r1
    assert r1["elapsed"] < 20.0, r1  # far below the 60 s start timeout
