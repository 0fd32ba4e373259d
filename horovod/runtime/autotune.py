"""Autotune (``HOROVOD_AUTOTUNE=1``): rank 0 searches the engine's performance knobs while the job trains.

What is tuned is what exists in this engine:

* ``tensor_fusion_threshold`` (bytes, searched in [0, 64] MiB): the coordinator's fusion limit.  Only rank 0
  fuses, so a new value takes effect for the whole job at once.
* ``cycle_time_ms`` (searched in [0, 100] ms): there are no fixed cycles here; it bounds the *gather window*,
  how long the engine thread, woken by an asynchronous enqueue, lets more tensors join the round before it
  sends them (the window also ends as soon as the enqueuing thread waits for a result).
* ``cache_enabled``: the response cache on (``HOROVOD_CACHE_CAPACITY``) or off (every entry evicted, with
  the usual notices, so workers fall back to full requests in step).
* ``hierarchical_allreduce`` / ``hierarchical_allgather``: only when the global set's communicator is the
  hierarchical one (several hosts with several ranks each); otherwise they stay at their value and are
  logged as such.  ``torus_allreduce`` does not exist here and is always logged as 0.

Search, as upstream: fusion threshold and cycle time jointly by Bayesian optimisation (a Gaussian process
with an RBF kernel and Expected Improvement, xi = 0.01; the defaults first, then upstream's seed points
(4 MB, 5 ms), (32, 50), (16, 25), (8, 10), then the maximiser of EI) for ``bayes_opt_max_samples`` trials;
then each tunable boolean in upstream's chain order, both values tried with the best continuous values, the
better kept.  A knob the user set explicitly is fixed and left out.  Instead of upstream's L-BFGS with 25
restarts, EI is maximised over random candidates refined around the best few (two dimensions at most: cheap
and robust); the kernel's length scale is the one of a small grid that maximises the marginal likelihood.
Two choices for noisy hosts (measured on the shared 2-core machine, where one setting's score varied 2x
between trials): a point measured already is not proposed again (EI kept returning to a lucky corner), and
the Bayesian stage's result is the trial with the highest posterior mean, not the single highest score.

Scoring, as upstream: a *step* ends when a tensor name comes back; ``steps_per_sample`` steps make a sample,
scored as allreduced bytes per microsecond; a trial's score is the median of :data:`SAMPLES_PER_TRIAL`
samples; the first ``warmup_samples`` trials (of the initial parameters) are discarded.

Rank 0 decides; the engine sends each new :class:`Params` to every rank on the control channels right after
the responses already coordinated, so every rank applies it at the same point of the response stream.
The log (``HOROVOD_AUTOTUNE_LOG``, rank 0) is upstream's CSV: a header, one row per trial, last row = best.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["Params", "ParameterManager", "BayesianOptimizer", "GaussianProcess", "expected_improvement",
           "LOG_HEADER", "SAMPLES_PER_TRIAL", "FUSION_MB_BOUNDS", "CYCLE_MS_BOUNDS", "SEED_POINTS"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
LOG_HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,"
              "tensor_fusion_threshold,score")
SAMPLES_PER_TRIAL = 5  # upstream's median of 5
FUSION_MB_BOUNDS = (0.0, 64.0)
CYCLE_MS_BOUNDS = (0.0, 100.0)
SEED_POINTS = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0))  # upstream's (fusion MB, cycle ms)
_CATEGORICAL = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled")
_WIRE = struct.Struct("<4?dq")


@dataclasses.dataclass(frozen=True)
class Params:
    """One setting of the tuned knobs (what a log row and a control frame carry)."""

    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    torus_allreduce: bool = False
    cache_enabled: bool = True
    cycle_time_ms: float = 1.0
    fusion_threshold: int = 128 * MIB

    def pack(self) -> bytes:
        return _WIRE.pack(self.hierarchical_allreduce, self.hierarchical_allgather, self.torus_allreduce,
                          self.cache_enabled, self.cycle_time_ms, self.fusion_threshold)

    @classmethod
    def unpack(cls, payload: bytes) -> Params:
        """Raises ValueError for a payload of the wrong size."""
        try:
            return cls(*_WIRE.unpack(payload))
        except struct.error as e:
            raise ValueError(f"autotune parameters: {e}") from None

    def row(self, score: float) -> str:
        """The CSV row of upstream's autotune log (booleans as 0/1, threshold in bytes)."""
        return (f"{int(self.hierarchical_allreduce)},{int(self.hierarchical_allgather)},"
                f"{int(self.torus_allreduce)},{int(self.cache_enabled)},{self.cycle_time_ms:g},"
                f"{self.fusion_threshold},{score:.6g}")


