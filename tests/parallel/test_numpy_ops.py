"""horovod.numpy collectives on every rank in lockstep:

    horovodrun -np 3 python -m pytest -x -q tests/parallel/test_numpy_ops.py

Every rank builds every rank's input from a seed, so expected results are computed locally with numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
from parallel_util import (
    ALL_DTYPES,
    BF16,
    adasum_expected,
    allreduce_expected,
    assert_same,
    data,
    launcher_rank_size,
    reducescatter_rows,
    seed,
)

import horovod.numpy as hvd

OPS = [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
REDUCE_DTYPES = [d for d in ALL_DTYPES if d != np.bool_]


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.barrier()


def rs():
    return hvd.rank(), hvd.size()


def test_layout_matches_launcher():
    rank, size = launcher_rank_size()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.local_size() == size and hvd.local_rank() == rank  # one host
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert hvd.is_initialized() and hvd.gloo_enabled()
    assert hvd.global_process_set.ranks == list(range(size))


# ------------------------------------------------------------------------------------------------ allreduce
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=str)
def test_allreduce_ops_dtypes(op, dtype):
    rank, size = rs()
    key = ("allreduce", op, dtype)
    low, high = (-3, 3) if op == hvd.Product else (-8, 8)
    xs = [data(key, r, (17, 3), dtype, low=low, high=high) for r in range(size)]
    out = hvd.allreduce(xs[rank], op=op, name=f"ar.{op}.{dtype}")
    assert_same(out, allreduce_expected(xs, op))


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_bool(op):
    rank, size = rs()
    xs = [data(("bool", op), r, (33,), np.bool_) for r in range(size)]
    out = hvd.allreduce(xs[rank], op=op)
    expected = {hvd.Sum: np.logical_or, hvd.Max: np.logical_or, hvd.Min: np.logical_and,
                hvd.Product: np.logical_and}[op].reduce(xs)
    assert_same(out, expected)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int8, np.uint8, np.float16, np.float32, np.float64],
                         ids=str)
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_allreduce_prescale_postscale(dtype, op):
    rank, size = rs()
    xs = [data(("scale", dtype, op), r, (64,), dtype, low=-20, high=20) for r in range(size)]
    out = hvd.allreduce(xs[rank], op=op, prescale_factor=0.5, postscale_factor=1.5)
    assert_same(out, allreduce_expected(xs, op, 0.5, 1.5))


def test_integer_average_truncates_toward_zero():
    rank, size = rs()
    # choose inputs whose sum is not divisible by size and is negative for half the elements
    base = np.array([-7, 7, -5, 5, -1, 1, -2, 2, 0], np.int32)
    xs = [base + (1 if r == 0 else 0) for r in range(size)]
    out = hvd.allreduce(xs[rank], op=hvd.Average)
    total = sum(x.astype(np.int64) for x in xs)
    expected = np.trunc(total / size).astype(np.int32)
    assert_same(out, expected)
    assert (expected != np.floor_divide(total, size)).any() or size == 1


def test_fp16_average_scaled_in_fp32():
    rank, size = rs()
    xs = [data("fp16avg", r, (1000,), np.float16, low=-100, high=100) for r in range(size)]
    out = hvd.allreduce(xs[rank], op=hvd.Average)
    total = sum(x.astype(np.float32) for x in xs).astype(np.float16)
    assert_same(out, (total.astype(np.float32) * np.float32(1 / size)).astype(np.float16))


@pytest.mark.parametrize("nbytes", [40, 200_000])
def test_allreduce_in_place(nbytes):
    rank, size = rs()
    n = nbytes // 8
    xs = [data(("inplace", nbytes), r, (n,), np.float64) for r in range(size)]
    mine = xs[rank].copy()
    out = hvd.allreduce_(mine, op=hvd.Sum)
    assert out is mine
    assert_same(mine, allreduce_expected(xs, hvd.Sum))
    mine = xs[rank].copy()
    h = hvd.allreduce_async_(mine, op=hvd.Average, name=f"inplace.async.{nbytes}")
    assert hvd.synchronize(h) is mine
    assert_same(mine, allreduce_expected(xs, hvd.Average))


def test_allreduce_scalar_and_empty():
    rank, size = rs()
    out = hvd.allreduce(np.float64(rank), op=hvd.Sum)
    assert out.shape == () and float(out) == sum(range(size))
    empty = hvd.allreduce(np.zeros((0, 4), np.float32), op=hvd.Sum)
    assert empty.shape == (0, 4)


def test_grouped_allreduce():
    rank, size = rs()
    shapes = [(3,), (4, 5), (), (1000,), (2, 2, 2)]
    xss = [[data(("grouped", i), r, s, np.float32) for i, s in enumerate(shapes)] for r in range(size)]
    outs = hvd.grouped_allreduce(xss[rank], op=hvd.Sum, name="grouped")
    assert len(outs) == len(shapes)
    for i, out in enumerate(outs):
        assert_same(out, allreduce_expected([xss[r][i] for r in range(size)], hvd.Sum))
    outs = hvd.grouped_allreduce(xss[rank], op=hvd.Average)  # unnamed
    for i, out in enumerate(outs):
        assert_same(out, allreduce_expected([xss[r][i] for r in range(size)], hvd.Average))


# ------------------------------------------------------------------------------------------------ allgather
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_allgather_uneven_first_dimension(dtype):
    rank, size = rs()
    xs = [data(("allgather", dtype), r, (r * 2 + 1, 3), dtype) for r in range(size)]
    out = hvd.allgather(xs[rank], name=f"ag.{dtype}")
    assert_same(out, np.concatenate(xs))


def test_allgather_with_zero_rows_on_some_ranks():
    rank, size = rs()
    xs = [data("ag0", r, (r % 2, 4), np.int64) for r in range(size)]
    assert_same(hvd.allgather(xs[rank]), np.concatenate(xs))


def test_allgather_one_dimensional_and_large():
    rank, size = rs()
    xs = [data("ag1d", r, (100_003 + r,), np.float32) for r in range(size)]
    assert_same(hvd.allgather(xs[rank]), np.concatenate(xs))


def test_grouped_allgather():
    rank, size = rs()
    xss = [[data(("gag", i), r, (r + i, 2), np.int32) for i in range(3)] for r in range(size)]
    outs = hvd.grouped_allgather(xss[rank])
    for i, out in enumerate(outs):
        assert_same(out, np.concatenate([xss[r][i] for r in range(size)]))


# ------------------------------------------------------------------------------------------------ broadcast
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_broadcast_from_every_root(dtype):
    rank, size = rs()
    for root in range(size):
        xs = [data(("bcast", dtype, root), r, (5, 7), dtype) for r in range(size)]
        out = hvd.broadcast(xs[rank], root, name=f"bc.{dtype}.{root}")
        assert_same(out, xs[root])
        if rank != root:
            assert_same(xs[rank], data(("bcast", dtype, root), rank, (5, 7), dtype))  # input untouched


def test_broadcast_in_place():
    rank, size = rs()
    for root in range(size):
        mine = data(("bcast_", root), rank, (300_001,), np.float64)
        out = hvd.broadcast_(mine, root)
        assert out is mine
        assert_same(mine, data(("bcast_", root), root, (300_001,), np.float64))


# ------------------------------------------------------------------------------------------------ alltoall
def test_alltoall_equal_splits():
    rank, size = rs()
    xs = [data("a2a", r, (size * 3, 2), np.float32) for r in range(size)]
    out = hvd.alltoall(xs[rank])
    expected = np.concatenate([xs[j][rank * 3:(rank + 1) * 3] for j in range(size)])
    assert_same(out, expected)


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.bool_, np.uint8], ids=str)
def test_alltoall_with_splits(dtype):
    rank, size = rs()
    splits = [[(r + j) % 3 for j in range(size)] for r in range(size)]
    extra = 2  # rows past sum(splits) are not sent
    xs = [data(("a2as", dtype), r, (sum(splits[r]) + extra, 4), dtype) for r in range(size)]
    out, received = hvd.alltoall(xs[rank], splits=np.array(splits[rank], np.int32))
    blocks = []
    for j in range(size):
        start = sum(splits[j][:rank])
        blocks.append(xs[j][start:start + splits[j][rank]])
    assert_same(out, np.concatenate(blocks))
    np.testing.assert_array_equal(received, [splits[j][rank] for j in range(size)])


def test_alltoall_async_with_list_splits():
    rank, size = rs()
    splits = [1] * size
    h = hvd.alltoall_async(np.full((size, 1), rank, np.int64), splits=splits)
    out, received = hvd.synchronize(h)
    np.testing.assert_array_equal(out.ravel(), np.arange(size))
    np.testing.assert_array_equal(received, splits)


# ------------------------------------------------------------------------------------------------ reducescatter
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float16, np.float32, np.float64], ids=str)
def test_reducescatter_uneven(op, dtype):
    rank, size = rs()
    dim0 = 2 * size + 1 if size > 1 else 3
    xs = [data(("rs", op, dtype), r, (dim0, 3), dtype) for r in range(size)]
    out = hvd.reducescatter(xs[rank], op=op)
    rows = reducescatter_rows(dim0, size)
    assert rows[0] >= rows[-1]
    start = sum(rows[:rank])
    full = allreduce_expected(xs, op)
    assert_same(out, full[start:start + rows[rank]])


def test_reducescatter_fewer_rows_than_ranks_and_scaling():
    rank, size = rs()
    dim0 = max(1, size - 1)
    xs = [data("rs_small", r, (dim0, 2), np.float64) for r in range(size)]
    out = hvd.reducescatter(xs[rank], op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    rows = reducescatter_rows(dim0, size)
    start = sum(rows[:rank])
    assert_same(out, allreduce_expected(xs, hvd.Sum, 0.5, 4.0)[start:start + rows[rank]])


def test_grouped_reducescatter():
    rank, size = rs()
    dims = [size, 2 * size + 1, size + 2]
    xss = [[data(("grs", i), r, (d, 2), np.float32) for i, d in enumerate(dims)] for r in range(size)]
    outs = hvd.grouped_reducescatter(xss[rank], op=hvd.Sum)
    for i, d in enumerate(dims):
        rows = reducescatter_rows(d, size)
        start = sum(rows[:rank])
        full = allreduce_expected([xss[r][i] for r in range(size)], hvd.Sum)
        assert_same(outs[i], full[start:start + rows[rank]])


# ------------------------------------------------------------------------------------------------ misc
def test_barrier():
    for _ in range(5):
        assert hvd.barrier() is None


def test_broadcast_object_and_allgather_object():
    rank, size = rs()
    for root in range(size):
        obj = {"root": root, "payload": list(range(root * 100))} if rank == root else None
        got = hvd.broadcast_object(obj, root, name=f"obj.{root}")
        assert got == {"root": root, "payload": list(range(root * 100))}
    gathered = hvd.allgather_object({"rank": rank, "blob": "x" * (rank * 1000)})
    assert gathered == [{"rank": r, "blob": "x" * (r * 1000)} for r in range(size)]


def test_unnamed_object_collectives_with_none_on_some_ranks():
    """The usual ``broadcast_object(x if rank == root else None)`` without a name: upstream named it after the
    object's type (``dict.sz`` on the root, ``NoneType.sz`` elsewhere) and the job stalled."""
    rank, size = rs()
    for root in range(size):
        state = {"epoch": 3, "root": root} if rank == root else None
        assert hvd.broadcast_object(state, root) == {"epoch": 3, "root": root}
    gathered = hvd.allgather_object(None if rank % 2 else [rank])  # different types on different ranks
    assert gathered == [None if r % 2 else [r] for r in range(size)]


