"""horovod.torch collectives against numpy, and their gradients, on every rank in lockstep (any size).

Every op × dtype × process set (global, and the even ranks added dynamically), and sync/async/in-place
variants for a few dtypes each.  Data are small integers, so sums and products are exact in every dtype,
bfloat16 included.  Gradients are checked against upstream's analytic formulas (see the autograd section).
"""

import copy
import time

import numpy as np
import pytest
import torch
from parallel_util import last_rank_short_text

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

hvd.init(process_sets="dynamic")
RANK, SIZE = hvd.rank(), hvd.size()
EVEN = hvd.add_process_set(list(range(0, SIZE, 2))) if SIZE > 1 else None
SETS = {"global": hvd.global_process_set, "even": EVEN or hvd.global_process_set}

REDUCE_DTYPES = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
MOVE_DTYPES = REDUCE_DTYPES + [torch.uint8, torch.int8, torch.int16, torch.bool]
OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}


def data(rank: int, shape, dtype: torch.dtype, low: int = -3, high: int = 4) -> torch.Tensor:
    """Deterministic per-rank values in [low, high) (non-negative for unsigned and bool)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if dtype in (torch.uint8, torch.bool):
        low = 0
    if dtype == torch.bool:
        high = 2
    return torch.randint(low, high, shape, generator=gen).to(dtype)


def members(ps) -> list[int]:
    return list(ps.ranks)


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def expected_reduce(ps, op, dtype, shape) -> np.ndarray:
    stack = np.stack([data(r, shape, dtype).to(torch.float64).numpy() for r in members(ps)])
    n = len(members(ps))
    if op == hvd.Sum:
        return stack.sum(0)
    if op == hvd.Average:
        total = stack.sum(0) / n
        return np.trunc(total) if not dtype.is_floating_point else total
    if op == hvd.Min:
        return stack.min(0)
    if op == hvd.Max:
        return stack.max(0)
    return stack.prod(0)


def tol(dtype):
    return {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)


@pytest.fixture
def nid(request):
    """Explicit names for collectives on a subset: unnamed ones would advance the auto-name counter on the
    members only, and the next unnamed global collective would get different names on different ranks."""
    return request.node.name


def skip_if_not_member(ps):
    if RANK not in ps.ranks:
        pytest.skip("not a member of this process set")


MODES = ["sync", "async", "inplace", "inplace_async"]
# every dtype × op synchronously; every mode for a few dtypes (the mode logic does not depend on the dtype)
ALLREDUCE_CASES = ([("sync", op, dt) for op in OPS for dt in REDUCE_DTYPES] +
                   [(m, op, dt) for m in MODES[1:] for op in ("sum", "average")
                    for dt in (torch.int32, torch.bfloat16, torch.float32)])


@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("mode,op_name,dtype", ALLREDUCE_CASES, ids=str)
def test_allreduce(set_name, mode, op_name, dtype, nid):
    ps, op = SETS[set_name], OPS[op_name]
    skip_if_not_member(ps)
    shape = (3, 5)
    x = data(RANK, shape, dtype)
    orig = x.clone()
    if mode == "sync":
        out = hvd.allreduce(x, op=op, process_set=ps, name=nid)
        assert torch.equal(x, orig), "out-of-place allreduce must not touch its input"
    elif mode == "async":
        out = hvd.synchronize(hvd.allreduce_async(x, op=op, process_set=ps, name=nid))
    elif mode == "inplace":
        out = hvd.allreduce_(x, op=op, process_set=ps, name=nid)
        assert out is x
    else:
        h = hvd.allreduce_async_(x, op=op, process_set=ps, name=nid)
        out = hvd.synchronize(h)
        assert out is x
    assert out.dtype == dtype and out.shape == shape
    np.testing.assert_allclose(as_np(out).astype(np.float64), expected_reduce(ps, op, dtype, shape),
                               rtol=tol(dtype), atol=tol(dtype))


@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_grouped_allreduce(set_name, inplace, dtype, nid):
    ps = SETS[set_name]
    skip_if_not_member(ps)
    shapes = [(4,), (2, 3), ()]
    xs = [data(RANK, s, dtype) for s in shapes]
    if inplace:
        outs = hvd.grouped_allreduce_(xs, op=hvd.Sum, process_set=ps, name=nid)
        assert all(o is x for o, x in zip(outs, xs))
    else:
        outs = hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum, process_set=ps, name=nid))
        assert isinstance(outs, tuple)
    for out, s in zip(outs, shapes):
        np.testing.assert_allclose(as_np(out), expected_reduce(ps, hvd.Sum, dtype, s), rtol=tol(dtype))


@pytest.mark.parametrize("set_name", list(SETS))
def test_grouped_allreduce_of_mixed_dtypes(set_name, nid):
    """Upstream's torch grouped allreduce takes tensors of different dtypes (each member keeps its own); it was
    refused with "Tensors in a grouped allreduce must all have the same dtype." (so was DistributedOptimizer's
    ``groups=`` on a model with parameters of several dtypes)."""
    ps = SETS[set_name]
    skip_if_not_member(ps)
    dtypes = [torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.float32]
    xs = [data(RANK, (3,), dtype) for dtype in dtypes]
    outs = hvd.synchronize(hvd.grouped_allreduce_async(xs, op=hvd.Sum, process_set=ps, name=nid))
    for out, dtype in zip(outs, dtypes):
        assert out.dtype == dtype
        np.testing.assert_allclose(as_np(out), expected_reduce(ps, hvd.Sum, dtype, (3,)), rtol=tol(dtype))


def test_prescale_postscale():
    x = torch.full((4,), float(RANK + 1))
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.allclose(out, torch.full((4,), float(sum(range(1, SIZE + 1)))))
    xi = torch.full((3,), 3, dtype=torch.int32)
    out = hvd.allreduce(xi, op=hvd.Sum, postscale_factor=0.5)  # integers scaled in float64, truncated
    assert torch.equal(out, torch.full((3,), int(3 * SIZE * 0.5), dtype=torch.int32))


@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("mode", ["sync", "async", "grouped"])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=str)
def test_allgather(set_name, mode, dtype, nid):
    ps = SETS[set_name]
    skip_if_not_member(ps)
    x = data(RANK, (RANK + 1, 2), dtype)  # different first dimension per rank
    if mode == "sync":
        out = hvd.allgather(x, process_set=ps, name=nid)
    elif mode == "async":
        out = hvd.synchronize(hvd.allgather_async(x, process_set=ps, name=nid))
    else:
        out, out2 = hvd.grouped_allgather([x, x[:, :1]], process_set=ps, name=nid)
        assert torch.equal(out2, out[:, :1])
    expected = torch.cat([data(r, (r + 1, 2), dtype) for r in members(ps)])
    assert out.dtype == dtype and torch.equal(out, expected)


@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("mode,dtype", [("sync", dt) for dt in MOVE_DTYPES] +
                         [(m, dt) for m in MODES[1:] for dt in (torch.bool, torch.float16, torch.int64)], ids=str)
def test_broadcast(set_name, mode, dtype, nid):
    ps = SETS[set_name]
    skip_if_not_member(ps)
    for root in members(ps):
        x = data(RANK, (2, 3), dtype)
        if mode == "sync":
            out = hvd.broadcast(x, root, process_set=ps, name=f"{nid}.{root}")
        elif mode == "async":
            out = hvd.synchronize(hvd.broadcast_async(x, root, process_set=ps, name=f"{nid}.{root}"))
        elif mode == "inplace":
            out = hvd.broadcast_(x, root, process_set=ps, name=f"{nid}.{root}")
            assert out is x
        else:
            out = hvd.synchronize(hvd.broadcast_async_(x, root, process_set=ps, name=f"{nid}.{root}"))
            assert out is x
        assert torch.equal(out, data(root, (2, 3), dtype))


@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("with_splits", [False, True])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=str)
def test_alltoall(set_name, with_splits, dtype, nid):
    ps = SETS[set_name]
    skip_if_not_member(ps)
    ranks = members(ps)
    n, me = len(ranks), ranks.index(RANK)

    def splits_of(i):  # rank at set position i sends j+i+1 rows... to member j
        return [j + i + 1 for j in range(n)] if with_splits else [2] * n

    def tensor_of(i):
        return data(ranks[i], (sum(splits_of(i)), 3), dtype)

    x = tensor_of(me)
    if with_splits:
        out, received = hvd.alltoall(x, splits=torch.tensor(splits_of(me), dtype=torch.int32), process_set=ps, name=nid)
        assert received.tolist() == [splits_of(i)[me] for i in range(n)]
    else:
        out = hvd.alltoall(x, process_set=ps, name=nid)
    parts = []
    for i in range(n):
        start = sum(splits_of(i)[:me])
        parts.append(tensor_of(i)[start:start + splits_of(i)[me]])
    assert torch.equal(out, torch.cat(parts))


def test_alltoall_async_returns_splits():
    out, received = hvd.synchronize(hvd.alltoall_async(torch.arange(2 * SIZE)))
    assert received.tolist() == [2] * SIZE
    assert out.tolist() == [v for r in range(SIZE) for v in (2 * RANK, 2 * RANK + 1)]


@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("op_name", ["sum", "average"])
@pytest.mark.parametrize("mode,dtype", [("sync", dt) for dt in REDUCE_DTYPES] +
                         [(m, torch.float32) for m in ("async", "grouped")], ids=str)
def test_reducescatter(set_name, op_name, mode, dtype, nid):
    ps, op = SETS[set_name], OPS[op_name]
    skip_if_not_member(ps)
    ranks = members(ps)
    n, me = len(ranks), ranks.index(RANK)
    shape = (2 * n + 1, 2)  # uneven: the first member gets one row more
    x = data(RANK, shape, dtype)
    if mode == "sync":
        out = hvd.reducescatter(x, op=op, process_set=ps, name=nid)
    elif mode == "async":
        out = hvd.synchronize(hvd.reducescatter_async(x, op=op, process_set=ps, name=nid))
    else:
        out = hvd.grouped_reducescatter([x], op=op, process_set=ps, name=nid)[0]
    rows = [shape[0] // n + (1 if j < shape[0] % n else 0) for j in range(n)]
    start = sum(rows[:me])
    expected = expected_reduce(ps, op, dtype, shape)[start:start + rows[me]]
    assert out.dtype == dtype
    np.testing.assert_allclose(as_np(out), expected, rtol=tol(dtype), atol=tol(dtype))


def test_poll_and_handles():
    h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="poll_me")
    out = hvd.synchronize(h)
    assert torch.equal(out, torch.full((3,), float(SIZE)))
    with pytest.raises(ValueError):
        hvd.poll(h)
    with pytest.raises(ValueError):
        hvd.synchronize(h)
    h2 = hvd.allreduce_async(torch.ones(1))
    assert h2 > h
    while not hvd.poll(h2):
        pass
    hvd.synchronize(h2)


def test_named_core_names_do_not_collide():
    a = hvd.allreduce_async(torch.ones(2), name="x", op=hvd.Sum)
    b = hvd.allgather_async(torch.ones(2), name="x")  # allreduce.x vs allgather.x
    assert hvd.synchronize(a).tolist() == [SIZE] * 2
    assert hvd.synchronize(b).shape == (2 * SIZE,)


def test_join_and_barrier():
    hvd.barrier()
    if RANK == SIZE - 1:
        last = hvd.join()
    else:
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="while_joined")
        assert out.tolist() == [SIZE - 1] * 2  # the joined rank contributes zeros
        last = hvd.join()
    assert len(set(hvd.allgather_object(last))) == 1
    hvd.barrier()


def test_sparse_allreduce():
    i = torch.tensor([[RANK], [0]])
    v = torch.tensor([float(RANK + 1)])
    sp = torch.sparse_coo_tensor(i, v, (SIZE, 2))
    out = hvd.sparse_allreduce_async(sp, name="sparse", op=hvd.Sum)().to_dense()
    assert out[:, 0].tolist() == [float(r + 1) for r in range(SIZE)]


def test_noncontiguous():
    x = torch.arange(12.0).reshape(3, 4).t()
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        hvd.allreduce_(x)
    with pytest.raises(ValueError, match="Tensor is required to be contiguous."):
        hvd.broadcast_async_(x, 0)
    out = hvd.allreduce(x, op=hvd.Sum)  # out-of-place: accepted (copied), unlike upstream
    assert torch.equal(out, x * SIZE)


def test_unsupported_types():
    with pytest.raises(ValueError, match=r"Tensor type torch.BoolTensor is not supported."):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="is not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="is not supported"):
        hvd.allgather(torch.ones(2, dtype=torch.complex64))


def test_argument_errors():
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="Number of entries in splits does not equal number of workers."):
        hvd.alltoall(torch.ones(4), splits=[1] * (SIZE + 1))
    with pytest.raises(ValueError, match="Sum of splits entries is greater than the first dimension"):
        hvd.alltoall(torch.ones(1), splits=[2] * SIZE)
    with pytest.raises(ValueError, match="invalid root rank"):
        hvd.broadcast(torch.ones(1), SIZE + 3)
    if EVEN is not None and RANK not in EVEN.ranks:
        with pytest.raises(ValueError, match=f"Allreduce: Rank {RANK} is not a member of the provided process set."):
            hvd.allreduce(torch.ones(1), process_set=EVEN)


def test_mismatched_shapes_fail_on_every_rank():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(HorovodInternalError, match="Mismatched"):
        hvd.allreduce(torch.ones(RANK + 1), name="mismatch")
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == SIZE  # the job goes on


def test_grouped_lists_of_different_lengths_fail_at_once_on_every_rank():
    """The last rank groups 2 tensors, the others 3: the names never matched and the job waited for the stall
    inspector (upstream: forever).  Every rank now gets the same error at once, and the job goes on."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    t0 = time.monotonic()
    with pytest.raises(HorovodInternalError) as info:
        hvd.grouped_allreduce([torch.ones(2)] * (3 - (RANK == SIZE - 1)), name="short", op=hvd.Sum)
    assert time.monotonic() - t0 < 15
    assert str(info.value) == last_rank_short_text("ALLREDUCE", "grouped_allreduce.short", SIZE)
    out = hvd.grouped_allreduce([torch.ones(2)] * 2, name="short", op=hvd.Sum)
    assert [t.tolist() for t in out] == [[SIZE, SIZE]] * 2