# ---------------------------------------------------------------------------------------------- GP + EI
_LENGTH_SCALES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0)
_MIN_DISTANCE = 0.02  # in the unit box: closer to a measured point than this is "measured already"


def _rbf(a: np.ndarray, b: np.ndarray, length: float) -> np.ndarray:
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    return np.exp(-0.5 * d2 / (length * length))


class GaussianProcess:
    """GP regression on points in [0, 1]^d with an RBF kernel (unit variance) and ``noise`` added to the
    diagonal; targets are standardised, the length scale is chosen by marginal likelihood on a grid."""

    def __init__(self, noise: float) -> None:
        self.noise = max(float(noise), 1e-6)
        self.length = _LENGTH_SCALES[0]

    def fit(self, x: np.ndarray, y: np.ndarray) -> GaussianProcess:
        self._x = np.asarray(x, float)
        y = np.asarray(y, float)
        self._mean = float(y.mean())
        self._std = float(y.std()) or 1.0
        z = (y - self._mean) / self._std
        best = None
        for length in _LENGTH_SCALES:
            k = _rbf(self._x, self._x, length) + self.noise * np.eye(len(z))
            chol = np.linalg.cholesky(k)
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, z))
            loglik = -0.5 * z @ alpha - np.log(np.diag(chol)).sum()
            if best is None or loglik > best[0]:
                best = (loglik, length, chol, alpha)
        _, self.length, self._chol, self._alpha = best
        return self

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation at ``x``, in the targets' units."""
        ks = _rbf(np.asarray(x, float), self._x, self.length)
        mu = ks @ self._alpha
        v = np.linalg.solve(self._chol, ks.T)
        var = np.maximum(1.0 - (v * v).sum(0), 1e-12)
        return mu * self._std + self._mean, np.sqrt(var) * self._std


_erf = np.vectorize(math.erf, otypes=[float])


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float, xi: float = 0.01) -> np.ndarray:
    """EI of a maximisation: E[max(f - best - xi, 0)] under N(mu, sigma^2)."""
    imp = mu - best - xi
    z = imp / sigma
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return np.where(sigma > 1e-12, imp * cdf + sigma * pdf, 0.0)


