"""Joining a job whose launcher has no rendezvous of Horovod's (torchrun, a PyTorchJob, srun without MPI).

The launcher gave every process its rank, the job's size, its node and where rank 0 runs
(:class:`JoinEnv`, made by :mod:`horovod.common.torchrun` and :mod:`horovod.common.slurm`).
:func:`join` turns that into the launcher's contract (``HOROVOD_RANK``... in docs/architecture.md) so that
the rest of ``hvd.init()`` is unchanged:

1. **Store.**  Rank 0 runs Horovod's authenticated rendezvous store (:mod:`horovod.runner.rendezvous`) in
   its own process, for the process's lifetime (re-``init()`` uses it too).  It listens on the addresses of
   this host that ``master_addr`` resolves to, at ``store_port`` (or ``HOROVOD_GLOO_RENDEZVOUS_PORT``) when
   the key is given, else at any free port that the key channel shares.  When ``master_addr`` is loopback
   on rank 0 but the job spans hosts (a PyTorchJob gives its master pod ``MASTER_ADDR=localhost``) it also
   listens on every non-loopback IPv4 address of the host (or on ``HOROVOD_GLOO_IFACE``'s), never on
   ``0.0.0.0``.
2. **Key.**  ``HOROVOD_SECRET_KEY`` set (the same hex key, >= 16 bytes, in every process: e.g. a Kubernetes
   Secret) is used by every rank.  Otherwise rank 0 makes a fresh key and shares it, with the store's
   address and port, through a *key channel* only this user can read:

   * every rank on one host: a file readable by this user only, ``<tmp>/horovod-<launcher>-<uid>/<hash of
     the launch>`` (the directory must be ours and mode 0700).  A stale file of an earlier job is
     recognised because the store refuses its key, and read again;
   * across hosts under Slurm: a MUNGE credential that only this user can decode (:mod:`horovod.common.slurm`);
   * otherwise none: the key is required, and ``JoinEnv.missing_key`` says how to give one.

   Rank 0 closes the channel as soon as every rank's record reached its store (they all read it by then),
   and at exit if the job never formed.
3. **Layout.**  Every rank puts a record (rank, size, host, node, the launcher's local rank) in the store;
   rank 0 checks them (same size, local ranks ``0..local_size-1`` on each node) and publishes the layout or
   the error; ranks keep the launcher's rank and local rank; without a local rank (a PyTorchJob without
   torchrun) local ranks are assigned per host name in rank order; cross ranks follow upstream's rule (the
   node's index among the nodes with that local rank).
4. **Export.**  ``HOROVOD_RANK/SIZE/LOCAL_*/CROSS_*/HOSTNAME``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT`` and
   ``HOROVOD_SECRET_KEY`` go into ``os.environ``; ``hvd.init()`` continues as under horovodrun.  A rank
   whose route to ``master_addr`` is loopback in a multi-host job gets ``HOROVOD_GLOO_IFACE`` set to the
   interface that routes to the other hosts (unless you set it), so it never advertises 127.0.0.1.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from horovod.base.config import read_env, start_timeout
from horovod.transport import netif

__all__ = ["JoinEnv", "KeyChannel", "join", "key_file_path", "derived_port", "derived_ports", "ports_text",
           "MIN_KEY_BYTES"]

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
"""Shortest ``HOROVOD_SECRET_KEY`` accepted when joining (the launcher's own keys are 32 bytes)."""

_RECORD = "join/{launch}/host.{rank}"
_LAYOUT = "join/{launch}/layout"
_OWNER = "join/{launch}/store"
"""Put by rank 0 in its store as soon as it listens: a rank that reached another job's store (same key, a
port that collides) sees it missing and tries the next port."""
"""Store keys of a launch: ``{launch}`` is a hash of ``JoinEnv.launch_id``, so that a process of another launch
that reaches this store (the same ``HOROVOD_SECRET_KEY`` and port in two srun steps, or two jobs whose derived
ports collide) never takes a rank's place in this one, followed by the attempt (``.<n>``, see ``_attempts``)."""
_POLL = 0.1
_ERROR_LINGER = 2.0
_PORT_BASE, _PORT_SPAN = 20000, 12000

_server: Any = None  # rank 0's RendezvousServer, kept for the life of the process
_channel: KeyChannel | None = None  # rank 0's open key channel, closed once every rank joined (or at exit)
_sigterm_previous: Any = None  # the SIGTERM handler that _on_sigterm replaced while the channel is open
_attempts = 0
"""How many of this process's joins put its record in rank 0's store.  ``hvd.init()`` again after a failed join
meets the others under the next attempt's keys: the failed one's layout (its error) and records stay in rank 0's
store, and were read again at once, so that no retry could ever succeed.  A join that failed before its record
reached the store (rank 0 not up yet) does not count: that rank's retry meets rank 0's first attempt."""


@dataclasses.dataclass(frozen=True)
class JoinEnv:
    """What the launcher told this process, and how to name it in errors."""

    launcher: str
    """"torchrun", "srun": named in messages and in the key file's directory."""
    master_addr: str
    """The host rank 0 runs on, as the launcher names it."""
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    node: int | None = None
    """The node's index (torchrun's ``GROUP_RANK``, Slurm's ``SLURM_NODEID``)."""
    launch_id: str = ""
    """Tells this launch from any other of the same user (names the key file, checked in a MUNGE payload)."""
    store_port: int | None = None
    """rank 0's store port when the key is given (``HOROVOD_GLOO_RENDEZVOUS_PORT`` wins); None: refused then."""
    store_port_source: str = ""
    """Where ``store_port`` comes from ("MASTER_PORT + 1"), or why there is none."""
    spare_ports: tuple[int, ...] = ()
    """Where rank 0's store listens when ``store_port`` is taken (derived ports: :func:`derived_ports`)."""
    names: tuple[str, str, str, str] = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    """The launcher's variables for the rank, the size, the local size and rank 0's host, as errors name them."""
    hostname: str = ""
    """This process's host as the launcher names it (Slurm's ``SLURMD_NODENAME``); "": the host name."""
    missing_key: str = ""
    """The error when no key is set and no key channel can share one (names how to give a key)."""
    key_channel: KeyChannel | None = None
    """A :class:`KeyChannel` for a job across hosts without ``HOROVOD_SECRET_KEY`` (one host: a file)."""
    peer_channel: KeyChannel | None = None
    """The key channel rank 0 would open across hosts without ``HOROVOD_SECRET_KEY``, also when this process
    has the key: a rank with the key that cannot reach the store checks it (:meth:`KeyChannel.serves`) to
    tell that rank 0 has no key.  None: the same as ``key_channel`` (one host: the file)."""

    @property
    def one_host(self) -> bool:
        """The launcher put every rank on this host."""
        return self.local_world_size == self.world_size


class KeyChannel(Protocol):
    """How rank 0 hands a fresh key, with its store's address and port, to the other ranks, and only them."""

    holds_port: bool
    """The channel listens at the launch's fixed port (``HOROVOD_GLOO_RENDEZVOUS_PORT``...), so the store
    takes any free one."""

    def publish(self, addrs: list[str], port: int, key: bytes) -> None:
        """Rank 0: make (address, port, key) readable by the other ranks of this launch.  ``addrs``: where the
        store listens, the first one the address to hand out."""

    def fetch(self, deadline: float) -> tuple[str, int, bytes]:
        """Another rank: what rank 0 published (waits for it until ``deadline``; ValueError then)."""

    def refetch(self) -> tuple[str, int, bytes] | None:
        """After rank 0's store refused the key fetched: what the channel holds now (None: nothing new)."""

    def close(self) -> None:
        """Rank 0: every rank has the key (or the process exits); idempotent."""

    def serves(self) -> bool:
        """Another rank, which has ``HOROVOD_SECRET_KEY``: rank 0 of this launch hands out a key through this
        channel now, so it has none (the key was set in some processes only)."""


def derived_port(launch_id: str) -> int:
    """A port every process of a launch computes alike from its id, for rank 0's store (or its key channel):
    20000-31999, below Linux's ephemeral ports."""
    digest = hashlib.sha256(launch_id.encode()).digest()
    return _PORT_BASE + int.from_bytes(digest[:4], "big") % _PORT_SPAN


DERIVED_PORTS = 4
"""Ports derived per launch: rank 0 listens on the first one free, the others try each in turn, so a port
taken by another program (another job's whose port collides, a service, a squatter) does not stop the job."""


def ports_text(ports: Sequence[int | None]) -> str:
    """"port 20001" or "ports 20001, 23456, ..." for errors."""
    return f"port {ports[0]}" if len(ports) == 1 else f"ports {', '.join(map(str, ports))}"


def derived_ports(launch_id: str) -> tuple[int, ...]:
    """:func:`derived_port` of the launch, then :data:`DERIVED_PORTS` - 1 more, all distinct."""
    ports = [derived_port(launch_id)]
    i = 1
    while len(ports) < DERIVED_PORTS:
        p = derived_port(f"{launch_id}#{i}")
        if p not in ports:
            ports.append(p)
        i += 1
    return tuple(ports)


# ---------------------------------------------------------------------------------------------- key file
def key_file_path(env: JoinEnv) -> str:
    """Where rank 0 of a one-host job leaves the key and the store's address for the other ranks."""
    ident = f"{env.launch_id}|{env.master_addr}".encode()
    return os.path.join(_private_dir(env.launcher), hashlib.sha256(ident).hexdigest()[:32] + ".json")


def _private_dir(launcher: str) -> str:
    """``<tmp>/horovod-<launcher>-<uid>``, created 0700; refused unless it is a directory of ours, 0700."""
    path = os.path.join(tempfile.gettempdir(), f"horovod-{launcher}-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a directory owned by this user with mode 0700 (owner uid "
                              f"{st.st_uid}, mode {stat.filemode(st.st_mode)}); Horovod keeps a {launcher} job's "
                              "key there: remove it, or set HOROVOD_SECRET_KEY in every worker's environment")
    return path


def _pid_namespace() -> str:
    """This process's pid namespace: a pid in a key file is only checked in the namespace that wrote it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _remove_stale_key_files(directory: str) -> None:
    """Remove the key files of rank 0s that died before their job joined (SIGKILL: nothing of theirs ran).

    Only files whose writer's pid namespace is this one (a container sharing /tmp counts pids of its own)
    and whose pid no longer exists: a live job's file is never touched.
    """
    own_ns = _pid_namespace()
    if not own_ns:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            with open(path) as f:
                data = json.loads(f.read(4096))
            if data.get("pidns") != own_ns:
                continue
            os.kill(int(data["pid"]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue


class KeyFile:
    """The key channel of a job on one host: a 0600 file in a 0700 directory of this user's.  Rank 0 removes
    it once every rank joined (or on SIGTERM); one left by a rank 0 killed outright is removed by the next."""

    holds_port = False

    def __init__(self, env: JoinEnv) -> None:
        self._env = env
        self.path = key_file_path(env)
        self._written = False

    def publish(self, addrs: list[str], port: int, key: bytes) -> None:
        _remove_stale_key_files(os.path.dirname(self.path))
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"addr": addrs[0], "port": port, "key": key.hex(), "pid": os.getpid(),
                       "pidns": _pid_namespace()}, f)
        os.replace(tmp, self.path)
        self._written = True

    def refetch(self) -> tuple[str, int, bytes] | None:
        try:
            st = os.lstat(self.path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                return None
            with open(self.path) as f:
                data = json.load(f)
            return str(data["addr"]), int(data["port"]), bytes.fromhex(data["key"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def fetch(self, deadline: float) -> tuple[str, int, bytes]:
        """The file's (address, port, key) once it exists (a stale one is replaced later by rank 0)."""
        env = self._env
        while True:
            found = self.refetch()
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"rank {env.rank} waited {start_timeout():g} s for rank 0 of this {env.launcher} job to publish "
                    f"its rendezvous store in {self.path}: did {env.names[0]}=0 call hvd.init()?  (Every rank is on "
                    f"this host, {env.names[2]} == {env.names[1]}, so rank 0 shares a fresh key through that file; "
                    "set HOROVOD_SECRET_KEY to share one yourself.)  Or does rank 0 have HOROVOD_SECRET_KEY while "
                    "this rank has none?  Set the same key in every rank, or in none.")
            time.sleep(_POLL)

    def serves(self) -> bool:
        try:
            with open(self.path) as f:
                pid = int(json.load(f)["pid"])
            if os.lstat(self.path).st_uid != os.getuid():
                return False
            os.kill(pid, 0)  # a file of a live rank 0, not one left by a killed job
            return True
        except PermissionError:
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def close(self) -> None:
        if not self._written:
            return
        self._written = False
        try:
            with open(self.path) as f:
                if json.load(f).get("pid") == os.getpid():
                    os.unlink(self.path)
        except (OSError, ValueError, AttributeError):
            pass


