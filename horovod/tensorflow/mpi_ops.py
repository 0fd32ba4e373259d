"""Horovod's collectives as TensorFlow ops (eager, ``tf.function``, TF1 graphs) with upstream's names and gradients.

Every op converts tensors to numpy, calls the shared submit function of :mod:`horovod.common.ops`, and wraps
the result (see :mod:`horovod.tensorflow._bridge` for how graph mode avoids blocking TensorFlow's threads).
Automatic names follow upstream in graph mode (``HorovodAllreduce_<tensor name>``, the negotiation key, the
same on every rank because every rank builds the same graph); in eager mode ``name=None`` gets a call counter.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from horovod.base.config import read_env
from horovod.base.reduce_ops import data_plane_op
from horovod.common import basics as _basics_mod
from horovod.common import ops as _ops
from horovod.common.basics import Adasum, Average, Max, Min, Product, Sum
from horovod.common.layout_check import mismatch_error, shape_moments, shapes_agree
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow import _bridge
from horovod.tensorflow._bridge import Wait, run_collective

__all__ = [
    "allreduce", "_allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "size_op",
    "local_size_op", "rank_op", "local_rank_op", "process_set_included_op", "Average", "Sum", "Adasum", "Min",
    "Max", "Product", "handle_average_backwards_compatibility", "_basics", "_normalize_name",
]

_basics = _basics_mod.HorovodBasics()
handle_average_backwards_compatibility = _ops.handle_average_backwards_compatibility

# The collectives are plain Python that builds ops: AutoGraph must not rewrite them (inside tf.function it
# would otherwise convert this module, and through the closures handed to numpy_function the engine itself,
# at every call at run time).
_plain = tf.autograph.experimental.do_not_convert

try:  # TensorFlow's own test of whether any gradient tape or forward accumulator is active
    from tensorflow.python.eager.record import could_possibly_record as _could_record
except ImportError:  # pragma: no cover - a TensorFlow without it: always wrap
    def _could_record() -> bool:
        return True


def _as_tensor(x) -> tf.Tensor:
    """``tf.convert_to_tensor``, skipped for a tensor (its dispatch costs ~20 us per eager call)."""
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(x)


def _differentiable(fwd):
    """``tf.custom_gradient(fwd)``, except in eager mode while nothing records: there the wrapper inspects
    ``fwd``'s signature and sets up variable watching on every call (about 0.3 ms, half of a small eager
    collective) for a gradient nobody can ask for.  Traced functions pay it once, when traced."""
    def call(*xs):
        if tf.executing_eagerly() and not _could_record():
            return fwd(*xs)[0]
        return tf.custom_gradient(fwd)(*xs)  # (building the wrapper costs ~60 us: only when it is used)
    return call


def _normalize_name(name: str) -> str:
    """Upstream's normalisation: anything outside ``[a-zA-Z0-9_]`` becomes ``_``."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _tensor_name(tensor: tf.Tensor) -> str:
    """``tensor``'s normalised name, for graph mode's automatic negotiation keys.

    An eager tensor that a ``tf.function`` captures from outside has no name while the function is traced
    (``Tensor.name`` raises AttributeError), and the placeholder that stands for it is named after an id of
    this process, which may differ across ranks: it is called ``captured``, and ``graph.unique_name`` numbers
    the keys in the order the function is traced, the same on every rank."""
    try:
        return _normalize_name(tensor.name)
    except AttributeError:
        return "captured"


def _core_name(prefix: str, tensor, name: str | None, ignore_name_scope: bool) -> str | None:
    """The negotiation key: ``None`` in eager mode without a name (the engine numbers calls)."""
    if tf.executing_eagerly():
        return name
    if name is None:
        name = f"{prefix}_{_tensor_name(tensor)}"
    graph = tf.compat.v1.get_default_graph()
    full = graph.unique_name(name)
    if ignore_name_scope:
        full = full.rsplit("/", 1)[-1]
    return full


