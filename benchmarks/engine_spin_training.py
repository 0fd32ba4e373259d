"""Does the waiting caller's spin cost training?  A 160-tensor model, DDP vs horovod.torch, np=2.

    python benchmarks/engine_spin_training.py              # prints images/s and ratios, and a JSON line
    python benchmarks/engine_spin_training.py --iters 300

The model has 164 parameter tensors (40 x (Linear 256 + LayerNorm), an input and an output layer), batch 64
per rank, one torch thread per process.  In one ``horovodrun -np 2`` launch every rank alternates steps of
three contenders: torch DDP over Gloo, ``hvd.DistributedOptimizer`` with the engine's spin allowed in every
wait ("spin"), and the same model and optimizer with no spin at all ("no spin"; the spin setting is switched
between steps), so load from other jobs hits all three alike.  Since docs/benchmarks.md's measurement, the
engine spins only while a caller waits for a synchronous op, never in the optimizer's wait for its
asynchronous gradients, so "spin" here forces what the engine no longer does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "RESULT "


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch_training import ManyTensors, gloo_beside_horovod  # benchmarks/ is sys.path[0]

    import horovod.torch as hvd
    from horovod.common import basics

    torch.set_num_threads(1)
    hvd.init()
    gloo_beside_horovod(hvd)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(ManyTensors())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    torch.manual_seed(0)
    model = ManyTensors()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(1234 + hvd.rank())
    x = torch.randn(args.batch, 64, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    def step(m, o) -> float:
        start = time.perf_counter()
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
        return time.perf_counter() - start

    engine = basics.engine()
    spin_time, spin_gate = engine._spin_time, type(engine)._drive_until

    def always_spin(self, handle, deadline):  # the engine spins only for synchronous ops: force it here
        sync = getattr(handle, "sync", False)
        handle.sync = True
        try:
            return spin_gate(self, handle, deadline)
        finally:
            handle.sync = sync

    times: dict[str, list[float]] = {"ddp_gloo": [], "horovod_spin": [], "horovod_no_spin": []}
    for i in range(args.warmup + args.iters):
        record = i >= args.warmup
        t = step(ddp, ddp_opt)
        if record:
            times["ddp_gloo"].append(t)
        engine._spin_time = spin_time
        type(engine)._drive_until = always_spin
        t = step(model, opt)
        if record:
            times["horovod_spin"].append(t)
        engine._spin_time = 0.0
        type(engine)._drive_until = spin_gate
        t = step(model, opt)
        if record:
            times["horovod_no_spin"].append(t)
    engine._spin_time = spin_time
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"times": times, "tensors": len(list(model.parameters()))}), flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, os.path.abspath(__file__),
           "--worker", "--batch", str(args.batch), "--warmup", str(args.warmup), "--iters", str(args.iters)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ranks import horovod from here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    lines = [line.split(RESULT, 1)[1] for line in out.stdout.splitlines() if RESULT in line]
    if not lines:
        raise RuntimeError(f"benchmark run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(lines[0])
    rate = {k: 2 * args.batch / statistics.median(v) for k, v in result["times"].items()}
    print(f"{result['tensors']} parameter tensors, batch {args.batch}/rank, np=2, {args.iters} steps each, "
          "interleaved step by step")
    for k, v in rate.items():
        print(f"  {k:16s} {v:8.1f} images/s   {v / rate['ddp_gloo']:.3f} x DDP")
    print(f"spin / no spin: {rate['horovod_spin'] / rate['horovod_no_spin']:.3f}")
    print(json.dumps({"benchmark": "engine_spin_training", **{f"{k}_images_per_s": v for k, v in rate.items()}}))


if __name__ == "__main__":
    main()
