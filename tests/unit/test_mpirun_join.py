"""When a process that mpirun/mpiexec started joins through rank 0's store (horovod/common/mpirun_join.py):
one host, several processes, and MPI not wanted or not installed; never across hosts (only MPI knows where
rank 0 is there), never when MPI is asked for or can bootstrap."""

from __future__ import annotations

import pytest

from horovod.common import mpirun_join, store_join

OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "PMIX_NAMESPACE": "2107375617"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4", "PMI_KVSNAME": "kvs_9"}


@pytest.mark.parametrize("env, mpi4py, joins", [
    (OMPI, False, True),  # mpi4py not installed
    ({**OMPI, "HOROVOD_CONTROLLER": "gloo"}, True, True),  # Horovod's own transport asked for
    (OMPI, True, False),  # MPI bootstraps, as before
    ({**OMPI, "HOROVOD_CONTROLLER": "mpi"}, False, False),  # mpi_job names mpi4py
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False, False),  # across hosts
    ({**OMPI, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, False, False),  # one process
    ({**OMPI, "HOROVOD_RANK": "1"}, False, False),  # horovodrun's worker
    (HYDRA, False, True),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, False, False),  # srun: horovod.common.slurm's
])
def test_detect(monkeypatch, env, mpi4py, joins):
    monkeypatch.setattr("horovod.transport.mpi.mpi_available", lambda: mpi4py)
    assert (mpirun_join.detect(env) is not None) is joins


def test_the_launch_as_rank_0_runs_it(monkeypatch):
    monkeypatch.setattr("horovod.transport.mpi.mpi_available", lambda: False)
    env = mpirun_join.detect(OMPI)
    assert (env.launcher, env.master_addr, env.rank, env.world_size, env.local_rank, env.one_host) == \
        ("mpirun", "127.0.0.1", 1, 3, 1, True)
    assert env.launch_id == "openmpi 2107375617" and env.store_port == store_join.derived_port(env.launch_id)
    hydra = mpirun_join.detect(HYDRA)
    assert (hydra.rank, hydra.world_size, hydra.launch_id, hydra.names[0]) == (2, 4, "mpich kvs_9", "PMI_RANK")
    # Without a job id: the parent process (mpirun, or its proxy on this host) tells launches apart.
    bare = mpirun_join.detect({k: v for k, v in OMPI.items() if k != "PMIX_NAMESPACE"})
    assert bare.launch_id.startswith("openmpi parent ")
