"""``horovod.tensorflow.keras``: Horovod for Keras 3 on TensorFlow (thin front-end of ``horovod._keras``).

    import keras
    import horovod.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size())), loss="mse")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
              verbose=1 if hvd.rank() == 0 else 0)

or simply ``model = hvd.DistributedModel(model)`` before ``compile``/``fit``.
"""

from __future__ import annotations

import keras

import horovod._keras as _impl
from horovod._keras.model import make_distributed_model_class
from horovod.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    sycl_built,
)
from horovod.common.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from horovod.tensorflow import SyncBatchNormalization, broadcast_variables
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.keras import callbacks, elastic
from horovod.tensorflow.mpi_ops import Average, Sum

__all__ = [
    "elastic",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built", "start_timeline",
    "stop_timeline", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Average",
    "Sum", "Compression", "callbacks", "DistributedOptimizer", "PartialDistributedOptimizer",
    "DistributedModel", "broadcast_global_variables", "broadcast_variables", "allreduce", "allgather",
    "broadcast", "reducescatter", "load_model", "SyncBatchNormalization",
]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Return a copy of the Keras optimizer (same class and config) that averages gradients across ranks.

    Gradients are reduced inside ``apply``/``apply_gradients`` (after ``backward_passes_per_step`` local
    accumulations, before clipping).  ``optimizer.variables`` works both as Keras 3's list and as
    Keras 2's ``optimizer.variables()``.

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    return _impl.create_distributed_optimizer(
        keras, optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """DistributedOptimizer whose ``local_layers``' trainable weights keep local gradients."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    if local_layers is not None:
        for layer in (local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]):
            for w in layer.trainable_weights:
                opt.register_local_var(w)
    return opt


def broadcast_global_variables(root_rank, model=None):
    """Broadcast ``model``'s (and its optimizer's) variables from ``root_rank`` (TF1 graph: all globals)."""
    return _impl.broadcast_global_variables(keras, root_rank, model)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """Average (or ``op``) a value across ranks; returns a tensor."""
    return _impl.allreduce(keras, value, name, average, prescale_factor, postscale_factor, op, compression,
                           process_set)


def allgather(value, name=None, process_set=global_process_set):
    """Concatenate every rank's value along the first dimension."""
    return _impl.allgather(keras, value, name, process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s value on every rank."""
    return _impl.broadcast(keras, value, root_rank, name, process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """Reduce across ranks and return this rank's rows."""
    return _impl.reducescatter(keras, value, name, op, process_set)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """``keras.models.load_model`` whose optimizer comes back as a DistributedOptimizer (state kept)."""
    return _impl.load_model(keras, filepath, custom_optimizers, custom_objects, compression)


DistributedModel = make_distributed_model_class(
    keras, lambda opt, **kw: DistributedOptimizer(opt, **kw), callbacks)
DistributedModel.__module__ = __name__
