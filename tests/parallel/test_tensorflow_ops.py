"""horovod.tensorflow collectives on every rank in lockstep, in eager, tf.function and TF1 graph mode:

    horovodrun -np 2 python -m pytest -x -q tests/parallel/test_tensorflow_ops.py

Inputs come from parallel_util.data (every rank can build every rank's input), expected values from numpy.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import tensorflow as tf
from parallel_util import (
    adasum_expected,
    allreduce_expected,
    data,
    last_rank_short_text,
    launcher_rank_size,
    reducescatter_rows,
    seed,
)

import horovod.tensorflow as hvd

MODES = ["eager", "function", "graph"]
REDUCE_DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]
GATHER_DTYPES = REDUCE_DTYPES + [np.uint16, np.int16, np.bool_]


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.barrier()


def run(mode: str, fn, *inputs):
    """Evaluate ``fn(*tensors)`` in the given execution mode; returns numpy (or a list of numpy)."""
    if mode == "eager":
        out = fn(*[tf.constant(x) for x in inputs])
    elif mode == "function":
        out = tf.function(fn)(*[tf.constant(x) for x in inputs])
    else:
        with tf.Graph().as_default() as g:
            phs = [tf.compat.v1.placeholder(tf.as_dtype(x.dtype), x.shape) for x in inputs]
            res = fn(*phs)
            with tf.compat.v1.Session(graph=g) as s:
                return s.run(res, dict(zip(phs, inputs)))
    return tf.nest.map_structure(lambda t: t.numpy(), out)


def test_layout():
    rank, size = launcher_rank_size()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert int(hvd.rank_op()) == rank and int(hvd.size_op()) == size
    assert int(hvd.local_rank_op()) == hvd.local_rank() and int(hvd.local_size_op()) == hvd.local_size()


@pytest.mark.parametrize("mode", MODES)
def test_eager_ops_are_waited_for_as_synchronous_ones(mode, monkeypatch):
    """Eagerly, the caller waits for its allreduce, allgather or broadcast right away: it is enqueued as a
    synchronous numpy or torch op is (``wake=False``: the caller runs the round and may spin), with results
    as before.  In a graph the completer waits, and nothing changes there."""
    from horovod.common import basics

    engine = basics.engine()
    seen: list[tuple[str, bool]] = []
    original = engine.enqueue_one

    def enqueue_one(request, tensor, output, wake=True, send_now=False):
        seen.append((request.name, wake or send_now))
        return original(request, tensor, output, wake, send_now)

    monkeypatch.setattr(engine, "enqueue_one", enqueue_one)
    r, n = hvd.rank(), hvd.size()
    x = np.arange(6, dtype=np.float64).reshape(2, 3) + r
    summed, gathered, root = run(mode, lambda t: [hvd.allreduce(t, op=hvd.Sum, name=f"sync.ar.{mode}"),
                                                   hvd.allgather(t, name=f"sync.ag.{mode}"),
                                                   hvd.broadcast(t, n - 1, name=f"sync.bc.{mode}")], x)
    everyone = [np.arange(6, dtype=np.float64).reshape(2, 3) + j for j in range(n)]
    np.testing.assert_allclose(summed, sum(everyone))
    np.testing.assert_allclose(gathered, np.concatenate(everyone))
    np.testing.assert_allclose(root, everyone[-1])
    kinds = {name.split(".")[1]: later for name, later in seen if name.startswith("sync.")}
    assert set(kinds) == {"ar", "ag", "bc"}, seen
    assert all(later != (mode == "eager") for later in kinds.values()), seen


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_allreduce(mode, dtype, op):
    r, n = hvd.rank(), hvd.size()
    key = ("ar", mode, np.dtype(dtype).name, op)
    xs = [data(key, j, (3, 5), dtype, low=-3, high=3) for j in range(n)]
    got = run(mode, lambda t: hvd.allreduce(t, op=op, name=f"ar_{mode}_{op}"), xs[r])
    exp = allreduce_expected(xs, op)
    np.testing.assert_allclose(got.astype(np.float64), exp.astype(np.float64), rtol=1e-3)
    assert got.dtype == np.dtype(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [np.int32, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_min_max_product(mode, dtype, op):
    test_allreduce(mode, dtype, op)


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_allreduce_allgather_broadcast(mode):
    """tf.bfloat16 (ml_dtypes' type, which the engine's dtype table loads on first use) in every mode."""
    bf16 = tf.bfloat16.as_numpy_dtype
    r, n = hvd.rank(), hvd.size()
    xs = [data(("bf16", mode), j, (6,), np.float32).astype(bf16) for j in range(n)]  # small integers: exact
    got = run(mode, lambda t: [hvd.allreduce(t, op=hvd.Sum, name=f"bf_ar_{mode}"),
                               hvd.allgather(t, name=f"bf_ag_{mode}"), hvd.broadcast(t, 0, name=f"bf_bc_{mode}")],
              xs[r])
    assert [g.dtype for g in got] == [np.dtype(bf16)] * 3
    np.testing.assert_array_equal(got[0].astype(np.float32), sum(x.astype(np.float32) for x in xs))
    np.testing.assert_array_equal(got[1].astype(np.float32), np.concatenate(xs).astype(np.float32))
    np.testing.assert_array_equal(got[2].astype(np.float32), xs[0].astype(np.float32))


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_scaling_and_grouped(mode):
    r, n = hvd.rank(), hvd.size()
    xs = [data(("sc", mode), j, (4,), np.float32) for j in range(n)]
    ys = [data(("sc2", mode), j, (2, 2), np.float32) for j in range(n)]
    got = run(mode, lambda a, b: [hvd.allreduce(a, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                                  *hvd.grouped_allreduce([a, b], op=hvd.Sum)], xs[r], ys[r])
    np.testing.assert_allclose(got[0], sum(xs), rtol=1e-6)
    np.testing.assert_allclose(got[1], sum(xs), rtol=1e-6)
    np.testing.assert_allclose(got[2], sum(ys), rtol=1e-6)


@pytest.mark.parametrize("mode", ["function", "graph"])
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum, hvd.Max])
def test_grouped_allreduce_many_tensors_large(mode, op):
    """Graph mode reduces a group as the pieces of one flat tensor, read straight from TensorFlow's buffers
    by the shared-memory transport: tiny tensors (merged), tensors across its 1 MiB pieces, 2.6 MB in all."""
    r, n = hvd.rank(), hvd.size()
    shapes = [(3,), (300, 500), (7, 2), (1,), (40_000,), (5, 5), (200, 1001), (9,), (64, 64, 3), (2,)]
    xs = [[data(("many", mode, op, i), j, s, np.float32, low=-9, high=9) for i, s in enumerate(shapes)]
          for j in range(n)]
    got = run(mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=op, name=f"many_{mode}_{op}"), *xs[r])
    for i, s in enumerate(shapes):
        exp = allreduce_expected([xs[j][i] for j in range(n)], op)
        assert got[i].shape == s
        np.testing.assert_allclose(got[i], exp, rtol=1e-6, err_msg=f"tensor {i} {s}")


def _data_address(t: tf.Tensor) -> int:
    """Where ``t``'s elements live (the ``data`` field that opens a DLPack ``DLTensor``)."""
    capsule = tf.experimental.dlpack.to_dlpack(t)
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.c_void_p.from_address(get(capsule, b"dltensor")).value


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=lambda d: np.dtype(d).name)
def test_grouped_allreduce_small_results_share_one_buffer(dtype):
    """In a tf.function the results under 64 KiB are slices of one flat buffer; every one whose size is a
    multiple of 64 bytes is a view, also after odd-sized ones (each starts on a 64-byte boundary), and the
    values are still the sums."""
    r, n = hvd.rank(), hvd.size()
    itemsize = np.dtype(dtype).itemsize
    shapes = [(3,), (96, 64), (7,), (24,), (128, 32), (5, 5), (64,)]
    xs = [[data(("views", np.dtype(dtype).name, i), j, s, dtype, low=-3, high=3) for i, s in enumerate(shapes)]
          for j in range(n)]
    outs = tf.function(lambda *ts: hvd.grouped_allreduce(list(ts), op=hvd.Sum))(*[tf.constant(x) for x in xs[r]])
    for i in range(len(shapes)):
        np.testing.assert_allclose(outs[i].numpy(), sum(x[i] for x in xs), rtol=1e-3 if dtype == np.float16 else 1e-6)
    viewed = [i for i, s in enumerate(shapes) if int(np.prod(s)) * itemsize % 64 == 0]
    assert len(viewed) >= 2
    padded = [-(-int(np.prod(s)) * itemsize // 64) * 64 for s in shapes]
    first = viewed[0]
    for i in viewed[1:]:
        assert _data_address(outs[i]) - _data_address(outs[first]) == sum(padded[first:i]), (i, shapes[i])


def test_grouped_allreduce_large_results_are_updated_in_place(monkeypatch):
    """Results of 64 KiB or more are written into buffers of their own (the inputs', reduced in place), so the
    next op (here ``* 0.5``, as an optimizer's ``lr * grad``) writes its output into the same memory instead
    of a new buffer.  Fresh inputs on every call: a result read before the engine wrote it (Grappler folding
    away the dependency on the collective, which it did for a reshape chain) would show last call's sums."""
    from horovod.tensorflow import mpi_ops
    r, n = hvd.rank(), hvd.size()
    written: list[int] = []
    submit = mpi_ops._ops.allreduce

    def recording(tensor, output=None, **kwargs):
        if output is None:  # the name's layout check (its first call), not the group's allreduce
            return submit(tensor, output, **kwargs)
        parts = output.parts if isinstance(output, mpi_ops._ops.Pieces) else [output]
        written[:] = [p.ctypes.data for p in parts]
        return submit(tensor, output, **kwargs)
    monkeypatch.setattr(mpi_ops._ops, "allreduce", recording)
    shapes = [(300, 100), (17,), (128, 130), (), (70_000,)]  # own, shared, own, shared, own

    @tf.function
    def step(*ts):
        gs = hvd.grouped_allreduce(list(ts), op=hvd.Sum, name="in_place")
        return [tf.reshape(g, [-1]) * 0.5 for g in gs]  # a reshape of our result: no reshape chain folding
    for call in range(4):
        xs = [[data(("own", call, i), j, s, np.float32, low=-5, high=5) for i, s in enumerate(shapes)]
              for j in range(n)]
        outs = step(*[tf.constant(x) for x in xs[r]])
        for i, s in enumerate(shapes):
            exp = 0.5 * sum(x[i] for x in xs).reshape(-1)
            np.testing.assert_allclose(outs[i].numpy(), exp, rtol=1e-6, err_msg=f"call {call} tensor {i} {s}")
        own = {_data_address(outs[i]) for i in (0, 2, 4)}
        assert own <= set(written), "the update allocated a new buffer instead of reusing the result's"


def test_grouped_allreduce_reduces_a_tensor_made_for_it_in_place():
    """A tensor nothing else reads (a gradient) is reduced in its own buffer: ``Snapshot`` hands the buffer over
    instead of copying it, and the result is that buffer -- no 21 MB of fresh memory written per Keras step."""
    from horovod.tensorflow import mpi_ops
    r, n = hvd.rank(), hvd.size()
    seen: list[int] = []
    reduced: list[int] = []
    submit = mpi_ops._ops.allreduce

    def recording(tensor, output=None, **kwargs):
        if output is None:  # the name's layout check (its first call), not the tensor's allreduce
            return submit(tensor, output, **kwargs)
        reduced[:] = [p.ctypes.data for p in (tensor.parts if isinstance(tensor, mpi_ops._ops.Pieces) else [tensor])]
        assert output is tensor
        return submit(tensor, output, **kwargs)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(mpi_ops._ops, "allreduce", recording)

    def where(a):
        seen.append(a.ctypes.data)
        return np.int64(0)

    @tf.function
    def step(x):
        g = x * 2.0  # a fresh buffer, read by the probe first and then by the allreduce alone
        probe = tf.numpy_function(where, [g], tf.int64, stateful=True)
        with tf.control_dependencies([probe]):
            return hvd.allreduce(g, op=hvd.Sum, name="made_for_it")
    try:
        for call in range(3):
            xs = [data(("made_for_it", call), j, (400, 100), np.float32) for j in range(n)]
            out = step(tf.constant(xs[r]))
            np.testing.assert_allclose(out.numpy(), sum(2.0 * x for x in xs), rtol=1e-6)
            assert reduced == [seen[-1]] == [_data_address(out)], "the gradient's buffer was copied"
    finally:
        monkeypatch.undo()


def test_in_place_group_of_one_tensor_twice_large():
    """One tensor given twice in a group large enough for the piece-by-piece exchange (4 MB each): the two
    copies must be reduced separately, not one buffer reduced twice (common-subexpression elimination merges
    two identical Snapshots unless each carries an attribute of its own)."""
    r, n = hvd.rank(), hvd.size()
    xs = [data("twice_large", j, (1024, 1024), np.float32) for j in range(n)]

    @tf.function
    def step(x):
        g = x * 3.0
        return hvd.grouped_allreduce([g, g, x * 3.0], op=hvd.Sum, name="twice_large")
    for call in range(2):
        for i, o in enumerate(step(tf.constant(xs[r]))):
            np.testing.assert_allclose(o.numpy(), sum(3.0 * x for x in xs), rtol=1e-5, err_msg=f"{call} {i}")


def test_in_place_results_never_reach_other_readers():
    """Reducing in place must not change what anything else reads: a tensor the graph also uses afterwards,
    a constant of the function (which every call reuses; also the one Grappler makes of a ``zeros_like``), a
    variable's value, the function's argument, an alias made by a reshape, one tensor given twice, and one
    expression written twice (one tensor after common-subexpression elimination) in two collectives.  Called
    three times, so a constant or variable reduced in place would show twice (or n times) its value on the
    next call."""
    r, n = hvd.rank(), hvd.size()
    shape = (300, 100)  # 120 KB: a buffer of its own
    xs = [data("readers_arg", j, shape, np.float32) for j in range(n)]
    cs = [data("readers_const", j, shape, np.float32) for j in range(n)]
    vs = [data("readers_var", j, shape, np.float32) for j in range(n)]
    var = tf.Variable(vs[r])

    @tf.function
    def step(x):
        g = x * 3.0
        h = tf.reshape(x * 5.0, [-1])  # read again below, through an alias
        k = x * 7.0  # the same expression twice: merged into one tensor by common-subexpression elimination
        outs = hvd.grouped_allreduce([g, tf.constant(cs[r]), var.read_value(), x, tf.reshape(h, shape), g,
                                      tf.zeros_like(x), x * 7.0], op=hvd.Sum, name="readers")
        outs.append(hvd.allreduce(k, op=hvd.Sum, name="readers_again"))  # another collective, same buffer
        return outs, g + 0.0, tf.reduce_sum(h), x + 0.0
    for call in range(3):
        outs, g_after, h_sum, x_after = step(tf.constant(xs[r]))
        expected = [sum(3.0 * x for x in xs), sum(cs), sum(vs), sum(xs), sum(5.0 * x for x in xs),
                    sum(3.0 * x for x in xs), np.zeros(shape), sum(7.0 * x for x in xs), sum(7.0 * x for x in xs)]
        for i, (o, e) in enumerate(zip(outs, expected)):
            np.testing.assert_allclose(o.numpy(), e, rtol=1e-5, err_msg=f"call {call} result {i}")
        np.testing.assert_allclose(g_after.numpy(), 3.0 * xs[r], rtol=1e-6)
        np.testing.assert_allclose(h_sum.numpy(), (5.0 * xs[r]).sum(dtype=np.float64), rtol=1e-4)
        np.testing.assert_allclose(x_after.numpy(), xs[r], rtol=0)
        np.testing.assert_array_equal(var.numpy(), vs[r])


@pytest.mark.parametrize("mode", MODES)
def test_adasum_allreduce_grouped_and_tape(mode):
    """hvd.Adasum against upstream's test reference: a tensor, a group (each tensor combined alone, also where
    tf.function's graph would hand the group over as one flat buffer) and DistributedGradientTape(op=Adasum)."""
    rank, size = hvd.rank(), hvd.size()

    def floats(key, shape):
        return [np.random.default_rng([seed(key), r]).normal(size=shape).astype(np.float32) for r in range(size)]

    xs, ys = floats("ada.x", (6, 5)), floats("ada.y", (40_000,))
    got = run(mode, lambda x: hvd.allreduce(x, op=hvd.Adasum), xs[rank])
    np.testing.assert_allclose(got, adasum_expected(xs), rtol=1e-5, atol=1e-5)
    got = run(mode, lambda x, y: hvd.grouped_allreduce([x, y], op=hvd.Adasum), xs[rank], ys[rank])
    np.testing.assert_allclose(got[0], adasum_expected(xs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], adasum_expected(ys), rtol=1e-5, atol=1e-5)
    if mode == "graph":
        return
    w1, w2 = tf.Variable(floats("ada.w1", (5, 3))[0]), tf.Variable(floats("ada.w2", (3,))[0])

    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(x @ w1) * w2)
        return hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w1, w2])

    got = run(mode, grads, xs[rank])
    local = []
    for x in xs:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.constant(x) @ w1) * w2)
        local.append([g.numpy() for g in tape.gradient(loss, [w1, w2])])
    for i in range(2):
        np.testing.assert_allclose(got[i], adasum_expected([g[i] for g in local]), rtol=1e-4, atol=1e-5)


