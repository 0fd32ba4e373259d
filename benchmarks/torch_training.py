"""Training throughput: horovod.torch DistributedOptimizer vs torch DistributedDataParallel (Gloo).

A synthetic CNN of about 5 M parameters, batch 32 per rank, one compute thread per process, ``--np`` local
processes.  Both contenders run in the same processes of one ``horovodrun`` launch: each rank builds the
model twice — once wrapped in DDP over a Gloo process group, once with ``hvd.DistributedOptimizer`` — and
alternates training steps between them.  Other load on a shared machine therefore hits both contenders
alike (separate launches minutes apart differed by 50% on a busy 2-core host).  The table reports the median
step time of each as images/s over all ranks, and the ratio.

    python benchmarks/torch_training.py                 # np=2, prints a table and a JSON line
    python benchmarks/torch_training.py --np 2 --iters 40
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

RESULT = "RESULT "


class Net(nn.Module):
    """~5.1 M parameters: four 3x3 conv layers on 32x32 images and two dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv4 = nn.Conv2d(128, 256, 3, padding=1)
        self.fc1 = nn.Linear(256 * 4 * 4, 1152)
        self.fc2 = nn.Linear(1152, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        x = F.max_pool2d(F.relu(self.conv4(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def gloo_beside_horovod(hvd) -> None:
    """torch.distributed's Gloo group for the DDP contender, on the ranks Horovod assigned (one launch)."""
    import torch.distributed as dist

    port = 0
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="ddp_port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    gloo_beside_horovod(hvd)

    torch.manual_seed(0)
    ddp_model = DistributedDataParallel(Net())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(0)
    hvd_model = Net()
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=hvd_model.named_parameters())
    hvd.broadcast_parameters(hvd_model.state_dict(), root_rank=0)

    gen = torch.Generator().manual_seed(1234 + hvd.rank())
    data = torch.randn(args.batch, 3, 32, 32, generator=gen)
    target = torch.randint(0, 10, (args.batch,), generator=gen)

    def step(model, optimizer) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"ddp_gloo": [], "horovod": []}
    for i in range(args.warmup + args.iters):
        for name, model, optimizer in (("ddp_gloo", ddp_model, ddp_opt), ("horovod", hvd_model, hvd_opt)):
            seconds = step(model, optimizer)
            if i >= args.warmup:
                times[name].append(seconds)
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"times": times, "size": hvd.size()}), flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


def run(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(args.np), sys.executable, os.path.abspath(__file__),
           "--worker", "--batch", str(args.batch), "--warmup", str(args.warmup), "--iters", str(args.iters)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"benchmark run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    params = sum(p.numel() for p in Net().parameters())
    result = run(args)
    images = args.np * args.batch  # per step, all ranks
    rate = {k: images / statistics.median(v) for k, v in result["times"].items()}
    mean = {k: images * len(v) / sum(v) for k, v in result["times"].items()}
    ratio = rate["horovod"] / rate["ddp_gloo"]
    print(f"model: {params / 1e6:.2f} M parameters, batch {args.batch}/rank, np={args.np}, 1 thread/process, "
          f"{args.iters} timed steps each, interleaved step by step")
    print("| contender | images/s (median step) | images/s (mean) |\n|---|---|---|")
    print(f"| torch DDP (Gloo) | {rate['ddp_gloo']:.1f} | {mean['ddp_gloo']:.1f} |")
    print(f"| horovod.torch DistributedOptimizer | {rate['horovod']:.1f} | {mean['horovod']:.1f} |")
    print(f"ratio horovod / DDP: {ratio:.3f} (median), {mean['horovod'] / mean['ddp_gloo']:.3f} (mean)")
    print(json.dumps({"benchmark": "torch_training", "params": params, "np": args.np, "batch": args.batch,
                      "ddp_images_per_s": rate["ddp_gloo"], "horovod_images_per_s": rate["horovod"],
                      "ratio": ratio}))


if __name__ == "__main__":
    main()
