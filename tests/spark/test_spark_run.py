"""``horovod.spark.run`` on a real local Spark (``local[2]``, a JVM and PySpark's Python workers).

Skipped with the reason when pyspark or Java is missing, unless ``HOROVOD_TEST_REQUIRE_SPARK=1`` (CI), which
turns the skip into a failure.  Every test checks that no process of its job survives it (the workers carry a
marker in their environment, passed with ``env=``).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
import uuid

import cloudpickle
import numpy as np
import psutil
import pytest
from spark_session import local_spark_session, skip_or_fail_without_spark

MARKER = "HOROVOD_TEST_SPARK_MARKER"
pytestmark = pytest.mark.timeout(180)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module


@pytest.fixture(scope="module")
def spark():
    skip_or_fail_without_spark()
    # local[2, 4]: two task slots; a failed task is retried (up to 4 attempts), which run_elastic relies on
    # (barrier stages of run() are never retried: a failed task fails the job). The executors get
    # HOROVOD_TEST_SPARK_UNSET through Spark's executor environment, not this process's: the JVM (and so the
    # Python workers it forks) may have started earlier, for another test module's session.
    session = local_spark_session("local[2,4]", "horovod-spark-tests",
                                  **{"spark.executorEnv.HOROVOD_TEST_SPARK_UNSET": "executor"})
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def marker():
    """A token in every worker's environment; after the test no process may carry it."""
    token = uuid.uuid4().hex
    yield token
    left = _wait_gone(token, 20.0)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"processes of the job survived it: {[(p.pid, _cmdline(p)) for p in left]}"


def _marked(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(MARKER) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def _wait_gone(token: str, timeout: float) -> list[psutil.Process]:
    end = time.monotonic() + timeout
    while True:
        left = _marked(token)
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def _workers(token: str) -> list[psutil.Process]:
    return [p for p in _marked(token) if "horovod.spark._worker" in _cmdline(p)]


# --- functions run by the workers (pickled by value) ---------------------------------------------------------

def _numpy_job(base: float) -> dict:
    import horovod.numpy as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    print(f"hello from rank {rank} of {size}", flush=True)
    sys.stderr.write(f"note from rank {rank}\n")
    summed = hvd.allreduce(np.arange(4, dtype=np.float64) * (rank + 1) + base, op=hvd.Sum)
    gathered = hvd.allgather(np.full((rank + 1, 2), rank, dtype=np.int64))
    env = {k: os.environ.get(k) for k in ("HOROVOD_TEST_SPARK_EXTRA", "HOROVOD_TEST_SPARK_UNSET")}
    key = os.environ["HOROVOD_SECRET_KEY"]  # the job key: in the environment, never on a command line
    leaked = []
    for p in psutil.process_iter(["cmdline"]):
        if key in " ".join(p.info["cmdline"] or []):
            leaked.append(p.pid)
    return {"leaked": leaked, "key": key, "rank": rank, "size": size, "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "sum": summed, "gathered": gathered,
            "env": env, "pid": os.getpid(), "work_dir": (os.environ.get("HOROVOD_SPARK_WORK_DIR"), os.getcwd())}


def _torch_job(x: np.ndarray, y: np.ndarray, w0: np.ndarray, b0: float, lr: float, steps: int) -> tuple:
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    n = len(x) // hvd.size()
    xs = torch.from_numpy(x[hvd.rank() * n:(hvd.rank() + 1) * n])
    ys = torch.from_numpy(y[hvd.rank() * n:(hvd.rank() + 1) * n])
    model = torch.nn.Linear(x.shape[1], 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w0 + hvd.rank()))  # rank 1 differs: broadcast must fix it
        model.bias.fill_(b0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
    return model.weight.detach().numpy().copy(), float(model.bias.item()), float(loss.item())


def _keras_job(x: np.ndarray, y: np.ndarray, w0: np.ndarray, b0: float, lr: float, epochs: int) -> tuple:
    """Keras 3 ``fit`` with upstream's recipe: DistributedOptimizer + BroadcastGlobalVariablesCallback."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import horovod.tensorflow.keras as hvd

    hvd.init()
    n = len(x) // hvd.size()
    xs, ys = x[hvd.rank() * n:(hvd.rank() + 1) * n], y[hvd.rank() * n:(hvd.rank() + 1) * n]
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(1)])
    model.layers[0].set_weights([(w0.T + hvd.rank()).astype("float32"), np.full(1, b0, "float32")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)), loss="mse")
    history = model.fit(xs, ys, batch_size=n, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    kernel, bias = model.layers[0].get_weights()
    return kernel.T.astype(np.float64), float(bias[0]), float(history.history["loss"][-1])


def _failing_job(message: str) -> None:
    import horovod.numpy as hvd

    hvd.init()
    if hvd.rank() == 1:
        if message.startswith("exit:"):
            sys.exit(int(message[5:]))
        raise ValueError(message)
    time.sleep(300)  # rank 0 never ends by itself: the driver must stop it


def _failing_job_peer_in_collective() -> None:
    """Rank 1 raises while rank 0 waits in an allreduce; rank 1's process then takes 2 s to exit (an atexit
    handler: a slow framework teardown), so rank 0's ShutdownError is recorded first."""
    import atexit

    import horovod.numpy as hvd

    if os.environ.get("HOROVOD_RANK") == "1":
        atexit.register(time.sleep, 2.0)  # runs after Horovod's own exit handler (registered later)
    hvd.init()
    hvd.allreduce(np.ones(2), name="warm")
    if hvd.rank() == 1:
        raise KeyError("spark-test-cause")
    hvd.allreduce(np.ones(2), name="never")


