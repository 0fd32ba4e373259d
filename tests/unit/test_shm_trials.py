"""The shared-memory trials: which region size large allreduces keep, and whether plain arrays go member to
member or through the segments, chosen by measuring them.

The trial's bookkeeping is checked on its own; then real members (spawned processes, segments, token rounds)
run both trials with tiny sizes: every allreduce during and after a trial checked against numpy, every member
keeping the same choice, and a candidate made slow on purpose (a sleep) losing.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from transport_harness import Ctx, run_ranks

from horovod.base.config import EnvVarError, read_runtime_config
from horovod.transport.buffers import Pieces
from horovod.transport.communicator import ReduceOp
from horovod.transport.shm_trials import MARGIN, SAMPLES, WARMUP, Trial

REGIONS = (256, 512)  # bytes: a 4 KiB allreduce crosses 4-8 pieces at np=2


# --------------------------------------------------------------------------------------------- bookkeeping
def test_candidates_in_turn_after_the_warm_up_and_small_calls_left_out():
    trial = Trial((10, 20, 40), min_bytes=100, warmup=2, samples=2)
    assert trial.candidate_for(99) is None
    seen = [trial.candidate_for(100) for _ in range(8)]
    assert seen == [10, 10, 10, 20, 40, 10, 20, 40]
    assert trial.candidate_for(50) is None  # below min_bytes: not counted


def test_complete_once_every_candidate_has_its_samples_and_the_warm_up_is_not_recorded():
    trial = Trial((10, 20), min_bytes=1, warmup=1, samples=2)
    times = {10: [5.0, 1.0, 3.0], 20: [2.0, 4.0]}
    region = trial.candidate_for(1000)  # warm-up: its time is not kept
    trial.record(region, 100.0, 1000)
    done = []
    for _ in range(4):
        region = trial.candidate_for(1000)
        trial.record(region, times[region].pop(0), 1000)
        done.append(trial.complete)
    assert done == [False, False, False, True]
    np.testing.assert_allclose(trial.medians(), [np.median([5.0, 1.0]) / 1000, np.median([2.0, 4.0]) / 1000])


@pytest.mark.parametrize("summed, want", [
    ([1.0, 0.5], 20),  # much faster: taken
    ([1.0, 1.0 - MARGIN / 2], 10),  # within the margin: the default stays
    ([1.0, 1.2], 10),
    ([1.0, 1.2, 0.9], 40),
])
def test_choice_keeps_the_default_unless_another_is_clearly_faster(summed, want):
    trial = Trial((10, 20, 40)[:len(summed)], min_bytes=1)
    assert trial.choose(np.array(summed)) == want


def test_a_trial_needs_two_candidates():
    with pytest.raises(ValueError, match="two candidates"):
        Trial((10,), min_bytes=1)


# --------------------------------------------------------------------------------------------- the knob
def test_configured_region_fixes_it_and_bad_values_are_refused():
    assert read_runtime_config({}).shm_region_bytes == 0
    assert read_runtime_config({"HOROVOD_SHM_REGION_BYTES": "2097152"}).shm_region_bytes == 2 * 1024 * 1024
    for bad in ("2MB", "-1", "100", str(64 * 1024 * 1024)):
        with pytest.raises(EnvVarError, match="HOROVOD_SHM_REGION_BYTES"):
            read_runtime_config({"HOROVOD_SHM_REGION_BYTES": bad})


def test_default_regions_fit_the_largest_piece():
    from horovod.transport.shm import MAX_PIECE_BYTES, REGION_CHOICES, _default_regions

    assert _default_regions(2, None, 0) == list(REGION_CHOICES)
    assert _default_regions(4, None, 0) == list(REGION_CHOICES)
    assert _default_regions(5, None, 0) == [REGION_CHOICES[0]]  # 2 MiB x 5 is beyond the largest piece
    assert _default_regions(16, None, 0) == [MAX_PIECE_BYTES // 16]
    assert _default_regions(2, None, 4096) == [4096]
    assert _default_regions(2, 1024, 0) == [512]


# --------------------------------------------------------------------------------------------- real members
def _trial_run(ctx: Ctx) -> dict:
    """Allreduces through the segments of varied sizes (plain arrays and Pieces, in place and not) until the
    trial decides and a few after; each checked against numpy.  ``slow``: a region whose token rounds sleep."""
    from horovod.transport.shm import ShmCommunicator

    slow, fixed = ctx.args
    comm = ShmCommunicator(ctx.mesh, list(range(ctx.size)), ctx.config, regions=[fixed] if fixed else REGIONS,
                           small_bytes=0, cross_memory=False)
    me, size = comm.rank, comm.size
    current = [None]
    if comm._region_trial is not None:
        candidate_for, signal = comm._region_trial.candidate_for, comm._signal

        def tracked(nbytes: int):
            current[0] = candidate_for(nbytes)
            return current[0]

        def slowed() -> None:
            if current[0] == slow:
                time.sleep(0.003)
            signal()

        comm._region_trial.candidate_for, comm._signal = tracked, slowed
    min_bytes = 2 * max(REGIONS) * size
    calls = WARMUP + SAMPLES * len(REGIONS)
    decided_after = None
    bad = []
    for call in range(calls + 4):
        n = min_bytes // 4 + 37 * (call % 3)  # float32: every call times the trial, sizes not a piece's multiple
        current[0] = None
        ins = [np.random.default_rng(100 * call + r).integers(-8, 8, n).astype(np.float32) for r in range(size)]
        want = np.sum(ins, axis=0, dtype=np.float32)
        if call % 2:
            cuts = [1, 5, n // 3, n // 2]
            out = np.empty(n, np.float32)
            comm.allreduce_scaled(Pieces(np.split(ins[me].copy(), cuts)), out, ReduceOp.SUM, 1.0)
        else:
            out = ins[me].copy()
            comm.allreduce(out, out, ReduceOp.SUM)
        if not np.array_equal(out, want):
            bad.append(call)
        small = np.full(7, float(me), np.float32)  # a small one in between: not part of the trial
        comm.allreduce(small, small, ReduceOp.SUM)
        if decided_after is None and comm._region_trial is None:
            decided_after = call + 1
    return {"bad": bad, "region": comm.large_region_bytes, "decided_after": decided_after}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("slow, want", [(REGIONS[0], REGIONS[1]), (REGIONS[1], REGIONS[0])])
def test_members_keep_the_faster_region_together(size, slow, want):
    res = run_ranks(size, _trial_run, (slow, None), timeout=90)
    for _, r, _ in res.values():
        assert r["bad"] == [], f"wrong sums in calls {r['bad']}"
        assert r["region"] == want
        assert r["decided_after"] == WARMUP + SAMPLES * len(REGIONS)


def test_a_configured_region_runs_no_trial():
    res = [r for _, r, _ in run_ranks(2, _trial_run, (REGIONS[0], 1024), timeout=60).values()]
    assert [r["region"] for r in res] == [1024, 1024]
    assert all(r["bad"] == [] and r["decided_after"] == 1 for r in res)  # no trial from the first call


# --------------------------------------------------------------------------------------------- mismatches
def _mismatched(ctx: Ctx) -> str:
    from horovod.base.exceptions import WireError
    from horovod.transport.shm import ShmCommunicator

    regions = REGIONS if ctx.rank == 0 else REGIONS[1:]
    comm = ShmCommunicator(ctx.mesh, list(range(ctx.size)), ctx.config, regions=regions, small_bytes=0,
                           cross_memory=False)
    buf = np.ones(4096, np.float32)
    try:
        comm.allreduce(buf, buf, ReduceOp.SUM)
    except WireError as e:
        return str(e)
    return "no error"


def test_members_that_disagree_on_regions_fail_with_the_knob_named():
    res = run_ranks(2, _mismatched, timeout=60)
    for rank, (_, msg, _) in res.items():
        assert "HOROVOD_SHM_REGION_BYTES must be the same on every rank" in msg, msg
        assert f"rank {1 - rank} divides shared-memory allreduces into regions of" in msg


SCRIPT = """
import os, numpy as np
if os.environ["HOROVOD_RANK"] == "1":
    os.environ["HOROVOD_SHM_REGION_BYTES"] = "65536"  # a careless per-rank setting
