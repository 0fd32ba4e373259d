"""Spark configuration pairs for Elastic Horovod on Spark (upstream's ``horovod.spark.conf``).

Each ``SPARK_CONF_*`` pair is ``(key, value)``, ready for ``SparkConf().setAll([...])`` or
``SparkSession.builder.config(*pair)``.  :func:`horovod.spark.run_elastic` needs Spark to retry a failed task
(``spark.task.maxFailures`` > 1; :data:`SPARK_CONF_ALWAYS_RESTART_FAILED_TASK` leaves the retry limit to
Horovod's ``reset_limit``), and, on clusters, not to exclude the executors or nodes whose task failed.

The ``spark.blacklist.*`` keys are Spark 2/3.0's names; Spark 3.1 renamed them ``spark.excludeOnFailure.*``
(the old names were accepted until Spark 4 dropped them).  :func:`exclude_on_failure` gives a pair under the new
name.
"""

from __future__ import annotations

SPARK_CONF_MAX_INT = "2147483647"
SPARK_CONF_MAX_INT_MINUS_ONE = "2147483646"

# Horovod counts resets itself (reset_limit): let Spark retry a failed task without limit.
SPARK_CONF_ALWAYS_RESTART_FAILED_TASK = ("spark.task.maxFailures", SPARK_CONF_MAX_INT)

SPARK_CONF_BLACKLIST_DISABLED = ("spark.blacklist.enabled", "false")
SPARK_CONF_BLACKLIST_ENABLED = ("spark.blacklist.enabled", "true")

# The pairs below matter only with the blacklist enabled.  Per stage: may an executor whose task failed run
# other tasks, may a node with a failed executor run other tasks.
SPARK_CONF_REUSE_FAILED_EXECUTOR = ("spark.blacklist.stage.maxFailedTasksPerExecutor", SPARK_CONF_MAX_INT)
SPARK_CONF_DONT_REUSE_FAILED_EXECUTOR = ("spark.blacklist.stage.maxFailedTasksPerExecutor", "1")
SPARK_CONF_REUSE_FAILING_NODE = ("spark.blacklist.stage.maxFailedExecutorsPerNode", SPARK_CONF_MAX_INT_MINUS_ONE)
SPARK_CONF_DONT_REUSE_FAILING_NODE = ("spark.blacklist.stage.maxFailedExecutorsPerNode", "1")

# Per task: may a retry of a failed task run on the same executor / the same node (always, once, never).
SPARK_CONF_REUSE_EXECUTOR_ALWAYS_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerExecutor",
                                                  SPARK_CONF_MAX_INT)
SPARK_CONF_REUSE_EXECUTOR_ONCE_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerExecutor", "2")
SPARK_CONF_DONT_REUSE_EXECUTOR_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerExecutor", "1")
SPARK_CONF_REUSE_NODE_ALWAYS_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerNode",
                                              SPARK_CONF_MAX_INT_MINUS_ONE)
SPARK_CONF_REUSE_NODE_ONCE_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerNode", "2")
SPARK_CONF_DONT_REUSE_NODE_FOR_SAME_TASK = ("spark.blacklist.task.maxTaskAttemptsPerNode", "1")

# Across the application (with dynamic allocation, only executors excluded for the whole application can be
# reclaimed by the cluster manager).
SPARK_CONF_REUSE_FAILED_EXECUTOR_IN_APP = ("spark.blacklist.application.maxFailedTasksPerExecutor",
                                           SPARK_CONF_MAX_INT)
SPARK_CONF_DONT_REUSE_FAILED_EXECUTOR_IN_APP = ("spark.blacklist.application.maxFailedTasksPerExecutor", "1")
SPARK_CONF_REUSE_FAILING_NODE_IN_APP = ("spark.blacklist.application.maxFailedExecutorsPerNode", SPARK_CONF_MAX_INT)
SPARK_CONF_DONT_REUSE_FAILING_NODE_IN_APP = ("spark.blacklist.application.maxFailedExecutorsPerNode", "1")

# Spark's defaults of these keys (https://spark.apache.org/docs/latest/configuration.html#scheduling).
SPARK_CONF_DEFAULT_VALUES = {
    "spark.task.maxFailures": "4",
    "spark.blacklist.enabled": "false",
    "spark.blacklist.stage.maxFailedTasksPerExecutor": "2",
    "spark.blacklist.stage.maxFailedExecutorsPerNode": "2",
    "spark.blacklist.task.maxTaskAttemptsPerExecutor": "1",
    "spark.blacklist.task.maxTaskAttemptsPerNode": "2",
    "spark.blacklist.application.maxFailedTasksPerExecutor": "2",
    "spark.blacklist.application.maxFailedExecutorsPerNode": "2",
}


def exclude_on_failure(pair: tuple[str, str]) -> tuple[str, str]:
    """``pair`` under Spark 3.1+'s name (``spark.blacklist.X`` -> ``spark.excludeOnFailure.X``); other keys as they
    are.  Not in upstream."""
    key, value = pair
    return key.replace("spark.blacklist.", "spark.excludeOnFailure.", 1), value
