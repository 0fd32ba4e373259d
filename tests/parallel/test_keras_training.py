"""Training with horovod.tensorflow / horovod.tensorflow.keras on every rank in lockstep:

    horovodrun -np 2 python -m pytest -x -q tests/parallel/test_keras_training.py

Equivalence: np ranks on their slices of a batch end with the weights one process gets on the whole batch
(computed locally on every rank, without Horovod collectives, as the reference).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvdk
from horovod._keras import is_distributed_optimizer

ROOT = Path(__file__).resolve().parent.parent.parent
STEPS, BATCH, FEATURES = 4, 8, 5


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield


def problem():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * BATCH * hvd.size(), FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype(np.float32)
    return x, y


def shard(a, step):
    """Rank's contiguous slice of step ``step``'s global batch."""
    n, r = hvd.size(), hvd.rank()
    glob = a[step * BATCH * n:(step + 1) * BATCH * n]
    return glob[r * BATCH:(r + 1) * BATCH], glob


def make_model(seed=3):
    keras.utils.set_random_seed(seed + hvd.rank())  # different init per rank: broadcast must align them
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def reference_weights(init, lr=0.1):
    """One process, whole global batches, plain SGD (no Horovod)."""
    model = make_model()
    model.set_weights(init)
    opt = keras.optimizers.SGD(lr)
    x, y = problem()
    for step in range(STEPS):
        _, xb = shard(x, step)
        _, yb = shard(y, step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return model.get_weights()


def rank0_init(model):
    hvd.broadcast_variables(model.variables, root_rank=0)
    return [w.copy() for w in model.get_weights()]


def assert_close(a, b):
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)


def assert_same_on_all_ranks(weights):
    flat = np.concatenate([w.ravel() for w in weights]).astype(np.float64)
    gathered = hvd.allgather_object(flat)
    for g in gathered:
        np.testing.assert_allclose(g, flat, rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradient_tape_equivalence(mode):
    model = make_model()
    init = rank0_init(model)
    opt = keras.optimizers.SGD(0.1)
    x, y = problem()

    def step_fn(xb, yb, first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:  # upstream's TF2 examples, written for Keras 2's callable optimizer.variables
            hvd.broadcast_variables(opt.variables(), root_rank=0)

    fn = tf.function(step_fn) if mode == "function" else step_fn
    for step in range(STEPS):
        xb, _ = shard(x, step)
        yb, _ = shard(y, step)
        fn(tf.constant(xb), tf.constant(yb), step == 0)
    assert_close(model.get_weights(), reference_weights(init))
    assert_same_on_all_ranks(model.get_weights())


def test_tf1_compute_gradients_equivalence():
    x, y = problem()
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=np.full((FEATURES, 1), 0.1 * (hvd.rank() + 1), np.float32))
        xb = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
        yb = tf.compat.v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean((tf.matmul(xb, w) - yb) ** 2)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train = opt.apply_gradients(opt.compute_gradients(loss))
        bcast = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(bcast)
            for step in range(STEPS):
                xs, _ = shard(x, step)
                ys, _ = shard(y, step)
                s.run(train, {xb: xs, yb: ys})
            got = s.run(w)
    ref = np.full((FEATURES, 1), 0.1, np.float32)
    for step in range(STEPS):
        _, xg = shard(x, step)
        _, yg = shard(y, step)
        ref = ref - 0.1 * (2 * xg.T @ (xg @ ref - yg) / len(xg))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


def test_tf1_backward_passes_per_step_with_sparse_as_dense():
    """An embedding's IndexedSlices gradient accumulated over two passes (it was refused even with
    sparse_as_dense=True). Reference: numpy, the two passes' gradients summed, averaged across ranks."""
    n, passes = hvd.size(), 4
    rows = [[(r + t) % 5, (2 * r + 3 * t) % 5] for r in range(n) for t in range(passes)]  # [r * passes + t]
    with tf.Graph().as_default():
        emb = tf.compat.v1.get_variable("emb", initializer=np.ones((5, 2), np.float32))
        idx = tf.compat.v1.placeholder(tf.int32, [2])
        loss = tf.reduce_sum(tf.gather(emb, idx)) * float(hvd.rank() + 1)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                       backward_passes_per_step=2, sparse_as_dense=True)
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            for t in range(passes):
                s.run(train, {idx: rows[hvd.rank() * passes + t]})
            got = s.run(emb)
    ref = np.ones((5, 2))
    for first in range(0, passes, 2):
        grad = np.zeros((5, 2))
        for r in range(n):
            for t in (first, first + 1):
                for i in rows[r * passes + t]:
                    grad[i] += r + 1
        ref -= 0.1 * grad / n
    np.testing.assert_allclose(got, ref, rtol=1e-6)


