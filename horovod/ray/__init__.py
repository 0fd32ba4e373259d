"""Horovod on Ray: ``RayExecutor`` runs a Horovod job whose ranks are Ray actors (docs/ray.md).

Upstream's API (``horovod.ray``): ``RayExecutor``, ``BaseHorovodWorker``, ``ElasticRayExecutor``; needs
``pip install 'horovod[ray]'``.
"""

from horovod.ray.elastic import ElasticRayExecutor, ElasticSettings, RayHostDiscovery
from horovod.ray.runner import MiniSettings, RayExecutor, WorkerDiedError, node_layout
from horovod.ray.worker import BaseHorovodWorker

__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "RayHostDiscovery", "MiniSettings",
           "ElasticSettings", "WorkerDiedError", "node_layout"]
