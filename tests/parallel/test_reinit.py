"""init()/shutdown()/init() cycles on every rank in lockstep, with numpy and torch:

    horovodrun -np 2 python -m pytest -x -q tests/parallel/test_reinit.py

Each cycle is upstream's ``test_horovod_is_initialized`` with no collective in between; every
``CHECK_EVERY`` cycles the ranks compare their generation counts (all equal, and equal to the number of
init() calls made) and check an allreduce against the sum computed here with numpy.  Cycles: 150 at np=2,
50 above (``HOROVOD_TEST_REINIT_CYCLES`` overrides; torch does a third of them, then carries on as the
test file of the reported hang did).  Driven by tests/test_reinit.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from parallel_util import data, launcher_rank_size

import horovod.numpy as hvd
from horovod.common import basics
from horovod.common.exceptions import HorovodInternalError, ShutdownError

RANK, SIZE = launcher_rank_size()
CYCLES = int(os.environ.get("HOROVOD_TEST_REINIT_CYCLES") or (150 if SIZE == 2 else 50))
CHECK_EVERY = 25


def _expected_sum(key: str, shape=(7,), dtype=np.int64) -> np.ndarray:
    return sum(data(key, r, shape, dtype) for r in range(SIZE))


def _check_generation(expected: int) -> None:
    gens = hvd.allgather(np.array([basics.generation()], dtype=np.int64), name="reinit.generation")
    assert gens.tolist() == [expected] * SIZE, f"generations differ across ranks: {gens.tolist()}"


def _cycles(mod, allreduce, cycles: int) -> None:
    """``cycles`` x (init, shutdown, init, [check], shutdown) through the module ``mod``."""
    mod.shutdown()
    start = basics.generation()
    for i in range(cycles):
        mod.init()
        assert mod.is_initialized(), f"cycle {i}: init() returned but is_initialized() is False"
        mod.shutdown()
        assert not mod.is_initialized()
        mod.init()
        # Must hold even when a faster rank already shut this generation down again.
        assert mod.is_initialized(), f"cycle {i}: second init() returned but is_initialized() is False"
        if (i + 1) % CHECK_EVERY == 0:
            _check_generation(start + 2 * (i + 1))
            key = f"reinit.{mod.__name__}.{i}"
            np.testing.assert_array_equal(allreduce(data(key, RANK, (7,), np.int64), key), _expected_sum(key))
        mod.shutdown()
    mod.init()
    _check_generation(start + 2 * cycles + 1)


def test_numpy_cycles():
    _cycles(hvd, lambda x, name: hvd.allreduce(x, op=hvd.Sum, name=name), CYCLES)


def test_torch_cycles_then_carry_on():
    """The reported torch hang: cycles, then barrier/allgather_object/broadcast_object must all meet."""
    torch = pytest.importorskip("torch")
    import horovod.torch as thvd

    def allreduce(x, name):
        return thvd.allreduce(torch.from_numpy(x), op=thvd.Sum, name=name).numpy()

    _cycles(thvd, allreduce, max(CHECK_EVERY, CYCLES // 3))  # the same path as numpy's: fewer
    # upstream's test_horovod_is_initialized, then the same process carries on
    thvd.init()
    assert thvd.is_initialized()
    thvd.shutdown()
    assert not thvd.is_initialized()
    thvd.init()
    thvd.barrier()
    assert thvd.allgather_object({"rank": RANK}) == [{"rank": r} for r in range(SIZE)]
    assert thvd.broadcast_object(f"from {RANK}", root_rank=SIZE - 1) == f"from {SIZE - 1}"
    t = torch.full((3,), float(RANK + 1))
    assert thvd.allreduce(t, op=thvd.Sum).tolist() == [SIZE * (SIZE + 1) / 2] * 3


def test_static_process_sets_across_generations():
    """The same ProcessSet objects are registered again by every init() and work in every generation."""
    hvd.shutdown()
    tail, head = hvd.ProcessSet(list(range(1, SIZE))), hvd.ProcessSet([0])
    for i in range(10):
        hvd.init(process_sets=[tail, head])
        assert (tail.process_set_id, head.process_set_id) == (1, 2)
        key = f"reinit.sets.{i}"
        if RANK > 0:
            expected = sum(data(key, r, (4,), np.int32) for r in range(1, SIZE))
            out = hvd.allreduce(data(key, RANK, (4,), np.int32), op=hvd.Sum, name=key, process_set=tail)
            np.testing.assert_array_equal(out, expected)
        hvd.barrier()  # a rank outside the set must not end the generation while the set still works
        hvd.shutdown()
        assert tail.process_set_id is None and head.process_set_id is None
    hvd.init()


@pytest.mark.parametrize("shape", [(16,), (300_000,)], ids=["inline", "data-plane"])
def test_shutdown_with_collectives_in_flight(shape):
    """Async collectives pending while one rank shuts down: each completes right or fails, nothing waits.

    A faster rank may end the generation before this one even submits: then the submission fails."""
    for i in range(8):
        hvd.init()
        key = f"reinit.inflight.{shape[0]}.{i}"
        handles = []
        for j in range(4):
            try:
                handles.append(hvd.allreduce_async(data(f"{key}.{j}", RANK, shape, np.float64), op=hvd.Sum,
                                                   name=f"{key}.{j}"))
            except ShutdownError:
                handles.append(None)
        if RANK == i % SIZE:
            hvd.shutdown()
        for j, h in enumerate(handles):
            if h is None:
                continue
            try:
                out = hvd.synchronize(h)
            except HorovodInternalError as e:
                assert isinstance(e, ShutdownError), e
                continue
            np.testing.assert_array_equal(out, _expected_sum(f"{key}.{j}", shape, np.float64))
        # this generation is over on every rank: the others' collectives fail with the shut-down error, the
        # quitter's as before init() (upstream's horovod_shutdown() clears its initialised flag)
        with pytest.raises(ValueError if RANK == i % SIZE else ShutdownError):
            hvd.allreduce(np.ones(2), name=f"{key}.after")
        hvd.shutdown()
    hvd.init()
    _check_generation(basics.generation())