def test_many_async_ops_then_synchronize():
    rank, size = rs()
    specs = [(i, (i % 7 + 1, 3), [np.float32, np.float64, np.int32][i % 3]) for i in range(120)]
    handles = []
    for i, shape, dtype in specs:
        handles.append(hvd.allreduce_async(data(("fuse", i), rank, shape, dtype), name=f"fuse.{i}", op=hvd.Sum))
    gathers = [hvd.allgather_async(data(("fuseg", i), rank, (rank + 1,), np.int16)) for i in range(10)]
    for (i, shape, dtype), h in zip(specs, handles):
        xs = [data(("fuse", i), r, shape, dtype) for r in range(size)]
        assert_same(hvd.synchronize(h), allreduce_expected(xs, hvd.Sum))
    for i, h in enumerate(gathers):
        assert_same(hvd.synchronize(h), np.concatenate([data(("fuseg", i), r, (r + 1,), np.int16)
                                                        for r in range(size)]))


def test_repeated_named_ops_hit_the_cache():
    rank, size = rs()
    for step in range(30):
        xs = [data(("cache", step), r, (16,), np.float32) for r in range(size)]
        assert_same(hvd.allreduce(xs[rank], name="cache.grad", op=hvd.Sum), allreduce_expected(xs, hvd.Sum))
        ys = [data(("cacheb", step), r, (3, 3), np.int32) for r in range(size)]
        assert_same(hvd.broadcast(ys[rank], step % size, name="cache.bcast"), ys[step % size])


