"""The built-in transport: an authenticated mesh of sockets and data-plane collectives over it.

``make_communicator(mesh, ranks, config)`` picks the backend for a group of global ranks:

* ``shm``: every member on this host (and shared memory not disabled);
* ``tcp``: one member per host, shared memory disabled, or uneven hosts;
* ``hierarchical``: several hosts with the same number of members each (shm inside, TCP between), unless
  ``HOROVOD_HIERARCHICAL_ALLREDUCE`` and ``HOROVOD_HIERARCHICAL_ALLGATHER`` are both ``0`` (one of them
  ``0`` makes only that collective flat).
* ``mpi``: the job was bootstrapped through MPI and ``HOROVOD_CPU_OPERATIONS`` is ``mpi`` (the default
  there): ``init`` sets ``mesh.mpi_comm`` and :mod:`horovod.transport.mpi` moves the data.

Backends are also available by name through :func:`get_backend` (``BACKENDS``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from horovod.base.config import RuntimeConfig
from horovod.transport.communicator import Communicator, PeerFailure, ReduceOp, apply_reduce
from horovod.transport.mesh import Mesh, build_mesh

__all__ = ["make_communicator", "choose_backend", "get_backend", "BACKENDS", "build_mesh", "Mesh",
           "Communicator", "PeerFailure", "ReduceOp", "apply_reduce"]

Factory = Callable[[Mesh, list[int], RuntimeConfig], Communicator]


def _shm(mesh: Mesh, ranks: list[int], config: RuntimeConfig) -> Communicator:
    from horovod.transport.shm import ShmCommunicator

    return ShmCommunicator(mesh, ranks, config)


def _tcp(mesh: Mesh, ranks: list[int], config: RuntimeConfig) -> Communicator:
    from horovod.transport.tcp import TcpCommunicator

    return TcpCommunicator(mesh, ranks, config)


def _hierarchical(mesh: Mesh, ranks: list[int], config: RuntimeConfig) -> Communicator:
    from horovod.transport.hierarchical import HierarchicalCommunicator

    return HierarchicalCommunicator(mesh, ranks, config)


def _mpi(mesh: Mesh, ranks: list[int], config: RuntimeConfig) -> Communicator:
    from horovod.transport.mpi import MpiCommunicator

    return MpiCommunicator(mesh.mpi_comm, ranks)


BACKENDS: dict[str, Factory] = {"shm": _shm, "tcp": _tcp, "hierarchical": _hierarchical, "mpi": _mpi}


def get_backend(name: str) -> Factory:
    """The factory registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the known backends.
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transport backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}") \
            from None


def choose_backend(mesh: Mesh, ranks: list[int], config: RuntimeConfig) -> str:
    """The name of the backend :func:`make_communicator` uses for ``ranks`` (every member agrees)."""
    if mesh.mpi_comm is not None:  # init under MPI with HOROVOD_CPU_OPERATIONS=mpi
        return "mpi"
    per_host = collections.Counter(mesh.hostnames[r] for r in ranks)
    shm_ok = not (config.disable_shm or mesh.disable_shm)
    if len(per_host) == 1:
        return "shm" if shm_ok and len(ranks) > 1 else "tcp"
    both_off = config.hierarchical_allreduce is False and config.hierarchical_allgather is False
    if not shm_ok or max(per_host.values()) == 1 or both_off:
        return "tcp"
    return "hierarchical" if len(set(per_host.values())) == 1 else "tcp"


def make_communicator(mesh: Mesh, ranks: list[int], config: RuntimeConfig) -> Communicator:
    """A communicator for the group ``ranks`` (sorted global ranks containing ``mesh.rank``)."""
    ranks = sorted(int(r) for r in ranks)
    return get_backend(choose_backend(mesh, ranks, config))(mesh, ranks, config)
