"""DistributedOptimizer, broadcast helpers and SyncBatchNorm, on every rank in lockstep (any size).

Equivalence: each rank trains on its 1/size share of a batch; the single-process reference, computed on
every rank inside the test, trains on the whole batch.  The weights must agree.
"""

import contextlib
import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parallel_util import adasum_expected

import horovod.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
ROWS = 4  # per rank (and per micro-batch)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(steps: int, rows: int):
    gen = torch.Generator().manual_seed(42)
    return [(torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)) for _ in range(steps)]


def my_rows(t: torch.Tensor, passes: int, k: int) -> torch.Tensor:
    """Micro-batch ``k`` of this rank's share of the global batch."""
    share = t.shape[0] // SIZE
    mine = t[RANK * share:(RANK + 1) * share]
    m = share // passes
    return mine[k * m:(k + 1) * m]


def train(steps=3, passes=1, lr=0.1, momentum=0.9, ref_scale=1.0, **opt_kwargs):
    data = batch(steps, ROWS * SIZE * passes)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    for x, y in data:  # single process, whole batch
        ref_opt.zero_grad()
        (F.mse_loss(ref(x), y) * ref_scale).backward()
        ref_opt.step()
    model = make_model(seed=RANK)  # different start: broadcast_parameters must fix it
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   **opt_kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in data:
        opt.zero_grad()
        for k in range(passes):
            (F.mse_loss(model(my_rows(x, passes, k)), my_rows(y, passes, k)) / passes).backward()
        opt.step()
    return ref, model


def assert_same(ref, model, atol=1e-6):
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=atol), f"{name}: max diff {(a - b).abs().max().item()}"
    gathered = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    for other in gathered:  # bit-identical on every rank
        assert all(torch.equal(a, b) for a, b in zip(other, model.parameters()))


def test_equivalence_sgd_momentum():
    assert_same(*train())


def test_a_layer_unfrozen_after_wrapping_is_averaged():
    """Fine-tuning: the first layer is frozen when the optimizer is made and unfrozen after one step (its
    gradients were never averaged: the ranks drifted apart). Reference: one process, whole batches."""
    data = batch(3, ROWS * SIZE)
    models = [make_model(), make_model()]
    for model in models:
        model[0].requires_grad_(False)
    ref, model = models
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    for step, (x, y) in enumerate(data):
        if step == 1:
            ref[0].requires_grad_(True)
            model[0].requires_grad_(True)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(my_rows(x, 1, 0)), my_rows(y, 1, 0)).backward()
        opt.step()
    assert not torch.equal(model[0].weight, make_model()[0].weight)  # it did train
    assert_same(ref, model)


@pytest.mark.parametrize("how", ["buckets", "groups", "fp16", "synchronize"])
def test_a_layer_frozen_during_training_stays_frozen(how):
    """Every rank freezes a layer after two steps (``requires_grad_(False)``) and unfreezes everything three
    steps later.  The frozen layer got zero gradients, which the wrapped SGD's momentum and weight decay (Adam
    alike) kept applying: the "frozen" layer moved on, and the ranks' models left the single-process one.  A
    parameter that requires no gradient now is left alone, as the wrapped optimizer leaves a parameter without
    a gradient.  Reference: one process, whole batches, clipped as the upstream pattern clips."""
    data = batch(7, ROWS * SIZE)
    ref, model = make_model(), make_model()
    kwargs = {"buckets": {}, "groups": {"groups": [[model[0].weight, model[2].bias], [model[2].weight]]},
              "fp16": {"compression": hvd.Compression.fp16}, "synchronize": {}}[how]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
                                   named_parameters=model.named_parameters(), **kwargs)
    for step, (x, y) in enumerate(data):
        for m in (ref, model):
            if step == 2:
                m[0].requires_grad_(False)
            if step == 3:
                m[2].bias.requires_grad_(False)
            if step == 5:
                m.requires_grad_(True)
        if step == 2:
            frozen = model[0].weight.detach().clone()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(my_rows(x, 1, 0)), my_rows(y, 1, 0)).backward()
        if how == "synchronize":
            opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize() if how == "synchronize" else contextlib.nullcontext():
            opt.step()
        if step in (2, 3, 4):
            assert model[0].weight.grad is None and torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[0].weight, frozen)  # trained again once unfrozen
    assert_same(ref, model, atol=2e-3 if how == "fp16" else 1e-6)


