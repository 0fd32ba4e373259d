"""Autotune's search and bookkeeping, checked against known synthetic score functions (no job needed)."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from horovod.base.config import EnvVarError, explicit_knobs, read_runtime_config
from horovod.runtime.autotune import (
    CYCLE_MS_BOUNDS,
    FUSION_MB_BOUNDS,
    LOG_HEADER,
    MIB,
    SEED_POINTS,
    BayesianOptimizer,
    GaussianProcess,
    ParameterManager,
    Params,
    expected_improvement,
)

OPT_MB, OPT_MS = 48.0, 75.0


def bowl(mb: float, ms: float) -> float:
    """A smooth score with its maximum (1.0) at (48 MB, 75 ms), away from the seed points."""
    return 1.0 - ((mb - OPT_MB) / 64) ** 2 - ((ms - OPT_MS) / 100) ** 2


@pytest.mark.parametrize("noise", [0.8, 0.1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bayesian_search_finds_the_optimum(noise, seed):
    bo = BayesianOptimizer([FUSION_MB_BOUNDS, CYCLE_MS_BOUNDS], noise, seeds=SEED_POINTS, seed=seed)
    bo.add([128, 1], bowl(64, 1))  # the defaults, outside the box: they count at its edge
    for _ in range(19):
        bo.add(point := bo.suggest(), bowl(*point))
        assert FUSION_MB_BOUNDS[0] <= point[0] <= FUSION_MB_BOUNDS[1]
        assert CYCLE_MS_BOUNDS[0] <= point[1] <= CYCLE_MS_BOUNDS[1]
    (mb, ms), score = bo.best()
    assert abs(mb - OPT_MB) < 8 and abs(ms - OPT_MS) < 12, (mb, ms)  # of ranges 64 and 100
    # better than the best seed point by a margin: the GP + EI steps did the work
    assert score > max(bowl(*s) for s in SEED_POINTS) + 0.01


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bayesian_search_with_noisy_scores(seed):
    """Scores with noise (sd 0.1): the result is still truly better than the seeds, and no point is measured
    twice."""
    rng = np.random.default_rng(100 + seed)
    bo = BayesianOptimizer([FUSION_MB_BOUNDS, CYCLE_MS_BOUNDS], 0.8, seeds=SEED_POINTS, seed=seed)
    points = []
    for _ in range(20):
        points.append(point := bo.suggest())
        bo.add(point, bowl(*point) + rng.normal(0, 0.1))
    (mb, ms), _ = bo.best()
    assert bowl(mb, ms) > 0.92, (mb, ms)  # truly better than every seed point (0.875 at best)
    unit = np.array(bo.x)
    distances = np.sqrt(((unit[:, None] - unit[None]) ** 2).sum(-1)) + np.eye(len(unit))
    assert distances.min() >= 0.02


def test_bayesian_search_tries_the_seeds_first():
    bo = BayesianOptimizer([FUSION_MB_BOUNDS, CYCLE_MS_BOUNDS], 0.8, seeds=SEED_POINTS)
    tried = []
    for _ in SEED_POINTS:
        tried.append(tuple(bo.suggest()))
        bo.add(tried[-1], 0.0)
    assert tried == [tuple(map(float, s)) for s in SEED_POINTS]


def test_gaussian_process_interpolates_and_is_unsure_far_away():
    x = np.linspace(0, 0.5, 8)[:, None]
    y = np.sin(6 * x[:, 0])
    gp = GaussianProcess(1e-4).fit(x, y)
    mu, sigma = gp.predict(np.array([[0.25], [0.95]]))
    assert abs(mu[0] - np.sin(1.5)) < 0.02
    assert sigma[0] < 0.05 < sigma[1]


def test_expected_improvement():
    mu = np.array([1.0, 0.0, 0.0, 0.5])
    sigma = np.array([1e-15, 1e-15, 1.0, 0.1])
    ei = expected_improvement(mu, sigma, best=0.5, xi=0.0)
    assert ei[0] == 0.0 and ei[1] == 0.0  # no uncertainty: nothing to expect (even above best)
    assert ei[2] == pytest.approx(0.5 * 0.3085 * -1 + 1.0 * 0.3521, abs=1e-3)  # imp*Phi(z) + sigma*phi(z)
    assert ei[3] == pytest.approx(0.1 / np.sqrt(2 * np.pi), rel=1e-6)


def test_params_wire_and_row():
    p = Params(True, False, False, True, 12.5, 3 * MIB)
    assert Params.unpack(p.pack()) == p
    assert p.row(4.25) == f"1,0,0,1,12.5,{3 * MIB},4.25"
    with pytest.raises(ValueError):
        Params.unpack(p.pack()[:-1])


class FakeJob:
    """Drives a ParameterManager as the engine does: one fused response per step, whose duration depends on
    the current parameters (score = bytes / us)."""

    def __init__(self, manager: ParameterManager, step_us) -> None:
        self.manager = manager
        self.step_us = step_us
        self.now = 0.0
        manager._clock = lambda: self.now
        self.applied = [manager.current]

    def run(self, max_steps: int, nbytes: int = 1000) -> None:
        """Steps until the search is over (at most ``max_steps``)."""
        names = [f"grad.{i}" for i in range(5)]
        for _ in range(max_steps):
            if not self.manager.active:
                return
            new = self.manager.update(names, nbytes)
            if new is not None:
                self.applied.append(new)
            self.now += self.step_us(self.manager.current) * 1e-6


def _rows(path) -> list[list[str]]:
    return list(csv.reader(io.StringIO(path.read_text())))


def test_manager_tunes_logs_and_keeps_the_best(tmp_path):
    log = tmp_path / "autotune.csv"

    def step_us(p: Params) -> float:  # faster near the optimum, and with the cache on
        return 1000.0 * (2.0 - bowl(p.fusion_threshold / MIB, p.cycle_time_ms)) * (1.0 if p.cache_enabled else 1.3)

    manager = ParameterManager(Params(), {"fusion_threshold", "cycle_time_ms", "cache_enabled"},
                               warmup_samples=2, steps_per_sample=3, bayes_opt_max_samples=12, noise=0.1,
                               log_path=str(log))
    job = FakeJob(manager, step_us)
    job.run(10_000)
    assert not manager.active
    rows = _rows(log)
    assert ",".join(rows[0]) == LOG_HEADER
    trials = rows[1:-1]
    assert len(trials) == 12 + 2  # warm-up trials are not logged; the cache is tried both ways
    best = rows[-1]
    assert best in trials[-2:]  # the better of the cache's two trials, on the Bayesian stage's result
    assert best == max(trials[-2:], key=lambda r: float(r[-1]))
    assert best[3] == "1"  # cache on wins
    mb, ms = int(best[5]) / MIB, float(best[4])
    assert abs(mb - OPT_MB) < 12 and abs(ms - OPT_MS) < 25, best
    first = trials[0]
    assert first[4:6] == ["1", str(128 * MIB)]  # the first trial measures the defaults
    assert [r[4:6] for r in trials[1:5]] == [[f"{ms:g}", str(int(mb * MIB))] for mb, ms in SEED_POINTS]
    # scores are bytes per microsecond of the sample's steps: check one against the model
    expected = 1000 / step_us(Params(cycle_time_ms=1.0, fusion_threshold=128 * MIB))
    assert float(first[-1]) == pytest.approx(expected, rel=1e-3)
    # what the engine was told to apply: every trial's parameters, the best last
    assert job.applied[-1] == manager.current and manager.current.row(0).split(",")[:6] == best[:6]
    assert len(job.applied) == 1 + len(trials)


def test_manager_leaves_explicit_knobs_alone(tmp_path):
    log = tmp_path / "autotune.csv"
    manager = ParameterManager(Params(fusion_threshold=8 * MIB), {"cycle_time_ms"}, warmup_samples=0,
                               steps_per_sample=1, bayes_opt_max_samples=6, noise=0.8, log_path=str(log))
    job = FakeJob(manager, lambda p: 100 + abs(p.cycle_time_ms - 40))
    job.run(10_000)
    assert not manager.active
    rows = _rows(log)[1:]
    assert len(rows) == 6 + 1
    assert {r[5] for r in rows} == {str(8 * MIB)} and {r[3] for r in rows} == {"1"}
    assert len({r[4] for r in rows[:-1]}) == 6  # every trial a different cycle time


def test_nothing_to_tune_is_inactive(tmp_path):
    manager = ParameterManager(Params(), set(), log_path=str(tmp_path / "log.csv"))
    assert not manager.active and manager.update(["a"], 10) is None
    assert _rows(tmp_path / "log.csv") == [LOG_HEADER.split(",")]


def _autotune_values(config) -> tuple:
    return (config.autotune, config.autotune_log, config.autotune_warmup_samples, config.autotune_steps_per_sample,
            config.autotune_bayes_opt_max_samples, config.autotune_gaussian_process_noise)


def test_autotune_knobs():
    config = read_runtime_config({})
    assert _autotune_values(config) == (False, "", 3, 10, 20, 0.8)
    config = read_runtime_config({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "t.csv",
                                  "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
                                  "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5",
                                  "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0"})
    assert _autotune_values(config) == (True, "t.csv", 0, 2, 5, 0)
    assert explicit_knobs({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": ""}) == {"fusion_threshold"}


@pytest.mark.parametrize("name,value,text", [
    ("HOROVOD_AUTOTUNE", "maybe", "is not a boolean"),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5", "must be <= 1"),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "-0.1", "must be >= 0"),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "nan", "is not a number in [0, 1]"),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0", "must be >= 1"),
    ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "0", "must be >= 1"),
    ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "-1", "must be >= 0"),
    ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "3 samples", "is not a number of samples"),
])
def test_autotune_knob_errors(name, value, text):
    with pytest.raises(EnvVarError) as e:
        read_runtime_config({name: value})
    assert str(e.value).startswith(f"{name}={value!r}") and text in str(e.value)
