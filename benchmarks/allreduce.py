"""Allreduce side by side: horovod (ours) vs Open MPI via mpi4py vs torch.distributed Gloo, np=2.

    python benchmarks/allreduce.py                 # full table (4 KiB ... 256 MiB)
    python benchmarks/allreduce.py --max-mib 64    # quicker
    python benchmarks/allreduce.py --max-mib 1 --peers mpi --rounds 6   # medians of six alternated launches

The driver launches each peer in turn in this same invocation (ours under horovodrun, Open MPI under mpirun,
Gloo with torch.distributed env:// rendezvous), each worker writes its timings as JSON, and the driver prints
one table with ratios (peer time / our time: > 1 means we are faster).  All three reduce float32 in place
(Sum); the last two rows are a synchronous 16 KiB allgather and broadcast (root 0).  Absolute times on a
shared 2-core machine drift; the ratios measured in one run are what matter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

KIB = 1024
MIB = 1024 * KIB
LONE_BYTES = 16 * KIB
MANY = 100


def _sizes(max_mib: int) -> list[int]:
    sizes, n = [], 4 * KIB
    while n <= max_mib * MIB:
        sizes.append(n)
        n *= 4
    return sizes


# Untimed calls per size: ours measure two ways of copying on their first 18 calls of each size class
# (horovod/transport/shm_trials.py); what is timed is the job's steady state after them.
WARMUP_CALLS = 20


def _iters(nbytes: int) -> int:
    return max(5, min(200, int(256 * MIB / nbytes) // 8))


# ----------------------------------------------------------------------------- workers
class _Horovod:
    name = "horovod"

    def __init__(self) -> None:
        import horovod.numpy as hvd

        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def allreduce(self, buf, name: str) -> None:
        self.hvd.allreduce_(buf, op=self.hvd.Sum, name=name)

    def allgather(self, buf, out) -> None:
        self.hvd.allgather(buf, name="gather")

    def broadcast(self, buf) -> None:
        self.hvd.broadcast(buf, 0, name="bcast")

    def many(self, bufs) -> None:
        hvd = self.hvd
        handles = [hvd.allreduce_async_(b, op=hvd.Sum, name=f"many.{i}") for i, b in enumerate(bufs)]
        for h in handles:
            hvd.synchronize(h)

    def barrier(self) -> None:
        self.hvd.barrier()

    def close(self) -> None:
        self.hvd.shutdown()


class _Mpi:
    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def allreduce(self, buf, name: str) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def allgather(self, buf, out) -> None:
        self.comm.Allgather(buf, out)

    def broadcast(self, buf) -> None:
        self.comm.Bcast(buf, root=0)

    def many(self, bufs) -> None:
        comm, in_place, op = self.comm, self.MPI.IN_PLACE, self.MPI.SUM
        for b in bufs:
            comm.Allreduce(in_place, b, op=op)

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass


class _Gloo:
    name = "gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="env://")
        self.torch = torch
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def allreduce(self, buf, name: str) -> None:
        self.dist.all_reduce(self.torch.from_numpy(buf))

    def allgather(self, buf, out) -> None:
        self.dist.all_gather_into_tensor(self.torch.from_numpy(out), self.torch.from_numpy(buf))

    def broadcast(self, buf) -> None:
        self.dist.broadcast(self.torch.from_numpy(buf), 0)

    def many(self, bufs) -> None:
        works = [self.dist.all_reduce(self.torch.from_numpy(b), async_op=True) for b in bufs]
        for w in works:
            w.wait()

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


def _time(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def worker(kind: str, out: str, max_mib: int) -> None:
    import numpy as np

    impl = {"horovod": _Horovod, "mpi": _Mpi, "gloo": _Gloo}[kind]()
    results: dict = {"sizes": {}}
    for nbytes in _sizes(max_mib):
        buf = np.zeros(nbytes // 4, np.float32)  # zeros: repeated in-place sums stay finite
        name = f"size.{nbytes}"
        for _ in range(WARMUP_CALLS):
            impl.allreduce(buf, name)
        impl.barrier()
        results["sizes"][nbytes] = _time(lambda b=buf, n=name: impl.allreduce(b, n), _iters(nbytes))
        del buf
    lone = np.zeros(LONE_BYTES // 4, np.float32)
    for _ in range(100):
        impl.allreduce(lone, "lone")
    impl.barrier()
    results["lone"] = _time(lambda: impl.allreduce(lone, "lone"), 2000)
    gathered = np.zeros(lone.size * impl.size, np.float32)
    for kind, op in (("gather", lambda: impl.allgather(lone, gathered)), ("bcast", lambda: impl.broadcast(lone))):
        for _ in range(100):
            op()
        impl.barrier()
        results[kind] = _time(op, 1000)
    bufs = [np.zeros(LONE_BYTES // 4, np.float32) for _ in range(MANY)]
    for _ in range(10):
        impl.many(bufs)
    impl.barrier()
    results["many"] = _time(lambda: impl.many(bufs), 100)
    impl.barrier()
    if impl.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    impl.close()


# ----------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, out: str, max_mib: int, np_: int, timeout: float) -> bool:
    args = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--out", out, "--max-mib", str(max_mib)]
    env = dict(os.environ)
    if kind == "horovod":
        cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), *args]
        procs = [subprocess.Popen(cmd, env=env)]
    elif kind == "mpi":
        if shutil.which("mpirun") is None:
            return False
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "--bind-to", "none", *args]
        procs = [subprocess.Popen(cmd, env=env)]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(np_))
        procs = [subprocess.Popen(args, env={**env, "RANK": str(r)}) for r in range(np_)]
    ok = True
    for p in procs:
        try:
            ok &= p.wait(timeout) == 0
        except subprocess.TimeoutExpired:
            p.kill()
            ok = False
    return ok and os.path.exists(out)


def _available(kind: str) -> bool:
    module = {"mpi": "mpi4py", "gloo": "torch", "horovod": "horovod"}[kind]
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def driver(max_mib: int, np_: int, peers: list[str], timeout: float, rounds: int = 1) -> dict:
    """Launch ours and each peer in turn, ``rounds`` times over (alternated: a shared host drifts from one
    minute to the next, and each ratio pairs the two launches of one round); print medians over the rounds."""
    runs: dict[str, list[dict]] = {}
    kinds = []
    for kind in ["horovod", *peers]:
        if _available(kind):
            kinds.append(kind)
        else:
            print(f"[skip] {kind}: not installed", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for kind in kinds:
                out = os.path.join(tmp, f"{kind}.{r}.json")
                if _launch(kind, out, max_mib, np_, timeout):
                    with open(out) as f:
                        runs.setdefault(kind, []).append(json.load(f))
                else:
                    print(f"[skip] {kind}: run {r + 1} failed", file=sys.stderr)
    kinds = [k for k in ("horovod", "mpi", "gloo") if k in runs]
    ours = runs.get("horovod")
    head = f"{'':>12}" + "".join(f"{k + ' (ms)':>14}" for k in kinds) + "".join(
        f"{k + '/ours':>12}" for k in kinds if k != "horovod")
    print(f"\nallreduce float32 in place, Sum, np={np_} (median" + (f" over {rounds} alternated rounds; a ratio: the "
          "median of each round's own)" if rounds > 1 else ")"))
    print(head)

    def value(run: dict, key) -> float:
        return run["sizes"][str(key)] if isinstance(key, int) else run[key]

    def row(label: str, key) -> None:
        line = f"{label:>12}" + "".join(f"{statistics.median(value(x, key) for x in runs[k]) * 1e3:>14.3f}"
                                        for k in kinds)
        if ours is not None:
            for k in kinds:
                if k != "horovod":
                    ratios = [value(p, key) / value(o, key) for p, o in zip(runs[k], ours)]
                    line += f"{statistics.median(ratios):>12.2f}"
                    if rounds > 1:
                        line += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        print(line)

    for nbytes in _sizes(max_mib):
        row(_fmt_size(nbytes), nbytes)
    row("lone 16KiB", "lone")
    row("100x16KiB", "many")
    row("gather 16KiB", "gather")
    row("bcast 16KiB", "bcast")
    results = {k: v[0] if rounds == 1 else v for k, v in runs.items()}
    print(json.dumps(results))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["horovod", "mpi", "gloo"])
    parser.add_argument("--out")
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("-np", type=int, default=2)
    parser.add_argument("--peers", default="mpi,gloo", help="comma list of peers to run (mpi, gloo)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--rounds", type=int, default=1, help="launch every contender this many times, alternated; "
                        "print medians (and each ratio's range) over the rounds")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.max_mib)
    else:
        driver(args.max_mib, args.np, [p for p in args.peers.split(",") if p], args.timeout, args.rounds)


if __name__ == "__main__":
    main()