def _gan(seed: int):
    torch.manual_seed(seed)
    return (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)),   # generator
            nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)))   # discriminator


@pytest.mark.parametrize("groups", [None, 1], ids=["buckets", "groups"])
def test_gan_two_optimizers_equal_a_single_process(groups):
    """A GAN: a generator's and a discriminator's DistributedOptimizer in one process.  Each checks once that
    every rank reduces the same parameters, under a name of its own (its creation ordinal: the two checks of
    the first generator pass, which reaches both models, are in flight together), and so are its groups (both
    optimizers' ``group.0`` were one name in flight twice: the duplicate-name error).  Generator and
    discriminator steps alternate; the weights equal one process's on the whole batches."""
    steps, rows = 3, ROWS * SIZE
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randn(rows, 4, generator=gen), torch.randn(rows, 6, generator=gen)) for _ in range(steps)]
    ones, zeros = torch.ones(rows, 1), torch.zeros(rows, 1)

    def run(G, D, og, od, mine):
        for z, real in data:
            og.zero_grad()  # generator first: its backward also reaches every discriminator parameter
            F.mse_loss(D(G(mine(z))), mine(ones)).backward()
            og.step()
            od.zero_grad()
            fake = G(mine(z)).detach()
            (F.mse_loss(D(mine(real)), mine(ones)) + F.mse_loss(D(fake), mine(zeros))).backward()
            od.step()

    ref_g, ref_d = _gan(0)
    run(ref_g, ref_d, torch.optim.SGD(ref_g.parameters(), lr=0.1, momentum=0.9),
        torch.optim.SGD(ref_d.parameters(), lr=0.1, momentum=0.9), lambda t: t)
    G, D = _gan(0)
    og = hvd.DistributedOptimizer(torch.optim.SGD(G.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=G.named_parameters(prefix="generator"), groups=groups)
    od = hvd.DistributedOptimizer(torch.optim.SGD(D.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=D.named_parameters(prefix="discriminator"), groups=groups)
    assert og._parameters_check_name != od._parameters_check_name
    run(G, D, og, od, lambda t: my_rows(t, 1, 0))
    assert not torch.equal(G[0].weight, _gan(0)[0][0].weight)  # it did train
    assert_same(ref_g, G)
    assert_same(ref_d, D)


def test_equivalence_backward_passes_per_step():
    assert_same(*train(passes=2))


@pytest.mark.parametrize("groups", [1, 2, "explicit"])
def test_equivalence_groups(groups):
    if groups == "explicit":
        ref, model = _train_with_explicit_groups()
    else:
        ref, model = train(groups=groups)
    assert_same(ref, model)


def _train_with_explicit_groups():
    data = batch(2, ROWS * SIZE)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    model = make_model()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), groups=[[params[0], params[3]], [params[1]]])
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(my_rows(x, 1, 0)), my_rows(y, 1, 0)).backward()
        opt.step()
    return ref, model


def test_groups_over_parameters_of_several_dtypes():
    """``groups=1`` puts every parameter in one grouped allreduce; a model holding float32 and float64
    parameters failed in backward with "Tensors in a grouped allreduce must all have the same dtype."."""
    ref, model = make_model(), make_model(seed=RANK)
    ref[2].double()
    model[2].double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in batch(2, ROWS * SIZE):
        ref_opt.zero_grad()
        F.mse_loss(ref[2](ref[1](ref[0](x)).double()), y.double()).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model[2](model[1](model[0](my_rows(x, 1, 0))).double()), my_rows(y, 1, 0).double()).backward()
        opt.step()
    assert_same(ref, model)


def test_num_groups_is_deprecated_alias():
    with pytest.warns(DeprecationWarning):
        assert_same(*train(steps=1, num_groups=2))


def test_equivalence_fp16_compression():
    assert_same(*train(compression=hvd.Compression.fp16), atol=2e-3)


