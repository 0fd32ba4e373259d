"""Upstream's ``horovod.runner.elastic.worker`` path: ``HostUpdateResult`` and ``WorkerNotificationManager``.

They live in :mod:`horovod.common.elastic` (the worker side); user code that overrides
``State.on_hosts_updated(timestamp, update_res)`` imports the flags from this path, as upstream's tests do.
"""

from __future__ import annotations

from horovod.common.elastic import HostUpdateResult, WorkerNotificationManager

__all__ = ["HostUpdateResult", "WorkerNotificationManager"]
