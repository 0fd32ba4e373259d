"""Integer handles for the async API of every adapter (``allreduce_async`` returns an int, as upstream).

The map keeps the engine handle — and through it the caller's input and output buffers — alive until
``synchronize`` pops it: the engine reads and writes those buffers after the async call has returned.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["HandleMap"]


class HandleMap:
    """Integer handles → (engine handle or adapter wrapper, grouped flag); numbering restarts on ``reset``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._handles: dict[int, tuple[Any, bool]] = {}

    def add(self, handle: Any, grouped: bool = False) -> int:
        with self._lock:
            self._next += 1
            self._handles[self._next] = (handle, grouped)
            return self._next

    def pop(self, key: int) -> tuple[Any, bool]:
        with self._lock:
            try:
                return self._handles.pop(key)
            except KeyError:
                raise ValueError(f"Unknown or already synchronized handle: {key}") from None

    def peek(self, key: int) -> tuple[Any, bool]:
        with self._lock:
            try:
                return self._handles[key]
            except KeyError:
                raise ValueError(f"Unknown or already synchronized handle: {key}") from None

    def reset(self) -> None:
        """Forget every handle and restart numbering at 1 (upstream does this on init/shutdown)."""
        with self._lock:
            self._handles.clear()
            self._next = 0
