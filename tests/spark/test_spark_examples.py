"""examples/spark run as written, on the module's local Spark session."""

from __future__ import annotations

import os
import re
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get("HOROVOD_TEST_REQUIRE_SPARK") != "1":
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'horovod[spark]')",
                        exc_type=ImportError)
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime for Spark", allow_module_level=True)


@pytest.mark.slow
def test_torch_example(estimator_spark, monkeypatch, capsys):
    pytest.importorskip("torch")
    from estimator_checks import run_example

    out = run_example(os.path.join(REPO, "examples", "spark", "spark_torch.py"), ["--epochs", "10"], monkeypatch,
                      capsys)
    assert re.search(r"^\[0\]<stdout>:epoch 10: loss \d", out, re.M), out[-3000:]
    match = re.search(r"^2 ranks finished; final loss ([\d.]+); rank 0 returned 97 trained parameters$", out, re.M)
    assert match, out[-3000:]
    assert float(match.group(1)) < 0.35  # it learned: the untrained model's loss is 0.55
