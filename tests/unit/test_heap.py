"""With ``HOROVOD_RETAIN_HEAP=1``, hvd.init() keeps glibc from handing the heap's top back after every step
(horovod/common/heap.py).

The step below allocates two 6 MB buffers and frees them, as a training step does with its activations and
gradients; with glibc's defaults each repetition faults the memory in again (the threshold glibc moves as the
program runs keeps such buffers mmapped), with the knob none does.  Each case runs in a fresh process:
the settings are per process and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STEP = """
import json, resource, numpy as np
import horovod.numpy as hvd
hvd.init()
def step():
    a = np.ones(6 << 17); b = np.ones(6 << 17)
    del b, a
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20))
hvd.shutdown()
"""


def _faults_per_step(retain: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if retain is not None:
        env["HOROVOD_RETAIN_HEAP"] = retain
    out = subprocess.run([sys.executable, "-c", STEP], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_init_keeps_the_heap_between_steps_when_asked():
    # 1536 pages are allocated per step: with glibc's defaults they are faulted in again each time
    assert _faults_per_step(None) > 500, "glibc no longer hands these buffers back: the test proves nothing here"
    assert _faults_per_step("0") > 500
    assert _faults_per_step("1") < 50
