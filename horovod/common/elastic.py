"""Elastic training on the worker side: ``State``, ``ObjectState``, ``run_fn`` and host-update notices.

A training function wrapped by :func:`run_fn` survives the loss or arrival of workers:

* a collective fails (``HorovodInternalError``: a peer died or hung) → ``state.restore()`` rolls back to
  the last ``commit()``, the framework re-initialises (``shutdown(); init()`` -- in elastic mode ``init``
  asks the driver for this worker's new rank, see :mod:`horovod.common.elastic_init`), ``state.sync()``
  broadcasts rank 0's committed state, and the function is called again;
* the driver reports changed hosts → rank 0 sees it in ``check_host_updates()`` (called by ``commit()``),
  every rank raises ``HostsUpdatedInterrupt`` at the same commit, and the job re-initialises the same way
  without a rollback.

A ``PreconditionError`` is not retried: the ranks disagree about a collective (shapes, types, parameters, or
collectives submitted on some ranks only, such as ``state.commit()`` under ``if hvd.rank() == 0:``, which the
stall inspector reports as mismatched collectives), an error in the program that the same code after a
reset runs into again.  The worker raises it and the job ends.

``State`` takes ``bcast_object`` and ``get_rank`` callables, so this module imports no framework and no
launcher code; the framework packages pass their own.  Host-update notices come from the rendezvous store
(key ``elastic/hosts_updated``, written by the driver), polled by rank 0 only, at commit time.
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from horovod.base.config import read_env
from horovod.base.exceptions import HorovodInternalError, HostsUpdatedInterrupt, PreconditionError

__all__ = ["State", "ObjectState", "run_fn", "run", "HostUpdateResult", "WorkerNotificationManager",
           "get_notification_manager"]

logger = logging.getLogger(__name__)

HOSTS_UPDATED_KEY = "elastic/hosts_updated"
"""Store key the driver writes as ``"<timestamp> <flags>"`` whenever the assignment of hosts changes."""


class HostUpdateResult(enum.IntFlag):
    """What changed in the host set (upstream's flags)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class State:
    """State of a training job that can be committed, restored and synchronised across ranks.

    Subclasses implement ``save()``, ``restore()`` and ``sync()``.

    Args:
        bcast_object: ``f(obj, root_rank=0) -> obj``, the framework's object broadcast.
        get_rank: ``f() -> int``, the framework's ``rank``.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[float, int]] = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after every re-initialisation (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by :func:`run_fn` after the framework re-initialised."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Queue a host-update notice (rank 0 only receives them)."""
        self._host_messages.put((timestamp, int(update_res)))

    def commit(self) -> None:
        """Save the state as the point to roll back to, then check for host changes.

        Call it only after the optimizer step of the batches the state covers: everything committed is
        treated as processed.

        Raises:
            HostsUpdatedInterrupt: hosts were added or removed; ``run_fn`` re-initialises.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Agree with rank 0 on whether hosts changed, and raise ``HostsUpdatedInterrupt`` if they did."""
        if self._rank() == 0:
            manager = _manager
            if manager is not None:
                manager.poll()
        prev_timestamp = last_timestamp = self._last_updated_timestamp
        all_update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, update = self._host_messages.get_nowait()
            if timestamp > last_timestamp:
                last_timestamp = timestamp
                all_update |= update
        prev_timestamp, self._last_updated_timestamp, all_update = self._bcast_object(
            (prev_timestamp, last_timestamp, int(all_update)))
        if self._last_updated_timestamp > prev_timestamp:
            # Only removals: every rank stopped at this same commit, so there is nothing to synchronise.
            raise HostsUpdatedInterrupt(all_update == HostUpdateResult.removed)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Hook for subclasses: the world changed (new rank/size)."""


class ObjectState(State):
    """State of plain picklable attributes: ``ObjectState(bcast, rank, epoch=0, batch=0)``.

    ``save()`` snapshots the attributes, ``restore()`` resets them to the snapshot, ``sync()`` sets every
    rank's attributes to rank 0's snapshot.  An attribute with ``state_dict()``/``load_state_dict()`` (an
    ``ElasticSampler``) is snapshotted through them and restored in place, and its ``reset()`` is called
    when the world changes, so ``ObjectState(..., sampler=sampler)`` commits the processed samples together
    with the rest.
    """

    def __init__(self, bcast_object: Callable[..., Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._stateful = {k for k, v in kwargs.items() if _is_stateful(v)}
        for attr, value in kwargs.items():
            setattr(self, attr, value)
        self._saved_state: dict[str, Any] = {}
        self._attrs = list(kwargs)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self.save()

    def save(self) -> None:
        new_state = {}
        for attr in self._attrs:
            value = getattr(self, attr)
            new_state[attr] = copy.deepcopy(value.state_dict() if attr in self._stateful else value)
        self._saved_state = new_state

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def reset(self) -> None:
        for attr in self._stateful:
            reset = getattr(getattr(self, attr), "reset", None)
            if callable(reset):
                reset()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            if attr in self._stateful:
                getattr(self, attr).load_state_dict(copy.deepcopy(value))
            else:
                setattr(self, attr, copy.deepcopy(value))


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


class WorkerNotificationManager:
    """Delivers the driver's host-update notices to the registered states of this process.

    Rank 0's ``State.check_host_updates()`` calls :meth:`poll`, one GET of ``elastic/hosts_updated`` from
    the rendezvous store.  Notices older than the generation this worker joined are ignored (the assignment
    it got already reflects them).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: set[State] = set()
        self._store = None
        self._last_delivered: float = 0

    def init(self) -> None:
        """Connect to the store named by the environment (no-op without a launcher)."""
        with self._lock:
            if self._store is not None:
                return
            from horovod.base import auth

            addr = read_env("HOROVOD_GLOO_RENDEZVOUS_ADDR")
            port = read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")
            from horovod.common.elastic_init import launched_by_driver

            if not addr or port is None or not launched_by_driver():
                return
            from horovod.transport.store import StoreClient

            key = auth.secret_key_from_env()
            if key is None:
                return
            self._store = StoreClient(addr, port, key, timeout=10.0)

    def register_listener(self, listener: State) -> None:
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener: State) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def handle_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Hand a notice to every registered state."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)

    def poll(self) -> None:
        """Fetch the driver's latest notice and deliver it if it is new to this worker."""
        store = self._store
        if store is None:
            return
        from horovod.common import elastic_init
        from horovod.transport.store import StoreError

        try:
            text = store.get(HOSTS_UPDATED_KEY, timeout=0).decode()
        except StoreError:
            return  # no notice yet (404), or the store is gone: the next collective will tell
        timestamp_text, _, flags_text = text.partition(" ")
        timestamp, flags = float(timestamp_text), int(flags_text or 0)
        baseline = max(self._last_delivered, elastic_init.hosts_baseline())
        if timestamp > baseline:
            self._last_delivered = timestamp
            self.handle_hosts_updated(timestamp, flags)


