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
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from horovod.common import auth
from horovod.common import config as config_mod
from horovod.common.config import DEFAULT_START_TIMEOUT
from horovod.runner import hosts as hosts_mod
from horovod.runner import knobs as knobs_mod

__all__ = ["run_commandline", "parse_args", "make_parser", "_run", "worker_env", "DEFAULT_START_TIMEOUT"]

logger = logging.getLogger(__name__)

RUN_FUNC_SCOPE = "runfunc"
RUN_RESULT_SCOPE = "runfunc_result"


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
                        help="Seconds workers may take to meet at the rendezvous store "
                             "(default: HOROVOD_START_TIMEOUT or 30).")
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

    library = parser.add_argument_group("library arguments")
    library.add_argument("--mpi-args", dest="mpi_args", help="Extra arguments for mpirun.")
    library.add_argument("--tcp", action="store_true", dest="tcp_flag",
                         help="Use TCP only between hosts (sets NCCL_IB_DISABLE=1).")
    library.add_argument("--binding-args", dest="binding_args", help="Process binding arguments (mpirun).")

    logging_group = parser.add_argument_group("logging arguments")
    logging_group.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                               dest="prefix_output_with_timestamp",
                               help="Prefix every output line with the time.")

    elastic = parser.add_argument_group("elastic arguments (not supported yet)")
    elastic.add_argument("--min-np", "--min-num-proc", type=int, dest="min_num_proc")
    elastic.add_argument("--max-np", "--max-num-proc", type=int, dest="max_num_proc")
    elastic.add_argument("--slots-per-host", "--slots", type=int, dest="slots")
    elastic.add_argument("--elastic-timeout", type=int, dest="elastic_timeout")
    elastic.add_argument("--reset-limit", type=int, dest="reset_limit")
    elastic.add_argument("--blacklist-cooldown-range", type=int, nargs=2, dest="cooldown_range")

    host_group = parser.add_argument_group("host arguments")
    hosts_ex = host_group.add_mutually_exclusive_group()
    hosts_ex.add_argument("-H", "--hosts", dest="hosts",
                          help="List of host names and slots, e.g. host1:2,host2:4 (default localhost:<np>).")
    hosts_ex.add_argument("-hostfile", "--hostfile", dest="hostfile",
                          help="File of '<hostname> slots=<n>' lines.")
    hosts_ex.add_argument("--host-discovery-script", dest="host_discovery_script",
                          help="Elastic host discovery script (not supported yet).")

    controller = parser.add_argument_group("controller arguments")
    controller_ex = controller.add_mutually_exclusive_group()
    controller_ex.add_argument("--gloo", action="store_true", dest="use_gloo",
                               help="Use the built-in transport (Horovod's Gloo controller).")
    controller_ex.add_argument("--mpi", action="store_true", dest="use_mpi", help="Launch with mpirun.")
    controller_ex.add_argument("--jsrun", action="store_true", dest="use_jsrun",
                               help="Launch with jsrun (LSF; not supported).")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``horovodrun`` arguments and apply ``--config-file`` (explicit flags win)."""
    args = make_parser().parse_args(argv)
    if args.config_file:
        knobs_mod.apply_config_file(args, knobs_mod.load_config_file(args.config_file))
    args.run_func = None
    args.executable = None
    args.env = None
    return args


def _validate(args: argparse.Namespace) -> None:
    knobs_mod.validate_knob_args(args)
    for dest in ("num_proc", "start_timeout", "ssh_port"):
        value = getattr(args, dest, None)
        if value is not None and value < 0:
            raise ValueError(f"{dest}={value} must be >= 0")
    if args.start_timeout == 0:
        raise ValueError("start_timeout=0 must be > 0 (seconds the workers may take to meet)")
    if args.host_discovery_script or args.min_num_proc is not None or args.max_num_proc is not None:
        raise ValueError("Elastic mode (--host-discovery-script, --min-np, --max-np) is not supported yet.")
    if getattr(args, "use_jsrun", False):
        raise ValueError("--jsrun is not supported; use --gloo or --mpi.")
    if not args.num_proc:
        raise ValueError("-np/--num-proc is required and must be at least 1 (or use --check-build).")
    if not args.command and args.run_func is None:
        raise ValueError("No command given: horovodrun -np N <command> [args...]")


def _start_timeout(args: argparse.Namespace) -> float:
    """``--start-timeout``, else ``HOROVOD_START_TIMEOUT`` of the workers' environment, else the default."""
    if args.start_timeout is not None:
        return args.start_timeout
    return config_mod.start_timeout(args.env if getattr(args, "env", None) is not None else None)


def _resolve_hosts(args: argparse.Namespace) -> list[hosts_mod.HostInfo]:
    if args.hostfile:
        spec = hosts_mod.parse_host_files(args.hostfile)
    elif args.hosts:
        spec = args.hosts
    else:
        spec = f"localhost:{args.num_proc}"
    return hosts_mod.parse_hosts(spec)


