"""Elastic training for torch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler`` (docs/elastic.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from horovod.common.elastic import run_fn
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import TorchState

__all__ = ["run", "TorchState", "ElasticSampler"]


def _reset() -> None:
    from horovod.common import basics

    basics.shutdown()
    basics.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``train(state, ...)``: retried from the last commit after failures and host changes.

    Example::

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                ...
                state.commit()

        train(hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0))
    """
    return run_fn(func, _reset)
