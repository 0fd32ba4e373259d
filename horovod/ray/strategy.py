"""Upstream's ``horovod.ray.strategy``: how a static job's workers are placed on the Ray cluster.

* :class:`PGStrategy` -- one placement-group bundle per worker, ``PACK`` (or the caller's current placement
  group, any bundle); what ``RayExecutor(num_workers=n)`` does;
* :class:`ColocatedStrategy` -- ``num_hosts`` bundles of ``num_workers_per_host`` workers each, ``STRICT_SPREAD``
  (one bundle per node); what ``RayExecutor(num_hosts=h, num_workers_per_host=w)`` does.

``create_workers()`` reserves the resources (``TimeoutError`` after ``settings.placement_group_timeout_s``),
starts one :class:`~horovod.ray.worker.BaseHorovodWorker` actor per rank (``world_rank``/``world_size`` set) and
returns ``(workers, node_workers)``: every worker in rank order, and one worker per host.  With GPUs the workers of
a node all see the union of that node's GPU ids (``CUDA_VISIBLE_DEVICES``).  ``shutdown()`` removes a placement
group the strategy created (an inherited one stays).  The Horovod environment (ranks, rendezvous) is
:class:`~horovod.ray.runner.RayExecutor`'s job, not the strategy's.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

import ray

from horovod.ray.utils import map_blocking
from horovod.ray.worker import BaseHorovodWorker

__all__ = ["create_placement_group", "BaseStrategy", "ColocatedStrategy", "PGStrategy", "PackStrategy"]

logger = logging.getLogger(__name__)


def create_placement_group(resources_per_bundle: dict[str, float], num_bundles: int, pg_timeout: float,
                           pg_strategy: str) -> tuple[Any, list[dict[str, float]]]:
    """A ready placement group of ``num_bundles`` copies of ``resources_per_bundle``, and its bundles.

    Raises:
        TimeoutError: not ready within ``pg_timeout`` seconds (the group is removed).
    """
    bundles = [dict(resources_per_bundle) for _ in range(num_bundles)]
    pg = ray.util.placement_group(bundles, strategy=pg_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=pg_timeout)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(
            "Placement group creation timed out. Make sure your cluster either has enough resources or use an "
            f"autoscaling cluster. Current resources available: {ray.available_resources()}, resources requested "
            f"by the placement group: {pg.bundle_specs}")
    return pg, bundles


def _resources(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def share_node_gpus(node_ids: list[str], gpu_ids: list[list[Any]]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of each node: the union of its workers' GPU ids, in first-seen order (so CUDA sees
    the neighbouring devices and can use peer-to-peer copies)."""
    per_node: dict[str, list[Any]] = {}
    for node, ids in zip(node_ids, gpu_ids):
        seen = per_node.setdefault(node, [])
        seen.extend(i for i in ids if i not in seen)
    return {node: ",".join(str(i) for i in ids) for node, ids in per_node.items()}


class BaseStrategy(abc.ABC):
    """A placement of the workers; subclasses define ``num_workers`` and ``create_workers``."""

    placement_group: Any = None
    workers: list[Any] | None = None
    settings: Any = None
    _created_placement_group = True

    @property
    @abc.abstractmethod
    def num_workers(self) -> int:
        """How many workers (ranks) the strategy places."""

    @abc.abstractmethod
    def create_workers(self) -> tuple[list[Any], list[Any]]:
        """Reserve the resources and start the workers: ``(workers in rank order, one worker per host)``."""

    @classmethod
    def get_node_workers(cls, workers: list[Any]) -> list[Any]:
        """One worker per hostname (the last one seen), for probing the network interfaces."""
        hostnames = map_blocking(lambda w: w.hostname.remote(), workers)
        return list(dict(zip(hostnames, workers)).values())

    def _timeout(self) -> float:
        return float(getattr(self.settings, "placement_group_timeout_s", 100) or 100)

    def _start_actors(self, bundle_of: list[int], cpus: float, gpus: float) -> tuple[list[Any], list[Any]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(BaseHorovodWorker)
        n = len(bundle_of)
        self.workers = [actor_cls.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(placement_group=self.placement_group, placement_group_bundle_index=b,
                                             placement_group_capture_child_tasks=False)))
            .remote(world_rank=rank, world_size=n) for rank, b in enumerate(bundle_of)]
        if gpus:
            node_ids = ray.get([w.node_id.remote() for w in self.workers])
            visible = share_node_gpus(node_ids, ray.get([w.get_gpu_ids.remote() for w in self.workers]))
            ray.get([w.update_env_vars.remote({"CUDA_VISIBLE_DEVICES": visible[node]})
                     for w, node in zip(self.workers, node_ids)])
        return self.workers, self.get_node_workers(self.workers)

    def shutdown(self) -> None:
        """Remove the placement group this strategy created (an inherited one stays); forget the workers."""
        if self.placement_group is not None and self._created_placement_group:
            ray.util.remove_placement_group(self.placement_group)
        self.placement_group = None
        self.workers = []


class ColocatedStrategy(BaseStrategy):
    """``num_hosts`` nodes with ``num_workers_per_host`` workers each (``STRICT_SPREAD``); rank ``w*host + i``."""

    def __init__(self, *, settings: Any, num_hosts: int, num_workers_per_host: int, use_gpu: bool,
                 cpus_per_worker: int, gpus_per_worker: int | None) -> None:
        self.settings = settings
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1

    @property
    def num_workers(self) -> int:
        return int(self.num_hosts * self.num_workers_per_host)

    def create_workers(self) -> tuple[list[Any], list[Any]]:
        gpus = self.gpus_per_worker * int(self.use_gpu)
        wph = self.num_workers_per_host
        self.placement_group, _ = create_placement_group(
            _resources(self.cpus_per_worker * wph, gpus * wph), self.num_hosts, self._timeout(), "STRICT_SPREAD")
        return self._start_actors([b for b in range(self.num_hosts) for _ in range(wph)], self.cpus_per_worker,
                                  gpus)


class PGStrategy(BaseStrategy):
    """``num_workers`` workers, one ``PACK`` bundle each; inside a placement group (a Tune trial), that group's
    bundles instead, unless ``force_create_placement_group``."""

    def __init__(self, *, settings: Any, num_workers: int, use_gpu: bool, cpus_per_worker: int,
                 gpus_per_worker: int | None, placement_group: Any = None,
                 force_create_placement_group: bool = False) -> None:
        from horovod.ray.runner import _current_pg

        self.settings = settings
        self._num_workers = num_workers
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1
        self.placement_group = None if force_create_placement_group else placement_group or _current_pg()
        self._created_placement_group = False

    @property
    def num_workers(self) -> int:
        return int(self._num_workers)

    def resources_per_worker(self) -> dict[str, float]:
        return _resources(self.cpus_per_worker, self.gpus_per_worker * int(self.use_gpu))

    def create_workers(self) -> tuple[list[Any], list[Any]]:
        if self.placement_group is None:
            self.placement_group, _ = create_placement_group(self.resources_per_worker(), self.num_workers,
                                                             self._timeout(), "PACK")
            self._created_placement_group = True
        bundle_of = list(range(self.num_workers)) if self._created_placement_group else [-1] * self.num_workers
        return self._start_actors(bundle_of, self.cpus_per_worker, self.gpus_per_worker * int(self.use_gpu))


PackStrategy = PGStrategy
"""Upstream's earlier name of :class:`PGStrategy`."""
