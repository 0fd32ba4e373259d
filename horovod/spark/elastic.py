"""``horovod.spark.run_elastic``: Elastic Horovod whose hosts are Spark tasks.

The job runs the launcher's elastic driver (:mod:`horovod.runner.elastic.driver`, the same generations,
resets, blacklist and exactly-once protocol as ``horovodrun --min-np/--max-np``) with Spark tasks as its
hosts, as upstream does:

* one ordinary (not barrier) Spark job of ``max_num_proc`` tasks, so that a failed task is retried by Spark
  on its own (``spark.task.maxFailures`` > 1) while the others keep training;
* every task *attempt* is a host of one slot, named by a host hash salted with its index and start time
  (upstream's rule): a retried attempt is a new host, the failed one stays blacklisted;
* a task registers and sends a heartbeat to the driver's store; discovery lists the tasks whose heartbeat
  is fresh and whose worker has not exited;
* "starting a worker on a host" publishes its environment for that task (``spark/cmd.<host>``); the task
  starts ``python -m horovod.spark._worker`` under the watchdog and reports its output and exit status
  back, which the driver sees through a process-like proxy (:class:`_TaskProcess`);
* a worker that exits non-zero makes its task fail (upstream's ``Command failed, making Spark task fail to
  restart the task``), so Spark starts a new attempt, which joins the job as a new host.

The job ends when the elastic driver ends: the results of the workers that finished successfully, in rank
order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any

from horovod.runner.elastic.discovery import HostDiscovery
from horovod.spark import task as task_mod

__all__ = ["run_elastic"]

logger = logging.getLogger("horovod.spark")

HEARTBEAT_SECONDS = 0.5
"""How often a task tells the driver it is alive."""
LOST_SECONDS = 5.0
"""A task whose heartbeat stopped this long is gone (its Python worker died): its worker counts as exited."""
LOST_EXIT_CODE = -int(signal.SIGKILL)
UNREACHABLE_IDLE_SECONDS = 5.0
"""An idle task (no worker) whose driver's store stays unreachable this long ends: the job is over."""
COMMAND_FAILED_MESSAGE = "Command failed, making Spark task fail to restart the task"


_SECRET_VARS = ("HOROVOD_SECRET_KEY", "_HOROVOD_SECRET_KEY", "HOROVOD_TLS_CERT", "HOROVOD_TLS_KEY")


def _host_key(kind: str, host: str) -> str:
    return f"spark/{kind}.{host}"


# ------------------------------------------------------------------------------------------------ task side

def elastic_task_fn(settings: task_mod.TaskSettings, index: int,
                    iterator: Iterable[Any]) -> Iterator[tuple[int, bytes]]:
    """One Spark task (attempt) of an elastic job: a one-slot host until the driver releases it.

    Yields ``(index, pickled (final rank, result))`` when its worker succeeded; nothing when released unused.

    Raises:
        RuntimeError: its worker failed (upstream's text, so that Spark retries the task as a new host).
    """
    from pyspark import TaskContext

    from horovod.runner import spawn
    from horovod.transport.store import StoreClient, StoreError

    ctx = TaskContext.get()
    client = StoreClient(settings.addr, settings.port, settings.key, timeout=30.0, tls=settings.job_tls())
    host = task_mod.host_hash(salt=f"{index}-{time.time()}")
    gpus = task_mod._task_gpus(ctx)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(client, host, stop), name="horovod-spark-heartbeat",
                            daemon=True)
    client.put(task_mod.task_key(index), json.dumps({"host": host, "attempt": ctx.attemptNumber(),
                                                       "pid": os.getpid()}).encode())
    beat.start()
    try:
        command = _wait_for_command(client, host)
        if command is None:
            return
        with _tempdir() as tmp:
            result_file, error_file = os.path.join(tmp, "result"), os.path.join(tmp, "error")
            env = _elastic_worker_env(settings, command["env"], gpus, result_file, error_file)
            worker = [settings.executable or sys.executable, "-m", "horovod.spark._worker"]
            proc = spawn.spawn_local(spawn.WorkerSpec(rank=index, command=worker, env=env, cwd=os.getcwd()))
            outbox = task_mod.Outbox(client, lambda seq: f"spark/out.{host}.{seq}", f"host {host}")
            readers = [threading.Thread(target=_pump, args=(stream, name, outbox), daemon=True,
                                        name=f"horovod-spark-{name}")
                       for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
            for t in readers:
                t.start()
            aborted = False
            applied = ""
            try:
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=0.2)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    try:
                        request = _get(client, _host_key("kill", host))
                        if task_mod._aborted(client):
                            aborted = True
                            spawn.terminate_workers([proc])
                            break
                    except StoreError:
                        continue  # the heartbeat thread notices a lost driver
                    if request is not None and request.decode() != applied:
                        applied = request.decode()
                        _signal_group(proc, int(applied.split()[-1]))
            finally:
                task_mod.stop_worker(proc)
            code = task_mod.reap_worker(proc, readers, outbox)
            result = task_mod._read(result_file)
            error = task_mod._read(error_file)
        try:
            client.put(_host_key("exit", host), json.dumps({"code": code, "aborted": aborted, "error": (
                error or b"").decode("utf-8", "replace")[-4000:]}).encode())
        except StoreError:
            if not aborted:
                raise
        if code == 0 and result is not None:
            yield index, result
            return
        if aborted:
            return
        raise RuntimeError(f"{COMMAND_FAILED_MESSAGE} (the Horovod worker of Spark task {index}, attempt "
                           f"{ctx.attemptNumber()}, exited with code {code})")
    finally:
        stop.set()


