"""Synthetic training benchmark with horovod.torch (upstream's pytorch_synthetic_benchmark, no torchvision).

    horovodrun -np 2 python examples/pytorch/pytorch_synthetic_benchmark.py --num-iters 5

Trains a ~5 M parameter CNN on random 32x32 images and prints images/s per rank and in total.  For the
comparison with torch DistributedDataParallel see benchmarks/torch_training.py.
"""

from __future__ import annotations

import argparse
import logging
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd

log = logging.getLogger("pytorch_synthetic_benchmark")


def build_model() -> torch.nn.Module:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from torch_training import Net

    return Net()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true", help="reduce with Adasum (power-of-two ranks)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    hvd.init()
    torch.set_num_threads(args.threads)
    model = build_model()
    # Adasum needs no learning rate scaled by the number of ranks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * (1 if args.use_adasum else hvd.size()))
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    if hvd.rank() == 0:
        log.info("Model: %.2f M parameters, batch size %d, %d ranks", sum(p.numel() for p in model.parameters()) / 1e6,
                 args.batch_size, hvd.size())
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / t
        rates.append(rate)
        if hvd.rank() == 0:
            log.info("Iter #%d: %.1f img/sec per rank", i, rate)
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    if hvd.rank() == 0:
        log.info("Img/sec per rank: %.1f +-%.1f", mean, conf)
        log.info("Total img/sec on %d rank(s): %.1f +-%.1f", hvd.size(), hvd.size() * mean, hvd.size() * conf)


if __name__ == "__main__":
    main()
