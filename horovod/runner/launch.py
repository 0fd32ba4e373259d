"""``horovodrun``: parse the command line, then :func:`_run` -- shared with ``horovod.run()``.

The flow of a static job on this host: resolve hosts and the slot plan (:mod:`horovod.runner.hosts`),
create the per-job key, start the authenticated rendezvous store (:mod:`horovod.runner.rendezvous`), build
each worker's environment (the launcher → worker contract of docs/architecture.md) and hand the workers to
the supervisor (:mod:`horovod.runner.spawn`), which forwards output and turns the first failure into the
job's error.  ``--mpi`` hands the job to ``mpirun`` instead (:mod:`horovod.runner.mpi_run`).

With ``--tls`` (``HOROVOD_TLS=1``) the launcher also makes the job's TLS certificate and key
(:mod:`horovod.transport.tls`); the store serves TLS only and the workers get both in their environment,
next to the job key (over ssh: on the remote watchdog's stdin).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from horovod.base import auth
from horovod.base import config as config_mod
from horovod.base.config import DEFAULT_START_TIMEOUT
from horovod.runner import hosts as hosts_mod
from horovod.runner import knobs as knobs_mod
from horovod.runner import run_func
from horovod.runner.common.util.timeout import TimeoutException
from horovod.runner.job import JobSpec, split_nics
from horovod.runner.worker_env import launcher_env, worker_env

__all__ = ["run_commandline", "parse_args", "make_parser", "job_from_args", "_run", "worker_env", "JobSpec",
           "DEFAULT_START_TIMEOUT"]

logger = logging.getLogger(__name__)

def make_parser() -> argparse.ArgumentParser:
    """The ``horovodrun`` argument parser, in upstream's groups; knob flags come from the config table."""
    from horovod import __version__

    parser = argparse.ArgumentParser(prog="horovodrun", description="Horovod Runner")
    parser.add_argument("-v", "--version", action="version", version=__version__,
                        help="Shows Horovod version.")

    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int,
                        help="Total number of training processes.")
    parser.add_argument("-cb", "--check-build", action="store_true", dest="check_build",
                        help="Show which frameworks and libraries are available to Horovod.")
    parser.add_argument("--disable-cache", action="store_true", dest="disable_cache",
                        help="Do not cache host checks (accepted; there is no cache for local jobs).")
    parser.add_argument("--start-timeout", type=int, dest="start_timeout",
                        help=_env_help("HOROVOD_START_TIMEOUT"))
    parser.add_argument("--network-interfaces", "--network-interface", action="append", dest="nics",
                        help="Network interface(s) for communication (repeatable; comma lists accepted).")
    parser.add_argument("--output-filename", dest="output_filename",
                        help="Also write each rank's output to <dir>/rank.<rank>/{stdout,stderr}.")
    parser.add_argument("--verbose", action="store_true", dest="verbose", help="More launcher output.")
    parser.add_argument("--config-file", dest="config_file",
                        help="YAML file of parameters; flags given on the command line win.")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="Command to be executed.")

    ssh = parser.add_argument_group("SSH arguments")
    ssh.add_argument("-p", "--ssh-port", type=int, dest="ssh_port", help="SSH port on all hosts.")
    ssh.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", help="SSH identity file.")

    knobs_mod.add_knob_arguments(parser)

    library = knobs_mod.argument_group(parser, "library arguments")
    library.add_argument("--mpi-args", dest="mpi_args", help="Extra arguments for mpirun.")
    library.add_argument("--tcp", action="store_true", dest="tcp",
                         help="Use TCP only between hosts (sets NCCL_IB_DISABLE=1).")
    library.add_argument("--binding-args", dest="binding_args", help="Process binding arguments (mpirun).")

    logging_group = knobs_mod.argument_group(parser, "logging arguments")
    logging_group.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                               dest="prefix_output_with_timestamp",
                               help="Prefix every output line with the time.")

    elastic = parser.add_argument_group("elastic arguments")
    elastic.add_argument("--min-np", "--min-num-proc", type=int, dest="min_num_proc",
                         help="Fewest processes the job runs with (default: -np); makes the job elastic.")
    elastic.add_argument("--max-np", "--max-num-proc", type=int, dest="max_num_proc",
                         help="Most processes the job grows to (default: no limit); makes the job elastic.")
    elastic.add_argument("--slots-per-host", "--slots", type=int, dest="slots",
                         help="Slots of a host the discovery script names without ':<slots>'.")
    elastic.add_argument("--elastic-timeout", type=int, dest="elastic_timeout",
                         help=_env_help("HOROVOD_ELASTIC_TIMEOUT"))
    elastic.add_argument("--reset-limit", type=int, dest="reset_limit",
                         help="Most resets before the job fails (default: no limit).")
    elastic.add_argument("--blacklist-cooldown-range", type=int, nargs=2, dest="cooldown_range",
                         metavar=("MIN", "MAX"),
                         help="Seconds a failed host stays blacklisted (backs off from MIN to MAX; default: forever).")

    host_group = parser.add_argument_group("host arguments")
    hosts_ex = host_group.add_mutually_exclusive_group()
    hosts_ex.add_argument("-H", "--hosts", dest="hosts",
                          help="List of host names and slots, e.g. host1:2,host2:4 (default localhost:<np>).")
    hosts_ex.add_argument("-hostfile", "--hostfile", dest="hostfile",
                          help="File of '<hostname> slots=<n>' lines.")
    hosts_ex.add_argument("--host-discovery-script", dest="host_discovery_script",
                          help="Script printing the available hosts ('host' or 'host:slots' lines); makes the "
                               "job elastic.")

    controller = parser.add_argument_group("controller arguments")
    controller_ex = controller.add_mutually_exclusive_group()
    controller_ex.add_argument("--gloo", action="store_true", dest="use_gloo",
                               help="Use the built-in transport (Horovod's Gloo controller).")
    controller_ex.add_argument("--mpi", action="store_true", dest="use_mpi", help="Launch with mpirun.")
    controller_ex.add_argument("--jsrun", action="store_true", dest="use_jsrun",
                               help="Launch with jsrun (LSF; refused: use --gloo or --mpi).")
    return parser


