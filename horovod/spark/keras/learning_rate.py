"""Learning-rate scaling of the Keras estimator: ``x size`` on the workers, ``/ size`` on the returned model.

Upstream's rule: the effective batch grows with the number of processes, so every worker multiplies the
optimizer's learning rate by ``hvd.size()``, and Horovod's ``LearningRateScheduleCallback``s (and warm-up)
among the user's callbacks start from that scaled rate; the model handed back to the user has it divided
again.  A ``keras.optimizers.schedules.LearningRateSchedule`` is scaled too (its ``initial_learning_rate``, or
the values of a piecewise-constant schedule); a schedule of another kind is left as it is, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["scale_learning_rate"]

logger = logging.getLogger(__name__)



def _scale_schedule(schedule: Any, factor: float) -> bool:
    scaled = False
    for name in ("initial_learning_rate", "end_learning_rate"):
        if isinstance(getattr(schedule, name, None), (int, float)):
            setattr(schedule, name, getattr(schedule, name) * factor)
            scaled = True
    if isinstance(getattr(schedule, "values", None), (list, tuple)):
        schedule.values = [v * factor for v in schedule.values]
        scaled = True
    warmup = getattr(schedule, "warmup_target", None)  # CosineDecay with warm-up
    if isinstance(warmup, (int, float)):
        schedule.warmup_target = warmup * factor
    return scaled


def scale_learning_rate(optimizer: Any, factor: float, callbacks: Iterable[Any] = ()) -> float | None:
    """Multiply ``optimizer``'s learning rate (a value or a schedule) by ``factor``; Horovod LR-schedule
    callbacks among ``callbacks`` get the scaled rate as their ``initial_lr``.

    Returns:
        The scaled learning rate, or None for a schedule (whose rate depends on the step).
    """
    import keras
    import numpy as np

    schedule = getattr(optimizer, "_learning_rate", None)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        if not _scale_schedule(schedule, factor):
            logger.warning("horovod.spark.keras: cannot scale the learning rate schedule %s by %g; it is "
                           "used as it is", type(schedule).__name__, factor)
        scaled = None
    else:
        scaled = float(np.asarray(optimizer.learning_rate)) * factor
        optimizer.learning_rate.assign(scaled)
    for callback in callbacks:
        if hasattr(callback, "initial_lr") and hasattr(callback, "multiplier"):  # hvd LR schedule / warm-up
            if scaled is not None:
                callback.initial_lr = scaled
            elif isinstance(callback.initial_lr, (int, float)):
                callback.initial_lr *= factor
    return scaled
