"""Send dicts from the workers of an elastic ``horovod.ray`` job to the driver's callbacks (upstream's module).

Inside the training function of ``RayExecutor(min_workers=...).run(fn, callbacks=[...])`` or
``ElasticRayExecutor.run(worker_fn, callbacks=[...])``::

    from horovod.ray import ray_logger

    ray_logger.log({"epoch": epoch, "loss": loss, "rank": hvd.rank()})

Every rank may log (upstream 0.28.1 has no rank filter).  Each dict goes into a ``ray.util.queue.Queue``
owned by the driver; :func:`log` returns once the queue holds it, so whatever a worker logged before its
function returned reaches every callback before ``run`` returns.  The driver calls each callback with each
dict, one dict at a time, in the order the queue received them (so one rank's dicts keep their order), on
a thread of its own while the job runs (see :mod:`horovod.ray.elastic`).

The executor gives each worker actor the queue (:meth:`BaseHorovodWorker.set_queue
<horovod.ray.worker.BaseHorovodWorker.set_queue>` calls :func:`configure`).  An elastic job run without
callbacks configures "no queue": :func:`log` then drops the dict silently, as upstream's (whose queue nobody
read).  Anywhere else -- a static ``RayExecutor`` job (which ignores callbacks, as upstream's), the driver,
a plain process -- there is nowhere to send it: the dict is dropped with one ``UserWarning`` per process
(upstream's behaviour).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

__all__ = ["configure", "log"]

_NOT_CONFIGURED = object()
_queue: Any = _NOT_CONFIGURED  # a ray.util.queue.Queue, None (a job without callbacks), or not configured
_lock = threading.Lock()
_warned = False


def configure(queue: Any) -> None:
    """Make :func:`log` in this process put its dicts into ``queue`` (``None``: drop them silently).

    The executor calls this in each worker actor before the training function starts.
    """
    global _queue
    with _lock:
        _queue = queue


def log(info_dict: dict) -> None:
    """Send ``info_dict`` (picklable values) to the driver, where every callback of ``run`` is called with it.

    Blocks until the driver's queue holds the dict.  Outside a worker of an elastic ``horovod.ray`` job the
    dict is dropped (one warning per process; none in a job run without callbacks).

    Raises:
        Whatever putting into the Ray queue raises, e.g. a value that cannot be pickled or a queue actor
        that died: the worker's function fails as with any other error.
    """
    global _warned
    queue = _queue
    if queue is _NOT_CONFIGURED:
        with _lock:
            if _warned:
                return
            _warned = True
        warnings.warn("`ray_logger.log` called but logging is not configured: only the workers of an elastic "
                      "horovod.ray job (RayExecutor(min_workers=...), ElasticRayExecutor) send to the driver's "
                      "callbacks; this dict and later ones in this process are dropped", stacklevel=2)
        return
    if queue is None:
        return
    queue.put(info_dict)