@pytest.mark.parametrize("wrap", ["optimizer", "distributed_model"])
def test_fit_equivalence(wrap):
    x, y = problem()
    model = make_model()
    rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
    targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
    if wrap == "optimizer":
        init = rank0_init(model)
        # as upstream's examples and docs have it (a TypeError in Keras 3 without our adaptation)
        model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                      experimental_run_tf_function=False)
        callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0), hvdk.callbacks.MetricAverageCallback()]
        model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    else:
        init = None
        model = hvdk.DistributedModel(model)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        init_holder = []

        class Grab(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if not init_holder:
                    init_holder.append([w.copy() for w in self.model.get_weights()])

        hist = model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[Grab()])
        init = init_holder[0]
        assert isinstance(model, hvd.DistributedModel) and isinstance(model, keras.Sequential)
        losses = hvd.allgather_object(hist.history["loss"][0])
        assert max(losses) - min(losses) < 1e-6  # metrics averaged across ranks
    assert_close(model.get_weights(), reference_weights(init))
    assert_same_on_all_ranks(model.get_weights())


def test_metric_average_averages_every_metric_alike_on_every_rank():
    logs = {"loss": float(hvd.rank() + 1), "mae": 2.0 * hvd.rank(), "lr": 0.5}
    hvdk.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    n = hvd.size()
    assert logs == pytest.approx({"loss": (n + 1) / 2, "mae": float(n - 1), "lr": 0.5})


@pytest.mark.parametrize("extra", ["added", "renamed"])
def test_metric_average_with_other_metrics_on_some_ranks_fails_on_every_rank(extra):
    # A careless script: a callback that writes into logs on rank 0 only, placed before MetricAverageCallback
    # (or metrics compiled on one rank only).  Every rank used to wait forever for a reduction of another name.
    logs = {"loss": 1.0, "accuracy": 0.5}
    if hvd.rank() == 0:
        if extra == "added":
            logs["val_extra"] = 3.0
        else:
            logs["val_extra"] = logs.pop("accuracy")
    with pytest.raises(ValueError, match=r"MetricAverageCallback: the ranks' logs hold different metrics .*"
                                         r"this rank's: \['accuracy', 'loss'\]|"
                                         r"MetricAverageCallback: the ranks' logs hold different metrics .*"
                                         r"this rank's: \['loss', 'val_extra'\]|"
                                         r"MetricAverageCallback: the ranks' logs hold different metrics .*"
                                         r"this rank's: \['accuracy', 'loss', 'val_extra'\]"):
        hvdk.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    hvd.barrier()  # nothing left in flight: the next test's collectives pair up


@pytest.mark.parametrize("shard_data", [False, True])
def test_distributed_model_fit_with_validation_data(shard_data):
    """Keras' fit runs validation through ``self.evaluate(..., callbacks=<its CallbackList>)``, which is the
    DistributedModel's evaluate: ``fit(..., validation_data=...)`` failed with "TypeError: 'CallbackList'
    object is not iterable".  Now the validation metrics are those of each rank's validation data (its shard
    with ``shard_data=True``), averaged across ranks at the epoch's end."""
    x, y = problem()
    model = hvdk.DistributedModel(make_model(), shard_data=shard_data)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    val_x, val_y = x[:6 * hvd.size()] + hvd.rank(), y[:6 * hvd.size()]  # different on each rank
    hist = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(val_x, val_y))
    assert sorted(hist.history) == ["loss", "mae", "val_loss", "val_mae"]
    plain = make_model()
    plain.set_weights(model.get_weights())
    plain.compile(loss="mse", metrics=["mae"])
    mine = val_x[hvd.rank()::hvd.size()] if shard_data else val_x
    mine_y = val_y[hvd.rank()::hvd.size()] if shard_data else val_y
    local = plain.evaluate(mine, mine_y, verbose=0, return_dict=True)
    everyone = hvd.allgather_object(local)
    for name in ("loss", "mae"):
        assert hist.history[f"val_{name}"][0] == pytest.approx(np.mean([e[name] for e in everyone]), rel=1e-5)


