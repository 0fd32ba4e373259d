"""``horovod.spark.run`` on ``local-cluster[2,1,1024]``: two executor JVMs, each with its own Python workers,
and a driver reached over the host's address (``spark.driver.host``), as on a real cluster.

Runs in a subprocess: a process has one SparkContext, and tests/spark/test_spark_run.py holds a local one.
"""

from __future__ import annotations

import json
import os
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

SCRIPT = r'''
import json, os
import numpy as np
from pyspark.sql import SparkSession
import horovod.spark

def fn():
    import horovod.numpy as hvd
    hvd.init()
    import psutil
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
    jvm = psutil.Process()
    while jvm is not None and jvm.name() != "java":  # worker <- watchdog <- Python worker <- daemon <- executor
        jvm = jvm.parent()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "sum": float(total[0]), "jvm": jvm.pid if jvm else None}

spark = (SparkSession.builder.master("local-cluster[2,1,1024]").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
try:
    # Waits for the executors' task slots; two executor JVMs can take long to start on a busy machine.
    results = horovod.spark.run(fn, num_proc=2, start_timeout=180)
    print("RESULT " + json.dumps({"results": results}), flush=True)
finally:
    spark.stop()
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_on_two_executor_jvms():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line[len("RESULT "):])
    results = report["results"]
    jvms = [r["jvm"] for r in results]
    assert None not in jvms and jvms[0] != jvms[1], f"both ranks under one executor JVM: {jvms}"
    assert [r["rank"] for r in results] == [0, 1]
    # One machine (one host hash): both ranks are local to each other, as under horovodrun on one host.
    assert [(r["size"], r["local_rank"], r["local_size"]) for r in results] == [(2, 0, 2), (2, 1, 2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert "[0]<stdout>:" not in proc.stderr
