"""The driver side of ``horovod.spark.run``.

One run is one barrier-mode Spark job of ``num_proc`` tasks (``rdd.barrier().mapPartitionsWithIndex``):
Spark starts all of them at once or none, and a failed task fails the others.  The driver

1. makes the job key and starts the authenticated rendezvous store (:mod:`horovod.runner.rendezvous`) on the
   address executors reach the driver at, and puts the pickled ``(fn, args, kwargs)`` in it;
2. checks that the application has ``num_proc`` task slots (waiting for executors up to ``start_timeout``;
   ``local[N]`` never grows, so there it fails at once), then submits the job in a thread, under the job
   group ``horovod.spark.run.<n>``;
3. waits for every task to register its host, groups tasks by host (task 0's host first, tasks in index
   order) and publishes each task's rank, local and cross rank;
4. while the workers run, prints their forwarded output and watches their exit records: the first failure
   cancels the job group (Spark kills the other tasks, whose watchdogs end their workers) and is raised
   naming the rank and its error;
5. returns the results ``collect`` brought back, in rank order.

The task side is :mod:`horovod.spark.task`; the worker :mod:`horovod.spark._worker`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from horovod.base.exceptions import follows_from_another_rank
from horovod.runner.common.util.timeout import TimeoutException
from horovod.spark import task as task_mod
from horovod.spark.elastic import run_elastic  # upstream defines it in horovod/spark/runner.py

__all__ = ["run", "run_elastic", "START_TIMEOUT_MESSAGE"]

logger = logging.getLogger("horovod.spark")

START_TIMEOUT_MESSAGE = ("Timed out waiting for {activity}. Please check that you have enough resources to run all "
                         "Horovod processes. Each Horovod process runs in a Spark task. You may need to increase "
                         "the start_timeout parameter to a larger value if your Spark resources are allocated "
                         "on-demand.")
"""Upstream's text (its tests match its start)."""

POLL_SECONDS = 0.05
CANCEL_JOIN_SECONDS = 30.0
"""How long the driver waits for a cancelled Spark job to end before it stops the store anyway."""

ABORT_MARGIN_SECONDS = 5.0
"""Beyond the workers' termination grace, how long the tasks may take to end after ``spark/abort``."""

_job_ids = itertools.count()


def _spark_context() -> Any:
    import pyspark

    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise Exception("Could not find an active SparkContext, are you running in a PySpark session?")
    return sc


def _env_overrides(env: Mapping[str, Any] | None) -> dict[str, str | None]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError(f"env argument must be a dict, not {type(env)}")
    return {str(k): None if v is None else str(v) for k, v in env.items()}


def _driver_address(sc: Any, nics: Sequence[str]) -> str:
    """Where the store listens: the first of ``nics`` if given, else the address executors reach the driver at."""
    from horovod.runner import network

    if nics:
        return network.choose_interface([], list(nics)).address
    host = sc.getConf().get("spark.driver.host")
    if host:
        try:
            return socket.gethostbyname(host)
        except OSError as e:
            logger.warning("horovod.spark: spark.driver.host=%s does not resolve (%s); choosing an interface", host, e)
    return network.choose_interface([]).address


def _task_slots(sc: Any) -> int | None:
    """Tasks the application can run at once (what Spark's barrier check compares), None if Spark won't say."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception as e:  # noqa: BLE001 - a private API: fall back to waiting for the tasks
        logger.debug("horovod.spark: cannot read the number of task slots: %s", e)
        return None


def _spark_error_summary(error: BaseException, ranks: dict[int, int] | None = None) -> str:
    """What a (Py4J) Spark error says happened, without the Java stack: the first exception line, the
    task's own failure if Spark quoted it, and which Horovod rank the failed task ran."""
    lines = [line.strip().lstrip(": ") for line in str(error).splitlines() if line.strip()]
    found = [line for line in lines if ("Exception" in line or "Error" in line) and not line.startswith("at ")
             and "calling z:" not in line and not line.startswith("Caused by: java.io.")]
    if not found:
        return (lines[0] if lines else type(error).__name__)[:1000]
    text = found[0][:1000]
    if len(found) > 1 and found[1] != found[0]:
        text += f" Cause: {found[1][:500]}"
    match = re.search(r"ResultTask\(\d+, (\d+)\)", found[0])
    if match and ranks and int(match.group(1)) in ranks:
        index = int(match.group(1))
        text += f" (Spark task {index} ran Horovod rank {ranks[index]}.)"
    return text