class BayesianOptimizer:
    """Maximises an expensive noisy function over a box: seeds first, then the maximiser of EI."""

    def __init__(self, bounds: Sequence[tuple[float, float]], noise: float, *, xi: float = 0.01,
                 seeds: Sequence[Sequence[float]] = (), seed: int = 0) -> None:
        self.lo = np.array([b[0] for b in bounds], float)
        self.span = np.array([b[1] - b[0] for b in bounds], float)
        self.noise = noise
        self.xi = xi
        self._seeds = [np.asarray(s, float) for s in seeds]
        self._rng = np.random.default_rng(seed)
        self.x: list[np.ndarray] = []  # unit-box coordinates
        self.y: list[float] = []

    def _unit(self, point: Sequence[float]) -> np.ndarray:
        return np.clip((np.asarray(point, float) - self.lo) / self.span, 0.0, 1.0)

    def add(self, point: Sequence[float], score: float) -> None:
        """Record an observation (points outside the box count at the nearest point of the box)."""
        self.x.append(self._unit(point))
        self.y.append(float(score))

    def suggest(self) -> np.ndarray:
        """The next point to try, in the caller's units."""
        while self._seeds:
            seed = self._unit(self._seeds.pop(0))
            if not any(np.allclose(seed, x) for x in self.x):
                return self.lo + seed * self.span
        if len(self.x) < 2:
            return self.lo + self._rng.random(len(self.lo)) * self.span
        gp = GaussianProcess(self.noise).fit(np.array(self.x), np.array(self.y))
        best = float(gp.predict(np.array(self.x))[0].max())

        def ei(points: np.ndarray) -> np.ndarray:
            return expected_improvement(*gp.predict(points), best, self.xi)

        measured = np.array(self.x)

        def new_ei(points: np.ndarray) -> np.ndarray:
            # A point (almost) measured already is not proposed again: on a noisy host EI keeps coming back to
            # a lucky corner, and a trial spent there tells the search little.
            near = (((points[:, None, :] - measured[None, :, :]) ** 2).sum(-1) < _MIN_DISTANCE ** 2).any(1)
            return np.where(near, -1.0, ei(points))

        candidates = self._rng.random((1024, len(self.lo)))
        scores = new_ei(candidates)
        for scale in (0.05, 0.02, 0.005):  # refine around the best few
            top = candidates[np.argsort(scores)[-5:]]
            local = np.clip(np.repeat(top, 32, 0) + self._rng.normal(0, scale, (len(top) * 32, len(self.lo))),
                            0.0, 1.0)
            candidates = np.concatenate([top, local])
            scores = new_ei(candidates)
        return self.lo + candidates[int(np.argmax(scores))] * self.span

    def best_index(self) -> int:
        """The observation with the highest posterior mean: it weighs each score with its neighbours', so a
        single lucky sample on a noisy host does not win over a region that is consistently good."""
        if len(self.y) < 2:
            return 0
        gp = GaussianProcess(self.noise).fit(np.array(self.x), np.array(self.y))
        return int(np.argmax(gp.predict(np.array(self.x))[0]))

    def best(self) -> tuple[np.ndarray, float]:
        """The point of :meth:`best_index` in the caller's units, and its observed score."""
        i = self.best_index()
        return self.lo + self.x[i] * self.span, self.y[i]


