"""broadcast_object / allgather_object: arbitrary picklable objects over the byte collectives.

These are the only places where pickled bytes cross the wire, and only because the user asked to send that
object to authenticated peers of the same job (every connection proves the job key).

Unnamed calls are named like other unnamed collectives (per process set, in call order).  Upstream named them
after ``type(obj)``, so the usual ``broadcast_object(state if rank == 0 else None)`` sent ``list.sz`` from the
root and ``NoneType.sz`` from the others, and the job stalled.
"""

from __future__ import annotations

import io
import itertools
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


def _pickled(obj: Any) -> tuple[np.ndarray, int, BaseException | None]:
    """``(payload, length, None)``, or, when ``obj`` cannot be pickled, ``(the error's text, -its length,
    the error)``: the collectives still run, so the peers learn of the failure at once instead of waiting
    for bytes that never come (they waited until the stall deadline)."""
    try:
        payload = _dumps(obj)
        return payload, payload.size, None
    except Exception as error:  # noqa: BLE001 - any pickling error, re-raised by the caller
        text = np.frombuffer(f"{type(error).__name__}: {error}".encode()[:4096], dtype=np.uint8)
        return text, -text.size, error


def _loads(arr: np.ndarray) -> Any:
    return cloudpickle.loads(arr.tobytes())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every member of ``process_set``."""
    name = name or naming.auto_name("broadcast_object", process_set.process_set_id or 0)
    is_root = basics.rank() == root_rank
    payload, size, error = _pickled(obj) if is_root else (np.zeros(0, np.uint8), 0, None)
    length = ops.broadcast(np.array([size], np.int64), root_rank, name=f"{name}.sz",
                           process_set=process_set).wait()
    if not is_root:
        payload = np.zeros(abs(int(length[0])), np.uint8)
    payload = ops.broadcast(payload, root_rank, name=f"{name}.t", process_set=process_set).wait()
    if error is not None:
        raise error
    if length[0] < 0:
        raise ValueError(f"broadcast_object: the root rank {root_rank} could not pickle its object: "
                         f"{payload.tobytes().decode(errors='replace')}")
    return obj if is_root else _loads(payload)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every member's ``obj``, ordered by rank within the set."""
    name = name or naming.auto_name("allgather_object", process_set.process_set_id or 0)
    payload, size, error = _pickled(obj)
    sizes = ops.allgather(np.array([size], np.int64), name=f"{name}.sz", process_set=process_set).wait()
    data = ops.allgather(payload, name=f"{name}.t", process_set=process_set).wait()
    if error is not None:
        raise error
    out, failed, offset = [], [], 0
    for rank, n in zip(process_set.ranks or itertools.count(), sizes.tolist()):  # global ranks
        part = data[offset:offset + abs(n)]
        offset += abs(n)
        if n < 0:
            failed.append(f"rank {rank}: {part.tobytes().decode(errors='replace')}")
        elif not failed:
            out.append(part)
    if failed:
        raise ValueError("allgather_object: could not pickle the object of " + "; ".join(failed))
    return [_loads(part) for part in out]
