"""Many independent collectives in one graph never deadlock, whatever the inter-op pool size (issue 9):

    horovodrun -np 2 python -m pytest -x -q tests/parallel/test_tensorflow_many_collectives.py

Each rank builds the collectives of one ``session.run`` (or one ``tf.function``) in the opposite order of
its neighbour, with a TF1 session of 1, 2 or the default number of inter-op threads, so a receive that held
a thread while its collective waited would starve the submits the other rank needs.  Results are checked
against numpy; the seed-000-style TF1 training of a 31-layer MLP (62 gradient tensors, one broadcast per
variable) is checked against a single-process run on the concatenated batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from parallel_util import data

import horovod.tensorflow as hvd

THREADS = [1, 2, 0]  # 0: TensorFlow's default pool size
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "allreduce_max")
DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16)
COUNT = 42


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.barrier()


def _spec(i: int):
    return KINDS[i % len(KINDS)], DTYPES[(i // len(KINDS)) % len(DTYPES)]


def _input(i: int, rank: int, size: int) -> np.ndarray:
    kind, dtype = _spec(i)
    if kind == "allgather":  # a rank-dependent first dimension
        return data(("many", i), rank, (rank + 1 + i % 3, 3), dtype, low=-4, high=4)
    if kind in ("alltoall", "reducescatter"):
        return data(("many", i), rank, (2 * size, 2), dtype, low=-4, high=4)
    return data(("many", i), rank, (3 + i % 5,), dtype, low=-4, high=4)


def _expected(i: int, rank: int, size: int) -> np.ndarray:
    kind, _ = _spec(i)
    xs = [_input(i, r, size) for r in range(size)]
    if kind == "allreduce":
        return np.sum(xs, axis=0).astype(xs[0].dtype)
    if kind == "allreduce_max":
        return np.max(xs, axis=0)
    if kind == "allgather":
        return np.concatenate(xs)
    if kind == "broadcast":
        return xs[0]
    if kind == "alltoall":
        return np.concatenate([x[2 * rank:2 * rank + 2] for x in xs])
    return np.sum(xs, axis=0).astype(xs[0].dtype)[2 * rank:2 * rank + 2]  # reducescatter


def _collective(i: int, t, tag: str):
    kind, _ = _spec(i)
    name = f"{tag}_{kind}_{i}"
    if kind == "allreduce":
        return hvd.allreduce(t, op=hvd.Sum, name=name)
    if kind == "allreduce_max":
        return hvd.allreduce(t, op=hvd.Max, name=name)
    if kind == "allgather":
        return hvd.allgather(t, name=name)
    if kind == "broadcast":
        return hvd.broadcast(t, root_rank=0, name=name)
    if kind == "alltoall":
        return hvd.alltoall(t, name=name)
    return hvd.reducescatter(t, op=hvd.Sum, name=name)


def _order() -> list[int]:
    order = list(range(COUNT))
    return order if hvd.rank() % 2 == 0 else order[::-1]


def _check(results: dict[int, np.ndarray]) -> None:
    r, n = hvd.rank(), hvd.size()
    assert sorted(results) == list(range(COUNT))
    for i, got in results.items():
        np.testing.assert_array_equal(np.asarray(got), _expected(i, r, n), err_msg=f"collective {i} {_spec(i)}")


@pytest.mark.parametrize("threads", THREADS)
def test_session_run_of_many_collectives_in_opposite_orders(threads):
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default() as g:
        phs, outs = {}, {}
        for i in _order():
            x = _input(i, r, n)
            phs[i] = tf.compat.v1.placeholder(tf.as_dtype(x.dtype), x.shape)
            outs[i] = _collective(i, phs[i], f"tf1_{threads}")
        cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=g, config=cfg) as s:
            for _ in range(2):  # a second run reuses the graph's queues
                feed = {phs[i]: _input(i, r, n) for i in range(COUNT)}
                got = s.run(outs, feed)
                _check(got)


@pytest.mark.parametrize("threads", THREADS)
def test_make_callable_of_many_collectives(threads):
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default() as g:
        outs = {i: _collective(i, tf.constant(_input(i, r, n)), f"callable_{threads}") for i in _order()}
        cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=g, config=cfg) as s:
            keys = sorted(outs)
            fn = s.make_callable([outs[i] for i in keys])
            _check(dict(zip(keys, fn())))


def test_tf_function_of_many_collectives_in_opposite_orders():
    r, n = hvd.rank(), hvd.size()
    inputs = {i: tf.constant(_input(i, r, n)) for i in range(COUNT)}

    @tf.function
    def step(xs):
        return {i: _collective(i, xs[i], "function") for i in _order()}

    for _ in range(2):
        got = step(inputs)
        _check({i: t.numpy() for i, t in got.items()})


def test_tf_function_of_many_small_allreduces_called_again_and_again():
    """One ``hvd.allreduce`` per tensor inside ``tf.function`` (as upstream's per-gradient code does), 50 of
    16 KiB each, 300 calls.  Rank 0's submit ops answer some of them in frames of inline results while others
    already wait in a shared-memory collective; rank 0 then entered that collective only after rank 1 had read
    the later frames too, which rank 1 does only after the collective: both waited until the op timeout
    (within ~200 calls here, every run)."""
    r, n = hvd.rank(), hvd.size()
    xs = [tf.constant(np.arange(4096, dtype=np.float32) * (r + 1) + i) for i in range(50)]

    @tf.function
    def step(xs):
        return tf.stack([tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum, name=f"small_{i}")) for i, x in enumerate(xs)])

    want = np.array([np.sum(np.arange(4096, dtype=np.float64) * (n * (n + 1) / 2) + n * i) for i in range(50)])
    for call in range(300):
        got = step(xs).numpy()
        if call % 50 == 0 or call == 299:
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_eager_many_collectives():
    r, n = hvd.rank(), hvd.size()
    got = {i: _collective(i, tf.constant(_input(i, r, n)), "eager").numpy() for i in range(COUNT)}
    _check(got)


def test_aborted_run_leaves_no_stale_result():
    """A run that fails in one collective must not leave its other results for the next run to read."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default() as g:
        good = hvd.allreduce(tf.fill([3], float(r + 1)), op=hvd.Sum, name="abort_good")
        shape = [2 + r]  # mismatched shapes across ranks: an error on every rank
        bad = hvd.allreduce(tf.ones(shape), op=hvd.Sum, name="abort_bad")
        cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=g, config=cfg) as s:
            if n > 1:
                with pytest.raises(tf.errors.OpError, match="Mismatched ALLREDUCE tensor shapes"):
                    s.run([good, bad])
            hvd.barrier()
            for _ in range(3):
                np.testing.assert_allclose(s.run(good), np.full(3, n * (n + 1) / 2))


