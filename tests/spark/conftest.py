"""Fixtures of the Spark estimator tests: one local Spark for the modules, skipped (or, in CI, failed) without Spark.

``estimator_spark`` starts ``local[2]`` (two task slots: the estimators train with ``num_proc=2``); modules that
need other settings (tests/spark/test_spark_run.py) make their own session with ``spark_session.py``.
"""

from __future__ import annotations

import pytest
from spark_session import local_spark_session, skip_or_fail_without_spark


@pytest.fixture(scope="module")
def estimator_spark(request):
    """A local Spark session with two task slots, shared by the modules that use it: a SparkContext's start and
    its first job (Python workers, the JIT) cost seconds per module.  Stopped after the last module of the run
    that uses it; a module in between that needs other settings stops it (``local_spark_session``) and the
    next module that uses it starts it again."""
    skip_or_fail_without_spark()
    session = local_spark_session("local[2]", "horovod-estimator-tests", **{"spark.sql.shuffle.partitions": "4",
                                                                            "spark.default.parallelism": "2"})
    users = [item.module for item in request.session.items if "estimator_spark" in item.fixturenames]
    try:
        yield session
    finally:
        if not users or users[-1] is request.module:
            session.stop()