def _group_core_name(prefix: str, tensors: list[tf.Tensor], name: str | None,
                     ignore_name_scope: bool) -> str | None:
    """The negotiation key of a grouped op: upstream's ``<prefix>_<first tensor>_<last tensor>`` in a graph
    when no name is given (the tensors' names are read only then: see :func:`_tensor_name`)."""
    if tf.executing_eagerly():
        return name
    return _core_name(prefix, tensors[0], name or f"{prefix}_{_tensor_name(tensors[0])}_{_tensor_name(tensors[-1])}",
                      ignore_name_scope)


def _set_size(process_set: ProcessSet) -> int:
    ranks = _basics_mod.process_set_ranks(process_set.process_set_id)
    return len(ranks) if ranks else _basics_mod.size()


def size_read_at_run_time() -> bool:
    """Whether a graph being traced must read the world size when it runs (upstream's ``size_op()`` under
    ``HOROVOD_ELASTIC=1``): an elastic job's traced steps outlive the size they were traced at."""
    return not tf.executing_eagerly() and bool(read_env("HOROVOD_ELASTIC"))


def set_size_tensor(process_set: ProcessSet, dtype) -> tf.Tensor:
    """The set's size as a ``dtype`` tensor: a constant, or read when the graph runs in an elastic job."""
    if size_read_at_run_time():
        return tf.cast(size_op(process_set.process_set_id), dtype)
    return tf.cast(_set_size(process_set), dtype)


def _set_rank(process_set: ProcessSet) -> int:
    ranks = _basics_mod.process_set_ranks(process_set.process_set_id) or []
    me = _basics_mod.rank()
    return ranks.index(me) if me in ranks else 0


def _waited_at_once() -> dict:
    """``wake=False`` for a single-tensor op enqueued in eager mode, where :func:`run_collective` waits for it
    right away: the caller runs the engine's round itself and spins for the answer, as a synchronous numpy or
    torch op's caller does, instead of arming the engine thread's wake timer and sleeping (a one-float eager
    allreduce at np=2: 0.27-0.45 ms instead of 0.43-0.60).  Decided when the op is built: eagerly, that is
    when it runs; in a graph the completer thread waits (see :mod:`horovod.tensorflow._bridge`)."""
    return {"wake": False} if tf.executing_eagerly() else {}


def _reduction_submit(one: Callable, many: Callable, grouped: bool, **kwargs) -> Callable:
    """The submit function of :func:`run_collective` for an allreduce or reducescatter: one engine op per
    tensor given (``one``), or a group (``many``) that negotiates as a unit."""
    def submit(arrays):
        return Wait(many(arrays, **kwargs) if grouped else [one(arrays[0], **kwargs)])
    return submit


# ---------------------------------------------------------------------------------------------- allreduce
def _grouped_allreduce_raw(tensors: Sequence[tf.Tensor], *, op: int, prescale_factor: float,
                           postscale_factor: float, name: str | None, process_set: ProcessSet,
                           grouped: bool) -> list[tf.Tensor]:
    tensors = [_as_tensor(t) for t in tensors]
    # One flat engine tensor, unless Adasum must combine several tensors each on its own.
    if _direct_path(tensors) and (op != Adasum or len(tensors) == 1):
        return _flat_allreduce(tensors, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                               name=name, process_set=process_set)

    one = functools.partial(_ops.allreduce, **_waited_at_once())
    submit = _reduction_submit(one, _ops.grouped_allreduce, grouped, name=name, op=op,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                               process_set=process_set)
    if not tf.executing_eagerly() and _bridge._queue_path():
        # another rank may take the flat path for this name (its shapes known statically): check alike
        submit = _with_layout_check(submit, name, process_set)
    outs = run_collective(submit, tensors, [t.dtype for t in tensors], "HorovodAllreduce")
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def _direct_path(tensors: list[tf.Tensor]) -> bool:
    """Inside ``tf.function`` (queue receive), static shapes, one plain numeric dtype, not empty."""
    if tf.executing_eagerly() or not _bridge._queue_path():
        return False
    dtype = tensors[0].dtype
    if dtype not in _bridge._DIRECT_DTYPES or any(t.dtype != dtype for t in tensors):
        return False
    if not all(t.shape.is_fully_defined() for t in tensors) or sum(t.shape.num_elements() for t in tensors) == 0:
        return False
    return _bridge.writable_inputs_ok()


