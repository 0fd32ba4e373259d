"""Horovod on Apache Spark: ``horovod.spark.run(fn, num_proc=...)`` runs ``fn`` as a Horovod job in Spark tasks.

Nothing heavy is imported here: ``pyspark`` loads only when :func:`run` is called (the workers import
``horovod.spark._worker``, which never needs it).  How it works: docs/spark.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

__all__ = ["run", "run_elastic"]


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: int | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None, env: Mapping[str, Any] | None = None,
        stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
        nics: Sequence[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Horovod processes in Spark tasks; results in rank order.

    Upstream's signature and behaviour (docs/spark.md lists the differences).  Each process runs as a child
    of one task of a barrier-mode Spark stage; ``num_proc`` defaults to ``spark.default.parallelism``.

    Raises:
        Exception: no active SparkContext (upstream's text).
        TimeoutException: the Spark tasks did not all start within ``start_timeout`` (upstream's text, e.g.
            ``num_proc`` above the cluster's task slots).
        RuntimeError: a rank failed (upstream's text naming the first failed rank and its exit code, then
            that rank's error), or the Spark job failed or was cancelled.
        ValueError: bad arguments (``use_mpi=True`` is not available under Spark here).
    """
    from horovod.spark.runner import run as _run

    return _run(fn, args=args, kwargs=kwargs, num_proc=num_proc, start_timeout=start_timeout, use_mpi=use_mpi,
                use_gloo=use_gloo, extra_mpi_args=extra_mpi_args, env=env, stdout=stdout, stderr=stderr,
                verbose=verbose, nics=nics, prefix_output_with_timestamp=prefix_output_with_timestamp,
                executable=executable)


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: int | None = None, elastic_timeout: int | None = None,
                reset_limit: int | None = None, env: Mapping[str, Any] | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
                nics: Sequence[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
                min_np: int | None = None, max_np: int | None = None) -> list[Any]:
    """Run ``fn`` as an Elastic Horovod job whose hosts are Spark tasks; results of the final ranks, in rank order.

    Upstream's signature and behaviour: ``max_num_proc`` Spark tasks (ordinary, not barrier), each task attempt
    a host of one slot; the job runs while at least ``min_num_proc`` of them are alive, a failed task is
    retried by Spark (``spark.task.maxFailures`` must be > 1, e.g. master ``local[2,4]``) and joins as a new
    host.  ``fn`` uses ``hvd.elastic.run`` and a ``State`` as under ``horovodrun --min-np``.  docs/spark.md.

    Raises:
        Exception: no active SparkContext (upstream's text).
        TimeoutException: ``num_proc`` tasks did not start within ``start_timeout``.
        RuntimeError: the elastic job failed (reset limit, too few hosts for ``elastic_timeout``, every
            worker failed) or the Spark job failed.
    """
    from horovod.spark.elastic import run_elastic as _run_elastic

    return _run_elastic(fn, args=args, kwargs=kwargs, num_proc=num_proc, min_num_proc=min_num_proc,
                        max_num_proc=max_num_proc, start_timeout=start_timeout, elastic_timeout=elastic_timeout,
                        reset_limit=reset_limit, env=env, stdout=stdout, stderr=stderr, verbose=verbose, nics=nics,
                        prefix_output_with_timestamp=prefix_output_with_timestamp, min_np=min_np, max_np=max_np)
