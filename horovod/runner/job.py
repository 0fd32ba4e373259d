"""The job, as one typed object: :class:`JobSpec`.

``horovodrun`` (:func:`horovod.runner.launch.parse_args`), ``horovod.run()`` and the cluster launchers build a
:class:`JobSpec`; the static launcher (:func:`horovod.runner.launch._run`) and the elastic driver
(:mod:`horovod.runner.elastic.driver`) read it.  What both need derived from it -- the command to start, the
interfaces, the deadlines, upstream's argument errors -- is computed here once, so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from horovod.base import config as config_mod
from horovod.runner import hosts as hosts_mod
from horovod.runner import knobs as knobs_mod

__all__ = ["JobSpec", "split_nics"]

# Fields that must not be negative (upstream's ``ValueError('<arg>=<v> must be >= 0')``).
_NONNEGATIVE = ("num_proc", "min_num_proc", "max_num_proc", "elastic_timeout", "reset_limit", "start_timeout",
                "ssh_port")


def split_nics(values: Sequence[str] | None) -> list[str]:
    """``--network-interface`` values (repeatable, each maybe a comma list) as one list of names."""
    return [n for item in (values or []) for n in item.split(",") if n]


@dataclasses.dataclass
class JobSpec:
    """What to run, where and with which settings.  ``None`` means "not given": the default applies.

    ``knobs`` holds the runtime knobs that were given (flag, ``--config-file`` or ``horovod.run(**knobs)``),
    keyed by :attr:`horovod.base.config.Knob.name` and in the flag's unit; only those are exported.
    ``env`` is the workers' base environment (``None``: this process's).  ``run_func`` is
    ``(func, args, kwargs)`` for ``horovod.run``; otherwise ``command`` is the argv to start.
    """

    num_proc: int | None = None
    command: list[str] = dataclasses.field(default_factory=list)
    run_func: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None
    executable: str | None = None
    env: dict[str, str] | None = None
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # hosts
    hosts: str | None = None
    hostfile: str | None = None
    host_discovery_script: str | None = None
    slots: int | None = None
    # elastic
    min_num_proc: int | None = None
    max_num_proc: int | None = None
    elastic_timeout: float | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None
    # launcher
    start_timeout: float | None = None
    nics: list[str] = dataclasses.field(default_factory=list)
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    disable_cache: bool = False
    output_filename: str | None = None
    verbose: bool = False
    prefix_output_with_timestamp: bool = False
    check_build: bool = False
    # controller and library
    use_gloo: bool = False
    use_mpi: bool = False
    use_jsrun: bool = False
    mpi_args: str | None = None
    binding_args: str | None = None
    tcp: bool = False

    # ------------------------------------------------------------------ derived values
    def base_env(self) -> dict[str, str]:
        """A copy of the workers' base environment (``env``, else this process's)."""
        return dict(os.environ if self.env is None else self.env)

    def knob_env(self) -> dict[str, str]:
        """The variables of the knobs that were given (what the workers get on top of ``base_env``)."""
        return knobs_mod.knob_env(self.knobs)

    def worker_settings(self) -> dict[str, str]:
        """``base_env`` with the given knobs applied: what the workers' ``hvd.init()`` will parse."""
        return {**self.base_env(), **self.knob_env()}

    def is_elastic(self) -> bool:
        """Upstream's rule: a discovery script or any of --min-np/--max-np makes the job elastic."""
        return bool(self.host_discovery_script) or self.min_num_proc is not None or self.max_num_proc is not None

    def start_timeout_seconds(self) -> float:
        """``--start-timeout``, else ``HOROVOD_START_TIMEOUT`` of the workers' environment, else its default."""
        if self.start_timeout is not None:
            return self.start_timeout
        return config_mod.start_timeout(self.base_env())

    def elastic_timeout_seconds(self) -> float:
        """``--elastic-timeout``, else ``HOROVOD_ELASTIC_TIMEOUT`` of the workers' environment, else its default."""
        if self.elastic_timeout is not None:
            return self.elastic_timeout
        return float(config_mod.read_env("HOROVOD_ELASTIC_TIMEOUT", self.base_env()))

    def tls_requested(self) -> bool:
        """``--tls`` or ``HOROVOD_TLS`` in the workers' environment."""
        return bool(config_mod.read_env("HOROVOD_TLS", self.worker_settings()))

    def command_line(self) -> str | list[str]:
        """The command each worker runs.

        The argv runs directly (what upstream's ``/bin/sh -c`` of the quoted words amounts to).  A single
        word with spaces (``horovodrun -np 2 "python a.py | tee x"``) is a shell line and runs via /bin/sh -c.
        """
        command = list(self.command)
        if command and command[0] == "--":
            command = command[1:]
        if len(command) == 1 and any(c.isspace() for c in command[0]):
            return command[0]
        return command

    def host_list(self) -> list[hosts_mod.HostInfo]:
        """``--hostfile``, else ``-H``, else ``localhost:<np>``.

        Raises:
            ValueError: a bad host or hostfile line, or a hostfile that cannot be read (naming the option and
                the path).
        """
        if self.hostfile:
            try:
                spec = hosts_mod.parse_host_files(self.hostfile)
            except OSError as e:  # the bare "[Errno 2] No such file or directory: 'x'" named no option
                raise ValueError(f"--hostfile {self.hostfile}: cannot read it: {e.strerror or e}") from None
        elif self.hosts:
            spec = self.hosts
        else:
            spec = f"localhost:{self.num_proc}"
        return hosts_mod.parse_hosts(spec)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Upstream's argument errors, raised before anything starts.

        Every knob the workers will see is parsed as ``hvd.init()`` will parse it, so a bad value fails
        here, naming the variable, instead of in every worker.

        Raises:
            ValueError: the job cannot run as described (the text names the argument).
        """
        knobs_mod.validate_knobs(self.knobs, self.base_env())
        for name in _NONNEGATIVE:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if self.use_jsrun:
            raise ValueError("--jsrun is not supported; use --gloo or --mpi.")
        if self.is_elastic():
            self._check_elastic()
        elif not self.num_proc:
            raise ValueError("-np/--num-proc is required and must be at least 1 (or use --check-build).")
        if not self.command and self.run_func is None:
            raise ValueError("No command given: horovodrun -np N <command> [args...]")
        if self.start_timeout_seconds() == 0:
            raise ValueError("start_timeout=0 must be > 0 (seconds the workers may take to meet)")
        if self.output_filename and os.path.exists(self.output_filename) and not os.path.isdir(self.output_filename):
            raise ValueError(f"--output-filename {self.output_filename}: not a directory (each rank writes "
                             f"<dir>/rank.<N>/stdout and stderr)")
        if self.is_elastic() and self.elastic_timeout_seconds() == 0:
            raise ValueError("elastic_timeout=0 must be > 0 (seconds to wait for enough slots)")

    def _check_elastic(self) -> None:
        if not (self.num_proc or self.min_num_proc):
            raise ValueError("-np/--num-proc or --min-np is required in elastic mode.")
        self.check_process_counts()

    def check_process_counts(self) -> None:
        """``--min-np <= -np <= --max-np``, for those that were given (``-np`` 0 counts as not given).

        Upstream does not check: ``-np 2 --min-np 3`` waited for 3 slots, and ``-np 4 --max-np 2`` started 2
        workers, both without a word (docs/compatibility.md).  ``horovodrun`` calls this right after parsing
        (an argument error, exit status 2); :meth:`check` calls it for ``horovod.run()``.

        Raises:
            ValueError: two of them are out of order (the text names both options and their values).
        """
        num_proc, min_np, max_np = self.num_proc or None, self.min_num_proc, self.max_num_proc
        if min_np is not None and max_np is not None and max_np < min_np:
            raise ValueError(f"--max-np ({max_np}) must not be less than --min-np ({min_np}).")
        if num_proc is not None and min_np is not None and min_np > num_proc:
            raise ValueError(f"--min-np ({min_np}) must not be greater than -np ({num_proc}).")
        if num_proc is not None and max_np is not None and max_np < num_proc:
            raise ValueError(f"--max-np ({max_np}) must not be less than -np ({num_proc}).")

    def elastic_bounds(self) -> tuple[int, int, int | None]:
        """``(np to start with, min np, max np or None)`` of an elastic job (upstream: min defaults to np, np
        to min).  After :meth:`check`, ``min <= np <= max``."""
        num_proc = self.num_proc or self.min_num_proc or 0
        min_np = self.min_num_proc if self.min_num_proc is not None else num_proc
        return num_proc, min_np, self.max_num_proc
