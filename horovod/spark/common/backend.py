"""Where an estimator's training function runs: upstream's ``Backend`` interface and ``SparkBackend``.

How an estimator uses it: ``HorovodEstimator`` makes ``SparkBackend(num_proc, verbose=...)`` unless the user
passed ``backend=`` (both is upstream's ``ValueError``), reads ``backend.num_processes()`` to size the Parquet
data, and calls ``backend.run(train_fn, args=..., env=...)``: one result per rank, rank 0's first.  A custom
backend (tests, another cluster manager) implements the same two methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Backend", "SparkBackend"]


class Backend:
    """Runs a function as a Horovod job (interface)."""

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            env: Mapping[str, Any] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every process; return their results in rank order."""
        raise NotImplementedError()

    def num_processes(self) -> int:
        """How many processes ``run`` starts."""
        raise NotImplementedError()


class SparkBackend(Backend):
    """``horovod.spark.run`` with fixed settings (upstream's keyword arguments go through to it).

    ``env`` adds variables to the workers' environment (on top of the executor's); ``CUDA_VISIBLE_DEVICES`` of the
    driver is never passed on (the executors decide their devices).
    """

    def __init__(self, num_proc: int | None = None, env: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._num_proc = num_proc
        self._env = dict(env or {})
        self._kwargs = kwargs

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
            env: Mapping[str, Any] | None = None) -> list[Any]:
        import horovod.spark

        full_env = {**self._env, **(env or {})}
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        return horovod.spark.run(fn, args=args, kwargs=kwargs, num_proc=self._num_proc, env=full_env, **self._kwargs)

    def num_processes(self) -> int:
        if self._num_proc is not None:
            return int(self._num_proc)
        from horovod.spark.runner import _spark_context

        return int(_spark_context().defaultParallelism)

