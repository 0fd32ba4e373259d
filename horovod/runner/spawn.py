"""Starting workers and watching them until the job ends.

The supervisor is independent of *where* a worker runs: it takes a spawner, a callable that turns a
:class:`WorkerSpec` into a running ``subprocess.Popen`` whose stdout/stderr are pipes.  :func:`spawn_local`
starts the command on this host; a remote spawner (ssh) returns the ``Popen`` of its ssh client the same
way and gets the same output forwarding and failure handling.

Every worker runs in its own session (process group), so that on failure or Ctrl-C the whole tree of each
worker -- including processes it started -- is terminated: SIGTERM to the group, a grace period, SIGKILL.

A local worker runs under a watchdog process (:mod:`horovod.runner._watchdog`, a few lines of standalone
Python started as ``python -I <path>``) that leads the worker's process group and holds a pipe from the
launcher (its stdin).  When that pipe closes while the worker runs -- the launcher was killed, even with
SIGKILL, so nobody else would clean up -- the watchdog terminates the whole group (SIGTERM,
:data:`ORPHAN_GRACE` seconds, SIGKILL), grandchildren included, whatever the command is.  It is otherwise
invisible: the worker inherits its stdout/stderr pipes, the group's signals reach the worker directly, and
the watchdog exits with the worker's status (dying of the same signal).  When the worker exits, what it
left running in its group is killed.  Remote workers run under the same script over ssh
(:mod:`horovod.runner.ssh`), there with the worker in a group of its own.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO

from horovod.base.exceptions import follows_from_another_rank
from horovod.runner.output import OutputSink, forward_stream, make_output_dir, rank_dir_name

__all__ = ["WorkerSpec", "JobFailure", "spawn_local", "run_workers", "failure_message", "exit_status",
           "TERMINATE_GRACE", "WATCHDOG_PATH", "watchdog_source", "ORPHAN_GRACE"]

logger = logging.getLogger(__name__)

TERMINATE_GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL when workers are stopped."""

CAUSE_GRACE = 3.0
"""Seconds the launcher waits, after a worker failed only because another rank did (its last error a
``ShutdownError`` naming that rank), for the rank that caused it to exit, so the summary names the cause.  The wait
ends early once every rank left is stopped (SIGSTOP): none of them can exit."""

_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Mismatch|Failure|Interrupt))(?::|$)")

ORPHAN_GRACE = max(1.0, TERMINATE_GRACE - 1.0)
"""Seconds the watchdog gives its worker between SIGTERM and SIGKILL once the launcher is gone (less than
:data:`TERMINATE_GRACE`, so a launcher that closes the pipe and then signals never races it)."""

WATCHDOG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_watchdog.py")
"""The standalone script every worker runs under (:mod:`horovod.runner._watchdog`)."""


@functools.lru_cache(maxsize=1)
def watchdog_source() -> str:
    """The watchdog's text, for hosts where it runs with ``python -c`` (ssh)."""
    with open(WATCHDOG_PATH, encoding="utf-8") as f:
        return f.read()


@dataclasses.dataclass
class WorkerSpec:
    """One worker to start: its rank, command (a string runs via ``/bin/sh -c``) and full environment."""

    rank: int
    command: str | Sequence[str]
    env: dict[str, str]
    hostname: str = "localhost"
    cwd: str | None = None


Spawner = Callable[[WorkerSpec], subprocess.Popen]


def failure_message(rank: int, exit_code: int) -> str:
    """Upstream's text for the first worker that failed."""
    return ("Horovod detected that one or more processes exited with non-zero status, thus causing the job "
            f"to be terminated. The first process to do so was:\nProcess name: {rank}\nExit code: "
            f"{exit_code}\n")


def exit_status(returncode: int) -> int:
    """A worker's exit status as upstream's launcher reports it: ``Popen.returncode``, except 128+N for a
    process killed by signal N (137 for SIGKILL), as a shell reports it.

    Upstream's local launcher reports what its middleman process exits with, which turns the negative
    returncode of a signal into 128+N; a rank on another host is reported with ssh's status, 128+N as well.
    """
    return 128 - returncode if returncode < 0 else returncode


class JobFailure(RuntimeError):
    """A worker exited non-zero (or was killed by a signal); ``str()`` is upstream's message."""

    def __init__(self, rank: int, exit_code: int) -> None:
        exit_code = exit_status(exit_code)
        super().__init__(failure_message(rank, exit_code))
        self.rank = rank
        self.exit_code = exit_code

    @property
    def shell_exit_code(self) -> int:
        """The launcher's own exit status: the worker's (128+signal for a signal), 1 where that is out of range."""
        return self.exit_code if 0 < self.exit_code < 256 else 1


