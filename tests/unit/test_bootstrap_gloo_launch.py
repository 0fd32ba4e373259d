"""HOROVOD_CONTROLLER=gloo in a process that mpirun started across hosts (no horovodrun): nothing connects the
processes, so before each one ran alone as rank 0 of size 1; such a launch is refused naming the fix.  An srun
step, or mpirun's processes on one host, join through rank 0's store instead (horovod/common/slurm.py,
mpirun_join.py)."""

from __future__ import annotations

import time

import pytest

from horovod.common import bootstrap

SLURM_TWO = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "2"}
OMPI_TWO = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
_CLEARED = ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
            "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "PMIX_RANK", "PMIX_NAMESPACE", "PMI_FD")


@pytest.fixture
def env(monkeypatch):
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOROVOD_CONTROLLER", "gloo")
    return monkeypatch


def test_gloo_controller_in_a_launch_of_several_processes_is_refused(env):
    for name, value in OMPI_TWO.items():
        env.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        bootstrap.use_mpi(None)
    assert str(info.value) == (
        "openmpi started 2 processes (this is rank 0) with HOROVOD_CONTROLLER=gloo across hosts, where only MPI "
        "can tell the processes where rank 0 is: each would run alone as rank 0 of size 1.  Unset "
        "HOROVOD_CONTROLLER to bootstrap through MPI, or start the job with horovodrun (or srun, whose tasks "
        "Horovod connects without MPI).")
    assert time.monotonic() - start < 1.0


def test_gloo_controller_in_an_srun_step_joins_through_task_0s_store(env):
    from horovod.common import slurm

    for name, value in SLURM_TWO.items():
        env.setenv(name, value)
    assert slurm.wants_join() is True  # hvd.init() joins (bootstrap.join_without_mpi) before it asks use_mpi


def test_gloo_controller_alone_or_under_horovodrun_still_runs_without_mpi(env):
    assert bootstrap.use_mpi(None) is False  # no launcher: a single process
    for name, value in dict(SLURM_TWO, SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="1").items():
        env.setenv(name, value)
    assert bootstrap.use_mpi(None) is False  # srun -n 1
    for name, value in SLURM_TWO.items():
        env.setenv(name, value)
    env.setenv("HOROVOD_RANK", "1")
    env.setenv("HOROVOD_SIZE", "2")
    assert bootstrap.use_mpi(None) is False  # horovodrun's workers inside an srun step


@pytest.mark.parametrize("launch", [
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
    {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALNRANKS": "1"},
    {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "PMIX_RANK": "0"},  # srun -n 1 --mpi=pmix
])
def test_mpirun_of_one_process_without_mpi4py_runs_it_alone(env, launch):
    """``mpirun -np 1 python train.py`` (or ``srun -n 1 --mpi=pmix``) where mpi4py is not installed failed,
    naming mpi4py, while ``-np 2`` on one host joins without it: a single process needs nobody to join."""
    env.delenv("HOROVOD_CONTROLLER")
    for name, value in launch.items():
        env.setenv(name, value)
    env.setattr("horovod.transport.mpi.mpi_available", lambda: False)
    assert bootstrap.use_mpi(None) is False
    env.setenv("HOROVOD_CONTROLLER", "mpi")  # MPI asked for: mpi_job names mpi4py, as before
    assert bootstrap.use_mpi(None) is True
    env.delenv("HOROVOD_CONTROLLER")
    env.setattr("horovod.transport.mpi.mpi_available", lambda: True)
    assert bootstrap.use_mpi(None) is True  # mpi4py installed: MPI bootstraps, as before
