"""horovod.ray.RayExecutor on a real local Ray cluster (``ray.init(num_cpus=4)``, actors of one CPU each).

Client code as written against upstream's API: results in rank order, torch and Keras training that match a
single-process run (numpy reference), ``run`` twice (also with ``hvd.shutdown()`` inside), ``execute`` /
``execute_single`` on an ``executable_cls``, a failing rank named on the driver (after ``hvd.init()`` and
before it), a killed actor, placement-group timeout, no actor process left after ``shutdown()``.

Skipped when ray is not installed, unless ``HOROVOD_TEST_REQUIRE_RAY=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import psutil
import pytest
from launch_util import local_ray_driver_env

try:
    import ray

    # Ray's own cloudpickle pickles the functions; importing it also tells ray from the namespace package tests/ray
    from ray import cloudpickle
except ImportError:
    if os.environ.get("HOROVOD_TEST_REQUIRE_RAY") == "1":
        raise
    pytest.skip("ray is not installed (pip install 'horovod[ray]'); HOROVOD_TEST_REQUIRE_RAY=1 makes this a "
                "failure", allow_module_level=True)

from horovod.ray import BaseHorovodWorker, RayExecutor, WorkerDiedError, node_layout  # noqa: E402

# The actors cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with local_ray_driver_env():
        # 2 logical GPUs (no hardware needed): Ray hands out their ids, enough to check CUDA_VISIBLE_DEVICES
        ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, configure_logging=False)
        yield
        ray.shutdown()


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=kw.pop("timeout_s", 20), **kw)


def _gone(pids: list[int], within: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _collectives(scale):
    import horovod.numpy as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    return {"layout": [r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
            "allreduce": hvd.allreduce(np.arange(4.0) * (r + 1) * scale, op=hvd.Sum).tolist(),
            "allgather": hvd.allgather(np.full(r + 1, float(r))).tolist(),
            "pid": os.getpid()}


def _check(results, n, scale):
    assert [d["layout"] for d in results] == [[r, n, r, n, 0, 1] for r in range(n)]  # one node
    for d in results:
        assert d["allreduce"] == (np.arange(4.0) * scale * n * (n + 1) / 2).tolist()
        assert d["allgather"] == np.concatenate([np.full(r + 1, float(r)) for r in range(n)]).tolist()


def test_results_in_rank_order_and_run_twice():
    ex = RayExecutor(_settings(), num_workers=3, cpus_per_worker=1)
    ex.start()
    try:
        first = ex.run(_collectives, args=[1.0], callbacks=[print])  # a static job ignores them, as upstream's
        _check(first, 3, 1.0)
        second = ex.run(_collectives, kwargs={"scale": 2.0})  # hvd.init() is a no-op: the job lives on
        _check(second, 3, 2.0)
        assert [d["pid"] for d in first] == [d["pid"] for d in second]
        refs = ex.run_remote(_collectives, args=[3.0])
        _check(ray.get(refs), 3, 3.0)
    finally:
        ex.shutdown()
    assert _gone([d["pid"] for d in first]) == []


def _init_shutdown(step):
    import horovod.numpy as hvd

    hvd.init()
    out = hvd.allreduce(np.array([float(step)]), op=hvd.Sum).tolist()
    hvd.shutdown()
    return out


def test_run_twice_with_shutdown_inside():
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    try:
        assert ex.run(_init_shutdown, args=[1]) == [[2.0], [2.0]]
        assert ex.run(_init_shutdown, args=[5]) == [[10.0], [10.0]]  # generation 2 through the same store
    finally:
        ex.shutdown()


class Counter:
    """An ``executable_cls``: state that lives in each actor across calls."""

    def __init__(self, start, step=1):
        import horovod.numpy as hvd

        hvd.init()
        self.value = start + hvd.rank()
        self.step = step

    def bump(self):
        self.value += self.step
        return self.value


def test_execute_and_execute_single():
    ex = RayExecutor(_settings(), num_workers=3)
    ex.start(executable_cls=Counter, executable_args=[10], executable_kwargs={"step": 5},
             extra_env_vars={"MY_SETTING": "abc", "HOROVOD_FUSION_THRESHOLD": 1234})
    try:
        assert ex.execute(lambda c: c.bump()) == [15, 16, 17]
        assert ex.execute_single(lambda c: c.bump()) == 20
        assert ex.execute(lambda c: c.value) == [20, 16, 17]
        envs = ex.execute(lambda _: {k: os.environ.get(k) for k in ("MY_SETTING", "HOROVOD_FUSION_THRESHOLD",
                                                                     "HOROVOD_SECRET_KEY", "HOROVOD_RANK")})
        assert [e["HOROVOD_RANK"] for e in envs] == ["0", "1", "2"]
        assert all(e["MY_SETTING"] == "abc" and e["HOROVOD_FUSION_THRESHOLD"] == "1234" for e in envs)
        assert len({e["HOROVOD_SECRET_KEY"] for e in envs}) == 1 and len(envs[0]["HOROVOD_SECRET_KEY"]) == 64
    finally:
        ex.shutdown()


def _fails_on_rank_one(before_init):
    import horovod.numpy as hvd

    if before_init and os.environ["HOROVOD_RANK"] == "1":
        raise KeyError("rank one gave up before hvd.init()")
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one is unhappy")
    for _ in range(3):  # the others wait in collectives for rank 1
        hvd.allreduce(np.ones(3))
    return hvd.rank()


@pytest.mark.parametrize("before_init", [False, True], ids=["after_init", "before_init"])
def test_failing_rank_is_named_and_executor_runs_again(before_init):
    ex = RayExecutor(_settings(timeout_s=60), num_workers=3)
    ex.start()
    try:
        start = time.monotonic()
        with pytest.raises(KeyError if before_init else ValueError) as e:  # the user's type, as upstream
            ex.run(_fails_on_rank_one, args=[before_init])
        assert time.monotonic() - start < 20  # the others did not wait for timeout_s or a stall deadline
        text = str(e.value)
        assert "raised on rank 1 of 3" in text
        assert ("gave up before hvd.init()" if before_init else "rank one is unhappy") in text
        _check(ex.run(_collectives, args=[1.0]), 3, 1.0)  # the same actors, a new Horovod generation
    finally:
        ex.shutdown()


def _returns_early_on_rank_zero(rounds_after: int):
    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 0:
        return "returned"
    time.sleep(4)  # past the grace (2 s here): rank 0 has left by now
    for i in range(rounds_after):  # rank 0 will never join these
        hvd.allreduce(np.ones(2), name=f"after.{i}")
    return "local work done"


@pytest.mark.parametrize("rounds_after", [0, 1], ids=["local_work", "collective"])
def test_a_rank_returning_before_the_others(rounds_after, monkeypatch):
    """Rank 0's function returns while the others still run. A peer that then waits in a collective rank 0 will
    never join failed only at the stall deadline (300 s; upstream: never): rank 0 leaves the job after a
    grace, as a process that exits, so the peer fails at once. A peer with only local work left finishes.
    Either way the next run works."""
    import horovod.ray.runner

    monkeypatch.setattr(horovod.ray.runner, "EARLY_RETURN_GRACE_S", 2.0)  # the driver's (5 s by default)
    ex = RayExecutor(_settings(timeout_s=60), num_workers=2)
    ex.start()
    try:
        start = time.monotonic()
        if rounds_after:
            with pytest.raises(Exception, match=r"Cause: rank 0 called shutdown\(\)") as e:
                ex.run(_returns_early_on_rank_zero, args=[rounds_after])
            assert "had returned from the function" in "".join(getattr(e.value, "__notes__", []))
        else:
            assert ex.run(_returns_early_on_rank_zero, args=[0]) == ["returned", "local work done"]
        assert time.monotonic() - start < 30
        _check(ex.run(_collectives, args=[1.0]), 2, 1.0)
    finally:
        ex.shutdown()


def _slow_training():
    import horovod.numpy as hvd

    hvd.init()
    for _ in range(600):
        hvd.allreduce(np.ones(8))
        time.sleep(0.05)
    return hvd.rank()


def test_killed_actor_is_named_and_nothing_is_left():
    ex = RayExecutor(_settings(), num_workers=3)
    ex.start()
    try:
        pids = ray.get([w.pid.remote() for w in ex.workers])
        refs = ex.run_remote(_slow_training)
        time.sleep(2)
        ray.kill(ex.workers[1])
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as e:
            ex._collect(refs)
        assert time.monotonic() - start < 20
        assert e.value.rank == 1 and "the actor of rank 1 of 3 died" in str(e.value)
        assert _gone(pids) == []  # the survivors are stopped too
        with pytest.raises(RuntimeError, match="call start"):
            ex.run(_collectives, args=[1.0])
        ex.start()  # the executor can start again
        _check(ex.run(_collectives, args=[1.0]), 3, 1.0)
    finally:
        ex.shutdown()


def test_killed_actor_during_run():
    """The same through the public ``run``: the driver raises once the survivors noticed."""
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    victim = ex.workers[0]
    try:
        import threading

        threading.Timer(2.0, lambda: ray.kill(victim)).start()
        with pytest.raises(WorkerDiedError, match="rank 0 of 2 died"):
            ex.run(_slow_training)
    finally:
        ex.shutdown()


def test_colocated_hosts_and_layout():
    ex = RayExecutor(_settings(), num_hosts=1, num_workers_per_host=3)
    ex.start()
    try:
        _check(ex.run(_collectives, args=[1.0]), 3, 1.0)
    finally:
        ex.shutdown()


def test_placement_group_timeout():
    ex = RayExecutor(_settings(placement_group_timeout_s=2), num_workers=9)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="Placement group creation timed out"):
        ex.start()
    assert time.monotonic() - start < 30
    assert ex.workers == []
    assert ray.available_resources().get("CPU") == 4  # the group was removed


def _cuda_env():
    import horovod.numpy as hvd

    hvd.init()
    return os.environ.get("CUDA_VISIBLE_DEVICES"), hvd.local_rank()


def test_gpus_of_a_node_are_visible_to_all_its_ranks():
    ex = RayExecutor(_settings(), num_workers=2, use_gpu=True)
    assert ex.gpus_per_worker == 1  # upstream's default: int(use_gpu)
    ex.start()
    try:
        result = ex.run(_cuda_env)
        assert [lr for _, lr in result] == [0, 1]
        assert result[0][0] == result[1][0] and sorted(result[0][0].split(",")) == ["0", "1"]
    finally:
        ex.shutdown()


def _tls_state():
    import horovod.numpy as hvd
    from horovod.common import basics

    hvd.init()
    hvd.allreduce(np.ones(4))
    return basics.engine().mesh.tls


def test_tls_from_the_driver_environment(monkeypatch):
    pytest.importorskip("cryptography")
    monkeypatch.setenv("HOROVOD_TLS", "1")
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start(extra_env_vars={"HOROVOD_SHM_DISABLE": "1"})  # TCP between the ranks: TLS channels
    try:
        assert ex.run(_tls_state) == [True, True]
    finally:
        ex.shutdown()


def test_constructor_errors():
    s = _settings()
    with pytest.raises(ValueError, match="`max_workers` provided without any positive `min_workers`"):
        RayExecutor(s, max_workers=2)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers` provided."):
        RayExecutor(s, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="gpus_per_slot is set, but use_gpu is False"):
        RayExecutor(s, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="gpus_per_slot must be >= 1"):
        RayExecutor(s, num_workers=2, use_gpu=True, gpus_per_worker=0)
    with pytest.raises(AssertionError):
        RayExecutor(s, num_workers=2, num_hosts=1)
    with pytest.raises(RuntimeError, match="call RayExecutor.start"):
        RayExecutor(s, num_workers=2).run(_collectives, args=[1.0])


def test_node_layout_like_upstream():
    # upstream's test: 5, 4 and 3 workers on three nodes (rank order interleaved)
    nodes = ["a"] * 5 + ["b"] * 4 + ["c"] * 3
    layout = node_layout(nodes)
    assert layout[0] == (0, 5, 0, 3) and layout[5] == (0, 4, 1, 3) and layout[9] == (0, 3, 2, 3)
    assert layout[4] == (4, 5, 0, 1) and layout[8] == (3, 4, 1, 2) and layout[11] == (2, 3, 2, 3)
    assert node_layout(["x", "y", "x"]) == [(0, 2, 0, 2), (0, 1, 1, 2), (1, 2, 0, 1)]


def test_base_worker_is_upstreams():
    w = BaseHorovodWorker.__new__(BaseHorovodWorker)
    for name in ("node_id", "hostname", "get_gpu_ids", "update_env_vars", "env_vars", "start_executable", "execute",
                 "set_queue"):
        assert callable(getattr(w, name))


# ------------------------------------------------------------------------------------------ training
def _problem():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 4)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0, 0.25], np.float32) - 0.5).astype(np.float32)
    return x, y


def _reference(steps=4, lr=0.05):
    """Full-batch SGD on the linear model in one process (numpy): what the ranks' shards must add up to."""
    x, y = (a.astype(np.float64) for a in _problem())
    w, b = np.full(4, 0.2), 0.1
    for _ in range(steps):
        err = x @ w + b - y
        w, b = w - lr * 2 / len(y) * (x.T @ err), b - lr * 2 / len(y) * err.sum()
    return np.concatenate([w, [b]])