def test_equivalence_bf16_compression():
    assert_same(*train(compression=hvd.Compression.bf16), atol=3e-2)


def test_equivalence_predivide_and_sum():
    assert_same(*train(gradient_predivide_factor=2.0), atol=1e-5)
    assert_same(*train(op=hvd.Sum, ref_scale=SIZE), atol=1e-5)  # Sum of means = SIZE x global mean


def test_unused_parameter_gets_zero_gradient():
    model = make_model()
    extra = nn.Parameter(torch.ones(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1))
    model(torch.ones(1, 6)).sum().backward()
    opt.step()
    assert extra.grad is not None and torch.equal(extra.grad, torch.zeros(2))


class Experts(nn.Module):
    """A dynamic forward: each rank routes through an expert of its own.  Expert 0 is one 360 KiB weight
    (reduced alone), expert 1 small tensors (bucketed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(6, 300)
        self.experts = nn.ModuleList([nn.Linear(300, 300, bias=False),
                                      nn.Sequential(nn.Linear(300, 8), nn.Linear(8, 300))])
        self.out = nn.Linear(300, 3)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.out(torch.tanh(self.experts[expert](torch.tanh(self.inp(x)))))


@pytest.mark.parametrize("groups", [None, 2], ids=["buckets", "groups"])
def test_parameters_used_on_some_ranks_only(groups):
    """Each rank uses another expert: every gradient is averaged when backward() returns, with zeros from the
    ranks that did not use it (as upstream's synchronize() and DDP's unused parameters).  Before, each rank
    waited at the end of backward() for an expert's gradient that the other started only in step()."""
    x, y = batch(1, ROWS * SIZE)[0]
    model = Experts()
    route = [r % 2 for r in range(SIZE)]
    expected: dict[str, torch.Tensor] = {}
    for r in range(SIZE):  # each rank's own gradients, plainly, then averaged
        ref = copy.deepcopy(model)
        F.mse_loss(ref(x[r * ROWS:(r + 1) * ROWS], route[r]), y[r * ROWS:(r + 1) * ROWS]).backward()
        for name, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            expected[name] = expected.get(name, 0) + g / SIZE
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=groups)
    for _ in range(2):  # and again: a second step finds every reduction's name free
        opt.zero_grad()
        F.mse_loss(model(my_rows(x, 1, 0), route[RANK]), my_rows(y, 1, 0)).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        with opt.skip_synchronize():
            opt.step()
        model.load_state_dict(Experts().state_dict())  # back to the start: the same gradients again


def test_frozen_parameter_listed_in_a_group_is_left_alone():
    """``groups=[all parameters]`` with one frozen: upstream keeps only what the optimizer trains; the frozen
    weight got a zero gradient and weight decay and momentum moved it."""
    model = make_model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
                                   named_parameters=model.named_parameters(), groups=[list(model.parameters())])
    for x, y in batch(2, ROWS * SIZE):
        opt.zero_grad()
        F.mse_loss(model(my_rows(x, 1, 0)), my_rows(y, 1, 0)).backward()
        opt.step()
    assert model[0].weight.grad is None and torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[2].weight, make_model()[2].weight)


def test_join_before_any_step_then_train():
    """Rank 1 has no batch in the first epoch and joins at once; the others step (their buckets' first
    reduction checks the layout, rank 1 adding zeros); in the next epoch every rank steps.  Rank 1's first
    reduction sent the layout check the others had done already: a stall.  Every rank now checks again after
    a join, and the weights match a plain run of the same batches."""
    if SIZE < 2:
        return
    data = batch(4, ROWS * SIZE)
    epochs = [data[:2], data[2:]]
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for epoch, batches in enumerate(epochs):  # epoch 0: every rank's rows but rank 1's; epoch 1: all
        rows = [r for r in range(SIZE) if epoch or r != 1]
        for x, y in batches:
            ref_opt.zero_grad()
            # joined ranks add zeros to the average over SIZE ranks
            sum(F.mse_loss(ref(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]) for r in rows).div(
                SIZE).backward()
            ref_opt.step()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for epoch, batches in enumerate(epochs):
        for x, y in batches if epoch or RANK != 1 else []:
            opt.zero_grad()
            F.mse_loss(model(my_rows(x, 1, 0)), my_rows(y, 1, 0)).backward()
            opt.step()
        hvd.join()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # rank 1 did not step: upstream's recipe
    assert_same(ref, model, atol=1e-6)


