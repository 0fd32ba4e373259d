"""``kill -9`` of the launcher leaves no local worker behind, nor anything the worker started.

Every local worker runs under the launcher's watchdog (``horovod/runner/_watchdog.py``), which holds a
pipe from the launcher: when the launcher dies the pipe closes and the watchdog ends the worker's whole
process group.  The workers here never call ``hvd.init()`` -- the guarantee must not depend on Horovod
running inside them -- and each starts a child, so grandchildren are checked too.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import MARKER, REPO, clean_env, kill_marked  # noqa: E402

from horovod.runner.spawn import ORPHAN_GRACE  # noqa: E402

GONE_WITHIN = 5.0
"""Seconds after ``kill -9`` of the launcher by which every worker process must be gone."""

WORKER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "ignore-term":          # a worker (and its child) that will not stop on SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    rank = os.environ.get("HOROVOD_RANK", "x")
    # the worker, its child, and its parent: the shell of `sh -c ...`, or the launcher's watchdog
    pids = [os.getpid(), child.pid, os.getppid()]
    tmp = os.path.join(out, f".{rank}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(" ".join(map(str, pids)))
    os.rename(tmp, os.path.join(out, f"pids.{rank}.{os.getpid()}"))
    if mode == "exit-leaving-child":
        sys.exit(0)
    time.sleep(300)
""")


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, within):
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _read_pids(out, count, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(f for f in os.listdir(out) if f.startswith("pids."))
        if len(files) >= count:
            return [int(p) for f in files for p in open(os.path.join(out, f)).read().split()]
        time.sleep(0.05)
    raise AssertionError(f"only {os.listdir(out)} of {count} workers reported their pids in {timeout} s")


def _start(argv, tmp_path):
    with open(tmp_path / "launcher.log", "wb") as log:
        return subprocess.Popen(argv, cwd=REPO, env=clean_env(**{MARKER: tmp_path.name}), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)


def _kill_launcher_and_check(launcher, pids, within, tmp_path):
    assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
    assert all(_alive(p) for p in pids), "a worker died before the launcher was killed"
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    killed = time.monotonic()
    alive = _wait_gone(pids, within)
    assert not alive, (f"still running {time.monotonic() - killed:.1f} s after kill -9 of the launcher: "
                       f"{[(p, psutil.Process(p).cmdline()) for p in alive if _alive(p)]}")


@pytest.fixture
def job(tmp_path):
    """Runs the launcher; whatever happens, nothing the test started survives it."""
    out = tmp_path / "pids"
    out.mkdir()
    started = []

    def run(argv, count):
        launcher = _start(argv, tmp_path)
        started.append(launcher)
        return launcher, _read_pids(str(out), count)

    yield run, str(out)
    for launcher in started:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    kill_marked(tmp_path.name)


def _worker(out, mode="sleep"):
    return [sys.executable, "-c", WORKER, out, mode]


def test_plain_command(job, tmp_path):
    run, out = job
    launcher, pids = run([sys.executable, "-m", "horovod.runner", "-np", "2", *_worker(out)], 2)
    assert len(pids) == 6
    _kill_launcher_and_check(launcher, pids, GONE_WITHIN, tmp_path)


def test_shell_wrapped_command(job, tmp_path):
    run, out = job
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    line = f"{sys.executable} {script} {out} sleep"
    launcher, pids = run([sys.executable, "-m", "horovod.runner", "-np", "3", "sh", "-c", line], 3)
    assert len(pids) == 9
    shells = {p for p in pids if _alive(p) and psutil.Process(p).name() in ("sh", "dash", "bash")}
    assert len(shells) == 3, "the workers' parents should be the shells"
    _kill_launcher_and_check(launcher, pids, GONE_WITHIN, tmp_path)


def test_shell_line_command(job, tmp_path):
    """A single-word command with spaces runs via /bin/sh -c inside the launcher (`horovodrun -np 2 "..."`)."""
    run, out = job
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    line = f"{sys.executable} {script} {out} sleep; echo unreachable"
    launcher, pids = run([sys.executable, "-m", "horovod.runner", "-np", "2", line], 2)
    _kill_launcher_and_check(launcher, pids, GONE_WITHIN, tmp_path)


def test_workers_that_ignore_sigterm(job, tmp_path):
    """SIGTERM first, then SIGKILL after the watchdog's grace period: stubborn workers go too."""
    run, out = job
    launcher, pids = run([sys.executable, "-m", "horovod.runner", "-np", "2", *_worker(out, "ignore-term")], 2)
    _kill_launcher_and_check(launcher, pids, ORPHAN_GRACE + GONE_WITHIN, tmp_path)


def test_horovod_run(job, tmp_path):
    """``horovod.run()`` inside a Python program that is killed: its workers go with it."""
    run, out = job
    program = textwrap.dedent(f"""
        import os, sys, time
        import horovod

        def fn():
            sys.argv = ["worker", {out!r}, "sleep"]
            exec(compile({WORKER!r}, "worker", "exec"), {{"__name__": "worker"}})

        horovod.run(fn, np=2)
    """)
    launcher, pids = run([sys.executable, "-c", program], 2)
    _kill_launcher_and_check(launcher, pids, GONE_WITHIN, tmp_path)


def test_elastic_driver(job, tmp_path):
    run, out = job
    launcher, pids = run([sys.executable, "-m", "horovod.runner", "-np", "2", "--min-np", "2",
                          "-H", "localhost:1,127.0.0.1:1", *_worker(out)], 2)
    _kill_launcher_and_check(launcher, pids, GONE_WITHIN, tmp_path)


def test_child_left_behind_by_a_finished_worker_is_ended(tmp_path):
    """A worker that exits 0 while its child still runs: the job ends and so does the child."""
    out = tmp_path / "pids"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2",
                           *_worker(str(out), "exit-leaving-child")],
                          cwd=REPO, env=clean_env(**{MARKER: tmp_path.name}), capture_output=True, text=True,
                          timeout=120)
    try:
        assert proc.returncode == 0, proc.stderr
        pids = _read_pids(str(out), 2, timeout=1)
        children = pids[1::3]
        assert len(children) == 2
        assert not _wait_gone(children, GONE_WITHIN)
    finally:
        kill_marked(tmp_path.name)


