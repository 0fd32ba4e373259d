"""What runs inside each Spark task of ``horovod.spark.run``, and the helpers a worker may call.

A task of the barrier stage: registers its host with the driver's rendezvous store, waits for its rank,
starts the Horovod worker (``python -m horovod.spark._worker``) as a child process under the launcher's
watchdog (:mod:`horovod.runner._watchdog`), forwards the worker's output to the driver, and returns the
worker's pickled result to Spark's ``collect``.  The worker lives outside the Spark Python worker: its engine
threads and sockets never share that process, and when the Spark task is killed (the job is cancelled, a
peer failed, the executor's Python worker died) the watchdog's lifeline closes and it ends the worker's
whole process group.

Everything the task needs travels in :class:`TaskSettings`, inside the closure Spark ships to the executors
-- the job key included (see docs/spark.md, "Trust boundary").  The key reaches the worker in its
environment through the watchdog's stdin, never on a command line.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["TaskSettings", "host_hash", "get_available_devices", "task_fn", "GPUS_ENV", "RESULT_ENV",
           "ERROR_ENV"]

GPUS_ENV = "HOROVOD_SPARK_TASK_GPUS"
"""The Spark task's GPU addresses (comma separated), read by :func:`get_available_devices` in the worker."""
RESULT_ENV = "HOROVOD_SPARK_RESULT_FILE"
ERROR_ENV = "HOROVOD_SPARK_ERROR_FILE"

POLL_SECONDS = 0.5
"""How often a task looks at the driver's ``abort`` key while its worker runs."""
DRIVER_LOST_SECONDS = 30.0
"""A task whose driver's store stays unreachable this long stops its worker (the driver is gone)."""
OUTPUT_FLUSH_SECONDS = 0.1
OUTPUT_CHUNK_BYTES = 1 << 20

# Keys of the driver's store (one store per run, so no run id in them).
FUNC_KEY = "runfunc/func"
ABORT_KEY = "spark/abort"


def task_key(index: int) -> str:
    return f"spark/task.{index}"


def assign_key(index: int) -> str:
    return f"spark/assign.{index}"


def exit_key(rank: int) -> str:
    return f"spark/exit.{rank}"


def output_key(rank: int, seq: int) -> str:
    return f"spark/out.{rank}.{seq}"


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """What the driver ships to every task (pickled by Spark with the task's closure)."""

    addr: str
    port: int
    key: bytes = dataclasses.field(repr=False)
    num_proc: int
    start_timeout: float
    env: dict[str, str | None]
    nics: tuple[str, ...] = ()
    timestamp: bool = False
    executable: str | None = None
    verbose: int = 1
    tls_cert: bytes | None = None
    tls_key: bytes | None = dataclasses.field(default=None, repr=False)

    def job_tls(self) -> Any:
        if self.tls_cert is None:
            return False
        from horovod.transport import tls as tls_mod

        return tls_mod.JobTls(tls_mod.JobCredentials(self.tls_cert, self.tls_key or b""))


def _namespaces() -> str:
    try:
        names = sorted(os.listdir("/proc/self/ns"))
    except OSError:
        return ""
    links = []
    for name in names:
        try:
            links.append(os.readlink(f"/proc/self/ns/{name}"))
        except OSError:
            pass
    return "-".join(links)


def host_hash(salt: str | None = None) -> str:
    """``<short hostname>-<md5>`` of the hostname and this process's namespaces (upstream's host identity).

    Tasks with the same hash share a machine *and* its namespaces, so their workers may use shared memory
    and abstract Unix sockets; containers on one machine (``CONTAINER_ID`` on YARN) are distinct hosts.
    """
    hostname = socket.gethostname()
    text = f"{hostname}-{_namespaces()}"
    container = os.environ.get("CONTAINER_ID")
    if container:
        text += f"-{container}"
    if salt:
        text += f"-{salt}"
    return f"{hostname.split('.')[0]}-{hashlib.md5(text.encode('utf-8')).hexdigest()}"


def get_available_devices() -> list[str]:
    """The GPU addresses Spark assigned to this worker's task (``[]`` without GPU scheduling)."""
    value = os.environ.get(GPUS_ENV, "")
    return [d for d in value.split(",") if d]


class _StreamSink:
    """One stream's lines (already ``[rank]<stream>:`` prefixed), into the task's :class:`Outbox`."""

    def __init__(self, stream: str, outbox: Outbox) -> None:
        self.stream = stream
        self.outbox = outbox

    def write(self, text: str) -> None:
        self.outbox.add(self.stream, text)


