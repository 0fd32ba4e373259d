"""Elastic training for torch (``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``).

Not implemented yet (tracked by the elastic issue); the module exists so ``hvd.elastic`` imports as
upstream's does.  Using any of its names raises ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run", "TorchState", "ElasticSampler"]

_MESSAGE = "horovod.torch.elastic is not implemented yet; run without elastic mode."


def run(func: Any) -> Any:
    raise NotImplementedError(_MESSAGE)


class TorchState:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE)


class ElasticSampler:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_MESSAGE)
