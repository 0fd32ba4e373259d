"""Upstream's ``horovod.runner.util.threads``: run functions in background threads.

``in_thread`` and ``on_event`` are what upstream's test helpers (``delay``) and user scripts import;
``execute_function_multithreaded`` runs one function over a list of argument lists.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["execute_function_multithreaded", "in_thread", "on_event"]


def _check_args(args: Any) -> None:
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use (arg,)")


def in_thread(target: Callable[..., Any], args: tuple = (), name: str | None = None, daemon: bool = True,
              silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` in a new thread and return the thread.

    Args:
        daemon: a daemon thread does not keep the process alive.
        silent: swallow any exception ``target`` raises (otherwise threading's excepthook reports it).

    Raises:
        ValueError: ``args`` is not a tuple.
    """
    _check_args(args)
    fn = target
    if silent:
        def fn(*a):
            try:
                target(*a)
            except BaseException:  # noqa: B036 - upstream's contract: silent swallows everything
                pass
    thread = threading.Thread(target=fn, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: tuple = (),
             stop: threading.Event | None = None, check_stop_interval_s: float = 1.0, daemon: bool = True,
             silent: bool = False) -> threading.Thread:
    """Call ``func(*args)`` in a new thread once ``event`` is set, unless ``stop`` is set first.

    ``stop`` is checked every ``check_stop_interval_s`` seconds.  A non-daemon thread needs ``stop`` (else
    it could keep the process alive forever).

    Raises:
        ValueError: ``event`` is None, ``args`` is not a tuple, or ``daemon=False`` without ``stop``.
    """
    if event is None:
        raise ValueError("Event must not be None")
    _check_args(args)
    if stop is None:
        if not daemon:
            raise ValueError("Stop event must be given for non-daemon event thread")

        def fn():
            event.wait()
            func(*args)
    else:
        def fn():
            while not event.is_set() and not stop.is_set():
                event.wait(timeout=check_stop_interval_s)
            if not stop.is_set():
                func(*args)
    return in_thread(fn, daemon=daemon, silent=silent)


def execute_function_multithreaded(fn: Callable[..., Any], args_list: Sequence[list],
                                   block_until_all_done: bool = True,
                                   max_concurrent_executions: int = 1000) -> dict[int, Any] | None:
    """Call ``fn(*args)`` for every ``args`` of ``args_list`` on at most ``max_concurrent_executions`` threads.

    Returns:
        ``{index in args_list: result}`` when ``block_until_all_done``, else None (the threads are daemons
        and keep running).

    Raises:
        RuntimeError: some call raised (its traceback is printed by the thread), so a result is missing.
    """
    work: queue.Queue = queue.Queue()
    for index, args in enumerate(args_list):
        work.put((index, list(args)))
    results: dict[int, Any] = {}
    lock = threading.Lock()

    def worker():
        while True:
            try:
                index, args = work.get(block=False)
            except queue.Empty:
                return
            value = fn(*args)
            with lock:
                results[index] = value

    count = min(max_concurrent_executions, len(args_list))
    threads = [in_thread(worker, daemon=not block_until_all_done) for _ in range(count)]
    if not block_until_all_done:
        return None
    for t in threads:
        while t.is_alive():  # join with a timeout so that a signal (Ctrl-C) still reaches the main thread
            t.join(0.1)
    if len(results) != len(args_list):
        raise RuntimeError(f"Some threads for func {getattr(fn, '__name__', fn)} did not complete successfully.")
    return dict(sorted(results.items()))
