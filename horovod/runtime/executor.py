"""Execute one response on the process set's communicator and complete the handles.

Every member executes the same responses in the same order (the coordinator's order), so the collective
calls on the communicator line up.  A rank that has joined has no entry for a tensor and contributes zeros
of the announced shape.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from horovod.base import adasum
from horovod.base.exceptions import PreconditionError
from horovod.base.reduce_ops import ReduceOp, data_plane_op
from horovod.runtime.messages import RequestType, Response, dtype_of
from horovod.runtime.queue import TensorEntry, TensorQueue
from horovod.transport.buffers import MERGE_BELOW, Pieces
from horovod.transport.communicator import Communicator
from horovod.transport.scaling import scale_inplace, scaled_copy

__all__ = ["Executor", "CollectiveFailure"]

_ACTIVITY = {RequestType.ALLREDUCE: "{}_ALLREDUCE", RequestType.ALLGATHER: "{}_ALLGATHER",
             RequestType.BROADCAST: "{}_BCAST", RequestType.ALLTOALL: "MPI_ALLTOALL",  # upstream's Gloo's too
             RequestType.REDUCESCATTER: "{}_REDUCESCATTER"}


def _activity(comm: Communicator, rtype: RequestType) -> str:
    """The timeline's name of the transport's part of ``rtype``, after the data plane that runs it
    (``GLOO_ALLGATHER``, ``MPI_ALLGATHER`` under MPI's data plane) as upstream names them."""
    return _ACTIVITY[rtype].format(getattr(comm, "data_plane", "GLOO"))  # test doubles may lack it


PARTS_MIN_BYTES = 1024 * 1024
"""A fused allreduce group of large tensors, at least this many bytes, is reduced from and into its tensors
(see :meth:`Executor._in_parts`)."""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class CollectiveFailure(ConnectionError):
    """The transport failed inside a collective; ``entries`` are left pending for the engine.

    The engine fails them once it knows the job's cause: the peer this rank saw fail (closed connection) is
    often only the messenger of another rank's failure, which the coordinator relays.
    """

    def __init__(self, cause: BaseException, entries: list[TensorEntry | None]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.entries = entries


class Executor:
    """Runs responses; ``communicator(set_id)`` returns the set's communicator (created on first use)."""

    def __init__(self, queue: TensorQueue, communicator: Callable[[int], Communicator], timeline=None) -> None:
        self.queue = queue
        self.communicator = communicator
        self.timeline = timeline
        # JOIN responses run so far: each is the same point of every rank's response stream, the moment
        # at which every rank had joined (see basics.participation_epoch)
        self.joins_completed = 0

    def execute(self, resp: Response) -> list[TensorEntry | None]:
        """Run ``resp``; returns its entries (None where this rank contributed zeros) for cache bookkeeping."""
        entries = self.queue.pop_many(resp.process_set_id, resp.names)
        rtype = resp.type
        if rtype == RequestType.ERROR:
            for e in entries:
                if e is not None:
                    e.handle.set_error(PreconditionError(resp.error))
            return entries
        if rtype in (RequestType.BARRIER, RequestType.JOIN, RequestType.ADD_PROCESS_SET,
                     RequestType.REMOVE_PROCESS_SET):
            if rtype == RequestType.JOIN:
                self.joins_completed += 1
            result = resp.last_joined_rank if rtype == RequestType.JOIN else list(resp.payload)
            for e in entries:
                if e is not None:
                    e.handle.set_result(result)
            return entries
        timeline = self.timeline if self.timeline is not None and self.timeline.active else None
        if timeline is None and resp.data is not None and rtype == RequestType.ALLREDUCE:
            # reduced by the coordinator: no communicator, nothing that can fail in the transport
            return self._complete(entries, self._inline_results(resp, entries, dtype_of(resp.dtype)))
        if timeline is not None:
            for name in resp.names:
                timeline.begin(name, RequestType(rtype).name)
        try:
            comm = self.communicator(resp.process_set_id)
            if rtype == RequestType.ALLREDUCE:
                results = self._allreduce(comm, resp, entries, timeline)
            else:
                run = {RequestType.ALLGATHER: self._allgather, RequestType.BROADCAST: self._broadcast,
                       RequestType.ALLTOALL: self._alltoall, RequestType.REDUCESCATTER: self._reducescatter,
                       }.get(rtype)
                if run is None:
                    raise PreconditionError(f"unsupported operation {rtype}")
                if timeline is not None:  # the transport's part, nested in the operation's bar as upstream
                    timeline.begin(resp.names[0], _activity(comm, rtype))
                try:
                    results = [run(comm, resp, entries[0])]
                finally:
                    if timeline is not None:
                        timeline.end(resp.names[0])
        except (ConnectionError, OSError) as error:  # the transport failed: the engine names the cause
            raise CollectiveFailure(error, entries) from error
        except BaseException as error:
            for e in entries:
                if e is not None:
                    e.handle.set_error(error)
            raise
        finally:
            if timeline is not None:
                for i, name in enumerate(resp.names):
                    shape = resp.shapes[i] if i < len(resp.shapes) else ()
                    timeline.end(name, {"dtype": str(dtype_of(resp.dtype)),
                                        "shape": "[" + ", ".join(map(str, shape)) + "]"})
        return self._complete(entries, results)

    def _complete(self, entries: list[TensorEntry | None], results: list) -> list[TensorEntry | None]:
        """Hand each entry its result, then wake the waiting callers once for all of them."""
        for e, result in zip(entries, results):
            if e is not None:
                e._result = result  # Handle.set_result(result, notify=False), inlined
                e._done = True
        self.queue.completion.notify()
        return entries

    # ------------------------------------------------------------------ collectives
    def _allreduce(self, comm: Communicator, resp: Response, entries: list[TensorEntry | None],
                   timeline) -> list[np.ndarray]:
        dtype = dtype_of(resp.dtype)
        if resp.data is not None:  # reduced by the coordinator
            return self._inline_results(resp, entries, dtype)
        if resp.reduce_op == ReduceOp.ADASUM:
            return self._adasum(comm, resp, entries, timeline)
        op, postscale = data_plane_op(resp.reduce_op, resp.postscale, comm.size)
        act = timeline.begin if timeline is not None else None
        if len(entries) == 1:
            e = entries[0]
            shape = resp.shapes[0]
            out = e.output if e is not None and e.output is not None else np.empty(shape, dtype)
            flat = out.reshape(-1)
            if e is None:
                src = np.zeros(_numel(shape), dtype)
            else:  # in place: hand the communicator the very same view so it sees ``inp is out``
                src = flat if e.output is e.tensor else e.tensor.reshape(-1)
            flat_only = resp.prescale != 1.0 or not comm.takes_pieces  # Pieces in or out become flat here
            parts = None  # an output made of the caller's own arrays, scattered into after the reduction
            if flat_only and type(flat) is Pieces:
                parts, flat = flat, np.empty(flat.size, dtype)
            if flat_only and type(src) is Pieces:
                src = src.concatenate(flat)
            if resp.prescale != 1.0:
                scaled_copy(src, resp.prescale, flat)
                src = flat
            if act:
                act(resp.names[0], _activity(comm, RequestType.ALLREDUCE))
            comm.allreduce_scaled(src, flat, op, postscale)
            if parts is not None:
                parts.scatter(flat)
            if act:
                timeline.end(resp.names[0])
            return [out]
        if self._in_parts(comm, resp, entries):  # a large group: straight from and into the tensors
            if act:
                for name in resp.names:
                    act(name, _activity(comm, RequestType.ALLREDUCE))
            outs = [e.output for e in entries]  # type: ignore[union-attr]
            comm.allreduce_scaled(Pieces([e.tensor for e in entries]), Pieces(outs, merge=False),  # type: ignore[union-attr]
                                  op, postscale)
            if act:
                for name in resp.names:
                    timeline.end(name)
            return outs
        if act:
            for name in resp.names:
                act(name, "MEMCPY_IN_FUSION_BUFFER")
        # The tensors are copied straight into the fusion buffer (one C call for the whole group).
        if None in entries:
            parts = [e.tensor if e is not None else np.zeros(_numel(s), dtype) for e, s in zip(entries, resp.shapes)]
        else:
            parts = [e.tensor for e in entries]
        buf = np.concatenate(parts, axis=None)
        if act:
            for name in resp.names:
                timeline.end(name)
                act(name, _activity(comm, RequestType.ALLREDUCE))
        scale_inplace(buf, resp.prescale)
        comm.allreduce_scaled(buf, buf, op, postscale)
        if act:
            for name in resp.names:
                timeline.end(name)
                act(name, "MEMCPY_OUT_FUSION_BUFFER")
        results = self._split(buf, resp.shapes, entries)
        if act:
            for name in resp.names:
                timeline.end(name)
        return results

    @staticmethod
    def _in_parts(comm: Communicator, resp: Response, entries: list[TensorEntry | None]) -> bool:
        """Whether a fused group goes to the transport as its tensors (:class:`Pieces`) rather than through a
        fusion buffer: a group of large tensors (three quarters of its bytes in tensors of ``MERGE_BELOW`` or
        more) whose every tensor has a contiguous output (``allreduce_async_``, torch's gradients), on a
        transport that reads and writes parts itself.  The fusion buffer costs two more passes over the group
        (copy in, copy out): a 21 MB group of eight gradients, in place, took 9.2 ms through it and 5.2 ms as
        parts; 16 x 64 KiB 0.92 against 0.83 ms.  Groups of small tensors keep it (100 x 16 KiB: 1.34 ms
        through the buffer, 1.91 as parts: a Python step per part), as do groups under
        :data:`PARTS_MIN_BYTES` (docs/benchmarks.md)."""
        if not comm.takes_pieces or resp.prescale != 1.0 or None in entries:
            return False
        sizes = [e.tensor.nbytes for e in entries]  # type: ignore[union-attr]
        nbytes = sum(sizes)
        if nbytes < PARTS_MIN_BYTES or 4 * sum(n for n in sizes if n >= MERGE_BELOW) < 3 * nbytes:
            return False  # before the per-tensor checks: 100 small tensors cost ~9 us here, not ~33
        return all(type(e.tensor) is np.ndarray and type(e.output) is np.ndarray  # type: ignore[union-attr]
                   and e.output.flags.c_contiguous and e.tensor.flags.c_contiguous for e in entries)  # type: ignore[union-attr]

    def _adasum(self, comm: Communicator, resp: Response, entries: list[TensorEntry | None],
                timeline) -> list:
        """Upstream's Adasum tree (horovod.base.adasum): by recursive doubling for a power-of-two set (log2(size)
        exchanges of the whole fused buffer with one partner each), else gathered and combined on every
        member; either way every member holds bitwise the same result."""
        dtype = dtype_of(resp.dtype)
        counts = [_numel(shape) for shape in resp.shapes]
        total = sum(counts)
        mine = np.empty(total, dtype)
        offset = 0
        for e, n in zip(entries, counts):
            part = mine[offset:offset + n]
            if e is None:
                part[...] = 0
            elif type(e.tensor) is Pieces:
                e.tensor.concatenate(part)
            else:
                part[...] = e.tensor.reshape(-1)
            offset += n
        if timeline is not None:
            for name in resp.names:
                timeline.begin(name, "MPI_ADASUM_ALLREDUCE")
        mine = adasum.scaled(mine, resp.prescale)
        if comm.size & (comm.size - 1):  # not a power of two: every buffer, the tree on each member
            everyone = np.empty(total * comm.size, dtype)
            comm.allgatherv(mine, everyone, [total] * comm.size)
            mine = adasum.tree([everyone[i * total:(i + 1) * total] for i in range(comm.size)], counts)
        else:
            theirs = np.empty(total, dtype)
            distance = 1
            while distance < comm.size:
                partner = comm.rank ^ distance
                counts_to = [0] * comm.size
                counts_to[partner] = total
                comm.alltoallv(mine, counts_to, theirs, counts_to)
                if comm.rank < partner:
                    mine = adasum.combine_tensors(mine, theirs, counts)
                else:
                    mine = adasum.combine_tensors(theirs, mine, counts)
                distance *= 2
        result = adasum.scaled(mine, resp.postscale)
        if timeline is not None:
            for name in resp.names:
                timeline.end(name)
        return self._split(result, resp.shapes, entries)

    @staticmethod
    def _split(buf: np.ndarray, shapes: list[tuple[int, ...]], entries: list[TensorEntry | None]) -> list:
        """Per tensor: its slice of ``buf``, copied into the caller's output when it has one."""
        results = []
        offset = 0
        for e, shape in zip(entries, shapes):
            if e is not None:
                n = e.tensor.size
            else:
                n = 1
                for d in shape:
                    n *= d
            view = buf[offset:offset + n]
            offset += n
            out = None if e is None else e.output
            if out is not None:
                if type(out) is Pieces:
                    out.scatter(view)
                elif out.ndim == 1:
                    out[...] = view
                else:
                    out[...] = view.reshape(out.shape)
                results.append(out)
            else:
                results.append(view.reshape(shape))
        return results

    def _inline_results(self, resp: Response, entries: list[TensorEntry | None], dtype: np.dtype) -> list:
        data = resp.data
        if isinstance(data, np.ndarray):  # our own coordinator's array: already private to us
            buf = data
        else:  # bytes received from the coordinator: read-only, copied once unless every tensor has an output
            buf = np.frombuffer(data, dtype)
            for e in entries:
                if e is None or e.output is None:
                    buf = buf.copy()
                    break
        return self._split(buf, resp.shapes, entries)

    def _allgather(self, comm: Communicator, resp: Response, e: TensorEntry) -> np.ndarray:
        dims = resp.rank_dims[0]
        rest = tuple(resp.shapes[0][1:])
        row = _numel(rest)
        out = np.empty((sum(dims), *rest), dtype_of(resp.dtype))
        comm.allgatherv(e.tensor.reshape(-1), out.reshape(-1), [d * row for d in dims])
        return out

    def _broadcast(self, comm: Communicator, resp: Response, e: TensorEntry) -> np.ndarray:
        root = comm.ranks.index(resp.root_rank)
        out = e.output if e.output is not None else np.empty(e.tensor.shape, e.tensor.dtype)
        if comm.rank == root and out is not e.tensor:
            np.copyto(out, e.tensor)
        comm.broadcast(out.reshape(-1), root)
        return out

    def _alltoall(self, comm: Communicator, resp: Response, e: TensorEntry) -> tuple[np.ndarray, np.ndarray]:
        me = comm.rank
        rest = tuple(e.tensor.shape[1:])
        row = _numel(rest)
        send_rows = resp.splits[me]
        recv_rows = [resp.splits[j][me] for j in range(comm.size)]
        out = np.empty((sum(recv_rows), *rest), e.tensor.dtype)
        comm.alltoallv(e.tensor.reshape(-1), [s * row for s in send_rows], out.reshape(-1),
                       [r * row for r in recv_rows])
        return out, np.asarray(recv_rows, dtype=np.int32)

    def _reducescatter(self, comm: Communicator, resp: Response, e: TensorEntry) -> np.ndarray:
        shape = resp.shapes[0]
        n = comm.size
        rest = tuple(shape[1:])
        row = _numel(rest)
        rows = [shape[0] // n + (1 if j < shape[0] % n else 0) for j in range(n)]
        op, postscale = data_plane_op(resp.reduce_op, resp.postscale, n)
        src = e.tensor.reshape(-1)
        if resp.prescale != 1.0:
            scaled = np.empty_like(src)
            scaled_copy(src, resp.prescale, scaled)
            src = scaled
        out = np.empty((rows[comm.rank], *rest), dtype_of(resp.dtype))
        comm.reducescatterv(src, out.reshape(-1), [r * row for r in rows], op)
        scale_inplace(out.reshape(-1), postscale)
        return out