def test_distributed_model_shards_sample_weight():
    """With ``shard_data=True`` x and y were sharded but ``sample_weight`` was not: fit and evaluate failed
    with Keras' "Data cardinality is ambiguous".  Each rank's weights are now the rows of its shard, and
    evaluate's weighted loss is the average of the ranks' weighted losses on their shards."""
    x, y = problem()
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    model = hvdk.DistributedModel(make_model(), shard_data=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=1, verbose=0)
    loss = model.evaluate(x, y, sample_weight=weights, verbose=0)
    plain = make_model()
    plain.set_weights(model.get_weights())
    plain.compile(loss="mse")
    r, n = hvd.rank(), hvd.size()
    local = plain.evaluate(x[r::n], y[r::n], sample_weight=weights[r::n], verbose=0)
    assert loss == pytest.approx(np.mean(hvd.allgather_object(local)), rel=1e-5)


def with_loss_scale(wrap: str, distributed, optimizer):
    """``distributed(optimizer)`` alone, inside a LossScaleOptimizer or around one."""
    scaler = keras.optimizers.LossScaleOptimizer
    if wrap == "inside_loss_scale":
        return distributed(scaler(optimizer))
    if wrap == "around_loss_scale":
        return scaler(distributed(optimizer))
    return distributed(optimizer)


@pytest.mark.parametrize("wrap", ["plain", "inside_loss_scale", "around_loss_scale"])
@pytest.mark.parametrize("average", [True, False])
def test_backward_passes_per_step(wrap, average):
    """Two backward passes per update: their gradients are summed (or averaged) and then averaged across
    ranks, also when a LossScaleOptimizer is involved (which refuses gradient_accumulation_steps itself).
    Reference: one process, one SGD step per two global batches (twice the rate when they are summed)."""
    x, y = problem()
    model = make_model()
    init = rank0_init(model)

    def distributed(optimizer):
        return hvdk.DistributedOptimizer(optimizer, backward_passes_per_step=2, average_aggregated_gradients=average)

    model.compile(optimizer=with_loss_scale(wrap, distributed, keras.optimizers.SGD(0.1)), loss="mse")
    rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
    targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
    model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference = make_model()
    reference.set_weights(init)
    reference.compile(optimizer=keras.optimizers.SGD(0.1 if average else 0.2), loss="mse")
    reference.fit(x, y, batch_size=2 * BATCH * hvd.size(), epochs=1, shuffle=False, verbose=0)
    assert_close(model.get_weights(), reference.get_weights())
    assert_same_on_all_ranks(model.get_weights())


@pytest.mark.parametrize("wrap", ["compile_wraps", "inside_loss_scale", "around_loss_scale"])
def test_mixed_precision_skips_an_overflowing_step_on_every_rank(wrap):
    """A LossScaleOptimizer skips a step whose gradients are not finite. One rank's float16 gradients overflow
    in step 1: the reduced gradients are checked, so every rank skips that step (it hung: the overflowing rank
    skipped the allreduce the others waited in), and a DistributedOptimizer around a LossScaleOptimizer
    reduces (it applied local gradients). Reference: one process, whole global batches, same loss scaling."""
    x, y = problem()
    y /= 10  # so that only the planted target overflows, also in a rank's smaller batch
    y[1 * BATCH * hvd.size() + (hvd.size() - 1) * BATCH] = 6e4  # the last rank's first target of step 1
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model()
        init = rank0_init(model)
        # compile_wraps: Keras puts a LossScaleOptimizer around it (mixed_float16)
        model.compile(optimizer=with_loss_scale(wrap, hvdk.DistributedOptimizer, keras.optimizers.SGD(0.1)),
                      loss="mse")
        rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
        targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
        model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        reference = make_model()
        reference.set_weights(init)
        reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # Keras wraps it: mixed_float16
        reference.fit(x, y, batch_size=BATCH * hvd.size(), epochs=1, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert type(model.optimizer).__name__ == type(reference.optimizer).__name__ == "LossScaleOptimizer"
    assert int(reference.optimizer.iterations) == STEPS - 1  # the reference skipped the overflowing step too
    assert int(model.optimizer.iterations) == STEPS - 1
    assert float(model.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale)
    for u, v in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(u, v, rtol=1e-2, atol=2e-3)  # float16 forward passes
    assert_same_on_all_ranks(model.get_weights())


def simulated_partial_weights(init, local: set[int], scale: bool, lr=0.1) -> list[list[np.ndarray]]:
    """Every rank's weights after partial data-parallel SGD, simulated in this one process: the gradients
    of the weights numbered in ``local`` stay each rank's own (divided by the size if ``scale``), the rest
    are averaged over the ranks."""
    n = hvd.size()
    x, y = problem()
    weights = [[w.copy() for w in init] for _ in range(n)]
    model = make_model()
    for step in range(STEPS):
        _, xg = shard(x, step)
        _, yg = shard(y, step)
        grads = []
        for q in range(n):
            model.set_weights(weights[q])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xg[q * BATCH:(q + 1) * BATCH]) - yg[q * BATCH:(q + 1) * BATCH]) ** 2)
            grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
        for q in range(n):
            for i, w in enumerate(weights[q]):
                g = grads[q][i] / (n if scale else 1) if i in local else np.mean([gr[i] for gr in grads], 0)
                weights[q][i] = w - lr * g
    return weights