# ---------------------------------------------------------------------- autograd
# Each rank computes ``loss = sum(op(x) * w_rank)`` with known per-rank weights; the expected ``x.grad``
# follows upstream's gradient definitions.


def w_of(rank: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(77 + rank), dtype=torch.float64)


def x_of(rank: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(5 + rank),
                       dtype=torch.float64).requires_grad_()


def mean_w(shape) -> torch.Tensor:
    return sum(w_of(r, shape) for r in range(SIZE)) / SIZE


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_allreduce_grad(op):
    x = x_of(RANK, (3, 2))
    y = hvd.allreduce(x, op=op, prescale_factor=0.5, postscale_factor=3.0)
    (y * w_of(RANK, (3, 2))).sum().backward()
    total = sum(w_of(r, (3, 2)) for r in range(SIZE))
    expected = (total / SIZE if op == hvd.Average else total) * 0.5 * 3.0
    assert torch.allclose(x.grad, expected)


def test_allreduce_value_grad_with_compression():
    x = x_of(RANK, (4,)).float().detach().requires_grad_()
    y = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert y.dtype == torch.float32
    (y * w_of(RANK, (4,)).float()).sum().backward()
    assert torch.allclose(x.grad, mean_w((4,)).float(), atol=2e-3)


def test_grouped_allreduce_grad():
    xs = [x_of(RANK, (2,)), x_of(RANK + 10, (3, 1))]
    ys = hvd.grouped_allreduce(xs)
    (ys[0] * w_of(RANK, (2,))).sum().add((ys[1] * w_of(RANK, (3, 1))).sum()).backward()
    assert torch.allclose(xs[0].grad, mean_w((2,)))
    assert torch.allclose(xs[1].grad, mean_w((3, 1)))


