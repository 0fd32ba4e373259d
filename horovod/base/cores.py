"""The CPUs this process may use, and whether a waiting thread may poll instead of sleeping.

Waiting threads (a synchronous op's caller in the engine, a member waiting for a shared-memory token) poll for
a short while before they sleep: on a VM a sleeping thread's wake-up costs 20-100 us.  That only pays while
every rank on the host has a core of its own; on an oversubscribed host a polling rank takes the core the
peer it waits for needs.
"""

from __future__ import annotations

import os

__all__ = ["usable_cores", "may_spin"]


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def may_spin(local_ranks: int) -> bool:
    """Whether a thread of one of ``local_ranks`` ranks on this host may poll while it waits."""
    return local_ranks <= usable_cores()