def test_repeated_name_with_changing_shape():
    rank, size = rs()
    for step in range(10):
        shape = (step % 3 + 1, 2)
        xs = [data(("cshape", step), r, shape, np.float64) for r in range(size)]
        assert_same(hvd.allreduce(xs[rank], name="changing", op=hvd.Sum), allreduce_expected(xs, hvd.Sum))


def test_big_odd_sized_tensors():
    rank, size = rs()
    n = 786_431  # ~3 MiB of float32, odd
    xs = [data("big", r, (n,), np.float32, low=-100, high=100) for r in range(size)]
    assert_same(hvd.allreduce(xs[rank], op=hvd.Sum), allreduce_expected(xs, hvd.Sum))
    assert_same(hvd.allreduce(xs[rank], op=hvd.Average), allreduce_expected(xs, hvd.Average))
    assert_same(hvd.allreduce(xs[rank], op=hvd.Max), allreduce_expected(xs, hvd.Max))
    ints = [data("bigint", r, (n + 2,), np.int64) for r in range(size)]
    assert_same(hvd.allreduce(ints[rank], op=hvd.Average), allreduce_expected(ints, hvd.Average))
    rows = [(n // 3) + r for r in range(size)]
    gs = [data("biggather", r, (rows[r], 3), np.int16) for r in range(size)]
    assert_same(hvd.allgather(gs[rank]), np.concatenate(gs))
    dim0 = 300_007
    rsx = [data("bigrs", r, (dim0, 2), np.float64) for r in range(size)]
    rrows = reducescatter_rows(dim0, size)
    start = sum(rrows[:rank])
    assert_same(hvd.reducescatter(rsx[rank], op=hvd.Sum), allreduce_expected(rsx, hvd.Sum)[start:start + rrows[rank]])
    a2a = [data("biga2a", r, (size * 50_001, 2), np.float32) for r in range(size)]
    expected = np.concatenate([a2a[j][rank * 50_001:(rank + 1) * 50_001] for j in range(size)])
    assert_same(hvd.alltoall(a2a[rank]), expected)


def test_big_fused_group():
    rank, size = rs()
    shapes = [(100_001,), (3,), (250_000,), (7, 7)]
    xss = [[data(("bigfuse", i), r, s, np.float32) for i, s in enumerate(shapes)] for r in range(size)]
    outs = hvd.grouped_allreduce(xss[rank], op=hvd.Average)
    for i, out in enumerate(outs):
        assert_same(out, allreduce_expected([xss[r][i] for r in range(size)], hvd.Average))


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_large_fused_group_reduced_in_its_tensors(op, dtype, monkeypatch):
    """A fused group of large tensors with outputs goes to shared memory as its tensors (no fusion buffer),
    some reduced in place, some into outputs of their own, small ones among them; fused with its neighbours
    (one response), every result against numpy.  Over TCP and MPI (no parts) the fusion buffer carries it."""
    from horovod.common import ops as _ops
    from horovod.runtime import executor
    rank, size = rs()
    decided: list[tuple[bool, bool]] = []  # (the transport takes parts, the group went as parts)
    real = executor.Executor._in_parts

    def recording(comm, resp, entries):
        decided.append((comm.takes_pieces, real(comm, resp, entries)))
        return decided[-1][1]
    monkeypatch.setattr(executor.Executor, "_in_parts", staticmethod(recording))
    shapes = [(300, 1024), (7,), (70_000,), (5, 5), (1024, 257), (3,)] + [(128, 256), (256,)] * 50  # 106 tensors
    for step in range(2):
        xss = [[data(("parts", step, i, np.dtype(dtype).name), r, s, dtype, low=-50, high=50)
                for i, s in enumerate(shapes)] for r in range(size)]
        mine = [x.copy() for x in xss[rank]]
        outs = [None if i % 2 == 0 else np.full(s, -1, dtype) for i, s in enumerate(shapes)]
        handles = [hvd.allreduce_async_(x, op=op, name=f"parts.{i}") if out is None else
                   _ops.allreduce(x, out, op=op, name=f"parts.{i}") for i, (x, out) in enumerate(zip(mine, outs))]
        for h in handles:
            h.wait() if hasattr(h, "wait") else hvd.synchronize(h)
        for i in range(len(shapes)):
            got = mine[i] if outs[i] is None else outs[i]
            assert_same(got, allreduce_expected([xss[r][i] for r in range(size)], op))
            if outs[i] is not None:
                assert_same(mine[i], xss[rank][i])  # an input with an output of its own is left alone
    assert decided, "no fused group reached the executor"
    assert any(parts for _, parts in decided) == any(takes for takes, _ in decided), decided


@pytest.mark.parametrize("simd", [True, False], ids=["ufunc-loop", "memcpy"])
@pytest.mark.parametrize("nbytes", [40, 200_000, 3_000_000])
def test_strided_views(nbytes, simd, monkeypatch):
    """A strided view (``x[::2]``, a transposed matrix) through every size class (sockets, one shared-memory
    round, pieces) and both copy loops of ``copy_into`` (hosts differ in which one they pick), against numpy."""
    from horovod.transport import buffers
    monkeypatch.setattr(buffers, "_simd_copy", simd)
    rank, size = rs()
    n = nbytes // 4
    xs = [data(("strided", nbytes), r, (2 * n,), np.float32) for r in range(size)]
    got = hvd.allreduce(xs[rank][::2], op=hvd.Sum, name=f"strided.{nbytes}.{simd}")
    assert_same(got, allreduce_expected([x[::2] for x in xs], hvd.Sum))
    mats = [x[:n - n % 8].reshape(8, -1) for x in xs]
    got = hvd.allreduce(mats[rank].T, op=hvd.Max, name=f"strided.T.{nbytes}.{simd}")
    assert_same(got, allreduce_expected([m.T for m in mats], hvd.Max))
    assert_same(hvd.allgather(mats[rank].T), np.concatenate([m.T for m in mats]))
    assert_same(hvd.broadcast(xs[rank][1::2], root_rank=size - 1), xs[size - 1][1::2])


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes not installed")
def test_bfloat16_average():
    rank, size = rs()
    xs = [data("bf16", r, (40,), BF16) for r in range(size)]
    out = hvd.allreduce(xs[rank], op=hvd.Average)
    total = sum(x.astype(np.float32) for x in xs).astype(BF16)
    assert_same(out, (total.astype(np.float32) * np.float32(1 / size)).astype(BF16))


# ------------------------------------------------------------------------------------------------ Adasum
ADASUM_RTOL = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}


def _floats(key, rank, shape, dtype):
    return np.random.default_rng([seed(key), rank]).normal(size=shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 40), (300_000,)], ids=["inline", "small", "data-plane"])