def test_adasum_tf1_optimizer_reduces_the_deltas_of_each_ranks_own_step():
    """DistributedOptimizer(tf.compat.v1.train optimizer, op=Adasum) in a TF1 session: every rank's Momentum
    step on its own data, then start + Adasum(deltas); the reference replays every rank's step locally."""
    rank, size = hvd.rank(), hvd.size()
    if size == 1:
        pytest.skip("a single rank takes the plain optimizer's path")
    rng = np.random.default_rng(seed("tf1.adasum"))
    w0, b0 = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    data = [[np.random.default_rng([seed("tf1.adasum.x"), s, k]).normal(size=(5, 4)).astype(np.float32)
             for k in range(size)] for s in range(3)]

    def loss_of(w, b, x):
        return tf.reduce_sum(tf.tanh(x @ w + b) ** 2)

    with tf.Graph().as_default():
        w, b = tf.compat.v1.get_variable("w", initializer=w0), tf.compat.v1.get_variable("b", initializer=b0)
        x = tf.compat.v1.placeholder(tf.float32, (5, 4))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), op=hvd.Adasum)
        step = tf.compat.v1.train.get_or_create_global_step()
        train = opt.minimize(loss_of(w, b, x), global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for s in range(3):
                sess.run(train, {x: data[s][rank]})
            got, steps = sess.run([w, b]), sess.run(step)
    replicas = [(tf.Variable(w0), tf.Variable(b0), tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
                for _ in range(size)]
    start = [w0.astype(np.float64), b0.astype(np.float64)]
    for s in range(3):
        deltas = []
        for k, (wk, bk, optk) in enumerate(replicas):
            wk.assign(start[0].astype(np.float32))
            bk.assign(start[1].astype(np.float32))
            optk.minimize(lambda: loss_of(wk, bk, tf.constant(data[s][k])), var_list=[wk, bk])  # noqa: B023
            deltas.append([wk.numpy() - start[0].astype(np.float32), bk.numpy() - start[1].astype(np.float32)])
        start = [start[i] + adasum_expected([d[i] for d in deltas]) for i in range(2)]
    assert steps == 3
    for g, e in zip(got, start):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    with tf.Graph().as_default():  # a registered local variable keeps its own rank's step
        w, b = tf.compat.v1.get_variable("w", initializer=w0), tf.compat.v1.get_variable("b", initializer=b0)
        x = tf.compat.v1.placeholder(tf.float32, (5, 4))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum)
        opt.register_local_var(b)
        train = opt.minimize(loss_of(w, b, x))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, {x: data[0][rank]})
            got_b = sess.run(b)
    with tf.GradientTape() as tape:
        bk = tf.Variable(b0)
        loss = loss_of(tf.constant(w0), bk, tf.constant(data[0][rank]))
    np.testing.assert_allclose(got_b, b0 - 0.1 * tape.gradient(loss, bk).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="backward_passes_per_step must be 1 with op=hvd.Adasum"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum,
                                 backward_passes_per_step=2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: np.dtype(d).name)