import horovod.numpy as hvd
hvd.init()
x = hvd.allreduce(np.ones(1 << 22, np.float32), name="big")
print("ALLREDUCED", float(x[0]), flush=True)
"""


def test_a_rank_with_another_region_setting_stops_the_job_with_a_clear_error(tmp_path):
    from launch_util import clean_env, launch, marked_processes

    script = tmp_path / "mismatch.py"
    script.write_text(SCRIPT)
    code, out, marker = launch(2, [sys.executable, str(script)], env=clean_env(HOROVOD_SHM_CROSS_MEMORY="0"),
                               timeout=60)
    assert code not in (None, 0), out
    assert "ALLREDUCED" not in out
    assert out.count("HOROVOD_SHM_REGION_BYTES must be the same on every rank") >= 2, out  # both ranks say so
    assert not marked_processes(marker)


# --------------------------------------------------------------------------------------------- member to member
def _path_run(ctx: Ctx) -> dict:
    """Plain float32 allreduces of varied sizes (in place and not) through the path trial, a sleep added to
    ``slow`` (direct or segments); each checked against numpy."""
    from horovod.transport.shm import ShmCommunicator

    slow = ctx.args
    comm = ShmCommunicator(ctx.mesh, list(range(ctx.size)), ctx.config, piece_bytes=1024, small_bytes=0,
                           direct_min_bytes=2048, direct_chunk_bytes=256)
    comm._ready()
    if comm._cma is None:
        return {"skip": "this host refused cross-memory copies"}
    me, size = comm.rank, comm.size
    paths = []

    def slowed(real, name):
        def run(*a):
            paths.append(name)
            if name == slow:
                time.sleep(0.003)
            return real(*a)
        return run

    comm._allreduce_direct = slowed(comm._allreduce_direct, "direct")
    comm._allreduce_segments = slowed(comm._allreduce_segments, "segments")
    calls = WARMUP + SAMPLES * 2
    bad, decided_after = [], None
    for call in range(calls + 4):
        n = 512 + 37 * (call % 3)  # 2048+ bytes: every call is part of the trial
        ins = [np.random.default_rng(100 * call + r).integers(-8, 8, n).astype(np.float32) for r in range(size)]
        want = np.sum(ins, axis=0, dtype=np.float32)
        out = ins[me].copy() if call % 2 else np.empty(n, np.float32)
        comm.allreduce(out if call % 2 else ins[me].copy(), out, ReduceOp.SUM)
        if not np.array_equal(out, want):
            bad.append(call)
        if decided_after is None and comm.direct_for(n * 4) is not None:
            decided_after = call + 1
    other = comm.direct_for(1 << 20)  # another size class: measured on its own, not yet
    return {"bad": bad, "direct": comm.direct_for(2048), "decided_after": decided_after, "paths": paths,
            "other": other}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("slow, want_direct", [("direct", False), ("segments", True)])
def test_members_keep_the_faster_path_together(size, slow, want_direct):
    res = run_ranks(size, _path_run, slow, timeout=90)
    for _, r, _ in res.values():
        if "skip" in r:
            pytest.skip(r["skip"])
        assert r["bad"] == [], f"wrong sums in calls {r['bad']}"
        assert r["direct"] is want_direct and r["other"] is None
        assert r["decided_after"] == WARMUP + SAMPLES * 2
        trial = r["paths"][:WARMUP + SAMPLES * 2]  # the default in the warm-up, then both in turn
        assert trial == ["direct"] * WARMUP + ["direct", "segments"] * SAMPLES
        after = set(r["paths"][WARMUP + SAMPLES * 2:])
        assert after == {"direct" if want_direct else "segments"}