def test_adasum_matches_upstreams_reference(dtype, shape):
    rank, size = rs()
    xs = [_floats(f"adasum{shape}", r, shape, dtype) for r in range(size)]
    got = hvd.allreduce(xs[rank], op=hvd.Adasum, name=f"adasum.{np.dtype(dtype).name}.{len(shape)}.{shape[0]}")
    assert got.dtype == np.dtype(dtype) and got.shape == shape
    np.testing.assert_allclose(got.astype(np.float64), adasum_expected(xs), rtol=ADASUM_RTOL[dtype],
                               atol=ADASUM_RTOL[dtype])
    assert len(set(hvd.allgather_object(got.tobytes()))) == 1  # bitwise the same on every rank


def test_adasum_of_a_group_combines_each_tensor_alone_and_scales():
    """A fused group: each tensor its own dot products; parallel vectors average, orthogonal ones add up."""
    rank, size = rs()
    xs = [[_floats("adasum.g", r, (5, 4), np.float32), np.full(6, 2.0, np.float32),
           np.eye(size, dtype=np.float32)[r] * 3.0, _floats("adasum.big", r, (70_000,), np.float32)]
          for r in range(size)]
    got = hvd.grouped_allreduce(xs[rank], op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5)
    np.testing.assert_allclose(got[1], np.full(6, 2.0), rtol=1e-6)  # identical on every rank: their average
    np.testing.assert_allclose(got[2], np.full(size, 3.0), rtol=1e-6)  # orthogonal: their sum
    for i in (0, 3):
        expected = adasum_expected([x[i].astype(np.float64) * 2.0 for x in xs]) * 0.5
        np.testing.assert_allclose(got[i], expected, rtol=1e-5, atol=1e-5)