class Outbox:
    """Output of both streams in arrival order; a thread PUTs it under ``key(seq)`` every 0.1 s (or when a chunk
    is full), so the driver can print it with prefixes.  ``who`` names the sender in an error."""

    def __init__(self, client: Any, key: Callable[[int], str], who: str) -> None:
        self._client = client
        self._key = key
        self._who = who
        self._items: list[list[str]] = []
        self._size = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="horovod-spark-output", daemon=True)
        self._thread.start()

    def add(self, stream: str, text: str) -> None:
        with self._lock:
            if self._items and self._items[-1][0] == stream:
                self._items[-1][1] += text
            else:
                self._items.append([stream, text])
            self._size += len(text)
            full = self._size >= OUTPUT_CHUNK_BYTES
        if full:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            items, self._items, self._size = self._items, [], 0
            if not items:
                return
            seq, self._seq = self._seq, self._seq + 1
            try:  # under the lock: chunks must arrive in sequence order
                self._client.put(self._key(seq), json.dumps(items).encode("utf-8"))
            except Exception as e:  # noqa: BLE001 - the driver is gone: output has nowhere to go
                sys.stderr.write(f"horovod.spark: could not forward {self._who}'s output: {e}\n")

    def _loop(self) -> None:
        while not self._stop.wait(OUTPUT_FLUSH_SECONDS):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.flush()


def _python_path() -> str:
    """The worker's PYTHONPATH: this horovod first, then what the task can import (``--py-files``, addFile)."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    system = {os.path.realpath(p) for key, p in sysconfig.get_paths().items()
              if key in ("stdlib", "platstdlib", "purelib", "platlib") and p}
    parts = [package_parent]
    for p in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]:
        if not p or p in parts:
            continue
        real = os.path.realpath(p)
        if real in system or any(real.startswith(s + os.sep) for s in system):
            continue
        parts.append(p)
    return os.pathsep.join(parts)


def user_env(settings: TaskSettings) -> dict[str, str]:
    """The executor's environment without any job credentials, then the user's ``env`` (``None`` deletes)."""
    from horovod.base import auth

    env = dict(os.environ)
    for name in (auth.SECRET_KEY_ENV, "_HOROVOD_SECRET_KEY", "HOROVOD_TLS", "HOROVOD_TLS_CERT", "HOROVOD_TLS_KEY"):
        env.pop(name, None)
    for k, v in settings.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _worker_env(settings: TaskSettings, assignment: dict[str, Any], gpus: list[str], result_file: str,
                error_file: str) -> dict[str, str]:
    """The worker's environment: the executor's, then the user's ``env``, then the launcher contract."""
    from horovod.base import auth
    from horovod.runner.hosts import SlotInfo

    env = user_env(settings)
    slot = SlotInfo(**assignment["slot"])
    env.update(slot.to_env())
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": settings.addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(settings.port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_START_TIMEOUT": str(assignment["start_timeout"]),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": _python_path(),
        "HOROVOD_SPARK_WORK_DIR": os.getcwd(),  # where the worker runs (upstream: the driver's directory)
        auth.SECRET_KEY_ENV: settings.key.hex(),
        GPUS_ENV: ",".join(gpus),
        RESULT_ENV: result_file,
        ERROR_ENV: error_file,
    })
    if settings.nics:
        env["HOROVOD_GLOO_IFACE"] = settings.nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(settings.nics)
    if settings.tls_cert is not None:
        from horovod.transport import tls as tls_mod

        env.update(tls_mod.worker_env(tls_mod.JobCredentials(settings.tls_cert, settings.tls_key or b"")))
    return env


def _task_gpus(ctx: Any) -> list[str]:
    try:
        gpu = ctx.resources().get("gpu")
    except Exception:  # noqa: BLE001 - Spark without resource scheduling
        return []
    return list(gpu.addresses) if gpu is not None else []


def _wait_for_assignment(client: Any, index: int, deadline: float) -> dict[str, Any]:
    from horovod.transport.store import StoreError

    while True:
        try:
            return json.loads(client.get(assign_key(index), timeout=POLL_SECONDS))
        except StoreError as e:
            if not str(e).startswith("timed out waiting"):
                raise
        if _aborted(client):
            raise RuntimeError("horovod.spark.run: the driver aborted the job before the workers started")
        if time.monotonic() > deadline:
            raise RuntimeError("horovod.spark.run: no rank assignment from the driver within start_timeout")


