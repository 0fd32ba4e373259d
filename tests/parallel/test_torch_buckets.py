"""DistributedOptimizer's gradient buckets (small gradients reduced as one flat tensor), on every rank in lockstep.

The reference is computed on every rank without Horovod: each rank's data (allgathered as objects) through a
plain copy of the model, gradients averaged with torch over the ranks.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
import horovod.torch.optimizer as hvd_optimizer

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


class Mixed(nn.Module):
    """A 300 KiB weight (reduced alone), then small tensors (bucketed), one of them unused."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(300, 256)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(256, 16), nn.LayerNorm(16), nn.Linear(16, 256))
                                     for _ in range(3)])
        self.unused = nn.Linear(4, 4)
        self.out = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.big(x))
        for block in self.blocks:
            x = torch.tanh(block(x)) + x
        return self.out(x)


def data(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 300, generator=gen), torch.randn(5, 3, generator=gen)


def reference_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients averaged over every rank's data, computed here with a plain copy of ``model``."""
    total: dict[str, torch.Tensor] = {}
    for r in range(SIZE):
        ref = copy.deepcopy(model)
        x, y = data(r)
        F.mse_loss(ref(x), y).backward()
        for name, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            total[name] = total.get(name, 0) + g / SIZE
    return total


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(hvd_optimizer, "_BUCKET_BYTES", 8 * 1024)  # several buckets in this model


@pytest.mark.parametrize("bucket_bytes", [8 * 1024, None], ids=["several-buckets", "default"])
def test_bucketed_gradients_match_reference(monkeypatch, bucket_bytes):
    if bucket_bytes is not None:
        monkeypatch.setattr(hvd_optimizer, "_BUCKET_BYTES", bucket_bytes)
    torch.manual_seed(0)
    model = Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    bucketed = {n for n, p in model.named_parameters() if p in opt._bucket_of}
    assert "big.weight" not in bucketed and "out.bias" in bucketed and "unused.weight" in bucketed
    if bucket_bytes is not None:
        assert len(opt._buckets) > 2
    names = hvd.allgather_object([b.name for b in opt._buckets])
    assert all(n == names[0] for n in names)  # every rank builds the same buckets
    expected = reference_grads(model)
    for _ in range(2):
        opt.zero_grad()
        x, y = data(RANK)
        F.mse_loss(model(x), y).backward()
        # averaged when backward() returns, also those sharing a bucket with the unused parameter (zeros)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        opt.synchronize()
        assert torch.equal(model.unused.weight.grad, torch.zeros(4, 4))
        with opt.skip_synchronize():
            opt.step()
        expected = reference_grads(model)


def test_one_request_per_bucket(monkeypatch, small_buckets):
    torch.manual_seed(0)
    model = Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    names: list[str] = []
    real = hvd_optimizer.allreduce_async_

    def counting(tensor, *args, **kwargs):
        names.append(kwargs.get("name"))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(hvd_optimizer, "allreduce_async_", counting)
    x, y = data(RANK)
    alone = [n for n, p in model.named_parameters() if p not in opt._bucket_of]
    buckets = [b.name for b in opt._buckets]
    check = opt._parameters_check_name  # the optimizer's ordinal, not a parameter's name: the same on every rank
    assert check.startswith("parameters_of.optimizer.")
    for step in range(2):  # the first step also checks that every rank's buckets hold the same shapes, and
        names.clear()      # that every rank reduces the same parameters
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        layout_checks = [f"{b}.layout" for b in buckets] + [check] if step == 0 else []
        assert sorted(names) == sorted(buckets + alone + layout_checks)


@pytest.mark.parametrize(("groups", "op"), [(None, hvd.Average), (2, hvd.Average), (2, hvd.Sum)],
                         ids=["buckets", "groups", "groups-sum"])