def test_adasum_with_joined_ranks_keeps_the_others_vector():
    """A joined rank contributes zeros, and Adasum with a zero vector leaves the other one as it is."""
    rank, size = rs()
    x = _floats("adasum.join", rank, (50_000,), np.float32)
    if rank == size - 1:
        np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Adasum, name="adasum.join"), x)
    assert hvd.join() == size - 1


def test_adasum_arguments_refused_with_upstreams_texts():
    rank, size = rs()
    with pytest.raises(ValueError, match="supports float16, float32 and float64 tensors, not int32"):
        hvd.allreduce(np.arange(4, dtype=np.int32), op=hvd.Adasum)
    with pytest.raises(ValueError, match="Reducescatter currently only supports AVERAGE and SUM"):
        hvd.reducescatter(np.ones((size, 2)), op=hvd.Adasum)


# ------------------------------------------------------------------------------------------------ join
def test_join_others_contribute_zeros():
    rank, size = rs()
    last = size - 1
    xs = [data("join", r, (9,), np.float64) for r in range(size)]
    ints = [data("joini", r, (9,), np.int32, low=-20, high=20) for r in range(size)]
    big = [data("joinbig", r, (100_000,), np.float32) for r in range(size)]
    if rank == last:
        assert_same(hvd.allreduce(xs[rank], op=hvd.Sum, name="join.sum"), xs[rank])
        # Average still divides by the full size
        assert_same(hvd.allreduce(xs[rank], op=hvd.Average, name="join.avg"),
                    allreduce_expected([xs[rank]] + [np.zeros_like(xs[rank])] * (size - 1), hvd.Average))
        assert_same(hvd.allreduce(ints[rank], op=hvd.Average, name="join.int"),
                    np.trunc(ints[rank].astype(np.float64) / size).astype(np.int32))
        assert_same(hvd.allreduce(big[rank], op=hvd.Sum, name="join.big"), big[rank])
    assert hvd.join() == last