def _nics(args: argparse.Namespace) -> list[str]:
    return [n for item in (args.nics or []) for n in item.split(",") if n]


def worker_env(slot: hosts_mod.SlotInfo, *, base: dict[str, str], store_addr: str, store_port: int,
               key: bytes, knobs: dict[str, str], start_timeout: float, nics: Sequence[str] = (),
               tcp: bool = False, tls: Any = None) -> dict[str, str]:
    """The complete environment of one worker (the launcher → worker contract).

    ``tls``: the job's :class:`horovod.transport.tls.JobCredentials` (``--tls``), else None.
    """
    from horovod.transport import tls as tls_mod

    env = dict(base)
    for name in ("_HOROVOD_SECRET_KEY", tls_mod.CERT_ENV, tls_mod.KEY_ENV):  # only the launcher's own
        env.pop(name, None)
    env.update(knobs)
    env.update(slot.to_env())
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": store_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(store_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_START_TIMEOUT": config_mod.format_number(start_timeout),
        "PYTHONUNBUFFERED": "1",
        auth.SECRET_KEY_ENV: key.hex(),
    })
    if nics:
        env["HOROVOD_GLOO_IFACE"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    if tcp:
        env["NCCL_IB_DISABLE"] = "1"
    if tls is not None:
        env.update(tls_mod.worker_env(tls))
    return env


def tls_requested(args: argparse.Namespace, knobs: dict[str, str]) -> bool:
    """``--tls`` or ``HOROVOD_TLS`` in the workers' environment (``horovod.run``: its ``env``)."""
    env = dict(args.env if getattr(args, "env", None) is not None else os.environ)
    env.update(knobs)
    return bool(config_mod.read_env("HOROVOD_TLS", env))


def _command(args: argparse.Namespace) -> str | list[str]:
    # The argv runs directly (what upstream's /bin/sh -c of the quoted words amounts to).  A single word
    # with spaces (`horovodrun -np 2 "python a.py | tee x"`) is a shell line and runs via /bin/sh -c.
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if len(command) == 1 and any(c.isspace() for c in command[0]):
        return command[0]
    return command


def _run(args: argparse.Namespace, stop_event: threading.Event | None = None) -> list[Any] | None:
    """Run the job described by ``args`` (from :func:`parse_args` or ``horovod.run``).

    Returns None for a command, or the per-rank results when ``args.run_func`` is set.

    Raises:
        ValueError: bad arguments (upstream's texts).
        JobFailure: a worker exited non-zero (a ``RuntimeError`` with upstream's message).
        Interrupted: ``stop_event`` was set (the CLI's SIGTERM handler).
    """
    from horovod.runner import spawn

    if args.check_build:
        print(_check_build_text(args.verbose))
        return None
    # --- elastic hook: --min-np/--max-np/--host-discovery-script go to the elastic driver
    # (horovod/runner/elastic/driver.py); everything below is the static job.
    from horovod.runner.elastic.driver import is_elastic, run_elastic

    if is_elastic(args):
        run_elastic(args, stop_event)
        return None
    # --- end of elastic hook
    _validate(args)
    start_timeout = _start_timeout(args)
    hosts = _resolve_hosts(args)
    # Unlike upstream's Gloo path (which starts every listed slot), exactly -np ranks are started.
    slots = hosts_mod.get_host_assignments(hosts, args.num_proc, args.num_proc)
    local_names = {s.hostname for s in slots if hosts_mod.is_local_host(s.hostname)}
    remote = [h.hostname for h in hosts if any(s.hostname == h.hostname for s in slots)
              and h.hostname not in local_names]
    knobs = knobs_mod.knob_env(args)
    nics = _nics(args)
    tls_on = tls_requested(args, knobs)
    if args.use_mpi:
        if tls_on:
            raise ValueError("--tls (HOROVOD_TLS=1) encrypts the built-in transport and the rendezvous store; under "
                             "--mpi the job key, the data and the object pickles travel over Open MPI's transport, "
                             "which TLS does not cover and which is not encrypted. Run without --mpi to encrypt "
                             "everything between hosts, or without --tls (see docs/security.md).")
        return _run_mpi(args, hosts, knobs, start_timeout, remote)

    from horovod.runner import network
    from horovod.runner.rendezvous import RendezvousServer

    ssh_options = None
    if remote:
        from horovod.runner import ssh

        if args.verbose:
            logger.info("Filtering local host names.")
            logger.info("Remote host found: %s", " ".join(remote))
        ssh_options = ssh.SshOptions(args.ssh_port, args.ssh_identity_file,
                                     connect_timeout=max(1, min(10, start_timeout)))
        ssh.check_hosts(remote, ssh_options)
    iface = network.choose_interface(remote, nics)

    key = auth.make_secret_key()
    creds = job_tls = None
    if tls_on:
        from horovod.transport import tls as tls_mod

        creds = tls_mod.make_credentials()
        job_tls = tls_mod.JobTls(creds)
    store_addr = iface.address
    server = RendezvousServer(key, addr=store_addr, tls=job_tls)
    port = server.start()
    try:
        command = _run_func_command(args, server, store_addr, port) if args.run_func else _command(args)
        base = dict(args.env if getattr(args, "env", None) is not None else os.environ)
        cwd = os.getcwd()
        specs = [spawn.WorkerSpec(rank=s.rank, hostname=s.hostname, command=command,
                                  cwd=None if s.hostname in local_names else cwd,
                                  env=worker_env(s, base=base, store_addr=store_addr, store_port=port,
                                                 key=key, knobs=knobs, start_timeout=start_timeout, nics=nics,
                                                 tcp=args.tcp_flag, tls=creds))
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
        output = spawn.OutputOptions(prefix_timestamp=args.prefix_output_with_timestamp,
                                     output_dir=args.output_filename)
        spawner: spawn.Spawner = spawn.spawn_local
        if ssh_options is not None:
            from horovod.runner.ssh import SshSpawner

            remote_spawn = SshSpawner(ssh_options)

            def spawner(spec: spawn.WorkerSpec) -> Any:
                return spawn.spawn_local(spec) if spec.hostname in local_names else remote_spawn(spec)

        spawn.run_workers(specs, spawner=spawner, output=output, stop_event=stop_event)
        logger.info("horovodrun: all %d ranks exited successfully after %.1f s", len(specs),
                    time.monotonic() - started)
        if args.run_func:
            return _collect_results(server, len(slots))
        return None
    finally:
        server.stop()


def _check_build_text(verbose: bool) -> str:
    from horovod.runner.build_info import check_build

    return check_build(verbose)


def _run_func_command(args: argparse.Namespace, server: Any, addr: str, port: int) -> list[str]:
    import cloudpickle

    server.put(f"{RUN_FUNC_SCOPE}/func", cloudpickle.dumps(args.run_func))
    executable = args.executable or sys.executable
    return [executable, "-m", "horovod.runner.run_task", addr, str(port)]


def _collect_results(server: Any, size: int) -> list[Any]:
    import cloudpickle

    results = []
    for rank in range(size):
        payload = server.get(f"{RUN_RESULT_SCOPE}/{rank}")
        if payload is None:
            raise RuntimeError(f"Process {rank} exited successfully but did not return a result.")
        results.append(cloudpickle.loads(payload))
    return results


def _run_mpi(args: argparse.Namespace, hosts: list[hosts_mod.HostInfo], knobs: dict[str, str],
             start_timeout: float, remote: Sequence[str] = ()) -> list[Any] | None:
    from horovod.runner import mpi_run

    env = dict(args.env if getattr(args, "env", None) is not None else os.environ)
    env.update(knobs)
    env.update({"PYTHONUNBUFFERED": "1", "HOROVOD_START_TIMEOUT": config_mod.format_number(start_timeout)})
    if args.tcp_flag:
        env["NCCL_IB_DISABLE"] = "1"
    nics = _nics(args)
    if nics:
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    mpi_args = " ".join(a for a in (args.mpi_args, args.binding_args) if a) or None
    if not args.run_func:
        command = _command(args)
        command_text = command if isinstance(command, str) else shlex.join(command)
        cmd = mpi_run.mpi_command(args.num_proc, hosts, command_text, env, nics=nics,
                                  output_filename=args.output_filename, mpi_args=mpi_args, tcp=args.tcp_flag,
                                  ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file)
        mpi_run.exec_mpirun(cmd, env)
        return None  # not reached

    from horovod.runner.network import choose_interface
    from horovod.runner.rendezvous import RendezvousServer

    key = auth.make_secret_key()
    store_addr = choose_interface(remote, nics).address
    with RendezvousServer(key, addr=store_addr) as server:
        env[auth.SECRET_KEY_ENV] = key.hex()
        command_text = shlex.join(_run_func_command(args, server, store_addr, server.port))
        cmd = mpi_run.mpi_command(args.num_proc, hosts, command_text, env, nics=nics,
                                  output_filename=args.output_filename, mpi_args=mpi_args, tcp=args.tcp_flag,
                                  ssh_port=args.ssh_port, ssh_identity_file=args.ssh_identity_file)
        mpi_run.run_mpirun(cmd, env)
        return _collect_results(server, args.num_proc)


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
        args = parse_args(argv)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"horovodrun: error: {e}\n")
        sys.exit(2)
    _configure_logging(args.verbose)

    from horovod.runner.spawn import Interrupted, JobFailure

    stop_event = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_event.signum = signum  # type: ignore[attr-defined]
        stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        _run(args, stop_event=stop_event)
    except JobFailure as e:
        logger.error("%s", e)
        sys.exit(e.shell_exit_code)
    except Interrupted as e:
        logger.error("%s", e)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        logger.error("horovodrun interrupted (Ctrl-C); all workers terminated")
        sys.exit(130)
    except (ValueError, RuntimeError, OSError) as e:
        logger.error("horovodrun: error: %s", e)
        sys.exit(1)


if __name__ == "__main__":
    run_commandline()
