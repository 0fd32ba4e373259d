"""Train a small CNN on MNIST with horovod.torch.

    horovodrun -np 2 python examples/pytorch/pytorch_mnist.py

MNIST is read from a local copy if there is one (``--data-dir``, ``~/.cache/mnist``, ``~/.keras/datasets``:
``mnist.npz`` as Keras stores it, or the raw ``*-idx?-ubyte[.gz]`` files torchvision downloads); nothing is
downloaded.  Without a copy the script trains on generated digit-like data (ten noisy class templates), which
is learnable, so the run still shows the accuracy climbing.  Each rank trains on its own shard; gradients are
averaged by ``hvd.DistributedOptimizer``.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

log = logging.getLogger("pytorch_mnist")


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist(data_dir: str | None) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], str]:
    """(x_train, y_train, x_test, y_test) as float32 images in [0, 1] and int64 labels, and the source."""
    dirs = [Path(d).expanduser() for d in (data_dir, "~/.cache/mnist", "~/.keras/datasets", "~/.cache") if d]
    for d in dirs:
        npz = d / "mnist.npz"
        if npz.is_file():
            with np.load(npz) as f:
                arrays = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
            return _normalise(*arrays), str(npz)
        for raw in (d / "MNIST" / "raw", d / "raw", d):
            names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                     "t10k-labels-idx1-ubyte"]
            paths = [next((p for p in (raw / n, raw / (n + ".gz")) if p.is_file()), None) for n in names]
            if all(paths):
                return _normalise(*(_read_idx(p) for p in paths)), str(raw)
    return generated_digits(), "generated (no local MNIST found)"


def _normalise(xtr, ytr, xte, yte):
    return (xtr.astype(np.float32) / 255.0, ytr.astype(np.int64), xte.astype(np.float32) / 255.0,
            yte.astype(np.int64))


def generated_digits(train: int = 12000, test: int = 2000, seed: int = 0):
    """Ten smooth random 28x28 templates plus noise and small shifts: learnable, not trivially separable."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((10, 7, 7)).astype(np.float32)
    templates = np.kron(coarse, np.ones((4, 4), np.float32))

    def make(n):
        y = rng.integers(0, 10, n)
        x = templates[y] + 0.6 * rng.standard_normal((n, 28, 28)).astype(np.float32)
        shifts = rng.integers(-2, 3, (n, 2))
        for i, (dy, dx) in enumerate(shifts):
            x[i] = np.roll(x[i], (dy, dx), axis=(0, 1))
        return np.clip(x, 0, 1.5).astype(np.float32), y.astype(np.int64)

    return (*make(train), *make(test))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--max-train", type=int, default=6000, help="use at most this many training images")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    (x_train, y_train, x_test, y_test), source = load_mnist(args.data_dir)
    x_train, y_train = x_train[:args.max_train], y_train[:args.max_train]
    shard = slice(hvd.rank(), None, hvd.size())  # each rank its own part of the data
    xs = torch.from_numpy(x_train[shard]).unsqueeze(1)
    ys = torch.from_numpy(y_train[shard])
    if hvd.rank() == 0:
        log.info("data: %s; %d training images (%d per rank), %d ranks", source, len(x_train), len(xs), hvd.size())

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)  # scale lr by size
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch))
        steps = len(xs) // args.batch_size  # equal on every rank (shards differ by at most one image)
        steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Min, name="steps"))
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
        accuracy = evaluate(model, x_test, y_test)
        if hvd.rank() == 0:
            log.info("epoch %d: loss %.4f, test accuracy %.2f%% (%.1f s)", epoch + 1, loss.item(), 100 * accuracy,
                     time.perf_counter() - start)


def evaluate(model: nn.Module, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """Accuracy over the whole test set: each rank scores its shard, the counts are summed."""
    model.eval()
    shard = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        pred = model(torch.from_numpy(x_test[shard]).unsqueeze(1)).argmax(1)
        correct = (pred == torch.from_numpy(y_test[shard])).sum()
    totals = hvd.allreduce(torch.tensor([int(correct), len(pred)]), op=hvd.Sum, name="accuracy")
    return int(totals[0]) / int(totals[1])


if __name__ == "__main__":
    main()
