"""Elastic Horovod jobs on Ray: ``RayExecutor(min_workers=...)`` and upstream's ``ElasticRayExecutor``.

The job is run by horovodrun's elastic driver (:class:`horovod.runner.elastic.driver.ElasticDriver`, the
protocol of docs/elastic.md), with Ray in place of processes and ssh:

* **Hosts** are the alive Ray nodes (:class:`RayHostDiscovery`), named by their node id, with
  ``CPU // cpus_per_worker`` slots (fewer when GPUs are the limit), re-read every second: a node that joins
  adds slots, a node that leaves (or the discovery you pass) removes them.
* **Workers** are :class:`~horovod.ray.worker.BaseHorovodWorker` actors pinned to their node
  (``NodeAffinitySchedulingStrategy``), one per slot, running the training function; an actor that dies or
  whose function raises is a failed worker: its node is blacklisted (``cooldown_range`` lets it come back),
  the others reset to their last ``commit()`` and go on (``hvd.elastic.run``), and a new generation starts
  on the remaining slots.  Stopped workers are killed with ``ray.kill``.
* The driver process runs the authenticated store, as for static jobs; the key reaches the actors through
  Ray (docs/ray.md, "Trust boundary").

``run`` returns the results of the workers of the last generation, in rank order.

``run(..., callbacks=[...])`` (upstream's :mod:`horovod.ray.ray_logger`): a ``ray.util.queue.Queue`` actor
(0 CPUs, on the driver's node) is given to every worker actor before its function starts; what a worker
passes to ``ray_logger.log`` goes into it, and a driver thread (:class:`_CallbackPump`) calls every callback
with each item in the order the queue got them, while the job runs.  When the driver is done, a sentinel put
behind the workers' items ends that thread after the last item, so ``run`` returns only once every logged
item was delivered.  A callback that raises stops the job (the driver's stop event: every worker is killed)
and ``run`` raises ``RuntimeError`` from the callback's exception; the queue actor is killed in every case.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import reprlib
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import ray

from horovod.base.config import DEFAULT_START_TIMEOUT
from horovod.ray.worker import BaseHorovodWorker
from horovod.runner import spawn
from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.driver import ElasticDriver, _Worker
from horovod.runner.hosts import SlotInfo

__all__ = ["RayHostDiscovery", "TestDiscovery", "ElasticRayExecutor", "ElasticSettings"]

logger = logging.getLogger(__name__)

_CALLBACK_WARN_SECONDS = 60.0
"""After the workers end, how often ``run`` says which callback it is still waiting for."""


class RayHostDiscovery(HostDiscovery):
    """The alive Ray nodes and their slots (upstream's class; hosts are node ids here, see module doc).

    ``cpus_per_slot``/``gpus_per_slot`` are upstream's older names of the same arguments.
    """

    def __init__(self, use_gpu: bool = False, cpus_per_worker: int = 1, gpus_per_worker: int = 1, *,
                 cpus_per_slot: int | None = None, gpus_per_slot: int | None = None) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_slot if cpus_per_slot is not None else cpus_per_worker
        self.gpus_per_worker = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{node id: slots}`` of the alive nodes with at least one slot (from their total resources)."""
        found = {}
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            resources = node.get("Resources", {})
            slots = resources.get("CPU", 0) // self.cpus_per_worker
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // max(self.gpus_per_worker, 1))
            slots = int(math.ceil(slots))
            if slots:
                found[node["NodeID"]] = slots
        return found



class TestDiscovery(RayHostDiscovery):
    """Upstream's discovery for trying elastic jobs: hides and restores Ray nodes every so often.

    Every ``change_frequency_s`` seconds one node is hidden from (or given back to) the elastic driver, at
    random, keeping between ``min_hosts`` and ``max_hosts`` nodes visible, so a job on a fixed cluster sees
    hosts leave and join (upstream's ``examples/ray/basic_ray_elastic.py``).  A hidden node's workers are
    stopped by the driver as for a node that left.  Hosts are node ids (module doc).

    ``_graceful=False`` asked upstream to kill the node itself through Ray's autoscaler (its cluster config
    ``~/ray_bootstrap_config.yaml``); that is not provided: a ``NotImplementedError`` says so here rather
    than when the first node is removed, minutes into the job.
    """

    __test__ = False  # a library class, not a pytest test

    def __init__(self, min_hosts: int, max_hosts: int, change_frequency_s: float, use_gpu: bool = False,
                 cpus_per_slot: int = 1, gpus_per_slot: int = 1, verbose: bool = True,
                 _graceful: bool = True) -> None:
        if not _graceful:
            raise NotImplementedError(
                "TestDiscovery(_graceful=False) kills nodes through Ray's autoscaler in upstream Horovod; "
                "not provided here: use the default _graceful=True, which hides nodes from the job instead")
        super().__init__(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot)
        self._min_hosts = min_hosts
        self._max_hosts = max_hosts
        self._change_frequency_s = change_frequency_s
        self._graceful = _graceful
        self.verbose = verbose
        self._last_reset_t: float | None = None
        self._removed_hosts: set[str] = set()

    def add_host(self, hosts: dict[str, int]) -> None:
        """Give a hidden node that is still alive back to the job (a message when there is none)."""
        hidden = sorted(self._removed_hosts & hosts.keys())
        if hidden:
            self._removed_hosts.remove(random.choice(hidden))
        else:
            print("No hosts to add.")

    def remove_host(self, hosts: dict[str, int]) -> None:
        """Hide one visible node from the job (nothing when every node is hidden already)."""
        visible = [h for h in hosts if h not in self._removed_hosts]
        if visible:
            self._removed_hosts.add(random.choice(visible))

    def change_hosts(self, hosts: dict[str, int]) -> None:
        """One change: grow at ``min_hosts`` or below, shrink at ``max_hosts`` or above, else either."""
        self._removed_hosts &= hosts.keys()  # nodes that really left are no longer "hidden"
        current = len(hosts) - len(self._removed_hosts)
        if current <= self._min_hosts:
            self.add_host(hosts)
        elif current >= self._max_hosts:
            self.remove_host(hosts)
        elif random.random() < 0.5:
            self.add_host(hosts)
        else:
            self.remove_host(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """The alive nodes less the hidden ones, after a change when ``change_frequency_s`` has passed."""
        now = time.time()
        if self._last_reset_t is None:
            self._last_reset_t = now
        hosts = super().find_available_hosts_and_slots()
        if now - self._last_reset_t >= self._change_frequency_s:
            self.change_hosts(hosts)
            self._last_reset_t = now
        remaining = {h: n for h, n in hosts.items() if h not in self._removed_hosts}
        if self.verbose:
            print(f"Total hosts: {len(hosts)}")
            print(f"Remaining hosts: {len(remaining)} -- {remaining}")
        return remaining


@dataclasses.dataclass
class ElasticSettings:
    """Upstream's elastic settings, as ``ElasticRayExecutor.create_settings`` makes them."""

    discovery: Any = None
    min_num_proc: int = 1
    max_num_proc: int | None = None
    elastic_timeout: float = 600
    reset_limit: int | None = None
    num_proc: int = 1
    ssh_identity_file: str | None = None
    nics: Any = None
    timeout_s: float = 30
    cooldown_range: tuple[int, int] | None = None
    verbose: int = 1
    key: Any = None
    elastic: bool = True


class _ActorProc:
    """The part of ``subprocess.Popen`` the elastic driver uses, for one actor running the function."""

    def __init__(self, actor: Any, ref: Any, slot: str) -> None:
        self.actor = actor
        self.ref = ref
        self.slot = slot
        self.returncode: int | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def _settle(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
        ready, _ = ray.wait([self.ref], timeout=timeout)
        if not ready:
            return None
        try:
            value, error, code = ray.get(self.ref), None, 0
        except Exception as e:  # noqa: BLE001 - a dead actor or the user's exception: a failed worker
            value, error, code = None, e, 1
        with self._lock:
            if self.returncode is None:
                self.value, self.error, self.returncode = value, error, code
            return self.returncode

    def poll(self) -> int | None:
        return self._settle(0)

    def wait(self) -> int:
        code = self._settle(None)
        assert code is not None
        return code

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug("ray.kill(%s): %s", self.slot, e)


def _call_and_report(fn: Callable[[], Any]) -> Callable[[Any], tuple[int, Any]]:
    """The function each actor runs: ``fn()``, returned with the rank this worker ended with."""

    def call(_executable: Any) -> tuple[int, Any]:
        value = fn()
        from horovod.base.config import read_env
        from horovod.common import basics

        rank = basics.rank() if basics.is_initialized() else read_env("HOROVOD_RANK")
        return rank, value

    return call


class _CallbackPump:
    """The driver's side of :mod:`horovod.ray.ray_logger`: the queue the workers log into, and a thread that
    calls every callback with each item, in order, while the job runs (see the module docstring).

    The thread blocks in the queue actor's ``get`` (no polling) and ends at :meth:`finish`'s sentinel, or at
    the first error: a callback that raised, or the queue actor lost.  Then ``error`` holds what happened and
    ``on_error`` (the driver's stop event) is called, so the job stops instead of running on unobserved.
    """

    def __init__(self, callbacks: list[Callable[[Any], Any]], on_error: Callable[[], None]) -> None:
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.callbacks = list(callbacks)
        self.on_error = on_error
        self.error: BaseException | None = None
        self.failed_on: tuple[Callable[[Any], Any], Any] | None = None  # (callback, item) that raised
        self.delivered = 0
        self._running: tuple[Callable[[Any], Any], Any, float] | None = None  # (callback, item, since)
        self._end = f"horovod.ray.ray_logger end {uuid.uuid4().hex}"
        node = ray.get_runtime_context().get_node_id()
        self.queue = Queue(actor_options={
            "num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=True)})
        self._thread = threading.Thread(target=self._loop, daemon=True, name="horovod-ray-callbacks")
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if isinstance(item, str) and item == self._end:
                    return
                for callback in self.callbacks:
                    self._running = (callback, item, time.monotonic())
                    try:
                        callback(item)
                    except BaseException:
                        self.failed_on = (callback, item)
                        raise
                    finally:
                        self._running = None
                self.delivered += 1
        except BaseException as e:  # noqa: BLE001 - handed to run(), which raises it
            self.error = e
            logger.debug("horovod.ray callbacks stopped after %d items: %r", self.delivered, e)
            self.on_error()

    def finish(self) -> None:
        """Every worker is gone: deliver what is still queued, then end the thread (call before :meth:`close`)."""
        if not self._thread.is_alive():
            return
        try:
            self.queue.put(self._end)  # behind every item a worker logged: their put()s have returned
        except Exception as e:  # noqa: BLE001 - the queue actor is gone: its get() fails the thread too
            self._thread.join(timeout=5.0)
            self.error = self.error or e
            return
        waited = 0.0
        while True:  # every item is delivered, however long a callback takes; but never in silence
            self._thread.join(timeout=_CALLBACK_WARN_SECONDS)
            if not self._thread.is_alive():
                return
            waited += _CALLBACK_WARN_SECONDS
            logger.warning(self._still_waiting(waited))

    def _still_waiting(self, waited: float) -> str:
        running = self._running
        if running is None:
            return (f"horovod.ray: the workers have ended; still delivering the items they logged to the callbacks "
                    f"after {waited:.0f} s ({self.delivered} delivered so far)")
        callback, item, since = running
        name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
        return (f"horovod.ray: the workers have ended, but callback {name} has not returned for "
                f"{time.monotonic() - since:.0f} s (item {reprlib.repr(item)}; {self.delivered} items delivered "
                "before it): run() returns once every item the workers logged is delivered")

    def close(self) -> None:
        """Kill the queue actor (a thread still waiting on it ends with the actor's error)."""
        try:
            self.queue.shutdown(force=True)
        except Exception as e:  # noqa: BLE001 - already gone
            logger.debug("ray_logger queue shutdown: %s", e)
        self._thread.join(timeout=5.0)

    def describe(self) -> str:
        """Why the callbacks stopped, for ``run``'s error."""
        if self.failed_on is None:
            return (f"horovod.ray: the driver could not read what the workers logged (ray_logger queue): "
                    f"{type(self.error).__name__}: {self.error}; the job was stopped")
        callback, item = self.failed_on
        name = getattr(callback, "__qualname__", None) or type(callback).__qualname__
        return (f"horovod.ray: callback {name} raised {type(self.error).__name__}: {self.error} on the item "
                f"{reprlib.repr(item)} (after {self.delivered} items delivered); the job was stopped and its "
                "workers killed")


class _RayElasticDriver(ElasticDriver):
    """horovodrun's elastic driver with Ray actors for workers (see the module docstring)."""

    def __init__(self, fn: Callable[[], Any], *, cpus_per_worker: int, gpus_per_worker: int,
                 env_vars: dict[str, str], log_queue: Any = None, **kwargs: Any) -> None:
        super().__init__(command=[], base_env={}, knobs={k: str(v) for k, v in env_vars.items()}, **kwargs)
        self.fn = fn
        self.log_queue = log_queue  # ray_logger's queue (None: a job without callbacks)
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.actor_cls = ray.remote(BaseHorovodWorker)
        self.failures: list[tuple[str, int, BaseException]] = []  # (slot, rank when started, error)

    def _bind_address(self) -> str:
        return ray.util.get_node_ip_address()

    def _store_endpoint(self, host: str) -> tuple[str, int]:
        return self.server.addr, self.server.port

    def _start_worker(self, slot: str, s: SlotInfo) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        env = self._worker_env(slot, s)
        if self.gpus_per_worker:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(s.local_size))
        actor = self.actor_cls.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=s.hostname, soft=False),
        ).remote(world_rank=s.rank, world_size=s.size)
        actor.update_env_vars.remote(env)  # ordered before the calls below (one caller, one actor)
        actor.set_queue.remote(self.log_queue)
        proc = _ActorProc(actor, actor.run_guarded.remote(_call_and_report(self.fn)), slot)
        label = s.rank if self.generation == 0 else self._next_label
        self._next_label = max(self._next_label, label + 1, len(self.plan.slots))
        worker = _Worker(slot, s.hostname, proc, label, [])  # type: ignore[arg-type]
        self.workers[slot] = worker

        def wait() -> None:
            code = proc.wait()
            # A process that ends frees its CPUs; an actor holds them until killed, so a successor on this
            # node (its host removed and restored, or back from a cooldown) could never be scheduled.
            proc.kill()
            if code and proc.error is not None:
                self.failures.append((slot, s.rank, proc.error))
            self._exits.put((worker, code))

        threading.Thread(target=wait, daemon=True, name=f"horovod-ray-elastic-{slot}").start()
        logger.debug("elastic: started %s as rank %d (actor on node %s)", slot, s.rank, s.hostname)

    def _kill(self, worker: _Worker, sig: int) -> None:
        worker.proc.kill()

    def _reap_later(self, worker: _Worker) -> None:
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and worker.proc.poll() is None:
            time.sleep(0.1)
        if worker.proc.poll() is None:
            worker.proc.kill()

    def _terminate_all(self) -> None:
        for w in [*self.workers.values(), *self.retired]:
            w.proc.kill()

    def results(self) -> list[Any]:
        """The values of the last generation's workers that returned, in the order of their final ranks."""
        done = []
        for slot in self.plan.slots:
            w = self.workers.get(slot)
            if w is not None and w.proc.poll() == 0:
                done.append(w.proc.value)
        return [value for _, value in sorted(done, key=lambda rv: rv[0])]


class _ElasticJob:
    """What both elastic front ends share: the parameters of one elastic Ray job and ``run``."""

    def __init__(self, *, discovery: HostDiscovery, min_workers: int, max_workers: int | None, num_workers: int,
                 reset_limit: int | None, cooldown_range: Any, elastic_timeout: float, timeout_s: float,
                 cpus_per_worker: int, gpus_per_worker: int, nics: Any, env_vars: dict[str, str]) -> None:
        if max_workers is not None and max_workers < min_workers:
            raise ValueError(f"max_workers ({max_workers}) must not be less than min_workers ({min_workers}).")
        self.kwargs = dict(discovery=discovery, num_proc=num_workers, min_np=min_workers, max_np=max_workers,
                           start_timeout=timeout_s, elastic_timeout=elastic_timeout, reset_limit=reset_limit,
                           cooldown_range=tuple(cooldown_range) if cooldown_range else None,
                           nics=sorted(nics) if nics else None)
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.env_vars = dict(env_vars)

    def run(self, fn: Callable[[], Any], callbacks: list[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Run the job; with ``callbacks``, every item a worker logs (``ray_logger.log``) is passed to each."""
        callbacks = list(callbacks or [])
        for i, callback in enumerate(callbacks):
            if not callable(callback):
                raise TypeError(f"callbacks[{i}] is not callable: {callback!r} (pass functions, or objects with "
                                "__call__, that take the logged dict)")
        stop = threading.Event()
        pump = _CallbackPump(callbacks, on_error=stop.set) if callbacks else None
        driver = _RayElasticDriver(fn, cpus_per_worker=self.cpus_per_worker, gpus_per_worker=self.gpus_per_worker,
                                   env_vars=self.env_vars, log_queue=pump.queue if pump else None,
                                   stop_event=stop, **self.kwargs)
        failure: Exception | None = None
        try:
            try:
                driver.run()  # kills every worker actor before it returns or raises
            except Exception as e:
                failure = e
            if pump is not None:
                pump.finish()
        finally:
            if pump is not None:
                pump.close()
        if pump is not None and pump.error is not None:
            if failure is None or isinstance(failure, spawn.Interrupted):  # the callback's error stopped the job
                raise RuntimeError(pump.describe()) from pump.error
            if hasattr(failure, "add_note"):  # Python >= 3.11
                failure.add_note(f"then, delivering the items logged before: {pump.describe()}")
        if failure is not None:
            raise RuntimeError(_failure_text(driver, failure)) from failure
        return driver.results()


def _failure_text(driver: _RayElasticDriver, error: BaseException) -> str:
    text = f"horovod.ray elastic job failed: {error}"
    if driver.failures:
        slot, rank, first = driver.failures[0]
        cause = getattr(first, "cause", None)
        cause = cause if isinstance(cause, BaseException) else first
        node, _, local = slot.rpartition(":")
        lines = [line for line in str(cause).strip().splitlines() if line.strip()] or [""]
        what = lines[-1] if isinstance(first, ray.exceptions.RayActorError) else lines[0]
        text += (f" (first failure: rank {rank} (node {node[:12]}, local slot {local}): "
                 f"{type(cause).__name__}: {what})")
    return text


class ElasticRayExecutor:
    """Upstream's elastic Ray executor (deprecated there since 0.25 in favour of ``RayExecutor(min_workers=)``).

    ``run(worker_fn)`` calls ``worker_fn()`` (no arguments) in every worker; use ``hvd.elastic.run`` and a
    state inside it to survive failures (docs/elastic.md).
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: int = 600, timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: Any = None, min_np: int | None = None, max_np: int | None = None,
                        **kwargs: Any) -> ElasticSettings:
        """Upstream's signature; ``discovery`` is set by the executor (``override_discovery``)."""
        if min_np is not None:
            min_num_proc = min_np
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
        if max_np is not None:
            max_num_proc = max_np
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
        known = {f.name for f in dataclasses.fields(ElasticSettings)}
        extra = {k: v for k, v in kwargs.items() if k in known}
        return ElasticSettings(min_num_proc=min_num_proc, max_num_proc=max_num_proc, reset_limit=reset_limit,
                               elastic_timeout=elastic_timeout, num_proc=min_num_proc, timeout_s=timeout_s,
                               ssh_identity_file=ssh_identity_file, nics=nics, **extra)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int | None = None, env_vars: dict | None = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be True if gpus_per_slot "
                             "is set. ")
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu=use_gpu, cpus_per_worker=cpus_per_slot,
                                                  gpus_per_worker=gpus_per_slot)
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env_vars = dict(env_vars or {})
        self._job: _ElasticJob | None = None

    def start(self) -> None:
        """Check the settings (the job itself starts in ``run``)."""
        s = self.settings
        if s.discovery is None:
            raise ValueError("settings.discovery is not set (override_discovery=False needs your own discovery)")
        self._job = _ElasticJob(
            discovery=s.discovery, min_workers=s.min_num_proc, max_workers=s.max_num_proc,
            num_workers=s.num_proc or s.min_num_proc, reset_limit=s.reset_limit,
            cooldown_range=getattr(s, "cooldown_range", None), elastic_timeout=s.elastic_timeout,
            timeout_s=_seconds(getattr(s, "timeout_s", None) or getattr(s, "start_timeout", None)
                               or DEFAULT_START_TIMEOUT),
            cpus_per_worker=self.cpus_per_slot, gpus_per_worker=self.gpus_per_slot * int(self.use_gpu),
            nics=s.nics, env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any], callbacks: list[Callable[[Any], Any]] | None = None) -> list[Any]:
        """Run ``worker_fn()`` elastically until a worker of the final generation returns; their results.

        ``callbacks``: each is called on the driver with every dict any worker passes to
        :func:`horovod.ray.ray_logger.log`, in order, while the job runs; all are delivered before ``run``
        returns.

        Raises:
            RuntimeError: the job failed (reset limit, too few slots for ``elastic_timeout``, no worker with
                state left); the text names the first failed worker and its error.  Or a callback raised:
                the job was stopped, the text names the callback and the item (``__cause__``: its error).
            TypeError: a callback is not callable.
        """
        if self._job is None:
            raise RuntimeError("call ElasticRayExecutor.start() before run()")
        return self._job.run(worker_fn, callbacks)


def _seconds(value: Any) -> float:
    """A number of seconds, or upstream's ``Timeout`` object's remaining time."""
    if hasattr(value, "remaining"):
        return float(value.remaining()) or 30.0
    return float(value)
