"""The engine: one background thread per process that owns all communication.

Framework threads call :meth:`Engine.enqueue` and get handles.  The thread wakes as soon as work arrives
(a byte on a pipe, no fixed cycle), sends the new requests to the coordinator (global rank 0, whose own
engine drives the :class:`~horovod.runtime.coordinator.Coordinator` in the same loop), executes the
responses it receives in order, and completes the handles.  Tensors enqueued while the thread is busy are
sent together and fused.

Shutdown is collective like upstream's: a rank that shuts down (or dies, or whose collective fails) makes
the coordinator send a shutdown notice to every rank, and every pending handle fails with the shut-down
error plus the cause.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from horovod.base.config import EnvVarError, RuntimeConfig, explicit_knobs
from horovod.base.cores import Spin, may_spin
from horovod.base.exceptions import SHUT_DOWN_MESSAGE, HorovodInternalError, WireError, shutdown_error
from horovod.runtime.autotune import ParameterManager, Params
from horovod.runtime.coordinator import Coordinator, collective_failure
from horovod.runtime.executor import CollectiveFailure, Executor
from horovod.runtime.messages import (
    Request,
    RequestType,
    Response,
    decode_requests,
    decode_responses,
    encode_requests,
    encode_responses,
)
from horovod.runtime.queue import Handle, TensorEntry, TensorQueue
from horovod.runtime.timeline import Timeline
from horovod.transport.communicator import Communicator, PeerFailure
from horovod.transport.local import SelfCommunicator
from horovod.transport.outbox import Outbox
from horovod.transport.wire import FrameReader, new_scratch

__all__ = ["Engine", "Topology", "DUPLICATE_NAME_MESSAGE"]

log = logging.getLogger(__name__)

DUPLICATE_NAME_MESSAGE = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor that is "
    "currently being processed.  If you want to request another tensor, use a different tensor name."
)
_REQUESTS = 1
_RESPONSES = 2
_READABLE = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
# Responses whose execution waits for the other members in the data plane.
_DATA_PLANE = frozenset({RequestType.ALLREDUCE, RequestType.ALLGATHER, RequestType.BROADCAST,
                         RequestType.ALLTOALL, RequestType.REDUCESCATTER})
_NO_DEADLINE = 365 * 86400.0  # the wait of a job whose knobs say never
_DRAIN_TIMEOUT = 2.0  # seconds the last control frames may take to leave when the engine stops
_KEEPALIVE = 3  # payload: the sender's time.monotonic() as a big-endian double
_PARAMS = 4  # rank 0 -> workers: autotune's next parameters (Params.pack), in order with the responses
_STAMP = struct.Struct("!d")
_SHUTDOWN_ACK_TIMEOUT = 5.0
# The bounded spin of a synchronous op's caller (Engine._spin): at least this long, and it starts from this
# typical wait (a small op's round trip on a quick host) until waits on this host are measured.
_MIN_SPIN = 50e-6
_FIRST_TYPICAL_WAIT = 50e-6
# Allreduces of at most this many bytes per batch travel with their request and are reduced by the
# coordinator, which answers with the result: one round trip instead of negotiation plus a data exchange.
_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"


def engine_core(config: RuntimeConfig, topology: Topology) -> int | None:
    """The CPU core ``HOROVOD_THREAD_AFFINITY`` gives this rank's engine thread (its local rank's entry), or
    None when unset.

    Raises:
        EnvVarError: fewer ids than ranks on this host, or a core this process may not run on.
    """
    cores = config.thread_affinity
    if not cores:
        return None
    text = ",".join(map(str, cores))
    if len(cores) < topology.local_size:
        raise EnvVarError("HOROVOD_THREAD_AFFINITY", text, f"names {len(cores)} core(s) but this host runs "
                          f"{topology.local_size} ranks: give one core id per local rank")
    core = cores[topology.local_rank]
    allowed = os.sched_getaffinity(0)
    if core not in allowed:
        raise EnvVarError("HOROVOD_THREAD_AFFINITY", text, f"gives local rank {topology.local_rank} core {core}, "
                          f"which this process may not run on (allowed: {sorted(allowed)})")
    return core


def check_output_files(config: RuntimeConfig, rank: int) -> None:
    """Rank 0 writes the timeline and the autotune log: a path it cannot write fails ``init()`` before the job
    meets, naming the variable (upstream logs an error and runs on without the file).

    Raises:
        EnvVarError: the file's directory is missing or not writable, or the path is a directory.
    """
    if rank != 0:
        return
    timeline = "" if config.timeline.upper() == "DYNAMIC" else config.timeline
    for name, path in (("HOROVOD_TIMELINE", timeline),
                       ("HOROVOD_AUTOTUNE_LOG", config.autotune_log if config.autotune else "")):
        problem = path and _unwritable(path)
        if problem:
            raise EnvVarError(name, path, f"cannot be written by rank 0: {problem}")


def _unwritable(path: str) -> str | None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a directory"
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "permission denied"
    return None


class Engine:
    """Owns the queue, the background thread, the process-set table and (on rank 0) the coordinator.

    ``core``: the CPU the engine thread pins itself to (:func:`engine_core`), as upstream's background thread.
    """

    def __init__(self, topology: Topology, config: RuntimeConfig, mesh=None,
                 process_sets: dict[int, list[int]] | None = None, core: int | None = None) -> None:
        self.topology = topology
        self._core = core
        self.rank = topology.rank
        self.size = topology.size
        self.config = config
        self.mesh = mesh
        self._sets_lock = threading.Lock()
        self.process_sets: dict[int, list[int]] = {0: list(range(self.size))}
        self.process_sets.update(process_sets or {})
        self.queue = TensorQueue()
        self.timeline: Timeline | None = None
        if self.rank == 0 and config.timeline:
            self.timeline = Timeline(config.timeline_mark_cycles)
            if config.timeline.upper() != "DYNAMIC":
                self.timeline.start(config.timeline)
        # Liveness (docs/running.md, "Deadlines"): each rank sends a keep-alive on its control channels every
        # ``_beat`` s from a thread of its own; a peer silent past ``_deadline`` while a rank waits for it is
        # reported as unresponsive (a stopped or hung process never ends a wait otherwise).
        self._deadline, self._deadline_knob = liveness_deadline(config)
        if self.size == 1 or mesh is None:
            self._deadline = None
        self._beat = min(1.0, self._deadline / 4) if self._deadline else 1.0
        self.coordinator: Coordinator | None = None
        if self.rank == 0:
            self.coordinator = Coordinator(
                self.size, dict(self.process_sets), cache_capacity=config.cache_capacity,
                fusion_threshold=config.fusion_threshold, disable_group_fusion=config.disable_group_fusion,
                timeline=self.timeline, stall_warning=config.stall_check_time,
                stall_shutdown=config.stall_shutdown_time, stall_disable=config.stall_check_disable,
                failure_settle=self._beat, failure_wait=self._deadline or 30.0)
        self._comms: dict[int, Communicator] = {}
        self.executor = Executor(self.queue, self._communicator, self.timeline)
        self._cache: dict[tuple[int, str], tuple[int, tuple]] = {}
        # (set, cache id) -> (cache key or None when this rank ran it without an entry, template): the
        # template rebuilds a compact response (``Response.cached_ids``) of that id
        self._cache_keys: dict[tuple[int, int], tuple[tuple[int, str] | None, Response]] = {}
        # Eviction notices that arrived before their response ran (it is still in _todo: same or earlier
        # frame).  Such an id must never enter the cache: a later hit would name an id the coordinator forgot.
        self._evicted_early: set[tuple[int, int]] = set()
        self._seq = 0  # response frames received
        self._cycle = max(0.0, config.cycle_time_ms) / 1000.0
        self._outstanding = 0  # tensors sent to the coordinator whose responses have not run yet
        self._todo: collections.deque[Response | _ParamsMarker | _AnswersQueued] = collections.deque()
        self._answers_mark: dict[int, int] | None = None  # see _deliver_before
        self._shutdown_requested: str | None = None
        self._shutdown_sent_at: float | None = None
        self._closed_peers: set[int] = set()
        self._stop_reason: str | None = None
        self._ctrl_lock = threading.Lock()  # the keep-alive thread sends only while the channels are open
        self._beats_stop = threading.Event()
        now = time.monotonic()
        self._clocks = {r: _PeerClock(now) for r in (range(1, self.size) if self.rank == 0 else (0,))}
        self._asked_at = now  # when this rank last went from nothing outstanding to waiting for rank 0
        self._next_liveness_check = 0.0
        self._draining: set[int] = set()  # peers with control frames still unread (e.g. after a collective)
        self._broken: tuple[str, float, int] | None = None  # a collective failed: (reason, when, peer)
        self._failed_entries: list[TensorEntry] = []  # their handles fail with the job's cause
        self._executed = 0  # responses executed (where autotune switched, see autotune_history)
        self.autotune_history: list[tuple[int, Params]] = []
        """(responses executed before, parameters) for every autotune switch: equal on every rank."""
        self._tune_hierarchy = False
        self._tuner = self._make_tuner() if config.autotune and self.rank == 0 else None
        self.stopped = threading.Event()
        self._exited = False  # stopped.is_set() without a call, on the enqueue path
        self._forked_from: int | None = None  # set in a forked child (orphan_after_fork)
        self._spin_time = max(0.0, config.spin_wait_us) * 1e-6  # the most one spin lasts (see _spin)
        if not may_spin(topology.local_size):
            self._spin_time = 0.0  # more ranks here than cores: a spinning rank takes the core a peer needs
        self._spinner = Spin(0.0)  # its length is set before each spin (see _spin); it keeps the back-off
        self._typical_wait = _FIRST_TYPICAL_WAIT  # running mean of a synchronous op's waits (see _learn_wait)
        # Rounds of engine work run under ``_drive``, in the engine thread or in a caller waiting for a result
        # (_drive_until).  ``_ctrl`` polls the control channels; the engine thread sleeps on ``_idle`` (wake
        # pipe + ``_ctrl``), a driving caller on ``_drive_poll`` (the same two).
        self._drive = threading.Lock()
        self._finished = False
        self._ctrl = select.epoll()
        self._channels: dict[int, FrameReader] = {}  # by file descriptor
        scratch = new_scratch()  # one receive buffer: only the thread running a round reads
        for channel in (mesh.ctrl.values() if mesh is not None else ()):
            self._channels[channel.fileno()] = FrameReader(channel, scratch=scratch)
            self._ctrl.register(channel.fileno(), select.EPOLLIN)
        # The queue's wake timer (a new entry nobody waits for yet) is watched with the channels: by the engine
        # thread through ``_ctrl``, which a driving caller takes out of its sleep, and by that caller itself.
        self.queue.set_delay(self._cycle)
        self._timer_fd = self.queue.timer_fd
        if self._timer_fd is not None:
            self._ctrl.register(self._timer_fd, select.EPOLLIN)
        self._ctrl_fd = self._ctrl.fileno()
        self._idle = select.epoll()
        self._idle.register(self.queue.wake_fd, select.EPOLLIN)
        self._idle.register(self._ctrl_fd, select.EPOLLIN)
        self._drive_poll = select.epoll()  # the channels themselves: its events say which ones to read
        self._drive_poll.register(self.queue.wake_fd, select.EPOLLIN)
        for fd in self._channels:
            self._drive_poll.register(fd, select.EPOLLIN)
        if self._timer_fd is not None:
            self._drive_poll.register(self._timer_fd, select.EPOLLIN)
        # Control frames never block their sender (see transport/outbox.py); what waits is sent from the
        # rounds once the channel is writable.
        self._outbox = Outbox(mesh.ctrl if mesh is not None else {}, self._watch_writable)
        self.queue.driver = self._drive_until
        self._thread = threading.Thread(target=self._run, name="horovod-engine", daemon=True)

    # ------------------------------------------------------------------ caller side
    def start(self) -> None:
        self._thread.start()
        if self._deadline is not None:
            threading.Thread(target=self._keepalive, name="horovod-keepalive", daemon=True).start()

    def enqueue(self, items: list[tuple[Request, object, object]]) -> list[Handle]:
        """Queue ``(request, input array, output array or None)`` items atomically; returns their handles.

        Raises ValueError for a name already in flight, ShutdownError once the engine has stopped.
        """
        if self.stopped.is_set() or self._forked_from is not None:
            self._raise_stopped()
        queue = self.queue
        entries = [TensorEntry(req, tensor, output, queue) for req, tensor, output in items]
        duplicate = queue.push(entries)
        if duplicate is not None:
            raise ValueError(DUPLICATE_NAME_MESSAGE)
        if self.stopped.is_set():  # lost a race with the engine's exit: fail what we just queued
            self._fail_pending()
        return entries

    def enqueue_one(self, request: Request, tensor, output, wake: bool = True, send_now: bool = False) -> Handle:
        """:meth:`enqueue` of one item (the per-tensor path of the adapters); ``wake=False`` when the caller
        waits for it right away (see :meth:`TensorQueue.push_one`).  ``send_now``: another thread will wait
        for it, and the request leaves from this one now (see :meth:`_send_now`)."""
        if self._exited:
            self._raise_stopped()
        entry = TensorEntry(request, tensor, output, self.queue, not (wake or send_now))
        if self.queue.push_one(entry, wake and not send_now) is not None:
            raise ValueError(DUPLICATE_NAME_MESSAGE)
        if self._exited:  # lost a race with the engine's exit: fail what we just queued
            self._fail_pending()
        elif send_now:
            self._send_now()
        return entry

    def orphan_after_fork(self, parent: int) -> None:
        """In a child forked from this rank (a DataLoader worker, ``os.fork()``): the child has the engine's state
        but none of its threads, and shares its sockets with the rank.  Operations fail at once instead of
        waiting forever, and nothing is ever sent or closed from here (see :meth:`shutdown`)."""
        self._forked_from = parent
        self._exited = True  # (no Event or lock is touched: another thread of the rank may have held it)

    @property
    def forked_from(self) -> int | None:
        """The rank's pid in a process forked from it (see :meth:`orphan_after_fork`), else None."""
        return self._forked_from

    def _raise_stopped(self) -> None:
        if self._forked_from is not None:
            raise RuntimeError(f"Horovod operations cannot run in a process forked from a Horovod rank (this "
                               f"process was forked from rank {self.rank}, pid {self._forked_from}, e.g. a "
                               f"DataLoader worker): run the collective in the rank itself")
        raise self._shutdown_error()

    def shutdown(self, reason: str | None = None, timeout: float = 30.0) -> None:
        """Ask the job to shut down and wait for this engine's thread to finish."""
        if self._forked_from is not None:
            return  # the rank owns the channels and segments
        if not self._thread.is_alive():
            self._finish_resources()
            return
        if self._shutdown_requested is None:
            self._shutdown_requested = reason or f"rank {self.rank} called shutdown()"
        self.queue.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("Horovod engine did not stop within %.0f s", timeout)

    def set_ranks(self, set_id: int) -> list[int] | None:
        with self._sets_lock:
            return self.process_sets.get(set_id)

    def set_table(self) -> dict[int, list[int]]:
        """A copy of every registered process set's ranks, by id (taken under the engine's lock)."""
        with self._sets_lock:
            return {k: list(v) for k, v in self.process_sets.items()}

    def _shutdown_error(self) -> HorovodInternalError:
        """What operations fail with once the job shut down: ``ShutdownError`` with the cause, or
        ``PreconditionError`` when the cause is mismatched collectives (a program error, see
        ``coordinator.mismatched_collectives``)."""
        return shutdown_error(self._shutdown_message(), self._stop_reason)

    def _shutdown_message(self) -> str:
        reason = self._stop_reason
        if reason is None or reason == f"rank {self.rank} called shutdown()":  # our own: upstream's exact text
            return SHUT_DOWN_MESSAGE
        return f"{SHUT_DOWN_MESSAGE} Cause: {reason}"

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            if self._core is not None:
                os.sched_setaffinity(0, {self._core})  # 0: the calling thread only
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the loop must always release the job
            self._engine_failed(e)
        finally:
            with self._drive:  # no caller is inside a round from here on, and none enters one
                self._finished = True
                with self._ctrl_lock:
                    self._beats_stop.set()
                self._exited = True
                self.stopped.set()
                self._fail_failed_entries()
                self._fail_pending()
                self._finish_resources()

    def _engine_failed(self, e: BaseException) -> None:
        """A round raised (a bug, or an interrupt that cut a round short): this rank's engine state can no
        longer be trusted, so the job shuts down with the cause."""
        if isinstance(e, Exception):
            log.error("Horovod background loop uncaught exception: %s", e, exc_info=True)
            reason = f"rank {self.rank}: {e}"
        else:
            reason = f"rank {self.rank}: {type(e).__name__} interrupted the engine in the middle of its work"
            log.error(reason)
        if self._stop_reason is None:
            self._stop_reason = reason
        self._notify_shutdown(self._stop_reason)

    def _loop(self) -> None:
        """The engine thread: sleep until something happens, then run a round, unless a waiting caller is
        running them itself (see :meth:`_drive_until`)."""
        wake_fd = self.queue.wake_fd
        poll = self._idle.poll
        parked = False  # a caller runs the rounds, and wakes this thread when it stops if work is left
        masked = False  # this thread took the control channels out of its own sleep when it parked
        while self._stop_reason is None:
            events = poll(self._beat if parked else self._select_timeout())
            parked = False
            if any(fd == wake_fd for fd, _ in events):
                # Let tensors enqueued back to back leave together (and fuse); the window ends as soon as
                # the enqueuing thread waits for a result, and a caller that waits right away (a lone
                # synchronous op) runs the round itself without waking this thread at all.  A caller that
                # already drives (this thread woke late) needs no window: waking up when it timed out, in
                # the middle of that caller's step, only takes a core from it or from its peers.
                self.queue.mark_woken()
                if not self._drive.locked():
                    self.queue.gather_window(self._cycle)
            if not self._drive.acquire(blocking=False):
                # A waiting caller runs the rounds: sleep again rather than wait for its lock, whose release
                # would wake this thread in the middle of the caller's next op (and often take that op's
                # rounds from it).  The caller wakes this thread once it stops driving if work is left.
                # Frames that arrived for the lock's holder to read must not wake this thread meanwhile: it
                # would spin on them, taking the GIL from the very thread it waits for (seen: a thread that
                # sent a request and held the lock for ~5 ms while this one woke 50-170 times per step).
                # Every other holder takes them back into this sleep once it released the lock.
                self.queue.park()
                self._idle.modify(self._ctrl_fd, 0)
                masked = True
                if not self._drive.acquire(blocking=False):
                    parked = True
                    continue
            try:
                if masked:
                    masked = False
                    self._unmask_ctrl()
                if self._stop_reason is None:
                    self._round()
            finally:
                self._drive.release()

    def _round(self, events: list[tuple[int, int]] | None = None) -> None:
        """One pass of the engine's work; whoever runs it holds ``_drive`` (the engine thread, or a caller
        waiting for a result).  ``events``: the driving caller's poll result (which channels are readable),
        None to poll the channels here."""
        if self.timeline is not None:
            self.timeline.mark_cycle()
        ready: set[int] = set()  # peers whose control frames were read now (not silent)
        self._read_ctrl(self._ctrl.poll(0) if events is None else events, ready)
        self._send_local_requests()
        self._draining = ready
        self._check_liveness(ready)
        if self.coordinator is not None:
            self._coordinate()
        self._execute_todo()
        if self._shutdown_sent_at is not None and self._stop_reason is None and \
                time.monotonic() - self._shutdown_sent_at > _SHUTDOWN_ACK_TIMEOUT:
            self._stop_reason = self._shutdown_requested

    def _read_ctrl(self, events: list[tuple[int, int]], ready: set[int]) -> None:
        """Read every control frame that arrived (one frame per channel and round let a backlog grow behind
        a busy rank 0) and send what waited for a channel to become writable."""
        channels = self._channels
        for fd, mask in events:
            reader = channels.get(fd)
            if reader is None:
                if fd == self._timer_fd:
                    self.queue.timer_fired()  # this round's drain sends what it woke us for
                continue
            if mask & select.EPOLLOUT:
                self._outbox.flush(reader.channel.peer)
            if mask & _READABLE:
                ready.add(reader.channel.peer)
                self._on_frames(reader)

    def _watch_writable(self, channel, on: bool) -> None:
        """The outbox's callback: poll ``channel`` for writability while frames wait for it."""
        mask = select.EPOLLIN | (select.EPOLLOUT if on else 0)
        fd = channel.fileno()
        for ep in (self._ctrl, self._drive_poll):
            try:
                ep.modify(fd, mask)
            except (OSError, ValueError):  # closed: the peer is gone, or the engine has finished
                pass

    def _drive_until(self, handle: Handle, deadline: float | None) -> None:
        """Run the engine's rounds in the calling thread until ``handle`` completes (or the deadline passes,
        or the engine stops).  Called by :meth:`Handle.wait`.

        A caller that waits would otherwise be woken by the engine thread, which was itself woken by the
        control socket: two thread wake-ups per result, each 15-130 us on a busy host.  Running the rounds
        here, the response wakes the waiting thread directly, and requests leave without waking the engine
        thread.  Only one thread runs rounds at a time (``_drive``); when the engine thread is busy, the
        caller waits as before.  While a caller drives, the engine thread's sleep does not include the
        control sockets, so it is not woken for frames the caller reads.

        An interrupt (KeyboardInterrupt) while the caller sleeps in ``poll`` leaves the engine intact; one
        that lands in the middle of a round shuts the job down with that cause (see :meth:`_engine_failed`).
        """
        if not self._drive.acquire(blocking=False):  # the engine thread is in a round: it will finish
            self.queue.ensure_awake()
            return
        engine_has_work = None  # decided when this caller stops driving
        try:
            if self._finished or self._stop_reason is not None:
                return
            self._idle.modify(self._ctrl_fd, 0)  # back once the lock is released (see _loop)
            try:
                poll = self._drive_poll.poll
                wake_fd = self.queue.wake_fd
                # only a synchronous op's caller spins (see _spin), and only where spinning is on
                spin = getattr(handle, "sync", False) and self._spin_time > 0
                events = None
                while True:
                    try:
                        self._round(events)
                    except Exception as e:  # noqa: BLE001 - as in the engine thread: the job ends with a cause
                        self._engine_failed(e)
                    except BaseException as e:
                        self._engine_failed(e)
                        raise
                    if handle._done or self._stop_reason is not None:
                        break
                    timeout = self._select_timeout()
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        timeout = min(timeout, left)
                    if spin and timeout > 0:
                        began = time.perf_counter()
                        events = self._spin(poll) or poll(timeout)
                        if events:
                            self._learn_wait(time.perf_counter() - began)
                    else:
                        events = poll(timeout)
                    for fd, _ in events:
                        if fd == wake_fd:
                            self.queue.mark_woken()
            finally:
                engine_has_work = self._stop_reason is not None or bool(self._todo) or \
                    self._broken is not None or self._shutdown_requested is not None or \
                    (self.coordinator is not None and self.coordinator.failures_pending)
        finally:
            self._drive.release()
            if engine_has_work is not None:
                self._unmask_ctrl()
        # After the release: an engine thread woken before it would go back to sleep (see _loop).
        if engine_has_work:
            self.queue.wake()  # the engine thread has work (or must exit): do not let it sleep
        elif engine_has_work is not None:
            self.queue.ensure_awake()  # entries another thread queued without waking anyone

    def _send_now(self) -> None:
        """Send the queued requests (and, on the coordinator, answer what is complete) from this thread,
        unless another thread runs a round now, which then does it.

        For a caller that does not wait itself (TensorFlow's submit op: its completer thread waits): the
        request leaves at once instead of after that thread, or the engine thread, woke up (0.3-0.5 ms on the
        critical path of a training step on a busy host).  Nothing is executed here; the waiting thread runs
        the rounds that do it, or the engine thread, woken when work is left and nobody may be driving."""
        if not self._drive.acquire(blocking=False):
            self.queue.ensure_awake()  # whoever runs rounds polls the wake pipe
            return
        try:
            if self._finished or self._stop_reason is not None:
                return
            self._send_local_requests()
            if self.coordinator is not None:
                self._coordinate()
        finally:
            self._drive.release()
            self._unmask_ctrl()
            if self._todo or self._stop_reason is not None:
                self.queue.wake()

    def _unmask_ctrl(self) -> None:
        """After releasing ``_drive`` (or, in the engine thread, on taking it after it parked): let control frames
        wake the engine thread again, which takes them out of its sleep while another thread holds the lock (see
        :meth:`_loop`).
        After the release, not before: a parked engine thread masks them before it tries the lock again, so
        whichever of the two comes last, either it gets the lock or this unmasks."""
        try:
            self._idle.modify(self._ctrl_fd, select.EPOLLIN)
        except (OSError, ValueError):  # closed: the engine has finished
            pass

    def _spin(self, poll) -> list | None:
        """Poll without sleeping for a while before the caller sleeps; the answer's events, or None.

        When the answer comes while spinning, the two thread wake-ups (ours, and the peer's if it spins
        too) cost nothing, which more than halves a small op's latency when each rank has a core.  How long
        an answer takes depends on the host: 40-60 us where a Python step costs what it did on the host the
        spin was first tuned on, three times that on a VM whose cores run Python three times slower.  A fixed
        spin too short for the host always ends just before the answer (and then backs off, below), so the
        spin lasts twice the typical wait seen lately (:meth:`_learn_wait`), never more than
        ``HOROVOD_SPIN_WAIT_US``.  With more ranks on this host than cores it does not spin at all (a
        spinning rank would take the core a peer needs to answer).  On an otherwise busy host the peer is
        often not running and the spin only burns a core, so after a spin that found nothing the next ones are
        skipped (1, 2, 4 ... 64 waits) until one succeeds again.  Only the caller of a synchronous op spins
        (``hvd.allreduce``, ``allreduce_``: enqueued and waited for at once); a training step's wait for the
        gradients it reduced asynchronously does not, as measured on the shared 2-core host, where spinning
        there cost some runs 8-11% of their steps.
        """
        if not self._spin_time:
            return None
        spinner = self._spinner
        spinner.seconds = min(self._spin_time, max(_MIN_SPIN, 2.0 * self._typical_wait))
        return spinner.poll(lambda: poll(0) or None)

    def _learn_wait(self, waited: float) -> None:
        """Fold one wait of a synchronous op's caller (spin and sleep, until events came) into the running
        mean the spin is sized from.  A wait longer than the spin's bound counts as that bound: a peer that
        is late by milliseconds (still computing) says nothing about how fast this host answers, and the
        backoff takes care of it."""
        self._typical_wait += (min(waited, self._spin_time) - self._typical_wait) * 0.125

    def _on_frames(self, reader: FrameReader) -> None:
        """Handle the control frames that arrived from one peer (all of them, without waiting for more)."""
        channel = reader.channel
        try:
            frames = reader.read()
        except (ConnectionError, OSError) as e:
            self._lost_channel(channel, e)
            return
        for kind, payload in frames:
            self._on_frame(channel.peer, kind, payload)

    def _lost_channel(self, channel, e: BaseException) -> None:
        """The control connection to ``channel.peer`` ended (closed, reset, or garbage on it)."""
        peer = channel.peer
        fd = channel.fileno()
        if self._channels.pop(fd, None) is not None:
            self._ctrl.unregister(fd)
            self._drive_poll.unregister(fd)
        self._closed_peers.add(peer)
        silent = self._silence(peer)  # a peer stopped for a while, then killed, was unresponsive first
        if self.coordinator is None:
            if self._stop_reason is None:
                if self._shutdown_requested is not None:
                    reason = self._shutdown_requested
                elif isinstance(e, WireError):  # garbage on the stream: the peer is alive, and broken
                    reason = f"rank 0 sent a malformed control message: {e}"
                    log.error(reason)
                elif silent is not None:
                    reason = self._unresponsive(0, silent, f"rank {self.rank} waited for it",
                                                f", then it closed ({e})")
                else:
                    reason = f"lost the connection to the coordinator (rank 0): {e}"
                    if self._broken is not None:
                        reason = f"{self._broken[0]}; {reason}"
                self._stop_reason = reason
        else:
            host = self.mesh.hostnames[peer] if self.mesh is not None else "?"
            if isinstance(e, WireError):  # garbage on the stream: the peer is alive, and broken
                reason = f"rank {peer} on host {host} sent a malformed control message: {e}"
                log.error(reason)
            elif silent is not None:
                reason = self._unresponsive(peer, silent, "other ranks waited for it", ", then it closed")
            else:
                reason = f"rank {peer} on host {host} exited or lost its connection"
            self.coordinator.peer_lost(peer, reason)

    def _on_frame(self, peer: int, kind: int, payload: bytes) -> None:
        try:
            if kind == _KEEPALIVE:
                if len(payload) != _STAMP.size:
                    raise WireError(f"keep-alive frame of {len(payload)} bytes")
                self._clocks[peer].heard(_STAMP.unpack(payload)[0], time.monotonic())
                return
            if self.coordinator is not None:
                if kind != _REQUESTS:
                    raise WireError(f"unexpected frame kind {kind}")
                batch = decode_requests(payload, peer)
            else:
                if kind == _PARAMS:
                    try:
                        self._todo.append(_ParamsMarker(Params.unpack(payload)))
                    except ValueError as e:
                        raise WireError(str(e)) from None
                    return
                if kind != _RESPONSES:
                    raise WireError(f"unexpected frame kind {kind}")
                seq, responses, shutdown, evicted = decode_responses(payload)
        except WireError as e:  # an authenticated peer that speaks garbage is broken: end the job, say why
            reason = f"rank {peer} sent a malformed control message: {e}"
            log.error(reason)
            if self.coordinator is not None:
                self.coordinator.shutdown_reason = self.coordinator.shutdown_reason or reason
            else:
                self._stop_reason = reason
            return
        if self.coordinator is not None:
            self.coordinator.submit(peer, *batch)
        else:
            self._seq = seq
            try:  # before this frame's evictions: they may name ids its responses use
                responses = [self._expand(r) if r.type == RequestType.CACHED else r for r in responses]
            except WireError as e:
                self._stop_reason = f"rank 0 sent a malformed control message: {e}"
                log.error(self._stop_reason)
                return
            self._todo.extend(responses)
            self._evict(evicted)
            if shutdown is not None:
                self._todo.append(Response(RequestType.ERROR, -1, [], error=shutdown, payload=[-1]))

    def _expand(self, compact: Response) -> Response:
        """Rebuild a response that travelled as cache ids from this rank's cache (every member holds them)."""
        ps = compact.process_set_id
        keys = self._cache_keys
        try:
            templates = [keys[(ps, cid)][1] for cid in compact.cached_ids]
        except KeyError:
            raise WireError(f"response refers to cache ids this rank does not hold: {compact.cached_ids[:8]}") \
                from None
        first = templates[0]
        if len(templates) == 1:
            names, shapes = first.names, first.shapes
        else:
            names = [t.names[0] for t in templates]
            shapes = [t.shapes[0] for t in templates]
        return Response(first.type, ps, names, first.dtype, shapes, first.root_rank, first.reduce_op,
                        first.prescale, first.postscale, first.rank_dims, first.splits,
                        cache_ids=[-2] * len(names), data=compact.data)

    def _send_local_requests(self) -> None:
        if self._broken is not None:  # nothing new goes out until the failed collective's cause is known
            self.queue.consume_wake()  # (new entries fail with it; a pipe left readable would spin the rounds)
            return
        new = self.queue.drain()
        shutdown = None
        if self._shutdown_requested is not None and self._shutdown_sent_at is None:
            shutdown = self._shutdown_requested
            self._shutdown_sent_at = time.monotonic()
        if not new and shutdown is None:
            return
        if self._outstanding <= 0:
            self._asked_at = time.monotonic()
        self._outstanding += len(new)
        full: list[Request] = []
        cached: list[tuple[int, int, int]] = []
        blobs: list = []
        inline_budget = _inline_budget(new) if self.size > 1 else 0
        cache_get = self._cache.get
        for e in new:
            req = e.request
            inline = -1
            if inline_budget and req.type == RequestType.ALLREDUCE and req.device < 0:
                nbytes = e.tensor.nbytes
                if 0 < nbytes <= inline_budget:
                    inline_budget -= nbytes
                    inline = len(blobs)
                    blobs.append(np.ascontiguousarray(e.tensor).reshape(-1).view(np.uint8))
            hit = cache_get((req.process_set_id, req.name))
            if hit is not None and hit[1] == req.signature():
                cached.append((req.process_set_id, hit[0], inline))
            else:
                req.inline = inline
                full.append(req)
        if self.coordinator is not None:
            self.coordinator.submit(0, self._seq, shutdown, full, cached, blobs)
        else:
            try:
                self._send_ctrl(0, _REQUESTS, encode_requests(self._seq, shutdown, full, cached, blobs))
            except (ConnectionError, OSError) as e:
                self._stop_reason = self._shutdown_requested or f"lost the connection to the coordinator: {e}"

    def _coordinate(self) -> None:
        coord = self.coordinator
        coord.settle(alive=self._alive)
        if coord.shutdown_reason is None:
            stall = coord.check_stalls()
            if stall is not None:
                coord.shutdown_reason = stall
        outgoing = coord.take_responses()
        shutdown = coord.shutdown_reason
        for r in range(1, self.size) if shutdown is not None else ():
            outgoing.setdefault(r, ([], []))
        mine: list[Response] = []
        ends: dict[int, int] = {}  # where this pass's answer to each peer ends in its stream
        for r, (responses, evicted) in outgoing.items():
            if r == 0:
                self._seq = coord.seq_for(0)
                mine = responses
                self._evict(evicted)
                continue
            if r in self._closed_peers:
                continue
            try:
                ends[r] = self._send_ctrl(r, _RESPONSES, encode_responses(coord.seq_for(r), responses, shutdown,
                                                                          evicted))
            except (ConnectionError, OSError):
                self._closed_peers.add(r)
        if mine and self._outbox.waiting():
            self._todo.append(_AnswersQueued(ends))  # what _deliver_before waits for
        self._todo.extend(mine)
        if shutdown is not None:
            self._todo.append(Response(RequestType.ERROR, -1, [], error=shutdown, payload=[-1]))

    def _execute_todo(self) -> None:
        if self._broken is not None:  # the data plane failed: only the coordinator's verdict matters now
            for resp in self._todo:
                if resp.type == RequestType.ERROR and resp.process_set_id == -1:
                    self._stop_reason = resp.error
                    break
            return
        while self._todo and self._stop_reason is None:
            resp = self._todo.popleft()
            if type(resp) is _AnswersQueued:
                self._answers_mark = resp.marks
                continue
            if resp.type is None:  # autotune's parameters, at this point of the response stream
                self._apply_params(resp.params)
                continue
            if resp.type == RequestType.ERROR and resp.process_set_id == -1:
                self._stop_reason = resp.error  # the coordinator's shutdown notice
                break
            if resp.type in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET) and resp.payload:
                self._forget_cache(resp.payload[0])  # set ids are reused: the old set's cache ids are void
            if resp.type == RequestType.ADD_PROCESS_SET and resp.payload:
                with self._sets_lock:
                    self.process_sets[resp.payload[0]] = list(resp.payload[1:])
            elif resp.type == RequestType.REMOVE_PROCESS_SET and resp.payload:
                with self._sets_lock:
                    self.process_sets.pop(resp.payload[0], None)
                comm = self._comms.pop(resp.payload[0], None)
                if comm is not None:
                    comm.close()
            if resp.type == RequestType.ERROR and resp.payload and resp.payload[0] != self.rank:
                continue
            try:
                if self.coordinator is not None and self._outbox.waiting() and resp.data is None and \
                        resp.type in _DATA_PLANE:
                    self._deliver_before(resp)
                entries = self.executor.execute(resp)
            except CollectiveFailure as e:
                self._collective_failed(e.cause, e.entries)
                return
            except (ConnectionError, OSError) as e:
                self._stop_reason = f"rank {self.rank}: collective failed: {e}"
                self._notify_shutdown(self._stop_reason)
                return
            self._outstanding -= len(entries) - entries.count(None)
            self._executed += 1
            if resp.cache_ids and max(resp.cache_ids) >= 0:
                self._record_cache(resp, entries)
            if self._tuner is not None and resp.type == RequestType.ALLREDUCE and resp.process_set_id == 0:
                params = self._tuner.update(resp.names, resp.nbytes())
                if params is not None:
                    self._publish_params(params)

    def _deliver_before(self, resp: Response) -> None:
        """Rank 0, before it waits in a collective: the members must have all of its response frame.

        A member whose socket buffer was full (it was busy in a collective of other ranks) holds only part
        of the frame that names this collective, the rest waits in the outbox, which rank 0 flushes only
        between collectives: it would never join.  Blocking here is safe -- such a member reads again once
        the collectives before this one are done, and those need nothing from rank 0 (it ran its own).
        Only up to the end of that frame (``_answers_mark``, set where the pass's answers entered the todo
        list): answers of later passes (or keep-alives) wait behind it, and a member already inside this
        collective reads them only after it -- waiting for them too was a deadlock (many small tensors
        answered inline)."""
        if self._answers_mark is None:
            return  # the pass that answered this was delivered whole when it was sent
        members = self.set_ranks(resp.process_set_id) or range(self.size)
        timeout = self._deadline or _NO_DEADLINE
        left = self._outbox.drain(timeout, peers={r for r in members if r != self.rank},
                                  until=self._answers_mark)
        if left:
            raise PeerFailure(left[0], f"did not read its control messages within {timeout:g} s")

    def _record_cache(self, resp: Response, entries: list) -> None:
        """Remember the cache ids a response assigned (and how to rebuild a compact response of each)."""
        for i, (cid, entry) in enumerate(zip(resp.cache_ids, entries)):
            if cid < 0:
                continue
            ident = (resp.process_set_id, cid)
            if ident in self._evicted_early:
                self._evicted_early.discard(ident)
                continue
            template = Response(resp.type, resp.process_set_id, [resp.names[i]], resp.dtype, [resp.shapes[i]],
                                resp.root_rank, resp.reduce_op, resp.prescale, resp.postscale, resp.rank_dims,
                                resp.splits)
            if entry is None:
                self._cache_keys[ident] = (None, template)  # a joined rank: nothing to cache, eviction will come
            else:
                key = (resp.process_set_id, entry.request.name)
                self._cache[key] = (cid, entry.request.signature())
                self._cache_keys[ident] = (key, template)

    def _forget_cache(self, set_id: int) -> None:
        for key in [k for k in self._cache if k[0] == set_id]:
            del self._cache[key]
        for key in [k for k in self._cache_keys if k[0] == set_id]:
            del self._cache_keys[key]
        self._evicted_early = {k for k in self._evicted_early if k[0] != set_id}

    def _evict(self, evicted: list[tuple[int, int]]) -> None:
        for ps, cid in evicted:
            if (ps, cid) not in self._cache_keys:
                self._evicted_early.add((ps, cid))  # its response has not run yet (see __init__)
                continue
            key = self._cache_keys.pop((ps, cid))[0]
            if key is not None and self._cache.get(key, (None,))[0] == cid:
                del self._cache[key]

    def _notify_shutdown(self, reason: str) -> None:
        """Best effort: tell the coordinator (or, on rank 0, everyone) that this rank is going down."""
        if self.mesh is None:
            return
        try:
            if self.coordinator is None:
                self._send_ctrl(0, _REQUESTS, encode_requests(self._seq, reason, [], []))
            else:
                for r in list(self.mesh.ctrl):
                    if r not in self._closed_peers:
                        self._send_ctrl(r, _RESPONSES, encode_responses(self.coordinator.seq_for(r) + 1, [],
                                                                         reason, []))
        except (ConnectionError, OSError):
            pass

    # ------------------------------------------------------------------ autotune
    def _make_tuner(self) -> ParameterManager:
        """Rank 0's parameter manager: what it may tune here, starting from the configured values."""
        config = self.config
        hierarchical = self._hierarchical()
        initial = Params(hierarchical_allreduce=hierarchical and config.hierarchical_allreduce is not False,
                         hierarchical_allgather=hierarchical and config.hierarchical_allgather is not False,
                         cache_enabled=config.cache_capacity > 0, cycle_time_ms=max(0.0, config.cycle_time_ms),
                         fusion_threshold=config.fusion_threshold)
        tunable = {"fusion_threshold", "cycle_time_ms"}
        if config.cache_capacity > 0:
            tunable.add("cache_enabled")
        if hierarchical:
            tunable |= {"hierarchical_allreduce", "hierarchical_allgather"}
        explicit = explicit_knobs()
        if "cache_capacity" in explicit:
            explicit.add("cache_enabled")
        return ParameterManager(
            initial, tunable - explicit, warmup_samples=config.autotune_warmup_samples,
            steps_per_sample=config.autotune_steps_per_sample,
            bayes_opt_max_samples=config.autotune_bayes_opt_max_samples,
            noise=config.autotune_gaussian_process_noise, log_path=config.autotune_log)

    def _hierarchical(self) -> bool:
        """Whether the global set's collectives are two-level (several hosts, several ranks on each): only
        then are hierarchical allreduce/allgather a choice autotune makes."""
        if self.mesh is None or self.size == 1:
            return False
        from horovod.transport import choose_backend

        return choose_backend(self.mesh, list(range(self.size)), self.config) == "hierarchical"

    def set_params(self, params: Params) -> None:
        """Rank 0: switch every rank to ``params`` at this point of the response stream, as autotune does
        after each trial (benchmarks/autotune.py compares two settings step by step with it)."""
        if self.coordinator is None:
            raise RuntimeError("only rank 0 sets the engine's parameters")
        with self._drive:
            self._publish_params(params)
        self.queue.wake()  # the engine thread applies them now, not at the next enqueue

    def _publish_params(self, params: Params) -> None:
        """Rank 0: send the tuner's next parameters to every rank after the responses already sent, and
        queue them after this rank's own: every rank applies them at the same point of the response stream
        (fusion decisions, the cache and hierarchical collectives stay consistent)."""
        if self._tuner is not None and not self._tuner.active:
            self._tuner = None  # done: the best parameters are the last to travel
        payload = params.pack()
        for r in range(1, self.size):
            if self.mesh is None or r in self._closed_peers:
                continue
            try:
                self._send_ctrl(r, _PARAMS, payload)
            except (ConnectionError, OSError):
                self._closed_peers.add(r)
        self._todo.append(_ParamsMarker(params))

    def _apply_params(self, params: Params) -> None:
        self._cycle = max(0.0, params.cycle_time_ms) / 1000.0
        self.queue.set_delay(self._cycle)
        coord = self.coordinator
        if coord is not None:
            coord.fusion_threshold = params.fusion_threshold
            capacity = self.config.cache_capacity if params.cache_enabled else 0
            if capacity != coord.cache_capacity:
                coord.set_cache_capacity(capacity)
        if not self.autotune_history:
            self._tune_hierarchy = self._hierarchical()
        if self._tune_hierarchy:
            for comm in self._comms.values():
                _set_hierarchy(comm, params)
        self.autotune_history.append((self._executed, params))

    # ------------------------------------------------------------------ liveness and data-plane failures
    def _send_ctrl(self, peer: int, kind: int, payload) -> int:
        return self._outbox.send(peer, kind, payload)

    def _keepalive(self) -> None:
        """Tell the control-channel peers every ``_beat`` s that this process is alive.

        A thread of its own, so that a long collective on the engine thread does not look like a frozen
        process; a stopped process (SIGSTOP), a dead host or a cut link goes silent.
        """
        while not self._beats_stop.wait(self._beat):
            stamp = _STAMP.pack(time.monotonic())
            with self._ctrl_lock:
                mesh = self.mesh
                if self._beats_stop.is_set() or mesh is None:
                    return
                for r in list(mesh.ctrl):
                    if r not in self._closed_peers:
                        try:
                            self._outbox.send(r, _KEEPALIVE, stamp)
                        except (ConnectionError, OSError):
                            pass  # the engine thread sees the closed connection itself

    def _select_timeout(self) -> float:
        if self._broken is not None or (self.coordinator is not None and self.coordinator.failures_pending):
            return min(0.1, self._beat)
        return 0.0 if self._todo else self._beat

    def _check_liveness(self, ready: set[int]) -> None:
        """End a wait on a silent peer, or on a cause that does not come after a collective failed."""
        if self._deadline is None or self._stop_reason is not None:
            return
        now = time.monotonic()
        if self._broken is not None:  # the coordinator settles within the deadline; this is a last resort
            reason, since, _ = self._broken
            if self._shutdown_requested is not None or now - since > 2 * self._deadline:
                log.error("%s (no other cause known after %.1f s)", reason, now - since)
                self._stop_reason = reason
                self._notify_shutdown(reason)
                return
        coord = self.coordinator
        if coord is not None:  # rank 0: is a rank that others wait for still alive?
            if coord.shutdown_reason is not None or now < self._next_liveness_check:
                return
            self._next_liveness_check = now + self._beat / 2
            for r in sorted(coord.waiting_on() - {0}):
                silent = now - self._clocks[r].alive_at
                if r not in ready and r not in self._closed_peers and silent > self._deadline:
                    reason = self._unresponsive(r, silent, "other ranks waited for it")
                    log.error(reason)
                    coord.peer_lost(r, reason)
                    return
            return
        if 0 in ready or (self._outstanding <= 0 and self._broken is None):
            return
        silent = now - max(self._asked_at, self._clocks[0].alive_at)
        if silent > self._deadline:
            reason = self._unresponsive(0, silent, f"rank {self.rank} waited for it")
            log.error(reason)
            self._stop_reason = reason

    def _alive(self, rank: int) -> bool:
        """Rank 0's view: ``rank`` is connected and sent a keep-alive lately (or has frames not read yet:
        after a long collective the verdict waits until they are)."""
        if rank == self.rank or rank in self._draining:
            return True
        if rank in self._closed_peers or rank not in self._clocks:
            return False
        recent = max(2 * self._beat, (self._deadline or 0.0) / 2)  # a stopped suspect is silent ~ the deadline
        return time.monotonic() - self._clocks[rank].alive_at <= recent

    def _silence(self, peer: int) -> float | None:
        """How long ``peer`` has been silent while this rank waited for it, if longer than two keep-alives."""
        if self._deadline is None or peer not in self._clocks:
            return None
        now = time.monotonic()
        if self.coordinator is None:
            if self._outstanding <= 0 and self._broken is None:
                return None
            silent = now - max(self._asked_at, self._clocks[0].alive_at)
        elif peer in self.coordinator.waiting_on() or self._broken is not None:
            silent = now - self._clocks[peer].alive_at
        else:
            return None
        return silent if silent > 2 * self._beat else None

    def _unresponsive(self, rank: int, silent: float, waiter: str, end: str = "") -> str:
        """The reason naming a silent peer.  On a worker, a collective that failed meanwhile is mentioned only
        when it failed on rank 0 too: waiting for a live rank that itself waited for the frozen coordinator
        is a consequence, and naming that rank would blame the wrong process."""
        host = self.mesh.hostnames[rank] if self.mesh is not None else "?"
        who = f"the coordinator (rank 0 on host {host})" if rank == 0 else f"rank {rank} on host {host}"
        end = end or (f": no keep-alive on its control channel for longer than {self._deadline:g} s "
                      f"({self._deadline_knob}); the process is stopped, hung or unreachable")
        reason = f"{who} has been unresponsive for {silent:.1f} s while {waiter}{end}"
        if rank == 0 and self._broken is not None and self._broken[2] == 0:
            reason = f"{self._broken[0]}; {reason}"
        return reason

    def _collective_failed(self, cause: BaseException, entries: list) -> None:
        """The transport failed inside a collective; decide (or wait for) the cause the job reports.

        A peer that timed out is the suspect: the rank reports it to the coordinator, which settles the
        reports of all ranks (a rank waiting for a live rank that itself waits for the stopped one would
        blame the wrong rank).  A peer that *closed* its connection has most likely failed itself and is only
        the messenger: the rank waits for the cause the coordinator relays.  Both waits end by the deadline.
        """
        self._failed_entries.extend(e for e in entries if e is not None)
        reason = collective_failure(self.rank, cause)
        if self._deadline is None or not isinstance(cause, PeerFailure) or \
                (isinstance(cause, WireError) and not cause.closed):
            log.error(reason)
            self._stop_reason = reason
            self._notify_shutdown(reason)
            return
        self._broken = (reason, time.monotonic(), cause.peer)
        if cause.closed:
            log.warning("%s; waiting for the cause", reason)
        elif self.coordinator is not None:
            log.error(reason)
            self.coordinator.report(0, reason)
        else:
            log.error(reason)
            self._notify_shutdown(reason)

    def _fail_failed_entries(self) -> None:
        if self._failed_entries:
            error = self._shutdown_error()
            for entry in self._failed_entries:
                entry.handle.set_error(error)
            self._failed_entries = []

    def _communicator(self, set_id: int) -> Communicator:
        comm = self._comms.get(set_id)
        if comm is None:
            ranks = self.set_ranks(set_id)
            if ranks is None:
                raise ValueError(f"Process set {set_id} does not exist, or has not been registered.")
            if len(ranks) == 1 or self.mesh is None:
                comm = SelfCommunicator(self.rank)
            else:
                from horovod.transport import make_communicator

                comm = make_communicator(self.mesh, ranks, self.config)
                if self.autotune_history and self._tune_hierarchy:
                    _set_hierarchy(comm, self.autotune_history[-1][1])
            self._comms[set_id] = comm
        return comm

    def _fail_pending(self) -> None:
        error = self._shutdown_error()
        for entry in self.queue.pop_all():
            entry.handle.set_error(error)

    def _finish_resources(self) -> None:
        self.queue.driver = None
        for ep in (self._idle, self._drive_poll, self._ctrl):
            ep.close()
        for comm in self._comms.values():
            try:
                comm.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._comms.clear()
        if self.mesh is not None:
            self._outbox.drain(_DRAIN_TIMEOUT)  # the last frames often say why this rank stops
            self.mesh.close()
            self.mesh = None
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None
        if self._tuner is not None:
            self._tuner.close()
        self.queue.close()


