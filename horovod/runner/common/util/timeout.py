"""Upstream's ``timeout``: a deadline that names the activity that missed it."""

from __future__ import annotations

import time

__all__ = ["Timeout", "TimeoutException"]


class TimeoutException(Exception):
    """A :class:`Timeout` expired; ``message`` says what was being waited for."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Timeout:
    """A deadline ``timeout`` seconds from now.

    ``message`` may contain ``{activity}``, filled in by :meth:`check_time_out_for`.
    """

    def __init__(self, timeout: float, message: str) -> None:
        self._timeout = timeout
        self._timeout_at = time.time() + timeout
        self._message = message

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self._timeout_at - time.time())

    def timed_out(self) -> bool:
        return time.time() > self._timeout_at

    def check_time_out_for(self, activity: str) -> None:
        """Raise TimeoutException (``message`` with ``activity``, then the timeout) once the deadline passed."""
        if self.timed_out():
            text = self._message.format(activity=activity)
            stop = "" if text.rstrip().endswith(".") else "."
            raise TimeoutException(f"{text}{stop} Timeout after {self._timeout} seconds.")