def _elastic_job(n: int, batch: int, epochs: int, sleep: float) -> tuple:
    """Exactly-once accounting: every sample adds 1 to its count per epoch, whatever the sizes on the way."""
    import horovod.numpy as hvd
    from horovod.common import elastic
    from horovod.common.elastic_sampler import ElasticSampler

    hvd.init()
    sampler = ElasticSampler(n, shuffle=True, seed=3, batch_size=batch)
    state = elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, counts=np.zeros(n, np.int64),
                                sampler=sampler, sizes=[])

    @elastic.run
    def train(state):
        if not state.sizes or state.sizes[-1] != hvd.size():
            state.sizes.append(hvd.size())
        while state.epoch < epochs:
            state.sampler.set_epoch(state.epoch)
            for step, indices in enumerate(state.sampler):
                state.counts += hvd.allreduce(np.bincount(np.asarray(indices, np.int64), minlength=n), op=hvd.Sum,
                                              name="counts")
                state.sampler.record_batch(step, batch)
                if state.epoch == step == 0:
                    print(f"rank {hvd.rank()} of {hvd.size()} trained a step", flush=True)
                time.sleep(sleep)
                state.commit()
            state.epoch += 1
            state.commit()

    train(state)
    print(f"finished as rank {hvd.rank()} of {hvd.size()}", flush=True)
    return hvd.rank(), hvd.size(), state.counts


def _elastic_failing_job() -> None:
    import horovod.numpy as hvd
    from horovod.common import elastic

    hvd.init()
    state = elastic.ObjectState(hvd.broadcast_object, hvd.rank, steps=0)

    @elastic.run
    def train(state):
        if hvd.rank() == 1:
            raise ValueError("elastic-boom")
        while True:
            hvd.allreduce(np.ones(1), name="x")
            time.sleep(0.05)

    train(state)


def _elastic_bad_config_job() -> None:
    import horovod.numpy as hvd

    hvd.init()
    raise ValueError("spark-elastic-bad-config")


def _sleeping_job() -> None:
    import horovod.numpy as hvd

    hvd.init()
    print("ready", flush=True)
    time.sleep(300)


# --- tests ---------------------------------------------------------------------------------------------------

