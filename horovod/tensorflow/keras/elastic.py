"""Keras elastic API (``KerasState``, the state callbacks, ``run``); implemented in :mod:`horovod._keras.elastic`."""

from horovod._keras.elastic import (
    CommitStateCallback,
    ElasticBatches,
    KerasState,
    RecordBatchCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)
from horovod.common.elastic_sampler import ElasticSampler
from horovod.tensorflow.elastic import run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "RecordBatchCallback", "ElasticBatches", "ElasticSampler", "run"]