def test_allgather_variable_rows(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    xs = [data(("ag", mode, np.dtype(dtype).name), j, (j + 1, 3), dtype) for j in range(n)]
    got = run(mode, lambda t: hvd.allgather(t), xs[r])
    np.testing.assert_array_equal(got, np.concatenate(xs))
    got = run(mode, lambda a, b: hvd.grouped_allgather([a, b]), xs[r], xs[r][:, :1])
    np.testing.assert_array_equal(got[1], np.concatenate([x[:, :1] for x in xs]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", GATHER_DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    xs = [data(("bc", mode, np.dtype(dtype).name), j, (2, 3), dtype) for j in range(n)]
    for root in range(n):
        np.testing.assert_array_equal(run(mode, lambda t, root=root: hvd.broadcast(t, root), xs[r]), xs[root])


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_and_reducescatter(mode):
    r, n = hvd.rank(), hvd.size()
    xs = [data(("a2a", mode), j, (2 * n, 2), np.int32) for j in range(n)]
    got = run(mode, lambda t: hvd.alltoall(t), xs[r])
    np.testing.assert_array_equal(got, np.concatenate([x[2 * r:2 * r + 2] for x in xs]))
    splits = np.array([1 + (j % 2) for j in range(n)], np.int32)
    ys = [data(("a2as", mode), j, (int(splits.sum()) + 1, 2), np.float32) for j in range(n)]
    out, recv = run(mode, lambda t, s: hvd.alltoall(t, splits=s), ys[r], splits)
    off = int(splits[:r].sum())
    np.testing.assert_array_equal(out, np.concatenate([y[off:off + splits[r]] for y in ys]))
    np.testing.assert_array_equal(recv, [splits[r]] * n)
    zs = [data(("rs", mode), j, (2 * n + 1, 3), np.float32) for j in range(n)]
    rows = reducescatter_rows(2 * n + 1, n)
    start = sum(rows[:r])
    got = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), zs[r])
    np.testing.assert_allclose(got, sum(zs)[start:start + rows[r]], rtol=1e-6)
    got = run(mode, lambda a: hvd.grouped_reducescatter([a, a * 2], op=hvd.Average), zs[r])
    np.testing.assert_allclose(got[1], (2 * sum(zs) / n)[start:start + rows[r]], rtol=1e-5)


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_eager_tensors_captured_by_a_tf_function(named):
    """Eager tensors made outside a ``tf.function`` and used inside it have no name while it is traced
    (``Tensor.name`` raises AttributeError): a name given is all a collective needs, and without one the
    automatic key calls them ``captured`` (their placeholders' names differ per process), numbered in the order
    the function is traced, the same on every rank."""
    r, n = hvd.rank(), hvd.size()
    key = ("captured", named)
    xs = [data((*key, "x"), j, (2 * n, 3), np.float32) for j in range(n)]
    ys = [data((*key, "y"), j, (n + 1,), np.float32) for j in range(n)]
    a, b = tf.constant(xs[r]), tf.constant(ys[r])
    splits = tf.constant(np.full(n, 2, np.int32))
    rows = tf.constant(np.arange(n + 1, dtype=np.int64) + r)

    def name(op: str) -> str | None:
        return f"captured.{op}" if named else None

    @tf.function
    def step():
        sparse = hvd.allreduce(tf.IndexedSlices(b, rows, tf.constant([2 * n + 1], tf.int64)), op=hvd.Sum,
                               name=name("sparse"))
        return {"allreduce": hvd.allreduce(a, op=hvd.Sum, name=name("ar")),
                "grouped_allreduce": hvd.grouped_allreduce([a, b], op=hvd.Sum, name=name("gar")),
                "allgather": hvd.allgather(b, name=name("ag")),
                "grouped_allgather": hvd.grouped_allgather([a, b], name=name("gag")),
                "broadcast": hvd.broadcast(a, 0, name=name("bc")),
                "alltoall": hvd.alltoall(a, splits=splits, name=name("a2a")),
                "reducescatter": hvd.reducescatter(a, op=hvd.Sum, name=name("rs")),
                "grouped_reducescatter": hvd.grouped_reducescatter([a, b], op=hvd.Sum, name=name("grs")),
                "sparse": (sparse.values, sparse.indices)}

    got = tf.nest.map_structure(lambda t: t.numpy(), step())
    ga, gb = reducescatter_rows(2 * n, n), reducescatter_rows(n + 1, n)
    sa, sb = sum(ga[:r]), sum(gb[:r])
    expected = {"allreduce": sum(xs), "grouped_allreduce": [sum(xs), sum(ys)], "allgather": np.concatenate(ys),
                "grouped_allgather": [np.concatenate(xs), np.concatenate(ys)], "broadcast": xs[0],
                "alltoall": (np.concatenate([x[2 * r:2 * r + 2] for x in xs]), np.full(n, 2, np.int32)),
                "reducescatter": sum(xs)[sa:sa + ga[r]],
                "grouped_reducescatter": [sum(xs)[sa:sa + ga[r]], sum(ys)[sb:sb + gb[r]]],
                "sparse": (np.concatenate(ys), np.concatenate([np.arange(n + 1) + j for j in range(n)]))}
    assert got.keys() == expected.keys()
    for op in expected:
        tf.nest.map_structure(lambda g, e, op=op: np.testing.assert_array_equal(g, e, err_msg=op), got[op],
                              expected[op])


@pytest.mark.parametrize("mode", MODES)
def test_process_sets(mode):
    """Collectives on a dynamic set of the even ranks (the driver sets HOROVOD_DYNAMIC_PROCESS_SETS=1)."""
    r, n = hvd.rank(), hvd.size()
    even = [j for j in range(n) if j % 2 == 0] if n > 2 else [0]
    ps = hvd.add_process_set(even)
    try:
        if r in even:
            xs = [data(("ps", mode), j, (4,), np.float32) for j in range(n)]
            # named: unnamed eager ops are numbered per process, and non-members skip these calls
            got = run(mode, lambda t: [hvd.allreduce(t, op=hvd.Sum, process_set=ps, name=f"ps_ar_{mode}"),
                                       hvd.allgather(t, process_set=ps, name=f"ps_ag_{mode}"),
                                       hvd.broadcast(t, even[-1], process_set=ps, name=f"ps_bc_{mode}")], xs[r])
            np.testing.assert_allclose(got[0], sum(xs[j] for j in even), rtol=1e-6)
            np.testing.assert_array_equal(got[1], np.concatenate([xs[j] for j in even]))
            np.testing.assert_array_equal(got[2], xs[even[-1]])
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match="not a member of the provided process set"):
                hvd.allreduce(tf.ones([1]), process_set=ps)
    finally:
        hvd.remove_process_set(ps)


