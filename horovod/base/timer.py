"""A one-shot timer whose expiry makes a descriptor readable (Linux ``timerfd``), for threads that sleep in epoll.

The engine thread must pick up a tensor enqueued asynchronously within the cycle time, even when no caller
waits for it (a training step still computing).  Waking it at once cost more than the thread's work: on a
2-vCPU host running two ranks, the woken thread takes a core from a rank that is still enqueueing, and the
caller usually runs the round itself a moment later anyway (100 x 16 KiB async allreduces at np=2: 1.33 ms
per step with the wake, 1.10 with this timer).  Arming a timer is one system call that wakes nobody; a caller
that starts waiting before it expires runs the round itself, which disarms it.  (Arming costs 10-45 us of
system time on that VM, disarming 10-13: the kernel reprograms its timer; still a sixth of the wake-up.)
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["OneShotTimer", "one_shot_timer"]

_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


class OneShotTimer:
    """``arm()`` makes :meth:`fileno` readable ``delay`` seconds later; ``disarm()`` (also when it has expired)
    makes it unreadable again.  Raises ``OSError`` (or ``AttributeError``: no timerfd in this libc) when built."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        fd = create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self._fd = fd
        self._settime = settime
        self._expiry = _Itimerspec()  # the delay, converted once per change, not per arm
        self._off = _Itimerspec()
        self.delay = 0.0

    def fileno(self) -> int:
        return self._fd

    def set_delay(self, seconds: float) -> None:
        self.delay = max(0.0, seconds)
        ns = max(1, int(self.delay * 1e9))  # 0 would disarm
        self._expiry.value.sec, self._expiry.value.nsec = divmod(ns, 1_000_000_000)

    def arm(self) -> None:
        self._settime(self._fd, 0, self._expiry, None)

    def disarm(self) -> None:
        self._settime(self._fd, 0, self._off, None)

    def clear(self) -> None:
        """Consume an expiry (the descriptor stays readable until then)."""
        try:
            os.read(self._fd, 8)
        except OSError:  # not expired (EAGAIN), or closed
            pass

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def one_shot_timer() -> OneShotTimer | None:
    """A new timer, or None where the platform has none (the engine thread is then woken at once)."""
    try:
        return OneShotTimer()
    except (AttributeError, OSError):
        return None
