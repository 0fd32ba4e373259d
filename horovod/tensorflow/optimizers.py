"""DistributedGradientTape, PartialDistributedGradientTape and the TF1 DistributedOptimizer.

Both wrap the user's object instead of subclassing it at run time: the tape wrapper shares the recorded tape
state and reduces the gradients it returns; the TF1 optimizer wrapper delegates to the wrapped
``tf.compat.v1.train.Optimizer`` and reduces in ``compute_gradients``.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_aggregation import GradientReducer
from horovod.tensorflow.mpi_ops import Adasum, Average, grouped_allreduce

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
           "LegacyDistributedOptimizer"]

log = logging.getLogger(__name__)


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` that shares the wrapped tape's recording and reduces what ``gradient`` returns."""

    __slots__ = ("_hvd_reducer", "_hvd_inner_cls")

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None,
                 use_generic_names: bool = False):
        """Gradients averaged (``op``) over the process set; local sources stay local."""
        kwargs = {} if unconnected_gradients is None else {"unconnected_gradients": unconnected_gradients}
        grads = self._hvd_inner_cls.gradient(self, target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._hvd_reducer.reduce(flat_grads, flat_sources, use_generic_names=use_generic_names)
        return tf.nest.pack_sequence_as(grads, reduced)

    def register_local_source(self, source) -> None:
        """Do not reduce the gradient of ``source`` (a variable local to this rank)."""
        self._hvd_reducer.register_local_var(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        grads = self.gradient(target, sources, output_gradients)
        local = [g for g, s in zip(grads, sources) if self._hvd_reducer._is_local(s)]
        glob = [g for g, s in zip(grads, sources) if not self._hvd_reducer._is_local(s)]
        return local, glob


def DistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                            compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                            process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True):
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged across ranks.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"DistributedGradientTape expects a tf.GradientTape, got {type(gradtape).__name__}")
    reducer = GradientReducer(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                              groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
                              name="DistributedGradientTape_")
    tape = _DistributedGradientTape.__new__(_DistributedGradientTape)
    tape.__dict__ = gradtape.__dict__  # share the recording: `with` and `watch` on either object are seen by both
    tape._hvd_reducer = reducer
    tape._hvd_inner_cls = type(gradtape)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense: str = "", device_sparse: str = "",  # noqa: N802
                                   compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set: ProcessSet = global_process_set, local_layers=None,
                                   scale_local_gradients: bool = True):
    """DistributedGradientTape whose ``local_layers``' trainable weights keep local gradients."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        for w in layer.trainable_weights:
            tape.register_local_source(w)
    return tape


class LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` that averages gradients in ``compute_gradients``."""

    def __init__(self, optimizer, name: str | None = None, use_locking: bool = False, *,
                 reducer: GradientReducer, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._bpps = int(backward_passes_per_step)
        self._average_aggregated = average_aggregated_gradients
        self._acc: dict = {}
        self._counter = None

    def register_local_var(self, var) -> None:
        self._reducer.register_local_var(var)

    def compute_gradients(self, *args, **kwargs):
        """Compute gradients with the wrapped optimizer, then average them across ranks."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*gradients) if gradients else ((), ())
        if self._bpps > 1:
            return list(zip(self._aggregate(list(grads), list(variables)), variables))
        reduced = self._reducer.reduce(list(grads), list(variables))
        return list(zip(reduced, variables))

    def _aggregate(self, grads, variables):
        """Accumulate locally; on every ``backward_passes_per_step``-th call reduce the sum (graph mode)."""
        n = self._bpps
        if self._counter is None:
            with tf.init_scope():
                self._counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="hvd_bpps_counter")
        accs = []
        for g, v in zip(grads, variables):
            if g is None:
                accs.append(None)
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self._reducer.sparse_as_dense:
                    raise ValueError("IndexedSlices are not supported when backward_passes_per_step > 1; pass "
                                     "sparse_as_dense=True to DistributedOptimizer")
                g = tf.convert_to_tensor(g)
            key = v.ref()
            if key not in self._acc:
                with tf.init_scope():
                    self._acc[key] = tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                                 name="hvd_bpps_acc")
            accs.append(self._acc[key].assign_add(g))
        count = self._counter.assign_add(1)
        ready = tf.equal(count % n, 0)

        def reduce_now():
            vals = [None if a is None else (a / n if self._average_aggregated else a) for a in accs]
            reduced = self._reducer.reduce(vals, variables)
            return [tf.zeros_like(a) if r is None else r for a, r in zip(accs, reduced) if a is not None]

        def keep():
            return [tf.zeros_like(a) for a in accs if a is not None]

        dense = tf.cond(ready, reduce_now, keep)
        self._ready = ready
        it = iter(dense)
        return [None if a is None else next(it) for a in accs]

    def apply_gradients(self, *args, **kwargs):
        if self._bpps <= 1:
            return self._optimizer.apply_gradients(*args, **kwargs)
        ready = self._ready

        def apply():
            with tf.control_dependencies([self._optimizer.apply_gradients(*args, **kwargs)]):
                return tf.group(*[a.assign(tf.zeros_like(a)) for a in self._acc.values()])

        def skip():
            gs = kwargs.get("global_step", args[1] if len(args) > 1 else None)
            return tf.group(gs.assign_add(1)) if gs is not None else tf.no_op()
        return tf.cond(ready, apply, skip)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


class LegacyAdasumOptimizer(LegacyDistributedOptimizer):
    """``DistributedOptimizer(tf.compat.v1.train optimizer, op=hvd.Adasum)``: each rank applies its own
    gradients with the wrapped optimizer (its own slots), and the variables become their values before the
    step plus the Adasum of the ranks' deltas (horovod.base.adasum), as torch's Adasum optimizer.  (Upstream's
    class of the same purpose delegated ``apply_gradients`` to the wrapped optimizer, which bypassed its own
    delta logic: it trained locally.)"""

    def __init__(self, optimizer, name: str | None = None, use_locking: bool = False, *,
                 compression=Compression.none, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(optimizer, name or f"DistributedDelta{type(optimizer).__name__}", use_locking,
                         reducer=None)  # type: ignore[arg-type] - nothing is reduced in compute_gradients
        self._compression = compression
        self._process_set = process_set
        self._local: set = set()

    def register_local_var(self, var) -> None:
        """Keep ``var``'s own step (its delta is not reduced)."""
        self._local.add(var.ref())

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, local: Adasum reduces the step's deltas instead."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = list(grads_and_vars)
        variables = [v for g, v in grads_and_vars if g is not None and v.ref() not in self._local]
        starts = [tf.identity(v.read_value() if hasattr(v, "read_value") else v) for v in variables]
        with tf.control_dependencies(starts):
            local = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        with tf.control_dependencies([local]):
            deltas = [tf.identity(v.read_value() if hasattr(v, "read_value") else v) - s
                      for v, s in zip(variables, starts)]
        if not deltas:
            return local
        reduced = grouped_allreduce(deltas, op=Adasum, compression=self._compression,
                                    process_set=self._process_set)
        return tf.group(*[v.assign(s + d, use_locking=self._use_locking)
                          for v, s, d in zip(variables, starts, reduced)])


def DistributedOptimizer(optimizer, name: str | None = None, use_locking: bool = False,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True):
    """Wrap an optimizer so that gradients are averaged across ranks before they are applied.

    ``tf.compat.v1.train`` optimizers get :class:`LegacyDistributedOptimizer` (reduces in
    ``compute_gradients``); Keras optimizers get ``horovod.tensorflow.keras.DistributedOptimizer`` (reduces
    inside ``apply``).

    Example (TF1)::

        opt = tf.compat.v1.train.GradientDescentOptimizer(0.01 * hvd.size())
        opt = hvd.DistributedOptimizer(opt)
        train_op = opt.minimize(loss, global_step=global_step)
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if op == Adasum:
            if backward_passes_per_step != 1:
                raise ValueError("backward_passes_per_step must be 1 with op=hvd.Adasum for a tf.compat.v1.train "
                                 "optimizer (each step's deltas are reduced).")
            return LegacyAdasumOptimizer(optimizer, name, use_locking, compression=compression,
                                         process_set=process_set)
        reducer = GradientReducer(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                                  groups=groups, process_set=process_set,
                                  scale_local_gradients=scale_local_gradients,
                                  name=name or f"Distributed{type(optimizer).__name__}_")
        return LegacyDistributedOptimizer(optimizer, name, use_locking, reducer=reducer,
                                          backward_passes_per_step=backward_passes_per_step,
                                          average_aggregated_gradients=average_aggregated_gradients)
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    from horovod.tensorflow import keras as hvd_keras

    return hvd_keras.DistributedOptimizer(optimizer, name=name, device_dense=device_dense,
                                          device_sparse=device_sparse, compression=compression,
                                          sparse_as_dense=sparse_as_dense,
                                          gradient_predivide_factor=gradient_predivide_factor, op=op,
                                          backward_passes_per_step=backward_passes_per_step,
                                          average_aggregated_gradients=average_aggregated_gradients,
                                          num_groups=num_groups, groups=groups, process_set=process_set,
                                          scale_local_gradients=scale_local_gradients)