class Interrupted(RuntimeError):
    """The launcher was asked to stop (Ctrl-C, SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"horovodrun interrupted by {_signal_name(signum)}; all workers terminated")
        self.signum = signum


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def spawn_local(spec: WorkerSpec) -> subprocess.Popen:
    """Start ``spec`` on this host under the watchdog in a new session, with piped stdout/stderr.

    The returned process is the watchdog: it leads the group, and exits with the worker's status.  Its
    stdin stays open for the launcher's lifetime; closing it (or the launcher dying) ends the worker.

    Raises:
        FileNotFoundError: the command's program does not exist (as ``subprocess.Popen`` would).
    """
    command = spec.command if isinstance(spec.command, str) else list(spec.command)
    if not isinstance(command, str):
        _check_program(command[0], spec.env, spec.cwd)
    proc = subprocess.Popen([sys.executable, "-I", WATCHDOG_PATH], env=spec.env, cwd=spec.cwd,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps({"command": command, "grace": ORPHAN_GRACE, "local": True}).encode() + b"\n")
        proc.stdin.flush()
    except BrokenPipeError:  # the watchdog died at start; its exit status and stderr tell why
        pass
    return proc


def _check_program(program: str, env: dict[str, str], cwd: str | None) -> None:
    """Raise as ``Popen`` (execvp) would: the watchdog would only report a bad program through its exit status.

    Raises:
        FileNotFoundError: no such file (on ``PATH`` for a bare name).
        IsADirectoryError: the path names a directory.
        PermissionError: the file exists but is not executable (on ``PATH``: only such files were found).
    """
    if os.sep in program:
        candidates = [program if os.path.isabs(program) else os.path.join(cwd or os.getcwd(), program)]
    else:
        if shutil.which(program, path=env.get("PATH", os.defpath)) is not None:
            return
        candidates = [os.path.join(d or os.curdir, program) for d in env.get("PATH", os.defpath).split(os.pathsep)]
    existing = [p for p in candidates if os.path.exists(p)]
    if not existing:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if os.sep in program and os.path.isdir(existing[0]):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), program)
    if not any(os.access(p, os.X_OK) and not os.path.isdir(p) for p in existing):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the worker leads its own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def terminate_workers(procs: Sequence[subprocess.Popen], grace: float = TERMINATE_GRACE) -> None:
    """SIGTERM every worker's process group, wait up to ``grace`` seconds, then SIGKILL the groups.

    A process with a ``soft_terminate()`` method (the ssh client of a remote worker) is asked with it
    instead of SIGTERM, so that the remote side stops the worker's group before ssh exits.
    """
    for proc in procs:
        soft = getattr(proc, "soft_terminate", None)  # remote workers: close the ssh connection's stdin
        if soft is not None:
            soft()
        else:
            _signal_group(proc, signal.SIGTERM)
            _signal_group(proc, signal.SIGCONT)  # a stopped (SIGSTOP) worker acts on SIGTERM only once resumed
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        # Also reaches children left in the group after the worker itself exited.
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.error("worker pid %d did not exit after SIGKILL", proc.pid)


@dataclasses.dataclass
class OutputOptions:
    """Where workers' output goes."""

    prefix_timestamp: bool = False
    output_dir: str | None = None
    stdout: OutputSink | None = None
    stderr: OutputSink | None = None


def open_output_files(options: OutputOptions, rank: int, num_proc: int,
                      mode: str = "wb") -> tuple[BinaryIO, BinaryIO] | None:
    """``--output-filename``: ``DIR/rank.<rank>/{stdout,stderr}``, or None without an output directory.

    Raises:
        ValueError: a directory or file cannot be created (the text names the option and the path).
    """
    if not options.output_dir:
        return None
    rank_dir = make_output_dir(options.output_dir, rank_dir_name(rank, num_proc))
    opened: list[BinaryIO] = []
    try:
        for name in ("stdout", "stderr"):
            path = os.path.join(rank_dir, name)
            opened.append(open(path, mode))
    except OSError as e:
        for f in opened:
            f.close()
        raise ValueError(f"--output-filename {options.output_dir}: cannot write {path}: "
                         f"{e.strerror or e}") from None
    return opened[0], opened[1]


