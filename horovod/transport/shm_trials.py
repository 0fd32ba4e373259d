"""Choices of the shared-memory data plane measured on the job's own allreduces, where hosts disagree.

Two choices differ by host (and from one day to the next on one host type), and no property of the host
predicted them (docs/benchmarks.md):

* the *region size* of large allreduces through the segments (one region per member per piece, one token round
  per piece): bigger regions mean fewer rounds but copies and sums that fit the caches less well; inside Keras
  training 2 MiB was ahead of 1 MiB by ~0.03 of scaling efficiency on one host and behind by as much on others;
* *member to member or through the segments* for plain arrays where the kernel allows cross-memory copies: the
  kernel's copies beat the segments' two copies on some hosts and cost twice as much on another (pages of
  4 KiB pinned one by one).

So each communicator measures: its first eligible allreduces try the candidates in turn, each member timing its
own from a point where all members are together (a late member's arrival is not the candidate's doing); once
every candidate has :data:`SAMPLES` timings the members swap their medians of seconds per byte (one small
allgather), add them in the same order, and every member keeps the same candidate: the default (the first)
unless another one is faster by more than :data:`MARGIN`.

Every member sees the same allreduces in the same order with the same sizes, so all of them try the same
candidate on the same call and reach the decision on the same call.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["Trial", "WARMUP", "SAMPLES", "MARGIN"]

WARMUP = 2  # first eligible allreduces not timed (first touch of the segments' pages, the caller's warm-up)
SAMPLES = 8  # timed allreduces per candidate, taken in turn so that the host's drift hits all of them alike
MARGIN = 0.03  # another candidate replaces the default only if its summed median is this much lower


class Trial:
    """Round-robin timings of ``candidates`` on allreduces of at least ``min_bytes``, then one choice.

    Args:
        candidates: what is tried (region sizes, or whether to copy member to member), the default first.
        min_bytes: smaller allreduces are not part of the trial.
    """

    def __init__(self, candidates: Sequence[Hashable], min_bytes: int, *, warmup: int = WARMUP,
                 samples: int = SAMPLES, margin: float = MARGIN) -> None:
        if len(candidates) < 2:
            raise ValueError("a trial needs at least two candidates")
        self.candidates = tuple(candidates)
        self.min_bytes, self.warmup, self.samples, self.margin = min_bytes, warmup, samples, margin
        self._calls = 0
        self._times: list[list[float]] = [[] for _ in self.candidates]

    def candidate_for(self, nbytes: int) -> Hashable | None:
        """The candidate for this allreduce (the default during the warm-up), or None: not part of the trial."""
        if nbytes < self.min_bytes:
            return None
        k = self._calls - self.warmup
        self._calls += 1
        return self.candidates[0] if k < 0 else self.candidates[k % len(self.candidates)]

    def record(self, candidate: Hashable, seconds: float, nbytes: int) -> None:
        """The time of the allreduce :meth:`candidate_for` last answered (ignored during the warm-up)."""
        if self._calls > self.warmup:
            self._times[self.candidates.index(candidate)].append(seconds / max(1, nbytes))

    @property
    def complete(self) -> bool:
        return all(len(t) >= self.samples for t in self._times)

    def medians(self) -> np.ndarray:
        """This member's median seconds per byte of each candidate (to be summed over the members)."""
        return np.array([statistics.median(t) for t in self._times], np.float64)

    def choose(self, summed: np.ndarray) -> Hashable:
        """What every member keeps, from the members' summed medians (the same array on every member)."""
        best = int(np.argmin(summed))
        if best and summed[best] >= (1.0 - self.margin) * summed[0]:
            best = 0
        return self.candidates[best]