def _torch_train():
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())  # different start on each rank: the broadcast must fix it
    model = torch.nn.Linear(4, 1)
    if hvd.rank() == 0:
        with torch.no_grad():
            model.weight.fill_(0.2)
            model.bias.fill_(0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    x, y = _problem()
    xb, yb = torch.from_numpy(x[hvd.rank()::hvd.size()]), torch.from_numpy(y[hvd.rank()::hvd.size()])
    for _ in range(4):
        opt.zero_grad()
        ((model(xb).squeeze(1) - yb) ** 2).mean().backward()
        opt.step()
    return model.weight.detach().flatten().tolist() + model.bias.detach().tolist()


def test_torch_training_matches_single_process():
    pytest.importorskip("torch")
    ex = RayExecutor(_settings(timeout_s=60), num_workers=2)
    ex.start()
    try:
        params = ex.run(_torch_train)
    finally:
        ex.shutdown()
    assert params[0] == params[1]
    np.testing.assert_allclose(params[0], _reference(), rtol=1e-5, atol=1e-6)


def _keras_train():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import horovod.keras as hvd

    hvd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.set_weights([np.full((4, 1), 0.2, np.float32), np.array([0.1], np.float32)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05)), loss="mse")
    x, y = _problem()
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model.fit(xs, ys, batch_size=len(xs), epochs=4, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    w, b = model.get_weights()
    return w.flatten().tolist() + b.tolist()


@pytest.mark.slow
def test_keras_training_matches_single_process():
    pytest.importorskip("tensorflow")
    ex = RayExecutor(_settings(timeout_s=120), num_workers=2)
    ex.start()
    try:
        params = ex.run(_keras_train)
    finally:
        ex.shutdown()
    np.testing.assert_allclose(params[0], params[1], rtol=0, atol=1e-7)
    np.testing.assert_allclose(params[0], _reference(), rtol=1e-4, atol=1e-5)
