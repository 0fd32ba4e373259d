"""Callbacks for ``horovod.keras``: the same classes as ``horovod.tensorflow.keras.callbacks`` (Keras 3 is
one Keras whichever way it is imported)."""

from __future__ import annotations

from horovod.tensorflow.keras.callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]
