"""examples/ray run as written (each starts its own local Ray)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get("HOROVOD_TEST_REQUIRE_RAY") != "1":
    # ray.util: without ray, `import ray` may find the namespace package tests/ray
    pytest.importorskip("ray.util", reason="ray is not installed (pip install 'horovod[ray]')")


@pytest.mark.slow
def test_torch_example():
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "RAY_ADDRESS"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "ray", "ray_torch.py"), "--epochs", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all 2 ranks agree on the model: True" in proc.stdout
    assert "{'rank': 1, 'size': 2, 'local_rank': 1" in proc.stdout
