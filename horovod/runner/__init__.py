"""The launcher (``horovodrun``) and ``horovod.run``.

Every worker imports ``horovod``, so this package imports nothing heavy at import time: the launcher's
modules load only when :func:`run` is called or the CLI starts.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run"]


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
        slots: int | None = None, reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None, hosts: str | None = None, hostfile: str | None = None,
        host_discovery_script: str | None = None, start_timeout: int | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interface: str | None = None,
        network_interfaces: Sequence[str] | None = None, executable: str | None = None,
        np: int | None = None, min_np: int | None = None, max_np: int | None = None,
        prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` processes and return the results, indexed by rank.

    The launcher starts a rendezvous store, puts ``cloudpickle((func, args, kwargs))`` into it and starts
    ``<executable or sys.executable> -m horovod.runner.run_task <addr> <port>`` once per rank; each worker
    fetches the function, runs it and stores its pickled result.  The pickled function and results travel
    only through that store, which refuses every request not signed with the per-job key, so no other
    process can read or replace them.

    Example::

        import horovod
        horovod.run(lambda: __import__("os").environ["HOROVOD_RANK"], np=2)   # ['0', '1']

    Raises:
        ValueError: conflicting arguments (upstream's texts).
        RuntimeError: a worker failed; the message names the first failed rank and its exit code.
    """
    from horovod.runner.launch import make_parser

    if num_proc is not None:
        warnings.warn("num_proc is deprecated, use np", DeprecationWarning, stacklevel=2)
        np = num_proc if np is None else np
    if min_num_proc is not None:
        warnings.warn("min_num_proc is deprecated, use min_np", DeprecationWarning, stacklevel=2)
        min_np = min_num_proc if min_np is None else min_np
    if max_num_proc is not None:
        warnings.warn("max_num_proc is deprecated, use max_np", DeprecationWarning, stacklevel=2)
        max_np = max_num_proc if max_np is None else max_np
    if hosts and hostfile:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    nics = list(network_interfaces or [])
    if network_interface:
        nics.append(network_interface)

    args_ns = make_parser().parse_args([])
    args_ns.num_proc = 1 if np is None else np
    args_ns.min_num_proc, args_ns.max_num_proc = min_np, max_np
    args_ns.slots, args_ns.reset_limit, args_ns.cooldown_range = slots, reset_limit, cooldown_range
    args_ns.hosts, args_ns.hostfile, args_ns.host_discovery_script = hosts, hostfile, host_discovery_script
    args_ns.start_timeout = start_timeout
    args_ns.ssh_port, args_ns.ssh_identity_file = ssh_port, ssh_identity_file
    args_ns.disable_cache = bool(disable_cache)
    args_ns.output_filename = output_filename
    args_ns.verbose = bool(verbose)
    args_ns.use_gloo, args_ns.use_mpi = bool(use_gloo), bool(use_mpi)
    args_ns.mpi_args = mpi_args
    args_ns.nics = nics or None
    args_ns.prefix_output_with_timestamp = prefix_output_with_timestamp
    args_ns.run_func = (func, tuple(args), dict(kwargs or {}))
    args_ns.executable = executable
    args_ns.command = []
    args_ns.env = _worker_base_env()

    from horovod.runner.launch import _run

    result = _run(args_ns)
    assert result is not None
    return result


def _worker_base_env() -> dict[str, str]:
    # The workers run `-m horovod.runner.run_task`: make sure they import this same horovod even when it
    # is not installed (a source checkout on sys.path).
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_parent not in parts:
        env["PYTHONPATH"] = os.pathsep.join([package_parent, *parts])
    return env
