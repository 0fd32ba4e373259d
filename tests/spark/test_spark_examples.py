"""examples/spark run as written (each starts its own local Spark)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get("HOROVOD_TEST_REQUIRE_SPARK") != "1":
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'horovod[spark]')",
                        exc_type=ImportError)
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime for Spark", allow_module_level=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_example():
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "spark", "spark_torch.py"), "--epochs", "10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^\[0\]<stdout>:epoch 10: loss \d", proc.stdout, re.M), proc.stdout[-3000:]
    match = re.search(r"^2 ranks finished; final loss ([\d.]+); rank 0 returned 97 trained parameters$", proc.stdout,
                      re.M)
    assert match, proc.stdout[-3000:]
    assert float(match.group(1)) < 0.35  # it learned: the untrained model's loss is 0.55