def test_torch_compile():
    data = batch(2, ROWS * SIZE)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    model = make_model()
    compiled = torch.compile(model, backend="aot_eager")  # inductor would spend the budget compiling C++
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(compiled(my_rows(x, 1, 0)), my_rows(y, 1, 0)).backward()
        opt.step()
    assert_same(ref, model, atol=1e-5)


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_autocast_bf16_with_grad_scaler(zero):
    """docs/torch.md's recipe; ``model.zero_grad()`` too, which the wrapper never sees: after the step the
    scaler skipped, the next backward found every pass counter spent (AssertionError) and now starts a step."""
    data = batch(3, ROWS * SIZE)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        for m, o, xs, ys in ((ref, ref_opt, x, y), (model, opt, my_rows(x, 1, 0), my_rows(y, 1, 0))):
            (o if zero == "optimizer" else m).zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(m(xs).float(), ys)
            if m is model and step == 1 and RANK == 0:
                loss = loss * float("inf")  # overflow on one rank: every rank must skip this step
            if m is model:
                before = [p.detach().clone() for p in model.parameters()]
                scaler.scale(loss).backward()
                scaler.step(opt)  # no synchronize()/skip_synchronize() needed
                scaler.update()
                if step == 1:
                    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            elif step != 1:
                loss.backward()
                o.step()
    scales = hvd.allgather_object(scaler.get_scale())
    assert len(set(scales)) == 1 and scales[0] < 2.0 ** 8
    assert_same(ref, model, atol=3e-2)


def test_clip_without_synchronize_and_upstream_pattern():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.full((2, 6), float(RANK))
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # already averaged when backward() returns
    gathered = hvd.allgather_object(grads)
    assert all(torch.equal(a, b) for g in gathered for a, b in zip(g, grads))
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match=r"optimizer.step\(\) called without optimizer.skip_synchronize\(\)"):
        opt.step()


def test_optimizer_looks_like_wrapped_one():
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = hvd.DistributedOptimizer(inner)
    assert isinstance(opt, torch.optim.Adam) and isinstance(opt, torch.optim.Optimizer)
    assert opt.__class__.__name__ == "Adam"
    assert opt.param_groups is inner.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 6)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert "state" in opt.state_dict()


def test_error_paths():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="named_parameters should be a sequence of tuples"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="Parameter names in named_parameters must be unique. Found duplicates: a"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("a", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="one or more model parameters were not named"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="groups must consist of torch.Tensor."):
        hvd.DistributedOptimizer(sgd, groups=[[1]])
    p = next(model.parameters())
    with pytest.raises(ValueError, match="A parameter can only appear once in groups."):
        hvd.DistributedOptimizer(sgd, groups=[[p], [p]])