def test_a_stopped_worker_goes_at_once_when_its_watchdog_is_orphaned():
    """A SIGSTOPped worker (a hung remote worker whose ssh connection the driver closed) cannot act on SIGTERM
    until it is resumed: the watchdog sends SIGCONT with it, so the worker ends at once instead of after the
    grace period (here 60 s) and SIGKILL."""
    from horovod.runner.spawn import WATCHDOG_PATH

    cfg = {"command": [sys.executable, "-c", "import time; time.sleep(300)"], "grace": 60, "local": False}
    watchdog = subprocess.Popen([sys.executable, "-I", WATCHDOG_PATH], stdin=subprocess.PIPE,
                                env=clean_env(), start_new_session=True)
    worker = None
    try:
        watchdog.stdin.write((json.dumps(cfg) + "\n").encode())
        watchdog.stdin.flush()
        deadline = time.monotonic() + 30
        while not psutil.Process(watchdog.pid).children():
            assert time.monotonic() < deadline, "the watchdog started no worker"
            time.sleep(0.05)
        worker = psutil.Process(watchdog.pid).children()[0]
        os.kill(worker.pid, signal.SIGSTOP)
        watchdog.stdin.close()  # the lifeline: the launcher (or ssh) is gone
        started = time.monotonic()
        assert watchdog.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - started < 10, "the stopped worker waited out the grace period"
        assert not _wait_gone([worker.pid], 5)
    finally:
        if watchdog.poll() is None:
            os.killpg(watchdog.pid, signal.SIGKILL)
            watchdog.wait()
        if worker is not None:  # a group of its own (a remote worker's): the watchdog's group kill misses it
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass
