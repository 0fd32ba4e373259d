"""The elastic loop and errors that are the program's, not faults: it resets for a failed collective
(``ShutdownError``: a peer died or hung) and raises a mismatch between the ranks (``PreconditionError``), which
the same code after a reset runs into again -- it reset forever."""

from __future__ import annotations

import pytest

from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import (
    SHUT_DOWN_MESSAGE,
    HorovodInternalError,
    PreconditionError,
    ShutdownError,
    shutdown_error,
)


def _loop(errors):
    """run_fn over a function that raises ``errors`` one per call, then returns; (result, resets, restores)."""
    state = ObjectState(lambda obj, root_rank=0: obj, lambda: 0, steps=0)
    resets, restores, calls = [], [], []
    real_restore = state.restore

    def restore():
        restores.append(1)
        real_restore()

    state.restore = restore

    def train(state):
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    return run_fn(train, lambda: resets.append(1)), state, resets, restores


def test_a_failed_collective_resets():
    wrapped, state, resets, restores = _loop([ShutdownError(f"{SHUT_DOWN_MESSAGE} Cause: rank 1 exited")])
    assert wrapped(state) == "done"
    assert (len(resets), len(restores)) == (1, 1)


@pytest.mark.parametrize("error", [
    PreconditionError("Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [3], but another "
                      "rank sent a tensor of shape [4]."),
    shutdown_error("unused", "Mismatched collectives: the ranks submitted different collectives ..."),
], ids=["shape", "collectives"])
def test_a_mismatch_between_the_ranks_is_raised_without_a_reset(error):
    wrapped, state, resets, restores = _loop([error])
    with pytest.raises(PreconditionError) as info:
        wrapped(state)
    assert info.value is error
    assert (resets, restores) == ([], [])


def test_shutdown_error_of_mismatched_collectives_starts_with_the_cause():
    cause = "Mismatched collectives: rank 0 never submitted ['grad'] and waits for ['b']."
    error = shutdown_error(f"{SHUT_DOWN_MESSAGE} Cause: {cause}", cause)
    assert type(error) is PreconditionError and isinstance(error, HorovodInternalError)  # torch: RuntimeError
    assert str(error) == f"{cause} Horovod has been shut down."
    other = shutdown_error(f"{SHUT_DOWN_MESSAGE} Cause: rank 1 exited", "rank 1 exited")
    assert type(other) is ShutdownError and str(other) == f"{SHUT_DOWN_MESSAGE} Cause: rank 1 exited"


def test_tensorflow_elastic_recovers_a_failed_op_but_not_a_mismatch_inside_tf_function():
    """Inside ``tf.function`` every collective error is ``UnknownError`` (numpy_function's); the elastic loop
    took one that wraps a mismatch (``FailedPreconditionError: ...``, which also names the shut-down notice
    for mismatched collectives) for a failed op and reset, forever."""
    tf = pytest.importorskip("tensorflow")
    from horovod.tensorflow.elastic import _collective_failures

    failed = tf.errors.UnknownError(None, None, f"Graph execution error:\n\n{SHUT_DOWN_MESSAGE} Cause: rank 1 exited")
    with pytest.raises(HorovodInternalError), _collective_failures():
        raise failed
    mismatch = tf.errors.UnknownError(None, None, "Graph execution error:\n\nDetected at node PyFunc\n\n"
                                      "FailedPreconditionError: Mismatched collectives: ... Horovod has been shut "
                                      f"down.\n{SHUT_DOWN_MESSAGE}")
    with pytest.raises(tf.errors.UnknownError) as info, _collective_failures():
        raise mismatch
    assert info.value is mismatch
