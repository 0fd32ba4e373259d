"""Upstream's ``horovod.ray.elastic_v2``: the elastic job of ``RayExecutor(min_workers=...)``.

:class:`ElasticAdapter` is upstream's adapter class over :class:`~horovod.ray.runner.RayExecutor`'s elastic mode
(the implementation lives in :mod:`horovod.ray.elastic`); :class:`ElasticParams` holds its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from horovod.ray.adapter import BaseParams, _ExecutorAdapter
from horovod.ray.elastic import RayHostDiscovery, TestDiscovery

__all__ = ["ElasticParams", "ElasticAdapter", "RayHostDiscovery", "TestDiscovery"]


@dataclass
class ElasticParams(BaseParams):
    """Parameters of an elastic job (see :class:`horovod.ray.RayExecutor` for each)."""

    min_workers: int = 1
    max_workers: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None
    elastic_timeout: int = 600
    override_discovery: bool = True

    @property
    def elastic(self) -> bool:
        return True

    @property
    def adapter(self) -> type:
        return ElasticAdapter


class ElasticAdapter(_ExecutorAdapter):
    """Upstream's elastic adapter: ``start()`` starts the elastic driver, ``run(fn)`` runs the job (one new actor
    per slot discovery finds; ``fn`` should use ``hvd.elastic.run``) and returns the final workers' results.

    ``override_discovery`` sets ``settings.discovery`` to a :class:`RayHostDiscovery` of these resources.
    ``execute``, ``run_remote`` and ``execute_single`` raise ``NotImplementedError`` (the elastic mode of
    RayExecutor has no such calls).
    """

    def __init__(self, settings: Any, min_workers: int, max_workers: int | None = None, use_gpu: bool = False,
                 cpus_per_worker: int = 1, gpus_per_worker: int | None = None, override_discovery: bool = True,
                 reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
                 elastic_timeout: int = 600) -> None:
        from horovod.ray.runner import RayExecutor

        self.settings = settings
        self.executor = RayExecutor(settings, min_workers=min_workers, max_workers=max_workers, use_gpu=use_gpu,
                                    cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker,
                                    override_discovery=override_discovery, reset_limit=reset_limit,
                                    cooldown_range=cooldown_range, elastic_timeout=elastic_timeout)
        self.min_workers = self.num_workers = min_workers
        self.max_workers = max_workers
        self.cpus_per_worker, self.use_gpu, self.gpus_per_worker = cpus_per_worker, use_gpu, gpus_per_worker
        self.reset_limit, self.cooldown_range, self.elastic_timeout = reset_limit, cooldown_range, elastic_timeout
