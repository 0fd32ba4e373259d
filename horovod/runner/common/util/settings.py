"""Upstream's ``settings``: the launcher's settings objects, as plain attribute holders.

``horovodrun`` and ``horovod.run`` describe a job with their own options; these classes exist so that code
written against upstream (``hvd_settings.Settings(num_proc=2, hosts='localhost:2', ...)``) still works.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BaseSettings", "Settings"]


class BaseSettings:
    """Options common to every launcher (upstream's names and defaults).

    Args:
        num_proc: number of processes (``-np``).
        verbose: verbosity level.
        ssh_port, ssh_identity_file: how to reach remote hosts.
        extra_mpi_args, tcp_flag, binding_args: passed to ``mpirun``.
        key: the per-job secret key.
        start_timeout: a :class:`horovod.runner.common.util.timeout.Timeout` for the start-up checks.
        output_filename: directory for per-rank stdout/stderr.
        run_func_mode: whether a function (``horovod.run``) rather than a command runs.
        nics: network interfaces to use.
        elastic: elastic mode.
        timestamp_output: prefix forwarded output with a timestamp.
    """

    def __init__(self, num_proc: int | None = None, verbose: int = 0, ssh_port: int | None = None,
                 ssh_identity_file: str | None = None, extra_mpi_args: str | None = None,
                 tcp_flag: bool | None = None, binding_args: str | None = None, key: bytes | None = None,
                 start_timeout: Any = None, output_filename: str | None = None, run_func_mode: bool | None = None,
                 nics: Any = None, elastic: bool = False, timestamp_output: bool = False) -> None:
        self.num_proc = num_proc
        self.verbose = verbose
        self.ssh_port = ssh_port
        self.ssh_identity_file = ssh_identity_file
        self.extra_mpi_args = extra_mpi_args
        self.tcp_flag = tcp_flag
        self.binding_args = binding_args
        self.key = key
        self.start_timeout = start_timeout
        self.output_filename = output_filename
        self.run_func_mode = run_func_mode
        self.nics = nics
        self.elastic = elastic
        self.timestamp_output = timestamp_output


class Settings(BaseSettings):
    """A static job's settings: :class:`BaseSettings` plus ``hosts`` (``"host1:2,host2:2"``)."""

    def __init__(self, hosts: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hosts = hosts
