"""Cross-memory copies (horovod.transport.cma) and the member-to-member allreduce built on them.

The copies are checked against numpy slicing in one process; the allreduce runs in real processes
(transport_harness): plain arrays member to member, a member holding Pieces (every member then goes through the
segments), a member that refuses, and a member that lies about where its buffer is.
"""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
from transport_harness import Ctx, run_ranks

from horovod.transport.buffers import Pieces
from horovod.transport.cma import cross_memory
from horovod.transport.communicator import ReduceOp

pytestmark = pytest.mark.skipif(cross_memory() is None, reason="libc without process_vm_readv")


def _ranges(parts: list[np.ndarray], lo: int, hi: int) -> list[tuple[int, int]]:
    """(address, length) of bytes [lo, hi) of the parts' concatenation."""
    out, at = [], 0
    for p in parts:
        a, b = max(lo, at), min(hi, at + p.nbytes)
        if b > a:
            out.append((p.__array_interface__["data"][0] + a - at, b - a))
        at += p.nbytes
    return out


def test_copies_between_ranges_in_this_process():
    cma = cross_memory()
    rng = np.random.default_rng(1)
    flat = rng.standard_normal(5000).astype(np.float32)
    src = np.split(flat.copy(), [3, 700, 701, 2500, 4999])
    dst = [np.zeros(len(p), np.float32) for p in np.split(flat, [1000, 1001, 3333])]
    cma.read(os.getpid(), _ranges(dst, 400, 16000), _ranges(src, 400, 16000))
    want = np.zeros(5000, np.float32)
    want[100:4000] = flat[100:4000]
    np.testing.assert_array_equal(np.concatenate(dst), want)
    cma.write(os.getpid(), _ranges(src, 0, 20000), _ranges(dst, 0, 20000))
    np.testing.assert_array_equal(np.concatenate(dst), flat)


def test_copy_failures_raise():
    cma = cross_memory()
    buf = np.zeros(16, np.uint8)
    with pytest.raises(OSError) as bad_address:
        cma.read(os.getpid(), [(buf.ctypes.data, 16)], [(16, 16)])
    assert bad_address.value.errno == errno.EFAULT
    pid = os.fork()
    if not pid:
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(OSError) as gone:
        cma.read(pid, [(buf.ctypes.data, 16)], [(buf.ctypes.data, 16)])
    assert gone.value.errno == errno.ESRCH
    with pytest.raises(ValueError, match="different"):
        cma.read(os.getpid(), [(buf.ctypes.data, 8)], [(buf.ctypes.data, 16)])


def test_common_ancestor_of_siblings_is_their_parent(tmp_path):
    from horovod.transport.cma import common_ancestor

    hold_r, hold_w = os.pipe()  # the children live until both have answered (a reaped sibling has no ancestry)
    children = []
    for _ in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if not pid:
            os.close(w)
            os.close(hold_w)
            sibling = int(os.read(r, 32))
            (tmp_path / str(os.getpid())).write_text(str(common_ancestor([sibling])))
            os.read(hold_r, 1)
            os._exit(0)
        os.close(r)
        children.append((pid, w))
    os.close(hold_r)
    for (_, w), (other, _) in zip(children, reversed(children)):
        os.write(w, str(other).encode())
        os.close(w)
    deadline = time.monotonic() + 10
    while not all((tmp_path / str(pid)).exists() for pid, _ in children) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.close(hold_w)
    for pid, _ in children:
        os.waitpid(pid, 0)
    assert [(tmp_path / str(pid)).read_text() for pid, _ in children] == [str(os.getpid())] * 2


_ANCESTOR_JOB = """
import json, os, sys
import numpy as np
import horovod.numpy as hvd
from horovod.transport.cma import common_ancestor

hvd.init()
pids = hvd.allgather(np.array([os.getpid()]), name="pids").tolist()
ancestor = common_ancestor([p for p in pids if p != os.getpid()])
with open(f"/proc/{ancestor}/cmdline", "rb") as f:
    cmdline = f.read().decode().split("\\0")
json.dump({"ancestor": ancestor, "parent": os.getppid(), "cmdline": cmdline},
          open(os.path.join(sys.argv[1], f"{hvd.rank()}.json"), "w"))
"""


def test_ranks_under_horovodrun_name_the_launcher(tmp_path):
    """Each rank has its own watchdog as parent; the process the ranks share is the launcher, which is what a
    rank names as allowed tracer under Yama's ptrace_scope 1."""
    import json
    import sys

    from launch_util import launch

    script = tmp_path / "job.py"
    script.write_text(_ANCESTOR_JOB)
    code, out, _ = launch(3, [sys.executable, str(script), str(tmp_path)], timeout=120)
    assert code == 0, out
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert len({rep["ancestor"] for rep in reports}) == 1, reports
    for rep in reports:
        assert rep["ancestor"] != rep["parent"] and "horovod.runner" in rep["cmdline"], rep


# -- the member-to-member allreduce, in real processes ------------------------------------------------------

def _comm(ctx: Ctx, **kwargs):
    from horovod.transport.shm import ShmCommunicator

    comm = ShmCommunicator(ctx.mesh, list(range(ctx.size)), ctx.config, **kwargs)
    comm._ready()
    return comm


