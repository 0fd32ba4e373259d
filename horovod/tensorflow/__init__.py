"""``horovod.tensorflow``: Horovod's API for TensorFlow 2.x (eager, ``tf.function``) and TF1 graphs.

    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    ...
    hvd.broadcast_variables(model.variables, root_rank=0)   # after the first step

See docs/tensorflow.md for execution modes, names, errors and differences from upstream.
"""

from __future__ import annotations

import logging

import tensorflow as tf

# Keras 3 adaptations that upstream's scripts need (``optimizer.variables()``, compile's
# ``experimental_run_tf_function``); TensorFlow has imported Keras already.
import horovod._keras  # noqa: F401
from horovod.base.exceptions import HorovodInternalError, HostsUpdatedInterrupt
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
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.functions import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from horovod.tensorflow.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    _allreduce,
    _basics,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    handle_average_backwards_compatibility,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from horovod.tensorflow.optimizers import (
    DistributedGradientTape,
    DistributedOptimizer,
    PartialDistributedGradientTape,
)
from horovod.tensorflow.sync_batch_norm import SyncBatchNormalization
from horovod.tensorflow.util import _executing_eagerly

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built", "start_timeline",
    "stop_timeline", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "HorovodInternalError",
    "HostsUpdatedInterrupt", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "size_op",
    "local_size_op", "rank_op", "local_rank_op", "process_set_included_op", "broadcast_variables",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "broadcast_global_variables",
    "BroadcastGlobalVariablesHook", "DistributedOptimizer", "DistributedGradientTape",
    "PartialDistributedGradientTape", "SyncBatchNormalization", "DistributedModel",
    "handle_average_backwards_compatibility", "_allreduce", "_basics", "_executing_eagerly",
]

log = logging.getLogger(__name__)


def broadcast_global_variables(root_rank: int):
    """TF1 graph mode: an op that assigns ``root_rank``'s values to every global variable.

    Raises RuntimeError in eager mode (use ``broadcast_variables`` there), as upstream.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """SessionRunHook that broadcasts all global variables from ``root_rank`` once the session is created.

    Use it with ``MonitoredTrainingSession`` so that every rank starts from the same (random or restored)
    weights.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self) -> None:
        if not self.bcast_op or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)


def __getattr__(name: str):
    if name == "DistributedModel":  # lazy: needs Keras
        from horovod.tensorflow.keras import DistributedModel

        return DistributedModel
    if name == "elastic":  # lazy, as upstream's hvd.elastic (horovod/tensorflow/elastic.py)
        import importlib

        return importlib.import_module("horovod.tensorflow.elastic")
    raise AttributeError(f"module 'horovod.tensorflow' has no attribute {name!r}")