def test_fp16_compression_and_indexed_slices():
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(np.full(4, r + 1.0, np.float32))
    out = hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), np.full(4, n * (n + 1) / 2))
    s = tf.IndexedSlices(tf.constant([[float(r)]]), tf.constant([r]), dense_shape=tf.constant([n, 1]))
    red = hvd.allreduce(s, op=hvd.Average)
    assert isinstance(red, tf.IndexedSlices)
    np.testing.assert_allclose(red.values.numpy()[:, 0], np.arange(n) / n)
    np.testing.assert_array_equal(red.indices.numpy(), np.arange(n))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradients(mode):
    r, n = hvd.rank(), hvd.size()
    x = tf.Variable(np.arange(3, dtype=np.float32) + r)

    def grads():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * 2.0) + tf.reduce_sum(hvd.allgather(x) ** 2) \
                + tf.reduce_sum(hvd.broadcast(x, 0) * 3.0)
        return tape.gradient(y, x)

    g = (tf.function(grads)() if mode == "function" else grads()).numpy()
    # d/dx allreduce_sum: Sum-allreduce of upstream grad (2*n); allgather: averaged 2*concat, own rows;
    # broadcast: averaged grad on the root, zeros elsewhere.
    xs = [np.arange(3, dtype=np.float32) + j for j in range(n)]
    gather = 2 * np.concatenate(xs)[3 * r:3 * r + 3]
    exp = np.full(3, 2.0 * n) + gather + (3.0 if r == 0 else 0.0)
    np.testing.assert_allclose(g, exp, rtol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_graph_independent_ops_any_order(threads):
    """Two independent allreduces whose inputs arrive in opposite orders on the two ranks."""
    r = hvd.rank()

    def slow(v):
        time.sleep(0.2)
        return v

    def build(a, b):
        if r % 2 == 0:
            b = tf.numpy_function(slow, [b], tf.float32)
        else:
            a = tf.numpy_function(slow, [a], tf.float32)
        return hvd.allreduce(a, op=hvd.Sum, name="indep_a"), hvd.allreduce(b, op=hvd.Sum, name="indep_b")

    n = hvd.size()
    with tf.Graph().as_default() as g:
        a = tf.compat.v1.placeholder(tf.float32, [2])
        b = tf.compat.v1.placeholder(tf.float32, [2])
        outs = build(a, b)
        cfg = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=g, config=cfg) as s:
            got = s.run(outs, {a: np.ones(2), b: np.full(2, 2.0)})
    np.testing.assert_allclose(got[0], n)
    np.testing.assert_allclose(got[1], 2 * n)
    got = tf.function(build)(tf.ones(2), tf.fill([2], 2.0))
    np.testing.assert_allclose(got[1].numpy(), 2 * n)


