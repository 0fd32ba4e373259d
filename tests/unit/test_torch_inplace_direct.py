"""horovod.torch's direct in-place allreduce (dense contiguous CPU tensors) behaves as the general path: same
results, same tensor objects, same names and errors; everything else still takes the general path."""

import pytest

torch = pytest.importorskip("torch")

import horovod.torch as hvd  # noqa: E402
from horovod.common import basics  # noqa: E402
from horovod.torch import mpi_ops  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod_alone():
    hvd.init()
    assert hvd.size() == 1
    yield
    hvd.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64])
def test_direct_results_and_identity(dtype):
    t = torch.arange(12, dtype=dtype).reshape(3, 4)
    expected = t.clone()
    pending = mpi_ops._inplace_direct(t, None, "probe", None, 1.0, 1.0, hvd.global_process_set)
    assert pending is not None and pending.wait() is t  # this tensor takes the direct path
    assert hvd.allreduce_(t, name="sync", op=hvd.Sum) is t
    assert torch.equal(t, expected)
    h = hvd.allreduce_async_(t, name="async", op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5)
    assert hvd.poll(h) in (True, False)
    assert hvd.synchronize(h) is t
    assert torch.equal(t, expected)


def test_probe_left_in_flight_is_a_duplicate_name():
    t = torch.ones(2)
    # Holding the engine's round lock keeps "dup" in flight: on a busy host the engine thread could otherwise
    # finish it before the second enqueue (CI saw that once).
    with basics.engine()._drive:
        pending = mpi_ops._inplace_direct(t, None, "dup", None, 1.0, 1.0, hvd.global_process_set)
        with pytest.raises(ValueError, match="same name as another tensor"):
            hvd.allreduce_async_(torch.ones(2), name="dup")
    assert pending.wait() is t


@pytest.mark.parametrize("make", [
    lambda: torch.arange(8.0).reshape(2, 4).t(),                     # not contiguous: general path's error
    lambda: torch.ones(3, dtype=torch.bool),                         # not reducible: general path's error
])
def test_tensors_the_general_path_refuses(make):
    t = make()
    assert mpi_ops._inplace_direct(t, None, None, None, 1.0, 1.0, hvd.global_process_set) is None
    with pytest.raises(ValueError):
        hvd.allreduce_(t)


@pytest.mark.parametrize("make", [
    lambda: torch.ones(3, requires_grad=True),
    lambda: torch.nn.Parameter(torch.ones(3)),
    lambda: torch.ones(3, dtype=torch.bfloat16),
])
def test_other_tensors_take_the_general_path(make):
    t = make()
    assert mpi_ops._inplace_direct(t, None, None, None, 1.0, 1.0, hvd.global_process_set) is None
    with torch.no_grad():
        out = hvd.allreduce_(t, op=hvd.Sum)
    assert out is t and torch.equal(t.detach(), torch.ones(3, dtype=t.dtype))


def test_average_argument_still_warns():
    with pytest.warns(DeprecationWarning):
        hvd.allreduce_(torch.ones(2), average=True)
