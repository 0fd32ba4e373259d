"""Upstream's ``horovod.ray.adapter``: the interface of a job's driver side (``Adapter``) and its common parameters.

:class:`~horovod.ray.runner.RayExecutor` does the work here; :class:`~horovod.ray.runner.StaticAdapter` and
:class:`~horovod.ray.elastic_v2.ElasticAdapter` are thin adapters over it for code written against upstream's
adapter classes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Adapter", "BaseParams"]


@dataclass
class BaseParams:
    """Resources of each worker.  ``gpus_per_worker`` defaults to ``int(use_gpu)``.

    Raises:
        ValueError: ``gpus_per_worker`` without ``use_gpu``, or below 1.
    """

    cpus_per_worker: int = 1
    use_gpu: bool = False
    gpus_per_worker: int | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_worker and not self.use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False. use_gpu must be True if gpus_per_worker "
                             "is set. ")
        if self.use_gpu and isinstance(self.gpus_per_worker, int) and self.gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1: Got {self.gpus_per_worker}.")
        self.gpus_per_worker = self.gpus_per_worker or int(self.use_gpu)


class Adapter(abc.ABC):
    """The driver side of a Horovod job on Ray (static or elastic); :class:`RayExecutor`'s methods, one to one."""

    @abc.abstractmethod
    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None, extra_env_vars: dict | None = None) -> None:
        """Start the workers (static) or the elastic driver; build ``executable_cls`` in each worker."""

    @abc.abstractmethod
    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list[Callable] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""

    @abc.abstractmethod
    def run_remote(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; the ObjectRefs in rank order."""

    @abc.abstractmethod
    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources."""


class _ExecutorAdapter(Adapter):
    """An :class:`Adapter` whose calls go to a :class:`~horovod.ray.runner.RayExecutor` (``self.executor``)."""

    executor: Any

    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None, extra_env_vars: dict | None = None) -> None:
        self.executor.start(executable_cls, executable_args, executable_kwargs, extra_env_vars)

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None) -> list[Any]:
        return self.executor.execute(fn, callbacks)

    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list[Callable] | None = None) -> list[Any]:
        return self.executor.run(fn, args, kwargs, callbacks)

    def run_remote(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        return self.executor.run_remote(fn, args, kwargs)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        return self.executor.execute_single(fn)

    def shutdown(self) -> None:
        self.executor.shutdown()
