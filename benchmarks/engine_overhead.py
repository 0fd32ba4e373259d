"""Per-tensor cost of the engine: many small tensors in flight, np=2 under the launcher.

    python benchmarks/engine_overhead.py                      # K = 1, 100, 200 tensors per step
    python benchmarks/engine_overhead.py --counts 100,200 --steps 200
    python benchmarks/engine_overhead.py --profile 200        # cProfile of both threads at K=200, rank 0 and 1
    python benchmarks/engine_overhead.py --counts 1 --lone 16384 --lone-iters 5000   # latency only

A step enqueues K in-place float32 allreduces (``--floats`` elements each, 256 = 1 KiB: the data plane is
negligible, what is left is the engine) with ``allreduce_async_`` under fixed names, as a training step
does, then synchronizes every handle.  Reported per K, medians over the timed steps:

* ``us/tensor``: step wall time / K (what the issue calls the amortised per-tensor cost);
* ``marginal``: (step(K_max) - step(K_min)) / (K_max - K_min), the cost of one more tensor in flight;
* ``cpu``: CPU time of the whole process (all threads) per step / K, on rank 0 and rank 1, and ``caller``:
  of the thread that enqueues and synchronizes.  On a loaded machine CPU time is far steadier than wall time;
* ``lone``: median latency of one synchronous in-place ``allreduce_`` of ``--lone`` bytes (16 KiB), as in
  benchmarks/allreduce.py.

``--profile K`` runs K-tensor steps with ``cProfile`` enabled in the caller thread and in the engine thread
of each rank and prints the top functions by internal time, with calls per tensor (deterministic counts).
Both ranks run in one launch, so load from other jobs hits them alike; to compare two versions of the code
run this script alternately from two checkouts (``PYTHONPATH=<checkout>``) and compare medians.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time


def _step(hvd, bufs: list, names: list[str]) -> None:
    handles = [hvd.allreduce_async_(b, op=hvd.Sum, name=n) for b, n in zip(bufs, names)]
    for h in handles:
        hvd.synchronize(h)


def _profile_engine(engine) -> cProfile.Profile:
    """Run the engine thread's loop under a profiler from now on (the loop method is looked up per call)."""
    prof = cProfile.Profile()
    original = type(engine)._loop

    def loop(self=engine):
        prof.enable()
        try:
            return original(self)
        finally:
            prof.disable()

    engine._loop = loop  # type: ignore[method-assign]
    return prof


def _profiles(result: dict, caller: cProfile.Profile, engine: cProfile.Profile, tensors: int, top: int) -> None:
    for label, prof in (("caller thread", caller), ("engine thread", engine)):
        out = io.StringIO()
        try:
            stats = pstats.Stats(prof, stream=out)
        except TypeError:  # nothing recorded: the thread slept throughout (the caller ran every round)
            result.setdefault("profiles", {})[label] = {"text": "(no calls)", "calls_per_tensor": 0.0,
                                                        "tottime_us_per_tensor": 0.0}
            continue
        total_calls = stats.total_calls  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(top)
        result.setdefault("profiles", {})[label] = {
            "text": out.getvalue(), "calls_per_tensor": total_calls / tensors,
            "tottime_us_per_tensor": stats.total_tt / tensors * 1e6}  # type: ignore[attr-defined]


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import horovod.numpy as hvd

    engine_prof = None
    if args.profile:
        # The engine thread starts in init(): patch the class before, restore after.
        from horovod.runtime import engine as engine_mod

        original_start = engine_mod.Engine.start
        holder: dict = {}

        def start(self):
            holder["prof"] = _profile_engine(self)
            original_start(self)

        engine_mod.Engine.start = start
        hvd.init()
        engine_mod.Engine.start = original_start
        engine_prof = holder["prof"]
    else:
        hvd.init()
    rank = hvd.rank()
    counts = [args.profile] if args.profile > 0 else [int(c) for c in args.counts.split(",")]
    if args.profile < 0:  # profile the lone synchronous allreduce instead
        counts = []
    result: dict = {"rank": rank, "counts": {}}
    for k in counts:
        bufs = [np.zeros(args.floats, np.float32) for _ in range(k)]
        names = [f"t{k}.{i}" for i in range(k)]
        for _ in range(args.warmup):
            _step(hvd, bufs, names)
        hvd.barrier()
        if args.profile:
            caller = cProfile.Profile()
            engine_prof.clear()  # type: ignore[union-attr]
            caller.enable()
        walls, cpus, callers = [], [], []
        for _ in range(args.steps):
            c0, t0, m0 = time.process_time(), time.perf_counter(), time.thread_time()
            _step(hvd, bufs, names)
            walls.append(time.perf_counter() - t0)
            callers.append(time.thread_time() - m0)
            cpus.append(time.process_time() - c0)
        if args.profile:
            caller.disable()
            hvd.barrier()
            _profiles(result, caller, engine_prof, args.steps * k, args.top)
        result["counts"][k] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus),
                               "caller": statistics.median(callers), "wall_mean": statistics.fmean(walls)}
        hvd.barrier()
    if args.lone and args.profile <= 0:  # a lone synchronous in-place allreduce, as benchmarks/allreduce.py
        buf = np.zeros(args.lone // 4, np.float32)
        for _ in range(args.warmup * 10):
            hvd.allreduce_(buf, op=hvd.Sum, name="lone")
        hvd.barrier()
        if args.profile:
            caller = cProfile.Profile()
            engine_prof.clear()  # type: ignore[union-attr]
            caller.enable()
        walls, cpus = [], []
        for _ in range(args.lone_iters):
            c0, t0 = time.process_time(), time.perf_counter()
            hvd.allreduce_(buf, op=hvd.Sum, name="lone")
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        result["lone"] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus),
                          "p90": sorted(walls)[int(0.9 * len(walls))]}
        if args.profile:
            caller.disable()
            _profiles(result, caller, engine_prof, args.lone_iters, args.top)
        hvd.barrier()
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump(result, f)
    hvd.shutdown()


