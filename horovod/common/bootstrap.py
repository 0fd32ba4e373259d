"""How a process learns its place in the job and gets connected to the others.

Three ways in: the launcher's environment and rendezvous store (``horovodrun``), MPI (``mpirun``/``srun`` or
``init(comm=...)``: layout, job key and addresses exchanged over the communicator), and the elastic driver
(``horovod.common.elastic_init``).  ``horovod.common.basics.init`` picks one and starts the engine.
"""

from __future__ import annotations

import logging
import os
import socket

from horovod.common import auth
from horovod.common.config import read_env, start_timeout
from horovod.common.process_sets import ProcessSet
from horovod.runtime.engine import Topology

__all__ = ["topology_from_env", "topology_from_mpi", "use_mpi", "mpi_job", "elastic_mesh", "build_mesh"]

log = logging.getLogger(__name__)


def topology_from_env() -> Topology:
    """The rank layout the launcher put in the environment (size 1 without a launcher).

    Raises:
        ValueError: a variable is not a whole number, or a rank is not below its size (the text names both).
    """
    layout = {}
    for kind in ("", "LOCAL_", "CROSS_"):
        rank_name, size_name = f"HOROVOD_{kind}RANK", f"HOROVOD_{kind}SIZE"
        rank, size = read_env(rank_name), read_env(size_name)
        if rank >= size:
            raise ValueError(f"{rank_name}={rank} must be below {size_name}={size} (the launcher sets both; "
                             "unset them to run a single process)")
        layout[kind.lower() + "rank"], layout[kind.lower() + "size"] = rank, size
    return Topology(**layout, hostname=read_env("HOROVOD_HOSTNAME") or socket.gethostname())


def elastic_mesh():
    """Under the elastic driver (HOROVOD_ELASTIC=1), get rank and mesh from it: horovod/common/elastic_init.py."""
    if not read_env("HOROVOD_ELASTIC") or not read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        return None
    from horovod.common import elastic_init

    return elastic_init.rendezvous()


def use_mpi(comm) -> bool:
    """MPI bootstraps the job: an mpi4py communicator was passed, or mpirun/srun started this process."""
    if comm is not None and not isinstance(comm, (list, tuple)):
        return True
    if os.environ.get("HOROVOD_RANK") or read_env("HOROVOD_CONTROLLER") == "gloo":
        return False
    from horovod.transport.mpi import detect_launch

    return detect_launch() is not None


def mpi_job(comm):
    """Bootstrap through MPI (mpirun/srun or ``init(comm=...)``); ValueError with the fix when impossible."""
    from horovod.transport import mpi as mpi_mod

    launch = mpi_mod.detect_launch()
    if not mpi_mod.mpi_available():
        if launch is None:
            raise ValueError("Horovod has not been built with MPI support. Please reinstall with MPI support "
                             "or use the default (built-in) controller.")
        raise ValueError(f"This process was started by {launch.kind} (rank {launch.rank} of {launch.size}) but "
                         "mpi4py is not installed: pip install mpi4py, or start the job with horovodrun.")
    job = mpi_mod.mpi_job(comm, threads=not read_env("HOROVOD_MPI_THREADS_DISABLE"),
                          iface=read_env("HOROVOD_GLOO_IFACE") or None)
    if job is None:
        raise ValueError(f"hvd.init(comm={comm}): this process is not one of the listed MPI_COMM_WORLD ranks; "
                         "only they may call init.")
    if comm is None and launch is not None and launch.size != job.size:
        job.close()
        raise ValueError(f"{launch.kind} started {launch.size} processes but MPI sees {job.size}: "
                         + ("run srun with --mpi=pmix (or pmi2) so that MPI connects the tasks, "
                            if launch.kind == "slurm" else "mpi4py uses a different MPI than the launcher; ")
                         + "or start the job with horovodrun.")
    log.debug("MPI job: rank %d of %d, local %d of %d, cross %d of %d, address %s", job.rank, job.size,
              job.local_rank, job.local_size, job.cross_rank, job.cross_size, job.iface_addr)
    return job


def topology_from_mpi(job) -> Topology:
    return Topology(rank=job.rank, size=job.size, local_rank=job.local_rank, local_size=job.local_size,
                    cross_rank=job.cross_rank, cross_size=job.cross_size, hostname=job.hostname)


def _interface_address(name: str) -> str | None:
    import psutil

    for entry in psutil.net_if_addrs().get(name, []):
        if entry.family == socket.AF_INET:
            return entry.address
    return None


def build_mesh(topology: Topology, sets: list[ProcessSet], scope: str, mpi=None):
    """Connect this rank to every other one (through MPI, or through the launcher's store)."""
    import json

    from horovod.transport import build_mesh as connect
    from horovod.transport.mesh import advertise_address
    from horovod.transport.store import StoreClient

    if mpi is not None:
        from horovod.transport.mpi import MpiStore

        timeout = start_timeout()
        mine = [ps.ranks for ps in sets]
        for r, theirs in enumerate(mpi.comm.allgather(mine)):
            if theirs != mine:
                raise ValueError("Horovod initialization failed: ranks passed different process_sets to init() "
                                 f"(rank {topology.rank}: {mine}, rank {r}: {theirs}).")
        mesh = connect(topology.rank, topology.size, topology.hostname, MpiStore(mpi.comm), mpi.key,
                          scope=scope, timeout=timeout, iface_addr=mpi.iface_addr)
        if (read_env("HOROVOD_CPU_OPERATIONS") or "mpi") == "mpi":
            mesh.mpi_comm = mpi.comm  # make_communicator then picks horovod.transport.mpi for data
        return mesh
    addr = read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")
    key = auth.secret_key_from_env()
    if not addr or not port or key is None:
        raise ValueError("Horovod initialization failed: HOROVOD_SIZE > 1 but no rendezvous address or secret "
                         "key in the environment. Start the job with horovodrun.")
    timeout = start_timeout()
    store = StoreClient(addr, int(port), key, timeout=timeout)
    # Every rank must pass the same static process sets: rank 0 compares everyone's, the others rank 0's.
    mine = json.dumps([ps.ranks for ps in sets]).encode()
    store.put(f"{scope}/process_sets.{topology.rank}", mine)
    others = range(1, topology.size) if topology.rank == 0 else [0]
    for r in others:
        theirs = store.get(f"{scope}/process_sets.{r}", timeout=timeout)
        if theirs != mine:
            raise ValueError("Horovod initialization failed: ranks passed different process_sets to init() "
                             f"(rank {topology.rank}: {mine.decode()}, rank {r}: {theirs.decode()}).")
    # Listen and advertise on HOROVOD_GLOO_IFACE (--network-interface) if this host has it, else on the
    # interface that routes to the launcher's store (the network the launcher chose for the job).
    iface = read_env("HOROVOD_GLOO_IFACE")
    iface_addr = _interface_address(iface) if iface else None
    if iface and iface_addr is None:
        log.warning("HOROVOD_GLOO_IFACE=%s has no IPv4 address on %s; using the route to %s", iface,
                    topology.hostname, addr)
    iface_addr = iface_addr or advertise_address(None, addr, topology.hostname)
    return connect(topology.rank, topology.size, topology.hostname, store, key, scope=scope, timeout=timeout,
                      iface_addr=iface_addr)
