"""horovod.tensorflow where it used to differ from upstream, on every rank in lockstep (any size):

* the gradient of ``reducescatter`` (upstream: ``allgather(dy)`` times the set size for ``Sum``);
* ``SyncBatchNormalization(fused=False)`` is accepted (and ``fused`` ignored), ``fused=True/None`` refused;
  unnamed layers are named as Keras names them, so a model may hold several;
* ranks that disagree raise ``FailedPreconditionError`` eagerly and in TF1 sessions, and inside
  ``tf.function`` an error that names it (never an empty result).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def gradient(mode: str, fn, x0: np.ndarray) -> np.ndarray:
    """d(sum(fn(x) * w))/dx with w = 1, 2, 3... over fn's output, in eager, tf.function or a TF1 graph."""
    def weights(y):
        return tf.reshape(tf.range(1, tf.size(y) + 1, dtype=y.dtype), tf.shape(y))

    if mode == "graph":
        with tf.Graph().as_default():
            x = tf.constant(x0)
            y = fn(x)
            g = tf.compat.v1.gradients(tf.reduce_sum(y * weights(y)), x)[0]
            with tf.compat.v1.Session() as s:
                return s.run(g)

    def step():
        x = tf.constant(x0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y * weights(y))
        return tape.gradient(loss, x)

    return (tf.function(step)() if mode == "function" else step()).numpy()


def expected_rs_grad(x0: np.ndarray, scale: float) -> np.ndarray:
    """allgather of every rank's dy (= 1, 2, ... over its block), times ``scale``."""
    rows = x0.shape[0] // SIZE
    block = np.arange(1, rows * x0.shape[1] + 1, dtype=x0.dtype).reshape(rows, x0.shape[1])
    return np.concatenate([block] * SIZE) * scale


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_reducescatter_gradient_is_upstreams(mode):
    x0 = np.arange(SIZE * 2 * 3, dtype=np.float32).reshape(SIZE * 2, 3) + RANK
    got = gradient(mode, lambda x: hvd.reducescatter(x, op=hvd.Sum, name=f"rs_sum_{mode}"), x0)
    np.testing.assert_allclose(got, expected_rs_grad(x0, SIZE))  # at np=2 a tape of ones gives 2.0
    got = gradient(mode, lambda x: hvd.reducescatter(x, op=hvd.Average, name=f"rs_avg_{mode}"), x0)
    np.testing.assert_allclose(got, expected_rs_grad(x0, 1.0))
    got = gradient(mode, lambda x: hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                                     name=f"rs_scaled_{mode}"), x0)
    np.testing.assert_allclose(got, expected_rs_grad(x0, SIZE * 1.5))
    got = gradient(mode, lambda x: hvd.grouped_reducescatter([x, 2.0 * x], op=hvd.Sum,
                                                             name=f"grs_{mode}")[1], x0)
    np.testing.assert_allclose(got, expected_rs_grad(x0, 2.0 * SIZE))


def test_reducescatter_gradient_of_ones_at_np():
    """Upstream's own test: the gradient of a Sum reducescatter under ones is the set size everywhere."""
    x = tf.Variable(tf.zeros([SIZE * 4, 3]))
    with tf.GradientTape() as tape:
        summed = hvd.reducescatter(x, op=hvd.Sum, name="rs_upstream")
    grad = tape.gradient(summed, x, tf.ones([4, 3]))
    np.testing.assert_array_equal(grad.numpy(), np.full([SIZE * 4, 3], float(SIZE)))