def test_broadcast_variables_and_objects():
    r = hvd.rank()
    v = [tf.Variable(np.full(3, r, np.float32)), tf.Variable(r)]
    hvd.broadcast_variables(v, root_rank=0)
    assert v[0].numpy().tolist() == [0, 0, 0] and int(v[1].numpy()) == 0
    obj = hvd.broadcast_object({"rank": r, "x": [1, 2]}, root_rank=0)
    assert obj == {"rank": 0, "x": [1, 2]}
    assert hvd.allgather_object(r) == list(range(hvd.size()))
    w = tf.Variable(np.full(2, r + 5.0, np.float32))
    hvd.broadcast_(w, 0)
    assert w.numpy().tolist() == [5.0, 5.0]
    with tf.Graph().as_default():
        tf.compat.v1.Variable(np.full(2, float(r)), name="gv")
        op = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(op)
            assert s.run(tf.compat.v1.global_variables()[0]).tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError):
        hvd.broadcast_global_variables(0)


def test_broadcast_variables_in_tf_function_is_one_collective():
    """``broadcast_variables`` of a model's and optimizer's variables in a traced first step (upstream's
    tensorflow2 examples) is one graph collective, not one per variable: each collective's ops took ~20 ms to
    build, so a 25-layer model's first step traced 4.6x longer than without Horovod.  Every variable still gets
    the root's value, whatever its dtype."""
    r = hvd.rank()
    vs = [tf.Variable(np.full(k + 1, r + k, np.float32)) for k in range(8)] + [tf.Variable(r, dtype=tf.int64)]

    @tf.function
    def step():
        hvd.broadcast_variables(vs, root_rank=0)

    step()
    assert [v.numpy().tolist() for v in vs[:8]] == [[float(k)] * (k + 1) for k in range(8)]
    assert int(vs[8].numpy()) == 0
    graph = step.get_concrete_function().graph
    submits = [op for op in graph.get_operations() if op.type in ("PyFunc", "EagerPyFunc") and "submit" in op.name]
    assert len(submits) == 1, [op.name for op in submits]


