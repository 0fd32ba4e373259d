"""Collectives over the mesh's data channels (TCP between hosts, or any stream socket).

Algorithms (``n`` members, ``N`` bytes):

* allreduce: up to ``small_bytes`` a direct exchange (everybody sends its buffer to everybody and reduces
  all of them in member order: one latency); above, a ring reduce-scatter + ring allgather
  (``2 (n-1)/n N`` bytes per member), where the reduction of each received piece overlaps the transfer
  of the next.
* allgatherv, alltoallv, reducescatterv: direct pairwise exchanges, all peers at once (same bytes per
  member as a ring, one latency); reducescatterv reduces in member order.
* broadcast: the root sends to everybody when small or ``n <= 2``; a pipelined chain otherwise.
* barrier: one token to and from every member.

Sending and receiving at once goes through :func:`horovod.transport.wire.exchange` (non-blocking sockets
and ``poll``), so messages larger than the socket buffers cannot deadlock.  Every result is reduced by
exactly one member (or in the same order by all), so all members get bit-identical results.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from horovod.base.config import RuntimeConfig
from horovod.base.cores import Spin
from horovod.transport.buffers import copy_into, offsets, place, split_counts
from horovod.transport.communicator import Communicator, ReduceOp, reduce_into
from horovod.transport.mesh import Mesh
from horovod.transport.scaling import scale_inplace
from horovod.transport.wire import Channel, Transfer, byte_view, exchange

__all__ = ["TcpCommunicator"]

logger = logging.getLogger(__name__)

SMALL_BYTES = 64 * 1024
PIECE_BYTES = 1024 * 1024


class TcpCommunicator(Communicator):
    """Collectives among ``ranks`` over ``mesh.data`` channels.

    Args:
        small_bytes: allreduce/broadcast at or below this size use one direct exchange.
        piece_bytes: granularity of pipelining (reduce while the next piece arrives; chain broadcast).
    """

    def __init__(self, mesh: Mesh, ranks: list[int], config: RuntimeConfig, *,
                 small_bytes: int = SMALL_BYTES, piece_bytes: int = PIECE_BYTES) -> None:
        self.ranks = sorted(int(r) for r in ranks)
        if mesh.rank not in self.ranks:
            raise ValueError(f"rank {mesh.rank} is not a member of the group {self.ranks}")
        self.rank = self.ranks.index(mesh.rank)
        self.size = len(self.ranks)
        self.timeout = float(config.op_timeout)
        self.small_bytes = small_bytes
        self.piece_bytes = max(1, piece_bytes)
        self.peers: dict[int, Channel] = {}
        for i, r in enumerate(self.ranks):
            if i != self.rank:
                ch = mesh.data[r]
                ch.settimeout(self.timeout)
                self.peers[i] = ch
        self._scratch: list[np.ndarray] = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._token = np.zeros(1, np.uint8)
        # the last receive of an exchange polls for the peer's bytes before sleeping (see wire.exchange)
        self._spin = Spin.for_peers(config.spin_wait_us, mesh.hostnames.count(mesh.hostnames[mesh.rank]))

    # -- helpers -------------------------------------------------------------------------------------
    def _buf(self, slot: int, count: int, dtype: np.dtype) -> np.ndarray:
        """A reusable scratch array (fresh allocations page-fault on every call)."""
        nbytes = count * dtype.itemsize
        if self._scratch[slot].nbytes < nbytes:
            self._scratch[slot] = np.empty(max(nbytes, 2 * self._scratch[slot].nbytes), np.uint8)
        return self._scratch[slot][:nbytes].view(dtype)

    def _xchg(self, sends: list[Transfer], recvs: list[Transfer]) -> None:
        exchange(sends, recvs, self.timeout, self._spin)

    def _piece_elems(self, dtype: np.dtype) -> int:
        return max(1, self.piece_bytes // dtype.itemsize)

    # -- allreduce -----------------------------------------------------------------------------------
    def allreduce(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        self.allreduce_scaled(inp, out, op, 1.0)

    def allreduce_scaled(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp, scale: float) -> None:
        n = inp.size
        if self.size == 1 or n == 0:
            if out is not inp and n:
                copy_into(out, inp)
            scale_inplace(out, scale)
        elif inp.nbytes <= self.small_bytes or n < self.size:
            self._allreduce_direct(inp, out, op)
            scale_inplace(out, scale)
        else:
            self._allreduce_ring(inp, out, op, scale)

    def _allreduce_direct(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        me, size = self.rank, self.size
        bufs: list[Any] = [None] * size
        recvs = []
        scratch = self._buf(0, inp.size * (size - 1), inp.dtype)
        for j, i in enumerate(p for p in range(size) if p != me):
            bufs[i] = scratch[j * inp.size:(j + 1) * inp.size]
            recvs.append(Transfer(self.peers[i], bufs[i]))
        self._xchg([Transfer(ch, inp) for ch in self.peers.values()], recvs)
        own = inp if (out is not inp or me < 2) else inp.copy()
        bufs[me] = own
        reduce_into(op, bufs[0], bufs[1], out)
        for i in range(2, size):
            reduce_into(op, out, bufs[i], out)

    def _reduce_piecewise(self, op: ReduceOp, own: np.ndarray, got: np.ndarray, dst: np.ndarray,
                          itemsize: int) -> Any:
        """A progress callback reducing ``dst = own <op> got`` piece by piece as ``got`` fills."""
        piece = self._piece_elems(own.dtype)
        state = [0]
        total = own.size

        def progress(done_bytes: int) -> None:
            ready = done_bytes // itemsize
            start = state[0]
            if ready < total and ready - start < piece:
                return
            end = ready if ready >= total else start + (ready - start) // piece * piece
            reduce_into(op, own[start:end], got[start:end], dst[start:end])
            state[0] = end

        return progress

    def _allreduce_ring(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp, scale: float) -> None:
        me, size = self.rank, self.size
        counts = split_counts(inp.size, size)
        offs = offsets(counts)
        right, left = self.peers[(me + 1) % size], self.peers[(me - 1) % size]
        tmp = self._buf(0, max(counts), inp.dtype)
        itemsize = inp.dtype.itemsize

        def block(a: np.ndarray, c: int) -> np.ndarray:
            return a[offs[c]:offs[c + 1]]

        # Reduce-scatter: at step s send block me-s-1, receive block me-s-2; member i ends owning block i.
        for s in range(size - 1):
            send_c, recv_c = (me - s - 1) % size, (me - s - 2) % size
            src = block(inp if s == 0 else out, send_c)
            got = tmp[:counts[recv_c]]
            progress = self._reduce_piecewise(op, block(inp, recv_c), got, block(out, recv_c), itemsize)
            self._xchg([Transfer(right, src)], [Transfer(left, got, progress)])
        scale_inplace(block(out, me), scale)  # the block I own, before the others receive it
        # Allgather: at step s send block me-s, receive block me-s-1 straight into ``out``.
        for s in range(size - 1):
            send_c, recv_c = (me - s) % size, (me - s - 1) % size
            self._xchg([Transfer(right, block(out, send_c))], [Transfer(left, block(out, recv_c))])

    # -- other collectives ---------------------------------------------------------------------------
    def allgatherv(self, inp: np.ndarray, out: np.ndarray, counts: list[int]) -> None:
        offs = offsets(counts)
        place(out[offs[self.rank]:offs[self.rank + 1]], inp)
        if self.size == 1:
            return
        sends = [Transfer(ch, inp) for ch in self.peers.values()]
        recvs = [Transfer(ch, out[offs[i]:offs[i + 1]]) for i, ch in self.peers.items()]
        self._xchg(sends, recvs)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.size == 1 or buf.size == 0:
            return
        me, size = self.rank, self.size
        if size <= 2 or buf.nbytes <= self.small_bytes:
            if me == root:
                self._xchg([Transfer(ch, buf) for ch in self.peers.values()], [])
            else:
                self._xchg([], [Transfer(self.peers[root], buf)])
            return
        # Pipelined chain root -> root+1 -> ...: each member forwards what it has received so far.
        pos = (me - root) % size
        nxt = self.peers[(me + 1) % size] if pos < size - 1 else None
        if pos == 0:
            self._xchg([Transfer(nxt, buf)], [])  # type: ignore[arg-type]
            return
        prev = self.peers[(me - 1) % size]
        view = byte_view(buf)
        if nxt is None:
            self._xchg([], [Transfer(prev, view)])
            return
        fwd = Transfer(nxt, view)
        fwd.limit = 0

        def progress(done: int) -> None:
            fwd.limit = done

        self._xchg([fwd], [Transfer(prev, view, progress)])

    def alltoallv(self, inp: np.ndarray, send_counts: list[int], out: np.ndarray,
                  recv_counts: list[int]) -> None:
        so, ro = offsets(send_counts), offsets(recv_counts)
        me = self.rank
        if send_counts[me]:
            copy_into(out[ro[me]:ro[me + 1]], inp[so[me]:so[me + 1]])
        if self.size == 1:
            return
        sends = [Transfer(ch, inp[so[i]:so[i + 1]]) for i, ch in self.peers.items()]
        recvs = [Transfer(ch, out[ro[i]:ro[i + 1]]) for i, ch in self.peers.items()]
        self._xchg(sends, recvs)

    def reducescatterv(self, inp: np.ndarray, out: np.ndarray, counts: list[int], op: ReduceOp) -> None:
        me, size = self.rank, self.size
        offs = offsets(counts)
        own = inp[offs[me]:offs[me + 1]]
        if size == 1 or counts[me] == 0:
            if size > 1:
                self._xchg([Transfer(ch, inp[offs[i]:offs[i + 1]]) for i, ch in self.peers.items()], [])
            elif own.size:
                copy_into(out, own)
            return
        scratch = self._buf(0, counts[me] * (size - 1), inp.dtype)
        bufs: list[Any] = [None] * size
        recvs = []
        for j, i in enumerate(p for p in range(size) if p != me):
            bufs[i] = scratch[j * counts[me]:(j + 1) * counts[me]]
            recvs.append(Transfer(self.peers[i], bufs[i]))
        self._xchg([Transfer(ch, inp[offs[i]:offs[i + 1]]) for i, ch in self.peers.items()], recvs)
        bufs[me] = own if not np.shares_memory(own, out) else own.copy()
        reduce_into(op, bufs[0], bufs[1], out)
        for i in range(2, size):
            reduce_into(op, out, bufs[i], out)

    def barrier(self) -> None:
        if self.size == 1:
            return
        got = np.zeros(self.size, np.uint8)
        self._xchg([Transfer(ch, self._token) for ch in self.peers.values()],
                   [Transfer(ch, got[i:i + 1]) for i, ch in self.peers.items()])
