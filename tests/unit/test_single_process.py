"""horovod.numpy in one process, without a launcher: size 1, every op, and the argument errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.base.exceptions import HorovodInternalError
from horovod.common import basics
from horovod.runtime.engine import DUPLICATE_NAME_MESSAGE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER_VARS = ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
                 "HOROVOD_CROSS_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
                 "HOROVOD_TIMELINE", "HOROVOD_DYNAMIC_PROCESS_SETS", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
SHUT_DOWN_PREFIX = "Horovod has been shut down. This was caused by an exception on one of the ranks"
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="single-process tests (no launcher)")

DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_]


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    hvd.init()
    yield
    # Leave the engine running for the next test unless a test shut it down.


@pytest.fixture(scope="module", autouse=True)
def _shutdown_at_end():
    yield
    hvd.shutdown()


def _data(dtype, shape=(3, 4), seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype)
    return (rng.standard_normal(shape) * 10).astype(dtype)


def test_size_one_layout():
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == \
        (0, 1, 0, 1, 0, 1)
    assert hvd.is_homogeneous()
    assert hvd.global_process_set.ranks == [0]
    assert hvd.global_process_set.process_set_id == 0
    assert basics._get_process_set_ids_and_ranks() == {0: [0]}


def test_init_is_idempotent():
    engine = basics.engine()
    hvd.init()
    assert basics.engine() is engine


def test_op_constants():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != np.bool_])
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_is_identity(dtype, op):
    x = _data(dtype)
    out = hvd.allreduce(x, op=op, name=f"ar.{np.dtype(dtype)}.{op}")
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_array_equal(out, x)
    assert out is not x


def test_allreduce_bool():
    x = _data(np.bool_)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum), x)


def test_allreduce_scaling_float():
    x = _data(np.float64)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    np.testing.assert_allclose(out, x * 0.5 * 3.0)


def test_allreduce_scaling_int_truncates():
    x = np.array([-7, 7, 5, -5, 1], np.int32)
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5)
    np.testing.assert_array_equal(out, np.trunc(x * 0.5).astype(np.int32))


def test_allreduce_scaling_fp16_in_fp32():
    x = _data(np.float16, (1000,))
    out = hvd.allreduce(x, op=hvd.Sum, postscale_factor=1 / 3)
    np.testing.assert_array_equal(out, (x.astype(np.float32) * np.float32(1 / 3)).astype(np.float16))


def test_allreduce_average_flag_backwards_compatibility():
    x = _data(np.float32)
    with pytest.warns(DeprecationWarning):
        np.testing.assert_array_equal(hvd.allreduce(x, average=False), x)
    with pytest.raises(ValueError, match="^The op parameter supersedes average. Please provide only one of them.$"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_allreduce_in_place():
    x = _data(np.float32)
    expected = x * 2.0
    out = hvd.allreduce_(x, op=hvd.Sum, postscale_factor=2.0)
    assert out is x
    np.testing.assert_array_equal(x, expected)
    h = hvd.allreduce_async_(x, op=hvd.Average)
    assert hvd.synchronize(h) is x


def test_allreduce_in_place_requires_contiguous():
    x = np.zeros((4, 4), np.float32)[:, 1]
    with pytest.raises(ValueError, match="^Tensor is required to be contiguous.$"):
        hvd.allreduce_(x)


def test_allreduce_non_contiguous_input():
    base = _data(np.float64, (6, 6))
    view = base[::2, 1::2]
    np.testing.assert_array_equal(hvd.allreduce(view, op=hvd.Sum), view)


def test_allreduce_async_poll_synchronize():
    x = _data(np.float32)
    h = hvd.allreduce_async(x, name="async.one", op=hvd.Sum)
    assert isinstance(h, int)
    np.testing.assert_array_equal(hvd.synchronize(h), x)


def test_grouped_allreduce():
    xs = [_data(np.float32, (3,), 1), _data(np.float32, (2, 2), 2), _data(np.float32, (), 3)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grp")
    assert isinstance(outs, list) and len(outs) == 3
    for x, o in zip(xs, outs):
        assert o.shape == x.shape
        np.testing.assert_array_equal(o, x)
    assert hvd.grouped_allreduce([]) == []
    h = hvd.grouped_allreduce_async(xs, op=hvd.Sum)
    assert hvd.poll(h) in (True, False)
    assert isinstance(hvd.synchronize(h), tuple)  # upstream's grouped handles (torch): a tuple


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(dtype):
    x = _data(dtype, (5, 2))
    out = hvd.allgather(x)
    np.testing.assert_array_equal(out, x)
    assert out.dtype == x.dtype
    outs = hvd.grouped_allgather([x, x[:1]])
    np.testing.assert_array_equal(outs[0], x)
    np.testing.assert_array_equal(outs[1], x[:1])


def test_allgather_empty_rows():
    x = np.zeros((0, 3), np.float32)
    assert hvd.allgather(x).shape == (0, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(dtype):
    x = _data(dtype)
    out = hvd.broadcast(x, 0)
    np.testing.assert_array_equal(out, x)
    y = x.copy()
    assert hvd.broadcast_(y, 0) is y
    np.testing.assert_array_equal(y, x)


def test_alltoall_without_and_with_splits():
    x = _data(np.int32, (6, 2))
    out = hvd.alltoall(x)
    np.testing.assert_array_equal(out, x)
    out, received = hvd.alltoall(x, splits=[4])
    np.testing.assert_array_equal(out, x[:4])
    np.testing.assert_array_equal(received, [4])
    out, received = hvd.alltoall(x, splits=np.array([0], np.int32))
    assert out.shape == (0, 2)
    np.testing.assert_array_equal(received, [0])


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_reducescatter(op):
    x = _data(np.float32, (5, 3))
    np.testing.assert_array_equal(hvd.reducescatter(x, op=op), x)
    outs = hvd.grouped_reducescatter([x, x * 2], op=op)
    np.testing.assert_array_equal(outs[1], x * 2)


def test_reducescatter_scaling_and_bad_op():
    x = _data(np.float64, (4,))
    np.testing.assert_allclose(hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), x * 0.5)
    with pytest.raises(ValueError, match="Reducescatter currently only supports AVERAGE and SUM."):
        hvd.reducescatter(x, op=hvd.Max)


def test_barrier_join_objects():
    assert hvd.barrier() is None
    assert hvd.join() == 0
    obj = {"a": [1, 2], "b": "x"}
    assert hvd.broadcast_object(obj, 0) == obj
    assert hvd.allgather_object(obj) == [obj]


def test_many_async_ops_then_synchronize():
    xs = [_data(np.float32, (i + 1,), i) for i in range(50)]
    handles = [hvd.allreduce_async(x, name=f"many.{i}", op=hvd.Sum) for i, x in enumerate(xs)]
    for h, x in zip(handles, xs):
        np.testing.assert_array_equal(hvd.synchronize(h), x)


def test_repeated_named_op():
    for i in range(20):
        x = np.full(3, float(i))
        np.testing.assert_array_equal(hvd.allreduce(x, name="repeated", op=hvd.Sum), x)


def test_concurrent_threads():
    errors = []

    def worker(t):
        try:
            for i in range(20):
                x = np.full(4, float(t * 100 + i))
                np.testing.assert_array_equal(hvd.allreduce(x, name=f"thread{t}.{i}", op=hvd.Sum), x)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("dtype", [np.complex64, np.uint32, np.uint64, np.object_])
def test_unsupported_dtype(dtype):
    x = np.zeros(3, dtype)
    with pytest.raises(ValueError, match=r"^Tensor type .* is not supported\.$"):
        hvd.allreduce(x)
    with pytest.raises(ValueError, match=r"^Tensor type .* is not supported\.$"):
        hvd.allgather(x)
    with pytest.raises(ValueError, match=r"^Tensor type .* is not supported\.$"):
        hvd.broadcast(x, 0)


def test_bad_alltoall_splits():
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"^alltoall expects a 1D splits tensor$"):
        hvd.alltoall(x, splits=[[4]])
    with pytest.raises(ValueError, match=r"^alltoall expects splits to contain 32-bit integer elements\.$"):
        hvd.alltoall(x, splits=np.array([4.0]))
    with pytest.raises(ValueError, match=r"^Number of entries in splits does not equal number of workers\.$"):
        hvd.alltoall(x, splits=[2, 2])
    with pytest.raises(ValueError, match=r"^Sum of splits entries is greater than the first dimension of tensor\.$"):
        hvd.alltoall(x, splits=[5])
    # the next op still works
    np.testing.assert_array_equal(hvd.alltoall(x), x)


def test_bad_alltoall_scalar_without_splits():
    with pytest.raises(ValueError, match=r"^splits not provided, but first dimension of tensor is not an even "
                                         r"multiple of the number of workers\.$"):
        hvd.alltoall(np.float32(3.0))


@pytest.mark.parametrize("root", [1, -1, 7])
def test_bad_root_rank(root):
    with pytest.raises(ValueError, match=rf"^broadcast received invalid root rank {root} for provided process set$"):
        hvd.broadcast(np.zeros(2), root)


@pytest.mark.parametrize("root", ["0", 0.0, None])
def test_root_rank_of_another_type(root):
    """A string or float root rank was reported as 'invalid root rank 0', which reads as a valid rank."""
    with pytest.raises(TypeError, match=rf"^broadcast's root_rank must be an int \(a global rank\), got "
                                        rf"{type(root).__name__} {re.escape(repr(root))}$"):
        hvd.broadcast(np.zeros(2), root)
    np.testing.assert_array_equal(hvd.broadcast(np.ones(2), np.int64(0)), np.ones(2))  # integers of any kind


def test_adasum_of_one_rank_is_its_own_tensor():
    x = np.array([1.5, -2.0, 0.25], np.float32)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Adasum), x)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.5), x)
    with pytest.raises(ValueError, match="Adasum reduction supports float16, float32 and float64 tensors"):
        hvd.allreduce(np.zeros(2, np.int64), op=hvd.Adasum)


def test_duplicate_name_in_flight(monkeypatch):
    engine = basics.engine()
    release = threading.Event()
    original = engine.executor.execute

    def held(resp):
        release.wait(10)
        return original(resp)

    monkeypatch.setattr(engine.executor, "execute", held)
    try:
        h = hvd.allreduce_async(np.ones(3), name="dup", op=hvd.Sum)
        with pytest.raises(ValueError) as info:
            hvd.allreduce_async(np.ones(3), name="dup", op=hvd.Sum)
        assert str(info.value) == DUPLICATE_NAME_MESSAGE
        assert str(info.value) == (
            "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that is "
            "currently being processed.  If you want to request another tensor, use a different tensor name.")
        with pytest.raises(ValueError):
            hvd.broadcast_async(np.ones(3), 0, name="dup")  # any op, same set: same name table
    finally:
        release.set()
    np.testing.assert_array_equal(hvd.synchronize(h), np.ones(3))
    np.testing.assert_array_equal(hvd.allreduce(np.ones(3), name="dup", op=hvd.Sum), np.ones(3))


def test_duplicate_name_inside_one_group():
    with pytest.raises(ValueError):
        basics.engine().enqueue([
            (_req("twice"), np.ones(2), None), (_req("twice"), np.ones(2), None)])
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), name="twice", op=hvd.Sum), np.ones(2))


def _req(name):
    from horovod.runtime.messages import Request, RequestType, dtype_code

    return Request(RequestType.ALLREDUCE, 0, name, dtype_code(np.float64), (2,), -1, 1)


def test_foreign_and_unknown_process_set():
    unregistered = hvd.ProcessSet([0])
    with pytest.raises(ValueError, match=r"^Allreduce: Process set provided does not exist, or has not been "
                                         r"registered\.$"):
        hvd.allreduce(np.zeros(1), process_set=unregistered)


def test_dynamic_process_sets_need_the_flag():
    with pytest.raises(ValueError, match=r"^Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after "
                                         r"Horovod initialization\.$"):
        hvd.add_process_set([0])


def test_dynamic_process_sets_for_that_init_only():
    """``init(process_sets="dynamic")`` enables them for that init, without exporting a variable (children and
    the next plain init() see no flag)."""
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    try:
        assert "HOROVOD_DYNAMIC_PROCESS_SETS" not in os.environ
        with pytest.raises(ValueError, match=r"^Attempted to add a duplicate process set"):  # past the flag
            hvd.add_process_set([0])  # at size 1 every set is the global one
    finally:
        hvd.shutdown()
    hvd.init()
    with pytest.raises(ValueError, match=r"^Set HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        hvd.add_process_set([0])


def test_unknown_handle():
    with pytest.raises(ValueError):
        hvd.synchronize(987654321)


def test_start_timeline_needs_the_env_var(tmp_path):
    with pytest.raises(ValueError, match=r"^Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage\.$"):
        hvd.start_timeline(str(tmp_path / "t.json"))


def test_mpi_threads_supported_without_mpi():
    with pytest.raises(ValueError, match="Horovod MPI is not enabled"):
        hvd.mpi_threads_supported()


# --------------------------------------------------------------------------------- shutdown / re-init (last)
def test_duplicate_static_process_set_at_init():
    hvd.shutdown()
    ps = hvd.ProcessSet([0])
    with pytest.raises(ValueError) as info:
        hvd.init(process_sets=[ps])
    assert str(info.value) == ("Horovod could not be initialized because process_sets entry number 0 is a "
                               "duplicate: ProcessSet(process_set_id=None, ranks=[0], mpi_comm=None)")


def test_enqueue_after_shutdown_fails_and_reinit_works():
    """After this process's own shutdown() a collective fails as before init() (upstream's horovod_shutdown
    clears initialization_done, so its ops fail CheckInitialized), not with the shut-down error, which is for
    a shutdown another rank caused (the flag stays set: test_faults)."""
    hvd.init()
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd.init\(\)\.$"):
        hvd.allreduce(np.ones(2))
    hvd.shutdown()  # safe twice
    hvd.init()
    assert hvd.is_initialized()
    np.testing.assert_array_equal(hvd.allreduce(np.ones(2), op=hvd.Sum), np.ones(2))


def test_layout_queries_after_shutdown_raise_like_upstream():
    """After shutdown() rank(), size()... answered from the stopped engine while is_initialized() was False;
    upstream raises its not-initialized ValueError (numpy and torch alike), and they answer again after init()."""
    queries = [hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
               hvd.is_homogeneous]
    try:
        import horovod.torch as hvd_torch
        queries += [hvd_torch.rank, hvd_torch.size, hvd_torch.local_rank, hvd_torch.local_size]
    except ImportError:
        pass
    hvd.init()
    hvd.shutdown()
    for query in queries:
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd\.init\(\)\.$"):
            query()
    hvd.init()
    assert [q() for q in queries[:6]] == [0, 1, 0, 1, 0, 1]


def test_pending_op_fails_with_shutdown_error(monkeypatch):
    engine = basics.engine()
    release = threading.Event()
    original = engine.executor.execute

    def held(resp):
        release.wait(2)
        return original(resp)

    monkeypatch.setattr(engine.executor, "execute", held)
    h = hvd.allreduce_async(np.ones(2), name="pending.at.shutdown")
    t = threading.Thread(target=hvd.shutdown)
    t.start()
    release.set()
    t.join(30)
    try:
        hvd.synchronize(h)
    except HorovodInternalError as e:
        assert str(e).startswith(SHUT_DOWN_PREFIX)
    hvd.init()


def test_before_init_errors_in_a_fresh_process():
    code = """
