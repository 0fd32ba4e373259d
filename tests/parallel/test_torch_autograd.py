"""Gradients of the differentiable collectives against upstream's analytic formulas (any size).

Each rank computes ``loss = sum(op(x) * w_rank)`` with known per-rank weights ``w_rank``; the expected
``x.grad`` is written out from every rank's ``w`` in numpy-free torch arithmetic.
"""

import pytest
import torch

import horovod.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


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