def test_numpy_results_in_rank_order_with_output(spark, marker):
    import horovod.spark

    out, err = io.StringIO(), io.StringIO()
    results = horovod.spark.run(_numpy_job, args=(10.0,), num_proc=2, stdout=out, stderr=err,
                                env={MARKER: marker, "HOROVOD_TEST_SPARK_EXTRA": 7,
                                     "HOROVOD_TEST_SPARK_UNSET": None})  # None: delete the executor's
    assert [r["rank"] for r in results] == [0, 1]
    expected_sum = sum(np.arange(4, dtype=np.float64) * (r + 1) + 10.0 for r in range(2))
    expected_gather = np.concatenate([np.full((r + 1, 2), r, dtype=np.int64) for r in range(2)])
    for r, res in enumerate(results):
        assert (res["size"], res["local_rank"], res["local_size"]) == (2, r, 2)  # one host: local = global
        assert (res["cross_rank"], res["cross_size"]) == (0, 1)
        np.testing.assert_array_equal(res["sum"], expected_sum)
        np.testing.assert_array_equal(res["gathered"], expected_gather)
        assert res["env"] == {"HOROVOD_TEST_SPARK_EXTRA": "7", "HOROVOD_TEST_SPARK_UNSET": None}
        assert res["work_dir"] == (os.getcwd(), os.getcwd())  # upstream's variable: local[2] runs here
    assert results[0]["pid"] != results[1]["pid"]
    assert results[0]["key"] == results[1]["key"] and len(results[0]["key"]) == 64
    assert results[0]["leaked"] == results[1]["leaked"] == []
    assert results[0]["key"] not in out.getvalue() + err.getvalue()
    for r in range(2):
        assert f"[{r}]<stdout>:hello from rank {r} of 2\n" in out.getvalue()
        assert f"[{r}]<stderr>:note from rank {r}\n" in err.getvalue()
    assert "<stderr>" not in out.getvalue() and "<stdout>" not in err.getvalue()


@pytest.mark.slow
def test_torch_training_matches_single_process(spark, marker):
    import horovod.spark

    rng = np.random.default_rng(7)
    x = rng.normal(size=(64, 3))
    w_true, b_true = np.array([[1.5, -2.0, 0.5]]), 0.3
    y = x @ w_true.T + b_true + 0.01 * rng.normal(size=(64, 1))
    w0, b0, lr, steps = np.zeros((1, 3)), 0.0, 0.1, 40
    results = horovod.spark.run(_torch_job, args=(x, y, w0, b0, lr, steps), num_proc=2, env={MARKER: marker})

    # Single process, plain numpy, on the concatenated data: averaged gradients of equal shards of the mean
    # squared error are the full batch's gradient.
    w, b = w0.copy(), b0
    for _ in range(steps):
        residual = x @ w.T + b - y
        w = w - lr * 2.0 / len(x) * (residual.T @ x)
        b = b - lr * 2.0 / len(x) * float(residual.sum())
    for weight, bias, loss in results:
        np.testing.assert_allclose(weight, w, rtol=1e-9, atol=1e-12)
        assert bias == pytest.approx(b, rel=1e-9, abs=1e-12)
        assert loss < 0.05  # it learned
    np.testing.assert_allclose(w, w_true, atol=0.1)


@pytest.mark.slow
def test_keras_training_matches_single_process(spark, marker):
    import horovod.spark

    rng = np.random.default_rng(11)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (x @ np.array([[0.5, -1.0, 2.0]]).T - 0.4).astype(np.float32)
    w0, b0, lr, epochs = np.zeros((1, 3)), 0.0, 0.1, 30
    results = horovod.spark.run(_keras_job, args=(x, y, w0, b0, lr, epochs), num_proc=2, env={MARKER: marker})

    # One process, numpy, full batch: one step per epoch on each rank's half averages to the full gradient.
    w, b = w0.copy(), b0
    for _ in range(epochs):
        residual = x @ w.T + b - y
        w = w - lr * 2.0 / len(x) * (residual.T @ x)
        b = b - lr * 2.0 / len(x) * float(residual.sum())
    for weight, bias, loss in results:
        np.testing.assert_allclose(weight, w, rtol=1e-4, atol=1e-5)
        assert bias == pytest.approx(b, rel=1e-4, abs=1e-5)
        assert loss < 0.5


