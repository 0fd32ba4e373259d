"""Every collective x dtype x backend x group size, against numpy, in real processes.

Chunk and piece sizes are injected tiny so that small tensors cross every piece and region boundary.
Inputs are small integers (exact in every dtype, incl. float16/bfloat16), so the expected values computed
here independently are exact; a random float32 allreduce checks that all members get identical bits.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import signal
import time

import numpy as np
import pytest
from transport_harness import Ctx, run_ranks

from horovod.transport import buffers
from horovod.transport.buffers import Pieces
from horovod.transport.communicator import ReduceOp

HAVE_BF16 = importlib.util.find_spec("ml_dtypes") is not None  # in the `test` extra; optional otherwise
DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool"] + \
    (["bfloat16"] if HAVE_BF16 else [])
SIZES = [0, 1, 7, 33, 100, 1001]
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _input(rank: int, n: int, dt: np.dtype, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 7 * n + salt)
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    return rng.integers(0, 4, n).astype(dt)


def _reduce(op: ReduceOp, arrays: list[np.ndarray]) -> np.ndarray:
    bool_ = arrays[0].dtype == np.bool_
    f = {ReduceOp.SUM: np.logical_or if bool_ else np.add, ReduceOp.MIN: np.logical_and if bool_ else np.minimum,
         ReduceOp.MAX: np.logical_or if bool_ else np.maximum,
         ReduceOp.PRODUCT: np.logical_and if bool_ else np.multiply}[op]
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = f(acc, a).astype(acc.dtype)
    return acc


def _scaled(acc: np.ndarray, scale: float) -> np.ndarray:
    """Upstream's postscale rules, written out: integers in float64 truncated toward zero, 16-bit floats in
    float32, other floats in their own precision, bool untouched."""
    if acc.dtype == np.bool_:
        return acc
    if acc.dtype.kind in "iu":
        return np.trunc(acc.astype(np.float64) * scale).astype(acc.dtype)
    if acc.dtype.itemsize == 2:
        return (acc.astype(np.float32) * np.float32(scale)).astype(acc.dtype)
    return acc * acc.dtype.type(scale)


def _make(ctx: Ctx, backend: str, ranks: list[int]):
    from horovod.transport.hierarchical import HierarchicalCommunicator
    from horovod.transport.shm import ShmCommunicator
    from horovod.transport.tcp import TcpCommunicator

    if backend == "shm":  # through the segments, as where the kernel refuses cross-memory copies
        return ShmCommunicator(ctx.mesh, ranks, ctx.config, piece_bytes=256, small_bytes=0, cross_memory=False)
    if backend == "shm-direct":  # member to member, chunks of 3 float32 / 12 uint8 cross every part boundary
        comm = ShmCommunicator(ctx.mesh, ranks, ctx.config, piece_bytes=256, small_bytes=0, cross_memory=True,
                               direct_min_bytes=1, direct_chunk_bytes=12)
        comm._ready()
        assert comm._cma is not None, "this host refused cross-memory copies"
        return comm
    if backend == "shm-default":
        return ShmCommunicator(ctx.mesh, ranks, ctx.config)
    if backend == "shm-poll":  # members poll for tokens whatever the host's cores (off by default at np > cores)
        from horovod.base.cores import Spin

        comm = ShmCommunicator(ctx.mesh, ranks, ctx.config, piece_bytes=256, small_bytes=0)
        comm._spin = Spin(200e-6)
        return comm
    if backend == "tcp":
        return TcpCommunicator(ctx.mesh, ranks, ctx.config, small_bytes=64, piece_bytes=40)
    if backend == "hierarchical":
        return HierarchicalCommunicator(ctx.mesh, ranks, ctx.config, small_bytes=0, piece_bytes=256)
    raise AssertionError(backend)


def _check_all(ctx: Ctx) -> list[str]:
    """Run every collective; return a list of mismatch descriptions (empty = all good)."""
    backend, ranks = ctx.args
    if ctx.rank not in ranks:
        return []
    comm = _make(ctx, backend, ranks)
    me, size = comm.rank, comm.size
    buffers.MERGE_BELOW = 2  # Pieces keep even their smallest parts apart: many segments per piece
    bad: list[str] = []

    def expect(name: str, got: np.ndarray, want: np.ndarray) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            bad.append(f"{name}: got {got[:8]!r} want {want[:8]!r}")

    for dname in DTYPES:
        dt = _dtype(dname)
        for n in SIZES:
            ins = [_input(r, n, dt) for r in range(size)]
            for op in OPS:
                out = np.empty(n, dt)
                comm.allreduce(ins[me].copy(), out, op)
                expect(f"allreduce {dname} n={n} {op.name}", out, _reduce(op, ins))
            buf = ins[me].copy()
            comm.allreduce(buf, buf, ReduceOp.SUM)
            expect(f"allreduce in-place {dname} n={n}", buf, _reduce(ReduceOp.SUM, ins))
            for scale in (1.0 / size, 2.5):  # Average's postscale, and one that grows the values
                out = np.empty(n, dt)
                comm.allreduce_scaled(ins[me].copy(), out, ReduceOp.SUM, scale)
                expect(f"allreduce scaled {dname} n={n} x{scale}", out, _scaled(_reduce(ReduceOp.SUM, ins), scale))
            if comm.takes_pieces and n:  # the input as pieces of uneven sizes (1, 2, 3 ... elements, the rest)
                cuts = [c for c in np.cumsum(np.arange(1, 20)) if c < n]
                for op in (ReduceOp.SUM, ReduceOp.MAX):
                    out = np.empty(n, dt)
                    comm.allreduce_scaled(Pieces(np.split(ins[me].copy(), cuts)), out, op, 0.5)
                    expect(f"allreduce of pieces {dname} n={n} {op.name}", out, _scaled(_reduce(op, ins), 0.5))
                    # ... and into an output of separate arrays (cut elsewhere than the input)
                    outs = [np.full(len(p), 7, dt) for p in np.split(out, cuts[1::2])]
                    comm.allreduce_scaled(Pieces(np.split(ins[me].copy(), cuts)), Pieces(outs, merge=False), op, 0.5)
                    expect(f"allreduce into pieces {dname} n={n} {op.name}", np.concatenate(outs),
                           _scaled(_reduce(op, ins), 0.5))

            counts = [(n + 3 * r) % 11 for r in range(size)]
            gins = [_input(r, counts[r], dt, 1) for r in range(size)]
            out = np.empty(sum(counts), dt)
            comm.allgatherv(gins[me], out, counts)
            expect(f"allgatherv {dname} n={n}", out, np.concatenate(gins))

            for root in range(size):
                buf = ins[me].copy() if me == root else np.zeros(n, dt)
                comm.broadcast(buf, root)
                expect(f"broadcast {dname} n={n} root={root}", buf, ins[root])

            sc = [[(n + i + 2 * j) % 5 for j in range(size)] for i in range(size)]
            ains = [_input(i, sum(sc[i]), dt, 2) for i in range(size)]
            offs = [np.cumsum([0] + sc[i]) for i in range(size)]
            rc = [sc[j][me] for j in range(size)]
            out = np.empty(sum(rc), dt)
            comm.alltoallv(ains[me], sc[me], out, rc)
            want = np.concatenate([ains[j][offs[j][me]:offs[j][me + 1]] for j in range(size)])
            expect(f"alltoallv {dname} n={n}", out, want)

            counts = [(n + r) // size + (r % 2) for r in range(size)]
            rins = [_input(r, sum(counts), dt, 3) for r in range(size)]
            ro = np.cumsum([0] + counts)
            for op in (ReduceOp.SUM, ReduceOp.MAX):
                out = np.empty(counts[me], dt)
                comm.reducescatterv(rins[me].copy(), out, counts, op)
                expect(f"reducescatterv {dname} n={n} {op.name}", out,
                       _reduce(op, rins)[ro[me]:ro[me + 1]])
        comm.barrier()
    # Bit-identical results for non-exact float sums, also at sizes that take the piece/ring paths.
    digests = []
    for n in (5, 3000, 70_000):
        x = np.random.default_rng(me + n).standard_normal(n).astype(np.float32)
        comm.allreduce(x, x, ReduceOp.SUM)
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
        comm.allreduce_scaled(x, x, ReduceOp.SUM, 1.0 / 3)  # each part scaled by one member: same bits
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
    comm.close()
    return bad + [f"digest {d}" for d in digests]


def _run(size: int, backend: str, ranks: list[int] | None = None, hosts: list[str] | None = None,
         disable_shm: bool = False) -> None:
    ranks = list(range(size)) if ranks is None else ranks
    res = run_ranks(size, _check_all, (backend, ranks), hosts=hosts, disable_shm=disable_shm, timeout=90)
    digests = set()
    for r in ranks:
        status, value, _logs = res[r]
        assert status == "ok"
        mismatches = [v for v in value if not v.startswith("digest ")]
        assert not mismatches, f"rank {r}: {len(mismatches)} mismatches, first: {mismatches[:5]}"
        digests.add(tuple(v for v in value if v.startswith("digest ")))
    assert len(digests) == 1, "members got different bits"


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shm(size):
    _run(size, "shm")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shm_member_to_member(size):
    _run(size, "shm-direct")


@pytest.mark.parametrize("size", [3, 4])
def test_shm_members_that_poll_for_tokens(size):
    _run(size, "shm-poll")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_tcp(size):
    _run(size, "tcp", disable_shm=True)


def test_subsets():
    _run(3, "shm", ranks=[0, 2])
    _run(3, "shm-direct", ranks=[0, 2])
    _run(3, "tcp", ranks=[0, 2], disable_shm=True)


def test_hierarchical():
    _run(4, "hierarchical", hosts=["a", "a", "b", "b"])
    _run(4, "hierarchical", hosts=["a", "b", "a", "b"])


# -- backend choice -----------------------------------------------------------------------------------

def _choose(ctx: Ctx) -> dict:
    from horovod.base.config import RuntimeConfig
    from horovod.transport import choose_backend, make_communicator

    out = {"all": choose_backend(ctx.mesh, list(range(ctx.size)), ctx.config),
           "no_hier": choose_backend(ctx.mesh, list(range(ctx.size)),
                                     RuntimeConfig(hierarchical_allreduce=False, hierarchical_allgather=False)),
           "pair": choose_backend(ctx.mesh, [0, 1], ctx.config)}
    comm = make_communicator(ctx.mesh, list(range(ctx.size)), ctx.config)
    x = np.full(100_000, ctx.rank + 1, np.float32)
    comm.allreduce(x, x, ReduceOp.SUM)
    out["ok"] = bool((x == sum(range(1, ctx.size + 1))).all())
    out["type"] = type(comm).__name__
    return out


@pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed (pip install 'horovod[test]'): "
                                          "bfloat16 is left out of the collective tests")
def test_bfloat16_is_covered():
    assert "bfloat16" in DTYPES and _dtype("bfloat16").itemsize == 2


def test_make_communicator_choice():
    res = run_ranks(4, _choose, hosts=["a", "a", "b", "b"])
    v = res[0][1]
    assert v == {"all": "hierarchical", "no_hier": "tcp", "pair": "shm", "ok": True,
                 "type": "HierarchicalCommunicator"}
    res = run_ranks(3, _choose, hosts=["a", "a", "b"])
    assert res[0][1]["all"] == "tcp" and res[0][1]["ok"]


def test_registry_lists_backends():
    from horovod.transport import get_backend

    with pytest.raises(ValueError, match="hierarchical, mpi, shm, tcp"):
        get_backend("nccl")


# -- failures -------------------------------------------------------------------------------------------

def _loop_until_failure(ctx: Ctx) -> tuple[str, float, int | None]:
    from horovod.transport import make_communicator
    from horovod.transport.communicator import PeerFailure

    victim, poll = ctx.args
    comm = make_communicator(ctx.mesh, list(range(ctx.size)), ctx.config)
    if poll:  # members poll for tokens whatever the host's cores (off by default at np > cores)
        from horovod.base.cores import Spin

        comm._spin = Spin(200e-6)
    x = np.ones(2 * 1024 * 1024, np.float32)
    ctx.store.put(f"started.{ctx.rank}", b"1")
    if ctx.rank == victim:
        time.sleep(3600)  # the victim: idles until killed
    try:
        while True:
            comm.allreduce(x, x, ReduceOp.SUM)
            x[:] = 1
    except PeerFailure as e:
        return str(e), time.time(), e.peer


def _shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/*"))


@pytest.mark.parametrize("disable_shm,poll", [(False, False), (True, False), (False, True)])
def test_killed_peer_is_detected_promptly(disable_shm, poll):
    before = _shm_files()
    killed_at = []

    def kill_victim(procs, store):
        for r in range(3):
            store.get(f"started.{r}", timeout=30)
        time.sleep(0.3)
        killed_at.append(time.time())
        os.kill(procs[2].pid, signal.SIGKILL)

    res = run_ranks(3, _loop_until_failure, (2, poll), disable_shm=disable_shm, op_timeout=30.0, expect_fail={2},
                    during=kill_victim, timeout=60)
    for r in (0, 1):
        status, (msg, when, peer), _ = res[r]
        assert status == "ok"
        assert when - killed_at[0] < 5.0, f"rank {r} noticed after {when - killed_at[0]:.1f} s: {msg}"
        assert peer in (1, 2, 0) and "rank" in msg
    assert res[0][1][2] in (1, 2)
    assert _shm_files() <= before


def _stall(ctx: Ctx) -> tuple[str, int, float]:
    from horovod.transport import make_communicator
    from horovod.transport.communicator import PeerFailure

    comm = make_communicator(ctx.mesh, list(range(ctx.size)), ctx.config)
    if ctx.rank == 1:  # stalled: never enters the allreduce, and stays until rank 0 has its outcome
        ctx.store.get("stall.over", timeout=30)
        return "slept", -1, 0.0
    t0 = time.monotonic()
    n = ctx.args  # small: over the sockets; large: through the shm token rounds
    try:
        comm.allreduce(np.ones(n, np.float32), np.empty(n, np.float32), ReduceOp.SUM)
    except PeerFailure as e:
        return e.reason, e.peer, time.monotonic() - t0
    finally:
        ctx.store.put("stall.over", b"1")
    return "no error", -1, 0.0


@pytest.mark.parametrize("disable_shm,n", [(False, 1000), (False, 100_000), (True, 100_000)])
def test_op_timeout_names_peer(disable_shm, n):
    res = run_ranks(2, _stall, n, disable_shm=disable_shm, op_timeout=1.0)
    reason, peer, took = res[0][1]
    assert peer == 1 and "timed out" in reason and 0.5 < took < 2.4