class _SparkJob:
    """One barrier-mode Spark job whose tasks run the Horovod workers (see the module's docstring)."""

    def __init__(self, sc: Any, num_proc: int, start_timeout: float, verbose: int) -> None:
        self.sc = sc
        self.num_proc = num_proc
        self.start_timeout = start_timeout
        self.verbose = verbose
        self.group = f"horovod.spark.run.{next(_job_ids)}"
        self.done = threading.Event()
        self.result: list[tuple[int, bytes]] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def wait_for_slots(self, deadline: float) -> None:
        """Return once Spark can run ``num_proc`` tasks at once; TimeoutException otherwise (local: at once)."""
        conf = self.sc.getConf()
        while True:
            slots = _task_slots(self.sc)
            if slots is None or slots >= self.num_proc:
                return
            master = str(self.sc.master)
            # local / local[N] / local[N,F] never grow; local-cluster[...] starts its executor JVMs after the driver.
            local = master == "local" or master.startswith("local[")
            if local or time.monotonic() >= deadline:
                why = (f" num_proc={self.num_proc} Spark tasks must run at once (barrier execution mode), but this "
                       f"Spark application has {slots} task slot{'s' if slots != 1 else ''} (master "
                       f"{self.sc.master}, spark.task.cpus={conf.get('spark.task.cpus') or 1})")
                if local:
                    why += ", and a local master never gets more: lower num_proc or use a larger local[N]."
                    raise TimeoutException(START_TIMEOUT_MESSAGE.format(activity="Spark tasks to start") + why
                                           + f" Failed at once rather than after start_timeout="
                                           f"{self.start_timeout:g} seconds.")
                raise TimeoutException(START_TIMEOUT_MESSAGE.format(activity="Spark tasks to start") + why
                                       + f". Timeout after {self.start_timeout:g} seconds.")
            time.sleep(0.5)

    def submit(self, settings: task_mod.TaskSettings, elastic: bool = False) -> None:
        """Start the Spark job in a thread: a barrier stage of ``task_fn`` (static) or ordinary tasks of
        ``elastic_task_fn`` (elastic: a failed task is retried alone)."""
        from functools import partial

        import pyspark

        mapper = partial(_elastic_mapper if elastic else _mapper, settings)
        thread_cls = getattr(pyspark, "InheritableThread", threading.Thread)

        def body() -> None:
            try:
                self.sc.setJobGroup(self.group, "Horovod Spark Run", interruptOnCancel=True)
                rdd = self.sc.parallelize(range(self.num_proc), self.num_proc)
                if not elastic:
                    rdd = rdd.barrier()
                self.result = rdd.mapPartitionsWithIndex(mapper).collect()
            except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
                self.error = e
            finally:
                self.done.set()

        self.thread = thread_cls(target=body, name=self.group, daemon=True)
        self.thread.start()

    def cancel(self, join: float = CANCEL_JOIN_SECONDS) -> None:
        if self.thread is None or self.done.is_set():
            return
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception as e:  # noqa: BLE001 - the SparkContext may be stopping
            logger.warning("horovod.spark: could not cancel Spark job group %s: %s", self.group, e)
        self.done.wait(join)


def _mapper(settings: task_mod.TaskSettings, index: int, iterator: Any) -> Any:
    return task_mod.task_fn(settings, index, iterator)


def _elastic_mapper(settings: task_mod.TaskSettings, index: int, iterator: Any) -> Any:
    from horovod.spark.elastic import elastic_task_fn

    return elastic_task_fn(settings, index, iterator)