# ---------------------------------------------------------------------------------------------- manager
class ParameterManager:
    """Rank 0's tuner: fed with what the engine executed, it returns the next :class:`Params` to apply.

    ``tunable``: the names of the :class:`Params` fields to search (``fusion_threshold``, ``cycle_time_ms``,
    ``hierarchical_allreduce``, ``hierarchical_allgather``, ``cache_enabled``); the others keep their
    initial value.
    """

    def __init__(self, initial: Params, tunable: set[str], *, warmup_samples: int = 3, steps_per_sample: int = 10,
                 bayes_opt_max_samples: int = 20, noise: float = 0.8, log_path: str = "",
                 samples_per_trial: int = SAMPLES_PER_TRIAL, clock: Callable[[], float] = time.monotonic,
                 seed: int = 0) -> None:
        self.current = initial
        self.best: tuple[Params, float] | None = None  # the result (and the score it was measured with)
        self.trials: list[tuple[Params, float]] = []
        self._warmup = warmup_samples
        self._steps = steps_per_sample
        self._samples_per_trial = samples_per_trial
        self._max_bayes = bayes_opt_max_samples
        self._clock = clock
        self._dims = [d for d in ("fusion_threshold", "cycle_time_ms") if d in tunable]
        bounds = {"fusion_threshold": FUSION_MB_BOUNDS, "cycle_time_ms": CYCLE_MS_BOUNDS}
        index = {"fusion_threshold": 0, "cycle_time_ms": 1}
        seeds = [[s[index[d]] for d in self._dims] for s in SEED_POINTS]
        self._bayes = BayesianOptimizer([bounds[d] for d in self._dims], noise, seeds=seeds, seed=seed) \
            if self._dims else None
        self._chain = [c for c in _CATEGORICAL if c in tunable]
        self._name = ""  # the boolean being tried
        self._pending_values: list[bool] = []  # its values still to try
        self._chain_trials: list[tuple[Params, float]] | None = None  # its trials so far
        self._base = initial  # the best so far, on which the booleans are tried
        self._base_score = 0.0
        self._counts: dict[str, int] = {}
        self._bytes = 0
        self._start: float | None = None
        self._samples: list[float] = []
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 - open for the whole search
        if self._log is not None:
            self._log.write(LOG_HEADER + "\n")
            self._log.flush()
        self.active = bool(self._dims or self._chain)
        if not self.active:
            log.warning("Autotune: every tunable parameter was set explicitly; nothing to tune")
            self._close_log()

    # -------------------------------------------------------------- input
    def update(self, names: Sequence[str], nbytes: int) -> Params | None:
        """Account one executed allreduce response; returns new parameters when they change."""
        if not self.active:
            return None
        now = self._clock()
        if self._start is None:
            self._start = now
        counts = self._counts
        steps = self._steps
        for name in names:
            c = counts.get(name, 0) + 1
            counts[name] = c
            if c > steps:  # a step beyond the sample's last began: the sample ends here
                elapsed_us = max((now - self._start) * 1e6, 1e-3)
                self._samples.append(self._bytes / elapsed_us)
                self._counts = counts = {n: 1 for n in names}
                self._bytes = 0
                self._start = now
                break
        self._bytes += nbytes
        if len(self._samples) < self._samples_per_trial:
            return None
        score = float(np.median(self._samples))
        self._samples = []
        return self._tune(score)

    # -------------------------------------------------------------- search
    def _restart_sampling(self) -> None:
        self._counts = {}
        self._bytes = 0
        self._start = None

    def _tune(self, score: float) -> Params | None:
        if self._warmup > 0:
            self._warmup -= 1
            log.debug("Autotune: warming up (%d remaining)", self._warmup)
            self._restart_sampling()
            return None
        params = self.current
        self.trials.append((params, score))
        log.info("Autotune: %s score %.4g bytes/us", params, score)
        self._write(params.row(score))
        nxt = self._next(params, score)
        self._restart_sampling()
        if nxt is None:
            self._finish()
            return self.current
        self.current = nxt
        return nxt

    def _next(self, params: Params, score: float) -> Params | None:
        """The parameters of the next trial, None when the search is over."""
        bo = self._bayes
        if bo is not None:
            bo.add([self._coord(params, d) for d in self._dims], score)
            if len(bo.y) < self._max_bayes:
                return self._with_point(params, bo.suggest())
            self._bayes = None
            self._base, self._base_score = self.trials[bo.best_index()]  # every trial so far was a Bayesian one
        elif self._chain_trials is not None:  # a trial of the current boolean
            self._chain_trials.append((params, score))
            if self._pending_values:
                return dataclasses.replace(self._base, **{self._name: self._pending_values.pop(0)})
            self._base, self._base_score = max(self._chain_trials, key=lambda t: t[1])
        else:
            self._base, self._base_score = params, score
        if not self._chain:
            return None
        self._name = self._chain.pop(0)
        value = getattr(self._base, self._name)
        self._pending_values = [value]  # both values, measured back to back
        self._chain_trials = []
        return dataclasses.replace(self._base, **{self._name: not value})

    @staticmethod
    def _coord(params: Params, dim: str) -> float:
        return params.fusion_threshold / MIB if dim == "fusion_threshold" else params.cycle_time_ms

    def _with_point(self, params: Params, point: Sequence[float]) -> Params:
        values = {}
        for d, v in zip(self._dims, point):
            values[d] = int(round(float(v) * MIB)) if d == "fusion_threshold" else round(float(v), 3)
        return dataclasses.replace(params, **values)

    def _finish(self) -> None:
        self.active = False
        self.best = params, score = self._base, self._base_score
        self.current = params
        log.info("Autotune: done after %d trials; best %s (%.4g bytes/us)", len(self.trials), params, score)
        self._write(params.row(score))
        self._close_log()

    # -------------------------------------------------------------- log
    def _write(self, line: str) -> None:
        if self._log is not None:
            self._log.write(line + "\n")
            self._log.flush()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """The engine stops: close the log (a search cut short keeps the rows written so far)."""
        self._close_log()