_manager: WorkerNotificationManager | None = None
_manager_lock = threading.Lock()


def get_notification_manager() -> WorkerNotificationManager:
    """The process's notification manager, created on first use (never at import)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = WorkerNotificationManager()
        return _manager


def __getattr__(name: str) -> Any:
    # Upstream exposes a module-level ``notification_manager``; build it only when someone asks.
    if name == "notification_manager":
        return get_notification_manager()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap ``func(state, ...)`` so that it is retried after failures and host changes.

    ``reset`` re-initialises the framework (``shutdown(); init()``).  There is no retry limit here: the
    driver's ``--reset-limit`` ends the job.  A ``PreconditionError`` (a mismatch between the ranks, see the
    module's docstring) is raised, not retried.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        manager = get_notification_manager()
        manager.init()
        manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except PreconditionError as e:
                    # the ranks disagree about a collective (shapes, types, parameters, or collectives run on
                    # some ranks only): the program's error, which the same code after a reset runs into again
                    # -- it reset and failed forever.  A fault (a peer died or hung) is a ShutdownError.
                    logger.error("elastic: not resetting for a mismatch between the ranks, an error in the "
                                 "program: %s", _first_line(e))
                    raise
                except HorovodInternalError as e:
                    logger.warning("elastic: collective failed, rolling back to the last commit: %s", _first_line(e))
                    logger.debug("elastic: the whole error: %s", e)
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    logger.info("elastic: hosts changed, re-initialising")
                    skip_sync = e.skip_sync
                reset()
                if skip_sync and _newcomers():
                    skip_sync = False  # hosts were also added while the removal was handled
                state.on_reset()
        finally:
            manager.remove_listener(state)

    return wrapper


def _newcomers() -> bool:
    from horovod.common import elastic_init

    return elastic_init.newcomers()


def _first_line(error: BaseException) -> str:
    """The gist of an error the job recovers from: TensorFlow appends the whole graph's traceback to an op's
    message (hundreds of lines per rank, for a failure that was handled)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else repr(error)
    return f"{lines[0]} [{len(lines) - 1} more lines at debug level]"


def _basics_reset() -> None:
    from horovod.common import basics

    basics.shutdown()
    basics.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """``run_fn`` with the framework-free reset (``horovod.common.basics``); for numpy-only jobs."""
    return run_fn(func, _basics_reset)
