"""Elastic jobs across network-namespace hosts over ssh (see conftest.py and .ci/netns_hosts.sh).

The job is tests/elastic/worker_numpy.py under tests/elastic/conftest.py's ``ElasticJob`` harness (a
discovery script printing a hosts file the test rewrites), so every test checks the exact outcome: final
weights and per-sample counts equal to a fault-free run.  Workers on hvdh2/hvdh3 (and hvdh1 from the root
namespace) are started by the elastic driver's ``SshSpawner``; each test proves that a worker ran in the
namespace of its host and that no worker nor remote ssh wrapper is left in any namespace afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

pytestmark = pytest.mark.timeout(120)

_spec = importlib.util.spec_from_file_location("_elastic_harness", os.path.join(REPO, "tests", "elastic",
                                                                                "conftest.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

NAMESPACES = ("hvdh1", "hvdh2", "hvdh3", "hvdh4")


def _ns_inodes() -> dict[int, str]:
    found = {}
    for ns in NAMESPACES:
        try:
            found[os.stat(f"/run/netns/{ns}").st_ino] = ns
        except OSError:
            pass
    return found


def namespace_of(pid: int) -> str | None:
    """The network namespace (host) a process runs in; None for the root namespace."""
    try:
        return _ns_inodes().get(os.stat(f"/proc/{pid}/ns/net").st_ino)
    except OSError:
        return None


class Tracker:
    """Remembers every worker of a job and its parent (the remote ssh wrapper) while the job runs."""

    def __init__(self, job) -> None:
        self.job = job
        self.seen: dict[int, tuple[str, str | None]] = {}  # pid -> (what, namespace)

    def scan(self) -> None:
        for p in self.job.leftovers():
            try:
                cmdline = " ".join(p.cmdline())
                if "worker_numpy.py" not in cmdline or "horovod.runner" in cmdline:  # not the launcher
                    continue
                self.seen.setdefault(p.pid, ("worker", namespace_of(p.pid)))
                parent = p.parent()
                if parent is not None and "kill_group" in " ".join(parent.cmdline()):
                    self.seen.setdefault(parent.pid, ("ssh wrapper", namespace_of(parent.pid)))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass

    def wait_steps(self, steps: int, size: int | None = None, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.scan()
            try:
                self.job.wait_steps(steps, timeout=0.3, size=size)
                self.scan()
                return
            except AssertionError:
                if self.job.proc.poll() is not None or time.monotonic() > deadline:
                    raise

    def namespaces(self, what: str) -> set[str | None]:
        return {ns for w, ns in self.seen.values() if w == what}

    def assert_nothing_left(self) -> None:
        """No tracked process alive, and no process of the job (by its marker) in any namespace."""
        deadline = time.monotonic() + 15
        while True:
            alive = []
            for pid, (what, ns) in self.seen.items():
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        alive.append((pid, what, ns))
                except psutil.NoSuchProcess:
                    pass
            marked = [(p.pid, namespace_of(p.pid)) for p in self.job.leftovers()]
            if not alive and not marked:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"left behind: tracked {alive}, marked {marked}")
            time.sleep(0.1)


def _job(elastic_job, netns_hosts, hosts, args, *, in_ns: str | None, **kwargs):
    prefix = ["ip", "netns", "exec", in_ns] if in_ns else None
    return elastic_job(hosts, [*netns_hosts.ssh_args(), *args], prefix=prefix, **kwargs)


@pytest.fixture
def elastic_job(tmp_path):
    jobs = []

    def start(*args, **kwargs):
        job = harness.ElasticJob(Path(tmp_path), *args, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.stop()


def test_remote_worker_killed(netns_hosts, elastic_job):
    """Launcher inside hvdh1, workers on hvdh2 and hvdh3; kill -9 of the hvdh3 worker mid-epoch."""
    job = _job(elastic_job, netns_hosts, ["hvdh2:1", "hvdh3:1"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
               in_ns="hvdh1", sleep_after_resize=0.0)
    tracker = Tracker(job)
    tracker.wait_steps(5, size=2)
    victim = job.pid("hvdh3:0")
    assert namespace_of(victim) == "hvdh3"
    os.kill(victim, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    result = job.assert_exact()
    assert result["sizes"] == [2, 1], result
    out = job.output()
    assert "blacklisting host hvdh3" in out and "generation 1: 1 worker on hvdh2" in out, out
    assert tracker.namespaces("worker") == {"hvdh2", "hvdh3"}
    assert tracker.namespaces("ssh wrapper") == {"hvdh2", "hvdh3"}
    tracker.assert_nothing_left()


def test_remote_host_removed_then_added(netns_hosts, elastic_job):
    """Launcher on the bridge (root namespace), hosts by address: .13 leaves discovery, then .11 joins."""
    h1, h2, h3 = (f"10.213.0.{n}" for n in (11, 12, 13))
    job = _job(elastic_job, netns_hosts, [f"{h2}:1", f"{h3}:1"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
               in_ns=None, samples=64, sleep=0.1)
    tracker = Tracker(job)
    tracker.wait_steps(4, size=2)
    job.set_hosts([f"{h2}:1"])
    _, steps, _ = job.progress()
    tracker.wait_steps(steps + 2, size=1)
    job.set_hosts([f"{h2}:1", f"{h1}:1"])
    _, steps, _ = job.progress()
    tracker.wait_steps(steps + 2, size=2)
    assert job.wait() == 0, job.output()
    result = job.assert_exact()
    assert result["sizes"] == [2, 1, 2], result
    out = job.output()
    assert "removed from elastic job" in out, out
    assert tracker.namespaces("worker") == {"hvdh1", "hvdh2", "hvdh3"}
    assert tracker.namespaces("ssh wrapper") == {"hvdh1", "hvdh2", "hvdh3"}
    tracker.assert_nothing_left()


def test_remote_worker_hung(netns_hosts, elastic_job):
    """A SIGSTOPped worker on hvdh3: the driver kills its ssh client and the remote wrapper kills the worker."""
    job = _job(elastic_job, netns_hosts, ["hvdh2:1", "hvdh3:1"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
               in_ns="hvdh1", sleep_after_resize=0.0)
    tracker = Tracker(job)
    tracker.wait_steps(5, size=2)
    victim = job.pid("hvdh3:0")
    assert namespace_of(victim) == "hvdh3"
    os.kill(victim, signal.SIGSTOP)
    started = time.monotonic()
    assert job.wait() == 0, job.output()
    assert time.monotonic() - started < 60
    assert job.assert_exact()["sizes"] == [2, 1]
    assert "hung?" in job.output()
    tracker.assert_nothing_left()
