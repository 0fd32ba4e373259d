"""Process sets on every rank in lockstep: static sets given to init(), dynamic add/remove, disjoint sets
running concurrently, every dtype per set.

    horovodrun -np 4 python -m pytest -x -q tests/parallel/test_numpy_process_sets.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from parallel_util import ALL_DTYPES, adasum_expected, allreduce_expected, assert_same, data, reducescatter_rows, seed

import horovod.numpy as hvd

STATIC: dict[str, hvd.ProcessSet] = {}


@pytest.fixture(scope="module", autouse=True)
def horovod():
    size = int(os.environ["HOROVOD_SIZE"])
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    STATIC["even"] = hvd.ProcessSet(range(0, size, 2))
    STATIC["odd"] = hvd.ProcessSet(range(1, size, 2))
    sets = [STATIC["even"], STATIC["odd"]]
    if size > 2:
        STATIC["first_two"] = hvd.ProcessSet([0, 1])
        sets.append(STATIC["first_two"])
    hvd.init(process_sets=sets)
    yield
    hvd.barrier()


def my_parity_set():
    return STATIC["even"] if hvd.rank() % 2 == 0 else STATIC["odd"]


def test_static_sets_registered():
    size = hvd.size()
    table = hvd.global_process_set.ranks
    assert table == list(range(size))
    from horovod.common.basics import _get_process_set_ids_and_ranks

    ids = _get_process_set_ids_and_ranks()
    assert ids[0] == list(range(size))
    assert ids[STATIC["even"].process_set_id] == list(range(0, size, 2))
    assert ids[STATIC["odd"].process_set_id] == list(range(1, size, 2))
    assert [STATIC["even"].process_set_id, STATIC["odd"].process_set_id] == [1, 2]
    ps = my_parity_set()
    assert ps.included()
    assert ps.size() == len(ps.ranks)
    assert ps.rank() == ps.ranks.index(hvd.rank())
    other = STATIC["odd"] if ps is STATIC["even"] else STATIC["even"]
    assert other.included() is False
    assert str(STATIC["even"]) == f"ProcessSet(process_set_id=1, ranks={list(range(0, size, 2))}, mpi_comm=None)"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_on_disjoint_sets_concurrently(dtype):
    rank = hvd.rank()
    ps = my_parity_set()
    members = ps.ranks
    key = ("ps", dtype, members[0])
    xs = {r: data(key, r, (6, 2), dtype) for r in members}
    op = hvd.Max if np.dtype(dtype) == np.bool_ else hvd.Sum
    out = hvd.allreduce(xs[rank], op=op, process_set=ps, name=f"ps.ar.{dtype}")
    expected = np.logical_or.reduce([xs[r] for r in members]) if np.dtype(dtype) == np.bool_ else \
        allreduce_expected([xs[r] for r in members], op)
    assert_same(out, expected)
    gathered = hvd.allgather(xs[rank][: members.index(rank) + 1], process_set=ps, name=f"ps.ag.{dtype}")
    assert_same(gathered, np.concatenate([xs[r][: i + 1] for i, r in enumerate(members)]))
    root = members[-1]
    assert_same(hvd.broadcast(xs[rank], root, process_set=ps, name=f"ps.bc.{dtype}"), xs[root])


def test_average_divides_by_set_size():
    rank = hvd.rank()
    ps = my_parity_set()
    xs = {r: data("psavg", r, (10,), np.int32, low=-30, high=30) for r in ps.ranks}
    out = hvd.allreduce(xs[rank], op=hvd.Average, process_set=ps)
    assert_same(out, allreduce_expected([xs[r] for r in ps.ranks], hvd.Average))


def test_alltoall_and_reducescatter_in_a_set():
    rank = hvd.rank()
    ps = my_parity_set()
    members = ps.ranks
    n = len(members)
    me = members.index(rank)
    splits = {r: [(i + j) % 2 + 1 for j in range(n)] for i, r in enumerate(members)}
    xs = {r: data("psa2a", r, (sum(splits[r]), 3), np.float32) for r in members}
    out, received = hvd.alltoall(xs[rank], splits=splits[rank], process_set=ps)
    blocks = []
    for r in members:
        start = sum(splits[r][:me])
        blocks.append(xs[r][start:start + splits[r][me]])
    assert_same(out, np.concatenate(blocks))
    np.testing.assert_array_equal(received, [splits[r][me] for r in members])
    dim0 = 2 * n + 1
    ys = {r: data("psrs", r, (dim0, 2), np.float64) for r in members}
    rows = reducescatter_rows(dim0, n)
    start = sum(rows[:me])
    full = allreduce_expected([ys[r] for r in members], hvd.Sum)
    assert_same(hvd.reducescatter(ys[rank], op=hvd.Sum, process_set=ps), full[start:start + rows[me]])


def test_big_tensor_in_a_set_while_the_other_set_works():
    rank = hvd.rank()
    ps = my_parity_set()
    n = 500_001 if ps is STATIC["even"] else 3
    xs = {r: data(("psbig", n), r, (n,), np.float32) for r in ps.ranks}
    for _ in range(3):
        assert_same(hvd.allreduce(xs[rank], op=hvd.Sum, process_set=ps, name="psbig"),
                    allreduce_expected([xs[r] for r in ps.ranks], hvd.Sum))


def test_overlapping_sets_async_in_the_same_order():
    rank, size = hvd.rank(), hvd.size()
    handles = []
    if "first_two" in STATIC and rank in (0, 1):
        handles.append(("two", hvd.allreduce_async(np.full(4, rank + 1.0), op=hvd.Sum,
                                                   process_set=STATIC["first_two"], name="ov.two")))
    handles.append(("global", hvd.allreduce_async(np.full(4, 1.0), op=hvd.Sum, name="ov.global")))
    handles.append(("parity", hvd.allreduce_async(np.full(4, 1.0), op=hvd.Sum, process_set=my_parity_set(),
                                                  name="ov.parity")))
    for kind, h in handles:
        out = hvd.synchronize(h)
        expected = {"two": 3.0, "global": float(size), "parity": float(len(my_parity_set().ranks))}[kind]
        np.testing.assert_array_equal(out, np.full(4, expected))


def test_adasum_in_disjoint_sets_concurrently():
    """Adasum on a process set (upstream: global set only): each parity set combines its own members'
    tensors, small (reduced by the coordinator) and large (the data plane), while the other set does too."""
    ps = my_parity_set()
    members = ps.ranks
    for shape in [(9,), (200_000,)]:
        xs = {r: np.random.default_rng([seed("adasum.set", shape[0]), r]).normal(size=shape).astype(np.float32)
              for r in members}
        got = hvd.allreduce(xs[hvd.rank()], op=hvd.Adasum, process_set=ps, name=f"adasum.set.{shape[0]}")
        np.testing.assert_allclose(got, adasum_expected([xs[r] for r in members]), rtol=1e-5, atol=1e-5)


def test_barrier_in_a_set():
    for _ in range(3):
        hvd.barrier(process_set=my_parity_set())
    hvd.barrier()


def test_op_on_a_set_this_rank_is_not_in():
    rank = hvd.rank()
    other = STATIC["odd"] if my_parity_set() is STATIC["even"] else STATIC["even"]
    if not other.ranks:
        return
    with pytest.raises(ValueError) as info:
        hvd.allreduce(np.ones(2), process_set=other)
    assert str(info.value) == f"Allreduce: Rank {rank} is not a member of the provided process set."
    with pytest.raises(ValueError) as info:
        hvd.allgather(np.ones(2), process_set=other)
    assert str(info.value) == f"Allgather: Rank {rank} is not a member of the provided process set."
    with pytest.raises(ValueError) as info:
        hvd.broadcast(np.ones(2), other.ranks[0], process_set=other)
    assert str(info.value) == f"Broadcast: Rank {rank} is not a member of the provided process set."
    with pytest.raises(ValueError, match="is not a member of the provided process set"):
        hvd.barrier(process_set=other)


def test_broadcast_root_outside_the_set():
    ps = my_parity_set()
    outsider = next((r for r in range(hvd.size()) if r not in ps.ranks), None)
    if outsider is None:
        return
    with pytest.raises(ValueError) as info:
        hvd.broadcast(np.ones(2), outsider, process_set=ps)
    assert str(info.value) == f"broadcast received invalid root rank {outsider} for provided process set"


# ------------------------------------------------------------------------------------------------ dynamic
def test_dynamic_add_use_remove():
    from horovod.common.basics import _get_process_set_ids_and_ranks

    rank = hvd.rank()
    # Static sets can be removed in dynamic mode; this frees id 2 and the ranks of "odd" for a new set.
    odd = STATIC["odd"]
    members = list(odd.ranks)
    assert hvd.remove_process_set(odd) is True
    assert odd.process_set_id is None
    assert 2 not in _get_process_set_ids_and_ranks()
    ps = hvd.add_process_set(members)
    assert ps.process_set_id == 2  # freed ids are reused first
    assert ps.ranks == members
    assert _get_process_set_ids_and_ranks()[2] == members
    if rank in ps.ranks:
        xs = {r: data("dyn", r, (5,), np.int64) for r in ps.ranks}
        assert_same(hvd.allreduce(xs[rank], op=hvd.Sum, process_set=ps, name="dyn"),
                    allreduce_expected([xs[r] for r in ps.ranks], hvd.Sum))
    assert hvd.remove_process_set(ps) is True
    assert ps.process_set_id is None
    assert 2 not in _get_process_set_ids_and_ranks()
    if rank in members:
        with pytest.raises(ValueError, match="Process set provided does not exist, or has not been registered"):
            hvd.allreduce(np.ones(1), process_set=ps)
    again = hvd.add_process_set(hvd.ProcessSet(members))
    assert again.process_set_id == 2
    STATIC["odd"] = again


def test_dynamic_duplicate_and_global_cannot_be_removed():
    size = hvd.size()
    with pytest.raises(ValueError) as info:
        hvd.add_process_set(list(range(0, size, 2)))  # same ranks as the static "even" set
    assert str(info.value).startswith("Attempted to add a duplicate process set: ")
    assert hvd.remove_process_set(hvd.global_process_set) is False


@pytest.mark.parametrize("bad", ["out_of_range", "negative", "repeated"])
def test_dynamic_set_with_bad_ranks_gets_upstreams_text(bad):
    size = hvd.size()
    ranks, text = {"out_of_range": ([0, size], f"invalid rank: {size}"), "negative": ([-1, 0], "invalid rank: -1"),
                   "repeated": ([1, 1], "duplicate rank: 1")}[bad]
    with pytest.raises(Exception) as info:
        hvd.add_process_set(ranks)
    assert str(info.value) == f"Tried to register process set with {text}", str(info.value)
    hvd.barrier()  # every rank got it, and the job goes on


def test_many_dynamic_sets_in_sequence():
    from horovod.common.basics import _get_process_set_ids_and_ranks

    size = hvd.size()
    for i in range(6):
        members = sorted({i % size, (i + 1) % size})
        if members in _get_process_set_ids_and_ranks().values():
            continue
        ps = hvd.add_process_set(members)
        if hvd.rank() in members:
            # named: members have different histories of unnamed ops (see tests/test_faults.py)
            out = hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=ps, name=f"many.{i}")
            np.testing.assert_array_equal(out, np.full(2, float(len(members))))
        assert hvd.remove_process_set(ps)
    hvd.barrier()


def test_reused_set_id_does_not_reuse_the_old_sets_cache():
    """A removed set's id comes back for the next set; cached tensor names of the old set must not leak."""
    from horovod.common.basics import _get_process_set_ids_and_ranks

    size = hvd.size()
    registered = list(_get_process_set_ids_and_ranks().values())
    candidates = [sorted({0, size - 1}), [0], [size - 1], [1], [0, 1]]
    free = [m for m in candidates if m not in registered]
    if not free:
        pytest.skip("every candidate set is already registered")
    members = free[0]
    ids = []
    for _round in range(3):
        ps = hvd.add_process_set(members)
        ids.append(ps.process_set_id)
        if hvd.rank() in members:
            for _ in range(3):  # the 2nd and 3rd calls are cache hits
                out = hvd.allreduce(np.ones(3), op=hvd.Sum, process_set=ps, name="reused.name")
                np.testing.assert_array_equal(out, np.full(3, float(len(members))))
        assert hvd.remove_process_set(ps)
    assert len(set(ids)) == 1  # the same id every round
    hvd.barrier()