# ------------------------------------------------------------------------------------------------ SyncBN
def test_sync_batch_norm_fused_false_is_accepted_and_global():
    layer = hvd.SyncBatchNormalization(fused=False, momentum=0.5, epsilon=1e-3)
    rng = np.random.default_rng(3)
    full = rng.normal(size=(SIZE * 4, 3)).astype(np.float32)
    mine = full[RANK * 4:(RANK + 1) * 4]
    out = layer(tf.constant(mine), training=True).numpy()
    mean, var = full.mean(0), full.var(0)
    np.testing.assert_allclose(out, (mine - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-4, atol=1e-6)
    assert "fused" not in layer.get_config()
    for fused in (True, None):
        with pytest.raises(ValueError, match="^SyncBatchNormalization does not support fused=True.$"):
            hvd.SyncBatchNormalization(fused=fused)


def test_sync_batch_norm_layers_in_one_model_use_the_global_batch():
    """Several unnamed SyncBatchNormalization layers in one model, Sequential and functional: upstream named
    each one "sync_batch_normalization", which Keras 3 refuses twice in a model.  Each layer normalises with
    the statistics of every rank's rows: the same model with Keras' BatchNormalization on all the rows gives
    this rank's rows (eagerly and in tf.function), and the moving statistics alike."""
    import keras

    def build(norm, functional: bool):
        layers = [layer for _ in range(3) for layer in (keras.layers.Dense(5), norm(momentum=0.5))]
        if not functional:
            return keras.Sequential([keras.Input((5,)), *layers])
        x = inp = keras.Input((5,))
        for layer in layers:
            x = layer(x)
        return keras.Model(inp, x)

    rng = np.random.default_rng(11)
    full = rng.normal(size=(SIZE * 4, 5)).astype(np.float32) * np.arange(1, 6, dtype=np.float32)
    mine = full[RANK * 4:(RANK + 1) * 4]
    for functional in (False, True):
        keras.utils.set_random_seed(5)  # the same weights on every rank
        synced = build(hvd.SyncBatchNormalization, functional)
        names = [layer.name for layer in synced.layers if isinstance(layer, hvd.SyncBatchNormalization)]
        assert len(set(names)) == 3 and all(n.startswith("sync_batch_normalization") for n in names), names
        plain = build(keras.layers.BatchNormalization, functional)
        plain.set_weights(synced.get_weights())
        expected = plain(full, training=True).numpy()[RANK * 4:(RANK + 1) * 4]
        np.testing.assert_allclose(synced(mine, training=True).numpy(), expected, rtol=1e-4, atol=1e-4)
        for got, want in zip(synced.get_weights(), plain.get_weights()):  # the moving statistics among them
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        traced = tf.function(lambda x, model=synced: model(x, training=True))
        np.testing.assert_allclose(traced(tf.constant(mine)).numpy(), expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ errors
COLLECTIVES = {
    "allreduce": lambda x, name: hvd.allreduce(x, name=name),
    "allgather": lambda x, name: hvd.allgather(tf.reshape(x, [1, -1]), name=name),
    "broadcast": lambda x, name: hvd.broadcast(x, 0, name=name),
    "reducescatter": lambda x, name: hvd.reducescatter(tf.reshape(x, [1, -1]) * tf.ones([SIZE, 1]), name=name),
}


def _mismatched() -> np.ndarray:
    return np.ones(2 + RANK, np.float32)  # every rank a different shape


@pytest.mark.parametrize("what", sorted(COLLECTIVES))
def test_mismatch_eager_is_failed_precondition(what):
    with pytest.raises(tf.errors.FailedPreconditionError, match="^Mismatched"):
        COLLECTIVES[what](tf.constant(_mismatched()), f"eager_mm_{what}")


@pytest.mark.parametrize("what", sorted(COLLECTIVES))
def test_mismatch_in_session_is_failed_precondition(what):
    with tf.Graph().as_default() as g:
        p = tf.compat.v1.placeholder(tf.float32, [None])
        out = COLLECTIVES[what](p, f"graph_mm_{what}")
        with tf.compat.v1.Session(graph=g) as s:
            with pytest.raises(tf.errors.FailedPreconditionError, match="^Mismatched") as info:
                s.run(out, {p: _mismatched()})
            assert info.value.op is not None  # TensorFlow's node is kept
            call = s.make_callable(out, [p])
            with pytest.raises(tf.errors.FailedPreconditionError, match="^Mismatched"):
                call(_mismatched())
            # The session still works afterwards.
            np.testing.assert_allclose(s.run(out, {p: np.ones(2, np.float32)}).ravel()[:2], [1.0, 1.0])


@pytest.mark.parametrize("what", sorted(COLLECTIVES))
def test_mismatch_in_function_raises_with_the_class_in_the_message(what):
    fn = tf.function(lambda x: COLLECTIVES[what](x, f"fn_mm_{what}"), reduce_retracing=True)
    # TensorFlow turns a numpy_function's exception into UnknownError; the text says which error it was.
    with pytest.raises(tf.errors.UnknownError, match="FailedPreconditionError: Mismatched"):
        fn(tf.constant(_mismatched()))
    fine = fn(tf.constant(np.ones(2, np.float32))).numpy().ravel()
    assert fine.size > 0 and np.all(fine[:2] > 0)


def test_function_error_is_never_an_empty_result():
    """The check op is stateless; its error must not be pruned away with it (it used to be)."""
    @tf.function
    def gathered(x):
        return hvd.allgather(x, name="fn_gather_cols")

    with pytest.raises(tf.errors.UnknownError, match="Mismatched ALLGATHER tensor shapes"):
        gathered(tf.ones([1, 2 + RANK]))


# ------------------------------------------------------------------------------------------------ AutoGraph
def test_autograph_never_converts_horovod_code(monkeypatch):
    """Inside tf.function AutoGraph must not rewrite our code: not at trace time and, through the closures
    handed to numpy_function, not the engine at run time (converted engine code broke, and is slow)."""
    import inspect

    from horovod.runtime import queue

    converted = []
    original_wait = queue.Handle.wait

    def wait(self, *args, **kwargs):
        frames = [f.filename for f in inspect.stack(0)]
        converted.extend(f for f in frames if "__autograph_generated" in f)
        return original_wait(self, *args, **kwargs)

    monkeypatch.setattr(queue.Handle, "wait", wait)

    @tf.function
    def step(x):
        y = hvd.allreduce(x, name="ag_ar")
        if tf.reduce_sum(y) > 0:  # converted control flow in the caller, as in user code
            y = y + hvd.allgather(x, name="ag_ag")[:2]
        return hvd.broadcast(y, 0, name="ag_bc")

    out = step(tf.ones([2]))
    np.testing.assert_allclose(out.numpy(), [2.0, 2.0])  # average of ones, plus ones gathered
    assert converted == [], converted[:3]