_OWN_BUFFER_BYTES = 64 * 1024
"""Results at least this large get a buffer of their own; smaller ones share one (see _flat_allreduce)."""


def _flat_allreduce(tensors: list[tf.Tensor], *, op: int, prescale_factor: float, postscale_factor: float,
                    name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    """Graph-mode (grouped) allreduce as *one* flat engine tensor, reduced in place in TensorFlow's memory.

    The inputs reach the engine as :class:`~horovod.common.ops.Pieces` of one flat tensor (numpy views of
    TensorFlow's buffers; the shared-memory transport copies and reduces straight from them, so nothing
    concatenates them first), and the results are written back into the same buffers, which the graph then
    uses as the results (:func:`_bridge.run_collective`'s ``owned``), each one first made private to the
    collective (:func:`_private`).  In place, every result byte lands where the input byte was just read (in
    cache): a 21 MB allreduce of Keras gradients took 6.6 ms into fresh buffers, 4.7-5.4 in place
    (docs/benchmarks.md).  Every result of 64 KiB or more keeps a buffer of its own, so the optimizer's
    ``lr * grad`` may update it in place as it does locally (TensorFlow never reuses a shared buffer); the small
    ones are 64-byte aligned slices of one more, views rather than copies (:func:`_aligned_layout`).  Every
    rank builds the same graph, so the single name negotiates as the group did."""
    dtype = tensors[0].dtype
    shapes = [t.shape for t in tensors]
    sizes = [s.num_elements() for s in shapes]
    if name and len(tensors) > 1:  # the timeline keeps a row per tensor, named as the grouped path names them
        _basics_mod.show_in_timeline_as(name, [f"{name}_{i + 1}of{len(tensors)}" for i in range(len(tensors))])
    own = [i for i, n in enumerate(sizes) if n * dtype.size >= _OWN_BUFFER_BYTES]
    shared = [i for i, n in enumerate(sizes) if n * dtype.size < _OWN_BUFFER_BYTES]
    starts, shared_total = _aligned_layout([sizes[i] for i in shared], dtype.size)
    # The engine's flat tensor: the shared results' buffer first, then each own result (every rank alike).
    # The small inputs are concatenated here, gaps included (one op, no Python per tensor); the large ones
    # reach the engine as they are.
    flat_in = [_concat_at(starts, shared_total, [tensors[i] for i in shared])] if shared else []
    flat_in += [tf.reshape(tensors[i], [-1]) for i in own]
    owned = _private(flat_in)

    layout = _FlatLayout(name, shapes, process_set)

    def submit(arrays):
        both = arrays[0] if len(arrays) == 1 else _ops.Pieces(arrays, merge=False)
        check = layout.start()
        handle = _ops.allreduce(both, both, name=name, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set, send_now=True)
        del both, arrays[:]  # from here on only the handle holds the views (the Wait drops it when done)
        wait = Wait([handle], lambda _results: [])
        return wait if check is None else wait.with_check(check, layout.finish)

    results = run_collective(submit, [], [], "HorovodAllreduce", owned=owned)
    out: list = [None] * len(tensors)
    if shared:
        flat = results[0]
        flat.set_shape([shared_total])
        for i, start in zip(shared, starts):
            out[i] = tf.reshape(flat[start:start + sizes[i]], shapes[i])
    for i, r in zip(own, results[1:] if shared else results):
        out[i] = tf.reshape(r, shapes[i])
    return out


_layouts_lock = threading.Lock()
_layouts_started: dict[tuple[str | None, int | None], tuple[int, int]] = {}
"""(name, process set id) of a flat allreduce -> the participation epoch in which its layout check was sent.
Kept per name, not per traced function, and set when the check is sent: every rank then sends it at the
same call (a function traced again on one rank only, an aborted step whose check is still in flight) and
never twice at once."""


class _FlatLayout:
    """The check that a flat allreduce's tensors have the same shapes on every rank
    (:mod:`horovod.common.layout_check`): sent with the first reduction of a name in each participation epoch.
    Inside ``tf.function`` the general path sends the same check: a rank whose shapes are not all known
    statically takes it for a name another rank reduces flat."""

    def __init__(self, name: str | None, shapes: Sequence, process_set: ProcessSet) -> None:
        self.name, self.shapes, self.process_set = name, shapes, process_set
        self.key = (name, process_set.process_set_id)

    def start(self):
        """The handle of this call's layout check; None when the name's check was sent in this epoch."""
        epoch = _basics_mod.participation_epoch()
        with _layouts_lock:
            if _layouts_started.get(self.key) == epoch:
                return None
            _layouts_started[self.key] = epoch
        return _ops.allreduce(shape_moments(self.shapes), name=f"{self.name}.layout", op=Sum,
                              process_set=self.process_set, send_now=True)

    def finish(self, sums) -> None:
        if not shapes_agree(sums, shape_moments(self.shapes)):
            raise mismatch_error("tensors", self.name, self.shapes)


def _with_layout_check(submit: Callable, name: str | None, process_set: ProcessSet) -> Callable:
    """``submit`` of the general path, with the layout check the flat path sends (from the arrays' shapes)."""
    def checked(arrays):
        layout = _FlatLayout(name, [a.shape for a in arrays], process_set)
        check = layout.start()
        wait = submit(arrays)
        return wait if check is None else wait.with_check(check, layout.finish)
    return checked


_private_ids = itertools.count()


def _private(flat: list[tf.Tensor]) -> list[tf.Tensor]:
    """``flat`` (1-D tensors), each as a buffer no other op reads: the tensor's own buffer when nothing else
    holds it (a gradient made for this allreduce alone), a copy otherwise (a tensor read elsewhere too, a
    variable's value, a constant, one tensor given twice).

    ``Snapshot`` makes that choice at run time, from the buffer's reference count.  Two graph rewrites would
    defeat it, and both are blocked: constant folding replaces ``Snapshot(constant)`` -- also of a
    ``zeros_like`` Grappler turned into one -- by a constant, which the function reuses on every call (so each
    Snapshot reads its input through a slice whose start, always 0, comes from ``Timestamp``, which nothing
    can fold); and common-subexpression elimination merges two Snapshots of one tensor into one buffer
    reduced twice (so each carries an attribute of its own).  Reading through a slice costs nothing: a slice
    of all of a tensor is the tensor's buffer."""
    begin = tf.reshape(tf.minimum(tf.cast(tf.raw_ops.Timestamp(), tf.int64), 0), [1])
    out = []
    for t in flat:
        snap = tf.raw_ops.Snapshot(input=tf.slice(t, begin, [-1]))
        snap.op._set_attr("_horovod_private", tf.compat.v1.AttrValue(i=next(_private_ids)))
        snap.set_shape(t.shape)
        out.append(snap)
    return out


def _concat_at(starts: list[int], total: int, tensors: list[tf.Tensor]) -> tf.Tensor:
    """``tensors`` flattened into one 1-D tensor of ``total`` elements, each at its start, zeros between."""
    dtype = tensors[0].dtype
    parts, at = [], 0
    for start, t in zip(starts, tensors):
        if start > at:
            parts.append(tf.zeros([start - at], dtype))
        parts.append(tf.reshape(t, [-1]))
        at = start + t.shape.num_elements()
    if total > at:
        parts.append(tf.zeros([total - at], dtype))
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


_SLICE_ALIGN_BYTES = 64  # TensorFlow shares a dim-0 slice's buffer only when both its ends are this aligned


def _aligned_layout(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Start of each tensor in the flat buffer (a multiple of 64 bytes) and the buffer's length.

    A tensor that starts and ends on such a boundary comes out of the flat result as a view, not a copy:
    without the gaps one odd-sized tensor shifts every later gradient off the boundary and TensorFlow copies
    them all (MobileNetV2 and the dense benchmark models happen to be aligned already).  One tensor is
    reduced as it is."""
    if len(sizes) == 1:
        return [0], sizes[0]
    align = max(1, _SLICE_ALIGN_BYTES // itemsize)
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += -(-n // align) * align
    return starts, at


@_plain
def _allreduce(tensor, name: str | None = None, op: int = Sum, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Raw allreduce op (no compression, no IndexedSlices) with its gradient."""
    tensor = _as_tensor(tensor)
    core = _core_name("HorovodAllreduce", tensor, name, ignore_name_scope)

    @_differentiable
    def fwd(x):
        out = _grouped_allreduce_raw([x], op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, name=core, process_set=process_set,
                                     grouped=False)[0]

        def grad(dy):
            return _allreduce(dy, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              ignore_name_scope=ignore_name_scope, process_set=process_set)
        return out, grad

    return fwd(tensor)


@_plain
def allreduce(tensor, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression=None, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False):
    """Reduce ``tensor`` over the process set (default: average); ``tf.IndexedSlices`` are allgathered.

    Example::

        avg = hvd.allreduce(tf.constant([1.0, 2.0]))           # same on every rank
        total = hvd.allreduce(x, op=hvd.Sum, name="total")
    """
    from horovod.tensorflow.compression import Compression

    compression = compression or Compression.none
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if op == Adasum:
            raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                      "workaround please pass sparse_as_dense=True to DistributedOptimizer")
        if op not in (Average, Sum):
            raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
        base = name or (None if tf.executing_eagerly() else f"HorovodAllgather_{_tensor_name(tensor.values)}")
        values = allgather(tensor.values, name=None if base is None else base + "_values",
                           process_set=process_set, ignore_name_scope=ignore_name_scope)
        indices = allgather(tensor.indices, name=None if base is None else base + "_indices",
                            process_set=process_set, ignore_name_scope=ignore_name_scope)
        if op == Average and size_read_at_run_time():
            values = values / set_size_tensor(process_set, values.dtype)
        elif op == Average:  # Sum, then / size
            values = values * tf.cast(data_plane_op(op, 1.0, _set_size(process_set))[1], values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    tensor = _as_tensor(tensor)
    if op == Adasum:
        _ops.check_adasum(tensor.dtype.as_numpy_dtype)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                         process_set=process_set)
    return compression.decompress(reduced, ctx)


@_plain
def grouped_allreduce(tensors, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
                      compression=None, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None):
    """Allreduce a list of tensors as one group (negotiated and fused together)."""
    from horovod.tensorflow.compression import Compression

    if not tensors:
        return tensors
    compression = compression or Compression.none
    op = handle_average_backwards_compatibility(op, average)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set,
                          name=None if name is None else f"{name}_{i}", ignore_name_scope=ignore_name_scope)
                for i, t in enumerate(tensors)]
    tensors = [_as_tensor(t) for t in tensors]
    if op == Adasum:
        for t in tensors:
            _ops.check_adasum(t.dtype.as_numpy_dtype)
    if len({t.dtype for t in tensors}) > 1:
        raise tf.errors.InvalidArgumentError(None, None,
                                             "Tensors in a grouped allreduce must all have the same dtype.")
    pairs = [compression.compress(t) for t in tensors]
    core = _group_core_name("HorovodGroupedAllreduce", tensors, name, ignore_name_scope)

    @_differentiable
    def fwd(*xs):
        outs = _grouped_allreduce_raw(list(xs), op=op, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, name=core, process_set=process_set,
                                      grouped=True)

        def grad(*dys):
            return grouped_allreduce(list(dys), op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, process_set=process_set,
                                     ignore_name_scope=ignore_name_scope)
        return outs, grad

    reduced = fwd(*[c for c, _ in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


# ---------------------------------------------------------------------------------------------- allgather
def _allgather_raw(tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet,
                   grouped: bool) -> list[tf.Tensor]:
    wake = _waited_at_once()

    def submit(arrays):
        if grouped:
            handles = _ops.grouped_allgather(arrays, name=name, process_set=process_set)
        else:
            handles = [_ops.allgather(arrays[0], name=name, process_set=process_set, **wake)]
        return Wait(handles)

    outs = run_collective(submit, tensors, [t.dtype for t in tensors], "HorovodAllgather")
    for o, t in zip(outs, tensors):
        if t.shape.rank is not None:
            o.set_shape([None] + t.shape.as_list()[1:] if t.shape.rank > 0 else [None])
    return outs


def _allgather_grad(dy, x, process_set: ProcessSet, ignore_name_scope: bool):
    dy = _allreduce(dy, op=Average, ignore_name_scope=ignore_name_scope, process_set=process_set)
    d = tf.reshape(tf.shape(x, out_type=tf.int32)[0], [1])
    sizes = _allgather_raw([d], _core_name("HorovodAllgather", d, None, ignore_name_scope), process_set, False)[0]
    offset = tf.reduce_sum(sizes[:_set_rank(process_set)])
    return dy[offset:offset + d[0]]


@_plain
def allgather(tensor, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every member's ``tensor`` along dimension 0 (sizes may differ per rank)."""
    tensor = _as_tensor(tensor)
    core = _core_name("HorovodAllgather", tensor, name, ignore_name_scope)

    @_differentiable
    def fwd(x):
        out = _allgather_raw([x], core, process_set, False)[0]

        def grad(dy):
            return _allgather_grad(dy, x, process_set, ignore_name_scope)
        return out, grad

    return fwd(tensor)


@_plain
def grouped_allgather(tensors, name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set):
    """Allgather a list of tensors as one group."""
    if not tensors:
        return tensors
    tensors = [_as_tensor(t) for t in tensors]
    core = _group_core_name("HorovodGroupedAllgather", tensors, name, ignore_name_scope)

    @_differentiable
    def fwd(*xs):
        outs = _allgather_raw(list(xs), core, process_set, True)

        def grad(*dys):
            return [_allgather_grad(dy, x, process_set, ignore_name_scope) for dy, x in zip(dys, xs)]
        return outs, grad

    return fwd(*tensors)


# ---------------------------------------------------------------------------------------------- broadcast
def _broadcast_raw(tensor: tf.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    wake = _waited_at_once()

    def submit(arrays):
        return Wait([_ops.broadcast(arrays[0], root_rank, name=name, process_set=process_set, **wake)])

    out = run_collective(submit, [tensor], [tensor.dtype], "HorovodBroadcast")[0]
    out.set_shape(tensor.shape)
    return out


@_plain
def broadcast(tensor, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every member (``root_rank`` is a global rank)."""
    root_rank = _ops.root_rank_index(root_rank)
    tensor = _as_tensor(tensor)
    core = _core_name("HorovodBroadcast", tensor, name, ignore_name_scope)

    @_differentiable
    def fwd(x):
        out = _broadcast_raw(x, root_rank, core, process_set)

        def grad(dy):
            reduced = _allreduce(dy, op=Average, ignore_name_scope=ignore_name_scope, process_set=process_set)
            return reduced if _basics_mod.rank() == root_rank else reduced * 0
        return out, grad

    return fwd(tensor)


@_plain
def broadcast_(variables, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set):
    """In-place broadcast of variables from ``root_rank``; returns the updated values."""
    single = not isinstance(variables, (list, tuple))
    vs = [variables] if single else list(variables)
    kinds = {isinstance(v, tf.Variable) for v in vs}
    if kinds != {True}:
        raise ValueError("broadcast_ requires all arguments to be tf.Variable (resource variables)")
    outs = []
    for i, v in enumerate(vs):
        vname = None if name is None else (name if single else f"{name}_{i}")
        value = broadcast(v.read_value() if hasattr(v, "read_value") else v, root_rank,
                          name=vname, process_set=process_set)
        outs.append(v.assign(value))
    return outs[0] if single else outs


# ---------------------------------------------------------------------------------------------- alltoall
@_plain
def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set):
    """Scatter slices of ``tensor`` to members; returns ``output`` or ``(output, received_splits)``."""
    tensor = _as_tensor(tensor)
    core = _core_name("HorovodAlltoall", tensor, name, ignore_name_scope)
    with_splits = splits is not None
    split_t = tf.convert_to_tensor(splits if with_splits else np.zeros(0, np.int32))
    if with_splits and split_t.dtype != tf.int32:
        raise tf.errors.InvalidArgumentError(None, None,
                                             "alltoall expects splits to contain 32-bit integer elements.")

    def submit(arrays):
        h = _ops.alltoall(arrays[0], arrays[1] if with_splits else None, name=core, process_set=process_set)

        def finish():
            out, received = h.wait()
            return [out, np.asarray(received, np.int32)]
        return finish

    @_differentiable
    def fwd(x):
        out, received = run_collective(submit, [x, split_t], [x.dtype, tf.int32], "HorovodAlltoall")
        if x.shape.rank is not None and x.shape.rank > 0:
            out.set_shape([None] + x.shape.as_list()[1:])
        received.set_shape([None])

        def grad(dy, _unused=None):
            return alltoall(dy, splits=received, ignore_name_scope=ignore_name_scope, process_set=process_set)[0]
        return (out, received), grad

    out, received = fwd(tensor)
    return (out, received) if with_splits else out


# ---------------------------------------------------------------------------------------------- reducescatter
def _reducescatter_raw(tensors, *, op, prescale_factor, postscale_factor, name, process_set, grouped):
    submit = _reduction_submit(_ops.reducescatter, _ops.grouped_reducescatter, grouped, name=name, op=op,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                               process_set=process_set)
    outs = run_collective(submit, tensors, [t.dtype for t in tensors], "HorovodReducescatter")
    for o, t in zip(outs, tensors):
        if t.shape.rank is not None and t.shape.rank > 0:
            o.set_shape([None] + t.shape.as_list()[1:])
    return outs


def _reducescatter_grad(dy, op, process_set, ignore_name_scope, prescale_factor=1.0, postscale_factor=1.0):
    """Upstream's reducescatter gradient: ``allgather(dy)``, × the set size for Sum (as the allreduce
    gradient sums every rank's identical ``dy``), × the scale factors; Average is ``allgather(dy)``."""
    if op == Sum:
        dy = dy * set_size_tensor(process_set, dy.dtype)
    scale = prescale_factor * postscale_factor
    if scale != 1.0:
        dy = dy * tf.cast(scale, dy.dtype)
    return allgather(dy, ignore_name_scope=ignore_name_scope, process_set=process_set)


def _check_rs_op(op):
    if op not in (Average, Sum):
        raise tf.errors.InvalidArgumentError(None, None, "Reducescatter currently only supports AVERAGE and SUM.")


@_plain
def reducescatter(tensor, device_dense: str = "", compression=None, op: int = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over members and return this member's block of dimension 0 (earlier ranks get extra rows)."""
    from horovod.tensorflow.compression import Compression

    compression = compression or Compression.none
    _check_rs_op(op)
    tensor = _as_tensor(tensor)
    core = _core_name("HorovodReducescatter", tensor, name, ignore_name_scope)
    compressed, ctx = compression.compress(tensor)

    @_differentiable
    def fwd(x):
        out = _reducescatter_raw([x], op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 name=core, process_set=process_set, grouped=False)[0]

        def grad(dy):
            return _reducescatter_grad(dy, op, process_set, ignore_name_scope, prescale_factor, postscale_factor)
        return out, grad

    return compression.decompress(fwd(compressed), ctx)


@_plain
def grouped_reducescatter(tensors, device_dense: str = "", compression=None, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None,
                          ignore_name_scope: bool = False):
    """Reducescatter a list of tensors as one group."""
    from horovod.tensorflow.compression import Compression

    if not tensors:
        return tensors
    compression = compression or Compression.none
    _check_rs_op(op)
    tensors = [_as_tensor(t) for t in tensors]
    core = _group_core_name("HorovodGroupedReducescatter", tensors, name, ignore_name_scope)
    pairs = [compression.compress(t) for t in tensors]

    @_differentiable
    def fwd(*xs):
        outs = _reducescatter_raw(list(xs), op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=core, process_set=process_set,
                                  grouped=True)

        def grad(*dys):
            return [_reducescatter_grad(dy, op, process_set, ignore_name_scope, prescale_factor, postscale_factor)
                    for dy in dys]
        return outs, grad

    outs = fwd(*[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ---------------------------------------------------------------------------------------------- join / barrier
@_plain
def join() -> tf.Tensor:
    """Stop contributing until every rank joined; returns (int32 scalar) the last rank that joined."""
    def submit(_arrays):
        h = _ops.join()
        return lambda: [np.int32(h.wait())]

    out = run_collective(submit, [tf.constant(0)], [tf.int32], "HorovodJoin")[0]
    out.set_shape([])
    return out


@_plain
def barrier(process_set: ProcessSet = global_process_set):
    """Block until every member of ``process_set`` reached the barrier (an op in graph mode)."""
    def submit(_arrays):
        h = _ops.barrier(process_set)
        return lambda: [h.wait(), np.int32(0)][1:]

    out = run_collective(submit, [tf.constant(0)], [tf.int32], "HorovodBarrier")[0]
    return None if tf.executing_eagerly() else out


# ---------------------------------------------------------------------------------------------- graph-time ints
def _int_op(fn, name: str | None) -> tf.Tensor:
    """Before ``hvd.init()``: upstream's ``FailedPreconditionError``, eagerly and when traced in ``tf.function``
    (upstream's kernels check initialisation first), not ``ValueError``/``InvalidArgumentError``."""
    if tf.executing_eagerly():
        try:
            value = fn()
        except ValueError as e:
            if str(e) == _basics_mod.NOT_INITIALIZED:
                raise tf.errors.FailedPreconditionError(None, None, str(e)) from e
            raise
        return tf.constant(value, dtype=tf.int32)
    _bridge.refuse_xla(name or "HorovodRank")
    _bridge.refuse_before_init_when_traced()
    out = tf.numpy_function(lambda: np.int32(fn()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


@_plain
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """Number of ranks in the process set, evaluated when the graph runs."""
    return _int_op(lambda: len(_basics_mod.process_set_ranks(process_set_id) or []), name)


@_plain
def local_size_op(name: str | None = None) -> tf.Tensor:
    return _int_op(_basics_mod.local_size, name)


@_plain
def rank_op(name: str | None = None) -> tf.Tensor:
    return _int_op(_basics_mod.rank, name)


@_plain
def local_rank_op(name: str | None = None) -> tf.Tensor:
    return _int_op(_basics_mod.local_rank, name)


@_plain
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    return _int_op(lambda: int(_basics_mod.rank() in (_basics_mod.process_set_ranks(process_set_id) or [])),
                   name)