@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("how", ["tape", "fit"])
def test_partial_distribution_keeps_local_layers_local(how, scale):
    """``PartialDistributedGradientTape`` / ``PartialDistributedOptimizer``: the local layer's weights follow
    each rank's own gradients (``scale_local_gradients``: divided by the size), the others the average."""
    x, y = problem()
    model = make_model()
    init = rank0_init(model)
    local_layer = model.layers[1]
    opt = keras.optimizers.SGD(0.1)
    if how == "tape":
        @tf.function
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            tape = hvd.PartialDistributedGradientTape(tape, local_layers=local_layer, scale_local_gradients=scale)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for step in range(STEPS):
            step_fn(tf.constant(shard(x, step)[0]), tf.constant(shard(y, step)[0]))
    else:
        model.compile(optimizer=hvdk.PartialDistributedOptimizer(opt, local_layers=[local_layer],
                                                                 scale_local_gradients=scale), loss="mse")
        rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
        targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
        model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    local = {i for i, v in enumerate(model.trainable_variables) if any(v is w for w in local_layer.trainable_weights)}
    assert local == {2, 3}
    expected = simulated_partial_weights(init, local, scale)
    assert_close(model.get_weights(), expected[hvd.rank()])
    assert_same_on_all_ranks(model.get_weights()[:2])
    if hvd.size() > 1:  # the local layer really is local: its weights differ from rank to rank
        assert not np.allclose(expected[0][2], expected[1][2])


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum], ids=["average", "sum"])
def test_local_gradients_are_scaled_whatever_the_op(op):
    """Upstream divides a local source's gradient by the set size whenever ``scale_local_gradients``, whatever
    the op (it used to be divided under Average only); the others are reduced with ``op``."""
    x, y = problem()
    model = make_model()
    rank0_init(model)
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean((model(tf.constant(shard(x, 0)[0])) - tf.constant(shard(y, 0)[0])) ** 2)
    own = [g.numpy() for g in tape.gradient(loss, variables)]
    every = [hvd.allgather_object(g) for g in own]
    dist = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[1], op=op)
    got = [g.numpy() for g in dist.gradient(loss, variables)]
    n = hvd.size()
    for i, g in enumerate(got):
        if i in (2, 3):  # the local layer
            expected = own[i] / n
        else:
            expected = np.sum(every[i], 0) / (n if op == hvd.Average else 1)
        np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op", [hvd.Adasum, hvd.Min, hvd.Max, hvd.Product])
