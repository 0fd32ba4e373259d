"""Upstream's horovod.ray module paths (strategy, adapter, elastic_v2, runner.StaticAdapter) on a real local Ray.

Used as upstream's ``RayExecutor`` uses them (``params.adapter(settings, **asdict(params))``), checked against
Ray's own view: the placement group table (strategy, bundles, state), the placement group each actor runs in,
the environment each actor got, ``ray.nodes()`` for discovery, and a numpy allreduce for a job's result.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest
from launch_util import local_ray_driver_env

try:
    import ray
    from ray import cloudpickle
except ImportError:
    if os.environ.get("HOROVOD_TEST_REQUIRE_RAY") == "1":
        raise
    pytest.skip("ray is not installed (pip install 'horovod[ray]')", allow_module_level=True)

from horovod.ray import RayExecutor  # noqa: E402
from horovod.ray.adapter import Adapter, BaseParams  # noqa: E402
from horovod.ray.elastic_v2 import ElasticAdapter, ElasticParams, RayHostDiscovery  # noqa: E402
from horovod.ray.runner import StaticAdapter, StaticParams  # noqa: E402
from horovod.ray.strategy import ColocatedStrategy, PackStrategy, PGStrategy  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with local_ray_driver_env():
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
        yield
        ray.shutdown()


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=kw.pop("pg_timeout", 30))


def _pg_of(worker):
    return ray.get(worker.execute.remote(lambda _: ray.get_runtime_context().get_placement_group_id()))


def _ranks(workers):
    return [(int(e["HOROVOD_RANK"]), int(e["HOROVOD_SIZE"])) for e in ray.get([w.env_vars.remote() for w in workers])]


def test_pg_strategy_packs_one_bundle_per_worker():
    assert PackStrategy is PGStrategy
    strategy = PGStrategy(settings=_settings(), num_workers=2, use_gpu=False, cpus_per_worker=1, gpus_per_worker=None)
    assert strategy.num_workers == 2
    workers, node_workers = strategy.create_workers()
    pg = strategy.placement_group
    table = ray.util.placement_group_table(pg)
    assert table["strategy"] == "PACK" and list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert [_pg_of(w) for w in workers] == [pg.id.hex()] * 2
    assert _ranks(workers) == [(0, 2), (1, 2)]
    assert len(node_workers) == 1  # one host
    strategy.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED" and strategy.workers == []


def test_colocated_strategy_spreads_hosts_strictly():
    strategy = ColocatedStrategy(settings=_settings(), num_hosts=1, num_workers_per_host=2, use_gpu=False,
                                 cpus_per_worker=1, gpus_per_worker=None)
    workers, node_workers = strategy.create_workers()
    table = ray.util.placement_group_table(strategy.placement_group)
    assert table["strategy"] == "STRICT_SPREAD" and list(table["bundles"].values()) == [{"CPU": 2.0}]
    assert _ranks(workers) == [(0, 2), (1, 2)] and len(node_workers) == 1
    assert len({_pg_of(w) for w in workers}) == 1
    strategy.shutdown()
    # two hosts of one worker each cannot be placed on this one-node cluster
    two_hosts = ColocatedStrategy(settings=_settings(pg_timeout=2), num_hosts=2, num_workers_per_host=1,
                                  use_gpu=False, cpus_per_worker=1, gpus_per_worker=None)
    with pytest.raises(TimeoutError, match="Placement group creation timed out"):
        two_hosts.create_workers()


def _collectives():
    import horovod.numpy as hvd

    hvd.init()
    return hvd.rank(), hvd.allreduce(np.arange(3.0) * (hvd.rank() + 1), op=hvd.Sum).tolist()


def test_static_adapter_as_upstreams_executor_builds_it():
    params = StaticParams(num_workers=2)
    assert params.elastic is False and params.adapter is StaticAdapter and params.gpus_per_worker == 0
    adapter = params.adapter(_settings(), **dataclasses.asdict(params))  # upstream's RayExecutor._initialize_adapter
    assert isinstance(adapter, Adapter)
    adapter.start()
    try:
        assert len(adapter.workers) == 2
        results = adapter.run(_collectives)
        assert results == [(0, (np.arange(3.0) * 3).tolist()), (1, (np.arange(3.0) * 3).tolist())]
        assert ray.get(adapter.run_remote(lambda: 7)) == [7, 7]
        assert adapter.execute_single(lambda executable: executable) is None
    finally:
        adapter.shutdown()
    assert adapter.workers == []


def test_elastic_params_and_adapter():
    with pytest.raises(ValueError, match="use_gpu must be True"):
        ElasticParams(min_workers=1, gpus_per_worker=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        BaseParams(use_gpu=True, gpus_per_worker=0)
    params = ElasticParams(min_workers=1, max_workers=2, cpus_per_worker=1)
    assert params.elastic is True and params.adapter is ElasticAdapter
    settings = _settings()
    adapter = params.adapter(settings, **dataclasses.asdict(params))
    assert isinstance(settings.discovery, RayHostDiscovery) and settings.elastic is True
    (node,) = [n for n in ray.nodes() if n["alive"]]
    # hosts are Ray node ids here (upstream: NodeManagerAddress; docs/compatibility.md)
    expected = {node["NodeID"]: int(node["Resources"]["CPU"])}
    assert settings.discovery.find_available_hosts_and_slots() == expected
    with pytest.raises(NotImplementedError):
        adapter.run_remote(lambda: 1)
    with pytest.raises(NotImplementedError):
        adapter.execute_single(lambda _: 1)
