"""The data-plane contract: collectives on flat numpy buffers among a fixed group of ranks.

The runtime decides *what* to run and in which order (every member runs the same calls in the same order);
a :class:`Communicator` only moves and reduces bytes.  Implementations: ``shm.ShmCommunicator`` (ranks on
one host), ``tcp.TcpCommunicator`` (any ranks, over the mesh's data channels) and
``hierarchical.HierarchicalCommunicator`` (shm inside hosts, TCP between them).  ``make_communicator`` picks
one.

All buffers are 1-D, C-contiguous numpy arrays; counts are in elements.  Every blocking wait inside a
collective has a deadline (``op_timeout``); a peer that disappears or times out raises
:class:`PeerFailure` naming the peer's global rank.
"""

from __future__ import annotations

import abc

import numpy as np

from horovod.base.reduce_ops import ReduceOp
from horovod.transport.scaling import scale_inplace

__all__ = ["ReduceOp", "Communicator", "PeerFailure", "apply_reduce", "reduce_into"]


_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PRODUCT: np.multiply}
_BOOL_UFUNCS = {ReduceOp.SUM: np.logical_or, ReduceOp.MIN: np.logical_and, ReduceOp.MAX: np.logical_or,
                ReduceOp.PRODUCT: np.logical_and}


def apply_reduce(op: ReduceOp, acc: np.ndarray, other: np.ndarray) -> None:
    """``acc = acc <op> other`` in place, with numpy's dtype rules (bool: or/and).

    ``op`` is an element-wise op (SUM, MIN, MAX, PRODUCT); the runtime turns Average into Sum with
    :func:`horovod.base.reduce_ops.data_plane_op`."""
    reduce_into(op, acc, other, acc)


def reduce_into(op: ReduceOp, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a <op> b`` without first copying ``a`` into ``out`` (``out`` may be ``a`` or ``b``).

    Floats overflow to inf and make nan (inf + -inf) in silence, as upstream's C++ loops: a mixed-precision
    step's non-finite gradients are expected (the loss scaler skips the step), and numpy's RuntimeWarnings
    ('invalid value encountered in add') came out of the transports."""
    kind = a.dtype.kind
    if kind in "iu":
        _UFUNCS[op](a, b, out=out)
    elif kind == "b":
        _BOOL_UFUNCS[op](a, b, out=out)
    else:
        with np.errstate(all="ignore"):
            _UFUNCS[op](a, b, out=out)


class PeerFailure(ConnectionError):
    """A peer closed its connection, sent garbage, or missed the collective's deadline.

    ``closed`` says the peer ended the connection (EOF, reset, broken pipe) rather than going silent: a peer
    that closes in the middle of a collective has usually failed itself, so it is the messenger of another
    rank's failure, not the cause (the runtime waits briefly for that cause before blaming the peer).
    """

    def __init__(self, peer: int, reason: str, *, closed: bool = False) -> None:
        super().__init__(f"rank {peer}: {reason}")
        self.peer = peer
        self.reason = reason
        self.closed = closed


class Communicator(abc.ABC):
    """Collectives among ``ranks`` (global ranks, sorted); ``rank``/``size`` are positions in the group.

    Every method is called by every member in the same order with agreeing sizes; none of them returns
    before this rank's part is finished.  Raises:
        PeerFailure: a peer closed, sent a malformed frame, or did not take part within ``op_timeout``.
    """

    ranks: list[int]
    rank: int
    size: int
    data_plane = "GLOO"
    """The prefix of the timeline's transport activities (``GLOO_ALLREDUCE``...): upstream's name for the data
    plane that moves the bytes (our own transports stand where upstream's Gloo does; MPI's is ``MPI``)."""
    takes_pieces = False
    """Whether ``allreduce_scaled`` takes :class:`~horovod.transport.buffers.Pieces` as input and as output
    (else the runtime concatenates an input into a flat buffer first and scatters a result from one)."""

    @abc.abstractmethod
    def allreduce(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """``out = reduce(inp of every member)``.  ``inp`` may be ``out`` (in place)."""

    def allreduce_scaled(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp, scale: float) -> None:
        """``allreduce`` then ``out *= scale`` (the runtime's postscale: Average, ``postscale_factor``) with
        :mod:`horovod.transport.scaling`'s dtype rules.  Transports in which each member reduces a part
        override it to scale that part once, before the others copy it: a pass over 1/size of the buffer
        instead of all of it, and every member still gets the same bits."""
        self.allreduce(inp, out, op)
        scale_inplace(out, scale)

    @abc.abstractmethod
    def allgatherv(self, inp: np.ndarray, out: np.ndarray, counts: list[int]) -> None:
        """``out`` = every member's ``inp`` concatenated in group order; ``counts[i]`` = len of member i."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy ``buf`` of group member ``root`` into ``buf`` of every member."""

    @abc.abstractmethod
    def alltoallv(self, inp: np.ndarray, send_counts: list[int], out: np.ndarray,
                  recv_counts: list[int]) -> None:
        """Member i sends ``inp[offset_j : offset_j + send_counts[j]]`` to member j; received blocks are
        concatenated in ``out`` in member order with sizes ``recv_counts``."""

    @abc.abstractmethod
    def reducescatterv(self, inp: np.ndarray, out: np.ndarray, counts: list[int], op: ReduceOp) -> None:
        """Reduce ``inp`` (len ``sum(counts)``) across members; member i gets block i (len ``counts[i]``)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every member has entered the barrier."""

    def close(self) -> None:  # noqa: B027 - optional hook, most communicators hold nothing
        """Release segments and buffers (connections belong to the mesh)."""