def test_sparse_gradients_refuse_the_ops_they_cannot_take(op):
    """An embedding's IndexedSlices gradient under a tape with Adasum/Min/Max/Product: upstream's
    NotImplementedError on every rank (it used to be summed without a word)."""
    emb = tf.Variable(tf.ones([4, 2]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(emb, [hvd.rank() % 4, 2]) * (hvd.rank() + 1.0))
    with pytest.raises(NotImplementedError, match="Adasum reduction does not currently support sparse" if op ==
                       hvd.Adasum else "Only Sum and Average ops are supported with tf.IndexedSlices"):
        hvd.DistributedGradientTape(tape, op=op).gradient(loss, [emb])


def test_an_optimizer_made_on_one_rank_only_does_not_rename_the_reductions():
    """Keras 3 numbers optimizers per process ("sgd", "sgd_1") and applies gradients in that name scope: an
    extra optimizer on rank 0 only (an evaluation model's, say) made the ranks' reduction names differ -- a
    stall.  Training now matches every rank's batches averaged."""
    if hvd.rank() == 0:
        keras.optimizers.SGD(0.1)  # only here: this rank's next SGD is "sgd_<k+1>"
    x, y = problem()
    model = make_model()
    init = rank0_init(model)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
    targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
    model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close(model.get_weights(), simulated_partial_weights(init, set(), True)[hvd.rank()])


def test_keras_state_sync_builds_an_optimizer_that_has_not_run():
    """A worker joining an elastic job has not built its optimizer; the others have: ``KerasState.sync()``
    builds it so every rank broadcasts the same variables (a stall before), and the slots come from rank 0."""
    model = make_model()
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    if hvd.rank() == 0:  # the survivor has trained: built, with momentum of its own
        opt.build(model.trainable_variables)
        for v in opt.variables:
            if "momentum" in v.path:
                v.assign(tf.fill(v.shape, 0.5))
    state = hvdk.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()
    momenta = [v.numpy() for v in opt.variables if "momentum" in v.path]
    assert momenta and all(np.all(m == 0.5) for m in momenta), momenta
    assert_same_on_all_ranks(model.get_weights())


def test_distributed_model_save_reload(tmp_path_factory):
    model = hvdk.DistributedModel(make_model())
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert model.jit_compile is False  # XLA would compile our ops: turned off with a notice
    x, y = problem()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = tmp_path_factory.mktemp(f"r{hvd.rank()}") / "m.keras"
    model.save(path)
    code = ("import keras, sys; m = keras.models.load_model(sys.argv[1]); "
            "assert type(m.optimizer).__name__ == 'Adam'; "
            "assert not any(k.startswith('horovod.') for k in sys.modules); print('reloaded')")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, HOROVOD_RANK="", HOROVOD_SIZE=""))
    assert "reloaded" in out.stdout, out.stderr[-2000:]
    loaded = hvdk.load_model(path)
    assert type(loaded.optimizer).__name__ == "Adam" and int(loaded.optimizer.iterations.numpy()) > 0
    assert callable(loaded.optimizer.variables) and len(loaded.optimizer.variables()) > 0


