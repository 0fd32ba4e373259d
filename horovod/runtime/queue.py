"""Handles and the tensor queue shared by framework threads and the engine thread.

An entry keeps the caller's input (and output, for in-place ops) alive until the collective completes: the
engine reads and writes those buffers after ``enqueue`` has returned, so the caller must not free them —
the adapters keep a reference to the handle, which keeps the entry, which keeps the buffers.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from horovod.base.timer import one_shot_timer
from horovod.runtime.messages import Request

__all__ = ["Handle", "TensorEntry", "TensorQueue"]


class _Completion:
    """One condition variable shared by many handles: completing a handle costs two attribute writes, and
    only wakes a thread when one is actually waiting."""

    __slots__ = ("cond", "waiters")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.waiters = 0

    def notify(self) -> None:
        if self.waiters:
            with self.cond:
                self.cond.notify_all()


_DEFAULT_COMPLETION = _Completion()


class Handle:
    """The future of one enqueued tensor; ``wait()`` returns its result or raises its error."""

    __slots__ = ("_done", "_result", "_error", "name", "_queue", "_completion")

    def __init__(self, name: str, queue: TensorQueue | None = None) -> None:
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self.name = name
        self._queue = queue
        self._completion = queue.completion if queue is not None else _DEFAULT_COMPLETION

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            queue = self._queue
            limit = timeout
            if queue is None:
                self._block(timeout, limit)
            else:
                drive = queue.driver
                if drive is not None:  # run the engine's rounds here while it is free (engine.py)
                    deadline = None if timeout is None else time.monotonic() + timeout
                    drive(self, deadline)
                    if deadline is not None:
                        timeout = max(0.0, deadline - time.monotonic())
                if not self._done:  # the engine thread does the work: end its gather window now
                    queue.caller_blocking()
                    try:
                        self._block(timeout, limit)
                    finally:
                        queue.caller_unblocked()
        if self._error is not None:
            raise self._error
        return self._result

    def _block(self, timeout: float | None, limit: float | None) -> None:
        if self._done:
            return
        completion = self._completion
        with completion.cond:
            completion.waiters += 1
            try:
                finished = completion.cond.wait_for(lambda: self._done, timeout)
            finally:
                completion.waiters -= 1
        if not finished:
            raise TimeoutError(f"collective {self.name!r} did not complete within {limit} s")

    def set_result(self, result: Any, notify: bool = True) -> None:
        """Complete the handle; ``notify=False`` lets the engine wake waiters once per batch instead."""
        self._result = result
        self._done = True
        if notify:
            self._completion.notify()

    def set_error(self, error: BaseException, notify: bool = True) -> None:
        self._error = error
        self._done = True
        if notify:
            self._completion.notify()


class TensorEntry(Handle):
    """One tensor of a pending collective: request and buffers.  It is its own handle (one object per
    tensor on the enqueue path, not two); ``handle`` is kept for readability at the call sites."""

    __slots__ = ("request", "tensor", "output", "sync")

    def __init__(self, request: Request, tensor: np.ndarray | None, output: np.ndarray | None,
                 queue: TensorQueue | None = None, sync: bool = False) -> None:
        self._done = False
        self._result = None
        self._error = None
        self.name = request.name
        self._queue = queue
        self._completion = queue.completion if queue is not None else _DEFAULT_COMPLETION
        self.request = request
        self.tensor = tensor
        self.output = output
        self.sync = sync  # enqueued by a caller that waits for it right away (a synchronous op)

    @property
    def handle(self) -> Handle:
        return self


class TensorQueue:
    """Entries waiting for negotiation, plus the table of in-flight names (duplicates are rejected)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completion = _Completion()
        # Set by the engine: ``driver(handle, deadline)`` runs its rounds in a waiting caller's thread.
        self.driver = None
        # The gather window's gate: a bare lock kept locked; a caller about to wait releases it, the window
        # takes it back.  Waiting on it is one C call without the GIL (a Condition runs Python on each wake).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._new: list[TensorEntry] = []
        self._in_flight: dict[tuple[int, str], TensorEntry] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # Guards the pipe's descriptors against close(): a write or close after close() would hit whatever
        # reused the number since (e.g. a socket of the next init() generation).
        self._fd_lock = threading.Lock()
        self._signalled = False
        self._byte = False
        # A new entry nobody waits for yet arms this timer instead of writing the pipe (see base/timer.py):
        # the engine thread wakes when it expires, unless a caller ran the round meanwhile (drain disarms it).
        self._timer = one_shot_timer()
        self._armed = False

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    @property
    def timer_fd(self) -> int | None:
        """The wake timer's descriptor (readable once it expired), None where there is no timer."""
        return self._timer.fileno() if self._timer is not None else None

    def set_delay(self, seconds: float) -> None:
        """How long a new entry may wait before the engine thread is woken for it (the cycle time; 0: at
        once)."""
        if self._timer is not None:
            self._timer.set_delay(seconds)

    def _arm(self) -> bool:
        """Under ``_lock``: arm the wake timer for a new entry; False where the pipe must wake the engine."""
        timer = self._timer
        if timer is None or timer.delay <= 0:
            return False
        timer.arm()
        self._armed = True
        return True

    def _disarm(self) -> None:
        """Under ``_lock``: the entries the timer was armed for are taken; it must not wake anybody."""
        if self._armed:
            self._armed = False
            self._timer.disarm()  # type: ignore[union-attr]

    def push_one(self, entry: TensorEntry, wake: bool = True) -> str | None:
        """:meth:`push` of a single entry (the common case, without the batch bookkeeping).

        ``wake=False``: the caller waits for the result right away and runs the engine's round itself, so
        the engine thread is not woken (a wake-up it does not need costs the caller a GIL hand-over);
        :meth:`Handle.wait` wakes it when the caller cannot run the round."""
        key = (entry.request.process_set_id, entry.name)
        with self._lock:
            if key in self._in_flight:
                return entry.name
            self._in_flight[key] = entry
            self._new.append(entry)
            signal = wake and not self._signalled
            if signal:
                self._signalled = True
                signal = not self._arm()
        if signal:
            self._poke()
        return None

    def push(self, entries: list[TensorEntry]) -> str | None:
        """Add entries atomically; returns the first duplicate name instead of adding anything."""
        if len(entries) == 1:
            return self.push_one(entries[0])
        with self._lock:
            for e in entries:
                if (e.request.process_set_id, e.request.name) in self._in_flight:
                    return e.request.name
            names = {(e.request.process_set_id, e.request.name) for e in entries}
            if len(names) != len(entries):
                return entries[0].request.name
            for e in entries:
                self._in_flight[(e.request.process_set_id, e.request.name)] = e
            self._new.extend(entries)
            signal = not self._signalled and not self._arm()
            self._signalled = True
        if signal:
            self._poke()
        return None

    def _poke(self) -> None:
        with self._fd_lock:
            if self._wake_w < 0:  # closed: the engine has exited and fails whatever is left
                return
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass
        self._byte = True  # after the write: drain() reads the pipe only when a byte may be there

    def caller_blocking(self) -> None:
        """A framework thread is about to wait for a result: end the engine's gather window now (or make the
        next one end at once)."""
        if self._gate.locked():
            try:
                self._gate.release()
            except RuntimeError:  # another waiting thread opened it meanwhile
                pass

    def caller_unblocked(self) -> None:
        """The waiting thread got its result: a later window must wait for its next wait (a "caller waits"
        left over from this one would send the first tensor of the next burst alone)."""
        self._gate.acquire(blocking=False)

    def gather_window(self, timeout: float) -> None:
        """Called by the engine right after it was woken: give the enqueuing thread the GIL for up to
        ``timeout`` seconds so that tensors enqueued back to back leave in one batch (and fuse), but stop as
        soon as that thread blocks on a result."""
        if timeout > 0:
            self._gate.acquire(timeout=timeout)
        else:
            self._gate.acquire(blocking=False)  # consume a stale "caller waits"

    def wake(self) -> None:
        with self._lock:
            self._signalled = True
        self._poke()

    def ensure_awake(self) -> None:
        """Wake the engine thread if entries wait that it was not told about (see ``push_one(wake=False)``)."""
        if not self._new or self._signalled:
            return
        with self._lock:
            signal = bool(self._new) and not self._signalled
            if signal:
                self._signalled = True
        if signal:
            self._poke()

    def park(self) -> None:
        """The engine thread goes back to sleep while a caller runs the rounds: forget the wake-up it got
        (the pipe is emptied first, then the flag cleared, so a push after this pokes again).  What the
        caller's rounds leave behind wakes it again: the caller calls :meth:`ensure_awake` once it stopped
        driving."""
        self._byte = False
        try:
            os.read(self._wake_r, 65536)
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            self._signalled = False

    def mark_woken(self) -> None:
        """The wake pipe was seen readable: the next :meth:`drain` empties it."""
        self._byte = True

    def consume_wake(self) -> None:
        """Empty the wake pipe once it was seen readable, without taking the entries (a round that sends
        nothing: a readable pipe left behind would end every sleep at once)."""
        if self._byte:
            self._byte = False
            try:
                os.read(self._wake_r, 65536)
            except (BlockingIOError, OSError):
                pass

    def drain(self) -> list[TensorEntry]:
        """Entries added since the last call (whoever runs the engine's round)."""
        self.consume_wake()  # *before* taking the list, so a concurrent push leaves a byte behind
        if not self._new and not self._signalled and not self._armed:  # nothing queued: no lock (the common round)
            return []
        with self._lock:
            new, self._new = self._new, []
            self._signalled = False
            self._disarm()  # whoever runs this round sends them: nobody need wake for them any more
        return new

    def timer_fired(self) -> None:
        """The wake timer's descriptor was seen readable: consume the expiry (the round drains the entries)."""
        if self._timer is not None:
            self._timer.clear()

    def pop(self, process_set_id: int, name: str) -> TensorEntry | None:
        with self._lock:
            return self._in_flight.pop((process_set_id, name), None)

    def pop_many(self, process_set_id: int, names: list[str]) -> list[TensorEntry | None]:
        """The entries of ``names`` (None where this rank has none, e.g. it joined), under one lock."""
        with self._lock:
            pop = self._in_flight.pop
            return [pop((process_set_id, name), None) for name in names]

    def pop_all(self) -> list[TensorEntry]:
        with self._lock:
            entries = list(self._in_flight.values())
            self._in_flight.clear()
            self._new.clear()
            self._disarm()
        return entries

    def close(self) -> None:
        """Close the wake pipe (idempotent: the descriptors are closed exactly once)."""
        with self._fd_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            if self._timer is not None:
                self._timer.close()
        for fd in fds:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
