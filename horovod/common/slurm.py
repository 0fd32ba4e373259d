"""Joining a job that ``srun`` started without MPI: no mpi4py, or no PMI server its MPI can use (``srun``
without ``--mpi``, or ``--mpi=pmi2`` with an Open MPI built without PMI-2).

An srun step tells every task its place (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
``SLURM_NODEID``, ``SLURM_STEP_NODELIST``...) but gives the tasks no way to talk.  Without MPI to connect
them, :func:`detect` turns those variables into a :class:`~horovod.common.store_join.JoinEnv` and
:func:`horovod.common.store_join.join` meets the ranks through rank 0's store, on the first node of the step
(where srun puts task 0), exactly as under torchrun.  When it applies (:func:`wants_join`): a step of several
tasks, not told ``HOROVOD_CONTROLLER=mpi``, and either ``HOROVOD_CONTROLLER=gloo``, no PMI server, or no
mpi4py (``--mpi=pmi2`` counts as no PMI server when the MPI is an Open MPI that cannot use it:
:func:`horovod.transport.mpi.slurm_without_pmi`).  Otherwise MPI bootstraps the job as before (``srun
--mpi=pmix`` with mpi4py).

**The port** of rank 0's store (or MUNGE door) is ``HOROVOD_GLOO_RENDEZVOUS_PORT`` or the first free of four
derived from the job and step ids (:func:`~horovod.common.store_join.derived_ports`), so every task knows
them without talking; the others try each (a port another program holds does not stop the job).

**The key.**  ``HOROVOD_SECRET_KEY`` (exported before srun, which passes the environment on) is used when
set.  Otherwise, on one node, rank 0 shares a fresh key through a file of this user's (as under torchrun);
across nodes through **MUNGE**, the authentication service Slurm itself runs on every node
(:class:`MungeDoor`): rank 0 answers each connection to its port with a fresh credential that carries the
key and that only this user can decode (``munge --restrict-uid``; ``unmunge`` also checks it was made by this
user, within its time to live, and never decoded before).  The door reads nothing from whoever connects, and a
rank reads at most :data:`_MAX_CREDENTIAL` bytes from it and trusts nothing it did not decode and check.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping

from horovod.base.config import read_env, start_timeout
from horovod.common.store_join import JoinEnv, derived_ports, ports_text
from horovod.transport.store import REFUSAL_HEADER

__all__ = ["expand_hostlist", "wants_join", "detect", "MungeDoor"]

log = logging.getLogger(__name__)

_NAMES = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "tasks on this node", "the step's first node")
_MAX_CREDENTIAL = 16384
"""Bytes a rank reads from rank 0's door at most (a credential of the ~120-byte payload is ~300)."""
_POLL = 0.1


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist syntax expanded: ``"node[01-03,7],gpu1"`` → node01 node02 node03 node7 gpu1.

    Several bracket groups in one name expand as their product (``r[1-2]n[1-2]``), zero padding as written.

    Raises:
        ValueError: unbalanced brackets or a range that is not numbers.
    """
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(spec + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            name = spec[start:i].strip()
            if name:
                hosts += _expand_name(name, spec)
            start = i + 1
        if depth not in (0, 1):
            raise ValueError(f"malformed Slurm host list {spec!r}")
    if depth:
        raise ValueError(f"malformed Slurm host list {spec!r}")
    return hosts


def _expand_name(name: str, spec: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    out: list[str] = []
    for part in match.group(1).split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not (hi.isdigit() and int(hi) >= int(lo))):
            raise ValueError(f"malformed Slurm host list {spec!r}: {part!r} is not a number or a rising range")
        for n in range(int(lo), int(hi or lo) + 1):
            out += _expand_name(f"{head}{n:0{len(lo)}d}{tail}", spec)
    return out


def wants_join(env: Mapping[str, str] | None = None) -> bool:
    """An srun step of several tasks that MPI will not connect (module doc): join through rank 0's store."""
    from horovod.transport.mpi import detect_launch, mpi_available, slurm_without_pmi

    env = os.environ if env is None else env
    launch = detect_launch(env)
    if launch is None or launch.kind != "slurm" or launch.size == 1:
        return False
    from horovod.common.elastic_init import launched_by_driver

    if launched_by_driver(env):
        return False
    controller = read_env("HOROVOD_CONTROLLER", env)
    if controller:
        return controller == "gloo"
    return slurm_without_pmi(launch, env) or not mpi_available()


