"""Mismatches across ranks and enqueue-time errors, on every rank in lockstep: every rank gets upstream's exact
text, and the next collective still works.

    horovodrun -np 2 python -m pytest -x -q tests/parallel/test_numpy_errors.py
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from parallel_util import last_rank_short_text

import horovod.numpy as hvd
from horovod.common.exceptions import HorovodInternalError, PreconditionError
from horovod.runtime.engine import DUPLICATE_NAME_MESSAGE


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.barrier()


@pytest.fixture(autouse=True)
def next_op_still_works():
    yield
    size = hvd.size()
    out = hvd.allreduce(np.ones(3), op=hvd.Sum)
    np.testing.assert_array_equal(out, np.full(3, float(size)))
    big = hvd.allreduce(np.ones(100_000, np.float32), op=hvd.Sum)
    assert float(big[0]) == size and float(big[-1]) == size


def expect_error(fn, text):
    with pytest.raises(PreconditionError) as info:
        fn()
    assert isinstance(info.value, HorovodInternalError) and isinstance(info.value, RuntimeError)
    assert str(info.value) == text


@pytest.mark.parametrize("n", [4, 50_000])  # inline (coordinator-reduced) and data-plane sizes
def test_mismatched_dtype(n):
    rank = hvd.rank()
    x = np.ones(n, np.float32 if rank == 0 else np.int32)
    expect_error(lambda: hvd.allreduce(x, name=f"bad.dtype.{n}"),
                 "Mismatched data types: One rank had type float32, but another rank had type int32.")


def test_mismatched_shape():
    rank = hvd.rank()
    x = np.ones((17, 17 + min(rank, 1)), np.float32)
    expect_error(lambda: hvd.allreduce(x, name="bad.shape"),
                 "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [17, 17], but another rank "
                 "sent a tensor of shape [17, 18].")


def test_mismatched_broadcast_shape():
    rank = hvd.rank()
    x = np.ones((2, 3) if rank == 0 else (3, 2), np.float64)
    expect_error(lambda: hvd.broadcast(x, 0, name="bad.bshape"),
                 "Mismatched BROADCAST tensor shapes: One rank sent a tensor of shape [2, 3], but another rank "
                 "sent a tensor of shape [3, 2].")


def test_mismatched_operation():
    rank = hvd.rank()
    x = np.ones((2, 2), np.float32)
    if rank == 0:
        fn = lambda: hvd.allreduce(x, name="bad.op")  # noqa: E731
    else:
        fn = lambda: hvd.allgather(x, name="bad.op")  # noqa: E731
    expect_error(fn, "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER.")


def test_mismatched_reduce_op():
    rank = hvd.rank()
    expect_error(lambda: hvd.allreduce(np.ones(3), op=hvd.Sum if rank == 0 else hvd.Average, name="bad.rop"),
                 "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent reduction "
                 "op 0.")


def test_mismatched_scale_factors():
    rank = hvd.rank()
    expect_error(lambda: hvd.allreduce(np.ones(3), prescale_factor=1.0 if rank == 0 else 2.0, name="bad.pre"),
                 "Mismatched prescale and/or postscale factors: One rank sent factors (1, 1), but another rank "
                 "sent factors (2, 1).")
    expect_error(lambda: hvd.reducescatter(np.ones((4, 2)), postscale_factor=0.5 if rank == 0 else 0.25,
                                           name="bad.post"),
                 "Mismatched prescale and/or postscale factors: One rank sent factors (1, 0.5), but another rank "
                 "sent factors (1, 0.25).")


def test_mismatched_root_rank():
    rank = hvd.rank()
    expect_error(lambda: hvd.broadcast(np.ones(3), 0 if rank == 0 else 1, name="bad.root"),
                 "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified "
                 "root rank 1.")


def test_mismatched_allgather_rank_and_dims():
    rank = hvd.rank()
    expect_error(lambda: hvd.allgather(np.ones((2, 3) if rank == 0 else (2, 3, 1)), name="bad.agrank"),
                 "Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank 2, but another rank sent a "
                 "tensor of rank 3.")
    expect_error(lambda: hvd.allgather(np.ones((2, 3 + min(rank, 1))), name="bad.agdim"),
                 "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 3, but "
                 "another rank sent a tensor with dimension 1 equal to 4.")


def test_allgather_scalar_on_set_rank_zero():
    expect_error(lambda: hvd.allgather(np.float32(1.0), name="bad.scalar"),
                 "Process-set rank zero tried to ALLGATHER a rank-zero tensor.")


GROUPED = {"ALLREDUCE": lambda xs, name: hvd.grouped_allreduce(xs, name=name, op=hvd.Sum),
           "ALLGATHER": lambda xs, name: hvd.grouped_allgather(xs, name=name),
           "REDUCESCATTER": lambda xs, name: hvd.grouped_reducescatter(xs, name=name, op=hvd.Sum)}


def short_last_rank(n: int = 3) -> list[np.ndarray]:
    """``n`` tensors, one fewer on the last rank."""
    size = hvd.size()
    return [np.ones((size, 2), np.float32)] * (n - (hvd.rank() == size - 1))


@pytest.mark.parametrize("op", list(GROUPED))
def test_grouped_lists_of_different_lengths_fail_at_once_on_every_rank(op):
    """The last rank groups 2 tensors, the others 3: names g_1of3.. and g_1of2.. never matched and the job waited
    for the stall inspector (60 s warning, then its deadline; upstream forever)."""
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    t0 = time.monotonic()
    expect_error(lambda: GROUPED[op](short_last_rank(), f"short.{op}"),
                 last_rank_short_text(op, f"short.{op}", hvd.size()))
    assert time.monotonic() - t0 < 15
    out = GROUPED[op]([np.ones((hvd.size(), 2), np.float32)] * 2, f"short.{op}")  # the name agreed on works
    assert len(out) == 2


def test_a_grouped_length_that_changes_on_one_rank_after_cached_steps():
    """Repeated steps travel as cache hits and replays, which carry no group size; a length that changes on
    one rank only is caught all the same."""
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    size = hvd.size()
    for _ in range(4):
        out = hvd.grouped_allreduce([np.ones(3, np.float32)] * 3, name="steps", op=hvd.Sum)
        np.testing.assert_array_equal(out[2], np.full(3, float(size)))
    t0 = time.monotonic()
    expect_error(lambda: hvd.grouped_allreduce(short_last_rank(), name="steps", op=hvd.Sum),
                 last_rank_short_text("ALLREDUCE", "steps", size))
    assert time.monotonic() - t0 < 15


def test_plain_names_that_look_grouped_are_not_groups():
    """A tensor a user named "x_1of2" is no group member: "x_1of2" and "x_1of3" on every rank, in different
    orders, are two plain allreduces."""
    names = ["x_1of2", "x_2of2", "x_1of3"]
    handles = [hvd.allreduce_async(np.full(2, float(i)), name=n, op=hvd.Sum)
               for i, n in (list(enumerate(names)) if hvd.rank() % 2 else list(enumerate(names))[::-1])]
    got = sorted(float(hvd.synchronize(h)[0]) for h in handles)
    assert got == [0.0, float(hvd.size()), 2.0 * hvd.size()]


def test_error_in_a_group_fails_every_member_and_async():
    rank = hvd.rank()
    h = hvd.allreduce_async(np.ones(3, np.float32 if rank == 0 else np.float64), name="bad.async")
    good = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="good.async")
    with pytest.raises(PreconditionError):
        hvd.synchronize(h)
    np.testing.assert_array_equal(hvd.synchronize(good), np.full(3, float(hvd.size())))


def test_same_name_after_an_error():
    rank = hvd.rank()
    with pytest.raises(PreconditionError):
        hvd.allreduce(np.ones(2, np.float32 if rank == 0 else np.int32), name="reused")
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="reused"),
                                  np.full(2, float(hvd.size())))


def test_broadcast_and_allgather_while_joined():
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        expect_error(lambda: hvd.broadcast(np.ones(2), 0, name="joined.bcast"),
                     "Broadcast is not supported with Join at this time.")
        expect_error(lambda: hvd.allgather(np.ones(2), name="joined.ag"),
                     "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using "
                     "DistributedOptimizer")
        expect_error(lambda: hvd.reducescatter(np.ones((size, 2)), name="joined.rs"),
                     "Reducescatter is not supported with Join at this time.")
    assert hvd.join() == 0


def test_duplicate_name_in_flight():
    rank = hvd.rank()
    if rank == 0:
        # Nobody else has submitted "dup" yet, so it is certainly still in flight here.
        h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="dup")
        with pytest.raises(ValueError) as info:
            hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="dup")
        assert str(info.value) == DUPLICATE_NAME_MESSAGE
        hvd.broadcast_object("go", 0, name="dup.go")
        np.testing.assert_array_equal(hvd.synchronize(h), np.full(2, float(hvd.size())))
    else:
        assert hvd.broadcast_object(None, 0, name="dup.go") == "go"
        np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="dup"),
                                      np.full(2, float(hvd.size())))


def test_enqueue_time_errors_are_value_errors():
    size = hvd.size()
    x = np.zeros((size + 1, 2), np.float32)
    with pytest.raises(ValueError, match=r"^Number of entries in splits does not equal number of workers\.$"):
        hvd.alltoall(x, splits=[1] * (size + 1))
    with pytest.raises(ValueError, match=r"^Sum of splits entries is greater than the first dimension of "
                                         r"tensor\.$"):
        hvd.alltoall(x, splits=[size + 2] + [0] * (size - 1))
    with pytest.raises(ValueError, match=r"^splits not provided, but first dimension of tensor is not an even "
                                         r"multiple of the number of workers\.$"):
        hvd.alltoall(x)
    with pytest.raises(ValueError, match=rf"^broadcast received invalid root rank {size} for provided process "
                                         r"set$"):
        hvd.broadcast(x, size)
    with pytest.raises(ValueError, match=r"^Tensor type complex128 is not supported\.$"):
        hvd.allreduce(np.zeros(2, np.complex128))


class Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle Unpicklable")


def test_an_object_that_cannot_be_pickled_is_an_error_on_every_rank():
    """The root (or, gathering, one rank) failed to pickle before the first collective: the others waited for
    its bytes until the stall deadline. Now its error reaches every rank at once."""
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    if r == root:
        with pytest.raises(TypeError, match="^cannot pickle Unpicklable$"):
            hvd.broadcast_object(Unpicklable(), root)
    else:
        with pytest.raises(ValueError, match=rf"^broadcast_object: the root rank {root} could not pickle its "
                                             r"object: TypeError: cannot pickle Unpicklable$"):
            hvd.broadcast_object(None, root)
    if r == 0:
        with pytest.raises(TypeError, match="^cannot pickle Unpicklable$"):
            hvd.allgather_object(Unpicklable())
    else:
        with pytest.raises(ValueError, match=r"^allgather_object: could not pickle the object of rank 0: "
                                             r"TypeError: cannot pickle Unpicklable$"):
            hvd.allgather_object({"rank": r})
    assert hvd.allgather_object({"rank": r}) == [{"rank": i} for i in range(n)]
    assert hvd.broadcast_object({"from": root} if r == root else None, root) == {"from": root}