def _per_rank_batches(steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank] -> (x, y)``: every rank's batch of every step, the same on every rank (seeded)."""
    return [[(torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * s + k)),
              torch.randn(5, 3, generator=torch.Generator().manual_seed(999 + 100 * s + k))) for k in range(SIZE)]
            for s in range(steps)]


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_adasum_combines_the_deltas_of_each_ranks_own_step(compression):
    """op=Adasum (upstream's delta optimizer): every rank steps its own optimizer (its own momentum) on its
    own gradient, and the parameters become start + Adasum(deltas).  Reference: every rank's step replayed
    here on copies, and the deltas combined with upstream's test reference."""
    if SIZE == 1:
        pytest.skip("a single rank takes the plain optimizer's path")
    data = _per_rank_batches(steps=3)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   compression=getattr(hvd.Compression, compression))
    with pytest.raises(AssertionError, match="Skipping synchronization is not supported"):
        with opt.skip_synchronize():
            pass
    replicas = [make_model() for _ in range(SIZE)]
    replica_opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in replicas]
    start = [p.detach().clone().double() for p in model.parameters()]
    for step in data:
        x, y = step[RANK]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        deltas = []
        for k, (replica, replica_opt) in enumerate(zip(replicas, replica_opts)):
            with torch.no_grad():
                for p, s in zip(replica.parameters(), start):
                    p.copy_(s)
            replica_opt.zero_grad()
            F.mse_loss(replica(step[k][0]), step[k][1]).backward()
            replica_opt.step()
            deltas.append([(p.detach().double() - s).numpy() for p, s in zip(replica.parameters(), start)])
        start = [s + torch.from_numpy(adasum_expected([d[i] for d in deltas])) for i, s in enumerate(start)]
    tol = 1e-5 if compression == "none" else 2e-3
    for p, s in zip(model.parameters(), start):
        torch.testing.assert_close(p.detach().double(), s, rtol=tol, atol=tol)
    weights = hvd.allgather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).unsqueeze(0))
    assert all(torch.equal(weights[0], w) for w in weights)
    F.mse_loss(model(data[0][RANK][0]), data[0][RANK][1]).backward()
    with pytest.raises(AssertionError, match="Gradients were computed more than backward_passes_per_step"):
        F.mse_loss(model(data[0][RANK][0]), data[0][RANK][1]).backward()
    opt.zero_grad()  # forgets the passes: a step after it trains normally


def test_adasum_a_layer_unfrozen_after_wrapping_is_combined():
    """op=Adasum and fine-tuning: the first layer is frozen when the optimizer is made and unfrozen after one
    step.  Each rank's optimizer stepped it on its own gradient but its delta was never reduced: the ranks'
    models silently drifted apart.  Reference: every rank's step replayed here, deltas combined with
    upstream's test reference."""
    if SIZE == 1:
        pytest.skip("a single rank takes the plain optimizer's path")
    data = _per_rank_batches(steps=3)
    model = make_model()
    model[0].requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    start = [p.detach().clone().double() for p in model.parameters()]
    replica = make_model()
    for s, step in enumerate(data):
        if s == 1:
            model[0].requires_grad_(True)
        replica[0].requires_grad_(s >= 1)
        x, y = step[RANK]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        deltas = []
        for k in range(SIZE):
            with torch.no_grad():
                for p, s0 in zip(replica.parameters(), start):
                    p.copy_(s0)
            replica.zero_grad()
            F.mse_loss(replica(step[k][0]), step[k][1]).backward()
            with torch.no_grad():
                deltas.append([(-0.1 * p.grad.double()).numpy() if p.grad is not None else np.zeros(p.shape)
                               for p in replica.parameters()])
        start = [s0 + torch.from_numpy(adasum_expected([d[i] for d in deltas])) for i, s0 in enumerate(start)]
    assert not torch.equal(model[0].weight, make_model()[0].weight)  # it did train
    for p, s0 in zip(model.parameters(), start):
        torch.testing.assert_close(p.detach().double(), s0, rtol=1e-5, atol=1e-5)
    weights = hvd.allgather(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).unsqueeze(0))
    assert all(torch.equal(weights[0], w) for w in weights)


def test_too_many_backward_passes_and_zero_grad():
    if SIZE == 1:
        pytest.skip("hooks are registered only with more than one rank")
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 6)).sum().backward()
    with pytest.raises(AssertionError, match="Gradients were computed more than backward_passes_per_step"):
        model(torch.ones(1, 6)).sum().backward()
    opt.zero_grad()  # nothing in flight: discards the gradients and the pass counters
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 6)).sum().backward()
    opt.step()
    pending = hvd.allreduce_async_(torch.ones(1), name="in_flight")
    opt._pending[next(model.parameters())] = type("R", (), {"done": False})()  # a reduction still writing
    with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
        opt.zero_grad()
    opt._pending.clear()
    hvd.synchronize(pending)


