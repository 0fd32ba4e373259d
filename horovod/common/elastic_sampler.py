"""Exactly-once data partitioning for elastic jobs, framework-free (torch and Keras wrap it).

Upstream's ``ElasticSampler`` counts processed samples as ``batches * batch_size * num_replicas`` and pads
the remainder with duplicates, so after a reset samples can be skipped or seen twice (upstream #3399).
Here the sampler keeps the *set* of processed sample indices of the epoch:

* every rank derives the same plan from (the epoch's permutation minus the processed set, world size,
  batch size), so ``record_batch(i, bs)`` marks exactly the samples that *all* ranks processed in steps
  ``0..i`` since the last reset, with no communication;
* the processed set is part of the state: commit it together with the model after the optimizer step, and
  a restore rolls both back together, so uncommitted samples are processed again exactly once;
* after a reset only the unprocessed remainder is partitioned over the new world (batch mode: without padding).

Batch mode (``batch_size=`` given): iteration yields this rank's batches; every rank has the same number of
steps and, unless fewer samples than ranks are left, a non-empty batch in each (the last two steps are
rebalanced).  Index mode (no ``batch_size``, upstream's way with ``DataLoader(batch_size=...)``): iteration
yields this rank's indices and ``record_batch`` uses the batch size it is given.  As upstream, the remainder
is padded with its first samples to a multiple of the world size, so every rank has as many indices, and
so as many steps, as the others (shares one sample apart made one rank run a step more, and the others
wait for its allreduce: a stall, then a reset into the same layout, forever); at most ``size - 1`` samples
per reset are processed twice.  Batch mode is exact.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np

__all__ = ["ElasticSampler", "plan_batches"]


def plan_batches(remaining: list[int], num_replicas: int, batch_size: int) -> list[list[list[int]]]:
    """Split ``remaining`` into steps of per-rank batches: ``plan[step][rank] -> indices``.

    Full steps give every rank ``batch_size`` consecutive samples; the last step is split as evenly as
    possible, and if it has fewer samples than ranks it is merged with the previous step and the two are
    re-split so that every rank keeps at least one sample per step.
    """
    n, bs = num_replicas, batch_size
    m = len(remaining)
    steps = math.ceil(m / (n * bs)) if m else 0
    plan: list[list[list[int]]] = []
    pos = 0
    full = steps - 1
    last = m - full * n * bs if steps else 0
    rebalance = steps >= 2 and last < n and bs >= 2
    if rebalance:
        full -= 1
    for _ in range(max(full, 0)):
        plan.append([remaining[pos + r * bs: pos + (r + 1) * bs] for r in range(n)])
        pos += n * bs
    if rebalance:
        total = m - pos
        per_rank = [total // n + (1 if r < total % n else 0) for r in range(n)]
        first = [min(bs, t - 1) for t in per_rank]
        second = [t - f for t, f in zip(per_rank, first)]
        for sizes in (first, second):
            step = []
            for size in sizes:
                step.append(remaining[pos: pos + size])
                pos += size
            plan.append(step)
    elif steps:
        total = m - pos
        step = []
        for r in range(n):
            size = total // n + (1 if r < total % n else 0)
            step.append(remaining[pos: pos + size])
            pos += size
        plan.append(step)
    return plan


def _padded(indices: list[int], num_replicas: int) -> list[int]:
    """``indices`` followed by its first ones (cyclically) up to a multiple of ``num_replicas``."""
    missing = -len(indices) % num_replicas
    if not indices or not missing:
        return indices
    return indices + (indices * (missing // len(indices) + 1))[:missing]


def _default_rank() -> int:
    from horovod.common import basics

    return basics.rank()


def _default_size() -> int:
    from horovod.common import basics

    return basics.size()


class ElasticSampler:
    """Partitions a dataset's indices over the current world so that every sample is processed once.

    Args:
        dataset: anything with ``len()`` (or an int, the number of samples).
        shuffle: permute the indices each epoch with ``random.Random(seed + epoch)``.
        seed: shuffling seed; must be the same on every rank.
        batch_size: batch mode (see the module docstring); None for index mode.
        get_rank, get_size: the framework's ``rank``/``size`` (default: ``horovod.common.basics``).

    Example (batch mode)::

        sampler = ElasticSampler(dataset, batch_size=32)
        for step, batch in enumerate(sampler):          # this rank's indices of each step
            train_on(batch)                             # forward, backward, allreduce, optimizer step
            sampler.record_batch(step, 32)
            state.commit()                              # state holds the sampler
    """

    def __init__(self, dataset: Sized | int, shuffle: bool = True, seed: int = 0, *,
                 batch_size: int | None = None, get_rank: Callable[[], int] | None = None,
                 get_size: Callable[[], int] | None = None) -> None:
        self.dataset = dataset
        self.num_samples_total = dataset if isinstance(dataset, int) else len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.batch_size = batch_size
        self._get_rank = get_rank or _default_rank
        self._get_size = get_size or _default_size
        self.epoch = 0
        self.processed = np.zeros(self.num_samples_total, dtype=bool)
        self.num_replicas = 1
        self.rank = 0
        self.remaining: list[int] = []
        self._plan: list[list[list[int]]] = []
        self._recorded = 0  # steps of the current plan already recorded
        self.reset()

    # ------------------------------------------------------------------ epoch and world
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` with nothing processed; calling it again for the current epoch keeps progress.

        (Upstream always clears the count; keeping it makes ``set_epoch(state.epoch)`` at the top of the
        epoch loop safe after a restore.)
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed[:] = False
        self.reset()

    def reset(self) -> None:
        """Re-read rank/size and partition the unprocessed samples of the epoch."""
        self.num_replicas = self._get_size()
        self.rank = self._get_rank()
        order = list(range(self.num_samples_total))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining = [i for i in order if not self.processed[i]]
        self._recorded = 0
        self._plan = plan_batches(self.remaining, self.num_replicas, self.batch_size) if self.batch_size else []
        self._padded = [] if self.batch_size else _padded(self.remaining, self.num_replicas)

    # ------------------------------------------------------------------ progress
    def _share(self, rank: int) -> list[int]:
        return self._padded[rank::self.num_replicas]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark every rank's samples of steps ``0..batch_idx`` (since the last reset) as processed.

        Call it after the optimizer step of that batch and before ``commit()``.
        """
        steps = batch_idx + 1
        if steps <= self._recorded:
            return
        if self.batch_size:
            for step in self._plan[self._recorded:steps]:
                for batch in step:
                    self.processed[batch] = True
        else:
            for r in range(self.num_replicas):
                share = self._share(r)
                self.processed[share[self._recorded * batch_size: steps * batch_size]] = True
        self._recorded = steps

    def record_indices(self, indices: Any) -> None:
        """Mark samples as processed explicitly (e.g. the allgathered indices of a step)."""
        self.processed[np.asarray(indices, dtype=np.int64)] = True

    @property
    def epoch_done(self) -> bool:
        """Every sample of this epoch is processed (and recorded)."""
        return bool(self.processed.all())

    @property
    def processed_num(self) -> int:
        """Samples of this epoch processed (and recorded) so far, by all ranks together."""
        return int(self.processed.sum())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed": np.packbits(self.processed).tobytes(),
                "num_samples": self.num_samples_total, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("num_samples", self.num_samples_total) != self.num_samples_total:
            raise ValueError(f"ElasticSampler state is for {state_dict['num_samples']} samples, the dataset has "
                             f"{self.num_samples_total}.")
        self.epoch = state_dict["epoch"]
        bits = np.frombuffer(state_dict["processed"], dtype=np.uint8)
        self.processed = np.unpackbits(bits, count=self.num_samples_total).astype(bool)
        self.reset()

    # ------------------------------------------------------------------ iteration
    def batches(self) -> list[list[int]]:
        """This rank's batches of the current plan (batch mode)."""
        if not self.batch_size:
            raise ValueError("ElasticSampler.batches() needs batch_size= (batch mode).")
        return [step[self.rank] for step in self._plan]

    def get_indices(self) -> list[int]:
        """This rank's indices since the last reset, in order."""
        if self.batch_size:
            return [i for batch in self.batches() for i in batch]
        return self._share(self.rank)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches() if self.batch_size else self.get_indices())

    def __len__(self) -> int:
        return len(self._plan) if self.batch_size else len(self._share(self.rank))
