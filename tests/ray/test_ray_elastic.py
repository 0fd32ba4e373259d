"""Elastic Horovod on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, 2 nodes x 2 CPUs).

A deterministic numpy job (as tests/elastic/worker_numpy.py): every sample i adds ``g(i)`` to the weights and 1
to ``counts[i]``, summed over ranks, so "every sample exactly once per epoch" is checked exactly whatever the
world sizes were.  Faults: a worker process killed (``SIGKILL``) mid-training -> its node is blacklisted and
the job finishes on the other node; a node that discovery reports later -> the job grows; a function that
raises everywhere -> the driver raises naming the worker and the error.

Skipped when ray is not installed, unless ``HOROVOD_TEST_REQUIRE_RAY=1`` (CI).
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import ray
    from ray import cloudpickle  # without ray, `import ray` may find the namespace package tests/ray
except ImportError:
    if os.environ.get("HOROVOD_TEST_REQUIRE_RAY") == "1":
        raise
    pytest.skip("ray is not installed (pip install 'horovod[ray]'); HOROVOD_TEST_REQUIRE_RAY=1 makes this a "
                "failure", allow_module_level=True)

from horovod.ray import ElasticRayExecutor, RayExecutor, RayHostDiscovery  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    env = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
    for k in env:
        del os.environ[k]
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, configure_logging=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()
    os.environ.update(env)


def _train(n, bs, epochs, sleep, out):
    import horovod.numpy as hvd
    from horovod.common import elastic
    from horovod.common.elastic_sampler import ElasticSampler

    open(os.path.join(out, f"pid.{os.getpid()}"), "w").close()

    def g(indices):
        x = np.asarray(indices, dtype=np.float64)
        return np.stack([np.ones_like(x), x + 1, np.mod(x * 7, 5)], axis=1).sum(axis=0) if len(x) else np.zeros(3)

    hvd.init()
    sampler = ElasticSampler(n, shuffle=True, seed=3, batch_size=bs)
    state = elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, steps=0, w=np.zeros(3),
                                counts=np.zeros(n, np.int64), sampler=sampler, sizes=[])

    @elastic.run
    def train(state):
        if not state.sizes or state.sizes[-1] != hvd.size():
            state.sizes.append(hvd.size())
        while state.epoch < epochs:
            state.sampler.set_epoch(state.epoch)
            for step, batch in enumerate(state.sampler):
                grad = hvd.allreduce(g(batch), op=hvd.Sum, name="grad")
                counts = hvd.allreduce(np.bincount(np.asarray(batch, np.int64), minlength=n), op=hvd.Sum,
                                       name="counts")
                state.w -= grad
                state.counts += counts
                state.steps += 1
                state.sampler.record_batch(step, bs)
                time.sleep(sleep)
                state.commit()
            state.epoch += 1
            state.commit()

    train(state)
    return {"w": state.w.tolist(), "counts": state.counts.tolist(), "sizes": state.sizes, "rank": hvd.rank(),
            "size": hvd.size()}


def _expected_w(n, epochs):
    x = np.arange(n, dtype=np.float64)
    return (-epochs * np.array([n, (x + 1).sum(), np.mod(x * 7, 5).sum()])).tolist()


def _check_exact(results, n, epochs, size):
    assert [r["rank"] for r in results] == list(range(size))
    for r in results:
        assert r["size"] == size
        assert set(r["counts"]) == {epochs}  # every sample exactly once per epoch
        assert r["w"] == _expected_w(n, epochs)


def test_killed_worker_job_continues_on_the_other_node(cluster, tmp_path):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2, max_workers=4, cpus_per_worker=1,
                     elastic_timeout=60)
    ex.start()
    killed = []

    def killer():
        deadline = time.monotonic() + 60
        while len(glob.glob(str(tmp_path / "pid.*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)
        pid = int(sorted(glob.glob(str(tmp_path / "pid.*")))[-1].rsplit(".", 1)[1])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    threading.Thread(target=killer, daemon=True).start()
    results = ex.run(_train, kwargs=dict(n=160, bs=2, epochs=3, sleep=0.05, out=str(tmp_path)))
    assert killed
    _check_exact(results, 160, 3, 2)  # 4 workers on 2 nodes, then the 2 on the node that is left
    assert results[0]["sizes"] == [4, 2]


class _LateNode(RayHostDiscovery):
    """Ray's nodes, except that the second one appears only ``delay`` seconds after the first call."""

    def __init__(self, delay):
        super().__init__(cpus_per_worker=1)
        self.delay = delay
        self.first = None

    def find_available_hosts_and_slots(self):
        found = super().find_available_hosts_and_slots()
        self.first = self.first or time.monotonic()
        if time.monotonic() - self.first < self.delay:
            head = ray.get_runtime_context().get_node_id()  # the driver's node
            found = {k: v for k, v in found.items() if k == head}
        return found


@pytest.mark.slow
def test_legacy_elastic_executor_grows_when_a_node_appears(cluster, tmp_path):
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, elastic_timeout=60, timeout_s=30)
    settings.discovery = _LateNode(delay=3.0)
    ex = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    ex.start()
    results = ex.run(lambda: _train(200, 2, 3, 0.05, str(tmp_path)))  # upstream calls worker_fn() bare
    _check_exact(results, 200, 3, 4)
    assert results[0]["sizes"] == [2, 4]


def _always_fails():
    raise ValueError("bad hyperparameters")


def test_failing_function_is_named(cluster):
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2, cpus_per_worker=1,
                     elastic_timeout=5)
    ex.start()
    with pytest.raises(RuntimeError, match=r"horovod.ray elastic job failed: .*first failure: rank \d \(node "
                                           r"\w+, local slot \d\): ValueError: bad hyperparameters"):
        ex.run(_always_fails)


def test_discovery_counts_slots(cluster):
    found = RayHostDiscovery(cpus_per_worker=1).find_available_hosts_and_slots()
    assert sorted(found.values()) == [2, 2]
    assert RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots() == {k: 1 for k in found}
    assert RayHostDiscovery(use_gpu=True).find_available_hosts_and_slots() == {}  # no GPUs: no slots