def test_join_returns_last_rank():
    last = hvd.join()
    assert 0 <= int(last) < hvd.size()


# ------------------------------------------------------------------------------------------------ errors
def test_mismatch_is_failed_precondition():
    r = hvd.rank()
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched ALLREDUCE tensor shapes"):
        hvd.allreduce(tf.ones([r + 1]), name="err_shape")
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched data types"):
        hvd.allreduce(tf.ones([2], dtype=tf.float32 if r == 0 else tf.int32), name="err_dtype")


def test_grouped_lists_of_different_lengths_fail_at_once_on_every_rank():
    """The last rank groups 2 tensors, the others 3: eagerly the names g_1of3.. and g_1of2.. never matched and
    the job waited for the stall inspector (upstream: forever); inside tf.function the group is one flat tensor
    whose length differs.  Every rank gets an error at once, and the job goes on."""
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        pytest.skip("needs two ranks")
    count = 3 - (r == n - 1)
    t0 = time.monotonic()
    with pytest.raises(tf.errors.FailedPreconditionError) as info:
        hvd.grouped_allreduce([tf.ones([2])] * count, name="err_short", op=hvd.Sum)
    assert time.monotonic() - t0 < 15
    assert last_rank_short_text("ALLREDUCE", "err_short", n) in str(info.value)
    with pytest.raises(tf.errors.OpError, match="Mismatched ALLREDUCE tensor shapes"):
        tf.function(lambda: hvd.grouped_allreduce([tf.ones([2])] * count, name="err_short_fn", op=hvd.Sum))()
    assert time.monotonic() - t0 < 30
    got = hvd.grouped_allreduce([tf.ones([2])] * 2, name="err_short", op=hvd.Sum)
    assert [g.numpy().tolist() for g in got] == [[n, n]] * 2