def test_resume_from_a_checkpoint_loaded_on_rank_zero_only(tmp_path_factory):
    """Upstream's resume pattern (keras_imagenet_resnet50.py): rank 0 ``hvd.load_model``s the checkpoint, the
    others build and compile a fresh model, and ``BroadcastGlobalVariablesCallback(0)`` hands rank 0's weights
    and optimizer state to them.  Keras names the optimizer's slots after the model's variable paths, which
    differ between the rebuilt model and the fresh ones; the broadcasts were named after them, never paired
    up, and every rank waited for ever.  The names are checked first (before the fix the test fails there
    instead of hanging), then the state every rank gets against rank 0's, then a synchronous epoch."""
    from horovod.tensorflow.functions import _var_names

    def compiled(seed):
        model = make_model(seed)
        model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
        return model

    x, y = problem()
    r = hvd.rank()
    if r == 0:
        trained = make_model(3)  # trained by rank 0 alone: a plain optimizer (a distributed one would wait)
        trained.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        trained.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        path = tmp_path_factory.mktemp("resume") / "checkpoint.keras"
        trained.save(path)
        resumed = hvdk.load_model(path)
    else:
        resumed = compiled(11)
        resumed.optimizer.build(resumed.trainable_variables)  # (what the callback does for an unbuilt one)
    variables = resumed.variables + resumed.optimizer.variables
    names = hvd.allgather_object(_var_names(variables))
    assert all(n == names[0] for n in names), names
    root_state = hvd.broadcast_object([v.numpy() for v in variables], root_rank=0)

    callback = hvdk.callbacks.BroadcastGlobalVariablesCallback(0)
    callback.set_model(resumed)
    callback.on_train_begin()
    for v, want in zip(variables, root_state):
        np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)
    assert int(resumed.optimizer.iterations.numpy()) == len(x) // BATCH
    resumed.fit(x[r::hvd.size()], y[r::hvd.size()], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert_same_on_all_ranks(resumed.get_weights() + [v.numpy() for v in resumed.optimizer.variables])


@pytest.mark.parametrize("wrap", ["plain", "loss_scale"])
def test_weight_decay_exclusions_survive_the_wrapping(wrap):
    """``opt.exclude_from_weight_decay(var_names=["bias"])`` (transformer fine-tuning: no decay on biases and
    norms) is kept by Keras outside the optimizer's config, which ``DistributedOptimizer`` rebuilds its copy
    from: the exclusions were dropped without a word and every variable decayed.  Checked against one process
    training on the whole batches with the same AdamW and exclusions."""
    def adamw():
        opt = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return keras.optimizers.LossScaleOptimizer(opt) if wrap == "loss_scale" else opt

    x, y = problem()
    model = make_model()
    init = rank0_init(model)
    model.compile(optimizer=hvdk.DistributedOptimizer(adamw()), loss="mse")
    rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
    targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
    model.fit(rows, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    ref = make_model()
    ref.set_weights(init)
    opt = adamw()
    for step in range(STEPS):
        _, xb = shard(x, step)
        _, yb = shard(y, step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((ref(xb) - yb) ** 2)
            scaled = opt.scale_loss(loss) if wrap == "loss_scale" else loss
        opt.apply_gradients(zip(tape.gradient(scaled, ref.trainable_variables), ref.trainable_variables))
    assert_close(model.get_weights(), ref.get_weights())
    assert_same_on_all_ranks(model.get_weights())


def test_lr_schedule_and_warmup_arithmetic():
    n = hvd.size()
    model = make_model()
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mse")
    x, y = problem()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    steps = len(x) // BATCH
    warm = hvdk.callbacks.LearningRateWarmupCallback(initial_lr=1.0, warmup_epochs=2, steps_per_epoch=steps)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=[warm, Record()])
    for i, lr in enumerate(seen):
        epoch, batch = divmod(i, steps)
        e = epoch + batch / steps + 1.0 / steps
        np.testing.assert_allclose(lr, 1.0 / n * (e * (n - 1) / 2 + 1), rtol=1e-5)
    seen.clear()
    sched = hvdk.callbacks.LearningRateScheduleCallback(initial_lr=0.5, multiplier=0.1, start_epoch=1)
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[sched, Record()])
    np.testing.assert_allclose(seen[steps:2 * steps], 0.5 * 0.1 ** 0, rtol=1e-6)
    np.testing.assert_allclose(seen[2 * steps:], 0.5 * 0.1 ** 1, rtol=1e-6)
    with pytest.raises(ValueError, match="initial_lr"):
        hvdk.callbacks.LearningRateScheduleCallback(initial_lr=None, multiplier=1.0)


def test_warmup_momentum_correction_is_skipped_for_a_float_momentum(caplog):
    """Momentum correction scales momentum by new_lr / old_lr for the batch whose rate changed. Keras 3's
    momentum is a Python float (SGD and RMSprop test it in Python, so it cannot be a variable) that the traced
    step bakes in: setting it had made the first batch's corrected momentum the momentum of the whole run.
    The correction is skipped with a warning. Reference: one process on the global batches, the warm-up
    rates set per batch by formula, momentum 0.9 throughout."""
    n, steps = hvd.size(), STEPS
    x, y = problem()
    model = make_model()
    init = rank0_init(model)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    rows = np.concatenate([shard(x, s)[0] for s in range(STEPS)])
    targets = np.concatenate([shard(y, s)[0] for s in range(STEPS)])
    warm = hvdk.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1, steps_per_epoch=steps)
    with caplog.at_level("WARNING", logger="horovod"):
        model.fit(rows, targets, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[warm])
    assert caplog.text.count("momentum_correction is skipped") == 1
    rates = [0.1 / n * ((b + 1) / steps * (n - 1) + 1) for b in range(steps)]

    class Schedule(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.model.optimizer.learning_rate.assign(rates[batch])

    reference = make_model()
    reference.set_weights(init)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    reference.fit(x, y, batch_size=BATCH * n, epochs=1, verbose=0, shuffle=False, callbacks=[Schedule()])
    assert_close(model.get_weights(), reference.get_weights())
    assert model.optimizer.momentum == 0.9


def test_sync_batch_norm_uses_global_statistics():
    r, n = hvd.rank(), hvd.size()
    xs = [np.arange(6, dtype=np.float32).reshape(3, 2) * (j + 1) for j in range(n)]
    layer = hvd.SyncBatchNormalization(momentum=0.0, epsilon=0.0, center=False, scale=False)
    out = layer(tf.constant(xs[r]), training=True).numpy()
    allx = np.concatenate(xs)
    np.testing.assert_allclose(out, (xs[r] - allx.mean(0)) / allx.std(0), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        hvd.SyncBatchNormalization(fused=True)


def test_sync_batch_norm_before_init_is_upstreams_error(monkeypatch):
    """Training before hvd.init() used local statistics without a word; inference needs no Horovod."""
    from horovod.common import basics

    layer = hvd.SyncBatchNormalization()
    x = tf.constant(np.arange(8, dtype=np.float32).reshape(4, 2))
    monkeypatch.setattr(basics, "is_initialized", lambda: False)
    np.testing.assert_allclose(layer(x, training=False).numpy(), x.numpy() / np.sqrt(1 + 1e-3), rtol=1e-6)
    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)."):
        layer(x, training=True)


def test_a_saved_model_with_sync_batch_norm_loads(tmp_path):
    """A trained model holding two SyncBatchNormalization layers, saved, comes back with either loader (Keras 3
    refuses classes it does not know): the same layers, weights and predictions, and the optimizer distributed
    again with ``hvd.load_model``."""
    keras.utils.set_random_seed(7)  # the same model on every rank
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), hvd.SyncBatchNormalization(),
                              keras.layers.Dense(8), hvd.SyncBatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(32, 4)).astype(np.float32)
    model.fit(x, x.sum(axis=1, keepdims=True), batch_size=8, epochs=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    for loaded in (keras.models.load_model(path), hvdk.load_model(path)):
        assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
        for got, want in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert is_distributed_optimizer(loaded.optimizer)


def test_keras_on_another_backend_is_refused_by_name():
    """``KERAS_BACKEND=torch``: the DistributedOptimizer and the broadcast callback refuse at once, naming the
    backend (they reduce and broadcast TensorFlow variables; the optimizer used to fail in its first step with
    a TypeError from inside Keras).  A process of its own: Keras picks its backend once, at import."""
    if hvd.rank() != 0:
        return
    probe = (
        "import keras, horovod.tensorflow.keras as hvd\n"
        "hvd.init()\n"
        "for make in (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),\n"
        "             lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0)):\n"
        "    try:\n"
        "        make()\n"
        "    except ValueError as e:\n"
        "        print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    refused = [line for line in out.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2, out.stdout + out.stderr
    assert all("Keras on 'torch'" in line and "KERAS_BACKEND=tensorflow" in line for line in refused), refused


@pytest.mark.parametrize("weights_only", [False, True])
def test_best_model_checkpoint_keeps_the_best_epoch(tmp_path, weights_only):
    """``BestModelCheckpoint`` made without a path (upstream's pattern: the path is set later), whole model or
    weights only: what it saved is the epoch with the lowest validation loss -- evaluated again, it gives that
    epoch's loss."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.3)), loss="mse")
    rng = np.random.default_rng(hvd.rank())
    x, xv = rng.normal(size=(64, 4)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)
    y, yv = np.sin(x).sum(1, keepdims=True), np.sin(xv).sum(1, keepdims=True)
    best = hvdk.callbacks.BestModelCheckpoint(monitor="val_loss", save_weights_only=weights_only)
    assert best.filepath is None
    best.filepath = str(tmp_path / ("best.weights.h5" if weights_only else "best.keras"))
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0, validation_data=(xv, yv), callbacks=[best])
    if weights_only:
        saved = keras.models.clone_model(model)
        saved.load_weights(best.filepath)
        saved.compile(loss="mse")
    else:
        saved = keras.models.load_model(best.filepath)
    np.testing.assert_allclose(saved.evaluate(xv, yv, verbose=0), min(history.history["val_loss"]), rtol=1e-5)


def test_errors_in_keras_front_end():
    with pytest.raises(ValueError, match="op currently only supports Average and Sum"):
        hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Max)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported"):
        hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)


@pytest.mark.parametrize("script", ["tensorflow_mnist_tf1.py", "keras_mnist_distributed_model.py"])
def test_seed_examples_end_to_end(script):
    """The seeds under their own launcher (rank 0 of this job starts it; the others wait at a barrier)."""
    if hvd.rank() == 0:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", MNIST_OFFLINE_SAMPLES="2000")
        out = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable,
                              str(ROOT / "examples" / "tensorflow" / script), "--epochs", "1"],
                             capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
        ok = out.returncode == 0 and out.stdout.count("all ranks agree: True") == 2
        detail = out.stdout[-3000:] + out.stderr[-3000:]
    else:
        ok, detail = True, ""
    results = hvd.allgather_object((ok, detail))
    assert all(r[0] for r in results), results[0][1]


def test_auto_jit_compile_stays_off_with_a_distributed_optimizer(monkeypatch):
    """Keras 3 resolves jit_compile='auto' to XLA where a GPU is visible, and XLA cannot run Horovod's
    collectives: with a DistributedOptimizer (also inside a LossScaleOptimizer) 'auto' means no XLA."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    gpu = type(cpu)(name="/physical_device:GPU:0", device_type="GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [cpu, gpu])

    def resolved(optimizer):
        model = make_model()
        model.compile(optimizer=optimizer, loss="mse")  # jit_compile="auto"
        return model.jit_compile

    assert resolved(keras.optimizers.SGD(0.1)) is True  # what Keras does with a GPU: the case that matters
    assert resolved(hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))) is False
    scaled = keras.optimizers.LossScaleOptimizer(hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    assert resolved(scaled) is False


def test_experimental_run_tf_function_is_accepted_only_with_a_distributed_optimizer():
    """Keras 2's compile argument that upstream's examples pass, with a DistributedOptimizer or in a
    DistributedModel; without either Keras 3's TypeError stays (test_fit_equivalence trains with it)."""
    with pytest.raises(TypeError, match="experimental_run_tf_function"):
        make_model().compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", experimental_run_tf_function=False)
    model = make_model()
    model.compile(hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse", experimental_run_tf_function=False)
    assert model.get_compile_config()["loss"] == "mse"
    model = hvdk.DistributedModel(make_model())  # wraps the plain optimizer before Keras sees the argument
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", experimental_run_tf_function=False)
    assert is_distributed_optimizer(model.optimizer)


def test_keras2_optimizer_spelling_of_upstreams_examples():
    """``opt.variables()`` and ``set_value(opt.lr, ...)`` (Keras 2) on plain Keras 3 optimizers."""
    for opt in (keras.optimizers.Adam(0.1), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))):
        assert opt.variables() == opt.variables and isinstance(opt.variables, list)
        tf.keras.backend.set_value(opt.lr, 0.25 + hvd.rank())
        assert np.isclose(float(opt.learning_rate), 0.25 + hvd.rank())
        opt.lr = 0.5
        assert np.isclose(float(tf.keras.backend.get_value(opt.lr)), 0.5)


