"""Upstream's ``safe_shell_exec``: run a shell command in its own process group, forward its output, and
stop the whole group when an event is set.

``execute`` returns the exit code (negative signal number when killed, as ``subprocess``).  With ``index``
each output line is prefixed ``[index]<stdout>:`` / ``[index]<stderr>:`` as ``horovodrun`` does.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from horovod.runner.output import OutputSink, forward_stream
from horovod.runner.spawn import terminate_workers

__all__ = ["execute", "terminate_executor_shell_and_children", "GRACEFUL_TERMINATION_TIME_S"]

GRACEFUL_TERMINATION_TIME_S = 5


def _copy(src: IO[bytes], dst: IO[str]) -> None:
    sink = OutputSink(dst)
    for chunk in iter(lambda: src.read1(65536), b""):
        sink.write(chunk.decode("utf-8", "replace"))


def terminate_executor_shell_and_children(proc: subprocess.Popen) -> None:
    """SIGTERM the command's process group, SIGKILL it after :data:`GRACEFUL_TERMINATION_TIME_S`."""
    terminate_workers([proc], grace=GRACEFUL_TERMINATION_TIME_S)


def execute(command: str, env: Mapping[str, str] | None = None, stdout: IO[str] | None = None,
            stderr: IO[str] | None = None, index: int | None = None,
            events: Sequence[threading.Event] | None = None, prefix_output_with_timestamp: bool = False) -> int:
    """Run ``command`` with ``/bin/sh``; return its exit code once it and its output are done.

    Args:
        env: the command's environment (default: this process's).
        stdout, stderr: text streams receiving its output (default ``sys.stdout``/``sys.stderr``).
        index: prefix every line with ``[index]<stdout>:`` (``<stderr>``); None copies output unchanged.
        events: when any of them is set, the command's whole process group is terminated.
        prefix_output_with_timestamp: put the time before the prefix (needs ``index``).
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    proc = subprocess.Popen(command, shell=True, env=dict(env) if env is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    readers = []
    for src, dst, name in ((proc.stdout, out, "stdout"), (proc.stderr, err, "stderr")):
        if index is None:
            target, args, kwargs = _copy, (src, dst), {}
        else:
            target, args = forward_stream, (src, OutputSink(dst), index, name)
            kwargs = {"timestamp": prefix_output_with_timestamp}
        thread = threading.Thread(target=target, args=args, kwargs=kwargs, daemon=True)
        thread.start()
        readers.append(thread)

    stop = threading.Event()
    if events:
        def watch():
            while not stop.is_set():
                if any(e.is_set() for e in events):
                    terminate_executor_shell_and_children(proc)
                    return
                stop.wait(0.1)
        threading.Thread(target=watch, daemon=True).start()
    try:
        code = proc.wait()
    finally:
        stop.set()
    for thread in readers:
        thread.join(GRACEFUL_TERMINATION_TIME_S)
    if any(t.is_alive() for t in readers):  # a child left in the group still holds the pipes open
        terminate_executor_shell_and_children(proc)
        for thread in readers:
            thread.join()
    proc.stdout.close()
    proc.stderr.close()
    return code
