"""Collectives for groups spanning several hosts with several members on each: shm inside, TCP between.

Allreduce of ``N`` elements with ``L`` members per host::

    reduce-scatter inside the host (shm)      member l gets the host's sum of share l (N/L elements)
    allreduce of share l across hosts (TCP)   among the members with local position l: every member
                                              carries 1/L of the cross-host traffic
    allgather inside the host (shm)           everybody gets every share

Shares are reduced by one member per host and then by one cross-host allreduce, so every member ends with
bit-identical values.  Allgather (unless ``hierarchical_allgather`` is ``False``) gathers inside the host,
exchanges whole host blocks between the first members of the hosts, and broadcasts inside the host.
Small buffers and the other collectives use one flat :class:`TcpCommunicator` (AF_UNIX inside hosts).
"""

from __future__ import annotations

import logging

import numpy as np

from horovod.base.config import RuntimeConfig
from horovod.transport.buffers import copy_into, offsets, split_counts
from horovod.transport.communicator import Communicator, ReduceOp
from horovod.transport.mesh import Mesh
from horovod.transport.shm import ShmCommunicator
from horovod.transport.tcp import TcpCommunicator

__all__ = ["HierarchicalCommunicator", "SMALL_BYTES"]

logger = logging.getLogger(__name__)

SMALL_BYTES = 64 * 1024


class HierarchicalCommunicator(Communicator):
    """Two-level collectives; requires the same number of members on every host.

    Raises:
        ValueError: hosts have different numbers of members (use :class:`TcpCommunicator`).
    """

    def __init__(self, mesh: Mesh, ranks: list[int], config: RuntimeConfig, *,
                 small_bytes: int = SMALL_BYTES, **shm_options: int) -> None:
        self.flat = TcpCommunicator(mesh, ranks, config)
        self.ranks, self.rank, self.size = self.flat.ranks, self.flat.rank, self.flat.size
        hosts: dict[str, list[int]] = {}
        for i, r in enumerate(self.ranks):
            hosts.setdefault(mesh.hostnames[r], []).append(i)
        self.host_members = list(hosts.values())  # group positions, per host in order of first member
        per_host = {len(m) for m in self.host_members}
        if len(per_host) != 1:
            raise ValueError(f"hierarchical collectives need the same number of members on every host, got "
                             f"{ {h: len(m) for h, m in hosts.items()} }")
        self.local_size = per_host.pop()
        self.host_index = next(h for h, m in enumerate(self.host_members) if self.rank in m)
        self.local_rank = self.host_members[self.host_index].index(self.rank)
        self.local = ShmCommunicator(mesh, [self.ranks[i] for i in self.host_members[self.host_index]],
                                     config, **shm_options)
        self.cross = TcpCommunicator(mesh, [self.ranks[m[self.local_rank]] for m in self.host_members],
                                     config)
        self.small_bytes = small_bytes
        self.allgather_hierarchical = config.hierarchical_allgather is not False
        self.allreduce_hierarchical = config.hierarchical_allreduce is not False
        # Group order equals host-major order when every host's members are contiguous.
        self._contiguous = [i for m in self.host_members for i in m] == list(range(self.size))

    def allreduce(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        self.allreduce_scaled(inp, out, op, 1.0)

    def allreduce_scaled(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp, scale: float) -> None:
        if not self.allreduce_hierarchical or inp.nbytes <= self.small_bytes or inp.size < self.local_size:
            self.flat.allreduce_scaled(inp, out, op, scale)
            return
        counts = split_counts(inp.size, self.local_size)
        share = np.empty(counts[self.local_rank], inp.dtype)
        self.local.reducescatterv(inp, share, counts, op)
        self.cross.allreduce_scaled(share, share, op, scale)  # this host's share, scaled once
        self.local.allgatherv(share, out, counts)

    def allgatherv(self, inp: np.ndarray, out: np.ndarray, counts: list[int]) -> None:
        if not self.allgather_hierarchical or out.nbytes <= self.small_bytes:
            self.flat.allgatherv(inp, out, counts)
            return
        offs = offsets(counts)
        members = self.host_members[self.host_index]
        local_counts = [counts[i] for i in members]
        if self._contiguous:
            host_block = out[offs[members[0]]:offs[members[-1] + 1]]
            self.local.allgatherv(inp, host_block, local_counts)
            if self.local_rank == 0:
                host_counts = [sum(counts[i] for i in m) for m in self.host_members]
                self.cross.allgatherv(host_block, out, host_counts)
        else:
            host_block = np.empty(sum(local_counts), out.dtype)
            self.local.allgatherv(inp, host_block, local_counts)
            if self.local_rank == 0:
                host_counts = [sum(counts[i] for i in m) for m in self.host_members]
                gathered = np.empty(sum(host_counts), out.dtype)
                self.cross.allgatherv(host_block, gathered, host_counts)
                pos = 0
                for m in self.host_members:
                    for i in m:
                        copy_into(out[offs[i]:offs[i + 1]], gathered[pos:pos + counts[i]])
                        pos += counts[i]
        self.local.broadcast(out, 0)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.flat.broadcast(buf, root)

    def alltoallv(self, inp: np.ndarray, send_counts: list[int], out: np.ndarray,
                  recv_counts: list[int]) -> None:
        self.flat.alltoallv(inp, send_counts, out, recv_counts)

    def reducescatterv(self, inp: np.ndarray, out: np.ndarray, counts: list[int], op: ReduceOp) -> None:
        self.flat.reducescatterv(inp, out, counts, op)

    def barrier(self) -> None:
        self.flat.barrier()

    def close(self) -> None:
        self.local.close()
