"""Allreduce across two network-namespace hosts (one rank each): our TCP path vs Open MPI's.

    sudo bash .ci/netns_hosts.sh up            # the hosts hvdh1..3 (see docs/running.md)
    python benchmarks/multihost_allreduce.py   # prints a markdown table

Three runs, launcher in hvdh1, ranks on hvdh2 and hvdh3 over the veth/bridge network:
``horovodrun`` (built-in transport, TCP between hosts), ``mpirun`` with Horovod (MPI data plane,
Open MPI's TCP BTL) and ``mpirun`` with bare mpi4py ``Allreduce`` (Open MPI alone).  Float32 Sum in place;
bus bandwidth = 2 (n-1)/n * bytes / time.
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
    results = {}
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        for i in range(3):
            run(x, i)
        barrier()
        n = _iters(nbytes)
        t0 = time.perf_counter()
        for i in range(n):
            run(x, i)
        barrier()
        results[nbytes] = (time.perf_counter() - t0) / n
    if rank == 0:
        print("BENCH " + json.dumps({"size": size, "times": results}), flush=True)


def _measure(cmd: list[str]) -> dict[int, float]:
    proc = subprocess.run(["ip", "netns", "exec", "hvdh1", *cmd], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    for line in proc.stdout.splitlines():
        if "BENCH " in line:
            return {int(k): v for k, v in json.loads(line.split("BENCH ", 1)[1])["times"].items()}
    raise RuntimeError(f"benchmark run failed ({proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["horovod", "mpi4py"])
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    key = os.path.join(STATE, "id_ed25519")
    me = [sys.executable, os.path.abspath(__file__), "--worker"]
    rsh = f"-p 2222 -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    mpirun = ["mpirun", "--allow-run-as-root", "-np", "2", "-H", "hvdh2:1,hvdh3:1", "--mca", "plm_rsh_args", rsh,
              "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include",
              "eth0", "-x", "PATH", "-x", f"PYTHONPATH={REPO}", "--wdir", REPO]
    ours = _measure([sys.executable, "-m", "horovod.runner", "-p", "2222", "-i", key, "-np", "2", "-H",
                     "hvdh2:1,hvdh3:1", *me, "horovod"])
    hvd_mpi = _measure([*mpirun, *me, "horovod"])
    ompi = _measure([*mpirun, *me, "mpi4py"])
    print("| size | horovodrun, TCP (ms) | GB/s | mpirun + Horovod, MPI data plane (ms) | GB/s "
          "| mpirun, bare mpi4py (ms) | GB/s | Open MPI / ours |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in SIZES:
        row = [ours[n], hvd_mpi[n], ompi[n]]
        cells = " | ".join(f"{t * 1e3:.2f} | {n / t / 1e9:.2f}" for t in row)  # 2(n-1)/n = 1 for 2 ranks
        label = f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
        print(f"| {label} | {cells} | {ompi[n] / ours[n]:.2f} |")


if __name__ == "__main__":
    main()