def test_keras2_lr_argument_of_upstreams_examples():
    """``Adam(lr=..., epsilon=1e-3)`` (upstream's Spark Rossmann example; Keras 3 refused ``lr``) steps as
    ``Adam(learning_rate=...)`` does, with Keras 2's deprecation warning."""
    grad = tf.constant([0.5, -2.0, 0.0])
    for make in (lambda **kw: keras.optimizers.Adam(epsilon=1e-3, **kw), lambda **kw: keras.optimizers.SGD(**kw)):
        with pytest.warns(UserWarning, match="The `lr` argument is deprecated, use `learning_rate` instead"):
            legacy = make(lr=0.25)
        reference = make(learning_rate=0.25)
        assert np.isclose(float(legacy.learning_rate), 0.25)
        stepped = []
        for opt in (legacy, reference):
            var = tf.Variable([1.0, 2.0, 3.0])
            opt.apply_gradients([(grad, var)])
            stepped.append(var.numpy())
        np.testing.assert_allclose(stepped[0], stepped[1])
        assert not np.allclose(stepped[0], [1.0, 2.0, 3.0])
    np.testing.assert_allclose(stepped[0], [1.0 - 0.125, 2.5, 3.0])  # SGD by hand: var - 0.25 * grad


def test_explicit_jit_compile_is_refused_naming_it():
    """jit_compile=True failed when the step ran, with XLA's 'RET_CHECK failure ... is_initialized'."""
    model = make_model()
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    x, y = problem()
    with pytest.raises(ValueError, match=r"cannot be compiled by XLA.*jit_compile=False"):
        model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0)

    @tf.function(jit_compile=True)
    def step(v):
        return hvd.allreduce(v, name="xla.refused")

    with pytest.raises(ValueError, match=r"HorovodAllreduce: Horovod's TensorFlow collectives run in Python"):
        step(tf.ones(2))
    with pytest.raises(ValueError, match="cannot be compiled by XLA"):
        tf.function(lambda: hvd.rank_op(), jit_compile=True)()
    np.testing.assert_allclose(hvd.allreduce(tf.ones(2), name="after.xla").numpy(), np.ones(2))
