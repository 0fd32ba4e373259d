"""Time the transport's allreduce alone (no engine): ``python benchmarks/transport_allreduce.py``.

Starts ``--np`` local processes, builds a mesh through a file store in a temporary directory and times
float32 allreduce for sizes from 4 KiB to 256 MiB on the shm and tcp backends.  ``--piece-kib`` overrides
the shared-memory piece size, for tuning.  Compare with Open MPI::

    mpirun --allow-run-as-root -np 2 python -c "from mpi4py import MPI; ..."  # comm.Allreduce
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

logger = logging.getLogger("transport_allreduce")

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


class _DirStore:
    def __init__(self, root: str) -> None:
        self.root = root

    def put(self, key: str, value: bytes) -> None:
        path = os.path.join(self.root, key.replace("/", "_"))
        with open(path + ".tmp", "wb") as f:
            f.write(value)
        os.replace(path + ".tmp", path)

    def get(self, key: str, timeout: float | None = 30.0) -> bytes:
        deadline = time.monotonic() + (timeout or 30.0)
        path = os.path.join(self.root, key.replace("/", "_"))
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(0.005)
        with open(path, "rb") as f:
            return f.read()


def _rank(rank: int, size: int, root: str, backend: str, sizes: list[int], piece: int | None,
          results: mp.Queue) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.base.config import RuntimeConfig
    from horovod.transport import build_mesh
    from horovod.transport.communicator import ReduceOp
    from horovod.transport.shm import ShmCommunicator
    from horovod.transport.tcp import TcpCommunicator

    disable = backend == "tcp"
    mesh = build_mesh(rank, size, "localhost", _DirStore(root), b"bench-key", scope="b", timeout=30,
                      disable_shm=disable)
    config = RuntimeConfig(disable_shm=disable)
    if backend == "shm":
        comm = ShmCommunicator(mesh, list(range(size)), config, **({"piece_bytes": piece} if piece else {}))
    else:
        comm = TcpCommunicator(mesh, list(range(size)), config)
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x)
        reps = max(3, min(2000, int(2e8 // max(nbytes, 1)) // 4))
        for _ in range(min(reps, 20)):
            comm.allreduce(x, out, ReduceOp.SUM)
        times = []
        for _ in range(reps):
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce(x, out, ReduceOp.SUM)
            times.append(time.perf_counter() - t0)
        assert out[0] == size
        if rank == 0:
            results.put((nbytes, float(np.median(times)), float(np.min(times))))
    if rank == 0:
        results.put(None)
    mesh.close()


def run(backend: str, size: int, sizes: list[int], piece: int | None = None) -> list[tuple[int, float, float]]:
    """``[(bytes, median_s, min_s)]`` of ``size``-process allreduces on ``backend``."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=_rank, args=(r, size, root, backend, sizes, piece, results))
                 for r in range(size)]
        for p in procs:
            p.start()
        out = []
        while (item := results.get(timeout=600)) is not None:
            out.append(item)
        for p in procs:
            p.join()
    return out


def _fmt(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--backend", choices=["shm", "tcp", "both"], default="both")
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--piece-kib", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = [s for s in SIZES if s <= args.max_mib << 20]
    for backend in (["shm", "tcp"] if args.backend == "both" else [args.backend]):
        for nbytes, med, best in run(backend, args.np, sizes, args.piece_kib and args.piece_kib * 1024):
            unit, scale = ("us", 1e6) if nbytes < 1 << 20 else ("ms", 1e3)
            logger.info("%-4s np=%d %8s  median %9.1f %s  min %9.1f %s", backend, args.np, _fmt(nbytes),
                        med * scale, unit, best * scale, unit)


if __name__ == "__main__":
    main()