def run_workers(specs: Sequence[WorkerSpec], spawner: Spawner = spawn_local,
                output: OutputOptions | None = None, stop_event: threading.Event | None = None,
                on_exit: Callable[[int, int], None] | None = None) -> None:
    """Start every worker, forward its output, and wait until all exit.

    Returns when every worker exited 0.  When one exits non-zero the others are terminated and
    :class:`JobFailure` names the first to fail.  If ``stop_event`` is set (the CLI's SIGTERM handler) or
    the caller is interrupted (KeyboardInterrupt), every worker is terminated before this returns/raises.

    Raises:
        JobFailure: a worker failed.
        Interrupted: ``stop_event`` was set.
    """
    output = output or OutputOptions()
    out_sink = output.stdout or OutputSink(sys.stdout)
    err_sink = output.stderr or OutputSink(sys.stderr)
    num_proc = len(specs)
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    err_readers: dict[int, threading.Thread] = {}
    last_errors: dict[int, str] = {}  # rank -> the last exception line of its stderr ("ShutdownError: ...")
    exits: queue.Queue[tuple[int, int]] = queue.Queue()

    def error_lines_of(rank: int) -> Callable[[str], None]:
        def seen(line: str) -> None:
            match = _EXCEPTION_LINE.match(line)
            if match:
                last_errors[rank] = match.group(1) + line[match.end(1):].rstrip()
        return seen

    def wait_for(rank: int, proc: subprocess.Popen) -> None:
        exits.put((rank, exit_status(proc.wait())))  # 137 for SIGKILL, here as over ssh (and upstream)

    try:
        for spec in specs:
            opened = open_output_files(output, spec.rank, num_proc)
            try:
                proc = spawner(spec)
            except BaseException:
                for f in opened or ():
                    f.close()
                raise
            procs.append(proc)
            for stream, sink, name, copy in ((proc.stdout, out_sink, "stdout", opened and opened[0]),
                                             (proc.stderr, err_sink, "stderr", opened and opened[1])):
                t = threading.Thread(target=_forward_and_close, args=(stream, sink, spec.rank, name),
                                     kwargs={"timestamp": output.prefix_timestamp, "copy_to": copy or None,
                                             "on_line": error_lines_of(spec.rank) if name == "stderr" else None},
                                     name=f"horovod-output-{spec.rank}-{name}", daemon=True)
                t.start()
                readers.append(t)
                if name == "stderr":
                    err_readers[spec.rank] = t
            threading.Thread(target=wait_for, args=(spec.rank, proc), name=f"horovod-wait-{spec.rank}",
                             daemon=True).start()

        failure: JobFailure | None = None
        failed: list[tuple[int, int]] = []  # (rank, code) in the order they exited
        cause_deadline = None
        remaining = num_proc
        by_rank = {spec.rank: proc for spec, proc in zip(specs, procs)}
        exited: set[int] = set()
        while remaining:
            if stop_event is not None and stop_event.is_set():
                raise Interrupted(getattr(stop_event, "signum", signal.SIGTERM))
            try:
                rank, code = exits.get(timeout=0.1)
            except queue.Empty:
                # The cause may still exit; not once every rank left is stopped (SIGSTOP): none of them can.
                if cause_deadline is not None and (time.monotonic() >= cause_deadline or _groups_stopped(
                        [proc.pid for r, proc in by_rank.items() if r not in exited])):
                    break
                continue
            exited.add(rank)
            remaining -= 1
            if on_exit is not None:
                on_exit(rank, code)
            if code != 0:
                failed.append((rank, code))
                if rank in err_readers:  # its last words: the pipe's EOF follows the exit closely
                    err_readers[rank].join(timeout=0.5)
                if not follows_from_another_rank(last_errors.get(rank, "")):
                    break
                # failed because another rank did: give that rank a moment to exit, and name it
                cause_deadline = cause_deadline or time.monotonic() + CAUSE_GRACE
        if failed:
            rank, code = next(((r, c) for r, c in failed if not follows_from_another_rank(last_errors.get(r, ""))),
                              failed[0])
            logger.error("Process %d exit with status code %d.", rank, code)
            logger.error("Terminating remaining workers after failure of Process %d.", rank)
            failure = JobFailure(rank, code)
        if failure is not None:
            terminate_workers(procs)
            _join_readers(readers)
            raise failure
        _join_readers(readers)
    except JobFailure:
        raise
    except BaseException:
        # Interrupted, KeyboardInterrupt, a spawn error: leave no worker behind.
        terminate_workers(procs)
        raise
    finally:
        for proc in procs:  # every worker has exited: release the watchdogs' lifelines
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass


def _groups_stopped(pgids: list[int]) -> bool:
    """Whether every worker under the watchdogs ``pgids`` is stopped: each group has a process besides its
    leader (the watchdog) and all of them are stopped (SIGSTOP).  One pass over ``/proc`` for all the groups;
    False where it cannot tell (a remote worker: the group is its ssh client's)."""
    wanted, stopped = set(pgids), set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return False
    for name in names:
        if not name.isdigit() or int(name) in wanted:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state, _ppid, group = f.read().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) not in wanted:
            continue
        if state not in ("T", "t"):
            return False
        stopped.add(int(group))
    return stopped == wanted


def _forward_and_close(src: BinaryIO, sink: OutputSink, rank: int, name: str, *, timestamp: bool,
                       copy_to: BinaryIO | None, on_line: Callable[[str], None] | None = None) -> None:
    # The reader owns its pipe and file: closing them from another thread could race a pending read.
    try:
        forward_stream(src, sink, rank, name, timestamp=timestamp, copy_to=copy_to, on_line=on_line)
    finally:
        src.close()
        if copy_to is not None:
            copy_to.close()


def _join_readers(readers: Sequence[threading.Thread], timeout: float = 2.0) -> None:
    # A grandchild may keep a pipe open after its worker exited; don't wait on it forever.
    deadline = time.monotonic() + timeout
    for t in readers:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
