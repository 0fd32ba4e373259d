"""Fixtures of the Spark estimator tests: one local Spark per test module, skipped (or, in CI, failed) without Spark.

``estimator_spark`` starts ``local[2]`` (two task slots: the estimators train with ``num_proc=2``); modules that
need other settings (tests/spark/test_spark_run.py) make their own session with ``spark_session.py``.
"""

from __future__ import annotations

import pytest
from spark_session import local_spark_session, skip_or_fail_without_spark


@pytest.fixture(scope="module")
def estimator_spark():
    """A local Spark session with two task slots, stopped after the module."""
    skip_or_fail_without_spark()
    session = local_spark_session("local[2]", "horovod-estimator-tests", **{"spark.sql.shuffle.partitions": "4",
                                                                            "spark.default.parallelism": "2"})
    try:
        yield session
    finally:
        session.stop()
