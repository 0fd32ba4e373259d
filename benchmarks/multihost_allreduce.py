"""Allreduce across two network-namespace hosts (one rank each): our TCP path, with and without TLS, vs Open MPI's.

    sudo bash .ci/netns_hosts.sh up                      # the hosts hvdh1..3 (see docs/running.md)
    python benchmarks/multihost_allreduce.py             # prints a markdown table
    python benchmarks/multihost_allreduce.py --no-mpi    # only plain vs --tls
    python benchmarks/multihost_allreduce.py --loopback  # plain vs --tls, 2 ranks on this host over TCP

Four runs, launcher in hvdh1, ranks on hvdh2 and hvdh3 over the veth/bridge network:
``horovodrun`` (built-in transport, TCP between hosts), ``horovodrun --tls`` (the same over TLS: the
"TLS / plain" column is the cost of encryption), ``mpirun`` with Horovod (MPI data plane, Open MPI's TCP
BTL) and ``mpirun`` with bare mpi4py ``Allreduce`` (Open MPI alone).  Float32 Sum in place; bus bandwidth
= 2 (n-1)/n * bytes / time.  ``--loopback`` runs the first two on this host with ``HOROVOD_SHM_DISABLE=1``,
where the network costs next to nothing and the cost of encryption shows most.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
STATE = os.environ.get("HVD_NETNS_DIR", "/tmp/hvd-netns")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _iters(nbytes: int) -> int:
    return max(5, min(100, (256 << 20) // nbytes // 4))


def worker(mode: str) -> None:
    if mode == "mpi4py":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def run(x, i):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

        def barrier():
            comm.Barrier()
    else:
        import horovod.numpy as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def run(x, i):
            hvd.allreduce_(x, op=hvd.Sum, name=f"b{x.nbytes}.{i % 2}")

        def barrier():
            hvd.barrier()
    results, cpu = {}, {}
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        for i in range(3):
            run(x, i)
        barrier()
        n = _iters(nbytes)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            run(x, i)
        barrier()
        results[nbytes] = (time.perf_counter() - t0) / n
        cpu[nbytes] = (time.process_time() - c0) / n  # every thread of this rank's process
    if rank == 0:
        print("BENCH " + json.dumps({"size": size, "times": results, "cpu": cpu}), flush=True)


def _measure(cmd: list[str], netns: str | None = "hvdh1", env: dict[str, str] | None = None,
             what: str = "times") -> dict[int, float]:
    """Seconds per allreduce by size (``what="cpu"``: CPU seconds of rank 0's process instead)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.run([*prefix, *cmd], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    for line in proc.stdout.splitlines():
        if "BENCH " in line:
            found = json.loads(line.split("BENCH ", 1)[1])
            if what == "both":
                return {int(k): (v, found["cpu"][k]) for k, v in found["times"].items()}  # type: ignore[misc]
            return {int(k): v for k, v in found[what].items()}
    raise RuntimeError(f"benchmark run failed ({proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["horovod", "mpi4py"])
    parser.add_argument("--no-mpi", action="store_true", help="only horovodrun, plain and --tls")
    parser.add_argument("--loopback", action="store_true",
                        help="plain vs --tls with 2 ranks on this host over TCP (no namespace hosts needed)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    me = [sys.executable, os.path.abspath(__file__), "--worker"]
    if args.loopback:
        run = [sys.executable, "-m", "horovod.runner", "-np", "2"]
        env = {"HOROVOD_SHM_DISABLE": "1", "PYTHONPATH": REPO}
        ours = _measure([*run, *me, "horovod"], None, env, "both")
        tls = _measure([*run, "--tls", *me, "horovod"], None, env, "both")
        _table(ours, tls)
        return
    key = os.path.join(STATE, "id_ed25519")
    rsh = f"-p 2222 -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    mpirun = ["mpirun", "--allow-run-as-root", "-np", "2", "-H", "hvdh2:1,hvdh3:1", "--mca", "plm_rsh_args", rsh,
              "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include",
              "eth0", "-x", "PATH", "-x", f"PYTHONPATH={REPO}", "--wdir", REPO]
    run = [sys.executable, "-m", "horovod.runner", "-p", "2222", "-i", key, "-np", "2", "-H", "hvdh2:1,hvdh3:1"]
    ours = _measure([*run, *me, "horovod"], what="both")
    tls = _measure([*run, "--tls", *me, "horovod"], what="both")
    if args.no_mpi:
        _table(ours, tls)
        return
    hvd_mpi = _measure([*mpirun, *me, "horovod"])
    ompi = _measure([*mpirun, *me, "mpi4py"])
    _table(ours, tls, hvd_mpi, ompi)


def _table(ours: dict[int, tuple[float, float]], tls: dict[int, tuple[float, float]],
           hvd_mpi: dict[int, float] | None = None, ompi: dict[int, float] | None = None) -> None:
    """``ours``/``tls``: (seconds, CPU seconds of rank 0) per allreduce by size.  The CPU ratio is the cost of
    encryption that machine load does not blur; the time ratio is what a job sees on this machine."""
    head = ("| size | horovodrun, TCP (ms) | GB/s | horovodrun --tls (ms) | GB/s | TLS / plain, time "
            "| CPU ms/op, TCP | CPU ms/op, TLS | TLS / plain, CPU ")
    if ompi is not None:
        head += "| mpirun + Horovod, MPI data plane (ms) | GB/s | mpirun, bare mpi4py (ms) | GB/s | Open MPI / ours "
    print(head + "|")
    print("|---:" * head.count("|") + "|")
    for n in SIZES:
        (t_ours, c_ours), (t_tls, c_tls) = ours[n], tls[n]
        row = [t_ours, t_tls] + ([hvd_mpi[n], ompi[n]] if ompi is not None and hvd_mpi is not None else [])
        cells = [f"{t * 1e3:.2f} | {n / t / 1e9:.2f}" for t in row]  # 2(n-1)/n = 1 for 2 ranks
        cells.insert(2, f"{t_tls / t_ours:.2f} | {c_ours * 1e3:.2f} | {c_tls * 1e3:.2f} | {c_tls / c_ours:.2f}")
        if ompi is not None:
            cells.append(f"{ompi[n] / t_ours:.2f}")
        label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