# ---------------------------------------------------------------------------------------------- addresses
def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0]).split("%", 1)[0]
        if addr not in out:
            out.append(addr)
    return out


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _store_addresses(env: JoinEnv) -> list[str]:
    """The addresses rank 0's store listens on (the first one is what rank 0 itself connects to)."""
    local = netif.local_addresses()
    mine = [a for a in _resolve(env.master_addr) if a in local]
    mine.sort(key=lambda a: ":" in a)  # IPv4 first
    if env.one_host:
        return mine[:1] or ["127.0.0.1"]
    if not mine:
        resolved = _resolve(env.master_addr) or "nothing"
        raise ValueError(f"{env.names[3]}={env.master_addr!r} resolves to {resolved}, none of which is an address "
                         f"of this host ({socket.gethostname()}), where {env.names[0]}=0 runs: Horovod's rendezvous "
                         f"store runs in rank 0 and listens where {env.names[3]} points")
    if all(_is_loopback(a) for a in mine):
        # A PyTorchJob's master pod has MASTER_ADDR=localhost while the others reach it by its service name.
        iface = read_env("HOROVOD_GLOO_IFACE")
        extra = [a for a, name in local.items() if ":" not in a and not _is_loopback(a)
                 and (not iface or name == iface)]
        if not extra:
            raise ValueError(f"{env.names[3]}={env.master_addr!r} is loopback on rank 0 but the job spans hosts "
                             f"({env.names[1]}={env.world_size}, {env.names[2]}={env.local_world_size}) and this "
                             "host has no other IPv4 address" + (f" on HOROVOD_GLOO_IFACE={iface}" if iface else ""))
        mine = mine[:1] + extra
    return mine


