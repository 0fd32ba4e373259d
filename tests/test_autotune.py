"""Autotune under the launcher: a training-like loop with ``HOROVOD_AUTOTUNE=1`` (or ``horovodrun --autotune``)
converges, rank 0 writes upstream's log, every rank switches to the same parameters at the same point of the
response stream, and every allreduce result stays right (numpy) while the parameters change."""

from __future__ import annotations

import csv
import json
import sys
import textwrap

import pytest
from launch_util import clean_env, launch, marked_processes

from horovod.runtime.autotune import LOG_HEADER, MIB

pytestmark = pytest.mark.skipif(bool(__import__("os").environ.get("HOROVOD_RANK")),
                                reason="drives the launcher itself")

# 12 small tensors (reduced by the coordinator) and 4 of 100-300 KB (fused on the data plane), values that
# differ per rank and per step; the expected sums are computed here with numpy.
JOB = textwrap.dedent("""\
    import json, os, sys
    import numpy as np
    import horovod.numpy as hvd
    from horovod.common.basics import engine

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shapes = [(64,), (300,), (7, 9)] * 4 + [(25_000,), (50_000,), (75_000,), (30_000,)]
    steps = int(sys.argv[2])
    for step in range(steps):
        xs = [np.arange(np.prod(s), dtype=np.float32).reshape(s) % 97 + (r + 1) * (step % 5) for s in shapes]
        handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"grad.{i}") for i, x in enumerate(xs)]
        for i, (h, s) in enumerate(zip(handles, shapes)):
            out = hvd.synchronize(h)
            base = np.arange(np.prod(s), dtype=np.float32).reshape(s) % 97
            expected = base * n + (n * (n + 1) / 2) * (step % 5)
            assert np.array_equal(out, expected), (step, i, out.ravel()[:4], expected.ravel()[:4])
    hist = [[at, list(vars(p).values())] for at, p in engine().autotune_history]
    with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
        json.dump({"history": hist}, f)
    hvd.shutdown()
""")

WARMUP, STEPS_PER_SAMPLE, BAYES = 1, 2, 5
# trials: Bayesian ones + the cache both ways; each is 5 samples of STEPS_PER_SAMPLE steps (+1 to start)
STEPS = (WARMUP + BAYES + 2) * (5 * STEPS_PER_SAMPLE + 1) + 15
# across hosts, hierarchical allreduce and allgather are tried both ways too
STEPS_MULTIHOST = (WARMUP + BAYES + 6) * (5 * STEPS_PER_SAMPLE + 1) + 15


def _check(tmp_path, np_, code, out, marker, log):
    assert not marked_processes(marker), "processes left behind"
    assert code == 0, out
    check_log_and_histories(tmp_path, np_, log, booleans=1)


def check_log_and_histories(tmp_path, np_, log, booleans: int) -> list[list[str]]:
    """The log has upstream's format and the search's trials (``booleans`` tried both ways after the Bayesian
    stage); every rank applied the same parameters at the same points.  Returns the trial rows."""
    rows = list(csv.reader(log.read_text().splitlines()))
    assert ",".join(rows[0]) == LOG_HEADER
    trials, best = rows[1:-1], rows[-1]
    assert len(trials) == BAYES + 2 * booleans, rows
    assert best in trials[-2:] and best == max(trials[-2:], key=lambda row: float(row[-1]))  # cache off/on
    assert all(float(row[-1]) > 0 for row in trials)
    assert trials[0][4:6] == ["1", str(128 * MIB)]  # the defaults are measured first
    assert len({(row[4], row[5]) for row in trials}) >= BAYES  # it searched
    assert {row[3] for row in trials[-2:]} == {"0", "1"}  # the cache off, then on
    histories = [json.loads((tmp_path / f"rank{r}.json").read_text())["history"] for r in range(np_)]
    assert all(h == histories[0] for h in histories[1:]), histories  # same parameters, same switch points
    applied = histories[0]
    assert len(applied) == len(trials)  # one switch after every trial, the last to the best
    last = applied[-1][1]  # hierarchical_allreduce, _allgather, torus, cache, cycle ms, threshold
    assert [str(int(v)) for v in last[:4]] + [f"{last[4]:g}", str(last[5])] == best[:6]
    assert [at for at, _ in applied] == sorted(at for at, _ in applied)
    return trials


def test_autotune_env_np2(tmp_path):
    log = tmp_path / "autotune.csv"
    env = clean_env(HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_LOG=str(log),
                    HOROVOD_AUTOTUNE_WARMUP_SAMPLES=str(WARMUP),
                    HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=str(STEPS_PER_SAMPLE),
                    HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES=str(BAYES))
    script = tmp_path / "job.py"
    script.write_text(JOB)
    code, out, marker = launch(2, [sys.executable, str(script), str(tmp_path), str(STEPS)], env=env, timeout=180)
    _check(tmp_path, 2, code, out, marker, log)


def test_autotune_flags_and_config_file_np3(tmp_path):
    """``--autotune`` and the log file as flags, the other settings from ``--config-file``'s autotune
    section."""
    log = tmp_path / "autotune.csv"
    config = tmp_path / "horovod.yaml"
    config.write_text(f"autotune:\n  warmup_samples: {WARMUP}\n  steps_per_sample: {STEPS_PER_SAMPLE}\n"
                      f"  bayes_opt_max_samples: {BAYES}\n  gaussian_process_noise: 0.5\n")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    code, out, marker = launch(3, ["--autotune", "--autotune-log-file", str(log), "--config-file", str(config),
                                   sys.executable, str(script), str(tmp_path), str(STEPS)],
                               env=clean_env(), timeout=240)
    _check(tmp_path, 3, code, out, marker, log)