def test_allgather_grad():
    rows = [r + 1 for r in range(SIZE)]
    x = x_of(RANK, (rows[RANK], 2))
    y = hvd.allgather(x)
    w = [w_of(r, (sum(rows), 2)) for r in range(SIZE)]
    (y * w[RANK]).sum().backward()
    start = sum(rows[:RANK])
    expected = (sum(w) / SIZE)[start:start + rows[RANK]]  # upstream: averaged, then this rank's rows
    assert torch.allclose(x.grad, expected)


def test_grouped_allgather_grad():
    x = x_of(RANK, (2, 2))
    (y,) = hvd.grouped_allgather([x])
    (y * w_of(RANK, (2 * SIZE, 2))).sum().backward()
    assert torch.allclose(x.grad, mean_w((2 * SIZE, 2))[2 * RANK:2 * RANK + 2])


@pytest.mark.parametrize("root", [0, SIZE - 1])
def test_broadcast_grad(root):
    x = x_of(RANK, (3,))
    y = hvd.broadcast(x, root)
    assert torch.allclose(y, x_of(root, (3,)))
    (y * w_of(RANK, (3,))).sum().backward()
    expected = mean_w((3,)) if RANK == root else torch.zeros(3, dtype=torch.float64)
    assert torch.allclose(x.grad, expected)