def _start_store(env: JoinEnv, key: bytes, ports: list[int | None]) -> tuple[list[str], int]:
    """Start rank 0's store on the first of ``ports`` free (None: any); returns (its addresses, the first one
    what rank 0 connects to; its port)."""
    global _server
    from horovod.runner.rendezvous import RendezvousServer
    from horovod.transport import tls as tls_mod

    addrs = _store_addresses(env)
    where = "HOROVOD_GLOO_RENDEZVOUS_PORT" if read_env("HOROVOD_GLOO_RENDEZVOUS_PORT") else env.store_port_source
    for i, port in enumerate(ports):
        server = RendezvousServer(key, addr=addrs[0], port=port or 0, tls=tls_mod.resolve(None))
        try:
            bound = server.start()
            for a in addrs[1:]:
                _listen_on(server, a, bound)
            break
        except OSError as e:
            server.stop()
            if e.errno == errno.EADDRINUSE and i + 1 < len(ports):
                log.debug("%s job: port %s taken (%s), rank 0's store tries port %s", env.launcher, port, e,
                          ports[i + 1])
                continue
            raise ValueError(f"rank 0 could not listen on {addrs} {ports_text(ports)} for Horovod's rendezvous store "
                             f"({where}): {e}; set HOROVOD_GLOO_RENDEZVOUS_PORT to a free port, the same on every "
                             "rank") from e
    _server = server
    log.debug("%s job: rendezvous store of rank 0 listening on %s", env.launcher, server.addresses)
    return addrs, bound


