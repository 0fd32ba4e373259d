"""Callbacks for ``horovod.tensorflow.keras`` (implementation shared in ``horovod._keras.callbacks``)."""

from __future__ import annotations

import keras

from horovod._keras.callbacks import make_callbacks

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

_impl = make_callbacks(keras)
BroadcastGlobalVariablesCallback = _impl.BroadcastGlobalVariablesCallback
MetricAverageCallback = _impl.MetricAverageCallback
LearningRateScheduleCallback = _impl.LearningRateScheduleCallback
LearningRateWarmupCallback = _impl.LearningRateWarmupCallback
BestModelCheckpoint = _impl.BestModelCheckpoint
for _cls in (BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
             LearningRateWarmupCallback, BestModelCheckpoint):
    _cls.__module__ = __name__
    _cls.__qualname__ = _cls.__name__