def _plain_and_pieces(ctx: Ctx) -> dict:
    """Plain arrays in place and not (member to member), then one member holding Pieces or a strided view (all
    through the segments); Average's scale."""
    comm = _comm(ctx, direct_min_bytes=1, direct_chunk_bytes=1000, cross_memory=True)
    calls = []
    real = comm._allreduce_direct
    comm._allreduce_direct = lambda *a: calls.append(1) or real(*a)
    n = 20_000
    inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(ctx.size)]
    avg = np.full(n, np.nan, np.float32)
    comm.allreduce_scaled(inputs[ctx.rank].copy(), avg, ReduceOp.SUM, 1 / ctx.size)
    in_place = inputs[ctx.rank].copy()
    comm.allreduce_scaled(in_place, in_place, ReduceOp.MAX, 1.0)
    direct_calls = len(calls)
    mixed = np.full(n, np.nan, np.float32)
    mine = inputs[ctx.rank].copy()
    comm.allreduce_scaled(Pieces(np.split(mine, [7, 5000])) if ctx.rank == 1 else mine, mixed, ReduceOp.SUM, 1.0)
    # a strided input on one member: every member through the segments too (allreduce and allgather)
    strided = np.full(n, np.nan, np.float32)
    mine = np.repeat(inputs[ctx.rank], 2)[::2] if ctx.rank == 0 else inputs[ctx.rank].copy()
    comm.allreduce_scaled(mine, strided, ReduceOp.SUM, 1.0)
    gathered = np.full(n * ctx.size, np.nan, np.float32)
    comm.allgatherv(mine, gathered, [n] * ctx.size)
    return {"direct": comm._cma is not None and direct_calls == 2 and len(calls) == 2, "avg": avg,
            "max": in_place, "sum": mixed, "strided": strided, "gathered": gathered, "inputs": inputs}


@pytest.mark.parametrize("size", [2, 3])
def test_member_to_member_and_a_member_with_pieces(size):
    res = run_ranks(size, _plain_and_pieces, timeout=60)
    inputs = res[0][1]["inputs"]
    total = inputs[0].copy()
    for x in inputs[1:]:
        total = total + x
    for r in range(size):
        status, got, _ = res[r]
        assert status == "ok" and got["direct"]
        np.testing.assert_allclose(got["avg"], total * np.float32(1 / size), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["max"], np.max(inputs, axis=0))
        np.testing.assert_allclose(got["sum"], total, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["strided"], total, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["gathered"], np.concatenate(inputs))
        for key in ("avg", "sum", "strided"):
            assert got[key].tobytes() == res[0][1][key].tobytes(), "members got different bits"


def _one_refuses(ctx: Ctx) -> tuple[bool, bool]:
    import dataclasses

    from horovod.base.config import read_runtime_config
    from horovod.transport.shm import ShmCommunicator

    if ctx.rank == 1:  # this member's environment says HOROVOD_SHM_CROSS_MEMORY=0
        off = read_runtime_config({"HOROVOD_SHM_CROSS_MEMORY": "0"}).shm_cross_memory
        config = dataclasses.replace(ctx.config, shm_cross_memory=off)
    else:
        config = ctx.config
    comm = ShmCommunicator(ctx.mesh, list(range(ctx.size)), config, direct_min_bytes=1)
    x = np.full(100_000, ctx.rank + 1.0, np.float32)
    comm.allreduce(x, x, ReduceOp.SUM)
    return comm._cma is None, bool((x == ctx.size * (ctx.size + 1) / 2).all())


def test_one_member_refusing_keeps_every_member_on_the_segments():
    res = run_ranks(3, _one_refuses, timeout=60)
    assert [res[r][1] for r in range(3)] == [(True, True)] * 3


def _liar(ctx: Ctx) -> tuple[str, int, float]:
    from horovod.transport import shm
    from horovod.transport.communicator import PeerFailure

    comm = _comm(ctx, direct_min_bytes=1)
    if ctx.rank == 1:  # says its buffers are at address 4096, which it has not mapped
        shm._address = lambda arr: 4096
    t0 = time.monotonic()
    try:
        x = np.ones(100_000, np.float32)
        comm.allreduce(x, x, ReduceOp.SUM)
    except PeerFailure as e:
        return e.reason, e.peer, time.monotonic() - t0
    return "no error", -1, 0.0


def test_a_member_lying_about_its_buffer_is_named():
    res = run_ranks(2, _liar, op_timeout=2.0, timeout=60)
    reason, peer, took = res[0][1]
    assert peer == 1 and "cross-memory copy failed" in reason and took < 1.0, res[0][1]
    reason, peer, took = res[1][1]  # the liar itself learns the job failed, within the deadline
    assert peer == 0 and took < 3.0, res[1][1]


def _large(ctx: Ctx) -> dict:
    """A realistic size with the default chunking: 32 MB in place, Average's scale; a 12 MB broadcast."""
    comm = _comm(ctx)
    n = 8 << 20
    x = np.random.default_rng(ctx.rank).standard_normal(n).astype(np.float32)
    comm.allreduce_scaled(x, x, ReduceOp.SUM, 1 / ctx.size)
    b = np.arange(3 << 20, dtype=np.float32) if ctx.rank == 1 else np.zeros(3 << 20, np.float32)
    comm.broadcast(b, 1)
    return {"direct": comm._cma is not None, "avg": x, "bcast_ok": bool(np.array_equal(b, np.arange(3 << 20)))}


def test_member_to_member_at_a_realistic_size_on_four_ranks():
    res = run_ranks(4, _large, timeout=120)
    total = sum(np.random.default_rng(r).standard_normal(8 << 20).astype(np.float32) for r in range(4))
    for r in range(4):
        status, got, _ = res[r]
        assert status == "ok" and got["direct"] and got["bcast_ok"]
        np.testing.assert_allclose(got["avg"], total / 4, rtol=1e-4, atol=1e-5)
        assert got["avg"].tobytes() == res[0][1]["avg"].tobytes(), "members got different bits"