# --------------------------------------------------------------------------------- seed 000 style training
LAYERS, WIDTH, BATCH, STEPS, LR = 31, 8, 16, 3, 0.05


def _mlp(x, weights):
    for k, (w, b) in enumerate(weights):
        x = tf.matmul(x, w) + b
        if k < len(weights) - 1:
            x = tf.tanh(x)
    return x


def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([rank, step, 7])
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32) * np.ones((1, WIDTH), np.float32)


def _train_tf1(threads: int, per_gradient: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Seed 000's shape: TF1 graph, Session, DistributedOptimizer(GradientDescentOptimizer), broadcast."""
    r = hvd.rank()
    rng = np.random.default_rng(100 + r)  # different on every rank: the broadcast must fix that
    with tf.Graph().as_default() as g:
        weights = [(tf.compat.v1.Variable(rng.normal(scale=0.4, size=(WIDTH, WIDTH)).astype(np.float32)),
                    tf.compat.v1.Variable(rng.normal(scale=0.1, size=(WIDTH,)).astype(np.float32)))
                   for _ in range(LAYERS)]
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        y = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        loss = tf.reduce_mean(tf.square(_mlp(x, weights) - y))
        opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
        if per_gradient:  # one allreduce per gradient tensor, as upstream's TF1 optimizer does
            grads = [(hvd.allreduce(gr, name=f"grad_{threads}_{k}"), v)
                     for k, (gr, v) in enumerate(opt.compute_gradients(loss))]
        else:
            opt = hvd.DistributedOptimizer(opt)
            grads = opt.compute_gradients(loss)
        assert len(grads) == 2 * LAYERS
        train = opt.apply_gradients(grads)
        bcast = hvd.broadcast_global_variables(0)
        variables = [v for pair in weights for v in pair]
        cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=g, config=cfg) as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(bcast)
            start = s.run(variables)
            for step in range(STEPS):
                bx, by = _batch(r, step)
                s.run(train, {x: bx, y: by})
            return start, s.run(variables)


def _reference(start: list[np.ndarray]) -> list[np.ndarray]:
    """One process, no Horovod: plain gradient descent on every rank's batch concatenated."""
    n = hvd.size()
    with tf.Graph().as_default() as g:
        variables = [tf.compat.v1.Variable(v) for v in start]
        weights = list(zip(variables[::2], variables[1::2]))
        x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        y = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
        loss = tf.reduce_mean(tf.square(_mlp(x, weights) - y))
        train = tf.compat.v1.train.GradientDescentOptimizer(LR).minimize(loss)
        with tf.compat.v1.Session(graph=g) as s:
            s.run(tf.compat.v1.global_variables_initializer())
            for step in range(STEPS):
                parts = [_batch(r, step) for r in range(n)]
                s.run(train, {x: np.concatenate([p[0] for p in parts]), y: np.concatenate([p[1] for p in parts])})
            return s.run(variables)


@pytest.mark.parametrize(("threads", "per_gradient"), [(1, True), (0, True), (1, False)],
                         ids=["1-allreduce_per_gradient", "0-allreduce_per_gradient", "1-DistributedOptimizer"])
def test_seed000_style_training_of_a_deep_mlp(threads, per_gradient):
    """One inter-op thread (the pool a blocked receive would starve) and the default pool; the collectives
    in opposite orders above run with every pool size."""
    start, final = _train_tf1(threads, per_gradient)
    starts = hvd.allgather_object([v.tolist() for v in start])
    assert all(s == starts[0] for s in starts), "broadcast_global_variables left ranks apart"
    expected = _reference(start)
    for got, want in zip(final, expected):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    assert any(not np.allclose(a, b) for a, b in zip(start, final)), "training did not move the weights"


def test_monitored_training_session_with_broadcast_hook():
    """Upstream's TF1 recipe: MonitoredTrainingSession + BroadcastGlobalVariablesHook, many variables."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(np.full(3, r + k, np.float32)) for k in range(COUNT)]
        total = hvd.allreduce(tf.add_n([tf.reduce_sum(v) for v in variables]), op=hvd.Sum, name="mts_total")
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hvd.BroadcastGlobalVariablesHook(0)],
                                                         config=config) as s:
            got = s.run(total)
            values = s.run(variables)
    for k, v in enumerate(values):
        np.testing.assert_array_equal(v, np.full(3, k, np.float32))  # rank 0's values everywhere
    assert got == n * 3 * sum(range(COUNT))
