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
        prefix_output_with_timestamp: bool = False, **knobs: Any) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` processes and return the results, indexed by rank.

    The launcher starts a rendezvous store, puts ``cloudpickle((func, args, kwargs))`` into it and starts
    ``<executable or sys.executable> -m horovod.runner.run_task <addr> <port>`` once per rank; each worker
    fetches the function, runs it and stores its pickled result.  The pickled function and results travel
    only through that store, which refuses every request not signed with the per-job key, so no other
    process can read or replace them.

    ``**knobs`` are the runtime knobs of ``horovodrun``'s flags, named like the flags' destinations and
    generated from the same table (:data:`horovod.base.config.KNOBS`): ``fusion_threshold_mb=32``,
    ``cycle_time_ms=2.5``, ``timeline_filename="t.json"``, ``log_level="debug"``, ``tls=True`` ...

    Example::

        import horovod
        horovod.run(lambda: __import__("os").environ["HOROVOD_RANK"], np=2)   # ['0', '1']

    Raises:
        TypeError: an argument that is neither one of the above nor a knob.
        ValueError: conflicting arguments (upstream's texts) or a knob value the knob cannot take.
        RuntimeError: a worker failed; the message names the first failed rank and its exit code.
    """
    from horovod.runner.job import JobSpec, split_nics
    from horovod.runner.knobs import knobs_from_kwargs
    from horovod.runner.launch import _run

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
    elastic = min_np is not None or max_np is not None or bool(host_discovery_script)  # np defaults to min_np
    nics = split_nics([*(network_interfaces or []), *([network_interface] if network_interface else [])])

    job = JobSpec(
        num_proc=np if np is not None or elastic else 1, min_num_proc=min_np, max_num_proc=max_np, slots=slots,
        reset_limit=reset_limit, cooldown_range=cooldown_range, hosts=hosts, hostfile=hostfile,
        host_discovery_script=host_discovery_script, start_timeout=start_timeout, ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file, disable_cache=bool(disable_cache), output_filename=output_filename,
        verbose=bool(verbose), use_gloo=bool(use_gloo), use_mpi=bool(use_mpi), mpi_args=mpi_args, nics=nics,
        prefix_output_with_timestamp=prefix_output_with_timestamp, knobs=knobs_from_kwargs(knobs),
        run_func=(func, tuple(args), dict(kwargs or {})), executable=executable, env=_worker_base_env())
    result = _run(job)
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
