"""Sparse gradients under DistributedOptimizer, on every rank in lockstep (any size).

``nn.Embedding(sparse=True)`` produces sparse gradients.  With ``sparse_as_dense=True`` they are reduced
densely and handed back sparse (``SparseAdam`` refuses dense ones); with ``sparse_as_dense=False`` they are
reduced as sparse tensors (allgather of indices and values).  Either way training must equal a single
process that trains on the concatenation of every rank's batch, computed on every rank inside the test.
"""

import pytest
import torch
import torch.nn as nn

import horovod.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
VOCAB, DIM, ROWS, STEPS = 50, 4, 6, 4  # ROWS sequences of 3 token ids per rank and step


class Model(nn.Module):
    def __init__(self, dense_head: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.Linear(DIM, 1) if dense_head else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).sum(1)
        return self.head(h).squeeze(1) if self.head is not None else h.sum(1)


def global_batches():
    gen = torch.Generator().manual_seed(7)
    # Token ids drawn from a small range so that ranks touch overlapping rows.
    return [(torch.randint(0, VOCAB // 2, (ROWS * SIZE, 3), generator=gen),
             torch.randn(ROWS * SIZE, generator=gen)) for _ in range(STEPS)]


def mine(t: torch.Tensor) -> torch.Tensor:
    return t[RANK * ROWS:(RANK + 1) * ROWS]


def train(make_opt, *, distributed: bool, dense_head: bool = False, **kwargs) -> tuple[Model, list[bool]]:
    model = Model(dense_head)
    opt = make_opt(model)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)
    sparse_seen = []
    for ids, y in global_batches():
        if distributed:
            ids, y = mine(ids), mine(y)
        opt.zero_grad()
        ((model(ids) - y) ** 2).mean().backward()
        opt.step()
        sparse_seen.append(model.emb.weight.grad.is_sparse)
    return model, sparse_seen


def sparse_adam(model):
    return torch.optim.SparseAdam(list(model.parameters()), lr=0.05)


@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_sparse_adam_matches_single_process(sparse_as_dense):
    ref, ref_sparse = train(sparse_adam, distributed=False)
    model, seen = train(sparse_adam, distributed=True, sparse_as_dense=sparse_as_dense)
    assert all(ref_sparse) and all(seen), "the optimizer must receive sparse gradients"
    assert model.emb.weight.grad.sparse_dim() == 1
    torch.testing.assert_close(model.emb.weight, ref.emb.weight, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.emb.weight, Model(False).emb.weight)  # it trained


@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_sparse_and_dense_parameters_with_sgd(sparse_as_dense):
    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    ref, _ = train(sgd, distributed=False, dense_head=True)
    model, seen = train(sgd, distributed=True, dense_head=True, sparse_as_dense=sparse_as_dense)
    assert all(seen)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_sparse_as_dense_reduces_densely_in_a_group():
    """Sparse gradients inside explicit groups travel in the group's dense allreduce, and come back sparse."""
    ref, _ = train(sparse_adam, distributed=False)
    model, seen = train(sparse_adam, distributed=True, sparse_as_dense=True, groups=1)
    assert all(seen)
    torch.testing.assert_close(model.emb.weight, ref.emb.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_embedding_unused_on_one_rank_in_a_step(sparse_as_dense):
    """A dynamic forward: in step 1 rank 0 does not use the embedding (no gradient: zeros), the others do
    (sparse).  The embedding is small and shares a bucket with the head; the sparse gradients used to leave
    it to be reduced alone while rank 0 sent its zeros in the bucket: a stall.  Reference: one process,
    the ranks' losses averaged."""
    if SIZE == 1:
        pytest.skip("one rank reduces nothing")

    def losses(model, step, ids, y, ranks):
        out = []
        for r in ranks:
            rows = slice(r * ROWS, (r + 1) * ROWS)
            if r == 0 and step == 1:
                pred = model.head(torch.ones(ROWS, DIM)).squeeze(1)  # the embedding is not used
            else:
                pred = model(ids[rows])
            out.append(((pred - y[rows]) ** 2).mean())
        return out

    ref, model = Model(True), Model(True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
    for step, (ids, y) in enumerate(global_batches()):
        ref_opt.zero_grad()
        (sum(losses(ref, step, ids, y, range(SIZE))) / SIZE).backward()
        ref_opt.step()
        opt.zero_grad()
        losses(model, step, ids, y, [RANK])[0].backward()
        opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