import numpy as np
import horovod.numpy as hvd
for fn in (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
           lambda: hvd.allreduce(np.ones(2)), lambda: hvd.allgather(np.ones(2)),
           lambda: hvd.broadcast(np.ones(2), 0), lambda: hvd.barrier(), lambda: hvd.join(),
           lambda: hvd.start_timeline("x"), hvd.stop_timeline):
    try:
        fn()
    except ValueError as e:
        print(str(e))
    else:
        print("no error")
print(hvd.is_initialized())
hvd.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:-1] == [NOT_INITIALIZED] * 13
    assert lines[-1] == "False"


def test_synchronous_collectives_run_their_round_in_the_calling_thread(monkeypatch):
    """hvd.allreduce/allgather/broadcast wait at once: the caller runs the engine's round (no thread hand-over,
    and it may poll for the answer) instead of waking the engine thread."""
    engine = basics.engine()
    threads = []
    original = engine._round

    def round_(*a, **k):
        threads.append(threading.current_thread().name)
        return original(*a, **k)

    pokes = []
    poke = engine.queue._poke
    monkeypatch.setattr(engine, "_round", round_)
    monkeypatch.setattr(engine.queue, "_poke", lambda: pokes.append(1) or poke())
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    for i in range(10):
        threads.clear()
        np.testing.assert_array_equal(hvd.allgather(x, name=f"sync.g.{i}"), x)
        np.testing.assert_array_equal(hvd.broadcast(x, 0, name=f"sync.b.{i}"), x)
        np.testing.assert_array_equal(hvd.allreduce(x, name=f"sync.r.{i}", op=hvd.Sum), x)
        assert threads and set(threads) == {threading.current_thread().name}
    assert not pokes  # the engine thread was never woken