def _inline_budget(batch: list) -> int:
    """How many bytes of a batch's allreduces travel inside the request: all of them when they fit
    ``_INLINE_BYTES``, else none.  A batch with more joins them into the fused data-plane allreduce of the
    rest at almost no cost, where inline ones would cost rank 0 a reduction and their bytes a trip each way
    through the control plane (~0.1 ms per step of 100 x 16 KiB tensors)."""
    total = 0
    for e in batch:
        req = e.request
        if req.type == RequestType.ALLREDUCE and req.device < 0:
            total += e.tensor.nbytes
            if total > _INLINE_BYTES:
                return 0
    return _INLINE_BYTES


def liveness_deadline(config: RuntimeConfig) -> tuple[float | None, str]:
    """Seconds a control-channel peer may stay silent while a rank waits for it, and the knob it comes from.

    The collective timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``, 30 s by default) bounds how long a peer may
    not answer inside a collective, so the same bound applies to the coordinator and to a rank the
    coordinator waits for; without it, the stall shutdown time; ``None`` when both are 0 (never).
    """
    for value, knob in ((config.op_timeout, "HOROVOD_GLOO_TIMEOUT_SECONDS"),
                        (config.stall_shutdown_time, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")):
        if value and 0 < value < float("inf"):
            return float(value), knob
    return None, ""


class _AnswersQueued:
    """In the coordinator's queue of responses to run: the responses after it were answered in frames that
    end at these per-peer offsets of the outbox (some of their bytes were still queued when sent)."""

    __slots__ = ("marks",)
    type = None

    def __init__(self, marks: dict[int, int]) -> None:
        self.marks = marks


class _ParamsMarker:
    """Autotune's parameters in the queue of responses to run (``type`` None tells it from a response)."""

    __slots__ = ("params",)
    type = None

    def __init__(self, params: Params) -> None:
        self.params = params


def _set_hierarchy(comm: Communicator, params: Params) -> None:
    """Switch a hierarchical communicator's two-level allreduce/allgather (others have no such choice)."""
    if hasattr(comm, "allreduce_hierarchical"):
        comm.allreduce_hierarchical = params.hierarchical_allreduce
        comm.allgather_hierarchical = params.hierarchical_allgather


class _PeerClock:
    """When a peer was last known alive, from the send times its keep-alives carry (its monotonic clock).

    A keep-alive read late (the engine thread was busy in a collective) must not count as fresh, so the
    peer's times are mapped onto ours with the smallest (receive time - send time) seen, which frames read
    promptly attain; the offset may grow by 1 ms per frame, which follows any drift between two hosts' clocks.
    """

    __slots__ = ("alive_at", "_offset")

    def __init__(self, now: float) -> None:
        self.alive_at = now
        self._offset: float | None = None

    def heard(self, sent: float, now: float) -> None:
        lag = now - sent
        self._offset = lag if self._offset is None else min(self._offset + 1e-3, lag)
        self.alive_at = max(self.alive_at, sent + self._offset)