class _Output:
    """The driver's end of the workers' output: ``spark/out.<rank>.<seq>`` chunks, in order, to the streams."""

    def __init__(self, server: Any, num_proc: int, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        from horovod.runner.output import OutputSink

        self.server = server
        self.next = [0] * num_proc
        self.sinks = {"stdout": OutputSink(stdout if stdout is not None else sys.stdout),
                      "stderr": OutputSink(stderr if stderr is not None else sys.stderr)}

    def drain(self) -> None:
        for rank in range(len(self.next)):
            while True:
                key = task_mod.output_key(rank, self.next[rank])
                chunk = self.server.get(key)
                if chunk is None:
                    break
                self.server.delete(key)
                self.next[rank] += 1
                for stream, text in json.loads(chunk):
                    self.sinks.get(stream, self.sinks["stderr"]).write(text)


def _assign_ranks(registrations: list[dict[str, Any]]) -> list[Any]:
    """Each task's SlotInfo: tasks grouped by host, hosts in order of their first task, tasks in index order."""
    from horovod.runner.hosts import HostInfo, get_host_assignments

    by_host: dict[str, list[int]] = {}
    for index, reg in enumerate(registrations):
        by_host.setdefault(str(reg["host"]), []).append(index)
    hosts = [HostInfo(h, len(indices)) for h, indices in by_host.items()]
    slots = get_host_assignments(hosts, len(registrations), len(registrations))
    per_task: list[Any] = [None] * len(registrations)
    position = 0
    for indices in by_host.values():
        for index in indices:
            per_task[index] = slots[position]
            position += 1
    return per_task


def _failure(record: dict[str, Any]) -> RuntimeError:
    from horovod.runner.spawn import JobFailure

    failure = JobFailure(int(record["rank"]), int(record["code"]))
    error = (record.get("error") or "").strip()
    detail = f"Rank {record['rank']} (Spark task {record['index']}) failed"
    failure.args = (f"{failure.args[0]}{detail}: {error}\n" if error else f"{failure.args[0]}{detail}.\n",)
    return failure


def _first_failure(server: Any, num_proc: int, seen: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest non-zero exit recorded so far (by the tasks' clocks); one that only followed from another
    rank's failure (a ``ShutdownError`` naming that rank) comes after, one the driver's abort caused last.

    A rank raising while its peer waits in a collective: the peer fails at once with a ``ShutdownError``
    when the rank shuts down at exit, and may exit (and be recorded) first; the cause is the rank's error.
    """
    for rank in range(num_proc):
        if rank not in seen:
            value = server.get(task_mod.exit_key(rank))
            if value is not None:
                seen[rank] = json.loads(value)
    failed = [r for r in seen.values() if r["code"] != 0]
    return min(failed, key=lambda r: (bool(r.get("aborted")), follows_from_another_rank(r.get("error") or ""),
                                      r["time"])) if failed else None


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        num_proc: int | None = None, start_timeout: int | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None, env: Mapping[str, Any] | None = None,
        stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
        nics: Sequence[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list[Any]:
    """``horovod.spark.run`` (documented there)."""
    import cloudpickle

    from horovod.base import auth
    from horovod.base.config import read_env
    from horovod.runner.rendezvous import RendezvousServer

    if use_mpi:
        raise ValueError("horovod.spark.run(use_mpi=True): MPI is not available under Spark here; the processes "
                         "always use the built-in (Gloo-compatible) transport. Leave use_mpi unset or pass "
                         "use_gloo=True.")
    if extra_mpi_args:
        logger.warning("horovod.spark.run: extra_mpi_args is ignored (no mpirun under Spark)")
    sc = _spark_context()
    if start_timeout is None:
        start_timeout = read_env("HOROVOD_SPARK_START_TIMEOUT")
    if start_timeout <= 0:
        raise ValueError(f"start_timeout={start_timeout} must be > 0 seconds")
    if num_proc is None:
        num_proc = sc.defaultParallelism
        if verbose >= 1:
            logger.info("Running %d processes (inferred from spark.default.parallelism)...", num_proc)
    elif verbose >= 1:
        logger.info("Running %d processes...", num_proc)
    if num_proc < 1:
        raise ValueError(f"num_proc={num_proc} must be at least 1")
    overrides = _env_overrides(env)
    nic_list = sorted(nics) if isinstance(nics, (set, frozenset)) else list(nics or [])
    started = time.monotonic()
    deadline = started + start_timeout

    tls_cert = tls_key = job_tls = None
    tls_value = overrides["HOROVOD_TLS"] if "HOROVOD_TLS" in overrides else os.environ.get("HOROVOD_TLS")
    if read_env("HOROVOD_TLS", {"HOROVOD_TLS": tls_value or ""}):  # as horovodrun --tls: store and mesh
        from horovod.transport import tls as tls_mod

        creds = tls_mod.make_credentials()
        tls_cert, tls_key, job_tls = creds.cert_pem, creds.key_pem, tls_mod.JobTls(creds)

    key = auth.make_secret_key()
    addr = _driver_address(sc, nic_list)
    server = RendezvousServer(key, addr=addr, tls=job_tls)
    port = server.start()
    job = _SparkJob(sc, num_proc, start_timeout, verbose)
    output = _Output(server, num_proc, stdout, stderr)
    registered = threading.Event()
    try:
        server.put(task_mod.FUNC_KEY, cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        job.wait_for_slots(deadline)
        settings = task_mod.TaskSettings(addr=addr, port=port, key=key,
                                         num_proc=num_proc, start_timeout=float(start_timeout), env=overrides,
                                         nics=tuple(nic_list), timestamp=prefix_output_with_timestamp,
                                         executable=executable, verbose=verbose, tls_cert=tls_cert, tls_key=tls_key)
        job.submit(settings)
        registrations = _wait_for_tasks(server, job, deadline)
        registered.set()
        slots = _assign_ranks(registrations)
        remaining = max(1.0, deadline - time.monotonic())
        for index, slot in enumerate(slots):
            server.put(task_mod.assign_key(index), json.dumps({
                "slot": {f: getattr(slot, f) for f in ("hostname", "rank", "local_rank", "cross_rank", "size",
                                                       "local_size", "cross_size")},
                "start_timeout": round(remaining, 3)}).encode())
        if verbose >= 2:
            hosts = {}
            for reg in registrations:
                hosts[reg["hostname"]] = hosts.get(reg["hostname"], 0) + 1
            logger.info("horovod.spark: %d tasks on %s started after %.1f s; ranks assigned", num_proc,
                        ", ".join(f"{h}:{n}" for h, n in hosts.items()), time.monotonic() - started)
        failure = _wait_for_workers(server, job, output, num_proc)
        output.drain()
        if failure is not None:
            raise _failure(failure)
        if job.error is not None:
            ranks = {index: slot.rank for index, slot in enumerate(slots)}
            raise RuntimeError(f"Spark job has failed: {_spark_error_summary(job.error, ranks)}") from job.error
        assert job.result is not None
        by_rank = {rank: payload for rank, payload in job.result if payload is not None}
        missing = [r for r in range(num_proc) if r not in by_rank]
        if missing:
            raise RuntimeError(f"horovod.spark.run: no result from rank(s) {missing}")
        return [cloudpickle.loads(by_rank[r])[1] for r in range(num_proc)]
    finally:
        try:
            server.put(task_mod.ABORT_KEY, b"1")  # tasks still waiting or running stop their workers
        except Exception:  # noqa: BLE001 - the server may have failed to start
            pass
        if job.thread is not None and not job.done.is_set() and registered.is_set():
            # Every task runs: give them the time to stop their workers themselves, then cancel.
            from horovod.runner.spawn import TERMINATE_GRACE

            job.done.wait(TERMINATE_GRACE + ABORT_MARGIN_SECONDS)
        job.cancel()
        try:
            output.drain()
        except Exception:  # noqa: BLE001 - best effort
            pass
        server.stop()


def _wait_for_tasks(server: Any, job: _SparkJob, deadline: float) -> list[dict[str, Any]]:
    """Every task's registration (host, hostname, pid), or TimeoutException / RuntimeError (job failed)."""
    registrations: list[dict[str, Any] | None] = [None] * job.num_proc
    while True:
        for index in range(job.num_proc):
            if registrations[index] is None:
                value = server.get(task_mod.task_key(index))
                if value is not None:
                    registrations[index] = json.loads(value)
        if all(r is not None for r in registrations):
            return registrations  # type: ignore[return-value]
        if job.done.is_set():
            if job.error is not None:
                raise RuntimeError(f"Spark job has failed: {_spark_error_summary(job.error)}") from job.error
            raise RuntimeError("Spark job ended before all tasks registered with the driver")
        if time.monotonic() >= deadline:
            started = sum(r is not None for r in registrations)
            raise TimeoutException(START_TIMEOUT_MESSAGE.format(activity="Spark tasks to start")
                                   + f" {started} of {job.num_proc} tasks started. Timeout after "
                                   f"{job.start_timeout:g} seconds.")
        time.sleep(POLL_SECONDS)


def _wait_for_workers(server: Any, job: _SparkJob, output: _Output, num_proc: int) -> dict[str, Any] | None:
    """Forward output until the Spark job ends; on the first failed rank stop the others, return its record.

    The other tasks stop their workers when they see ``spark/abort`` (SIGTERM, then SIGKILL after
    ``TERMINATE_GRACE``) and end normally; should they not, the job group is cancelled.
    """
    from horovod.runner.spawn import TERMINATE_GRACE

    seen: dict[int, dict[str, Any]] = {}
    while not job.done.wait(POLL_SECONDS):
        output.drain()
        if _first_failure(server, num_proc, seen) is not None:
            server.put(task_mod.ABORT_KEY, b"1")
            end = time.monotonic() + TERMINATE_GRACE + ABORT_MARGIN_SECONDS
            while not job.done.wait(POLL_SECONDS) and time.monotonic() < end:
                output.drain()
            job.cancel()
            break
    return _first_failure(server, num_proc, seen)