def test_second_run_in_same_session_default_num_proc(spark, marker):
    import horovod.spark

    first = horovod.spark.run(_numpy_job, args=(1.0,), env={MARKER: marker})  # num_proc: defaultParallelism
    tls = {}
    try:
        import cryptography  # noqa: F401 - the driver makes the job's certificate with it

        tls = {"HOROVOD_TLS": "1", "HOROVOD_SHM_DISABLE": "1"}  # the store and the TCP mesh under TLS
    except ImportError:
        pass
    second = horovod.spark.run(_numpy_job, args=(2.0,), env={MARKER: marker, **tls})
    assert [r["rank"] for r in first] == [r["rank"] for r in second] == [0, 1]
    assert first[0]["sum"][0] == 1.0 * 2 + 0 + 0 and second[0]["sum"][0] == 2.0 * 2
    assert second[1]["env"] == {"HOROVOD_TEST_SPARK_EXTRA": None, "HOROVOD_TEST_SPARK_UNSET": "executor"}


@pytest.mark.parametrize("failure", ["spark-test-boom", "exit:7"])
def test_failing_rank_is_named_and_others_stopped(spark, marker, failure):
    """A rank raising, or calling sys.exit(7) (reported as exit code 1 before, unlike a process of a static job)."""
    import horovod.spark

    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        horovod.spark.run(_failing_job, args=(failure,), num_proc=2, env={MARKER: marker},
                          stdout=io.StringIO(), stderr=io.StringIO())
    text = str(info.value)
    assert text.startswith("Horovod detected that one or more processes exited with non-zero status")
    if failure.startswith("exit:"):
        assert "Process name: 1\nExit code: 7\n" in text and "SystemExit: 7" in text
    else:
        assert "Process name: 1\nExit code: 1\n" in text
        assert "ValueError: spark-test-boom" in text
    assert time.monotonic() - started < 60  # rank 0 would sleep 300 s
    assert not _wait_gone(marker, 10.0)


def test_failing_rank_named_not_the_peer_it_shut_down(spark, marker):
    """The rank whose function raised is named with its error, not its peer whose collective failed (earlier,
    by the clock) with the ShutdownError that rank's exit caused."""
    import horovod.spark

    with pytest.raises(RuntimeError) as info:
        horovod.spark.run(_failing_job_peer_in_collective, num_proc=2, env={MARKER: marker},
                          stdout=io.StringIO(), stderr=io.StringIO())
    text = str(info.value)
    assert "Process name: 1\nExit code: " in text, text  # 1, or 143 (SIGTERM): stopped by the abort while it slept
    assert "Rank 1 (Spark task 1) failed: KeyError: 'spark-test-cause'" in text, text
    assert not _wait_gone(marker, 10.0)


def test_num_proc_above_slots_fails_within_start_timeout(spark, marker):
    import horovod.spark
    from horovod.runner.common.util.timeout import TimeoutException

    started = time.monotonic()
    with pytest.raises(TimeoutException, match=r"^Timed out waiting for Spark tasks to start\. Please check that "
                                               r"you have enough resources to run all Horovod processes\.") as info:
        horovod.spark.run(_numpy_job, args=(0.0,), num_proc=3, start_timeout=10, env={MARKER: marker})
    assert time.monotonic() - started < 10
    assert "num_proc=3" in str(info.value) and "2 task slots" in str(info.value)
    # The session is still usable afterwards.
    assert [r["rank"] for r in horovod.spark.run(_numpy_job, args=(0.0,), num_proc=2, env={MARKER: marker})] \
        == [0, 1]


def _when_workers_run(token: str, action, count: int = 2, timeout: float = 60.0,
                      ready=lambda: True) -> threading.Thread:
    """Run ``action(workers)`` once ``count`` workers exist, a second has passed (they reach their sleep) and
    ``ready()`` holds."""
    def watch() -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            workers = _workers(token)
            if len(workers) >= count:
                time.sleep(1.0)
                while not ready() and time.monotonic() < end:
                    time.sleep(0.1)
                action(_workers(token))
                return
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_cancelled_job_leaves_no_worker(spark, marker):
    import horovod.spark

    watcher = _when_workers_run(marker, lambda workers: spark.sparkContext.cancelAllJobs())
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Spark job has failed: .*cancel"):
        horovod.spark.run(_sleeping_job, num_proc=2, env={MARKER: marker}, stdout=io.StringIO())
    watcher.join()
    assert time.monotonic() - started < 60
    assert not _wait_gone(marker, 15.0)


