"""Autotune across two namespace hosts with two ranks each: the global set's collectives are hierarchical, so
hierarchical allreduce and allgather are tuned too, every rank switches them at the same point (a rank that
switched alone would deadlock or corrupt the sums), and the results stay right (see tests/test_autotune.py)."""

from __future__ import annotations

import sys

import pytest
from test_autotune import BAYES, JOB, STEPS_MULTIHOST, STEPS_PER_SAMPLE, WARMUP, check_log_and_histories

pytestmark = pytest.mark.timeout(300)


def test_autotune_tunes_hierarchical_collectives(netns_hosts, tmp_path):
    tmp_path.chmod(0o777)
    log = tmp_path / "autotune.csv"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": str(WARMUP), "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": str(STEPS_PER_SAMPLE),
           "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(BAYES)}
    proc = netns_hosts.horovodrun("hvdh1", ["-np", "4", "-H", "hvdh2:2,hvdh3:2", sys.executable, str(script),
                                            str(tmp_path), str(STEPS_MULTIHOST)], timeout=280, env_extra=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    trials = check_log_and_histories(tmp_path, 4, log, booleans=3)
    assert {r[0] for r in trials[:BAYES]} == {"1"} and {r[1] for r in trials[:BAYES]} == {"1"}  # on by default
    assert {r[0] for r in trials[BAYES:BAYES + 2]} == {"0", "1"}  # hierarchical allreduce off, then on
    assert {r[1] for r in trials[BAYES + 2:BAYES + 4]} == {"0", "1"}  # then hierarchical allgather
