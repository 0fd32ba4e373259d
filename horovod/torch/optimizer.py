"""``DistributedOptimizer``: averages gradients over the ranks while ``loss.backward()`` is still running.

Each parameter gets a ``register_post_accumulate_grad_hook``; when its gradient is complete (and, with
``backward_passes_per_step=N``, on the N-th backward pass) the hook starts an in-place ``allreduce_async_``
of ``p.grad``, so communication overlaps the rest of the backward pass.  The engine fuses gradients that
become ready together.  Small dense CPU gradients (at most ``_SMALL_BYTES``) are instead copied into flat
*buckets* of up to ``_BUCKET_BYTES`` (in reverse registration order, the order backward produces them, as
DDP does), and a bucket is reduced as one tensor once all its gradients are in: a model with hundreds of
small parameter tensors (LayerNorm, biases) costs the engine a dozen requests per step instead of hundreds,
and the copies (in C++) cost less than the engine's Python work per tensor.  The first hook of a backward
pass also queues an autograd *final callback* (as DistributedDataParallel does) that waits for the started
reductions before ``backward()`` returns, so code that reads gradients between ``backward()`` and
``step()`` (clipping, ``GradScaler.unscale_``) sees averaged gradients without calling ``synchronize()``.
``step()`` reduces whatever is left (parameters whose hook never fired get zero gradients) and then runs
the wrapped optimizer.

The wrapper holds the user's optimizer instead of subclassing it at run time (upstream builds
``type(name, (optimizer.__class__,), ...)``).  It still reports the wrapped class — ``isinstance(opt,
torch.optim.SGD)`` and ``opt.__class__.__name__ == "SGD"`` hold, so LR schedulers and ``GradScaler`` accept
it — and every attribute it does not define (``param_groups``, ``state``, ``state_dict``...) is the wrapped
optimizer's.  Pickling it pickles the wrapped optimizer: hooks and handles belong to this process.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from horovod.base.config import read_env
from horovod.base.reduce_ops import predivide_scales
from horovod.common import basics
from horovod.common.basics import Adasum, Average, Sum
from horovod.common.layout_check import (
    mismatch_error,
    parameter_moments,
    parameters_mismatch_error,
    shape_moments,
    shapes_agree,
)
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.util import split_list
from horovod.runtime.engine import DUPLICATE_NAME_MESSAGE
from horovod.torch.compression import Compression, Compressor
from horovod.torch.mpi_ops import (
    allreduce_async_,
    grouped_allreduce_async_,
    sparse_allreduce_async,
    synchronize,
)

__all__ = ["DistributedOptimizer"]

log = logging.getLogger(__name__)

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


# Gradients of at most _SMALL_BYTES go through buckets of up to _BUCKET_BYTES (DDP's default bucket cap).  A
# larger gradient is reduced alone as soon as it is ready (no copy, and it overlaps the rest of backward).
# Measured on the 164-tensor model of benchmarks/torch_training.py (np=2, CPU time per step, one launch):
# per-tensor 38-42 ms, 1 MiB buckets 38.6, 4 MiB 33-35, one bucket 31, DDP 35.5; on the MLP (8 tensors, 3 of
# them > 256 KiB) the small ones in one bucket cost the same CPU as reducing them alone.  A first bucket of
# 1-2 MiB (DDP starts with 1 MiB) cost 1.2 ms more CPU per step there and gained no wall time.
_SMALL_BYTES = 256 * 1024
_BUCKET_BYTES = 25 * 1024 * 1024
_BUCKET_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})


class _Bucket:
    """A flat buffer shared by several small gradients (``slots[i]`` is ``params[i]``'s view of it) and this
    step's fill state: which slots hold their gradient, which parameters went their own way (sparse)."""

    __slots__ = ("name", "params", "flat", "slots", "filled", "skipped", "sparse_dims", "launched",
                 "layout_checked_in")

    def __init__(self, name: str, params: list[torch.Tensor]) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        # the same name on every rank whatever the layout: a bucket of another size is the engine's shape
        # mismatch error at once (a name with the size in it never matched: a stall)
        self.name = name
        # the participation epoch (basics.participation_epoch()) in which every rank's bucket was found to hold
        # the same shapes: checked at the bucket's first reduction in each, as every rank of a new generation
        # (an elastic reset, init() again) or after a join() (a joined rank never sent the check) must send it
        self.layout_checked_in = (0, 0)
        self.slots, offset = [], 0
        for p in params:
            self.slots.append(self.flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.filled: set[int] = set()
        self.skipped: set[int] = set()
        # slot i -> sparse_dim() of a sparse gradient reduced densely in its slot (sparse_as_dense): handed back
        # in that layout
        self.sparse_dims: dict[int, int] = {}
        self.launched = False

    def reset(self) -> None:
        self.filled.clear()
        self.skipped.clear()
        self.sparse_dims.clear()
        self.launched = False

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.params]

    def layout_moments(self) -> torch.Tensor:
        """The members' :func:`~horovod.common.layout_check.shape_moments`."""
        return torch.from_numpy(shape_moments(self.shapes()))


class _BucketReduction:
    """The started allreduce of one bucket; ``finish()`` copies the averaged slots back into the gradients.
    ``layouts`` is the sum of every rank's :meth:`_Bucket.layout_moments`, started with the bucket's first
    reduction."""

    __slots__ = ("bucket", "handle", "layouts", "done")

    def __init__(self, bucket: _Bucket, handle, layouts=None) -> None:
        self.bucket = bucket
        self.handle = handle
        self.layouts = layouts
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        bucket = self.bucket
        if self.layouts is not None:
            self._check_layouts(synchronize(self.layouts))
        synchronize(self.handle)
        members = [i for i in range(len(bucket.params))
                   if i not in bucket.skipped and i not in bucket.sparse_dims] \
            if bucket.skipped or bucket.sparse_dims else range(len(bucket.params))
        torch._foreach_copy_([bucket.params[i].grad for i in members], [bucket.slots[i] for i in members])
        for i, sparse_dim in bucket.sparse_dims.items():
            bucket.params[i].grad = bucket.slots[i].clone().to_sparse(sparse_dim)

    def _check_layouts(self, sums: torch.Tensor) -> None:
        bucket = self.bucket
        if shapes_agree(sums.tolist(), bucket.layout_moments().tolist()):
            bucket.layout_checked_in = basics.participation_epoch()
            return
        with contextlib.suppress(Exception):  # the bucket's own allreduce: done, or failed on the shapes
            synchronize(self.handle)
        raise mismatch_error("gradients", bucket.name, bucket.shapes())  # as the engine's own shape mismatch


class _Reduction:
    """One started allreduce of one parameter or group; ``finish()`` writes the results into ``p.grad``.

    ``sparse_dims[i]`` is the ``sparse_dim()`` of parameter i's gradient when it was sparse and reduced
    densely (``sparse_as_dense``): the result goes back into ``p.grad`` in that sparse layout, which
    optimizers such as ``SparseAdam`` require.
    """

    __slots__ = ("params", "tensors", "ctxs", "handle", "compression", "sparse_dims", "frozen", "done")

    def __init__(self, params, tensors, ctxs, handle, compression, sparse_dims=None, frozen=()) -> None:
        self.params = params
        self.tensors = tensors
        self.ctxs = ctxs
        self.handle = handle
        self.compression = compression
        self.sparse_dims = sparse_dims or [None] * len(params)
        self.frozen = frozen  # members sent as zeros for the group's sake, their gradients left alone
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        if callable(self.handle):  # sparse: two allgathers behind a callable
            self.params[0].grad = self.handle()
            return
        synchronize(self.handle)
        for p, t, ctx, sparse_dim in zip(self.params, self.tensors, self.ctxs, self.sparse_dims):
            if p in self.frozen:
                continue
            out = self.compression.decompress(t, ctx)
            if sparse_dim is not None:
                p.grad = out.to_sparse(sparse_dim)
            elif out is not p.grad:
                p.grad.copy_(out)


# DistributedOptimizers made so far in this process, per init() and process set: the next one's ordinal names
# its parameter check (see _DistributedOptimizer._check_parameters)
_optimizers_made: collections.Counter = collections.Counter()


def _next_ordinal(process_set: ProcessSet) -> int:
    """k for the k-th DistributedOptimizer this process makes over ``process_set`` (counted per set: a rank
    outside a set makes none of its optimizers, and names are the engine's per set).  Every rank of a correct
    program makes its optimizers in the same order, whatever their parameters, so the names an optimizer
    makes from it (its parameter check, ``parameters_of.optimizer.<k>``; its groups, ``optimizer.<k>.group.<i>``)
    are the same on every rank and another optimizer's (a GAN's) never.  A name taken from the parameters (the
    first one's, before) differed exactly when the check had something to report, and the ranks' checks
    never met: a stall instead of the error.

    Counted since this process's latest ``init()``: an elastic worker that joins a running job makes its
    optimizers in its first generation, the survivors may have made theirs (again) after the reset; counted
    over the process's life, a survivor that re-creates its optimizer at each reset named its check after the
    number of resets it had seen, and no newcomer's check met it."""
    ranks = process_set.process_set_id if process_set.process_set_id is not None else tuple(process_set.ranks or ())
    key = (basics.generation(), ranks)
    k = _optimizers_made[key]
    _optimizers_made[key] += 1
    return k


@contextlib.contextmanager
def _naming_another_optimizer(name: str) -> Iterator[None]:
    """Upstream's duplicate-name error, with its likely cause here: two optimizers (a GAN's generator and
    discriminator) whose parameters have the same names (``model.named_parameters()`` of two models built
    alike, or none given), whose hooks both fire in one backward pass."""
    try:
        yield
    except ValueError as e:
        if str(e) != DUPLICATE_NAME_MESSAGE:
            raise
        raise ValueError(f"{e}  ({name!r}: another DistributedOptimizer reduces a parameter of this name; give "
                         "each optimizer's parameters their own names, e.g. named_parameters=generator."
                         "named_parameters(prefix='generator'))") from None


class _DistributedOptimizer:
    """See :func:`DistributedOptimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters, compression: type[Compressor],
                 backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                 groups, sparse_as_dense: bool, process_set: ProcessSet) -> None:
        self._optimizer = optimizer
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._parameter_names = self._names(named_parameters)
        self._groups = self._make_groups(groups)
        self._group_of: dict[torch.Tensor, int] = {p: i for i, g in enumerate(self._groups or []) for p in g}
        self._pending: dict[torch.Tensor, _Reduction] = {}
        self._reduced_grads: dict[torch.Tensor, weakref.ref] = {}  # the gradient tensor each reduction used
        self._seen: set[torch.Tensor] = set()
        self._group_ready: dict[int, set] = {}
        self._delay: dict[torch.Tensor, int] = {}
        self._hook_handles: list = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[torch.Tensor, tuple[_Bucket, int]] = {}
        self._callback_queued = False
        self._synchronized = False
        self._should_synchronize = True
        set_size = process_set.size() if process_set.included() else 0
        self._active = bool(process_set.included()) and (
            (set_size or 0) > 1 or read_env("HOROVOD_ELASTIC"))
        self._requires_update: list[torch.Tensor] = []
        self._frozen: list[torch.Tensor] = []  # parameters that did not require a gradient when registered
        self._sparse_dims: dict[torch.Tensor, int] = {}  # parameters whose gradients have been sparse: sparse_dim
        # the participation epoch in which every rank's parameters were found the same (_check_parameters), and
        # the check's reduction while it is in flight
        self._parameters_checked_in = (0, 0)
        self._parameters_check: Any = None
        self._trainable_checked: tuple = ()  # which of _requires_update required a gradient at the last check
        self._ordinal = _next_ordinal(process_set)
        self._parameters_check_name = f"parameters_of.optimizer.{self._ordinal}"
        self._parameters_looked_at = False  # this step (one look per step: the hooks are the hot path)
        self._register_hooks(p for group in optimizer.param_groups for p in group["params"])

    # ------------------------------------------------------------------ looks like the wrapped optimizer
    @property
    def __class__(self):  # noqa: D401 - isinstance(opt, torch.optim.SGD) and LR schedulers rely on this
        return self._optimizer.__class__

    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __reduce_ex__(self, protocol):
        return self._optimizer.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    # ------------------------------------------------------------------ construction helpers
    def _names(self, named_parameters) -> dict[torch.Tensor, str]:
        groups = self._optimizer.param_groups
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            # upstream's allreduce.noname.<g>.<i>; ours stay cacheable (the engine never caches "*.noname.*")
            named_parameters = [(f"param.{i}.{j}", v) for i, group in enumerate(groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                             "produced by model.named_parameters().")
        counts = collections.Counter(k for k, _ in named_parameters)
        dups = sorted(k for k, n in counts.items() if n > 1)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                             + ", ".join(dups))
        all_ids = {id(v) for group in groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             "Python object ids: " + ", ".join(str(i) for i in unnamed))
        return {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}

    def _make_groups(self, groups) -> list[list[torch.Tensor]] | None:
        if groups is None or groups == 0:
            return None
        if isinstance(groups, list):
            seen: set[int] = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
            # as upstream: only what this optimizer updates (a frozen parameter listed in a group got a zero
            # gradient, and momentum or weight decay moved it)
            trained = {id(p) for g in self._optimizer.param_groups for p in g["params"] if p.requires_grad}
            return [kept for g in groups if (kept := [p for p in g if id(p) in trained])]
        if not isinstance(groups, int) or groups < 0:
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        params = [p for group in self._optimizer.param_groups for p in group["params"] if p.requires_grad]
        return [g for g in split_list(params, min(groups, max(len(params), 1))) if g]

    def _register_hooks(self, params: Iterable[torch.Tensor]) -> None:
        me = weakref.ref(self)
        added = []
        for p in params:
            if not p.requires_grad:
                self._frozen.append(p)
                continue
            added.append(p)
            self._requires_update.append(p)
            self._delay[p] = self.backward_passes_per_step
            if p not in self._parameter_names:
                self._parameter_names[p] = f"param.extra.{len(self._parameter_names)}"
            if self._active:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(me)))
        if self._active:
            self._make_buckets(added)
            self._parameters_checked_in = (0, 0)  # parameters added (unfrozen): every rank checks again

    def _make_buckets(self, params: list[torch.Tensor]) -> None:
        """Buckets for the small dense CPU parameters among ``params``, in reverse order (backward's), by dtype.

        Only without explicit groups and compression; every rank builds the same buckets from the same
        model, so a bucket's name and size negotiate like a parameter's."""
        if self._groups is not None or self._compression is not Compression.none:
            return
        open_: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}

        def close(dtype: torch.dtype) -> None:
            members = open_.pop(dtype, [])
            sizes.pop(dtype, None)
            if len(members) > 1:
                # named after its first gradient: unique across optimizers (bucket.<i> was not), the same on
                # every rank; the timeline draws it on its gradients' rows (issue 11: a row per tensor)
                bucket = _Bucket(f"bucket.{self._parameter_names[members[0]]}", members)
                basics.show_in_timeline_as(f"allreduce.{bucket.name}",
                                           [f"allreduce.{self._parameter_names[p]}" for p in members])
                self._buckets.append(bucket)
                for i, p in enumerate(members):
                    self._bucket_of[p] = (bucket, i)

        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if p.device.type != "cpu" or p.layout != torch.strided or p.dtype not in _BUCKET_DTYPES \
                    or nbytes > _SMALL_BYTES or p in self._bucket_of:
                continue
            if sizes.get(p.dtype, 0) + nbytes > _BUCKET_BYTES:
                close(p.dtype)
            open_.setdefault(p.dtype, []).append(p)
            sizes[p.dtype] = sizes.get(p.dtype, 0) + nbytes
        for dtype in list(open_):
            close(dtype)

    # ------------------------------------------------------------------ hooks
    def _grad_ready(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            reduced = self._reduced_grads.get(p)
            if reduced is None or reduced() is p.grad or any(not r.done for r in self._pending.values()):
                raise AssertionError(_TOO_MANY_PASSES)
            # a new gradient tensor since the last reduction: the gradients were cleared behind our back
            # (model.zero_grad() after a step that GradScaler skipped), so this is the next step's first pass
            self._reset_counters()
        self._delay[p] -= 1
        self._seen.add(p)
        if self._delay[p] > 0:
            return
        self._queue_final_callback()
        if self._groups is None or p not in self._group_of:
            in_bucket = self._bucket_of.get(p)
            if in_bucket is None:
                self._launch([p])
            else:
                self._fill(*in_bucket)
            return
        earlier = self._pending.get(p)
        if earlier is not None and earlier.done:  # its group went out at the end of an earlier pass: alone
            self._launch([p])
            return
        gid = self._group_of[p]
        ready = self._group_ready.setdefault(gid, set())
        ready.add(p)
        if len(ready) == len(self._groups[gid]):
            self._launch(self._groups[gid], gid)

    def _queue_final_callback(self) -> None:
        if self._callback_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_started)
            self._callback_queued = True
        except RuntimeError:  # not inside a backward pass: step()/synchronize() will wait instead
            pass

    def _finish_started(self) -> None:
        """End of a step's last backward pass: start what it gave no gradient (zeros, as DDP's unused
        parameters), then wait for every reduction.  Another rank's pass may have used what this one did not
        (a dynamic forward: experts, branches) and wait for it here; starting it only in ``step()`` deadlocked.
        A gradient that a later backward pass of the same step brings is reduced again, alone."""
        self._callback_queued = False
        self._launch_the_rest()
        try:
            self._await_check()
        except BaseException:
            self._reset_counters()
            raise
        for reduction in {id(r): r for r in self._pending.values()}.values():
            reduction.finish()

    def _launch_the_rest(self) -> None:
        """Start every reduction not started in this step, with zeros for the gradients that did not come."""
        if self._groups is not None:
            for gid, group in enumerate(self._groups):
                if group[0] not in self._pending:
                    self._launch(group, gid)
        for bucket in self._buckets:
            if not bucket.launched:
                self._launch_bucket(bucket)
        for p in self._requires_update:
            if p not in self._pending and p.requires_grad:
                self._launch([p])

    def _fill(self, bucket: _Bucket, i: int) -> None:
        """Copy parameter i's gradient into its slot; reduce the bucket once every slot is in."""
        p = bucket.params[i]
        grad = p.grad
        if bucket.launched:  # by the end of an earlier backward pass of this step (a second loss): alone
            bucket.skipped.add(i)
            self._launch([p])
            return
        if grad is None:
            p.grad = grad = self._no_grad(p)
        self._put(bucket, i, grad)
        self._reduced_grads[p] = weakref.ref(grad)
        bucket.filled.add(i)
        if len(bucket.filled) == len(bucket.params):
            self._launch_bucket(bucket)

    def _put(self, bucket: _Bucket, i: int, grad: torch.Tensor) -> None:
        """Parameter i's gradient into its slot, or reduced on its own.  What a rank without this gradient
        sends must match what the others send: zeros in the slot (a dense gradient, or a sparse one with
        ``sparse_as_dense``: densely in the slot, as upstream reduced it, handed back sparse), or an empty
        sparse gradient alone (see :meth:`_no_grad`)."""
        if grad.is_sparse and self.sparse_as_dense and grad.dtype == bucket.flat.dtype:
            bucket.slots[i].copy_(grad.to_dense())
            bucket.sparse_dims[i] = grad.sparse_dim()
        elif grad.is_sparse or grad.dtype != bucket.flat.dtype:
            bucket.skipped.add(i)  # reduced on its own
            self._launch([bucket.params[i]])
        elif grad.data_ptr() != bucket.slots[i].data_ptr():
            bucket.slots[i].copy_(grad)

    def _no_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The gradient a rank contributes for a parameter its backward passes did not reach: zeros, sparse
        (no entries) for a parameter whose gradients have been sparse, so that it takes the same path as the
        other ranks' sparse gradients (two allgathers; dense zeros were an allreduce that nobody matched)."""
        sparse_dim = self._sparse_dims.get(p)
        if sparse_dim is not None and not self.sparse_as_dense:
            return torch.sparse_coo_tensor(torch.zeros((sparse_dim, 0), dtype=torch.int64),
                                           torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype), p.shape,
                                           check_invariants=False)
        return torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _launch_bucket(self, bucket: _Bucket) -> None:
        """Start the bucket's allreduce; slots whose hook never fired get the parameter's gradient (or zeros,
        as a parameter reduced alone would).  Called when the last slot fills, at the end of a backward pass
        for a bucket that is partly filled (so every gradient backward produced is averaged when it
        returns), or from ``synchronize()``."""
        for i in range(len(bucket.params)):
            if i not in bucket.filled:
                p = bucket.params[i]
                if not p.requires_grad:  # frozen since: zeros in its slot, its gradient left alone
                    bucket.slots[i].zero_()
                    bucket.filled.add(i)
                    bucket.skipped.add(i)
                    continue
                if p.grad is None:
                    p.grad = self._no_grad(p)
                bucket.filled.add(i)
                self._put(bucket, i, p.grad)
                self._reduced_grads[p] = weakref.ref(p.grad)
        prescale, postscale = predivide_scales(self.op, self.gradient_predivide_factor)
        bucket.launched = True
        with _naming_another_optimizer(self._parameter_names[bucket.params[0]]):
            self._check_parameters()
            layouts = None if bucket.layout_checked_in == basics.participation_epoch() else allreduce_async_(
                bucket.layout_moments(), name=f"{bucket.name}.layout", op=Sum, process_set=self.process_set)
            handle = allreduce_async_(bucket.flat, name=bucket.name, op=self.op, prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=self.process_set)
        reduction = _BucketReduction(bucket, handle, layouts)
        for i, p in enumerate(bucket.params):
            if i not in bucket.skipped:
                self._pending[p] = reduction

    def _launch(self, params: Sequence[torch.Tensor], group_id: int | None = None) -> None:
        # a group's members frozen since it was made (requires_grad=False, no gradient this step): the group
        # sends zeros for them, and their gradients stay as they are
        frozen = {p for p in params if not p.requires_grad and p not in self._seen} if group_id is not None else ()
        for p in params:
            if p in frozen:
                continue
            if p.grad is None:  # no gradient on this rank (unused parameter): contribute zeros
                p.grad = self._no_grad(p)
            elif p.grad.is_sparse:
                self._sparse_dims[p] = p.grad.sparse_dim()
        with _naming_another_optimizer(self._parameter_names[params[0]]):
            self._check_parameters()
        prescale, postscale = predivide_scales(self.op, self.gradient_predivide_factor)
        first = params[0]
        if group_id is None and first.grad.is_sparse and not self.sparse_as_dense:
            handle = sparse_allreduce_async(first.grad, self._parameter_names[first], self.op, self.process_set)
            reduction = _Reduction([first], [], [], handle, self._compression)
        else:
            tensors, ctxs, sparse_dims = [], [], []
            for p in params:
                if p in frozen:
                    compressed, ctx = self._compression.compress(torch.zeros_like(p))
                    tensors.append(compressed)
                    ctxs.append(ctx)
                    sparse_dims.append(None)
                    continue
                grad = p.grad
                sparse_dims.append(grad.sparse_dim() if grad.is_sparse else None)
                if grad.is_sparse:  # sparse_as_dense (or in a group): reduce densely, hand back sparse
                    grad = grad.to_dense()
                    p.grad = grad
                elif not grad.is_contiguous():
                    p.grad = grad = grad.contiguous()
                compressed, ctx = self._compression.compress(grad)
                tensors.append(compressed)
                ctxs.append(ctx)
            if group_id is None:
                with _naming_another_optimizer(self._parameter_names[first]):
                    handle = allreduce_async_(tensors[0], name=self._parameter_names[first], op=self.op,
                                              prescale_factor=prescale, postscale_factor=postscale,
                                              process_set=self.process_set)
            else:
                # named after this optimizer too: group.<i> of a GAN's two optimizers was a duplicate name
                handle = grouped_allreduce_async_(tensors, name=f"optimizer.{self._ordinal}.group.{group_id}",
                                                  op=self.op, prescale_factor=prescale, postscale_factor=postscale,
                                                  process_set=self.process_set)
            reduction = _Reduction(list(params), tensors, ctxs, handle, self._compression, sparse_dims, frozen)
        for p in params:
            self._pending[p] = reduction
            if p not in frozen:
                self._reduced_grads[p] = weakref.ref(p.grad)

    def _trainable_names(self) -> list[str]:
        """The parameters this step reduces: those that require a gradient now (a layer frozen after the
        optimizer was made is left alone, as the wrapped optimizer leaves a parameter without a gradient)."""
        return [self._parameter_names[p] for p in self._requires_update if p.requires_grad]

    def _check_parameters(self) -> None:
        """With a step's first reduction, once per participation epoch: sum every rank's digest of its trainable
        parameters' names under a name every rank sends whatever its parameters (the optimizer's creation
        ordinal, :func:`_next_ordinal`; two optimizers of one process, a GAN's, have their own).  Ranks
        training different models (another number of layers, a layer frozen or renamed on one rank) reduce
        names the others never send, which only stalled; ``synchronize()`` now fails on every rank first
        (:meth:`_await_check`)."""
        if self._parameters_looked_at:
            return
        self._parameters_looked_at = True
        # checked again when layers were frozen or unfrozen since: a rank that froze one the others did not
        # would leave their reductions of it unmatched
        trainable = tuple(p.requires_grad for p in self._requires_update)
        if trainable != self._trainable_checked:
            self._trainable_checked = trainable
            self._parameters_checked_in = (0, 0)
        if self._parameters_check is not None or self._parameters_checked_in == basics.participation_epoch():
            return
        self._parameters_check = allreduce_async_(torch.from_numpy(parameter_moments(self._trainable_names())),
                                                  name=self._parameters_check_name, op=Sum,
                                                  process_set=self.process_set)

    def _await_check(self) -> None:
        check, self._parameters_check = self._parameters_check, None
        if check is None:
            return
        sums = synchronize(check).tolist()
        if not shapes_agree(sums, parameter_moments(self._trainable_names()).tolist()):
            raise parameters_mismatch_error(self._trainable_names())
        self._parameters_checked_in = basics.participation_epoch()

    # ------------------------------------------------------------------ public API (upstream's)
    def synchronize(self) -> None:
        """Finish averaging every gradient now (parameters without a gradient contribute zeros).

        Only needed to modify gradients before ``step()`` in upstream's style; afterwards call ``step()``
        inside ``skip_synchronize()``."""
        if not self._active:
            self._synchronized = True
            return
        if self._frozen:
            self._adopt_unfrozen()
        self._launch_the_rest()
        try:
            self._await_check()
            for reduction in list(self._pending.values()):
                reduction.finish()
        finally:
            self._reset_counters()
        self._synchronized = True

    def _adopt_unfrozen(self) -> None:
        """Hook the parameters unfrozen since they were registered (fine-tuning unfreezes layers as it goes):
        upstream never averaged them, and the ranks drifted apart without a word. This step's gradients of
        theirs are reduced by ``synchronize()``, each alone; later steps' as any other."""
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            self._frozen = [p for p in self._frozen if not p.requires_grad]
            self._register_hooks(unfrozen)

    def _reset_counters(self) -> None:
        self._parameters_looked_at = False
        self._pending.clear()
        self._reduced_grads.clear()
        self._seen.clear()
        self._group_ready.clear()
        for bucket in self._buckets:
            bucket.reset()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A context manager used to specify that optimizer.step() should not perform synchronization.

        It's typically used in a following pattern::

            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Average the remaining gradients, then run the wrapped optimizer's ``step``."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step() if closure is None else self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; refused while a reduction is writing into the gradients.

        Reductions finish before ``backward()`` returns, so after it ``zero_grad()`` simply discards this
        step's gradients and pass counters, as in plain PyTorch (``GradScaler`` skipping ``step()`` on an
        overflow relies on this).  Upstream refused any call between ``backward()`` and ``step()``."""
        if any(not r.done for r in self._pending.values()):
            raise AssertionError(_ZERO_GRAD_RACE)
        self._reset_counters()
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def load_state_dict(self, state_dict: dict) -> None:
        """The wrapped optimizer's ``load_state_dict``; forgets gradients in flight and pass counters."""
        self._reset_counters()
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self._optimizer.add_param_group(param_group)
        self._register_hooks(self._optimizer.param_groups[-1]["params"])

    def remove_hooks(self) -> None:
        """Detach from the parameters (e.g. before wrapping the same model in a new optimizer)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()


def _make_hook(me: weakref.ref):
    def hook(p: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            opt._grad_ready(p)

    return hook


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set):
    """
    An optimizer that wraps another torch.optim.Optimizer, using an allreduce to
    combine gradient values before applying gradients to model weights.

    Allreduce operations are executed after each gradient is computed by ``loss.backward()``
    in parallel with each other, and ``backward()`` returns once the gradients it produced
    are averaged. The ``step()`` method ensures that all allreduce operations are finished
    before applying gradients to the model.

    Gradients are therefore averaged when ``backward()`` returns, so clipping needs no extra
    call. Upstream's pattern, which synchronizes explicitly, still works::

        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with optimizer.skip_synchronize():
            optimizer.step()

    Arguments:
        optimizer: Optimizer to use for computing gradients and applying updates.
        named_parameters: A mapping between parameter names and values. Used for naming of
                          allreduce operations. Typically just ``model.named_parameters()``.
        compression: Compression algorithm used during allreduce to reduce the amount
                     of data sent during each parameter update step.  Defaults to
                     not using compression (``Compression.none``; also ``fp16``, ``bf16``).
        backward_passes_per_step: Number of expected backward passes to perform
                                  before calling step()/synchronize(). This
                                  allows accumulating gradients over multiple
                                  mini-batches before reducing and applying them.
        op: The reduction operation to use when combining gradients across different ranks.
            ``hvd.Adasum`` reduces the deltas of each rank's own optimizer step instead (upstream's
            Adasum optimizer, horovod/torch/adasum_optimizer.py).
        gradient_predivide_factor: If op == Average, gradient_predivide_factor splits the averaging
                                   before and after the sum. Gradients are scaled by
                                   1.0 / gradient_predivide_factor before the sum and
                                   gradient_predivide_factor / size after the sum.
        num_groups: Number of groups to assign gradient allreduce ops to for explicit
                    grouping. Defaults to no explicit groups (deprecated: use ``groups``).
        groups: The parameter to group the gradient allreduce ops. Accept values is a
                non-negative integer or a list of list of torch.Tensor.
                If groups is a non-negative integer, it is the number of groups to assign
                gradient allreduce ops to for explicit grouping.
                If groups is a list of list of torch.Tensor. Tensors in the same
                inner list will be assigned to the same group, while parameter that does
                not appear in any list will form a group itself.
                Defaults as None, which is no explicit groups.
        sparse_as_dense: If set True, convert all sparse gradients to dense and perform allreduce, then
                         convert back to sparse before applying the update.
        process_set: Gradients will only be reduced over Horovod processes belonging
                     to this process set. Defaults to the global process set.

    Returns:
        A wrapper that behaves as ``optimizer`` (same class for ``isinstance``, same ``param_groups``).

    Raises:
        ValueError: for invalid arguments (the message names the argument).
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    basics.engine()  # ValueError before init, as every collective
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the original optimizer once.")
    if op == Adasum and basics.size() > 1:
        from horovod.torch.adasum_optimizer import _DistributedAdasumOptimizer

        return _DistributedAdasumOptimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                                           op, 1.0, None, False, process_set)
    return _DistributedOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                 gradient_predivide_factor, groups, sparse_as_dense, process_set)