@pytest.mark.parametrize("with_splits", [False, True])
def test_alltoall_grad(with_splits):
    def splits_of(r):
        return [j + r + 1 for j in range(SIZE)] if with_splits else [1] * SIZE

    x = x_of(RANK, (sum(splits_of(RANK)), 2))
    if with_splits:
        y, received = hvd.alltoall(x, splits=splits_of(RANK))
    else:
        y = hvd.alltoall(x)
    recv = [splits_of(i)[RANK] for i in range(SIZE)]
    (y * w_of(RANK, (sum(recv), 2))).sum().backward()
    # rows x[block j] went to rank j, where they sit after the rows of ranks < RANK
    parts = []
    for j in range(SIZE):
        recv_j = [splits_of(i)[j] for i in range(SIZE)]
        start = sum(recv_j[:RANK])
        parts.append(w_of(j, (sum(recv_j), 2))[start:start + splits_of(RANK)[j]])
    assert torch.allclose(x.grad, torch.cat(parts))


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_reducescatter_grad(op):
    x = x_of(RANK, (2 * SIZE, 3))
    y = hvd.reducescatter(x, op=op, prescale_factor=2.0)
    (y * w_of(RANK, (2, 3))).sum().backward()
    gathered = torch.cat([w_of(r, (2, 3)) for r in range(SIZE)])
    expected = gathered * 2.0 * (SIZE if op == hvd.Sum else 1)  # upstream: ×size for Sum, ×factors
    assert torch.allclose(x.grad, expected)


