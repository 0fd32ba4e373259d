"""The torch example under horovodrun with a worker killed mid-run: the job finishes, every sample once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .conftest import FAST_ENV, REPO

pytest.importorskip("torch")


def _tagged(tag: str) -> list[tuple[psutil.Process, str]]:
    """The example's live processes with their command lines (read once: a process may exit meanwhile)."""
    found = []
    for p in psutil.process_iter():
        try:
            cmdline = " ".join(p.cmdline())
            if p.environ().get("TEST_TAG") == tag and "pytorch_elastic.py" in cmdline:
                found.append((p, cmdline))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _run_example(tmp_path, hosts: str, np_: int, max_np: int, act, done_marker: bytes, samples: int = 192) -> str:
    """The example under the elastic launcher, ``hosts`` its first discovery output; once its log holds
    ``done_marker`` and all ``np_`` workers run, ``act(workers, hosts_file)`` (a kill, new hosts) is called
    once.  Returns the log of a job that succeeded with every sample used exactly 3 times and left nothing."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    tag = str(tmp_path)
    env = dict(os.environ, **FAST_ENV, TEST_TAG=tag)
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), "--min-np", "1", "--max-np", str(max_np),
           "--host-discovery-script", f"cat {hosts_file}", sys.executable,
           str(REPO / "examples" / "elastic" / "pytorch_elastic.py"), "--samples", str(samples), "--epochs", "3",
           "--step-sleep", "0.2", "--lr", "0.01"]
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Act as soon as the first epoch is done: two epochs (>= 2.4 s of steps) remain, so the action always
        # lands mid-training however slow the start-up was.
        deadline = time.monotonic() + 90
        acted = False
        while time.monotonic() < deadline and not acted and proc.poll() is None:
            workers = [p for p, cmdline in _tagged(tag) if "horovod.runner" not in cmdline]
            if len(workers) == np_ and done_marker in log.read_bytes():
                act(workers, hosts_file)
                acted = True
            time.sleep(0.05)
        assert acted, log.read_text()
        assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "every sample used exactly 3 times: True" in text, text[-4000:]
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _tagged(tag)
    return text


def test_pytorch_example_survives_kill(tmp_path):
    def kill_one(workers, _hosts_file):
        max(workers, key=lambda p: p.pid).send_signal(signal.SIGKILL)

    text = _run_example(tmp_path, "localhost:1\n127.0.0.1:1\n", 2, 2, kill_one, b"epoch 0 done on 2 workers")
    assert "generation 1: 1 worker" in text, text[-4000:]


def test_pytorch_example_grows_when_a_host_appears(tmp_path):
    """Two workers training with the DistributedOptimizer, then a third joins: every rank of the new generation
    checks its buckets' layout again (the old ones used to skip the check the new one sent: a stall, then the
    same stall in every later generation)."""
    def add_host(_workers, hosts_file):
        hosts_file.write_text("localhost:2\n127.0.0.1:1\n")

    # 12 steps of >= 0.2 s per epoch: the two epochs left give the new worker >= 4.8 s to start under load
    text = _run_example(tmp_path, "localhost:2\n", 2, 3, add_host, b"epoch 0 done on 2 workers", samples=384)
    assert "generation 1: 3 workers" in text, text[-4000:]
    assert "epoch 2 done on 3 workers" in text, text[-4000:]
