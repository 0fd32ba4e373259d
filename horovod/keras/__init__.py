"""``horovod.keras``: Horovod for standalone Keras 3 (thin front-end of ``horovod._keras``).

Keras 3 is one package whether imported as ``keras`` or ``tf.keras``; this module differs from
``horovod.tensorflow.keras`` only in upstream's signatures (``allreduce`` averages by default, no
``process_set`` on the value functions).
"""

from __future__ import annotations

import keras

import horovod._keras as _impl
from horovod.common.basics import (
    Adasum,
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
from horovod.common.process_sets import global_process_set
from horovod.keras import callbacks, elastic
from horovod.tensorflow import SyncBatchNormalization, broadcast_variables
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.keras import DistributedModel, PartialDistributedOptimizer
from horovod.tensorflow.mpi_ops import Average, Sum

__all__ = [
    "elastic",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built", "start_timeline",
    "stop_timeline", "Average", "Sum", "Adasum", "Compression", "callbacks", "DistributedOptimizer",
    "PartialDistributedOptimizer", "DistributedModel", "broadcast_global_variables", "broadcast_variables",
    "allreduce", "allgather", "broadcast", "reducescatter", "load_model", "SyncBatchNormalization",
]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, num_groups=0, groups=None, backward_passes_per_step=1,
                         average_aggregated_gradients=False):
    """Return a copy of the Keras optimizer that averages gradients across ranks (see
    ``horovod.tensorflow.keras.DistributedOptimizer``)."""
    return _impl.create_distributed_optimizer(
        keras, optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, num_groups=num_groups, groups=groups,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, process_set=global_process_set)


def broadcast_global_variables(root_rank, model=None):
    """Broadcast ``model``'s (and its optimizer's) variables from ``root_rank`` (TF1 graph: all globals)."""
    return _impl.broadcast_global_variables(keras, root_rank, model)


def allreduce(value, name=None, average=True, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Average a value across ranks (upstream's ``average=True`` default; pass ``average=None`` with ``op``)."""
    return _impl.allreduce(keras, value, name, average, prescale_factor, postscale_factor, op, compression)


def allgather(value, name=None):
    """Concatenate every rank's value along the first dimension."""
    return _impl.allgather(keras, value, name)


def broadcast(value, root_rank, name=None):
    """``root_rank``'s value on every rank."""
    return _impl.broadcast(keras, value, root_rank, name)


def reducescatter(value, name=None, op=Average):
    """Reduce across ranks and return this rank's rows."""
    return _impl.reducescatter(keras, value, name, op)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """``keras.models.load_model`` whose optimizer comes back as a DistributedOptimizer (state kept)."""
    return _impl.load_model(keras, filepath, custom_optimizers, custom_objects, compression)
