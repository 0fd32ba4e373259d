"""Are autotune's settings at least as fast as the defaults?  The 164-tensor model, horovod.torch, np=2.

    python benchmarks/autotune.py                      # tune, then time defaults vs tuned, print the ratio
    python benchmarks/autotune.py --pairs 5 --iters 300

1. One ``horovodrun -np 2`` launch trains the many-tensor model of benchmarks/torch_training.py (40 x (Linear 256
   + LayerNorm), 164 parameter tensors, batch 64 per rank, one torch thread per process) with
   ``HOROVOD_AUTOTUNE=1`` until the search is over (upstream's defaults: 3 warm-up trials, 10 steps per sample,
   20 Bayesian trials, unless given), and rank 0 writes the log.
2. The log's last row (the best) becomes ``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME`` and, when the
   cache lost, ``HOROVOD_CACHE_CAPACITY=0``.
3. Launches with the defaults and with the tuned env alternate (``--pairs`` of each); each times ``--iters``
   steps after ``--warmup``.  Printed: images/s (median step) of every launch, the median over launches and
   the ratio tuned / defaults.
4. One more launch alternates the two settings step by step (rank 0 switches every rank before each step with
   ``Engine.set_params``, autotune's own mechanism), so load from other jobs on a busy host hits both alike;
   printed: images/s (median step) of each and their ratio, then a JSON line of everything.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT = "RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ranks import horovod from here


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch_training import ManyTensors  # benchmarks/ is sys.path[0]

    import horovod.torch as hvd
    from horovod.common import basics

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = ManyTensors()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(1234 + hvd.rank())
    x = torch.randn(args.batch, 64, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    times = []
    engine = basics.engine()
    settings = None  # --paired: rank 0 switches every rank between the defaults and the tuned row each step
    if args.paired and hvd.rank() == 0:
        from horovod.runtime.autotune import Params

        config = engine.config
        defaults = Params(cache_enabled=config.cache_capacity > 0, cycle_time_ms=config.cycle_time_ms,
                          fusion_threshold=config.fusion_threshold)
        settings = [defaults, Params(*[float(v) if "." in v else int(v) for v in args.paired.split(",")[:6]])]
    paired: dict[str, list[float]] = {"defaults": [], "tuned": []}
    for i in range(args.warmup + args.iters):
        if settings is not None:
            engine.set_params(settings[i % 2])
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            paired["tuned" if i % 2 else "defaults"].append(times[-1])
        if args.tune and i % 50 == 49:  # rank 0 knows when the search is over: tell the others
            done = torch.tensor([float(hvd.rank() == 0 and engine._tuner is None and
                                       bool(engine.autotune_history))])
            if hvd.broadcast(done, 0, name="autotune.done").item():
                break
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"times": times, "steps": i + 1, "paired": paired}), flush=True)
    hvd.shutdown()


def launch(args: argparse.Namespace, env: dict[str, str], *, tune: bool = False, paired: str = "") -> dict:
    cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, os.path.abspath(__file__),
           "--worker", "--batch", str(args.batch), "--warmup", str(0 if tune else args.warmup),
           "--iters", str(args.max_tune_steps if tune else args.iters)] + (["--tune"] if tune else []) + \
        (["--paired", paired] if paired else [])
    full = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    full.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=full)
    for line in out.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"benchmark run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def tuned_env(log_path: str) -> tuple[dict[str, str], list[str]]:
    """The knobs of the log's last row (the best), and that row."""
    with open(log_path) as f:
        rows = list(csv.reader(f))
    best = dict(zip(rows[0], rows[-1]))
    env = {"HOROVOD_FUSION_THRESHOLD": best["tensor_fusion_threshold"], "HOROVOD_CYCLE_TIME": best["cycle_time_ms"]}
    if best["cache_enabled"] == "0":
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    return env, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=3, help="launches of each contender, alternating")
    parser.add_argument("--warmup-samples", type=int, default=3)
    parser.add_argument("--steps-per-sample", type=int, default=10)
    parser.add_argument("--bayes-opt-max-samples", type=int, default=20)
    parser.add_argument("--max-tune-steps", type=int, default=5000)
    parser.add_argument("--tune", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--paired", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "autotune.csv")
        started = time.monotonic()
        tuning = launch(args, {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": log_path,
                               "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": str(args.warmup_samples),
                               "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": str(args.steps_per_sample),
                               "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.bayes_opt_max_samples)}, tune=True)
        env, rows = tuned_env(log_path)
    print(f"tuning: {tuning['steps']} steps, {len(rows) - 2} trials, {time.monotonic() - started:.0f} s; log:")
    for row in rows:
        print("  " + ",".join(row))
    if env == {"HOROVOD_FUSION_THRESHOLD": str(128 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "1"}:
        print("the search kept the defaults: the timing below compares the defaults with themselves")
    print("tuned env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    images = 2 * args.batch
    rates: dict[str, list[float]] = {"defaults": [], "tuned": []}
    for _ in range(args.pairs):
        for name, extra in (("defaults", {}), ("tuned", env)):
            result = launch(args, extra, tune=False)
            rates[name].append(images / statistics.median(result["times"]))
    for name, values in rates.items():
        print(f"  {name:8s} images/s per launch: {', '.join(f'{v:.1f}' for v in values)}; "
              f"median {statistics.median(values):.1f}")
    ratio = statistics.median(rates["tuned"]) / statistics.median(rates["defaults"])
    pair_ratios = [t / d for t, d in zip(rates["tuned"], rates["defaults"])]
    print(f"separate launches, tuned / defaults: {ratio:.3f} (per pair: {', '.join(f'{r:.3f}' for r in pair_ratios)})")
    # The same two settings in one launch, alternating step by step (rank 0 switches every rank each step, as
    # autotune does between trials): both see the same load, which separate launches on a busy host do not.
    paired = launch(args, {}, paired=",".join(rows[-1]))["paired"]
    steps = {k: images / statistics.median(v) for k, v in paired.items()}
    print(f"one launch, alternating steps: defaults {steps['defaults']:.1f}, tuned {steps['tuned']:.1f} images/s "
          f"(median step), tuned / defaults: {steps['tuned'] / steps['defaults']:.3f}")
    print(json.dumps({"benchmark": "autotune", "tuned_env": env, "best_row": rows[-1], "trials": len(rows) - 2,
                      "defaults_images_per_s": rates["defaults"], "tuned_images_per_s": rates["tuned"],
                      "ratio": ratio, "pair_ratios": pair_ratios, "interleaved_images_per_s": steps,
                      "interleaved_ratio": steps["tuned"] / steps["defaults"]}))


if __name__ == "__main__":
    main()
