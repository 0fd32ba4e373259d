"""Joining a job that ``torchrun`` (or a Kubeflow PyTorchJob) started, without ``horovodrun``.

torchrun gives every worker ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node's index), ``TORCHELASTIC_RUN_ID``...; a PyTorchJob without
torchrun sets only the first four (one process per pod).  :func:`detect` reads them into a
:class:`~horovod.common.store_join.JoinEnv`, and :func:`horovod.common.store_join.join` meets the other ranks
through rank 0's store at ``MASTER_PORT + 1`` (torchrun's own store holds ``MASTER_PORT``).  torchrun has no
authenticated channel to share a key (its TCPStore answers anybody who reaches the port), so across hosts
``HOROVOD_SECRET_KEY`` is required; on one host rank 0 shares a fresh one through a file of this user's.

``horovodrun``'s ``HOROVOD_RANK`` wins over torchrun's variables; an MPI launcher's (``SLURM_*``,
``OMPI_COMM_WORLD_*``) win only over a PyTorchJob's, not over torchrun's (``TORCHELASTIC_RUN_ID``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from horovod.base.config import EnvVarError, is_set, parse_int
from horovod.common.store_join import JoinEnv

__all__ = ["detect", "make_env"]

_WHY = "(torchrun's variable: hvd.init() joins a torchrun job because MASTER_ADDR, RANK and WORLD_SIZE are set)"


def make_env(master_addr: str, master_port: int, rank: int, world_size: int, local_rank: int | None = None,
             local_world_size: int | None = None, group_rank: int | None = None, run_id: str = "",
             restart_count: int = 0) -> JoinEnv:
    """The :class:`JoinEnv` of a torchrun worker (each restart of torchrun's workers is another launch)."""
    multi_host = "without LOCAL_WORLD_SIZE (one process per host or pod)" if local_world_size is None \
        else f"on several hosts (LOCAL_WORLD_SIZE={local_world_size})"
    return JoinEnv(
        launcher="torchrun", master_addr=master_addr, rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=local_world_size, node=group_rank, launch_id=f"{run_id}|{master_port}|{restart_count}",
        store_port=master_port + 1 if master_port < 65535 else None,
        store_port_source="MASTER_PORT + 1" if master_port < 65535
        else "MASTER_PORT=65535 leaves no MASTER_PORT + 1 for Horovod's rendezvous store",
        missing_key=(
            f"hvd.init() under torchrun with WORLD_SIZE={world_size} {multi_host} needs HOROVOD_SECRET_KEY: "
            "the same random key, in hex, in every worker's environment (e.g. from a Kubernetes Secret; "
            "python -c 'import secrets; print(secrets.token_hex(32))'). torchrun has no authenticated channel to "
            "share one (docs/running.md, torchrun and Kubernetes)."))


def _int(env: Mapping[str, str], name: str, *, minimum: int, what: str) -> int | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        return parse_int(name, text, minimum=minimum, what=what)
    except EnvVarError as e:
        problem = str(e)[len(f"{name}={text!r} "):]
        raise EnvVarError(name, text, f"{problem} {_WHY}") from None


def detect(env: Mapping[str, str] | None = None) -> JoinEnv | None:
    """torchrun's (or a PyTorchJob's) description of this process; None when it was not started that way.

    A job is recognised when ``MASTER_ADDR``, ``RANK`` and ``WORLD_SIZE`` are set (or
    ``TORCHELASTIC_RUN_ID``), unless ``horovodrun`` (``HOROVOD_RANK``) or the elastic driver
    (``HOROVOD_ELASTIC_SLOT``; ``HOROVOD_ELASTIC=1`` alone does not count) started the process, or, without
    ``TORCHELASTIC_RUN_ID``, an MPI launcher's variables are set (torchrun's own win over the Slurm step or
    mpirun it runs in).

    Raises:
        EnvVarError: a torchrun variable is missing or malformed (the text names it and its value).
    """
    env = os.environ if env is None else env
    from horovod.common.elastic_init import launched_by_driver

    if is_set("HOROVOD_RANK", env) or launched_by_driver(env):
        return None
    started_by_torchrun = bool(env.get("TORCHELASTIC_RUN_ID", "").strip())
    if not (all(env.get(v, "").strip() for v in ("MASTER_ADDR", "RANK", "WORLD_SIZE")) or started_by_torchrun):
        return None
    from horovod.transport.mpi import detect_launch

    # torchrun started this process when it set TORCHELASTIC_RUN_ID: the Slurm step (or mpirun) it runs in
    # launched torchrun, not this worker, so its variables describe torchrun's task, not the job.
    if not started_by_torchrun and detect_launch(env) is not None:
        return None
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if not env.get(name, "").strip():
            raise EnvVarError(name, "", f"is not set {_WHY}", show_value=False)
    port = _int(env, "MASTER_PORT", minimum=1, what="a TCP port number")
    rank = _int(env, "RANK", minimum=0, what="a rank (a whole number)")
    size = _int(env, "WORLD_SIZE", minimum=1, what="a number of processes")
    local_rank = _int(env, "LOCAL_RANK", minimum=0, what="a rank (a whole number)")
    local_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1, what="a number of processes")
    group_rank = _int(env, "GROUP_RANK", minimum=0, what="a node rank (a whole number)")
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", minimum=0, what="a whole number") or 0
    assert port is not None and rank is not None and size is not None
    if port > 65535:
        raise EnvVarError("MASTER_PORT", env["MASTER_PORT"], f"must be <= 65535 {_WHY}")
    if rank >= size:
        raise ValueError(f"RANK={rank} must be below WORLD_SIZE={size} {_WHY}")
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_size} {_WHY}")
    if local_size is not None and local_size > size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_size} must not exceed WORLD_SIZE={size} {_WHY}")
    return make_env(env["MASTER_ADDR"].strip(), port, rank, size, local_rank, local_size, group_rank,
                    env.get("TORCHELASTIC_RUN_ID", "").strip(), restart)