def test_join_coordinator_last():
    rank, size = rs()
    if rank == 0:
        x = np.arange(5, dtype=np.float32)
        assert_same(hvd.allreduce(x, op=hvd.Sum, name="join0"), x)
    assert hvd.join() == 0
    # everything works normally afterwards
    assert_same(hvd.allreduce(np.ones(3), op=hvd.Sum, name="after.join"), np.full(3, float(size)))


def test_join_every_rank_at_once():
    rank, size = rs()
    result = hvd.join()
    assert 0 <= result < size
    assert hvd.allgather_object(result) == [result] * size


@pytest.mark.parametrize("sizes", [(5, 3, 2), (1000, 70_000, 3, 600_000), (17, 300_000)], ids=["inline", "big", "two"])
@pytest.mark.parametrize("prescale", [1.0, 3.0])
def test_allreduce_between_pieces(sizes, prescale):
    """An input of several arrays read as one (``Pieces``, TensorFlow's gradients) reduced into an output of
    several arrays written in place (``Pieces(merge=False)``, TensorFlow-owned results), split at other
    places than the input; alone and fused with an ordinary tensor (the fusion buffer is scattered into the
    output's arrays).  Small totals are reduced by the coordinator, big ones by the data plane (shared
    memory writes the arrays itself, TCP through a flat buffer: tests/test_parallel.py runs both)."""
    from horovod.common import ops as _ops
    rank, size = rs()
    n = sum(sizes)
    xs = [data(("pieces", n, prescale), r, (n,), np.float32) for r in range(size)]
    expected = allreduce_expected(xs, hvd.Average) * np.float32(prescale)
    cuts = np.cumsum(sizes)[:-1]
    out_cuts = sorted({max(1, c // 2) for c in cuts} | {n - 1})
    other = [data(("pieces-other", n), r, (300_000,), np.float32) for r in range(size)]
    for fused in (False, True):
        outs = [np.full(len(p), np.nan, np.float32) for p in np.split(np.empty(n), out_cuts)]
        h = _ops.allreduce(_ops.Pieces(np.split(xs[rank], cuts)), _ops.Pieces(outs, merge=False),
                           name=f"pieces.{n}.{prescale}.{fused}", op=hvd.Average, prescale_factor=prescale)
        if fused:
            assert_same(hvd.allreduce(other[rank], op=hvd.Sum, name=f"pieces.other.{n}.{prescale}"),
                        allreduce_expected(other, hvd.Sum))
        h.wait()
        np.testing.assert_allclose(np.concatenate(outs), expected, rtol=1e-5, err_msg=f"fused={fused}")


@pytest.mark.parametrize("waiter", ["other-thread", "nobody"])
def test_requests_sent_by_the_enqueuing_thread(waiter):
    """``send_now`` (TensorFlow's submit op): the enqueuing thread sends the request itself and never waits;
    another thread waits and runs the rounds that execute it, or nobody waits and the engine thread must.
    With nobody waiting the coordinator enqueues last (after a barrier), so its answer is complete at once and
    only a wake-up gets the engine thread to execute it before its next heartbeat (up to 1 s: five steps
    took 1.8 s without it, 0.015 s with it).  Ranks enqueue in different orders; the sizes cover inline and
    data-plane allreduces."""
    import threading
    import time

    from horovod.common import ops as _ops
    rank, size = rs()
    shapes = [(7,), (300_000,), (33, 5), (1_000_000,)]
    xs = {i: [data(("send-now", waiter, i), r, s, np.float32) for r in range(size)] for i, s in enumerate(shapes)}

    def send(order: list[int], outs: dict) -> dict:
        return {i: _ops.allreduce(xs[i][rank], outs[i], name=f"send-now.{waiter}.{i}", op=hvd.Sum, send_now=True)
                for i in order}

    def wait_all(handles: dict, errors: list) -> None:
        try:
            for i in sorted(handles):
                handles[i].wait()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    elapsed = 0.0
    for step in range(5):
        order = list(range(len(shapes)))[::-1 if (rank + step) % 2 else 1]
        outs = {i: np.full(shapes[i], np.nan, np.float32) for i in order}
        if waiter == "other-thread":
            handles, errors = send(order, outs), []
            t = threading.Thread(target=wait_all, args=(handles, errors))
            t.start()
            t.join(30)
            assert not t.is_alive() and not errors, errors
        else:
            handles = send(order, outs) if rank else {}
            hvd.barrier()  # every other rank's requests reached the coordinator
            start = time.monotonic()
            if not rank:
                handles = send(order, outs)
            while not all(h.done() for h in handles.values()) and time.monotonic() - start < 30:
                time.sleep(0.0005)
            elapsed += time.monotonic() - start
            assert all(h.done() for h in handles.values()), "no thread ran the rounds of requests sent at once"
        for i in order:
            handles[i].wait()
            assert_same(outs[i], allreduce_expected(xs[i], hvd.Sum))
    assert elapsed < 0.75, f"five steps took {elapsed:.2f} s: requests sent at once waited for a heartbeat"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("n", [5, 3 << 16])  # a small tensor and one past the transports' segment sizes
def test_non_finite_values_reduce_without_numpy_warnings(dtype, n):
    """Mixed-precision training reduces inf/-inf/nan gradients on purpose (the loss scaler then skips the step):
    numpy's 'invalid value encountered in add' / 'overflow encountered in multiply' RuntimeWarnings leaked
    from the reduction and scaling code of the transports, where upstream's C++ says nothing.  Results are
    IEEE's: inf + -inf = nan, a prescaled float16 overflow is inf."""
    import warnings

    r, size = rs()
    finfo = np.finfo(dtype)
    x = np.zeros(n, dtype)
    x[:5] = [np.inf if r == 0 else -np.inf, np.nan, finfo.max, -finfo.max, 1]
    xs = []
    for k in range(size):
        xk = x.copy()
        xk[0] = np.inf if k == 0 else -np.inf
        xs.append(xk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hvd.allreduce(x, op=hvd.Sum, name=f"nonfinite_sum_{np.dtype(dtype).name}_{n}")
        avg = hvd.allreduce(x, op=hvd.Average, prescale_factor=4.0, name=f"nonfinite_avg_{np.dtype(dtype).name}_{n}")
        mx = hvd.allreduce(x, op=hvd.Max, name=f"nonfinite_max_{np.dtype(dtype).name}_{n}")
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got[:5], allreduce_expected(xs, 1)[:5])
        np.testing.assert_array_equal(avg[:5], allreduce_expected(xs, 0, prescale=4.0)[:5])
        np.testing.assert_array_equal(mx[:5], allreduce_expected(xs, 4)[:5])
