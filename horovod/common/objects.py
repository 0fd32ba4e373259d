"""broadcast_object / allgather_object: arbitrary picklable objects over the byte collectives.

These are the only places where pickled bytes cross the wire, and only because the user asked to send that
object to authenticated peers of the same job (every connection proves the job key).

Unnamed calls are named like other unnamed collectives (per process set, in call order).  Upstream named them
after ``type(obj)``, so the usual ``broadcast_object(state if rank == 0 else None)`` sent ``list.sz`` from the
root and ``NoneType.sz`` from the others, and the job stalled.
"""

from __future__ import annotations

import io
from typing import Any

import cloudpickle
import numpy as np

from horovod.common import basics, naming, ops
from horovod.common.process_sets import ProcessSet, global_process_set

__all__ = ["broadcast_object", "allgather_object"]


def _dumps(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def _loads(arr: np.ndarray) -> Any:
    return cloudpickle.loads(arr.tobytes())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every member of ``process_set``."""
    name = name or naming.auto_name("broadcast_object", process_set.process_set_id or 0)
    is_root = basics.rank() == root_rank
    payload = _dumps(obj) if is_root else np.zeros(0, np.uint8)
    length = np.array([payload.size if is_root else 0], dtype=np.int64)
    length = ops.broadcast(length, root_rank, name=f"{name}.sz", process_set=process_set).wait()
    if not is_root:
        payload = np.zeros(int(length[0]), np.uint8)
    payload = ops.broadcast(payload, root_rank, name=f"{name}.t", process_set=process_set).wait()
    return obj if is_root else _loads(payload)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every member's ``obj``, ordered by rank within the set."""
    name = name or naming.auto_name("allgather_object", process_set.process_set_id or 0)
    payload = _dumps(obj)
    sizes = ops.allgather(np.array([payload.size], np.int64), name=f"{name}.sz", process_set=process_set).wait()
    data = ops.allgather(payload, name=f"{name}.t", process_set=process_set).wait()
    out, offset = [], 0
    for n in sizes:
        out.append(_loads(data[offset:offset + int(n)]))
        offset += int(n)
    return out
