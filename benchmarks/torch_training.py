"""Training throughput: horovod.torch DistributedOptimizer vs torch DistributedDataParallel (Gloo).

Three model shapes (``--model``), one compute thread per process, ``--np`` local processes:

* ``cnn``: a synthetic CNN of about 5 M parameters in 12 tensors, batch 32 per rank (compute-bound);
* ``mlp``: 1024-2048-1024-1024-10, 5.3 M parameters in 8 tensors, batch 64 (communication-bound);
* ``many``: 40 x (Linear 256 + LayerNorm) between an input and an output layer, 2.7 M parameters in 164
  tensors, batch 64 (many small gradients, as ResNet-50, BERT or GPT-2 have).

Both contenders run in the same processes of one ``horovodrun`` launch: each rank builds the
model twice — once wrapped in DDP over a Gloo process group, once with ``hvd.DistributedOptimizer`` — and
alternates training steps between them.  Other load on a shared machine therefore hits both contenders
alike (separate launches minutes apart differed by 50% on a busy 2-core host).  The table reports the median
step time of each as images/s over all ranks, and the ratio.

    python benchmarks/torch_training.py                 # np=2, the CNN: a table and a JSON line
    python benchmarks/torch_training.py --model all     # each shape in its own launch
    python benchmarks/torch_training.py --model many --iters 200
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
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class MLP(nn.Module):
    """1024-2048-1024-1024-10: 5.3 M parameters in 8 tensors, little compute per byte of gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(1024, 2048), nn.Linear(2048, 1024), nn.Linear(1024, 1024)])
        self.out = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


class ManyTensors(nn.Module):
    """164 parameter tensors of at most 256 x 256: 40 x (Linear 256 + LayerNorm), an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)) for _ in range(40)])
        self.out = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x))
        for block in self.blocks:
            x = F.relu(block(x))
        return self.out(x)


# model name -> (class, input shape of one sample, default batch per rank)
MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...], int]] = {
    "cnn": (Net, (3, 32, 32), 32),
    "mlp": (MLP, (1024,), 64),
    "many": (ManyTensors, (64,), 64),
}


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

    model_class, sample_shape, _ = MODELS[args.model]
    torch.manual_seed(0)
    ddp_model = DistributedDataParallel(model_class())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(0)
    hvd_model = model_class()
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=hvd_model.named_parameters())
    hvd.broadcast_parameters(hvd_model.state_dict(), root_rank=0)

    gen = torch.Generator().manual_seed(1234 + hvd.rank())
    data = torch.randn(args.batch, *sample_shape, generator=gen)
    target = torch.randint(0, 10, (args.batch,), generator=gen)

    def step(model, optimizer) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        return time.perf_counter() - start, time.process_time() - cpu

    times: dict[str, list[float]] = {"ddp_gloo": [], "horovod": []}
    cpu: dict[str, list[float]] = {"ddp_gloo": [], "horovod": []}  # all threads of this process
    for i in range(args.warmup + args.iters):
        for name, model, optimizer in (("ddp_gloo", ddp_model, ddp_opt), ("horovod", hvd_model, hvd_opt)):
            seconds, cpu_seconds = step(model, optimizer)
            if i >= args.warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"times": times, "cpu": cpu, "size": hvd.size(), "load": os.getloadavg()}),
              flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


def run(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(args.np), sys.executable, os.path.abspath(__file__),
           "--worker", "--model", args.model, "--batch", str(args.batch), "--warmup", str(args.warmup),
           "--iters", str(args.iters)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    for line in out.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"benchmark run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def report(args: argparse.Namespace) -> dict:
    """One launch for ``args.model``: print its table and return the JSON summary."""
    model_class = MODELS[args.model][0]
    model = model_class()
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    load_before = os.getloadavg()[0]
    result = run(args)
    images = args.np * args.batch  # per step, all ranks
    rate = {k: images / statistics.median(v) for k, v in result["times"].items()}
    mean = {k: images * len(v) / sum(v) for k, v in result["times"].items()}
    ratio = rate["horovod"] / rate["ddp_gloo"]
    print(f"model {args.model}: {params / 1e6:.2f} M parameters in {tensors} tensors, batch {args.batch}/rank, "
          f"np={args.np}, 1 thread/process, {args.iters} timed steps each, interleaved step by step, "
          f"load average {load_before:.1f} -> {result['load'][0]:.1f}")
    cpu = {k: statistics.median(v) * 1e3 for k, v in result["cpu"].items()}
    print("| contender | images/s (median step) | images/s (mean) | CPU ms/step, rank 0 |\n|---|---|---|---|")
    print(f"| torch DDP (Gloo) | {rate['ddp_gloo']:.1f} | {mean['ddp_gloo']:.1f} | {cpu['ddp_gloo']:.1f} |")
    print(f"| horovod.torch DistributedOptimizer | {rate['horovod']:.1f} | {mean['horovod']:.1f} | "
          f"{cpu['horovod']:.1f} |")
    print(f"ratio horovod / DDP: {ratio:.3f} (median), {mean['horovod'] / mean['ddp_gloo']:.3f} (mean)")
    summary = {"benchmark": "torch_training", "model": args.model, "params": params, "tensors": tensors,
               "np": args.np, "batch": args.batch, "ddp_images_per_s": rate["ddp_gloo"],
               "horovod_images_per_s": rate["horovod"], "ratio": ratio,
               "ratio_mean": mean["horovod"] / mean["ddp_gloo"], "cpu_ms_per_step": cpu,
               "load": [load_before, result["load"][0]]}
    print(json.dumps(summary), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "all"], default="cnn")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="per rank (default: the model's, 32 or 64)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    batch = args.batch
    for name in MODELS if args.model == "all" else [args.model]:
        report(argparse.Namespace(**{**vars(args), "model": name, "batch": batch or MODELS[name][2]}))

if __name__ == "__main__":
    main()