def _env_help(name: str) -> str:
    """Help text of a flag whose default is a registered variable's (the default written once, in config)."""
    var = config_mod.ENV_VARS[name]
    return f"{var.help[:1].upper()}{var.help[1:]} (default: {name} or {config_mod.format_number(var.default)})."


# The parser's dests that are JobSpec fields of the same name.
_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(JobSpec)
                    if f.name not in ("knobs", "nics", "cooldown_range", "run_func", "executable", "env"))


def job_from_args(args: argparse.Namespace) -> JobSpec:
    """The :class:`JobSpec` of parsed ``horovodrun`` arguments, with ``--config-file`` applied (flags win)."""
    job = JobSpec(**{name: getattr(args, name) for name in _JOB_FIELDS},
                  knobs=knobs_mod.knobs_from_args(args), nics=split_nics(args.nics),
                  cooldown_range=tuple(args.cooldown_range) if args.cooldown_range else None)
    if args.config_file:
        controller = knobs_mod.apply_config_file(job.knobs, knobs_mod.load_config_file(args.config_file))
        if controller and not (job.use_gloo or job.use_mpi):
            setattr(job, f"use_{controller}", True)
    return job


def parse_args(argv: Sequence[str] | None = None) -> JobSpec:
    """Parse ``horovodrun`` arguments into the job they describe (``--config-file`` applied)."""
    return job_from_args(make_parser().parse_args(argv))


