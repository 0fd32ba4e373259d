"""Integer handles for the async API of every adapter (``allreduce_async`` returns an int, as upstream).

The map keeps the engine handle — and through it the caller's input and output buffers — alive until
``synchronize`` pops it: the engine reads and writes those buffers after the async call has returned.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["HandleMap"]


class HandleMap:
    """Integer handles → (engine handle or adapter wrapper, grouped flag); numbering restarts on ``reset``.

    No lock: ``next()`` of an ``itertools.count`` and one dict store/pop are each atomic in CPython, and
    these run once per tensor on the caller's path."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._handles: dict[int, tuple[Any, bool]] = {}

    def add(self, handle: Any, grouped: bool = False) -> int:
        key = next(self._counter)
        self._handles[key] = (handle, grouped)
        return key

    def pop(self, key: int) -> tuple[Any, bool]:
        try:
            return self._handles.pop(key)
        except (KeyError, TypeError):
            raise ValueError(f"Unknown or already synchronized handle: {key}") from None

    def peek(self, key: int) -> tuple[Any, bool]:
        try:
            return self._handles[key]
        except (KeyError, TypeError):
            raise ValueError(f"Unknown or already synchronized handle: {key}") from None

    def reset(self) -> None:
        """Forget every handle and restart numbering at 1 (upstream does this on init/shutdown)."""
        self._handles.clear()
        self._counter = itertools.count(1)
