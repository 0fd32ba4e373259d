"""One handle contract for every framework (horovod/common/handles.py): ints from 1, ``poll`` never blocks,
``synchronize`` returns the result once -- a tuple for grouped handles, as upstream's torch -- and an unknown
or already synchronized handle is a ValueError; the synchronous grouped wrappers return lists."""

from __future__ import annotations

import os

import numpy as np
import pytest

from horovod.common.handles import Group, HandleMap

LAUNCHER_VARS = ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
                 "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="single-process tests (no launcher)")


class _Done:
    def __init__(self, value):
        self.value = value

    def done(self) -> bool:
        return True

    def wait(self):
        return self.value


def test_map_contract():
    handles = HandleMap()
    a, b = handles.add(_Done(1)), handles.add(Group([_Done(2), _Done(3)]))
    assert (a, b) == (1, 2)
    assert handles.poll(b) is True
    assert handles.synchronize(b) == (2, 3)
    for bad in (b, 99, None):
        with pytest.raises(ValueError, match="Unknown or already synchronized handle"):
            handles.synchronize(bad)
        with pytest.raises(ValueError, match="Unknown or already synchronized handle"):
            handles.poll(bad)
    handles.reset()
    assert handles.add(_Done(0)) == 1


class _FailedAtShutdown:
    def done(self) -> bool:
        return True

    def wait(self):
        raise RuntimeError("Horovod has been shut down")


def test_a_handle_pending_at_shutdown_says_why_it_failed():
    """Upstream's synchronize() of an operation that shutdown() ended raised the shut-down error; ours said
    "unknown handle" because the map forgot it.  Once its number is given out again it means the new one."""
    handles = HandleMap()
    a, b = handles.add(_Done(1)), handles.add(_FailedAtShutdown())
    handles.reset()  # shutdown()
    handles.reset()  # the next init()
    with pytest.raises(RuntimeError, match="shut down"):
        handles.synchronize(b)
    assert handles.add(_Done("new")) == a
    assert handles.synchronize(a) == "new"
    for bad in (a, b):
        with pytest.raises(ValueError, match="Unknown or already synchronized handle"):
            handles.synchronize(bad)


def _frameworks():
    import horovod.numpy as hnp

    yield pytest.param(hnp, np.asarray, id="numpy")
    try:
        import torch

        import horovod.torch as htorch
    except ImportError:
        yield pytest.param(None, None, id="torch", marks=pytest.mark.skip(reason="torch is not installed"))
        return
    yield pytest.param(htorch, torch.as_tensor, id="torch")


@pytest.fixture
def fresh(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("hvd,make", list(_frameworks()))
def test_every_framework_has_the_same_contract(fresh, hvd, make):
    hvd.init()
    try:
        xs = [make(np.arange(3, dtype=np.float32)), make(np.ones((2, 2), np.float32))]
        h = hvd.grouped_allreduce_async(xs, op=hvd.Sum)
        assert isinstance(h, int)
        out = hvd.synchronize(h)
        assert isinstance(out, tuple) and len(out) == 2
        for x, o in zip(xs, out):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(x))  # size 1: the sum is the input
        with pytest.raises(ValueError):
            hvd.synchronize(h)
        with pytest.raises(ValueError):
            hvd.poll(h)
        assert isinstance(hvd.grouped_allreduce(xs, op=hvd.Sum), list)
        assert isinstance(hvd.grouped_allgather(xs), list)
        single = hvd.allreduce_async(xs[0], op=hvd.Sum)
        while not hvd.poll(single):
            pass
        np.testing.assert_array_equal(np.asarray(hvd.synchronize(single)), np.asarray(xs[0]))
    finally:
        hvd.shutdown()