def _tempdir() -> Any:
    import tempfile

    return tempfile.TemporaryDirectory(prefix="horovod-spark-")


def _get(client: Any, key: str) -> bytes | None:
    from horovod.transport.store import StoreError

    try:
        return client.get(key, timeout=0)
    except StoreError as e:
        if str(e).startswith("timed out waiting"):
            return None
        raise


def _heartbeat(client: Any, host: str, stop: threading.Event) -> None:
    count = 0
    lost_since: float | None = None
    while not stop.wait(HEARTBEAT_SECONDS):
        count += 1
        try:
            client.put(_host_key("alive", host), str(count).encode())
            lost_since = None
        except Exception:  # noqa: BLE001 - the driver is gone or busy
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > task_mod.DRIVER_LOST_SECONDS:
                # Nobody will stop this task's worker: end the Python worker, the watchdog ends the rest.
                sys.stderr.write("horovod.spark: the driver is unreachable; stopping this task's worker\n")
                os._exit(1)


def _wait_for_command(client: Any, host: str) -> dict[str, Any] | None:
    """The driver's command for this host, or None once the driver released the job (or is gone)."""
    from horovod.transport.store import StoreError

    unreachable_since: float | None = None
    while True:
        try:
            value = _get(client, _host_key("cmd", host))
            if value is not None:
                return json.loads(value)
            if task_mod._aborted(client):
                return None
            unreachable_since = None
        except StoreError:
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > UNREACHABLE_IDLE_SECONDS:
                return None  # the job ended (its store stopped) without this host
        time.sleep(0.1)


def _elastic_worker_env(settings: task_mod.TaskSettings, contract: dict[str, str], gpus: list[str],
                        result_file: str, error_file: str) -> dict[str, str]:
    from horovod.base import auth

    env = task_mod.user_env(settings)
    env.update(contract)
    env.update({"PYTHONPATH": task_mod._python_path(), auth.SECRET_KEY_ENV: settings.key.hex(),
                task_mod.GPUS_ENV: ",".join(gpus), task_mod.RESULT_ENV: result_file,
                task_mod.ERROR_ENV: error_file})
    if settings.tls_cert is not None:
        from horovod.transport import tls as tls_mod

        env.update(tls_mod.worker_env(tls_mod.JobCredentials(settings.tls_cert, settings.tls_key or b"")))
    return env


