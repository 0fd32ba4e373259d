"""Run a command under ``python -m horovod.runner`` from the tests, with a hard timeout and no leftovers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "HOROVOD_TEST_JOB_MARKER"


def clean_env(**extra: str) -> dict[str, str]:
    """The parent's environment without launcher/Horovod variables (the outer run may itself be a rank)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_COMM_WORLD", "PMI_"))}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


@contextlib.contextmanager
def local_ray_driver_env():
    """The environment a test's local Ray cluster starts its actors with (they inherit the driver's): no
    ``HOROVOD_*`` variable of the outer run, this tree on ``PYTHONPATH``, one OpenMP thread; restored after."""
    saved = dict(os.environ)
    for k in [k for k in os.environ if k.startswith("HOROVOD_")]:
        del os.environ[k]
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def launch(np_: int, command: list[str], *, env: dict[str, str] | None = None, timeout: float = 240.0):
    """``python -m horovod.runner -np N <command>``; returns (returncode, output, marker).

    On timeout the launcher's whole session is killed and the returncode is None."""
    marker = uuid.uuid4().hex
    full_env = dict(env if env is not None else clean_env())
    full_env[MARKER] = marker
    proc = subprocess.Popen([sys.executable, "-m", "horovod.runner", "-np", str(np_), *command], cwd=REPO,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, marker
    except subprocess.TimeoutExpired:
        kill_marked(marker)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return None, out, marker


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(MARKER) == marker:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def kill_marked(marker: str) -> None:
    for p in marked_processes(marker):
        try:
            p.kill()
        except psutil.Error:
            pass


def signal_once_ready(launcher: subprocess.Popen, ready, sig: int, timeout: float = 30.0) -> tuple[float, str]:
    """Send ``sig`` to ``launcher`` once the file ``ready`` (a pathlib.Path) exists; return how long the launcher
    then took to exit and its stderr (it is killed if still running)."""
    import time

    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        launcher.send_signal(sig)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=timeout)
        return time.monotonic() - start, err
    finally:
        if launcher.poll() is None:
            launcher.kill()