def test_killed_spark_task_leaves_no_worker(spark, marker):
    import horovod.spark

    killed = []

    def kill_task_of_rank_1(workers: list[psutil.Process]) -> None:
        worker = next(w for w in workers if w.environ().get("HOROVOD_RANK") == "1")
        task = worker.parent().parent()  # worker <- watchdog <- Spark's Python worker running the task
        killed.append(task.pid)
        task.send_signal(signal.SIGKILL)

    watcher = _when_workers_run(marker, kill_task_of_rank_1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^Spark job has failed: .*Spark task 1 ran Horovod rank 1"):
        horovod.spark.run(_sleeping_job, num_proc=2, env={MARKER: marker}, stdout=io.StringIO())
    watcher.join()
    assert killed
    assert time.monotonic() - started < 60
    assert not _wait_gone(marker, 15.0)


@pytest.mark.slow
def test_elastic_training_survives_a_killed_task(spark, marker):
    import horovod.spark

    def kill_one_task(workers: list[psutil.Process]) -> None:
        task = max(workers, key=lambda p: p.pid).parent().parent()  # worker <- watchdog <- Spark's Python worker
        killed.append(task.pid)
        task.send_signal(signal.SIGKILL)

    killed: list[int] = []
    out = io.StringIO()
    # Mid-training, as users see it: once both ranks have trained a step (killed while the mesh formed is
    # tests/elastic's test_killed_during_mesh_formation).
    watcher = _when_workers_run(marker, kill_one_task, ready=lambda: all(
        f"<stdout>:rank {r} of 2 trained a step" in out.getvalue() for r in range(2)))
    n, epochs = 40, 2
    results = horovod.spark.run_elastic(_elastic_job, args=(n, 2, epochs, 0.2), num_proc=2, min_num_proc=1,
                                        max_num_proc=2, start_timeout=60, elastic_timeout=60,
                                        env={MARKER: marker}, stdout=out, stderr=io.StringIO())
    watcher.join()
    assert killed, "no task was killed"
    # Spark retried the killed task, which joined again: two final ranks, in rank order, every sample seen
    # exactly once per epoch across the failure.
    assert [(rank, size) for rank, size, _ in results] == [(0, 2), (1, 2)]
    for _, _, counts in results:
        np.testing.assert_array_equal(counts, np.full(n, epochs))
    assert "<stdout>:finished as rank 0 of 2" in out.getvalue()


def test_elastic_reset_limit(spark, marker):
    import horovod.spark

    with pytest.raises(RuntimeError, match="number of resets during elastic job exceeded limit: 0"):
        horovod.spark.run_elastic(_elastic_failing_job, num_proc=2, min_num_proc=1, max_num_proc=2, reset_limit=0,
                                  start_timeout=60, elastic_timeout=30, env={MARKER: marker},
                                  stdout=io.StringIO(), stderr=io.StringIO())


def test_elastic_failure_of_every_host_names_the_error(spark, marker):
    """Every worker fails (a bad configuration): all hosts blacklisted.  The error names the first failed rank
    and its exception, as the static run and horovodrun's elastic launcher do (it said only "All hosts are
    blacklisted; 2 slots needed to continue.", the exception being in the forwarded stderr alone)."""
    import horovod.spark

    with pytest.raises(RuntimeError) as info:
        horovod.spark.run_elastic(_elastic_bad_config_job, num_proc=2, start_timeout=60, elastic_timeout=30,
                                  env={MARKER: marker}, stdout=io.StringIO(), stderr=io.StringIO())
    text = str(info.value)
    assert text.startswith("Horovod detected that one or more processes exited with non-zero status"), text
    assert "All hosts are blacklisted" in text and "ValueError: spark-elastic-bad-config" in text, text


def test_arguments(spark):
    import horovod.spark

    with pytest.raises(ValueError, match="use_mpi"):
        horovod.spark.run(_numpy_job, args=(0.0,), num_proc=2, use_mpi=True)
    with pytest.raises(ValueError, match="^env argument must be a dict"):
        horovod.spark.run(_numpy_job, args=(0.0,), num_proc=2, env=["A=1"])
    with pytest.raises(ValueError, match="num_proc"):
        horovod.spark.run(_numpy_job, args=(0.0,), num_proc=0)
    with pytest.raises(ValueError, match="min_num_proc"):
        horovod.spark.run_elastic(_numpy_job, num_proc=2, min_num_proc=3)