def test_two_losses_backward_separately(small_buckets, groups, op):
    """Two heads, one backward each in one step: the second pass's gradients find their bucket (or group)
    already sent, with zeros, by the first pass's end and are reduced alone; the first pass's results stay as
    they were (a group completed by the second pass went out again whole: under Sum, its members reduced in
    the first pass were multiplied by the number of ranks)."""
    torch.manual_seed(0)
    model = Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=groups, op=op)
    x, y = data(RANK)
    F.mse_loss(model(x), y).backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters() if not n.startswith("unused.")}
    F.mse_loss(model.unused(x[:, :4]), y[:, :1].expand(-1, 4)).backward()
    opt.synchronize()
    scale = 1 / SIZE if op == hvd.Average else 1.0
    for r in range(SIZE):
        xr, yr = data(r)
        ref = copy.deepcopy(model.unused)
        F.mse_loss(ref(xr[:, :4]), yr[:, :1].expand(-1, 4)).backward()
        if r == 0:
            expected = [p.grad * scale for p in ref.parameters()]
        else:
            expected = [e + p.grad * scale for e, p in zip(expected, ref.parameters())]
    for e, p in zip(expected, model.unused.parameters()):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if name in first:
            assert torch.equal(p.grad, first[name]), name


def test_sparse_gradient_in_a_bucket_goes_alone():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 2)
    params = list(emb.parameters()) + list(lin.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=[("emb.weight", emb.weight), ("lin.weight", lin.weight),
                                                     ("lin.bias", lin.bias)])
    assert emb.weight in opt._bucket_of
    ids = torch.tensor([RANK % 10, (RANK + 3) % 10])
    lin(emb(ids)).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse
    w = (lin.weight + 0.1 * lin.weight.grad).detach()  # the weights before SGD's step
    expected = torch.zeros(10, 4)  # d sum(lin(emb(ids))) / d emb row = column sums of lin.weight, per lookup
    for r in range(SIZE):
        for i in (r % 10, (r + 3) % 10):
            expected[i] += w.sum(0) / SIZE
    torch.testing.assert_close(emb.weight.grad.to_dense(), expected, rtol=1e-5, atol=1e-6)


def test_one_bucket_per_dtype():
    torch.manual_seed(0)
    first, second = nn.Linear(6, 5), nn.Linear(5, 3).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1),
                                   named_parameters=[("a.w", first.weight), ("a.b", first.bias),
                                                     ("b.w", second.weight), ("b.b", second.bias)])
    assert sorted(str(b.flat.dtype) for b in opt._buckets) == ["torch.float32", "torch.float64"]
    expected_first = [torch.zeros_like(p) for p in first.parameters()]
    expected_second = [torch.zeros_like(p) for p in second.parameters()]
    for r in range(SIZE):
        ref1, ref2 = copy.deepcopy(first), copy.deepcopy(second)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(r))
        ref2(ref1(x).double()).sum().backward()
        for e, p in zip(expected_first + expected_second, list(ref1.parameters()) + list(ref2.parameters())):
            e += p.grad / SIZE
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(RANK))
    second(first(x).double()).sum().backward()
    for e, p in zip(expected_first + expected_second, list(first.parameters()) + list(second.parameters())):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("differ", ["width", "transposed"])
def test_models_that_differ_across_ranks_are_an_error_on_every_rank(differ):
    """Bucketed gradients are named by the first parameter: another width on one rank stalled until the stall
    timeout (the bucket's size was in its name), and shapes with the same number of elements were silently
    summed slot into the wrong slot. Both are upstream's shape mismatch error, on every rank, at once."""
    last = RANK == SIZE - 1
    if differ == "width":
        model = nn.Sequential(nn.Linear(4, 8 + last), nn.ReLU(), nn.Linear(8 + last, 1))
    else:
        model = nn.Module()
        model.w = nn.Parameter(torch.ones((3, 2) if last else (2, 3)))
        model.b = nn.Parameter(torch.ones(6))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert len(opt._buckets) == 1
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    # a HorovodInternalError, as the engine's own shape mismatch (upstream's torch error)
    expected = r"Mismatched ALLREDUCE tensor shapes: .* do not have the same shapes on every rank; this rank's: " \
               r"\[\[.*\]\] \(\d tensors\)"
    with pytest.raises(hvd.HorovodInternalError, match=expected):
        opt.synchronize()
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE  # the job goes on
