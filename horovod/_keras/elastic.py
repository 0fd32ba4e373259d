"""Keras elastic callbacks and state, shared by ``horovod.keras.elastic`` and ``horovod.tensorflow.keras.elastic``.

Exactly once with Keras: feed ``model.fit`` an :class:`ElasticBatches` (a ``PyDataset`` over an
``ElasticSampler`` in batch mode), record each finished batch with :class:`RecordBatchCallback` *before*
:class:`CommitStateCallback`, and call ``fit`` once per epoch, so that the number of steps Keras fixes at the
start of ``fit`` is the current plan's::

    sampler = ElasticSampler(len(x), batch_size=32)
    state = hvd.elastic.KerasState(model, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            state.sampler.set_epoch(state.epoch)
            model.fit(ElasticBatches(x, y, state.sampler), epochs=1, verbose=0,
                      callbacks=[RecordBatchCallback(state.sampler), CommitStateCallback(state)])
            state.epoch += 1
            state.commit()
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from horovod.common.elastic_sampler import ElasticSampler
from horovod.tensorflow.elastic import TensorFlowKerasState

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "RecordBatchCallback", "ElasticBatches"]


class KerasState(TensorFlowKerasState):
    """``TensorFlowKerasState`` with the Keras backend (upstream's name)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit every ``batches_per_commit`` batches and at the end of each epoch.

    Not once an ``ElasticSampler`` of the state has recorded its epoch's last batch: that progress is committed
    by the loop's ``state.epoch += 1; state.commit()``.  Committed here, a reset landing before the loop's
    commit resumed the epoch with no batch left, and ``fit`` refuses an empty ``ElasticBatches``; restored to
    the commit before, the last batch runs again, from the weights it started from (exactly once still).
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self._commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._commit()

    def _commit(self) -> None:
        if not any(isinstance(v, ElasticSampler) and v.epoch_done for v in vars(self.state).values()):
            self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Track ``state.batch``; shortens the first epoch after a reset by the batches already done."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None  # each fit (after a reset: with the restored state) measures it anew

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Track ``state.epoch`` (the next epoch to run)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        # Keras counts epochs from 0 in every fit; after a reset, fit runs again from the restored state.
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


class RecordBatchCallback(keras.callbacks.Callback):
    """Mark each finished batch's samples (all ranks') as processed; put it before ``CommitStateCallback``."""

    def __init__(self, sampler: Any) -> None:
        super().__init__()
        self.sampler = sampler

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.sampler.record_batch(batch, self.sampler.batch_size)


class ElasticBatches(keras.utils.PyDataset):
    """This rank's batches of an ``ElasticSampler`` (batch mode) over in-memory arrays."""

    def __init__(self, x: Any, y: Any, sampler: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not sampler.batch_size:
            raise ValueError("ElasticBatches needs an ElasticSampler with batch_size= (batch mode).")
        self.x, self.y, self.sampler = x, y, sampler
        self._batches = sampler.batches()

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        batch = np.asarray(self._batches[index], dtype=np.int64)
        return self.x[batch], self.y[batch]