def _node_address(node: str) -> str:
    """``node`` when it resolves, else its ``NodeAddr`` from ``scontrol`` (node names need not be host names)."""
    try:
        socket.getaddrinfo(node, None, type=socket.SOCK_STREAM)
        return node
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    match = re.search(r"\bNodeAddr=(\S+)", out)
    if match is None:
        raise ValueError(f"the first node of this srun step, {node!r} (SLURM_STEP_NODELIST), where task 0 runs "
                         "Horovod's rendezvous store, does not resolve to an address and `scontrol show node` "
                         "names no NodeAddr for it")
    return match.group(1)


def detect(env: Mapping[str, str] | None = None) -> JoinEnv | None:
    """The step's description of this task when :func:`wants_join`; None otherwise.

    Raises:
        ValueError: the step's variables are inconsistent, or task 0 is not on the step's first node.
    """
    env = os.environ if env is None else env
    if not wants_join(env):
        return None
    from horovod.transport.mpi import detect_launch

    launch = detect_launch(env)
    assert launch is not None
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
    if not nodes:
        raise ValueError(f"srun started {launch.size} tasks but SLURM_STEP_NODELIST is not set: Horovod finds "
                         "task 0's store on the step's first node")
    this_node = env.get("SLURMD_NODENAME", "").strip()
    if launch.rank == 0 and this_node and this_node != nodes[0]:
        raise ValueError(f"srun placed task 0 on {this_node}, not on the step's first node {nodes[0]} "
                         f"(SLURM_STEP_NODELIST={env.get('SLURM_STEP_NODELIST')!r}): Horovod's tasks look for "
                         "task 0 on the first node (srun's block and cyclic distributions put it there)")
    job_id = env.get("SLURM_JOB_ID", "").strip()
    step_id = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    launch_id = f"slurm {job_id}.{step_id}"
    ports = derived_ports(launch_id)
    node_id = env.get("SLURM_NODEID", "").strip()
    master = _node_address(nodes[0])
    local_size = launch.local_size if len(nodes) > 1 else launch.size
    from horovod.base import auth

    key_set = bool(env.get(auth.SECRET_KEY_ENV, "").strip())
    door = peer = None
    missing_key = ""
    if len(nodes) > 1:
        if shutil.which("munge") and shutil.which("unmunge"):
            user_port = read_env("HOROVOD_GLOO_RENDEZVOUS_PORT", env)
            peer = MungeDoor(master, user_port or ports[0], f"{job_id}.{step_id}", launch.rank,
                             () if user_port else ports[1:])
            door = None if key_set else peer
        elif not key_set:
            missing_key = (
                f"srun started {launch.size} tasks on {len(nodes)} nodes without MPI, and Horovod has no key to "
                "authenticate them: set HOROVOD_SECRET_KEY (the same random hex key in every task: export "
                "HOROVOD_SECRET_KEY=$(python -c 'import secrets; print(secrets.token_hex(32))') before srun), or "
                "install MUNGE's munge/unmunge (Slurm's own authentication) on the nodes, or run srun "
                "--mpi=pmix with mpi4py installed.")
    return JoinEnv(
        launcher="srun", master_addr=master, rank=launch.rank, world_size=launch.size,
        local_rank=launch.local_rank, local_world_size=local_size,
        node=int(node_id) if node_id.isdigit() else None, launch_id=launch_id,
        store_port=ports[0], spare_ports=ports[1:],
        store_port_source=f"the ports derived from the job and step ids ({job_id}.{step_id})",
        names=_NAMES, hostname=this_node, missing_key=missing_key, key_channel=door, peer_channel=peer)


