"""The CPUs this process may use, and the bounded polling of a thread that waits for a peer.

Waiting threads (a synchronous op's caller in the engine, a member of a shared-memory collective waiting
for a peer's token) poll for a short while before they sleep: on a VM a sleeping thread's wake-up costs 20-100 us,
and the peer that wakes it pays for it too.  That only pays while every rank on the host has a core of its
own; on an oversubscribed host a polling rank takes the core the peer it waits for needs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["usable_cores", "may_spin", "Spin", "PEER_SPIN_US"]

T = TypeVar("T")

# The most a member of a collective polls for a peer before it sleeps (see Spin; never more than
# HOROVOD_SPIN_WAIT_US): members of one collective reach each exchange tens of microseconds apart.
PEER_SPIN_US = 100.0
_MAX_SKIP = 64


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def may_spin(local_ranks: int) -> bool:
    """Whether a thread of one of ``local_ranks`` ranks on this host may poll while it waits."""
    return local_ranks <= usable_cores()


class Spin:
    """Polls ``attempt`` for up to ``seconds`` before its caller sleeps, backing off when polling finds nothing.

    A poll that ends empty-handed (the peer was descheduled or is still computing) makes the next 1, 2, 4 ...
    64 waits sleep at once, so a busy host does not lose a core to it; one that succeeds resets the back-off.
    """

    __slots__ = ("seconds", "_skip", "_backoff")

    def __init__(self, seconds: float) -> None:
        self.seconds = max(0.0, seconds)
        self._skip = 0  # waits left that sleep at once
        self._backoff = 1

    @classmethod
    def for_peers(cls, spin_wait_us: float, local_ranks: int) -> Spin:
        """A collective member's spin: :data:`PEER_SPIN_US`, at most ``HOROVOD_SPIN_WAIT_US`` (0 turns it off),
        none with more ranks on this host than cores."""
        return cls(min(PEER_SPIN_US, spin_wait_us) * 1e-6 if may_spin(local_ranks) else 0.0)

    def poll(self, attempt: Callable[[], T | None]) -> T | None:
        """``attempt()``'s first result other than None, or None when the spin ended (or is off, or skipped)."""
        if not self.seconds:
            return None
        if self._skip:
            self._skip -= 1
            return None
        until = time.perf_counter() + self.seconds
        while True:
            got = attempt()
            if got is not None:
                self._backoff = 1
                return got
            if time.perf_counter() >= until:
                self._skip = self._backoff
                self._backoff = min(_MAX_SKIP, 2 * self._backoff)
                return None
