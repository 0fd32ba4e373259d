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


def test_pytorch_example_survives_kill(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    tag = str(tmp_path)
    env = dict(os.environ, **FAST_ENV, TEST_TAG=tag)
    cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", f"cat {hosts}", sys.executable,
           str(REPO / "examples" / "elastic" / "pytorch_elastic.py"), "--samples", "192", "--epochs", "3",
           "--step-sleep", "0.2", "--lr", "0.01"]
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Kill one of the two workers as soon as the first epoch is done: two epochs (>= 2.4 s of steps) remain,
        # so the kill always lands mid-training however slow the start-up was.
        deadline = time.monotonic() + 90
        victim = None
        while time.monotonic() < deadline and victim is None and proc.poll() is None:
            workers = [p for p, cmdline in _tagged(tag) if "horovod.runner" not in cmdline]
            if len(workers) == 2 and b"epoch 0 done on 2 workers" in log.read_bytes():
                victim = max(workers, key=lambda p: p.pid)
            time.sleep(0.05)
        assert victim is not None, log.read_text()
        victim.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "every sample used exactly 3 times: True" in text, text[-4000:]
    assert "generation 1: 1 worker" in text, text[-4000:]
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _tagged(tag)