def driver(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, os.path.abspath(__file__),
               "--worker", "--out", out, "--counts", args.counts, "--floats", str(args.floats),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile", str(args.profile),
               "--top", str(args.top), "--lone", str(args.lone), "--lone-iters", str(args.lone_iters)]
        subprocess.run(cmd, check=True, timeout=args.timeout)
        ranks = []
        for r in (0, 1):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    if args.profile:
        for res in ranks:
            for label, p in res.get("profiles", {}).items():
                print(f"\n===== rank {res['rank']} {label}: {p['calls_per_tensor']:.1f} calls/tensor, "
                      f"{p['tottime_us_per_tensor']:.1f} us profiled time/tensor (inflated by the profiler)")
                print(p["text"])
        return {"ranks": ranks}
    counts = sorted(int(k) for k in ranks[0]["counts"])
    print(f"\nengine per-tensor cost, np=2, {args.floats} float32 per tensor, median of {args.steps} steps")
    print("(cpu: CPU time of the whole process per tensor; caller: of the thread that enqueues and waits)")
    print(f"{'K':>5} {'step ms':>9} {'us/tensor':>10} {'cpu r0':>8} {'caller r0':>10} {'cpu r1':>8} "
          f"{'caller r1':>10}")
    summary = {}
    for k in counts:
        c0, c1 = ranks[0]["counts"][str(k)], ranks[1]["counts"][str(k)]
        summary[k] = {"step_ms": c0["wall"] * 1e3, "us_per_tensor": c0["wall"] / k * 1e6,
                      "cpu_us_r0": c0["cpu"] / k * 1e6, "cpu_us_r1": c1["cpu"] / k * 1e6,
                      "caller_us_r0": c0.get("caller", 0.0) / k * 1e6,
                      "caller_us_r1": c1.get("caller", 0.0) / k * 1e6}
        s = summary[k]
        print(f"{k:>5} {s['step_ms']:>9.3f} {s['us_per_tensor']:>10.1f} {s['cpu_us_r0']:>8.1f} "
              f"{s['caller_us_r0']:>10.1f} {s['cpu_us_r1']:>8.1f} {s['caller_us_r1']:>10.1f}")
    if "lone" in ranks[0]:
        lone = ranks[0]["lone"]
        summary["lone_us"] = lone["wall"] * 1e6
        print(f"lone {args.lone // 1024} KiB allreduce_ (synchronous): median {lone['wall'] * 1e6:.0f} us, "
              f"p90 {lone['p90'] * 1e6:.0f} us, CPU r0 {lone['cpu'] * 1e6:.0f} us, "
              f"r1 {ranks[1]['lone']['cpu'] * 1e6:.0f} us per call")
    if len(counts) >= 2 and counts[-1] > counts[0]:
        lo, hi = counts[0], counts[-1]
        marginal = (summary[hi]["step_ms"] - summary[lo]["step_ms"]) * 1e3 / (hi - lo)
        print(f"marginal cost of one more tensor in flight ({lo} -> {hi}): {marginal:.1f} us")
        summary["marginal_us"] = marginal
    print("RESULT " + json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--counts", default="1,100,200", help="tensors per step, comma separated")
    parser.add_argument("--floats", type=int, default=256, help="float32 elements per tensor")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--lone", type=int, default=16384, help="bytes of the lone synchronous allreduce (0: skip)")
    parser.add_argument("--lone-iters", type=int, default=2000)
    parser.add_argument("--profile", type=int, default=0,
                        help="profile K-tensor steps instead of timing (-1: the lone allreduce)")
    parser.add_argument("--top", type=int, default=25, help="functions listed per profile")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
