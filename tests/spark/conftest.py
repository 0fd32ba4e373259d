"""Fixtures of the Spark estimator tests: one local Spark per test module, skipped (or, in CI, failed) without Spark.

``estimator_spark`` starts ``local[2]`` (two task slots: the estimators train with ``num_proc=2``); modules that
need other settings (tests/spark/test_spark_run.py) make their own session.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_SPARK = os.environ.get("HOROVOD_TEST_REQUIRE_SPARK") == "1"


def skip_or_fail_without_spark() -> None:
    """Skip the caller when pyspark or Java is missing; fail instead under HOROVOD_TEST_REQUIRE_SPARK=1."""
    reason = None
    try:
        import pyspark  # noqa: F401
    except ImportError as e:
        reason = f"pyspark is not installed ({e}); pip install 'horovod[spark]'"
    if reason is None and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        reason = "no Java runtime (java not on PATH, JAVA_HOME unset); Spark needs Java 17+"
    if reason is None:
        return
    if REQUIRE_SPARK:
        pytest.fail(f"Spark tests required (HOROVOD_TEST_REQUIRE_SPARK=1) but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def estimator_spark():
    """A local Spark session with two task slots, stopped after the module."""
    skip_or_fail_without_spark()
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("horovod-estimator-tests")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1")
               .config("spark.sql.shuffle.partitions", "4").config("spark.default.parallelism", "2")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