def _aborted(client: Any) -> bool:
    return client.exists(ABORT_KEY)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def task_fn(settings: TaskSettings, index: int, iterator: Iterable[Any]) -> Iterator[tuple[int, bytes]]:
    """The body of Spark task ``index``: yields ``(rank, cloudpickle of the result or None)`` when its worker ended.

    A failed worker is reported to the driver (``spark/exit.<rank>``), which stops the other ranks through
    ``spark/abort``; the task then ends normally.

    Raises (failing the barrier stage, so Spark kills the other tasks):
        RuntimeError: the worker failed and the driver could not be told or is gone, the driver aborted
            before the workers started, or this is a retried attempt.
    """
    from pyspark import BarrierTaskContext

    from horovod.runner import spawn
    from horovod.runner.output import forward_stream
    from horovod.transport.store import StoreClient, StoreError

    ctx = BarrierTaskContext.get()
    client = StoreClient(settings.addr, settings.port, settings.key, timeout=30.0, tls=settings.job_tls())
    if ctx.attemptNumber() > 0 or client.exists(task_key(index)):
        # A rerun (task or barrier stage retried) would join no job: the driver assigns ranks once.
        raise RuntimeError("horovod.spark.run does not retry tasks: the Horovod job already failed in an "
                           "earlier attempt of this task (see the driver's error)")
    gpus = _task_gpus(ctx)
    client.put(task_key(index), json.dumps({
        "host": host_hash(), "hostname": socket.gethostname(), "pid": os.getpid(),
        "task_attempt_id": ctx.taskAttemptId(), "gpus": gpus}).encode())
    assignment = _wait_for_assignment(client, index, time.monotonic() + settings.start_timeout + 30)
    rank = assignment["slot"]["rank"]
    with tempfile.TemporaryDirectory(prefix="horovod-spark-") as tmp:
        result_file, error_file = os.path.join(tmp, "result"), os.path.join(tmp, "error")
        env = _worker_env(settings, assignment, gpus, result_file, error_file)
        command = [settings.executable or sys.executable, "-m", "horovod.spark._worker"]
        outbox = Outbox(client, functools.partial(output_key, rank), f"rank {rank}")
        proc = spawn.spawn_local(spawn.WorkerSpec(rank=rank, command=command, env=env, cwd=os.getcwd()))
        readers = []
        for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            sink = _StreamSink(name, outbox)
            t = threading.Thread(target=_forward, args=(forward_stream, stream, sink, rank, name, settings.timestamp),
                                 name=f"horovod-spark-{name}", daemon=True)
            t.start()
            readers.append(t)
        aborted = lost = False
        unreachable_since: float | None = None
        try:
            while proc.poll() is None:
                try:
                    proc.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    pass
                try:
                    aborted = _aborted(client)
                    unreachable_since = None
                except StoreError:
                    unreachable_since = unreachable_since or time.monotonic()
                    lost = time.monotonic() - unreachable_since > DRIVER_LOST_SECONDS
                if aborted or lost:
                    spawn.terminate_workers([proc])
                    break
        finally:
            stop_worker(proc)  # interrupted (Spark killed this task's thread): leave nothing behind
        code = reap_worker(proc, readers, outbox)
        error = _read(error_file)
        result = _read(result_file)
    if code == 0 and result is None:
        code, error = 1, b"the worker exited 0 without storing a result"
    why = "the driver aborted the job" if aborted else "the driver is unreachable" if lost else None
    text = (error or b"").decode("utf-8", "replace") or why
    # A worker that stored its own error failed by itself, even if the abort then found it still exiting.
    if _record_exit(client, rank, index, code, text, aborted and error is None) and not lost:
        # The driver knows (and stops the other ranks): end this task normally, without Spark's error noise.
        yield rank, result if code == 0 else None
        return
    if code == 0:
        yield rank, result
        return
    raise RuntimeError(f"Horovod rank {rank} (Spark task {index}) exited with code {code}"
                       + (f": {why}" if why else ""))


def stop_worker(proc: subprocess.Popen) -> None:
    """End a task's worker if it still runs, and close its stdin (the end of the task's supervision)."""
    from horovod.runner import spawn

    if proc.poll() is None:
        spawn.terminate_workers([proc])
    if proc.stdin is not None:
        proc.stdin.close()


def reap_worker(proc: subprocess.Popen, readers: list[threading.Thread], outbox: Outbox) -> int:
    """The worker's exit code, once its output has been forwarded to the driver."""
    code = proc.wait()
    for t in readers:
        t.join(timeout=5)
    outbox.close()
    return code


def _forward(forward_stream: Any, stream: Any, sink: Any, rank: int, name: str, timestamp: bool) -> None:
    try:
        forward_stream(stream, sink, rank, name, timestamp=timestamp)
    finally:
        stream.close()


def _record_exit(client: Any, rank: int, index: int, code: int, error: str | None, aborted: bool) -> bool:
    """Tell the driver how the worker ended; False if the driver could not be told."""
    try:
        client.put(exit_key(rank), json.dumps({"rank": rank, "index": index, "code": code, "error": error,
                                                "aborted": aborted, "time": time.time()}).encode())
        return True
    except Exception as e:  # noqa: BLE001 - the driver learns it from Spark's failure instead
        sys.stderr.write(f"horovod.spark: could not report rank {rank}'s exit to the driver: {e}\n")
        return False
