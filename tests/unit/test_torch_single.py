"""horovod.torch in one process: the device seam (mocked GPU), compression, pickling, np=1 identities."""

import pickle

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import horovod.torch as hvd  # noqa: E402
from horovod.torch import device  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod_alone():
    hvd.init()
    assert hvd.size() == 1
    yield
    hvd.shutdown()


class FakeStaging(device.HostStaging):
    """Records the seam's calls; 'device' tensors are CPU tensors marked by the test."""

    def __init__(self):
        self.calls = []

    def to_host(self, tensor):
        self.calls.append("to_host")
        return tensor.detach().clone()

    def to_device(self, host, like):
        self.calls.append("to_device")
        return host.clone()

    def copy_back(self, host, target):
        self.calls.append("copy_back")
        with torch.no_grad():
            target.copy_(host)


@pytest.fixture
def fake_gpu(monkeypatch):
    marked = set()
    staging = FakeStaging()
    monkeypatch.setattr(device, "staging", staging)
    monkeypatch.setattr(device, "on_host", lambda t: id(t) not in marked)
    return marked, staging


def test_device_tensors_are_staged_through_host(fake_gpu):
    marked, staging = fake_gpu
    x = torch.arange(4.0)
    marked.add(id(x))
    out = hvd.allreduce(x, op=hvd.Sum)
    assert torch.equal(out, x) and out is not x
    assert staging.calls == ["to_host", "to_device"]
    staging.calls.clear()
    y = torch.arange(3.0)
    marked.add(id(y))
    assert hvd.allreduce_(y) is y
    assert staging.calls == ["to_host", "copy_back"]


def test_device_backend_takes_over(fake_gpu):
    marked, staging = fake_gpu

    class Backend:
        def __init__(self):
            self.seen = []

        def supports(self, kind, tensors, process_set):
            return kind == "allreduce"

        def submit(self, kind, tensors, outputs, **kwargs):
            self.seen.append((kind, kwargs["op"]))

            class Done:
                def done(self):
                    return True

                def wait(self):
                    return [t * 10 for t in tensors]

            return Done()

    backend = Backend()
    previous = device.set_device_backend(backend)
    try:
        x = torch.ones(2)
        marked.add(id(x))
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((2,), 10.0))
        assert backend.seen == [("allreduce", hvd.Sum)] and staging.calls == []
        assert torch.equal(hvd.broadcast(x, 0), x)  # unsupported kind: staged
        assert staging.calls == ["to_host", "to_device"]
        cpu = torch.ones(2)
        assert torch.equal(hvd.allreduce(cpu, op=hvd.Sum), cpu)  # host tensors never go to the backend
        assert len(backend.seen) == 1
    finally:
        device.set_device_backend(previous)


def test_compression_roundtrip():
    x = torch.randn(5, dtype=torch.float64)
    for comp, wire in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        c, ctx = comp.compress(x)
        assert c.dtype == wire
        assert comp.decompress(c, ctx).dtype == torch.float64
    i = torch.arange(3)
    assert hvd.Compression.fp16.compress(i)[0] is i
    assert hvd.Compression.none.compress(x)[0] is x


def test_zero_copy_cpu_in_place():
    x = torch.arange(4.0)
    ptr = x.data_ptr()
    hvd.allreduce_(x)
    assert x.data_ptr() == ptr and torch.equal(x, torch.arange(4.0))
    b = torch.ones(3, dtype=torch.bfloat16)
    assert hvd.allreduce(b, op=hvd.Sum).dtype == torch.bfloat16


def test_optimizer_pickles_as_wrapped_optimizer():
    model = nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    again = pickle.loads(pickle.dumps(opt))
    assert type(again) is torch.optim.SGD and again.param_groups[0]["lr"] == 0.1
    assert "DistributedOptimizer(SGD" in repr(opt)


def _run(use_hvd: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if use_hvd:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.none)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()] + [
        t for s in opt.state_dict()["state"].values() for t in s.values()]


def test_np1_bit_identical_with_and_without_horovod():
    plain, distributed = _run(False), _run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, distributed))