class MungeDoor:
    """The key channel across nodes under Slurm: rank 0's key, in MUNGE credentials only this user can decode.

    Rank 0 listens on its node's address at the step's port and answers every connection with a fresh
    credential (one per connection: MUNGE refuses a credential decoded twice), restricted to this user's uid,
    carrying the launch, the store's address and port, and the key; it reads nothing from the peer.  The
    other ranks connect, read at most :data:`_MAX_CREDENTIAL` bytes, and accept only what ``unmunge`` decodes
    as made by this user, for this launch.
    """

    holds_port = True

    def __init__(self, master_addr: str, port: int, launch: str, rank: int, spare_ports: tuple[int, ...] = ()) -> None:
        self.master_addr, self.port, self.launch, self.rank = master_addr, port, launch, rank
        self.ports = (port, *spare_ports)  # task 0 listens on the first free (derived_ports); ranks try each
        self._payload = b""
        self._listeners: list[socket.socket] = []
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------------------- rank 0
    def publish(self, addrs: list[str], port: int, key: bytes) -> None:
        self._payload = json.dumps({"launch": self.launch, "addr": addrs[0], "port": port,
                                    "key": key.hex()}).encode()
        _munge(self._payload)  # munged answers on this node, or the error names it now
        for i, port in enumerate(self.ports):
            self.port = port
            try:
                for a in addrs:  # where the store listens: where the other tasks reach this node
                    family = socket.AF_INET6 if ":" in a else socket.AF_INET
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    self._listeners.append(sock)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((a, self.port))
                    sock.listen(128)
                break
            except OSError as e:
                self.close()
                if e.errno == errno.EADDRINUSE and i + 1 < len(self.ports):
                    continue
                raise ValueError(f"task 0 could not listen on {a} {ports_text(self.ports)} to hand the job key to "
                                 "the other tasks (the ports derived from the job and step ids, or "
                                 f"HOROVOD_GLOO_RENDEZVOUS_PORT): {e}; set HOROVOD_GLOO_RENDEZVOUS_PORT to a free "
                                 "port, exported before srun") from e
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="horovod-munge-door", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self._stop_r, *self._listeners], [], [])
            if self._stop_r in ready:
                return
            for sock in ready:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                with conn:
                    try:
                        conn.settimeout(5.0)
                        conn.sendall(_munge(self._payload))
                    except (OSError, ValueError) as e:
                        log.debug("MUNGE door: %s", e)

    def close(self) -> None:
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r, self._stop_w = -1, -1

    # ---------------------------------------------------------------------------------------- other ranks
    def fetch(self, deadline: float) -> tuple[str, int, bytes]:
        """Task 0's (address, port, key), trying each of :attr:`ports` in turn until ``deadline``."""
        last = "nothing listened yet"
        tries = 0
        while True:
            self.port = self.ports[tries % len(self.ports)]
            try:
                return self._fetch_once()
            except _StoreAtTheDoor as e:  # task 0 has the key: waiting changes nothing
                raise ValueError(str(e)) from None
            except (OSError, ValueError) as e:
                last = f"{self.port}: {e}"
            if time.monotonic() >= deadline:
                where = (f"{self.master_addr}:{self.port}" if len(self.ports) == 1 else
                         f"{self.master_addr} ({ports_text(self.ports)})")
                raise ValueError(
                    f"rank {self.rank} could not get the job key from task 0 at {where} within "
                    f"the start timeout ({start_timeout():g} s): {last}.  Did task 0 call hvd.init(), and is the "
                    "port open between the nodes?  (srun started these tasks on several nodes without MPI and "
                    "without HOROVOD_SECRET_KEY, so task 0 hands out a fresh key in MUNGE credentials.)")
            tries += 1
            if tries % len(self.ports) == 0:
                time.sleep(_POLL)

    def refetch(self) -> tuple[str, int, bytes] | None:
        try:
            return self._fetch_once()
        except (OSError, ValueError):
            return None

    def serves(self) -> bool:
        """Something answers at the door's port with a MUNGE credential: task 0 hands out a key (it has none).

        Reads only the credential's armor prefix; the credential itself is neither decoded nor kept."""
        for port in self.ports:
            try:
                with socket.create_connection((self.master_addr, port), timeout=2.0) as sock:
                    head = b""
                    while len(head) < len(_ARMOR) and (chunk := sock.recv(len(_ARMOR) - len(head))):
                        head += chunk
            except OSError:
                continue
            if head == _ARMOR:
                return True
        return False

    def _fetch_once(self) -> tuple[str, int, bytes]:
        chunks: list[bytes] = []
        received = 0
        with socket.create_connection((self.master_addr, self.port), timeout=5.0) as sock:
            while received <= _MAX_CREDENTIAL:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
        if received > _MAX_CREDENTIAL:
            raise ValueError(f"{self.master_addr}:{self.port} sent more than {_MAX_CREDENTIAL} bytes: not a "
                             "Horovod task 0 of this user's")
        answer = b"".join(chunks)
        if answer.startswith(b"HTTP/1.") and f"\r\n{REFUSAL_HEADER}: refused\r\n".encode() in answer:
            raise _StoreAtTheDoor(
                f"rank {self.rank} has no HOROVOD_SECRET_KEY but task 0 of this srun step (at {self.master_addr}:"
                f"{self.port}) runs Horovod's rendezvous store there, as it does when it has the key, instead of "
                "handing out a fresh key in MUNGE credentials.  Set the same HOROVOD_SECRET_KEY in every task "
                "(export it before srun, which passes it on), or in none.")
        payload = _unmunge(b"".join(chunks))
        try:
            data = json.loads(payload)
            found = str(data["addr"]), int(data["port"]), bytes.fromhex(data["key"])
            launch = data["launch"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"a credential of this user's at {self.master_addr}:{self.port} is not a Horovod "
                             f"key: {e}") from e
        if launch != self.launch:
            raise ValueError(f"{self.master_addr}:{self.port} serves the key of another launch of this user's "
                             f"({launch}, not {self.launch}): set HOROVOD_GLOO_RENDEZVOUS_PORT to another port")
        return found