def _listen_on(server: Any, addr: str, port: int) -> None:
    """``RendezvousServer.listen`` on the first listener's port (the other hosts reach rank 0's host at it)."""
    with server._lock:
        if addr in server._listeners:
            return
        sock = server._bind(addr, port)
        server._listeners[addr] = sock
        server._new_listeners.append(sock)
    server._wake()


# ---------------------------------------------------------------------------------------------- layout
def _layout(records: list[dict[str, Any]], world_size: int) -> list[list[int]]:
    """``[local_rank, local_size, cross_rank, cross_size]`` per rank, or ValueError naming the problem."""
    for r, rec in enumerate(records):
        if rec["world_size"] != world_size:
            raise ValueError(f"rank {r} has WORLD_SIZE={rec['world_size']} but rank 0 has WORLD_SIZE={world_size}")
    given = [rec["local_rank"] is not None for rec in records]
    if any(given) and not all(given):
        raise ValueError(f"rank {given.index(not given[0])} has {'no ' if given[0] else ''}LOCAL_RANK while rank 0 "
                         f"{'has one' if given[0] else 'has none'}: start every rank the same way")
    nodes: dict[str, list[int]] = {}
    for r, rec in enumerate(records):
        nodes.setdefault(rec["node"], []).append(r)
    local = [[0, 0] for _ in records]
    for node, ranks in nodes.items():
        if given[0]:
            locals_ = sorted(records[r]["local_rank"] for r in ranks)
            sizes = {records[r]["local_size"] for r in ranks} - {None}
            if locals_ != list(range(len(ranks))) or sizes - {len(ranks)}:
                shown = {r: (records[r]["local_rank"], records[r]["local_size"]) for r in ranks}
                raise ValueError(f"node {node} has ranks {ranks} whose (LOCAL_RANK, LOCAL_WORLD_SIZE) are {shown}: "
                                 f"expected local ranks 0..{len(ranks) - 1} with LOCAL_WORLD_SIZE={len(ranks)}")
            for r in ranks:
                local[r] = [records[r]["local_rank"], len(ranks)]
        else:
            for i, r in enumerate(ranks):
                local[r] = [i, len(ranks)]
    by_local: dict[int, list[str]] = {}
    for node, ranks in nodes.items():  # nodes in the order of their first rank (upstream's host order)
        for r in ranks:
            by_local.setdefault(local[r][0], []).append(node)
    return [[lr, ls, by_local[lr].index(records[r]["node"]), len(by_local[lr])]
            for r, (lr, ls) in enumerate(local)]


