"""Worker of the multi-host tests (runs on every rank, under horovodrun over ssh or under mpirun).

    python tests/multihost/mh_worker.py check <expected backend> <piddir>
    python tests/multihost/mh_worker.py loop <piddir>        # allreduce until killed; pid in <piddir>
    python tests/multihost/mh_worker.py fail-one <piddir>    # last rank exits 3, the others sleep
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import horovod.numpy as hvd
from horovod.common import basics


def write_pid(piddir: str) -> None:
    with open(os.path.join(piddir, f"rank.{hvd.rank()}"), "w") as f:
        json.dump({"pid": os.getpid(), "host": os.environ.get("HOROVOD_HOSTNAME", "")}, f)


def check(expected_backend: str, piddir: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    write_pid(piddir)
    # Layout: contiguous hosts with the same number of ranks each.
    assert size == hvd.local_size() * hvd.cross_size(), (size, hvd.local_size(), hvd.cross_size())
    assert rank == hvd.cross_rank() * hvd.local_size() + hvd.local_rank()
    assert hvd.is_homogeneous()
    layouts = hvd.allgather_object((rank, hvd.local_rank(), hvd.cross_rank(), os.environ.get("HOROVOD_HOSTNAME")))
    assert [r for r, *_ in layouts] == list(range(size))

    n = 1 << 20  # 4 MiB of float32: well above the hierarchical threshold
    for dtype in (np.float32, np.float64, np.int32, np.float16):
        x = (np.arange(n) % 7 + rank).astype(dtype)
        out = hvd.allreduce(x, op=hvd.Sum, name=f"big.{np.dtype(dtype).name}")
        expected = (np.arange(n) % 7 * size + size * (size - 1) // 2).astype(dtype)
        np.testing.assert_array_equal(out, expected)
    # Before any rank can finish: a rank's shutdown ends the job (and its communicators) everywhere.
    backend = type(basics.engine()._communicator(0)).__name__
    assert backend == expected_backend, (backend, expected_backend)
    rows = [np.full((1000 * (r + 1), 33), r, np.float32) for r in range(size)]
    gathered = hvd.allgather(rows[rank], name="big.allgather")
    np.testing.assert_array_equal(gathered, np.concatenate(rows))
    b = hvd.broadcast(np.full(300_000, rank, np.int64), root_rank=size - 1, name="big.bcast")
    assert (b == size - 1).all()
    parts = hvd.alltoall(np.repeat(np.arange(size, dtype=np.int32), 1000) + 100 * rank, name="a2a")
    np.testing.assert_array_equal(parts, np.repeat(np.arange(size, dtype=np.int32) * 100 + rank, 1000))
    rs = hvd.reducescatter(np.ones((size * 1000, 4), np.float32) * (rank + 1), op=hvd.Sum, name="rs")
    assert rs.shape == (1000, 4) and (rs == size * (size + 1) / 2).all()
    hvd.barrier()
    if rank == 0:
        print(f"MULTIHOST-OK size={size} local_size={hvd.local_size()} cross_size={hvd.cross_size()} "
              f"backend={backend} mpi={hvd.mpi_enabled()} hosts={sorted({h for *_, h in layouts})}")
    hvd.shutdown()


def loop(piddir: str) -> None:
    write_pid(piddir)
    x = np.ones(10_000, np.float32)
    step = 0
    while True:
        hvd.allreduce(x, name=f"loop.{step % 4}")
        step += 1
        if step == 20 and hvd.rank() == 0:
            print("LOOPING", flush=True)
        time.sleep(0.01)


def fail_one(piddir: str) -> None:
    write_pid(piddir)
    hvd.barrier()
    if hvd.rank() == hvd.size() - 1:
        print("failing on purpose", flush=True)
        os._exit(3)
    time.sleep(600)  # a hung rank: only the launcher can end it


if __name__ == "__main__":
    hvd.init()
    mode = sys.argv[1]
    if mode == "check":
        check(sys.argv[2], sys.argv[3])
    elif mode == "loop":
        loop(sys.argv[2])
    elif mode == "fail-one":
        fail_one(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode}")