def test_broadcast_parameters_and_objects():
    model = make_model(seed=RANK)
    hvd.broadcast_parameters(model.state_dict(), root_rank=SIZE - 1)
    ref = make_model(seed=SIZE - 1)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    params = [torch.full((2,), float(RANK))]
    hvd.broadcast_parameters([("p", params[0])], root_rank=0)
    assert params[0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(model.parameters(), 0)
    assert hvd.broadcast_object({"r": RANK}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(RANK) == list(range(SIZE))


def test_broadcast_optimizer_state_between_other_optimizers_is_an_error_off_the_root():
    """Rank 0 built an Adam, the others an SGD (a careless script): the others loaded Adam's state and
    parameter groups into their SGD without a word.  They now raise, naming both; rank 0's state is untouched."""
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01) if RANK == 0 else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
    inner.step()
    before = copy.deepcopy(inner.state_dict())
    if RANK == 0:
        hvd.broadcast_optimizer_state(inner, root_rank=0)
    else:
        with pytest.raises(ValueError, match=r"broadcast_optimizer_state: rank 0's optimizer is a "
                                             r"torch\.optim\.adam\.Adam, this rank's \(rank \d\) a "
                                             r"torch\.optim\.sgd\.SGD: every rank must build the same optimizer"):
            hvd.broadcast_optimizer_state(inner, root_rank=0)
    after = inner.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after["state"][pid][key]), torch.as_tensor(value))


def test_broadcast_optimizer_state_leaves_root_untouched():
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01 if RANK == 0 else 0.5)
    if RANK == 0:  # only the root has state (a resumed checkpoint); the others are fresh
        for _ in range(2):
            adam.zero_grad()
            model(torch.ones(2, 6)).pow(2).sum().backward()
            adam.step()
    before = copy.deepcopy(adam.state_dict())
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    after = adam.state_dict()
    root = hvd.broadcast_object(before, root_rank=0)
    assert after["param_groups"][0]["lr"] == 0.01
    for pid, state in root["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    if RANK == 0:  # bit-identical, nothing stepped
        for pid, state in before["state"].items():
            assert all(torch.equal(after["state"][pid][k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="cannot broadcast torch.optim.LBFGS state"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)


@pytest.mark.parametrize("dims", [2, 4])
def test_sync_batch_norm_equals_global_batch_norm(dims):
    shape = (2 * SIZE, 3) if dims == 2 else (2 * SIZE, 3, 4, 2)
    gen = torch.Generator().manual_seed(3)
    x_full = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 1
    w_full = torch.randn(shape, generator=gen, dtype=torch.float64)
    bn = nn.BatchNorm1d(3) if dims == 2 else nn.BatchNorm2d(3)
    sbn = hvd.SyncBatchNorm(3)
    bn, sbn = bn.double(), sbn.double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=gen)
        bn.bias.uniform_(-1, 1, generator=gen)
        sbn.weight.copy_(bn.weight)
        sbn.bias.copy_(bn.bias)
    xr = x_full.clone().requires_grad_()
    (bn(xr) * w_full).sum().backward()
    mine = slice(2 * RANK, 2 * RANK + 2)
    x = x_full[mine].clone().requires_grad_()
    out = sbn(x)
    (out * w_full[mine]).sum().backward()
    with torch.no_grad():
        bn_out = nn.functional.batch_norm(x_full, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    assert torch.allclose(out, bn_out[mine], atol=1e-10)
    assert torch.allclose(x.grad, xr.grad[mine], atol=1e-10)
    wgrad = hvd.allreduce(sbn.weight.grad, op=hvd.Sum)
    assert torch.allclose(wgrad, bn.weight.grad, atol=1e-10)
    assert torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-12)
    assert torch.allclose(sbn.running_var, bn.running_var, atol=1e-12)
    sbn.eval()
    assert torch.allclose(sbn(x), bn.eval()(x_full)[mine])


def test_sync_batch_norm_uneven_batches_and_errors():
    sbn = hvd.SyncBatchNorm(2)
    x = torch.randn(RANK + 1, 2, generator=torch.Generator().manual_seed(RANK), dtype=torch.float64)
    out = sbn.double()(x)
    full = torch.cat([torch.randn(r + 1, 2, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
                      for r in range(SIZE)])
    expected = (full - full.mean(0)) / torch.sqrt(full.var(0, unbiased=False) + sbn.eps)
    start = sum(range(1, RANK + 1))
    assert torch.allclose(out, expected[start:start + RANK + 1], atol=1e-10)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        sbn(torch.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.barrier()
