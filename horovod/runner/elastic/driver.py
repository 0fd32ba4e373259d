"""The elastic driver: keeps a job of ``--min-np``..``--max-np`` workers running while hosts come and go.

It runs the rendezvous store and numbers rank assignments by *generation* (the store keys are listed in
:mod:`horovod.common.elastic_init`).  One loop, ticking every 0.1 s:

* every second it runs discovery; when the usable hosts would change the assignment it writes a notice
  ``elastic/hosts_updated = "<time> <flags>"`` that rank 0 reads at its next ``commit()``;
* a worker of the current generation that exits non-zero, or announces ``elastic/ready.<g>/<slot>``
  (it left the generation after a failed collective or a host-update interrupt), starts a *reset*: the driver
  writes ``elastic/reset.<g>``, waits until every live worker of the generation has left, and kills those
  that did not within the grace period (a hung worker), blacklisting their hosts as it does for failed ones;
* then it computes the next assignment (old hosts first, so they keep low ranks), publishes it, bumps
  ``elastic/generation`` and starts workers for the slots that have none;
* the job ends with success when a worker of the current generation exits 0 (the others are given time to
  finish), and with an error after ``--reset-limit`` resets, when fewer than ``--min-np`` slots remain for
  ``--elastic-timeout`` seconds, or when no worker with state is left.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from horovod.base import auth
from horovod.base.config import ENV_VARS, format_number, read_env
from horovod.common.elastic_init import heartbeat_period
from horovod.runner import hosts as hosts_mod
from horovod.runner import spawn
from horovod.runner.common.util.timeout import TimeoutException
from horovod.runner.elastic.discovery import (
    DISCOVER_HOSTS_FREQUENCY_SECS,
    FixedHosts,
    HostDiscovery,
    HostDiscoveryScript,
    HostManager,
)
from horovod.runner.job import JobSpec
from horovod.runner.output import OutputSink, forward_stream
from horovod.runner.worker_env import worker_env

__all__ = ["ElasticDriver", "run_elastic", "RESET_LIMIT_MESSAGE", "DEFAULT_GRACE_SECONDS"]

logger = logging.getLogger(__name__)

RESET_LIMIT_MESSAGE = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
NO_PREVIOUS_HOSTS_MESSAGE = "No hosts from previous set remaining, unable to broadcast state."
DEFAULT_GRACE_SECONDS = ENV_VARS["HOROVOD_ELASTIC_GRACE_SECONDS"].default
"""After one worker left a generation, how long the others may take to leave too before they count as hung."""

_TICK = 0.1
_FIRST_WAIT_REPORT_SECS = 5.0  # a wait for slots says so after this long
_WAIT_REPORT_SECS = 30.0  # and again this often
_RANK_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


class AllHostsBlacklisted(RuntimeError):
    """Every host failed (and is blacklisted for good): the job cannot go on."""


class AllWorkersFailed(RuntimeError):
    """Every worker of a generation failed (upstream: failure count == world size -> stop)."""


@dataclasses.dataclass
class _Worker:
    slot: str
    host: str
    proc: subprocess.Popen
    label: int
    readers: list[threading.Thread]
    exited: int | None = None
    removed: bool = False  # told rank -1: it exits, and is never given a slot again
    killed: bool = False  # by the driver, as hung
    beat: tuple[int, bytes | None, float] = (-1, None, 0.0)  # (generation, heartbeat value, when it last changed)


@dataclasses.dataclass
class _Plan:
    slots: dict[str, hosts_mod.SlotInfo]

    def same_as(self, other: _Plan) -> bool:
        return {k: v.rank for k, v in self.slots.items()} == {k: v.rank for k, v in other.slots.items()} and \
            {v.size for v in self.slots.values()} == {v.size for v in other.slots.values()}


def _plan(hosts: list[hosts_mod.HostInfo], max_np: int | None) -> _Plan:
    if not hosts:
        return _Plan({})
    slots = hosts_mod.get_host_assignments(hosts, 0, max_np)
    return _Plan({f"{s.hostname}:{s.local_rank}": s for s in slots})


class _DiscoveryCall(threading.Thread):
    """One run of the discovery; ``answer`` is ``{host: slots}`` or the exception, once it has ended."""

    def __init__(self, discovery: HostDiscovery) -> None:
        super().__init__(name="horovod-elastic-discovery", daemon=True)
        self.discovery = discovery
        self.answer: dict[str, int] | BaseException = RuntimeError("discovery still running")
        self.start()

    def run(self) -> None:
        try:
            self.answer = self.discovery.find_available_hosts_and_slots()
        except Exception as e:  # noqa: BLE001 - handed to the driver's loop
            self.answer = e


class ElasticDriver:
    """Runs one elastic job; see the module docstring.  :meth:`run` returns on success or raises."""

    def __init__(self, discovery: HostDiscovery, command: str | list[str], *, num_proc: int, min_np: int,
                 max_np: int | None, base_env: dict[str, str], knobs: dict[str, str], start_timeout: int,
                 elastic_timeout: float, reset_limit: int | None, cooldown_range: tuple[int, int] | None,
                 nics: list[str] | None = None, output: spawn.OutputOptions | None = None,
                 stop_event: threading.Event | None = None, ssh_options: Any = None,
                 grace: float | None = None, store_items: dict[str, bytes] | None = None,
                 result_scope: str | None = None) -> None:
        self.hosts = HostManager(discovery, cooldown_range)
        self.command = command
        self.num_proc = num_proc
        self.min_np = min_np
        self.max_np = max_np
        self.base_env = base_env
        self.knobs = knobs
        self.start_timeout = start_timeout
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.nics = nics or []
        self.output = output or spawn.OutputOptions()
        self.stop_event = stop_event
        self.ssh_options = ssh_options
        if grace is None:
            grace = read_env("HOROVOD_ELASTIC_GRACE_SECONDS", base_env)
        self.grace = grace
        self.store_items = dict(store_items or {})  # put into the store before any worker starts
        self.result_scope = result_scope  # run() returns <result_scope>/<rank> of the last generation
        self.key = auth.make_secret_key()
        self.tls: Any = None  # the job's TLS credentials (horovodrun --tls), made in run()
        self.server: Any = None
        self.generation = -1
        self.plan = _Plan({})
        self.reset_count = 0
        self.workers: dict[str, _Worker] = {}
        self.retired: list[_Worker] = []  # removed workers replaced by a fresh one before they had exited
        self.first_failure: tuple[int, int] | None = None  # (rank, exit code) of the first worker that failed
        self.late_failure: tuple[int, int] | None = None  # the first to exit non-zero after one succeeded
        self._exits: queue.Queue[tuple[_Worker, int]] = queue.Queue()
        self._hosts_ts = 0.0
        self._notice_ts = 0.0
        self._out = self.output.stdout or OutputSink(sys.stdout)
        self._err = self.output.stderr or OutputSink(sys.stderr)
        self._next_label = 0
        self._discovery_call: _DiscoveryCall | None = None

    # ------------------------------------------------------------------ store helpers
    def _put(self, key: str, value: str) -> None:
        self.server.put(key, value.encode())

    def _ready(self, slot: str) -> bool:
        return self.server.get(f"elastic/ready.{self.generation}/{slot}") is not None

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[bytes | None] | None:
        """Run the job until it succeeds.

        Returns:
            With ``result_scope``: what each rank of the last generation stored under
            ``<result_scope>/<rank>`` (None where nothing), in rank order; else None.

        Raises:
            spawn.JobFailure: no worker succeeded (upstream's message names the first failure), or one exited
                non-zero after another succeeded.
            RuntimeError: reset limit, no slots, discovery failing on the first call.
            spawn.Interrupted: ``stop_event`` was set.
        """
        from horovod.runner.rendezvous import RendezvousServer

        try:
            self._first_discovery()  # the first discovery failure is fatal (upstream)
            self._check_remote_start()
        except BaseException:  # Ctrl-C, SIGTERM: the script runs in a session of its own, so stop it here
            self._close_discovery()
            raise
        job_tls = None
        if read_env("HOROVOD_TLS", {**self.base_env, **self.knobs}):
            from horovod.transport import tls as tls_mod

            self.tls = tls_mod.make_credentials()
            job_tls = tls_mod.JobTls(self.tls)
        self.server = RendezvousServer(self.key, addr=self._bind_address(), tls=job_tls)
        self.server.start()
        try:
            for key, value in self.store_items.items():
                self.server.put(key, value)
            # horovodrun and horovod.run() refuse -np below --min-np (JobSpec.check_process_counts); the floor
            # stays for drivers made elsewhere (Ray, Spark)
            self._wait_for_slots(max(self.num_proc, self.min_np), "to start")
            self._new_generation(survivors=set())
            self._loop()
            if self.late_failure is not None:
                raise spawn.JobFailure(*self.late_failure)
            if self.result_scope is None:
                return None
            return [self._result(rank) for rank in range(len(self.plan.slots))]
        finally:
            self._close_discovery()
            self._terminate_all()
            self.server.stop()

    def _close_discovery(self) -> None:
        """Stop a discovery still running.  A user's discovery need not subclass ``HostDiscovery`` (upstream's
        driver only ever calls ``find_available_hosts_and_slots()``): one without ``close`` has nothing to stop."""
        close = getattr(self.hosts.discovery, "close", None)
        if callable(close):
            close()

    def _result(self, rank: int) -> bytes | None:
        """What the worker of ``rank`` (last generation) stored: under its rank, or, when its function never
        called ``hvd.init()`` (so it had no rank), under its slot (horovod.runner.run_task)."""
        found = self.server.get(f"{self.result_scope}/{rank}")
        if found is None:
            slot = next((name for name, s in self.plan.slots.items() if s.rank == rank), None)
            if slot is not None:
                found = self.server.get(f"{self.result_scope}/slot.{slot}")
        return found

    def _first_discovery(self) -> None:
        """Run the discovery once, on a thread, so that ``stop_event`` (SIGTERM) is noticed while a slow script
        runs (up to its timeout).

        Raises:
            RuntimeError, ValueError: the script failed or printed a bad line.
            spawn.Interrupted: ``stop_event`` was set.
        """
        call = _DiscoveryCall(self.hosts.discovery)
        while call.is_alive():
            self._check_stop()
            call.join(0.1)
        if isinstance(call.answer, BaseException):
            raise call.answer
        self.hosts.apply(call.answer)

    def _check_remote_start(self) -> None:
        """Workers started over ssh start in the launcher's directory: one that was removed is named before
        any worker starts (as in a static job), not by the first remote start, after the local ones.

        Raises:
            RuntimeError: a host known now is started over ssh and the launcher's directory is gone.
        """
        from horovod.runner.ssh import SshSpawner, working_directory

        if any(isinstance(self._spawner(h.hostname), SshSpawner) for h in self.hosts.usable_hosts()):
            working_directory()

    def _bind_address(self) -> str:
        """The store's first address, chosen as for a static job (``horovod.runner.network``), never all
        interfaces: ``--network-interface``, else the route to the remote hosts known now, else loopback."""
        from horovod.runner.network import choose_interface

        remote = [h.hostname for h in self.hosts.usable_hosts() if not hosts_mod.is_local_host(h.hostname)]
        try:
            return choose_interface(remote, self.nics).address
        except ValueError as e:
            if self.nics:
                raise
            logger.warning("elastic: %s; the rendezvous store listens on loopback for now", e)
            return "127.0.0.1"

    def _store_endpoint(self, host: str) -> tuple[str, int]:
        """Where a worker on ``host`` reaches the store.  A host that a discovery script named later, reached
        through an interface the store does not listen on yet, gets a listener on that interface's address."""
        if hosts_mod.is_local_host(host):
            return self.server.addr, self.server.port
        from horovod.runner.network import choose_interface

        try:
            addr = choose_interface([host], self.nics).address
        except ValueError as e:
            logger.warning("elastic: %s; workers on %s will not reach the rendezvous store", e, host)
            return self.server.addr, self.server.port
        return addr, self.server.listen(addr)

    def _check_stop(self) -> None:
        if self.stop_event is not None and self.stop_event.is_set():
            raise spawn.Interrupted(getattr(self.stop_event, "signum", signal.SIGTERM))

    def _discover(self, last: list[float]) -> None:
        """Start a discovery every :data:`DISCOVER_HOSTS_FREQUENCY_SECS` on a thread of its own (as upstream)
        and take its answer when it is there: a slow or hung script must not hold up the loop that notices
        failed workers (it did, for the script's 30 s timeout)."""
        running = self._discovery_call
        if running is not None:
            if running.is_alive():
                return
            self._discovery_call = None
            last[0] = time.monotonic()
            if isinstance(running.answer, BaseException):  # after the first call a failing script only logs
                logger.warning("elastic: host discovery failed, keeping the last known hosts: %s", running.answer)
            else:
                self.hosts.apply(running.answer)
            return
        if time.monotonic() - last[0] < DISCOVER_HOSTS_FREQUENCY_SECS:
            return
        self._discovery_call = _DiscoveryCall(self.hosts.discovery)

    def _wait_for_slots(self, needed: int, why: str) -> None:
        """Until the usable hosts offer ``needed`` slots; says so in the log when it has to wait (after
        :data:`_FIRST_WAIT_REPORT_SECS`, then every :data:`_WAIT_REPORT_SECS`), since the wait may last
        ``--elastic-timeout`` (10 minutes by default) and a user would otherwise see a job that does nothing."""
        started = time.monotonic()
        deadline = started + self.elastic_timeout
        last = [started]
        first_report = next_report = started + _FIRST_WAIT_REPORT_SECS
        while True:
            self._check_stop()
            usable = self.hosts.usable_hosts()
            available = sum(h.slots for h in usable)
            if available >= needed:
                if next_report > first_report:
                    logger.info("elastic: %d slots available after %.0f s of waiting", available,
                                time.monotonic() - started)
                return
            now = time.monotonic()
            blacklisted = self.hosts.all_blacklisted()
            if now >= next_report and not blacklisted:
                hosts = ", ".join(f"{h.hostname}:{h.slots}" for h in usable) or "none"
                logger.warning("elastic: waiting for %d slots %s; %d available now (usable hosts: %s); giving "
                               "up in %.0f s (--elastic-timeout)", needed, why, available, hosts, deadline - now)
                next_report = now + _WAIT_REPORT_SECS
            if blacklisted:
                raise AllHostsBlacklisted(f"All hosts are blacklisted; {needed} slots needed {why}.")
            if time.monotonic() > deadline:
                # upstream's words (its driver's Timeout), then what it leaves out: why, and what was found
                raise TimeoutException(
                    "Timed out waiting for minimum number of slots to become available. Please check that you "
                    f"have enough resources to run at least {needed} Horovod processes. Timeout after "
                    f"{format_number(self.elastic_timeout)} seconds ({needed} slots needed {why}, {available} "
                    "found; --elastic-timeout).")
            self._drain_exits_while_waiting()
            time.sleep(_TICK)
            self._discover(last)

    def _loop(self) -> None:
        last_discovery = [time.monotonic()]
        reset_started: float | None = None
        succeeded = False
        success_deadline = 0.0
        while True:
            self._check_stop()
            self._discover(last_discovery)
            # 1. worker exits
            while True:
                try:
                    worker, code = self._exits.get_nowait()
                except queue.Empty:
                    break
                worker.exited = code
                assigned = self.plan.slots.get(worker.slot)
                if self.workers.get(worker.slot) is not worker or assigned is None:
                    logger.debug("elastic: %s (not in generation %d) exited with %d", worker.slot,
                                 self.generation, code)
                    continue
                if code == 0:
                    if not succeeded:
                        logger.info("elastic: rank %d (%s) finished successfully", assigned.rank, worker.slot)
                        succeeded = True
                        success_deadline = time.monotonic() + self.elastic_timeout
                    continue
                if succeeded:  # the job fails all the same (upstream: any final worker's non-zero exit)
                    logger.warning("elastic: %s exited with %d after the job succeeded", worker.slot, code)
                    self.late_failure = self.late_failure or (assigned.rank, code)
                    continue
                self._failed(worker, f"exited with status code {code}")
                if reset_started is None:
                    reset_started = self._start_reset()
            live = [w for s, w in self.workers.items() if s in self.plan.slots and w.exited is None]
            if succeeded:
                waiting = [w for w in live if self._ready(w.slot)]
                for w in waiting:  # left the generation after the job succeeded: nothing to wait for
                    self._kill(w, signal.SIGTERM)
                if not live:
                    return
                if time.monotonic() > success_deadline:
                    logger.warning("elastic: terminating %d workers still running after the job succeeded",
                                   len(live))
                    return
                time.sleep(_TICK)
                continue
            # 2. workers leaving the generation
            if reset_started is None and any(self._ready(w.slot) for w in live):
                reset_started = self._start_reset()
            if reset_started is not None:
                pending = [w for w in live if not self._ready(w.slot)]
                for w in pending:
                    why = self._stuck(w, reset_started)
                    if why is not None:
                        self._failed(w, why)
                        self._kill(w, signal.SIGKILL)
                        w.killed = True
                pending = [w for w in pending if w.proc.poll() is None and not w.killed]
                if not pending:
                    survivors = {w.slot for w in live if w.exited is None and self._ready(w.slot)
                                 and w.proc.poll() is None}
                    if not survivors and self.first_failure is not None and not self.hosts.all_blacklisted():
                        # Nobody has the job's state: upstream stops when every worker failed (e.g. an import
                        # error), also when a blacklist cooldown would bring the hosts back (hosts blacklisted
                        # for good end the job below, as AllHostsBlacklisted).
                        raise AllWorkersFailed(f"every worker of generation {self.generation} failed")
                    self._next_generation(survivors)
                    reset_started = None
            else:
                self._maybe_notify()
            time.sleep(_TICK)

    def _stuck(self, worker: _Worker, reset_started: float) -> str | None:
        """Why ``worker``, which has not left the generation since the reset began, counts as hung (None: wait).

        A worker that joined the generation bumps ``elastic/alive.<g>/<slot>`` every
        :func:`~horovod.common.elastic_init.heartbeat_period` from a thread of its own: while it does, it is
        alive and only busy (a checkpoint, a validation pass: it leaves at its next collective), and gets
        ``--elastic-timeout``; one whose heartbeat stopped for the grace period (at least 3 beats) is hung
        (SIGSTOPped, stuck in native code).  A worker with no heartbeat (still starting) gets the grace period.
        """
        now = time.monotonic()
        value = self.server.get(f"elastic/alive.{self.generation}/{worker.slot}")
        generation, last_value, changed = worker.beat
        if value is not None and (generation != self.generation or value != last_value):
            worker.beat = (self.generation, value, now)
            generation, changed = self.generation, now
        g = self.generation
        if generation != g:  # never beat in this generation
            if now - reset_started > self.grace:
                return f"did not leave generation {g} within {self.grace:.0f} s after a failure (hung?); killed"
            return None
        silent = now - max(changed, reset_started)
        if silent > max(self.grace, 3 * heartbeat_period(self.grace)):
            return (f"did not leave generation {g} after a failure and sent no heartbeat for {silent:.0f} s "
                    "(hung?); killed")
        if now - reset_started > self.elastic_timeout:
            return (f"still busy {self.elastic_timeout:.0f} s after generation {g} failed, without reaching a "
                    "collective (--elastic-timeout); killed")
        return None

    # ------------------------------------------------------------------ events
    def _failed(self, worker: _Worker, why: str) -> None:
        assigned = self.plan.slots.get(worker.slot)
        rank = assigned.rank if assigned is not None else -1
        logger.error("elastic: rank %d (%s) %s", rank, worker.slot, why)
        delay = self.hosts.blacklist(worker.host)
        logger.warning("elastic: blacklisting host %s%s", worker.host,
                       "" if delay == float("inf") else f" for {delay:.0f} s")
        if self.first_failure is None:
            self.first_failure = (rank, worker.exited or 1)

    def _start_reset(self) -> float:
        logger.info("elastic: generation %d is over; waiting for its workers to leave", self.generation)
        self._put(f"elastic/reset.{self.generation}", "1")
        return time.monotonic()

    def _maybe_notify(self) -> None:
        new = _plan(self.hosts.usable_hosts(), self.max_np)
        if new.same_as(self.plan):  # no host left is a removal too: the reset then waits for --min-np slots
            return
        flags = 0
        if set(self.plan.slots) - set(new.slots):
            flags |= 1  # removed
        if set(new.slots) - set(self.plan.slots):
            flags |= 2  # added
        if not flags:
            flags = 1 | 2
        if self._notice_ts > self._hosts_ts and getattr(self, "_notice_flags", None) == flags:
            return  # already told rank 0 about this change
        self._notice_ts = max(time.time(), self._notice_ts + 1e-3)
        self._notice_flags = flags
        logger.info("elastic: hosts changed (%s); notifying rank 0",
                    {1: "removed", 2: "added", 3: "added and removed"}[flags])
        self._put("elastic/hosts_updated", f"{self._notice_ts!r} {flags}")

    def _next_generation(self, survivors: set[str]) -> None:
        if self.reset_limit is not None and self.reset_count >= self.reset_limit:
            raise RuntimeError(RESET_LIMIT_MESSAGE.format(self.reset_limit))
        self._wait_for_slots(self.min_np, "to continue")
        self.reset_count += 1
        self._new_generation(survivors)

    def _new_generation(self, survivors: set[str]) -> None:
        new = _plan(self.hosts.usable_hosts(), self.max_np)
        if self.generation >= 0 and not (survivors & set(new.slots)):
            raise RuntimeError(NO_PREVIOUS_HOSTS_MESSAGE)
        self.generation += 1
        g = self.generation
        for slot, s in new.slots.items():
            self._put(f"elastic/assign.{g}/{slot}", f"{s.rank},{s.size},{s.local_rank},{s.local_size},"
                                                     f"{s.cross_rank},{s.cross_size}")
        for slot, w in self.workers.items():
            if slot not in new.slots and w.exited is None:
                self._put(f"elastic/assign.{g}/{slot}", "-1,-1,-1,-1,-1,-1")
                w.removed = True
        self._hosts_ts = self._notice_ts
        self.plan = new
        # Slots that get a fresh worker: it has none of the job's state, so the others must sync() even if they
        # left for a removal only (a host may have been added while that removal was being handled).
        starting = [slot for slot in new.slots if (w := self.workers.get(slot)) is None or w.removed
                    or w.exited is not None or w.proc.poll() is not None]
        self._put("elastic/generation", f"{g} {self._hosts_ts!r} {int(bool(starting))}")
        size = len(new.slots)
        logger.info("elastic: generation %d: %d worker%s on %s", g, size, "" if size == 1 else "s",
                    ",".join(sorted({s.hostname for s in new.slots.values()})))
        for slot, w in list(self.workers.items()):
            if slot not in new.slots and w.exited is None:
                # Removed or blacklisted: it reads rank -1 and exits; make sure it does.
                threading.Thread(target=self._reap_later, args=(w,), daemon=True).start()
        for slot in starting:
            w = self.workers.get(slot)
            if w is not None and w.removed and w.exited is None:
                # Its host came back before it had exited: it is exiting with upstream's "has been removed"
                # error (or will, at the generation it reads), so it gets a successor whose generation its exit
                # is no part of (reused, it failed the generation and its host was blacklisted).  Its reaper,
                # started when it was removed, still ends it after the grace period.
                self.retired.append(w)
            self._start_worker(slot, new.slots[slot])

    def _reap_later(self, worker: _Worker) -> None:
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and worker.proc.poll() is None:
            time.sleep(_TICK)
        if worker.proc.poll() is None:
            spawn.terminate_workers([worker.proc])

    # ------------------------------------------------------------------ processes
    def _worker_env(self, slot: str, s: hosts_mod.SlotInfo) -> dict[str, str]:
        store_addr, store_port = self._store_endpoint(s.hostname)
        env = worker_env(s, base=self.base_env, store_addr=store_addr,
                         store_port=store_port, key=self.key, knobs=self.knobs,
                         start_timeout=self.start_timeout, nics=self.nics, tls=self.tls)
        for name in _RANK_VARS:
            env.pop(name, None)
        env.update({"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_SLOT": slot,
                    "HOROVOD_ELASTIC_TIMEOUT": format_number(self.elastic_timeout)})
        return env

    def _spawner(self, host: str) -> spawn.Spawner:
        if hosts_mod.is_local_host(host):
            return spawn.spawn_local
        from horovod.runner.ssh import SshOptions, SshSpawner

        return SshSpawner(self.ssh_options or SshOptions())

    def _start_worker(self, slot: str, s: hosts_mod.SlotInfo) -> None:
        spec = spawn.WorkerSpec(rank=s.rank, command=self.command, env=self._worker_env(slot, s),
                                hostname=s.hostname)
        proc = self._spawner(s.hostname)(spec)
        label = s.rank if self.generation == 0 else self._next_label
        self._next_label = max(self._next_label, label + 1, len(self.plan.slots))
        readers = []
        copies = self._output_files(s.rank)
        for stream, sink, name, copy in ((proc.stdout, self._out, "stdout", copies[0]),
                                         (proc.stderr, self._err, "stderr", copies[1])):
            t = threading.Thread(target=_forward, args=(stream, sink, label, name, self.output.prefix_timestamp,
                                                        copy),
                                 name=f"horovod-elastic-{slot}-{name}", daemon=True)
            t.start()
            readers.append(t)
        worker = _Worker(slot, s.hostname, proc, label, readers)
        self.workers[slot] = worker
        threading.Thread(target=lambda: self._exits.put((worker, spawn.exit_status(proc.wait()))), daemon=True,
                         name=f"horovod-elastic-wait-{slot}").start()
        logger.debug("elastic: started %s as rank %d (pid %d)", slot, s.rank, proc.pid)

    def _output_files(self, rank: int) -> tuple[Any, Any]:
        """``--output-filename`` as in a static job, appended to, so a worker that takes over a rank after a
        reset adds to what the rank wrote before."""
        opened = spawn.open_output_files(self.output, rank, max(self.num_proc, self.max_np or 0), mode="ab")
        return opened or (None, None)

    def _kill(self, worker: _Worker, sig: int) -> None:
        try:
            os.killpg(worker.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _drain_exits_while_waiting(self) -> None:
        while True:
            try:
                worker, code = self._exits.get_nowait()
            except queue.Empty:
                return
            worker.exited = code

    def _terminate_all(self) -> None:
        workers = [*self.workers.values(), *self.retired]
        procs = [w.proc for w in workers if w.proc.poll() is None]
        if procs:
            spawn.terminate_workers(procs)
        deadline = time.monotonic() + 2.0
        for w in workers:
            for t in w.readers:
                t.join(timeout=max(0.0, deadline - time.monotonic()))


def _forward(stream: Any, sink: OutputSink, label: int, name: str, timestamp: bool, copy_to: Any = None) -> None:
    try:
        forward_stream(stream, sink, label, name, timestamp=timestamp, copy_to=copy_to)
    finally:
        stream.close()
        if copy_to is not None:
            copy_to.close()


def _discovery(job: JobSpec) -> HostDiscovery:
    if job.host_discovery_script:
        return HostDiscoveryScript(job.host_discovery_script, job.slots)
    if job.hosts or job.hostfile:
        hosts = job.host_list()
        if len(hosts) < 2:
            raise ValueError("Cannot run in fault tolerance mode with fewer than 2 hosts.")
        return FixedHosts(hosts)
    raise ValueError("One of --host-discovery-script, --hosts, or --hostnames must be provided")


def run_elastic(job: JobSpec, stop_event: threading.Event | None = None) -> list[Any] | None:
    """Run the elastic ``job`` (``launch._run`` calls this after :meth:`JobSpec.check`).

    Returns:
        For ``horovod.run()`` (``job.run_func``), the results of the last generation's first ``min_np``
        ranks in rank order (upstream's "first min_np results"); else None.

    Raises:
        ValueError: bad arguments (upstream's texts).
        RuntimeError: the job failed (see :meth:`ElasticDriver.run`).
    """
    from horovod.runner import run_func

    num_proc, min_np, max_np = job.elastic_bounds()
    discovery = _discovery(job)
    ssh_options = None
    if job.ssh_port or job.ssh_identity_file:
        from horovod.runner.ssh import SshOptions

        ssh_options = SshOptions(port=job.ssh_port, identity_file=job.ssh_identity_file)
    command: str | list[str] = job.command_line()
    store_items = {}
    if job.run_func is not None:
        command = run_func.worker_command(job.executable)
        store_items[run_func.FUNC_KEY] = run_func.func_payload(job.run_func)
    driver = ElasticDriver(
        discovery, command, num_proc=num_proc, min_np=min_np, max_np=max_np, base_env=job.base_env(),
        knobs=job.knob_env(), start_timeout=job.start_timeout_seconds(),
        elastic_timeout=job.elastic_timeout_seconds(), reset_limit=job.reset_limit,
        cooldown_range=job.cooldown_range, nics=job.nics, stop_event=stop_event, ssh_options=ssh_options,
        output=spawn.OutputOptions(prefix_timestamp=job.prefix_output_with_timestamp,
                                   output_dir=job.output_filename), store_items=store_items,
        result_scope=run_func.RESULT_SCOPE if job.run_func is not None else None)
    try:
        payloads = driver.run()
    except (AllHostsBlacklisted, AllWorkersFailed) as e:
        if driver.first_failure is None:
            raise
        # Upstream stops the job here and reports its failed workers: the first one, in its words.
        failure = spawn.JobFailure(*driver.first_failure)
        failure.args = (f"{failure.args[0]}({e})\n",)
        raise failure from None
    # Upstream returns the first min_np results: the ranks every generation has.
    return None if payloads is None else run_func.decode_results(payloads[:min_np])
