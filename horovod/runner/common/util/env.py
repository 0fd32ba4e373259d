"""Upstream's ``env``: which launcher variables reach workers, and the rank and size a process was given."""

from __future__ import annotations

import os

from horovod.base.config import LOG_LEVELS
from horovod.runner.mpi_run import is_exportable

__all__ = ["LOG_LEVEL_STR", "IGNORE_REGEXES", "KUBEFLOW_MPI_EXEC", "is_exportable", "get_env_rank_and_size",
           "is_kubeflow_mpi"]

LOG_LEVEL_STR = list(reversed(LOG_LEVELS))
"""``['FATAL', 'ERROR', 'WARNING', 'INFO', 'DEBUG', 'TRACE']`` as upstream."""

IGNORE_REGEXES = {"BASH_FUNC_.*", "OLDPWD", ".*CUDA_VISIBLE_DEVICES", "_HOROVOD_SECRET_KEY"}
"""Upstream's patterns of variables the launcher does not forward; :func:`is_exportable` applies them (and
also drops ``PWD``, ``SHLVL``, ``_`` and names that are not identifiers)."""

KUBEFLOW_MPI_EXEC = "/etc/mpi/kubexec.sh"

_RANK_SIZE_VARS = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                   ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size() -> tuple[int, int]:
    """``(rank, size)`` from the launcher's (or mpirun's) variables; ``(0, 1)`` when none are set.

    Raises:
        RuntimeError: only one of a rank/size pair is set.
    """
    for rank_var, size_var in _RANK_SIZE_VARS:
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of {rank_var} and "
                               f"{size_var} found in environment")
    return 0, 1


def is_kubeflow_mpi() -> bool:
    """Whether mpirun runs under Kubeflow's MPI operator (its rsh agent)."""
    return os.environ.get("OMPI_MCA_plm_rsh_agent") == KUBEFLOW_MPI_EXEC