def _run(job: JobSpec, stop_event: threading.Event | None = None) -> list[Any] | None:
    """Run ``job`` (from :func:`parse_args` or ``horovod.run``).

    Returns None for a command, or the per-rank results when ``job.run_func`` is set.

    Raises:
        ValueError: bad arguments (upstream's texts).
        JobFailure: a worker exited non-zero (a ``RuntimeError`` with upstream's message).
        Interrupted: ``stop_event`` was set (the CLI's SIGTERM handler).
    """
    from horovod.runner import spawn

    if job.check_build:
        print(_check_build_text(job.verbose))
        return None
    job.check()
    ignored = [flag for flag, value in (("--mpi-args", job.mpi_args), ("--binding-args", job.binding_args)) if value]
    if ignored and (job.is_elastic() or not job.use_mpi):
        # upstream's horovodrun runs mpirun by default when Horovod has MPI, so these took effect there; here the
        # default is the built-in transport, which would drop them without a word
        logger.warning("horovodrun: warning: %s %s only passed to mpirun (--mpi); this job runs on the built-in "
                       "transport without mpirun and ignores %s: add --mpi to launch with mpirun",
                       " and ".join(ignored), "is" if len(ignored) == 1 else "are",
                       "it" if len(ignored) == 1 else "them")
    if job.output_filename and (job.is_elastic() or not job.use_mpi):  # under --mpi, mpirun writes it
        from horovod.runner.output import make_output_dir

        make_output_dir(job.output_filename)  # before anything starts, as upstream
    if job.is_elastic():
        from horovod.runner.elastic.driver import run_elastic

        return run_elastic(job, stop_event)
    start_timeout = job.start_timeout_seconds()
    hosts = job.host_list()
    # Unlike upstream's Gloo path (which starts every listed slot), exactly -np ranks are started.
    assert job.num_proc is not None
    slots = hosts_mod.get_host_assignments(hosts, job.num_proc, job.num_proc)
    local_names = {s.hostname for s in slots if hosts_mod.is_local_host(s.hostname)}
    remote = [h.hostname for h in hosts if any(s.hostname == h.hostname for s in slots)
              and h.hostname not in local_names]
    knobs = job.knob_env()
    if job.use_mpi and job.tls_requested():
        raise ValueError("--tls (HOROVOD_TLS=1) encrypts the built-in transport and the rendezvous store; under "
                         "--mpi the job key, the data and the object pickles travel over Open MPI's transport, "
                         "which TLS does not cover and which is not encrypted. Run without --mpi to encrypt "
                         "everything between hosts, or without --tls (see docs/security.md).")
    ssh_options = None
    cwd = None  # ranks on this host inherit the launcher's directory; remote ones start in its path
    if remote:  # under --mpi too, as upstream: mpirun's own ssh then finds the hosts known, or we name the host
        from horovod.runner import ssh

        cwd = ssh.working_directory()

        if job.verbose:
            logger.info("Filtering local host names.")
            logger.info("Remote host found: %s", " ".join(remote))
        ssh_options = ssh.SshOptions(job.ssh_port, job.ssh_identity_file,
                                     connect_timeout=max(1, min(10, start_timeout)))
        ssh.check_hosts(remote, ssh_options, stop_event=stop_event)
    if job.use_mpi:
        return _run_mpi(job, hosts, knobs, start_timeout, remote)

    from horovod.runner import network
    from horovod.runner.rendezvous import RendezvousServer

    iface = network.choose_interface(remote, job.nics)

    key = auth.make_secret_key()
    creds = job_tls = None
    if job.tls_requested():
        from horovod.transport import tls as tls_mod

        creds = tls_mod.make_credentials()
        job_tls = tls_mod.JobTls(creds)
    store_addr = iface.address
    server = RendezvousServer(key, addr=store_addr, tls=job_tls)
    port = server.start()
    try:
        command = _run_func_command(job, server, store_addr, port) if job.run_func else job.command_line()
        base = job.base_env()
        specs = [spawn.WorkerSpec(rank=s.rank, hostname=s.hostname, command=command,
                                  cwd=None if s.hostname in local_names else cwd,
                                  env=worker_env(s, base=base, store_addr=store_addr, store_port=port,
                                                 key=key, knobs=knobs, start_timeout=start_timeout, nics=job.nics,
                                                 tcp=job.tcp, tls=creds))
                 for s in slots]
        host_text = ",".join(f"{h.hostname}:{sum(1 for s in slots if s.hostname == h.hostname)}"
                             for h in hosts if any(s.hostname == h.hostname for s in slots))
        shown = command if isinstance(command, str) else shlex.join(command)
        logger.info("horovodrun: starting %d rank%s on %s (%s), network interface %s (%s), transport: "
                    "built-in (gloo-compatible, shm/tcp%s), rendezvous %s:%d: %s", len(specs),
                    "" if len(specs) == 1 else "s", host_text,
                    f"remote over ssh: {', '.join(remote)}" if remote else "this host",
                    iface.name, iface.address, ", TLS on TCP and the store" if creds else "", store_addr, port,
                    shown)
        started = time.monotonic()
        output = spawn.OutputOptions(prefix_timestamp=job.prefix_output_with_timestamp,
                                     output_dir=job.output_filename)
        spawner: spawn.Spawner = spawn.spawn_local
        if ssh_options is not None:
            from horovod.runner.ssh import SshSpawner

            remote_spawn = SshSpawner(ssh_options)

            def spawner(spec: spawn.WorkerSpec) -> Any:
                return spawn.spawn_local(spec) if spec.hostname in local_names else remote_spawn(spec)

        spawn.run_workers(specs, spawner=spawner, output=output, stop_event=stop_event,
                          on_exit=lambda rank, code: _record_exit(server, rank, code))
        logger.info("horovodrun: all %d ranks exited successfully after %.1f s", len(specs),
                    time.monotonic() - started)
        if job.run_func:
            return _collect_results(server, len(slots))
        return None
    finally:
        server.stop()