def test_mismatch_in_graph_mode_keeps_message():
    r = hvd.rank()
    with pytest.raises(tf.errors.OpError, match="Mismatched ALLREDUCE tensor shapes"):
        tf.function(lambda: hvd.allreduce(tf.ones([r + 1]), name="err_shape_fn"))()


def test_mismatch_in_graph_mode_surfaces_through_a_reshape():
    """The check that raises a collective's error must survive Grappler also when the result is reshaped
    again (it folds ``Reshape(Reshape(x))`` into one): results written into TensorFlow's own buffers (64 KiB
    and more) and results that came through the receive queue (allgather) alike."""
    r = hvd.rank()
    with pytest.raises(tf.errors.OpError, match="Mismatched ALLREDUCE tensor shapes"):
        tf.function(lambda: tf.reshape(hvd.allreduce(tf.ones([r + 1, 20_000]), name="err_own_fn"), [-1]) * 2)()
    with pytest.raises(tf.errors.OpError, match="Mismatched"):
        tf.function(lambda: tf.reshape(hvd.allgather(tf.ones([2, 3 + r]), name="err_gather_fn"), [-1]) * 2)()


def test_mismatch_of_equal_flat_lengths_in_graph_mode_is_reported():
    """Inside tf.function an allreduce reaches the engine as one flat tensor, whose length is all the engine
    compares: shapes [2, 3] and [3, 2], or a group's tensors of [3] and [4] elements (the 64-byte gaps between
    a group's tensors give both the same length), were summed into the wrong elements without an error -- a
    model that differs between ranks trained on wrong gradients.  Each name's first reduction now checks the
    shapes too; a later call of the name with the same shapes everywhere works."""
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(tf.errors.OpError, match="Mismatched ALLREDUCE tensor shapes: the tensors reduced together "
                                                "as err_transposed_fn do not have the same shapes on every rank"):
        tf.function(lambda: hvd.allreduce(tf.ones([2, 3] if r == 0 else [3, 2]), name="err_transposed_fn"))()
    with pytest.raises(tf.errors.OpError, match=r"err_padded_fn do not have the same shapes on every rank; this "
                                                rf"rank's: \[\[{3 + r}\], \[2\]\] \(2 tensors\)"):
        tf.function(lambda: hvd.grouped_allreduce([tf.ones([3 + r]), tf.ones([2])], name="err_padded_fn"))()
    w = [tf.ones([3 + r]), tf.ones([2])]

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(w[0]) + tf.reduce_sum(w[1])
        return hvd.DistributedGradientTape(tape).gradient(loss, w)
    with pytest.raises(tf.errors.OpError, match="do not have the same shapes on every rank"):
        grads()
    got = tf.function(lambda: hvd.grouped_allreduce([tf.ones([3]), tf.ones([2])], name="err_padded_fn",
                                                    op=hvd.Sum))()
    assert [g.numpy().tolist() for g in got] == [[n] * 3, [n] * 2]


def test_a_call_after_an_aborted_one_gets_its_own_results():
    """A step that fails (here: another collective mismatches) cancels its other receives, but their
    collectives still finish and deliver.  The next call of the same function must not take those results for
    its own: it used to, and every later call then returned the result of the call before it."""
    r, n = hvd.rank(), hvd.size()

    @tf.function
    def step(a, b):
        return hvd.allreduce(a, op=hvd.Sum, name="abort_a"), hvd.allreduce(b, op=hvd.Sum, name="abort_b")
    big = 40_000_000  # 160 MB: still being reduced when the mismatch aborts the step
    with pytest.raises(tf.errors.OpError, match="Mismatched"):
        step(tf.ones([3 if r == 1 else 2]), tf.fill([big], 1.0))  # rank 1 traces its own copy, the others reuse
    time.sleep(0.5)  # the aborted call's other collective finishes meanwhile (an elastic reset takes longer)
    for call in range(1, 4):
        _, b = step(tf.ones([2]), tf.fill([big], float(call + 1)))
        got = b.numpy()
        assert got[0] == got[-1] == n * (call + 1), (call, got[:2], got[-2:])


def test_steady_calls_do_not_ask_the_queue_and_unused_results_still_deliver(monkeypatch):
    """A call after a normally finished one skips the queue's leftover check (an eager op inside a running
    function); a function that returns none of a collective's results (its check is pruned, so nothing counts
    the deliveries read) asks every time and still returns right results from its other collective."""
    from horovod.tensorflow import _bridge
    r, n = hvd.rank(), hvd.size()
    sites, asked = [], []
    init, drop = _bridge._Site.__init__, _bridge._Site._drop_stale
    monkeypatch.setattr(_bridge._Site, "__init__", lambda site, q: (sites.append(site), init(site, q))[1])
    monkeypatch.setattr(_bridge._Site, "_drop_stale", lambda site: (asked.append(site), drop(site))[1])

    @tf.function
    def used(x):
        return hvd.allreduce(x, op=hvd.Sum, name="steady_used")

    @tf.function
    def unused(x, y):
        hvd.allreduce(x, op=hvd.Sum, name="steady_unused")
        return hvd.allreduce(y, op=hvd.Sum, name="steady_returned")

    for call in range(4):
        x = tf.fill([1000], float(r + call))
        np.testing.assert_allclose(used(x).numpy(), np.full(1000, sum(q + call for q in range(n)), np.float32))
        np.testing.assert_allclose(unused(x, 2 * x).numpy(),
                                   np.full(1000, 2 * sum(q + call for q in range(n)), np.float32))
    used_site, unused_site, returned_site = sites  # in the order traced
    assert used_site not in asked and returned_site not in asked, "a call after a normal one asked the queue"
    assert all(site is unused_site for site in asked) and len(asked) <= 3


