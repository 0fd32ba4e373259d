"""Keras elastic training under a real fault: kill -9 of a worker mid-epoch, every sample exactly once.

The job (``worker_keras.py``) uses ``hvd.elastic.run``, ``KerasState``, ``ElasticBatches`` and the
``RecordBatchCallback``/``CommitStateCallback`` callbacks; its model is exactly additive, so the final
weights must equal the fault-free ones and each sample must be counted once per epoch.
"""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(120) if hasattr(pytest.mark, "timeout") else []


def test_keras_kill_worker_mid_epoch(elastic_job):
    job = elastic_job(["localhost:1", "127.0.0.1:1"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
                      worker="worker_keras.py", samples=48, batch=2, epochs=2, sleep=0.05)
    job.wait_steps(5, size=2, timeout=90)
    epoch, _, _ = job.progress()
    assert epoch == 0  # mid-epoch: 12 steps per epoch on 2 workers
    os.kill(job.pid("127.0.0.1:0"), signal.SIGKILL)
    assert job.wait() == 0, job.output()
    result = job.result()
    assert result["uses"] == [2] * 48, result
    assert result["w"] == result["expected_w"], result
    assert result["sizes"] == [2, 1], result
    assert "blacklisting host 127.0.0.1" in job.log_text()
    job.assert_no_leftovers()