def _record_exit(server: Any, rank: int, code: int) -> None:
    """A rank's process ended: the ranks still waiting for it in ``init()`` fail at once, naming it."""
    from horovod.common.bootstrap import record_exit

    record_exit(server, rank, code)


def _check_build_text(verbose: bool) -> str:
    from horovod.runner.build_info import check_build

    return check_build(verbose)


def _run_func_command(job: JobSpec, server: Any, addr: str, port: int) -> list[str]:
    server.put(run_func.FUNC_KEY, run_func.func_payload(job.run_func))
    return run_func.worker_command(job.executable, addr, port)


def _collect_results(server: Any, size: int) -> list[Any]:
    return run_func.decode_results([server.get(f"{run_func.RESULT_SCOPE}/{rank}") for rank in range(size)])


def _run_mpi(job: JobSpec, hosts: list[hosts_mod.HostInfo], knobs: dict[str, str],
             start_timeout: float, remote: Sequence[str] = ()) -> list[Any] | None:
    from horovod.runner import mpi_run

    env = launcher_env(job.base_env(), knobs=knobs, start_timeout=start_timeout, nics=job.nics, tcp=job.tcp,
                       unbuffered=False)
    mpi_args = " ".join(a for a in (job.mpi_args, job.binding_args) if a) or None
    assert job.num_proc is not None

    def mpirun_command(command_text: str) -> str:
        return mpi_run.mpi_command(job.num_proc, hosts, command_text, env, nics=job.nics,
                                   output_filename=job.output_filename, mpi_args=mpi_args, tcp=job.tcp,
                                   ssh_port=job.ssh_port, ssh_identity_file=job.ssh_identity_file,
                                   timestamp=job.prefix_output_with_timestamp)

    if not job.run_func:
        command = job.command_line()
        mpi_run.exec_mpirun(mpirun_command(command if isinstance(command, str) else shlex.join(command)), env)
        return None  # not reached

    from horovod.runner.network import choose_interface
    from horovod.runner.rendezvous import RendezvousServer

    key = auth.make_secret_key()
    store_addr = choose_interface(remote, job.nics).address
    with RendezvousServer(key, addr=store_addr) as server:
        env[auth.SECRET_KEY_ENV] = key.hex()
        mpi_run.run_mpirun(mpirun_command(shlex.join(_run_func_command(job, server, store_addr, server.port))),
                           env)
        return _collect_results(server, job.num_proc)


def _configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("horovod.runner").setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        logging.getLogger("horovod.runner.rendezvous").setLevel(logging.WARNING)


def run_commandline(argv: Sequence[str] | None = None) -> None:
    """The ``horovodrun`` console script: exits 0 on success, non-zero on any failure."""
    try:
        job = parse_args(argv)
        job.check_process_counts()  # an argument error, as argparse's (horovod.run: ValueError from check())
    except (ValueError, OSError) as e:
        sys.stderr.write(f"horovodrun: error: {e}\n")
        sys.exit(2)
    _configure_logging(job.verbose)

    from horovod.runner.spawn import Interrupted, JobFailure

    stop_event = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_event.signum = signum  # type: ignore[attr-defined]
        stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        _run(job, stop_event=stop_event)
    except JobFailure as e:
        logger.error("%s", e)
        sys.exit(e.shell_exit_code)
    except Interrupted as e:
        logger.error("%s", e)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        logger.error("horovodrun interrupted (Ctrl-C); all workers terminated")
        sys.exit(130)
    except (ValueError, RuntimeError, OSError, TimeoutException) as e:
        logger.error("horovodrun: error: %s", e)
        sys.exit(1)


if __name__ == "__main__":
    run_commandline()
