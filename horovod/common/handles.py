"""Integer handles for the async API of every adapter (``allreduce_async`` returns an int, as upstream).

One contract for every framework: an adapter registers a *pending* object (anything with ``done()`` and
``wait()``: an engine handle, or the adapter's wrapper that turns numpy results into its tensors) and gets an
int; ``poll(handle)`` is ``done()``, ``synchronize(handle)`` forgets the handle and returns ``wait()``.  A
grouped call registers a :class:`Group`, whose result is a tuple with one entry per tensor (upstream's
grouped handles; the synchronous ``grouped_*`` wrappers return lists).

The map keeps the pending object -- and through it the caller's input and output buffers -- alive until
``synchronize`` pops it: the engine reads and writes those buffers after the async call has returned.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Protocol

__all__ = ["Pending", "Group", "HandleMap"]


class Pending(Protocol):
    """What a handle stands for: ``done()`` never blocks; ``wait()`` returns the result or raises its error."""

    def done(self) -> bool: ...

    def wait(self) -> Any: ...


class Group:
    """Several pending operations behind one handle; the result is a tuple of theirs, in order."""

    __slots__ = ("_members",)

    def __init__(self, members: Iterable[Pending]) -> None:
        self._members = tuple(members)

    def done(self) -> bool:
        return all(m.done() for m in self._members)

    def wait(self) -> tuple:
        return tuple(m.wait() for m in self._members)


class HandleMap:
    """Integer handles → pending operations; numbering restarts on ``reset``.

    No lock: ``next()`` of an ``itertools.count`` and one dict store/pop are each atomic in CPython, and
    these run once per tensor on the caller's path."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._before_reset: dict[int, Pending] = {}  # not synchronized when shutdown() reset the map

    def add(self, pending: Pending) -> int:
        """Register ``pending``; returns its handle."""
        key = next(self._counter)
        self._pending[key] = pending
        if self._before_reset:
            self._before_reset.pop(key, None)  # the number now means the new operation
        return key

    def poll(self, key: int) -> bool:
        """True once the operation behind ``key`` has completed (successfully or not).

        Raises:
            ValueError: unknown or already synchronized handle.
        """
        return self._get(key).done()

    def synchronize(self, key: int) -> Any:
        """Forget ``key`` and wait for its result (a tuple for a :class:`Group`).

        Raises:
            ValueError: unknown or already synchronized handle (upstream returned None).
            Exception: the operation's own error (``HorovodInternalError``, ``PreconditionError`` ...).
        """
        try:
            pending = self._pending.pop(key)
        except (KeyError, TypeError):
            pending = self._before_reset.pop(key, None) if isinstance(key, int) else None
            if pending is None:
                raise ValueError(f"Unknown or already synchronized handle: {key}") from None
        return pending.wait()  # one pending at shutdown: its own result, or the shut-down error that ended it

    def _get(self, key: int) -> Pending:
        try:
            return self._pending[key]
        except (KeyError, TypeError):
            raise ValueError(f"Unknown or already synchronized handle: {key}") from None

    def reset(self) -> None:
        """Restart numbering at 1 (upstream does this on init/shutdown).  A handle still pending is kept until
        its number is given out again, so that ``synchronize`` of it says why it failed (Horovod shut down), as
        upstream's did, rather than "unknown handle"."""
        self._before_reset.update(self._pending)
        self._pending = {}
        self._counter = itertools.count(1)