def test_elastic_is_importable():
    assert all(hasattr(hvd.elastic, name) for name in ("run", "TorchState", "ElasticSampler"))


def test_torch_state_restores_the_commit_every_time():
    """restore() twice with no commit between (a second failure before the next commit): the optimizer's
    momentum is the committed one both times.  torch's Optimizer.load_state_dict keeps the tensors it is
    given, so restoring the snapshot itself made the momentum buffer the snapshot, and the steps after the
    first restore updated the commit in place."""
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()

    step()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    weight, buf = model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone()
    for _ in range(3):
        step()
        step()
        state.restore()
        assert torch.equal(model.weight.detach(), weight)
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], buf)


def test_synchronous_allgather_and_broadcast_never_wake_the_engine_thread(monkeypatch):
    """hvd.allgather/broadcast/broadcast_ wait at once: the caller runs the engine's round (and may poll for
    the answer) instead of waking the engine thread, as hvd.allreduce does."""
    import threading

    from horovod.common import basics

    engine = basics.engine()
    pokes, threads = [], []
    poke, original = engine.queue._poke, engine._round
    monkeypatch.setattr(engine.queue, "_poke", lambda: pokes.append(1) or poke())
    monkeypatch.setattr(engine, "_round", lambda *a, **k: threads.append(threading.current_thread().name) or
                        original(*a, **k))
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    for i in range(10):
        assert torch.equal(hvd.allgather(x, name=f"sync.g.{i}"), x)
        assert torch.equal(hvd.broadcast(x, 0, name=f"sync.b.{i}"), x)
        y = x.clone()
        assert hvd.broadcast_(y, 0, name=f"sync.b_.{i}") is y and torch.equal(y, x)
    assert threads and set(threads) == {threading.current_thread().name}
    assert not pokes
    # the gradients still flow (the differentiable forms)
    z = x.clone().requires_grad_()
    hvd.allgather(z, name="sync.grad").sum().backward()
    assert torch.equal(z.grad, torch.ones_like(x))


def test_sync_batch_norm_trains_only_once_initialized():
    """Before hvd.init() a training forward used this process's statistics without a word; upstream's
    "not initialized" error now. Inference needs no Horovod; size 1 is plain batch norm."""
    x = torch.randn(6, 3)
    bn, plain = hvd.SyncBatchNorm(3), nn.BatchNorm1d(3)
    hvd.shutdown()
    try:
        torch.testing.assert_close(bn.eval()(x), plain.eval()(x))
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd.init\(\).$"):
            bn.train()(x)
    finally:
        hvd.init()
    torch.testing.assert_close(bn.train()(x), plain.train()(x))


def test_sparse_allreduce_warns_nothing():
    """A sparse gradient's reduction builds its result with ``torch.sparse_coo_tensor``, which (torch >= 2.x) warns
    once per process that invariant checks are implicitly disabled, on every rank of a job training an
    ``nn.Embedding(sparse=True)``: a plain torch run of the same model warns nothing.  A fresh process, since
    torch warns only once."""
    import subprocess
    import sys

    code = ("import torch, horovod.torch as hvd\n"
            "hvd.init()\n"
            "t = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 4), (5, 4), check_invariants=True)\n"
            "out = hvd.sparse_allreduce_async(t, name='s', op=hvd.Average)()\n"
            "assert torch.equal(out.to_dense(), t.to_dense()), out\n")
    run = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Sparse invariant checks" not in run.stderr


def test_optimizer_check_names_count_from_the_latest_init():
    """An optimizer's parameter check is named after its creation ordinal since the process's latest init():
    an elastic survivor that re-creates its optimizer after a reset (a new init) names its check as a newcomer
    making its first optimizer does; counted over the process's life, it was 1 against the newcomer's 0 and
    the two checks never met."""
    def make():
        model = nn.Linear(3, 2)
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())

    first, second = make(), make()
    assert (first._parameters_check_name, second._parameters_check_name) == \
        ("parameters_of.optimizer.0", "parameters_of.optimizer.1")  # a GAN's two optimizers: their own names
    hvd.shutdown()
    hvd.init()
    assert make()._parameters_check_name == "parameters_of.optimizer.0"
