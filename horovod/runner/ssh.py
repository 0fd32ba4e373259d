"""Remote workers over ssh: the reachability check and the spawner the supervisor plugs in.

Each remote worker is one ``ssh`` client process on the launcher's host.  On the remote host ssh runs a small
Python wrapper (the same interpreter path as the launcher's, as upstream assumes one environment on every
host) that reads the worker's description -- working directory, command, environment including the job key
-- as one JSON line from its stdin, so nothing secret shows up in ``ps`` on either host.  The wrapper starts
the worker in its own process group and keeps reading its stdin: end of file means the ssh connection is
gone (the launcher closed it, was killed, or the network broke), and the wrapper then terminates the whole
remote process group (SIGTERM, a grace period, SIGKILL).  It also kills what is left of the group when the
worker exits, so no remote process outlives the job.  The worker's stdout/stderr are the ssh channel's, and
the supervisor prefixes them per rank exactly as local output.  The wrapper is the watchdog that local
workers run under too (:mod:`horovod.runner._watchdog`, sent as text: it needs nothing but Python).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from horovod.runner.mpi_run import is_exportable
from horovod.runner.spawn import ORPHAN_GRACE, Interrupted, WorkerSpec, watchdog_source

__all__ = ["SshOptions", "ssh_command", "check_hosts", "SshSpawner", "remote_env", "working_directory"]

logger = logging.getLogger(__name__)

# Host-specific variables of the launcher's session that must not be replayed on another host.
_NOT_REMOTE = {"HOSTNAME", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "DISPLAY", "TERM",
               "XDG_RUNTIME_DIR", "XDG_SESSION_ID"}



@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts: ``-p/--ssh-port``, ``-i/--ssh-identity-file`` and the connect timeout."""

    port: int | None = None
    identity_file: str | None = None
    connect_timeout: int = 10


def ssh_command(host: str, options: SshOptions, remote_command: str | None = None) -> list[str]:
    """The ssh argv for ``host`` (batch mode: never prompts; dead connections noticed within ~15 s)."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no",
            "-o", "LogLevel=ERROR", "-o", f"ConnectTimeout={max(1, int(options.connect_timeout))}",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
    if options.port:
        argv += ["-p", str(options.port)]
    if options.identity_file:
        argv += ["-i", options.identity_file]
    argv.append(host)
    if remote_command is not None:
        argv.append(remote_command)
    return argv


class _HostCheck:
    """``ssh <host> true`` on many hosts at once, stoppable: :meth:`stop` kills the ssh clients still waiting."""

    def __init__(self, options: SshOptions, attempts: int) -> None:
        self.options = options
        self.attempts = attempts
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            running = list(self._running)
        for proc in running:
            try:
                proc.kill()
            except OSError:
                pass

    def check(self, host: str) -> str | None:
        """None when ``host`` answers, else ssh's reason."""
        options = self.options
        reason = "unknown error"
        for _ in range(self.attempts):
            if self._stopping.is_set():
                return "interrupted"
            try:
                proc = subprocess.Popen(ssh_command(host, options, "true"), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            except OSError as e:
                return f"cannot run ssh: {e}"
            with self._lock:
                self._running.add(proc)
            if self._stopping.is_set():  # stop() ran before this client was registered
                proc.kill()
            try:
                _, stderr = proc.communicate(timeout=options.connect_timeout + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                reason = f"no answer within {options.connect_timeout + 5} s"
                continue
            finally:
                with self._lock:
                    self._running.discard(proc)
            if proc.returncode == 0:
                return None
            lines = [line for line in stderr.splitlines() if line.strip()]
            reason = lines[-1] if lines else f"ssh exited with status {proc.returncode}"
            if "Connection refused" in reason or "Could not resolve" in reason or "Permission denied" in reason:
                break  # retrying cannot help and the user should hear about it at once
        return reason


def check_hosts(hosts: Sequence[str], options: SshOptions, attempts: int = 2,
                stop_event: threading.Event | None = None) -> None:
    """Run ``ssh <host> true`` on every host in parallel before any worker starts.

    Ctrl-C (``KeyboardInterrupt``) or ``stop_event`` (the CLI's SIGTERM handler) ends the check at once: the
    ssh clients still waiting for a host are killed.

    Raises:
        RuntimeError: some hosts cannot be reached (the message names each one with ssh's reason), or the
            ``-i`` identity file does not exist.
        Interrupted: ``stop_event`` was set.
    """
    if not hosts:
        return
    identity = options.identity_file
    if identity and not os.path.isfile(os.path.expanduser(identity)):
        # ssh only warns that it cannot read it and then fails as if the key were not authorized anywhere
        what = "is a directory, not a key file" if os.path.isdir(os.path.expanduser(identity)) else "does not exist"
        raise RuntimeError(f"ssh identity file {identity!r} (-i/--ssh-identity-file) {what} on this host")
    checker = _HostCheck(options, attempts)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts)))
    try:
        futures = {host: pool.submit(checker.check, host) for host in hosts}
        pending = set(futures.values())
        while pending:
            if stop_event is not None and stop_event.is_set():
                raise Interrupted(getattr(stop_event, "signum", signal.SIGTERM))
            _, pending = concurrent.futures.wait(pending, timeout=0.1)
    except BaseException:
        checker.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    failed = {h: r for h, f in futures.items() if (r := f.result()) is not None}
    if failed:
        details = "; ".join(f"{h}: {r.rstrip('.')}" for h, r in failed.items())
        raise RuntimeError(f"could not connect to some hosts via ssh: {details}. "
                           "Check that sshd runs there and accepts key authentication "
                           "(-p/--ssh-port, -i/--ssh-identity-file).")


def working_directory() -> str:
    """The launcher's working directory, where the ranks on other hosts start (static and elastic jobs).

    Raises:
        RuntimeError: it was removed (a shell left in a deleted directory).
    """
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise RuntimeError("horovodrun's working directory no longer exists (removed or replaced since this "
                           "shell entered it); the ranks on other hosts start in the launcher's directory: cd "
                           "to an existing directory, the same path on every host, and run again") from None


def remote_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a worker's environment that is sent to a remote host (upstream's exportable set)."""
    return {k: v for k, v in env.items() if is_exportable(k) and k not in _NOT_REMOTE}


class _SshProcess(subprocess.Popen):
    """The ssh client of one remote worker; stopping it gently means closing its stdin."""

    def soft_terminate(self) -> None:
        """Ask the remote wrapper to stop the worker (it sees end of file) and let ssh exit by itself."""
        try:
            if self.stdin is not None:
                self.stdin.close()
        except OSError:
            pass


class SshSpawner:
    """Start a :class:`WorkerSpec` on ``spec.hostname`` over ssh (a spawner for ``spawn.run_workers``)."""

    def __init__(self, options: SshOptions, python: str | None = None,
                 grace: float = ORPHAN_GRACE) -> None:
        self.options = options
        self.python = python or sys.executable
        self.grace = grace

    def __call__(self, spec: WorkerSpec) -> subprocess.Popen:
        payload = {"cwd": spec.cwd or working_directory(), "command": spec.command if isinstance(spec.command, str)
                   else list(spec.command), "env": remote_env(spec.env), "grace": self.grace, "local": False}
        remote = f"{shlex.quote(self.python)} -u -c {shlex.quote(watchdog_source())}"
        proc = _SshProcess(ssh_command(spec.hostname, self.options, remote), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(payload).encode() + b"\n")
        proc.stdin.flush()
        logger.debug("rank %d: ssh %s (pid %d)", spec.rank, spec.hostname, proc.pid)
        return proc
