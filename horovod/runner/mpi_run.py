"""``horovodrun --mpi``: hand the job to Open MPI's ``mpirun`` (upstream's command line).

Under mpirun the workers find their ranks in ``OMPI_COMM_WORLD_*`` and use mpi4py; there is no rendezvous
store and no per-job key (MPI does its own wire-up).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from horovod.runner.hosts import HostInfo

__all__ = ["mpi_command", "exec_mpirun", "run_mpirun", "is_exportable"]

logger = logging.getLogger(__name__)

_NOT_EXPORTED = re.compile(r"^(BASH_FUNC_.*|OLDPWD|.*CUDA_VISIBLE_DEVICES|_HOROVOD_SECRET_KEY"
                           r"|PWD|SHLVL|_)$")


def is_exportable(name: str) -> bool:
    """Whether an env variable of the launcher is forwarded to workers (upstream's exclusions)."""
    return bool(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name)) and not _NOT_EXPORTED.match(name)


def mpi_command(num_proc: int, hosts: Sequence[HostInfo], command: str, env: Mapping[str, str], *,
                nics: Sequence[str] = (), output_filename: str | None = None, mpi_args: str | None = None,
                tcp: bool = False, ssh_port: int | None = None, ssh_identity_file: str | None = None,
                timestamp: bool = False) -> str:
    """The Open MPI ``mpirun`` command line for the job (a shell string, as upstream builds it).

    ``timestamp`` (``--prefix-output-with-timestamp``) adds upstream's ``--timestamp-output``."""
    host_arg = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
    parts = ["mpirun", "--allow-run-as-root", "--tag-output", *(["--timestamp-output"] if timestamp else []),
             "-np", str(num_proc), "-H", host_arg, "-bind-to", "none", "-map-by", "slot"]
    # Open MPI refuses a parameter given twice: the user's --mpi-args replace our defaults.
    for name, value in (("pml", "ob1"), ("btl", "^openib")):
        if not re.search(rf"-?-mca\s+{name}\s", mpi_args or ""):
            parts += ["-mca", name, value]
    if nics:
        parts += ["-mca", "btl_tcp_if_include", ",".join(nics), "-x", "NCCL_SOCKET_IFNAME"]
    rsh_args = (["-p", str(ssh_port)] if ssh_port else []) + (["-i", ssh_identity_file] if ssh_identity_file else [])
    if rsh_args:  # how mpirun's ssh reaches the other hosts' orted
        parts += ["-mca", "plm_rsh_args", " ".join(shlex.quote(a) for a in rsh_args)]
    if output_filename:
        parts += ["--output-filename", output_filename]
    if tcp:
        parts += ["-x", "NCCL_IB_DISABLE"]
    for name in sorted(env):
        if is_exportable(name):
            parts += ["-x", name]
    cmd = " ".join(shlex.quote(p) for p in parts)
    if mpi_args:
        cmd += " " + mpi_args
    return cmd + " " + command


def _check_mpirun() -> None:
    if shutil.which("mpirun") is None:
        raise RuntimeError("--mpi: mpirun was not found on PATH; install Open MPI or use --gloo")


def _shell_argv(cmd: str) -> list[str]:
    """``/bin/sh -c 'exec mpirun ...'``: the shell replaces itself with mpirun, so a signal sent to the
    launcher's process (``horovodrun``'s pid, after :func:`exec_mpirun`) reaches mpirun, which forwards it to
    the ranks.  Without ``exec`` the shell took the signal and died, leaving mpirun and the ranks running."""
    return ["/bin/sh", "-c", "exec " + cmd]


def exec_mpirun(cmd: str, env: Mapping[str, str]) -> None:
    """Replace this process with mpirun (through ``/bin/sh -c 'exec <mpirun ...>'``; never returns).

    The command line is logged at debug level: ``horovodrun --verbose`` prints it, as upstream."""
    _check_mpirun()
    logger.debug("%s", cmd)
    os.execve("/bin/sh", _shell_argv(cmd), dict(env))


def run_mpirun(cmd: str, env: Mapping[str, str]) -> None:
    """Run mpirun as a child (``horovod.run`` mode).  Raises ``RuntimeError`` on a non-zero exit."""
    _check_mpirun()
    logger.debug("%s", cmd)
    code = subprocess.call(_shell_argv(cmd), env=dict(env))
    if code != 0:
        raise RuntimeError(f"mpirun failed with exit code {code}")
