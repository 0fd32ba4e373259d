"""Harness of the elastic fault tests: a horovodrun job on two local "hosts" (``localhost``, ``127.0.0.1``).

The discovery script prints the test's hosts file (or fails while ``fail`` exists), so a test adds and
removes hosts by rewriting it.  Workers run ``worker_numpy.py``; see its docstring for the math.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

FAST_ENV = {
    "HOROVOD_ELASTIC_GRACE_SECONDS": "4",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "4",
    "HOROVOD_START_TIMEOUT": "20",
}


def expected(samples: int, epochs: int) -> tuple[np.ndarray, np.ndarray]:
    """The fault-free outcome: every sample once per epoch."""
    x = np.arange(samples, dtype=np.float64)
    g = np.stack([np.ones_like(x), x + 1, np.mod(x * 7, 5)], axis=1).sum(axis=0)
    return -epochs * g, np.full(samples, epochs)


class ElasticJob:
    """One ``horovodrun`` elastic job in ``tmp``; ``stop()`` always leaves nothing running."""

    def __init__(self, tmp: Path, hosts: list[str], args: list[str], *, samples: int = 48, batch: int = 2,
                 epochs: int = 2, sleep: float = 0.08, sleep_after_resize: float | None = None, resizes: int = 1,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None,
                 worker: str = "worker_numpy.py") -> None:
        """``sleep``: each step's pause, which gives a test the time to act mid-job; ``sleep_after_resize``: the
        pause once the world changed size ``resizes`` times (default ``sleep``), 0 where the test then only waits
        for the job's end."""
        self.tmp = tmp
        self.out = tmp / "out"
        self.out.mkdir()
        self.hosts_file = tmp / "hosts"
        self.fail_file = tmp / "fail"
        self.set_hosts(hosts)
        self.script = tmp / "discover.sh"
        self.script.write_text(f"#!/bin/sh\nif [ -f '{self.fail_file}' ]; then exit 3; fi\ncat '{self.hosts_file}'\n")
        self.script.chmod(0o755)
        self.samples, self.epochs = samples, epochs
        full_env = dict(os.environ)
        full_env.update(FAST_ENV)
        full_env.update({"TEST_OUT": str(self.out), "TEST_SAMPLES": str(samples), "TEST_BATCH": str(batch),
                         "TEST_EPOCHS": str(epochs), "TEST_STEP_SLEEP": str(sleep),
                         "TEST_STEP_SLEEP_AFTER_RESIZE": str(sleep_after_resize if sleep_after_resize is not None
                                                             else sleep),
                         "TEST_RESIZES": str(resizes),
                         "PYTHONPATH": str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")})
        full_env.update(env or {})
        self.log = open(tmp / "driver.log", "wb")
        # ``prefix``: run the launcher through it, e.g. ``ip netns exec hvdh1`` (tests/multihost).
        cmd = [*(prefix or []), sys.executable, "-m", "horovod.runner", *args,
               "--host-discovery-script", str(self.script), sys.executable, str(HERE / worker), str(self.out)]
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(tmp))

    def set_hosts(self, hosts: list[str]) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(h + "\n" for h in hosts))
        tmp.replace(self.hosts_file)

    def progress(self) -> tuple[int, int, int]:
        try:
            epoch, steps, size = (self.out / "progress").read_text().split()
            return int(epoch), int(steps), int(size)
        except (OSError, ValueError):
            return -1, 0, 0

    def wait_steps(self, steps: int, timeout: float = 60.0, size: int | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, done, current = self.progress()
            if done >= steps and (size is None or current == size):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended early ({self.proc.returncode}):\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"no progress to {steps} steps (at {self.progress()}):\n{self.output()}")

    def pid(self, slot: str) -> int:
        """The newest live worker process of ``slot``."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for path in sorted((self.out / "pids").glob(f"{slot}.*"), key=lambda p: p.stat().st_mtime,
                               reverse=True):
                pid = int(path.name.rsplit(".", 1)[1])
                if psutil.pid_exists(pid):
                    return pid
            time.sleep(0.05)
        raise AssertionError(f"no live worker for {slot}")

    def wait(self, timeout: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"job did not finish in {timeout} s:\n{self.output()}") from None

    def log_text(self) -> str:
        """The driver's whole log (launcher and every rank's output): what a test searches for a message,
        which a rank's long traceback after it must not push out of reach."""
        if not self.log.closed:  # stop() closed it (a job that did not finish in time)
            self.log.flush()
        return (self.tmp / "driver.log").read_text(errors="replace")

    def output(self) -> str:
        """The log's last 6000 characters, for assertion messages."""
        return self.log_text()[-6000:]

    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())

    def assert_exact(self) -> dict:
        result = self.result()
        w, counts = expected(self.samples, self.epochs)
        assert result["counts"] == counts.tolist(), result
        assert result["w"] == w.tolist(), result
        return result

    def leftovers(self) -> list[psutil.Process]:
        mine = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if str(self.out) in " ".join(p.info["cmdline"] or []):
                    mine.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return mine

    def assert_no_leftovers(self) -> None:
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.leftovers()
        assert not left, f"processes left behind: {[(p.pid, p.status()) for p in left]}"

    def stop(self) -> None:
        for p in self.leftovers():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def elastic_job(tmp_path):
    jobs: list[ElasticJob] = []

    def start(*args, **kwargs) -> ElasticJob:
        job = ElasticJob(tmp_path, *args, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.stop()
