"""Joining a job that ``mpirun``/``mpiexec`` started on one host when MPI will not bootstrap it.

Under an MPI launcher Horovod bootstraps through MPI (mpi4py).  Without mpi4py, or with
``HOROVOD_CONTROLLER=gloo``, the processes of a launch on **one host** (every rank local: Open MPI's
``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's ``MPI_LOCALNRANKS`` equal to the size) meet at rank 0's store on this
host instead (:func:`horovod.common.store_join.join`; the key from ``HOROVOD_SECRET_KEY`` or rank 0's key file)
and run on Horovod's own transport.  A launch across hosts gives no process the address of rank 0 without MPI,
so it still needs mpi4py (``bootstrap.mpi_job`` says so).

The launch is told from any other of the same user by the launcher's job id (``PMIX_NAMESPACE``, which Open MPI
4+ sets, or Hydra's ``PMI_KVSNAME``); without one, by the parent process (mpirun itself, or its proxy on
this host, the same for every rank).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from horovod.base.config import read_env
from horovod.common.store_join import JoinEnv, derived_ports

__all__ = ["detect"]

_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME")


def detect(env: Mapping[str, str] | None = None) -> JoinEnv | None:
    """This process's place in a one-host MPI launch that MPI will not bootstrap; None otherwise."""
    from horovod.common.elastic_init import launched_by_driver
    from horovod.transport.mpi import detect_launch, mpi_available

    env = os.environ if env is None else env
    launch = detect_launch(env)
    if launch is None or launch.kind not in ("openmpi", "mpich") or launch.size == 1 or launched_by_driver(env):
        return None
    controller = read_env("HOROVOD_CONTROLLER", env)
    if controller == "mpi" or (controller != "gloo" and mpi_available()):
        return None
    if launch.local_size != launch.size or launch.local_rank is None:
        return None  # across hosts: only MPI can tell where rank 0 is (mpi_job names mpi4py)
    ident = next((env[v].strip() for v in _ID_VARS if env.get(v, "").strip()), f"parent {os.getppid()}")
    launch_id = f"{launch.kind} {ident}"
    ports = derived_ports(launch_id)
    rank_var, size_var, local_var = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
                                     if launch.kind == "openmpi" else ("PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"))
    return JoinEnv(
        launcher="mpirun", master_addr="127.0.0.1", rank=launch.rank, world_size=launch.size,
        local_rank=launch.local_rank, local_world_size=launch.size, node=0, launch_id=launch_id,
        store_port=ports[0], spare_ports=ports[1:],
        store_port_source=f"the ports derived from the launch's id ({ident})",
        names=(rank_var, size_var, local_var, "this host"))
