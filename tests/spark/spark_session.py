"""Local Spark sessions for the tests in tests/spark, and the skip (or, in CI, failure) without Spark."""

from __future__ import annotations

import os
import shutil
from typing import Any

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


def local_spark_session(master: str, app_name: str, **conf: str) -> Any:
    """A quiet local Spark session (no UI, driver on the loopback address), with ``conf`` on top.  A running
    session of the same master and app (conftest.py's, shared by modules) is reused; one of another is stopped
    first (``getOrCreate()`` would hand it over, whatever the master)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkContext._active_spark_context
    if active is not None and (active.master != master or active.appName != app_name):
        SparkSession.builder.getOrCreate().stop()  # the running session (clears it as the active one too)

    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