class _StoreAtTheDoor(ValueError):
    """Task 0 runs its store where a rank without the key expected the MUNGE door: task 0 has the key."""


_ARMOR = b"MUNGE:"
"""How every MUNGE credential begins."""


def _munge(payload: bytes) -> bytes:
    """A credential of ``payload`` that only this user can decode.

    Raises:
        ValueError: ``munge`` failed (munged not running on this node...); the text has its error.
    """
    try:
        done = subprocess.run(["munge", "--restrict-uid", str(os.getuid())], input=payload, capture_output=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"munge failed: {e}") from e
    if done.returncode != 0:
        raise ValueError(f"munge failed (exit {done.returncode}): "
                         f"{done.stderr.decode(errors='replace').strip()}: is munged running on this node?  Or set "
                         "HOROVOD_SECRET_KEY, exported before srun, the same random hex key in every task")
    return done.stdout


def _unmunge(credential: bytes) -> bytes:
    """The payload of a credential made by this user for this user (``unmunge`` also refuses replays and
    expired ones).

    Raises:
        ValueError: it does not decode, or another user made it.
    """
    try:
        done = subprocess.run(["unmunge", "--numeric", "--keys=UID", "--metadata=/dev/stderr"], input=credential,
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"unmunge failed: {e}") from e
    err = done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise ValueError(f"its credential did not decode (unmunge exit {done.returncode}: {err.strip()[:200]})")
    match = re.search(r"^UID:\s+(\d+)\s*$", err, re.MULTILINE)
    if match is None or int(match.group(1)) != os.getuid():
        raise ValueError(f"its credential was made by uid {match.group(1) if match else '?'}, not this user's "
                         f"({os.getuid()})")
    return done.stdout
