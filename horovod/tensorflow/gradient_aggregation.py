"""Gradient reduction shared by DistributedGradientTape, the TF1 DistributedOptimizer and the Keras optimizer.

One :class:`GradientReducer` holds upstream's options (``op``, ``gradient_predivide_factor``, ``groups``,
``sparse_as_dense``, compression, process set, local variables) and turns a list of gradients into their
reductions.  Dense gradients of one dtype travel as *one* grouped allreduce by default: a single engine
request batch (fused into one buffer) and, in graph mode, a single submit/receive op pair instead of one
per variable.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from horovod.base.reduce_ops import predivide_scales
from horovod.common import basics as _basics
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import (
    Average,
    _normalize_name,
    _tensor_name,
    allreduce,
    grouped_allreduce,
    set_size_tensor,
    size_read_at_run_time,
)
from horovod.tensorflow.util import split_list

__all__ = ["GradientReducer", "check_reduce_args"]


def check_reduce_args(op: int, gradient_predivide_factor: float, groups, num_groups: int = 0) -> None:
    """Upstream's argument checks, with messages that name the argument."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    if num_groups and num_groups < 0:
        raise ValueError("num_groups should be a non-negative integer.")


def _key(var):
    """Hashable identity of a tf.Variable or keras.Variable (Keras 3 variables have no ``ref()``)."""
    return var.ref() if hasattr(var, "ref") else id(var)


class GradientReducer:
    """Reduce gradients across a process set with upstream's options."""

    def __init__(self, *, compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
                 name: str = "", ignore_name_scope: bool = False) -> None:
        check_reduce_args(op, gradient_predivide_factor, groups, num_groups)
        if num_groups and groups is None:
            groups = num_groups
        self.compression = compression or Compression.none
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.predivide = gradient_predivide_factor
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.name = name
        # graph-mode names without the enclosing scopes: Keras 3 applies gradients inside the optimizer's
        # name scope, numbered per process ("sgd", "sgd_1" once another optimizer exists on that rank only)
        self.ignore_name_scope = ignore_name_scope
        self._local_refs: set = set()

    def register_local_var(self, var) -> None:
        """Gradients of ``var`` stay local (not reduced); averaged by set size if ``scale_local_gradients``."""
        self._local_refs.add(_key(var))

    def _is_local(self, var) -> bool:
        if var is None or not self._local_refs:
            return False
        return _key(var) in self._local_refs

    def _set_size(self) -> int:
        ranks = _basics.process_set_ranks(self.process_set.process_set_id)
        return len(ranks) if ranks else 1

    def _scales(self) -> tuple[float, float]:
        return predivide_scales(self.op, self.predivide)

    def reduce(self, grads: Sequence, variables: Sequence | None = None, *,
               use_generic_names: bool = False) -> list:
        """Return the reduced gradients (``None`` entries stay ``None``)."""
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        if not _basics.is_initialized():
            # upstream reduces through size_op/process_set_included_op kernels, which fail with the collectives'
            # class (not the ValueError that asking the process set gives)
            raise tf.errors.FailedPreconditionError(None, None, _basics.NOT_INITIALIZED)
        # a step traced in an elastic job reduces at any size: it may run again after the job grows
        if not self.process_set.included() or (self._set_size() <= 1 and not size_read_at_run_time()):
            return grads
        out = list(grads)
        dense_idx: list[int] = []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if self._is_local(v):
                if self.scale_local_gradients:  # upstream: whatever the op
                    out[i] = g / set_size_tensor(self.process_set, g.dtype)
                continue
            if isinstance(g, tf.IndexedSlices):
                # Adasum, Min, ...: upstream's NotImplementedError, not a silent Sum
                out[i] = allreduce(g, op=self.op, process_set=self.process_set,
                                   name=f"{self.name}grad_{i}" if use_generic_names else None,
                                   ignore_name_scope=use_generic_names or self.ignore_name_scope)
                continue
            dense_idx.append(i)
        for group in self._groups(dense_idx, variables):
            self._reduce_group(group, grads, out, use_generic_names)
        return out

    def _groups(self, idx: list[int], variables: list) -> list[list[int]]:
        if not idx:
            return []
        if isinstance(self.groups, int) and self.groups > 0:
            return [g for g in split_list(idx, min(self.groups, len(idx))) if g]
        if isinstance(self.groups, list):
            where = {}
            for gi, group in enumerate(self.groups):
                for v in group:
                    where[_key(v)] = gi
            explicit: dict[int, list[int]] = {}
            rest = []
            for i in idx:
                v = variables[i]
                gi = where.get(_key(v)) if v is not None else None
                (explicit.setdefault(gi, []) if gi is not None else rest).append(i)
            return list(explicit.values()) + [[i] for i in rest]
        return [idx]  # default: everything in one group (split by dtype in _reduce_group)

    def _reduce_group(self, group: list[int], grads: list, out: list, use_generic_names: bool) -> None:
        pre, post = self._scales()
        compressed = [self.compression.compress(tf.convert_to_tensor(grads[i])) for i in group]
        by_dtype: dict = {}
        for pos, (c, _) in enumerate(compressed):
            by_dtype.setdefault(c.dtype, []).append(pos)
        for positions in by_dtype.values():
            tensors = [compressed[p][0] for p in positions]
            name = None
            if use_generic_names:
                name = f"{self.name}grad_{group[positions[0]]}_{group[positions[-1]]}"
            elif not tf.executing_eagerly() and self.name:
                name = f"{_normalize_name(self.name)}_{_tensor_name(tensors[0])}_{len(tensors)}"
            reduced = grouped_allreduce(tensors, op=self.op, prescale_factor=pre, postscale_factor=post,
                                        process_set=self.process_set, name=name,
                                        ignore_name_scope=use_generic_names or self.ignore_name_scope)
            for p, r in zip(positions, reduced):
                out[group[p]] = self.compression.decompress(r, compressed[p][1])