def _signal_group(proc: Any, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
        if sig == signal.SIGTERM:
            os.killpg(proc.pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


def _pump(stream: Any, name: str, outbox: task_mod.Outbox) -> None:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        while True:
            try:
                chunk = os.read(stream.fileno(), 65536)
            except OSError:
                chunk = b""
            text = decoder.decode(chunk, final=not chunk)
            if text:
                outbox.add(name, text)
            if not chunk:
                return
    finally:
        stream.close()


# ---------------------------------------------------------------------------------------------- driver side

def _fake_pid() -> int:
    """A pid no process has (above the kernel's pid_max): the elastic driver must never signal it."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read()) + 1000
    except (OSError, ValueError):
        return 1 << 30


class _TaskProcess:
    """What the elastic driver sees of a worker running in a Spark task: a ``Popen`` look-alike.

    ``stdout``/``stderr`` are pipes fed with the output the task forwards; ``poll``/``wait`` return its exit
    status (or ``-SIGKILL`` when the task stopped sending heartbeats); signals become requests to the task.
    """

    def __init__(self, server: Any, host: str) -> None:
        self.server = server
        self.host = host
        self.pid = _fake_pid()
        self.stdin = None
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self.stdout = os.fdopen(out_r, "rb", buffering=0)
        self.stderr = os.fdopen(err_r, "rb", buffering=0)
        self.returncode: int | None = None
        self._done = threading.Event()
        self._seq = 0
        self._kills = 0

    # Popen API used by the elastic driver and horovod.runner.spawn
    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(["spark task", self.host], timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._kills += 1
            self.server.put(_host_key("kill", self.host), f"{self._kills} {int(sig)}".encode())

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def soft_terminate(self) -> None:
        self.terminate()

    # fed by the monitor
    def drain(self) -> None:
        while True:
            key = f"spark/out.{self.host}.{self._seq}"
            chunk = self.server.get(key)
            if chunk is None:
                return
            self.server.delete(key)
            self._seq += 1
            for stream, text in json.loads(chunk):
                fd = self._err_w if stream == "stderr" else self._out_w
                try:
                    os.write(fd, text.encode("utf-8"))
                except OSError:
                    pass

    def finish(self, code: int) -> None:
        if self.returncode is not None:
            return
        self.drain()
        for fd in (self._out_w, self._err_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.returncode = code
        self._done.set()


class _SparkTasks(HostDiscovery):
    """Discovery (``{host: 1}`` for every live task attempt without a finished worker) and the monitor that
    feeds the :class:`_TaskProcess` proxies; one thread polls the driver's store."""

    def __init__(self, num_tasks: int) -> None:
        self.num_tasks = num_tasks
        self.server: Any = None
        self.procs: dict[str, _TaskProcess] = {}
        self._latest: dict[int, str] = {}  # task index -> the host of its latest attempt
        self._beats: dict[str, tuple[bytes, float]] = {}
        self._exited: set[str] = set()
        self.errors: dict[str, str] = {}  # host -> the error its worker reported (its exception and traceback)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, server: Any) -> None:
        self.server = server
        self._thread = threading.Thread(target=self._loop, name="horovod-spark-tasks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            return {h: 1 for h in self._latest.values()
                    if h not in self._exited and now - self._beats[h][1] < LOST_SECONDS}

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - keep watching; the driver's deadlines still apply
                logger.warning("horovod.spark: task monitor: %s", e)

    def _tick(self) -> None:
        now = time.monotonic()
        for index in range(self.num_tasks):
            value = self.server.get(task_mod.task_key(index))
            if value is None:
                continue
            host = str(json.loads(value)["host"])
            beat = self.server.get(_host_key("alive", host)) or b"registered"
            with self._lock:
                self._latest[index] = host
                last = self._beats.get(host)
                if last is None or last[0] != beat:
                    self._beats[host] = (beat, now)
        for host, proc in list(self.procs.items()):
            proc.drain()
            record = self.server.get(_host_key("exit", host))
            if record is not None:
                exit_record = json.loads(record)
                with self._lock:
                    self._exited.add(host)
                    self.errors[host] = str(exit_record.get("error") or "").strip()
                proc.finish(int(exit_record["code"]))
                continue
            with self._lock:
                seen = self._beats.get(host, (b"", now))[1]
            if proc.returncode is None and now - seen > LOST_SECONDS:
                logger.warning("horovod.spark: the Spark task of host %s stopped (no heartbeat for %.0f s)",
                               host, LOST_SECONDS)
                with self._lock:
                    self._exited.add(host)
                proc.finish(LOST_EXIT_CODE)


def _make_driver(tasks: _SparkTasks, job: Any, settings_for: Callable[[Any], task_mod.TaskSettings],
                 addr: str, **kwargs: Any) -> Any:
    """The launcher's elastic driver with Spark tasks as hosts (see the module docstring)."""
    from horovod.runner import spawn
    from horovod.runner.elastic.driver import ElasticDriver

    class SparkElasticDriver(ElasticDriver):
        submitted = False
        first_failed_host: str | None = None

        def _failed(self, worker: Any, why: str) -> None:
            if self.first_failure is None:
                self.first_failed_host = worker.host
            super()._failed(worker, why)

        def _bind_address(self) -> str:
            return addr

        def _store_endpoint(self, host: str) -> tuple[str, int]:
            return self.server.addr, self.server.port

        def _wait_for_slots(self, needed: int, why: str) -> None:
            if not self.submitted:
                self.submitted = True
                tasks.start(self.server)
                job.submit(settings_for(self), elastic=True)
                deadline = time.monotonic() + job.start_timeout
                while len(tasks.find_available_hosts_and_slots()) < needed:
                    self._check_stop()
                    if time.monotonic() > deadline:
                        from horovod.runner.common.util.timeout import TimeoutException
                        from horovod.spark.runner import START_TIMEOUT_MESSAGE

                        found = len(tasks.find_available_hosts_and_slots())
                        raise TimeoutException(START_TIMEOUT_MESSAGE.format(activity="Spark tasks to start")
                                               + f" {found} of the {needed} tasks needed started. Timeout after "
                                               f"{job.start_timeout:g} seconds.")
                    time.sleep(0.1)
                self.hosts.update_available_hosts()
            super()._wait_for_slots(needed, why)

        def _check_stop(self) -> None:
            super()._check_stop()
            if job.done.is_set() and job.error is not None:
                from horovod.spark.runner import _spark_error_summary

                raise RuntimeError(f"Spark job has failed: {_spark_error_summary(job.error)}") from job.error

        def _spawner(self, host: str) -> spawn.Spawner:
            def start(spec: spawn.WorkerSpec) -> Any:
                proc = _TaskProcess(self.server, host)
                tasks.procs[host] = proc
                # The key and the TLS key reach the task in its closure: never put them in the store.
                env = {k: v for k, v in spec.env.items() if k not in _SECRET_VARS}
                self.server.put(_host_key("cmd", host), json.dumps({"env": env}).encode())
                return proc
            return start

        def _kill(self, worker: Any, sig: int) -> None:
            worker.proc.send_signal(sig)

        def _reap_later(self, worker: Any) -> None:
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and worker.proc.poll() is None:
                time.sleep(0.1)
            _stop_procs([worker.proc])

        def _terminate_all(self) -> None:
            # The job is over (run() stops the store next): idle tasks end, running workers are stopped.
            self.server.put(task_mod.ABORT_KEY, b"1")
            workers = [*self.workers.values(), *self.retired]
            _stop_procs([w.proc for w in workers if w.proc.poll() is None])
            deadline = time.monotonic() + 2.0
            for w in workers:
                for t in w.readers:
                    t.join(timeout=max(0.0, deadline - time.monotonic()))

    return SparkElasticDriver(tasks, **kwargs)


def _stop_procs(procs: Sequence[_TaskProcess]) -> None:
    from horovod.runner.spawn import TERMINATE_GRACE

    for p in procs:
        p.terminate()
    end = time.monotonic() + TERMINATE_GRACE
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: int | None = None, elastic_timeout: int | None = None,
                reset_limit: int | None = None, env: Mapping[str, Any] | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
                nics: Sequence[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
                min_np: int | None = None, max_np: int | None = None) -> list[Any]:
    """``horovod.spark.run_elastic`` (documented there)."""
    import cloudpickle

    from horovod.base.config import read_env
    from horovod.runner import spawn
    from horovod.runner.elastic.driver import AllHostsBlacklisted
    from horovod.runner.output import OutputSink
    from horovod.spark.runner import _driver_address, _env_overrides, _spark_context, _SparkJob

    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=3)
        min_num_proc = min_np if min_num_proc is None else min_num_proc
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=3)
        max_num_proc = max_np if max_num_proc is None else max_num_proc
    sc = _spark_context()
    if start_timeout is None:
        start_timeout = read_env("HOROVOD_SPARK_START_TIMEOUT")
    if elastic_timeout is None:
        elastic_timeout = read_env("HOROVOD_ELASTIC_TIMEOUT")
    if num_proc is None:
        num_proc = sc.defaultParallelism
    min_num_proc = num_proc if min_num_proc is None else min_num_proc
    max_num_proc = num_proc if max_num_proc is None else max_num_proc
    if not 1 <= min_num_proc <= num_proc <= max_num_proc:
        raise ValueError(f"need 1 <= min_num_proc ({min_num_proc}) <= num_proc ({num_proc}) <= max_num_proc "
                         f"({max_num_proc})")
    for name, value in (("start_timeout", start_timeout), ("elastic_timeout", elastic_timeout)):
        if value <= 0:
            raise ValueError(f"{name}={value} must be > 0 seconds")
    if verbose >= 1:
        logger.info("Running %d processes (min %d, max %d)...", num_proc, min_num_proc, max_num_proc)
    master, failures = str(sc.master), sc.getConf().get("spark.task.maxFailures")
    if failures == "1" or (failures is None and re.fullmatch(r"local(\[[^,\]]*\])?", master)):
        logger.warning("horovod.spark.run_elastic: Spark does not retry failed tasks here (master %s, "
                       "spark.task.maxFailures=1): a failed worker cannot come back, and its task's failure "
                       "ends the Spark job. Use spark.task.maxFailures > 1 (local: master local[N,F]).", master)
    overrides = _env_overrides(env)
    nic_list = sorted(nics) if isinstance(nics, (set, frozenset)) else list(nics or [])
    user_env = dict(os.environ)
    user_env.update({k: v for k, v in overrides.items() if v is not None})
    knobs = {"HOROVOD_TLS": "1"} if read_env("HOROVOD_TLS", {"HOROVOD_TLS": user_env.get("HOROVOD_TLS", "")}) else {}
    grace = read_env("HOROVOD_ELASTIC_GRACE_SECONDS", user_env)

    job = _SparkJob(sc, max_num_proc, float(start_timeout), verbose)
    tasks = _SparkTasks(max_num_proc)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))

    def settings_for(driver: Any) -> task_mod.TaskSettings:
        driver.server.put(task_mod.FUNC_KEY, payload)
        creds = driver.tls
        return task_mod.TaskSettings(
            addr=driver.server.addr, port=driver.server.port, key=driver.key, num_proc=max_num_proc,
            start_timeout=float(start_timeout), env=overrides, nics=tuple(nic_list),
            timestamp=prefix_output_with_timestamp, verbose=verbose,
            tls_cert=creds.cert_pem if creds is not None else None,
            tls_key=creds.key_pem if creds is not None else None)

    output = spawn.OutputOptions(prefix_timestamp=prefix_output_with_timestamp,
                                 stdout=OutputSink(stdout if stdout is not None else sys.stdout),
                                 stderr=OutputSink(stderr if stderr is not None else sys.stderr))
    driver = _make_driver(tasks, job, settings_for, _driver_address(sc, nic_list),
                          command=["horovod.spark._worker"], num_proc=num_proc, min_np=min_num_proc,
                          max_np=max_num_proc, base_env={}, knobs=knobs, start_timeout=int(start_timeout),
                          elastic_timeout=float(elastic_timeout), reset_limit=reset_limit, cooldown_range=None,
                          nics=nic_list, output=output, grace=grace)
    try:
        try:
            driver.run()
        finally:
            tasks.stop()
            # The tasks end by themselves once released (or Spark retries exhausted); never wait forever.
            from horovod.runner.spawn import TERMINATE_GRACE
            from horovod.spark.runner import ABORT_MARGIN_SECONDS

            job.done.wait(TERMINATE_GRACE + ABORT_MARGIN_SECONDS)
            job.cancel()
    except spawn.JobFailure:
        raise
    except AllHostsBlacklisted as e:
        if driver.first_failure is None:
            raise
        # As horovodrun's elastic launcher: upstream's words for the first failed worker, then its error.
        failure = spawn.JobFailure(*driver.first_failure)
        error = tasks.errors.get(driver.first_failed_host or "", "")
        detail = f"Rank {driver.first_failure[0]} (host {driver.first_failed_host}) failed"
        failure.args = (f"{failure.args[0]}({e})\n{detail}" + (f": {error}\n" if error else ".\n"),)
        raise failure from None
    if job.error is not None:
        from horovod.spark.runner import _spark_error_summary

        raise RuntimeError(f"Spark job has failed: {_spark_error_summary(job.error)}") from job.error
    assert job.result is not None
    results = sorted(cloudpickle.loads(payload) for _, payload in job.result)
    return [value for _, value in results]
