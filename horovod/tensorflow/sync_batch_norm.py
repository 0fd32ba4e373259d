"""SyncBatchNormalization: batch statistics computed over every rank's batch."""

from __future__ import annotations

import keras
import tensorflow as tf

from horovod.common import basics as _basics
from horovod.common.process_sets import global_process_set
from horovod.tensorflow.mpi_ops import Sum, _allreduce, set_size_tensor, size_read_at_run_time

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="horovod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose mean and variance are those of the global batch (all ranks).

    Registered with Keras, so ``keras.models.load_model`` rebuilds a saved model that holds it (Keras 3 refuses
    unregistered classes outside its own modules); ``hvd.load_model`` also knows it by its class name, for
    files saved before it was registered.

    Each rank contributes ``[mean, var + mean**2]`` of its batch; a Sum-allreduce divided by the size gives
    E[x] and E[x**2], so var = E[x**2] - E[x]**2 (equal per-rank batch sizes, as upstream assumes).
    """

    def __init__(self, fused: bool | None = False, **kwargs) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        # Unnamed layers are named by Keras from the class: "sync_batch_normalization" as upstream, then
        # "sync_batch_normalization_1", ...  (upstream gave every one the first name, which Keras 3 refuses
        # in a model holding more than one.)
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        if not _basics.is_initialized():  # not this process's statistics without a word
            raise ValueError(_basics.NOT_INITIALIZED)
        if _basics.size() <= 1 and not size_read_at_run_time():  # (elastic: the job may grow under this trace)
            return mean, variance
        stacked = tf.stack([mean, variance + tf.square(mean)])
        total = _allreduce(stacked, op=Sum) / set_size_tensor(global_process_set, stacked.dtype)
        g_mean = total[0]
        return g_mean, total[1] - tf.square(g_mean)

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config