def test_small_graph_collectives_finish_in_their_submit_op(monkeypatch):
    """A small collective inside ``tf.function`` is waited for by its submit op for a while (the completer
    thread, the queue and the check then do nothing); one whose peer comes later is taken over by the
    completer.  Both give the right results: allreduce written in place, grouped, allgather and broadcast."""
    from horovod.tensorflow import _bridge
    r, n = hvd.rank(), hvd.size()
    handed = []
    put = _bridge._completer.put
    monkeypatch.setattr(_bridge._completer, "put", lambda *a: (handed.append(a), put(*a))[1])

    def late(x):
        time.sleep(0.3 if r == n - 1 else 0.0)  # the last rank reaches the collectives 0.3 s after the others
        return x

    @tf.function
    def step(x, delay):
        x = tf.cond(delay, lambda: tf.numpy_function(late, [x], tf.float32, stateful=True), lambda: x)
        x.set_shape([6])
        # one after the other (one submit op at a time waits; independent ones go to the completer at once)
        a = hvd.allreduce(x, op=hvd.Sum, name="quick_sum")
        b, c = hvd.grouped_allreduce([x * a, 2 * x], op=hvd.Average, name="quick_group")
        with tf.control_dependencies([b, c]):
            g = hvd.allgather(x[:2], name="quick_gather")
        with tf.control_dependencies([g]):
            return a, b, c, g, hvd.broadcast(x, n - 1, name="quick_bcast")

    xs = [np.arange(6, dtype=np.float32) * (q + 1) for q in range(n)]
    for wait_s, delay in ((30.0, False), (0.01, True)):
        monkeypatch.setattr(_bridge, "QUICK_WAIT_S", wait_s)
        for call in range(3):
            handed.clear()
            hvd.allreduce(tf.ones([1]), name=f"quick_align_{delay}_{call}")  # every rank starts the call together
            a, b, c, g, bc = (t.numpy() for t in step(tf.constant(xs[r]), tf.constant(delay)))
            np.testing.assert_allclose(a, np.sum(xs, 0), rtol=1e-6)
            np.testing.assert_allclose(b, np.mean(xs, 0) * np.sum(xs, 0), rtol=1e-6)
            np.testing.assert_allclose(c, 2 * np.mean(xs, 0), rtol=1e-6)
            np.testing.assert_array_equal(g, np.concatenate([x[:2] for x in xs]))
            np.testing.assert_array_equal(bc, xs[n - 1])
            if not delay:
                assert not handed, f"call {call}: {len(handed)} small collectives went to the completer"
            elif r != n - 1:
                assert handed, f"call {call}: a collective whose peer came 0.3 s later never reached the completer"


def test_bad_arguments_are_invalid_argument():
    n = hvd.size()
    with pytest.raises(tf.errors.InvalidArgumentError, match="first dimension of tensor is not an even multiple"):
        hvd.alltoall(tf.ones([n + 1]) if n > 1 else tf.ones([]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="invalid root rank"):
        hvd.broadcast(tf.ones([1]), root_rank=n)
    for root in ("1", 0.5):  # were converted by int(): rank 1, rank 0
        with pytest.raises(TypeError, match="broadcast's root_rank must be an int"):
            hvd.broadcast(tf.ones([1]), root_rank=root)
        with pytest.raises(TypeError, match="broadcast's root_rank must be an int"):
            tf.function(lambda: hvd.broadcast(tf.ones([1]), root_rank=root))()  # noqa: B023 - called at once
    with pytest.raises(NotImplementedError):
        hvd.allreduce(tf.IndexedSlices(tf.ones([1, 1]), tf.constant([0])), op=hvd.Max)


@pytest.mark.parametrize("mode", MODES)
def test_a_dtype_the_engine_cannot_carry_is_a_type_error_when_built(mode):
    """string, complex, uint32 tensors: upstream's ops refuse them by their type constraints, a ``TypeError``
    when the op is built (eagerly, traced, in a TF1 graph).  Ours reached the engine and failed with
    ``InvalidArgumentError`` ('Tensor type object is not supported.'), inside ``tf.function`` only when the
    function ran.  Every rank fails alike before any negotiation, so nothing waits."""
    calls = {
        "allreduce": lambda x: hvd.allreduce(x, op=hvd.Sum),
        "grouped_allreduce": lambda x: hvd.grouped_allreduce([x, x], op=hvd.Sum),
        "allgather": lambda x: hvd.allgather(x),
        "broadcast": lambda x: hvd.broadcast(x, 0),
        "alltoall": lambda x: hvd.alltoall(x),
        "reducescatter": lambda x: hvd.reducescatter(x, op=hvd.Sum),
    }
    n = hvd.size()
    for value in (np.array([b"a"] * n, dtype=object), np.ones(n, np.complex64), np.ones(n, np.uint32)):
        dtype = tf.constant(value).dtype
        for fn in calls.values():
            with pytest.raises(TypeError, match=f"DataType {dtype.name} not in list of allowed values"):
                if mode == "graph":
                    with tf.Graph().as_default():
                        fn(tf.compat.v1.placeholder(dtype, value.shape))
                elif mode == "function":
                    tf.function(fn)(tf.constant(value))
                else:
                    fn(tf.constant(value))
            if mode == "eager":  # the variables' broadcast too
                with pytest.raises(TypeError, match=f"DataType {dtype.name} not in list"):
                    hvd.broadcast_variables([tf.Variable(value)], root_rank=0)
    hvd.allreduce(tf.ones([1]), name=f"after_bad_dtypes_{mode}")  # the engine is fine