# ---------------------------------------------------------------------------------------------- join
def join(env: JoinEnv) -> None:
    """Meet the other ranks through rank 0's store and export the launcher's variables (module doc).

    Raises:
        ValueError: no usable key, a store that cannot listen, inconsistent launcher variables across ranks
            (the text names the rank and the variable), or the ranks did not meet within the start timeout.
    """
    global _channel, _attempts
    from horovod.base import auth
    from horovod.transport.store import StoreClient, StoreError, UnprovenAnswer

    if env.world_size == 1:
        return
    timeout = start_timeout()
    deadline = time.monotonic() + timeout
    key = auth.secret_key_from_env()
    if key is not None and len(key) < MIN_KEY_BYTES:
        raise ValueError(f"HOROVOD_SECRET_KEY has {len(key)} bytes; under {env.launcher} it must be at least "
                         f"{MIN_KEY_BYTES} random bytes in hex, the same on every rank: "
                         "python -c 'import secrets; print(secrets.token_hex(32))'")
    channel: KeyChannel | None = None
    if key is None:
        channel = KeyFile(env) if env.one_host else env.key_channel
        if channel is None:
            raise ValueError(env.missing_key)
    port = None if channel is not None and channel.holds_port else read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")
    ports: list[int | None] = [port]
    if port is None and channel is None:
        if env.store_port is None:
            raise ValueError(f"{env.store_port_source}: set HOROVOD_GLOO_RENDEZVOUS_PORT to a free port for "
                             "Horovod's rendezvous store, the same on every rank")
        port = env.store_port
        ports = [port, *env.spare_ports]

    launch_hash = hashlib.sha256(env.launch_id.encode()).hexdigest()[:16]
    if env.rank == 0:
        if _server is not None:  # an earlier init() of this process failed after starting it
            addr, port, key = _server.addr, _server.port, _server.key
        else:
            key = key or auth.make_secret_key()
            addrs, port = _start_store(env, key, ports)
            addr = addrs[0]
            StoreClient(addr, port, key, timeout=timeout).put(_OWNER.format(launch=launch_hash), b"")
            if channel is not None:
                channel.publish(addrs, port, key)
                _channel = channel
                atexit.register(channel.close)
                _close_on_sigterm()
    elif channel is None:
        addr = env.master_addr
    else:
        addr, port, key = channel.fetch(deadline)
    assert key is not None and port is not None

    hostname = read_env("HOROVOD_HOSTNAME") or env.hostname or socket.gethostname()
    launch = f"{launch_hash}.{_attempts + 1}"
    token = secrets.token_hex(8)
    next_check = 0.0  # when a rank with the key next looks whether rank 0 hands out one (it has none then)
    record = {"rank": env.rank, "world_size": env.world_size, "host": hostname,
              "node": f"group {env.node}" if env.node is not None and env.local_rank is not None else hostname,
              "local_rank": env.local_rank, "local_size": env.local_world_size,
              "addr": netif.route_source(addr) or "", "token": token}
    tries = 0
    while True:
        client = StoreClient(addr, port, key, timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        try:
            if channel is None and not client.exists(_OWNER.format(launch=launch_hash)):
                raise StoreError(f"the rendezvous store at {addr}:{port} is another job's (one with the same key)")
            client.put(_RECORD.format(launch=launch, rank=env.rank), json.dumps(record).encode())
            _attempts += 1
            break
        except StoreError as e:
            if isinstance(e, UnprovenAnswer) and e.refused and channel is None:
                raise ValueError(f"rank {env.rank}: the rendezvous store of rank 0 at {addr}:{port} refused this "
                                 "rank's key: every rank needs the same HOROVOD_SECRET_KEY") from e
            if channel is None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 1.0
                _refuse_if_rank_0_has_no_key(env, e)
            if time.monotonic() >= deadline:
                where = f"{addr}:{port}" if len(ports) == 1 else f"{addr} ({ports_text(ports)})"
                raise ValueError(f"rank {env.rank} could not reach the rendezvous store of rank 0 at {where} "
                                 f"within the start timeout ({timeout:g} s): {e}.  Is {env.names[0]}=0 running "
                                 "hvd.init(), and is the port open between the hosts?") from e
            tries += 1
            if channel is None and len(ports) > 1:  # rank 0 listens on the first of them it found free
                port = ports[tries % len(ports)]
                if tries % len(ports):
                    continue
            time.sleep(_POLL)
            if channel is not None:  # a stale file of an earlier job: rank 0 replaces it when its store is up
                addr, port, key = channel.refetch() or (addr, port, key)
    client = StoreClient(addr, port, key, timeout=timeout)

    if env.rank == 0:
        layout = _gather_layout(client, env, launch, deadline, timeout)
        # Every rank's record is in: each has read the key by now, so the channel closes (and the SIGTERM
        # handler of _close_on_sigterm goes): a key file then never outlives the join, even under SIGKILL.
        _close_channel()
    else:
        try:  # rank 0 decides within its own start timeout, which began at most ``timeout`` ago
            answer = json.loads(client.get(_LAYOUT.format(launch=launch),
                                           timeout=max(0.0, deadline + timeout - time.monotonic())))
        except StoreError as e:
            if "unreachable" in str(e):
                raise ValueError(f"rank {env.rank}: rank 0 stopped serving the rendezvous store at {addr}:{port} "
                                 f"before it published the {env.launcher} job's layout (see rank 0's error)") from e
            raise ValueError(f"rank {env.rank} waited {2 * timeout:g} s for rank 0 to publish the {env.launcher} "
                             f"job's layout: {e}") from e
        if answer.get("error"):
            raise ValueError(f"Horovod initialization failed (rank 0 checked every rank's {env.launcher} "
                             f"variables): {answer['error']}")
        layout = answer
    if layout["tokens"][env.rank] != token:
        raise ValueError(f"another process also has {env.names[0]}={env.rank} ({env.launcher}'s variable): every "
                         f"process of the job needs a different {env.names[0]} below {env.names[1]}")
    lr, ls, cr, cs = layout["ranks"][env.rank]
    exported = {"HOROVOD_RANK": env.rank, "HOROVOD_SIZE": env.world_size, "HOROVOD_LOCAL_RANK": lr,
                "HOROVOD_LOCAL_SIZE": ls, "HOROVOD_CROSS_RANK": cr, "HOROVOD_CROSS_SIZE": cs,
                "HOROVOD_HOSTNAME": hostname, "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
                "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_SECRET_KEY": key.hex()}
    iface = _iface_for_other_hosts(record["addr"], hostname, layout)
    if iface and not read_env("HOROVOD_GLOO_IFACE"):
        exported["HOROVOD_GLOO_IFACE"] = iface
    os.environ.update({k: str(v) for k, v in exported.items()})
    log.debug("%s job: rank %d of %d, local %d of %d, cross %d of %d, store %s:%d", env.launcher, env.rank,
              env.world_size, lr, ls, cr, cs, addr, port)


def _refuse_if_rank_0_has_no_key(env: JoinEnv, error: Exception) -> None:
    """A rank with ``HOROVOD_SECRET_KEY`` that cannot reach rank 0's store: ValueError when rank 0 hands out
    a key of its own instead (it has no ``HOROVOD_SECRET_KEY``), rather than waiting out the start timeout."""
    if env.rank == 0:
        return
    probe: Any = None
    try:
        if not env.one_host:
            probe = env.peer_channel or env.key_channel
        elif os.path.isdir(os.path.join(tempfile.gettempdir(), f"horovod-{env.launcher}-{os.getuid()}")):
            probe = KeyFile(env)  # (a rank with the key never makes the directory, nor needs it to be sound)
        serves = probe is not None and probe.serves()
    except Exception as e:  # noqa: BLE001 - only a diagnosis: the store's own error stands
        log.debug("key channel check: %s", e)
        return
    if serves:
        where = getattr(probe, "path", None) or f"{env.master_addr}:{getattr(probe, 'port', '?')}"
        raise ValueError(f"rank {env.rank} has HOROVOD_SECRET_KEY but rank 0 of this {env.launcher} job has none: "
                         f"it hands out a fresh key of its own ({where}) instead of running its store at the port "
                         "this rank uses.  Set the same HOROVOD_SECRET_KEY in every rank (export it before the "
                         "launcher, which passes it on), or in none.") from error


def _close_channel() -> None:
    global _channel, _sigterm_previous
    channel, _channel = _channel, None
    if channel is not None:
        channel.close()
    previous, _sigterm_previous = _sigterm_previous, None
    if previous is not None and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # else the application set its own since
                signal.signal(signal.SIGTERM, previous)
        except (ValueError, OSError):
            pass


def _close_on_sigterm() -> None:
    """Rank 0, while its key channel is open: SIGTERM closes the channel (removes the key file) first.

    A launcher ends the other processes with SIGTERM when one fails (srun -K, torchrun), often while rank 0
    still waits for a rank that will never come; atexit does not run then, and the key file stayed in
    ``<tmp>/horovod-<launcher>-<uid>/``.  The handler is this module's only while the channel is open:
    :func:`_close_channel` puts the previous one back, and a SIGTERM meanwhile is handed to it after the
    channel closed (the default handler ends the process as before)."""
    global _sigterm_previous
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers: the file then goes at exit, as before
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous is _on_sigterm:  # a handler not set from Python: leave it alone
            return
        _sigterm_previous = previous  # before the handler can run
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        _sigterm_previous = None


def _on_sigterm(signum: int, frame: Any) -> None:
    previous = _sigterm_previous
    _close_channel()  # puts ``previous`` back
    if previous is None or previous == signal.SIG_IGN:
        return
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL: end the process as SIGTERM would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def _gather_layout(client: Any, env: JoinEnv, launch: str, deadline: float, timeout: float) -> dict[str, Any]:
    """Rank 0: every rank's record -> the layout, published (or the error, published, then raised)."""
    from horovod.base import auth
    from horovod.transport.store import StoreError

    records: list[dict[str, Any]] = []
    try:
        for r in range(env.world_size):
            try:
                records.append(json.loads(client.get(_RECORD.format(launch=launch, rank=r),
                                                     timeout=max(0.0, deadline - time.monotonic()))))
            except StoreError as e:
                missing = [q for q in range(r, env.world_size)
                           if not _has(client, _RECORD.format(launch=launch, rank=q))]
                raise ValueError(f"ranks {missing} of {env.names[1]}={env.world_size} did not reach rank 0's "
                                 f"rendezvous store within the start timeout ({timeout:g} s); did they call "
                                 "hvd.init(), is HOROVOD_SECRET_KEY set in every rank or in none (rank 0 "
                                 f"{'has it' if auth.secret_key_from_env() else 'has none'}), or does another "
                                 f"process have the RANK of one of them? ({e})") from e
        layout = {"ranks": _layout(records, env.world_size), "tokens": [rec["token"] for rec in records],
                  "hosts": [rec["host"] for rec in records], "addrs": [rec["addr"] for rec in records]}
    except ValueError as e:
        client.put(_LAYOUT.format(launch=launch), json.dumps({"error": str(e)}).encode())
        time.sleep(_ERROR_LINGER)  # the store lives in this process: let the others read why before it may exit
        raise ValueError(f"Horovod initialization failed: {e}") from e
    client.put(_LAYOUT.format(launch=launch), json.dumps(layout).encode())
    return layout


def _has(client: Any, key: str) -> bool:
    try:
        client.get(key, timeout=0)
        return True
    except Exception:  # noqa: BLE001 - only for the error text
        return False


def _iface_for_other_hosts(my_addr: str, hostname: str, layout: dict[str, Any]) -> str | None:
    """The interface to listen on when this rank's route to the store is loopback but peers are elsewhere."""
    if my_addr and not _is_loopback(my_addr):
        return None
    for host, addr in zip(layout["hosts"], layout["addrs"]):
        if host != hostname and addr and not _is_loopback(addr):
            route = netif.route_source(addr)
            if route and not _is_loopback(route):
                return netif.local_addresses().get(route)
    return None
