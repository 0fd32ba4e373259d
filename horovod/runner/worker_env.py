"""The environment a worker starts with: the launcher → worker contract of docs/architecture.md.

Used by the static launcher (:mod:`horovod.runner.launch`), ``--mpi`` and the elastic driver
(:mod:`horovod.runner.elastic.driver`) alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from horovod.base import auth
from horovod.base import config as config_mod
from horovod.runner import hosts as hosts_mod

__all__ = ["worker_env", "launcher_env"]


def launcher_env(base: Mapping[str, str], *, knobs: Mapping[str, str], start_timeout: float,
                 nics: Sequence[str] = (), tcp: bool = False, unbuffered: bool = True) -> dict[str, str]:
    """What every worker of a job gets, whatever starts it (our spawner or ``mpirun``).

    ``base`` (the user's environment), the knobs that were given, ``PYTHONUNBUFFERED`` (only with
    ``unbuffered``), the start deadline, and the NCCL interface/TCP settings upstream exports.

    ``unbuffered=False`` is for ``mpirun``, as upstream: Open MPI's ``--tag-output`` tags every write(2) of a
    rank, and an unbuffered ``print('a', 'b')`` is four writes, so its line came out cut into tagged pieces
    (``...Loss: 2.33[1,0]<stdout>:...``).  Our own forwarder joins pieces into lines, so it keeps unbuffered
    output (upstream's gloo launcher sets it too).  A ``PYTHONUNBUFFERED`` in ``base`` is kept either way.
    """
    env = dict(base)
    env.update(knobs)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    env["HOROVOD_START_TIMEOUT"] = config_mod.format_number(start_timeout)
    if nics:
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    if tcp:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def worker_env(slot: hosts_mod.SlotInfo, *, base: Mapping[str, str], store_addr: str, store_port: int,
               key: bytes, knobs: Mapping[str, str], start_timeout: float, nics: Sequence[str] = (),
               tcp: bool = False, tls: Any = None) -> dict[str, str]:
    """The complete environment of one worker started by our spawner (the built-in transport).

    ``tls``: the job's :class:`horovod.transport.tls.JobCredentials` (``--tls``), else None.  Stale
    credentials in ``base`` (the launcher's own) are dropped.
    """
    from horovod.transport import tls as tls_mod

    env = launcher_env({k: v for k, v in base.items()
                        if k not in ("_HOROVOD_SECRET_KEY", tls_mod.CERT_ENV, tls_mod.KEY_ENV)},
                       knobs=knobs, start_timeout=start_timeout, nics=nics, tcp=tcp)
    env.update(slot.to_env())
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": store_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(store_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        auth.SECRET_KEY_ENV: key.hex(),
    })
    if nics:
        env["HOROVOD_GLOO_IFACE"] = nics[0]
    if tls is not None:
        env.update(tls_mod.worker_env(tls))
    return env