def test_grouped_reducescatter_grad():
    x = x_of(RANK, (SIZE, 2))
    (y,) = hvd.grouped_reducescatter([x], op=hvd.Sum)
    (y * w_of(RANK, (1, 2))).sum().backward()
    assert torch.allclose(x.grad, torch.cat([w_of(r, (1, 2)) for r in range(SIZE)]) * SIZE)


# ---------------------------------------------------------------------- torch.compile
# A collective inside a compiled function is a graph break and runs eagerly (upstream's C++ op did the same).
# Before, Dynamo traced the engine's numpy code, which the waiting thread runs itself: the engine died
# ("Expected np.nditer base") and the job hung or shut down.  These come last: a failure there took the engine
# with it.  aot_eager: AOTAutograd as inductor uses it, without the C++ compile time.


def test_collectives_inside_torch_compile():
    root = SIZE - 1

    @torch.compile(backend="aot_eager")
    def step(x, w):
        total = hvd.allreduce(x * 2, op=hvd.Sum, name="compiled.sum")
        gathered = hvd.allgather(w + 1, name="compiled.gather")
        sent = hvd.broadcast(w - 1, root_rank=root, name="compiled.bcast")
        mean = hvd.synchronize(hvd.allreduce_async(w, name="compiled.async"))
        inplace = hvd.allreduce_(w.clone(), op=hvd.Max, name="compiled.inplace")
        return (total * w).sum(), gathered * 3, sent, mean, inplace

    ws = [data(r, (2, 3), torch.float64) for r in range(SIZE)]
    expected_total = sum(2 * x_of(r, (2, 3)).detach() for r in range(SIZE))
    for _ in range(2):  # the second call runs the cached graphs
        x = x_of(RANK, (2, 3))
        loss, gathered, sent, mean, inplace = step(x, ws[RANK])
        loss.backward()
        assert torch.allclose(loss, (expected_total * ws[RANK]).sum())
        np.testing.assert_array_equal(gathered.numpy(), 3 * np.concatenate([w.numpy() + 1 for w in ws]))
        np.testing.assert_array_equal(sent.numpy(), ws[root].numpy() - 1)
        np.testing.assert_allclose(mean.numpy(), np.mean([w.numpy() for w in ws], axis=0))
        np.testing.assert_array_equal(inplace.numpy(), np.max([w.numpy() for w in ws], axis=0))
        # d loss / dx: the Sum-allreduce of every rank's 2 * w
        np.testing.assert_allclose(x.grad.numpy(), 2 * sum(w.numpy() for w in ws))


def test_sync_batch_norm_model_under_torch_compile():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), hvd.SyncBatchNorm(6), torch.nn.ReLU(),
                                torch.nn.Linear(6, 2)).double()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")
    for _ in range(2):
        x = x_of(RANK, (5 + RANK, 4)).detach()  # batch sizes differ across ranks
        out, out_c = model(x), compiled(x)
        np.testing.assert_allclose(out_c.detach().numpy(), out.detach().numpy(), rtol=1e-10, atol=1e-12)
        (out * w_of(RANK, out.shape)).sum().backward()
        (out_c * w_of(RANK, out.shape)).sum().backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
        for b, c in zip(model.buffers(), twin.buffers()):
            np.testing.assert_allclose(c.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
