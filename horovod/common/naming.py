"""Names for unnamed collectives.

The engine matches tensors across ranks by name, so ranks that call the same collectives in the same order
must generate the same names.  Counters are kept per process set and restart when a set id is registered
again: members of a dynamic set may have run different numbers of unnamed ops elsewhere before joining it.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["auto_name", "reset"]

_lock = threading.Lock()
_counters: collections.Counter[int] = collections.Counter()


def auto_name(prefix: str, process_set_id: int = 0) -> str:
    """``<prefix>.noname.<n>`` with ``n`` counting this process set's unnamed collectives."""
    with _lock:
        _counters[process_set_id] += 1
        n = _counters[process_set_id]
    suffix = f"{n}" if process_set_id == 0 else f"{process_set_id}.{n}"
    return f"{prefix}.noname.{suffix}"


def reset(process_set_id: int | None = None) -> None:
    """Restart the numbering of one set (when its id is (re)registered), or of every set (init)."""
    with _lock:
        if process_set_id is None:
            _counters.clear()
        else:
            _counters.pop(process_set_id, None)
