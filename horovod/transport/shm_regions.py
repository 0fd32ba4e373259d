"""Which region size a shared-memory allreduce uses on this host, measured on the job's own allreduces.

A large allreduce through the segments runs in pieces of one region per member, with one token round per
piece (:mod:`horovod.transport.shm`).  Bigger regions mean fewer rounds (fewer wake-ups, fewer moments where
one member waits for another) but copies and sums that fit the caches less well.  Which wins differs by host:
inside Keras training, 2 MiB regions were ahead of 1 MiB by ~0.03 of scaling efficiency on an AMD EPYC VM and
behind by about as much on an Intel Sapphire Rapids one (docs/benchmarks.md).  No property of the host
predicted it, so each communicator measures: its first large allreduces try the candidates in turn, each
member timing its own from the first token round on (a late member's arrival is not the region's doing);
once every candidate has :data:`SAMPLES` timings the members add their medians of seconds per byte (one small
collective) and every member keeps the same candidate: the default (the first) unless another one is faster
by more than :data:`MARGIN`.

Every member sees the same allreduces in the same order with the same sizes, so all of them try the same
candidate on the same call and reach the decision on the same call.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

__all__ = ["RegionTrial", "WARMUP", "SAMPLES", "MARGIN"]

WARMUP = 2  # first large allreduces not timed (first touch of the segments' pages, the caller's warm-up)
SAMPLES = 8  # timed allreduces per candidate, taken in turn so that the host's drift hits all of them alike
MARGIN = 0.03  # another candidate replaces the default only if its summed median is this much lower


class RegionTrial:
    """Round-robin timings of region sizes for allreduces of at least ``min_bytes``, then one choice.

    Args:
        candidates: region sizes in bytes, the default first.
        min_bytes: allreduces below this are not timed (too few pieces to tell the sizes apart).
    """

    def __init__(self, candidates: Sequence[int], min_bytes: int, *, warmup: int = WARMUP,
                 samples: int = SAMPLES, margin: float = MARGIN) -> None:
        if len(candidates) < 2:
            raise ValueError("a trial needs at least two region sizes")
        self.candidates = tuple(candidates)
        self.min_bytes, self.warmup, self.samples, self.margin = min_bytes, warmup, samples, margin
        self._calls = 0
        self._times: list[list[float]] = [[] for _ in self.candidates]

    def region_for(self, nbytes: int) -> int | None:
        """The candidate for this allreduce (the default during the warm-up), or None: not part of the trial."""
        if nbytes < self.min_bytes:
            return None
        k = self._calls - self.warmup
        self._calls += 1
        return self.candidates[0] if k < 0 else self.candidates[k % len(self.candidates)]

    def record(self, region: int, seconds: float, nbytes: int) -> None:
        """One timed allreduce (ignored during the warm-up)."""
        if self._calls > self.warmup:
            self._times[self.candidates.index(region)].append(seconds / max(1, nbytes))

    @property
    def complete(self) -> bool:
        return all(len(t) >= self.samples for t in self._times)

    def medians(self) -> np.ndarray:
        """This member's median seconds per byte of each candidate (to be summed over the members)."""
        return np.array([statistics.median(t) for t in self._times], np.float64)

    def choose(self, summed: np.ndarray) -> int:
        """The region every member keeps, from the members' summed medians (the same array on every member)."""
        best = int(np.argmin(summed))
        if best and summed[best] >= (1.0 - self.margin) * summed[0]:
            best = 0
        return self.candidates[best]
