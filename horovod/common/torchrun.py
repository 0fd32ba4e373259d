"""Joining a job that ``torchrun`` (or a Kubeflow PyTorchJob) started, without ``horovodrun``.

torchrun gives every worker ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node's index), ``TORCHELASTIC_RUN_ID``...; a PyTorchJob without
torchrun sets only the first four (one process per pod).  :func:`join` turns them into the launcher's
contract (``HOROVOD_RANK``... in docs/architecture.md) so that the rest of ``hvd.init()`` is unchanged:

1. **Store.**  Rank 0 runs Horovod's authenticated rendezvous store (:mod:`horovod.runner.rendezvous`) in
   its own process, for the process's lifetime (re-``init()`` uses it too).  It listens on the addresses of
   this host that ``MASTER_ADDR`` resolves to, at ``MASTER_PORT + 1`` (torchrun's own store holds
   ``MASTER_PORT``) or ``HOROVOD_GLOO_RENDEZVOUS_PORT``.  When ``MASTER_ADDR`` is loopback on rank 0 but the
   job spans hosts (a PyTorchJob gives its master pod ``MASTER_ADDR=localhost``) it also listens on every
   non-loopback IPv4 address of the host (or on ``HOROVOD_GLOO_IFACE``'s), never on ``0.0.0.0``.
2. **Key.**  There is no launcher to make the job key, and torchrun has no authenticated channel to share
   one (its TCPStore answers anybody who reaches the port), so:

   * ``HOROVOD_SECRET_KEY`` set (the same hex key, >= 16 bytes, in every worker: e.g. a Kubernetes
     Secret) -- used by every rank; required when the job spans hosts;
   * otherwise, and only when every rank is on one host (``LOCAL_WORLD_SIZE == WORLD_SIZE``), rank 0 makes
     a fresh key and puts it, with the store's address and port (any free port), in a file readable by
     this user only: ``<tmp>/horovod-torchrun-<uid>/<hash of run id, MASTER_ADDR, MASTER_PORT, restart>``
     (the directory must be ours and mode 0700).  The other ranks read it; a stale file of an earlier job
     is recognised because the store refuses its key, and read again.  Rank 0 removes the file as soon as
     every rank's record reached its store (they all read it by then), and at exit if the job never formed.

3. **Layout.**  Every rank puts a record (rank, ``WORLD_SIZE``, host, node, torchrun's local rank) in the
   store; rank 0 checks them (same ``WORLD_SIZE``, local ranks ``0..LOCAL_WORLD_SIZE-1`` on each node) and
   publishes the layout or the error; ranks keep torchrun's ``RANK`` and ``LOCAL_RANK``; without
   ``LOCAL_RANK`` (PyTorchJob without torchrun) local ranks are assigned per host name in rank order;
   cross ranks follow upstream's rule (the node's index among the nodes with that local rank).
4. **Export.**  ``HOROVOD_RANK/SIZE/LOCAL_*/CROSS_*/HOSTNAME``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT`` and
   ``HOROVOD_SECRET_KEY`` go into ``os.environ``; ``hvd.init()`` continues as under horovodrun.  A rank
   whose route to ``MASTER_ADDR`` is loopback in a multi-host job gets ``HOROVOD_GLOO_IFACE`` set to the
   interface that routes to the other hosts (unless you set it), so it never advertises 127.0.0.1.

``horovodrun``'s ``HOROVOD_RANK`` wins over torchrun's variables; an MPI launcher's (``SLURM_*``,
``OMPI_COMM_WORLD_*``) win only over a PyTorchJob's, not over torchrun's (``TORCHELASTIC_RUN_ID``).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from horovod.base.config import EnvVarError, is_set, parse_int, read_env, start_timeout
from horovod.transport import netif

__all__ = ["TorchrunEnv", "detect", "join", "key_file_path", "MIN_KEY_BYTES"]

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
"""Shortest ``HOROVOD_SECRET_KEY`` accepted under torchrun (the launcher's own keys are 32 bytes)."""

_RECORD = "torchrun/host.{rank}"
_LAYOUT = "torchrun/layout"
_POLL = 0.1
_ERROR_LINGER = 2.0
_WHY = "(torchrun's variable: hvd.init() joins a torchrun job because MASTER_ADDR, RANK and WORLD_SIZE are set)"

_server: Any = None  # rank 0's RendezvousServer, kept for the life of the process
_key_file: str | None = None


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (or a PyTorchJob) told this process."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    group_rank: int | None = None
    run_id: str = ""
    restart_count: int = 0

    @property
    def one_host(self) -> bool:
        """torchrun put every rank on this host."""
        return self.local_world_size == self.world_size


def _int(env: Mapping[str, str], name: str, *, minimum: int, what: str) -> int | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        return parse_int(name, text, minimum=minimum, what=what)
    except EnvVarError as e:
        problem = str(e)[len(f"{name}={text!r} "):]
        raise EnvVarError(name, text, f"{problem} {_WHY}") from None


def detect(env: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """torchrun's (or a PyTorchJob's) description of this process; None when it was not started that way.

    A job is recognised when ``MASTER_ADDR``, ``RANK`` and ``WORLD_SIZE`` are set (or
    ``TORCHELASTIC_RUN_ID``), unless ``horovodrun`` (``HOROVOD_RANK``) or the elastic driver
    (``HOROVOD_ELASTIC_SLOT``; ``HOROVOD_ELASTIC=1`` alone does not count) started the process, or, without
    ``TORCHELASTIC_RUN_ID``, an MPI launcher's variables are set (torchrun's own win over the Slurm step or
    mpirun it runs in).

    Raises:
        EnvVarError: a torchrun variable is missing or malformed (the text names it and its value).
    """
    env = os.environ if env is None else env
    from horovod.common.elastic_init import launched_by_driver

    if is_set("HOROVOD_RANK", env) or launched_by_driver(env):
        return None
    started_by_torchrun = bool(env.get("TORCHELASTIC_RUN_ID", "").strip())
    if not (all(env.get(v, "").strip() for v in ("MASTER_ADDR", "RANK", "WORLD_SIZE")) or started_by_torchrun):
        return None
    from horovod.transport.mpi import detect_launch

    # torchrun started this process when it set TORCHELASTIC_RUN_ID: the Slurm step (or mpirun) it runs in
    # launched torchrun, not this worker, so its variables describe torchrun's task, not the job.
    if not started_by_torchrun and detect_launch(env) is not None:
        return None
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if not env.get(name, "").strip():
            raise EnvVarError(name, "", f"is not set {_WHY}", show_value=False)
    port = _int(env, "MASTER_PORT", minimum=1, what="a TCP port number")
    rank = _int(env, "RANK", minimum=0, what="a rank (a whole number)")
    size = _int(env, "WORLD_SIZE", minimum=1, what="a number of processes")
    local_rank = _int(env, "LOCAL_RANK", minimum=0, what="a rank (a whole number)")
    local_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1, what="a number of processes")
    group_rank = _int(env, "GROUP_RANK", minimum=0, what="a node rank (a whole number)")
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", minimum=0, what="a whole number") or 0
    assert port is not None and rank is not None and size is not None
    if port > 65535:
        raise EnvVarError("MASTER_PORT", env["MASTER_PORT"], f"must be <= 65535 {_WHY}")
    if rank >= size:
        raise ValueError(f"RANK={rank} must be below WORLD_SIZE={size} {_WHY}")
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ValueError(f"LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_size} {_WHY}")
    if local_size is not None and local_size > size:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_size} must not exceed WORLD_SIZE={size} {_WHY}")
    return TorchrunEnv(master_addr=env["MASTER_ADDR"].strip(), master_port=port, rank=rank, world_size=size,
                       local_rank=local_rank, local_world_size=local_size, group_rank=group_rank,
                       run_id=env.get("TORCHELASTIC_RUN_ID", "").strip(), restart_count=restart)


# ---------------------------------------------------------------------------------------------- key file
def key_file_path(tr: TorchrunEnv) -> str:
    """Where rank 0 of a one-host job leaves the key and the store's address for the other ranks."""
    ident = f"{tr.run_id}|{tr.master_addr}|{tr.master_port}|{tr.restart_count}".encode()
    return os.path.join(_private_dir(), hashlib.sha256(ident).hexdigest()[:32] + ".json")


def _private_dir() -> str:
    """``<tmp>/horovod-torchrun-<uid>``, created 0700; refused unless it is a directory of ours, 0700."""
    path = os.path.join(tempfile.gettempdir(), f"horovod-torchrun-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a directory owned by this user with mode 0700 (owner uid "
                              f"{st.st_uid}, mode {stat.filemode(st.st_mode)}); Horovod keeps a torchrun job's "
                              "key there: remove it, or set HOROVOD_SECRET_KEY in every worker's environment")
    return path


def _write_key_file(path: str, addr: str, port: int, key: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"addr": addr, "port": port, "key": key.hex(), "pid": os.getpid()}, f)
    os.replace(tmp, path)


def _read_key_file(path: str) -> tuple[str, int, bytes] | None:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        with open(path) as f:
            data = json.load(f)
        return str(data["addr"]), int(data["port"]), bytes.fromhex(data["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove_key_file() -> None:
    path = _key_file
    if path is None:
        return
    try:
        with open(path) as f:
            if json.load(f).get("pid") == os.getpid():
                os.unlink(path)
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


def _store_addresses(tr: TorchrunEnv) -> list[str]:
    """The addresses rank 0's store listens on (the first one is what rank 0 itself connects to)."""
    local = netif.local_addresses()
    mine = [a for a in _resolve(tr.master_addr) if a in local]
    mine.sort(key=lambda a: ":" in a)  # IPv4 first
    if tr.one_host:
        return mine[:1] or ["127.0.0.1"]
    if not mine:
        raise ValueError(f"MASTER_ADDR={tr.master_addr!r} resolves to {_resolve(tr.master_addr) or 'nothing'}, "
                         f"none of which is an address of this host ({socket.gethostname()}), where RANK=0 runs: "
                         "Horovod's rendezvous store runs in rank 0 and listens where MASTER_ADDR points")
    if all(_is_loopback(a) for a in mine):
        # A PyTorchJob's master pod has MASTER_ADDR=localhost while the others reach it by its service name.
        iface = read_env("HOROVOD_GLOO_IFACE")
        extra = [a for a, name in local.items() if ":" not in a and not _is_loopback(a)
                 and (not iface or name == iface)]
        if not extra:
            raise ValueError(f"MASTER_ADDR={tr.master_addr!r} is loopback on rank 0 but the job spans hosts "
                             f"(WORLD_SIZE={tr.world_size}, LOCAL_WORLD_SIZE={tr.local_world_size}) and this "
                             "host has no other IPv4 address" + (f" on HOROVOD_GLOO_IFACE={iface}" if iface else ""))
        mine = mine[:1] + extra
    return mine


def _start_store(tr: TorchrunEnv, key: bytes, port: int | None) -> tuple[str, int]:
    """Start rank 0's store; returns (address rank 0 connects to, port)."""
    global _server
    from horovod.runner.rendezvous import RendezvousServer
    from horovod.transport import tls as tls_mod

    addrs = _store_addresses(tr)
    server = RendezvousServer(key, addr=addrs[0], port=port or 0, tls=tls_mod.resolve(None))
    where = "HOROVOD_GLOO_RENDEZVOUS_PORT" if read_env("HOROVOD_GLOO_RENDEZVOUS_PORT") else "MASTER_PORT + 1"
    try:
        bound = server.start()
        for a in addrs[1:]:
            _listen_on(server, a, bound)
    except OSError as e:
        server.stop()
        raise ValueError(f"rank 0 could not listen on {addrs} port {port} for Horovod's rendezvous store "
                         f"({where}): {e}; set HOROVOD_GLOO_RENDEZVOUS_PORT to a free port, the same on every "
                         "rank") from e
    _server = server
    log.debug("torchrun job: rendezvous store of rank 0 listening on %s", server.addresses)
    return addrs[0], bound


def _listen_on(server: Any, addr: str, port: int) -> None:
    """``RendezvousServer.listen`` on the first listener's port (the other hosts reach MASTER_ADDR at it)."""
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
def join(tr: TorchrunEnv) -> None:
    """Meet the other ranks through rank 0's store and export the launcher's variables (module doc).

    Raises:
        ValueError: no usable key, a store that cannot listen, inconsistent torchrun variables across ranks
            (the text names the rank and the variable), or the ranks did not meet within the start timeout.
    """
    global _key_file
    from horovod.base import auth
    from horovod.transport.store import StoreClient, StoreError

    if tr.world_size == 1:
        return
    timeout = start_timeout()
    deadline = time.monotonic() + timeout
    key = auth.secret_key_from_env()
    if key is not None and len(key) < MIN_KEY_BYTES:
        raise ValueError(f"HOROVOD_SECRET_KEY has {len(key)} bytes; under torchrun it must be at least "
                         f"{MIN_KEY_BYTES} random bytes in hex, the same on every rank: "
                         "python -c 'import secrets; print(secrets.token_hex(32))'")
    if key is None and not tr.one_host:
        where = ("without LOCAL_WORLD_SIZE (one process per host or pod)" if tr.local_world_size is None
                 else f"on several hosts (LOCAL_WORLD_SIZE={tr.local_world_size})")
        raise ValueError(
            f"hvd.init() under torchrun with WORLD_SIZE={tr.world_size} {where} needs HOROVOD_SECRET_KEY: "
            "the same random key, in hex, in every worker's "
            "environment (e.g. from a Kubernetes Secret; python -c 'import secrets; print(secrets.token_hex(32))'). "
            "torchrun has no authenticated channel to share one (docs/running.md, torchrun and Kubernetes).")
    port = read_env("HOROVOD_GLOO_RENDEZVOUS_PORT")
    use_file = key is None
    if port is None and not use_file:
        if tr.master_port >= 65535:
            raise ValueError("MASTER_PORT=65535 leaves no MASTER_PORT + 1 for Horovod's rendezvous store: set "
                             "HOROVOD_GLOO_RENDEZVOUS_PORT, the same on every rank")
        port = tr.master_port + 1
    path = key_file_path(tr) if use_file else None

    if tr.rank == 0:
        if _server is not None:  # an earlier init() of this process failed after starting it
            addr, port, key = _server.addr, _server.port, _server.key
        else:
            key = key or auth.make_secret_key()
            addr, port = _start_store(tr, key, port)
            if path is not None:
                _write_key_file(path, addr, port, key)
                _key_file = path
                atexit.register(_remove_key_file)
    elif path is None:
        addr = tr.master_addr
    else:
        addr, port, key = _wait_key_file(path, tr, deadline)
    assert key is not None and port is not None

    hostname = read_env("HOROVOD_HOSTNAME") or socket.gethostname()
    token = secrets.token_hex(8)
    record = {"rank": tr.rank, "world_size": tr.world_size, "host": hostname,
              "node": f"group {tr.group_rank}" if tr.group_rank is not None and tr.local_rank is not None
              else hostname,
              "local_rank": tr.local_rank, "local_size": tr.local_world_size,
              "addr": netif.route_source(addr) or "", "token": token}
    while True:
        client = StoreClient(addr, port, key, timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        try:
            client.put(_RECORD.format(rank=tr.rank), json.dumps(record).encode())
            break
        except StoreError as e:
            refused = "is not signed with this job's key" in str(e)
            if refused and path is None:
                raise ValueError(f"rank {tr.rank}: the rendezvous store of rank 0 at {addr}:{port} refused this "
                                 "rank's key: every rank needs the same HOROVOD_SECRET_KEY") from e
            if time.monotonic() >= deadline:
                raise ValueError(f"rank {tr.rank} could not reach the rendezvous store of rank 0 at {addr}:{port} "
                                 f"within the start timeout ({timeout:g} s): {e}.  Is RANK=0 running hvd.init(), "
                                 "and is the port open between the hosts?") from e
            time.sleep(_POLL)
            if path is not None:  # a stale file of an earlier job: rank 0 replaces it when its store is up
                addr, port, key = _read_key_file(path) or (addr, port, key)
    client = StoreClient(addr, port, key, timeout=timeout)

    if tr.rank == 0:
        layout = _gather_layout(client, tr, deadline, timeout)
        # Every rank's record is in: each has read the key file, so it goes now.  Removing it at exit only
        # left it behind whenever torchrun ended rank 0 with SIGTERM (another rank failed) or SIGKILL; and a
        # signal handler would replace the application's own.
        _remove_key_file()
    else:
        try:  # rank 0 decides within its own start timeout, which began at most ``timeout`` ago
            answer = json.loads(client.get(_LAYOUT, timeout=max(0.0, deadline + timeout - time.monotonic())))
        except StoreError as e:
            if "unreachable" in str(e):
                raise ValueError(f"rank {tr.rank}: rank 0 stopped serving the rendezvous store at {addr}:{port} "
                                 "before it published the torchrun job's layout (see rank 0's error)") from e
            raise ValueError(f"rank {tr.rank} waited {2 * timeout:g} s for rank 0 to publish the torchrun job's "
                             f"layout: {e}") from e
        if answer.get("error"):
            raise ValueError(f"Horovod initialization failed (rank 0 checked every rank's torchrun variables): "
                             f"{answer['error']}")
        layout = answer
    if layout["tokens"][tr.rank] != token:
        raise ValueError(f"another process also has RANK={tr.rank} (torchrun's variable): every process of the "
                         "job needs a different RANK below WORLD_SIZE")
    lr, ls, cr, cs = layout["ranks"][tr.rank]
    env = {"HOROVOD_RANK": tr.rank, "HOROVOD_SIZE": tr.world_size, "HOROVOD_LOCAL_RANK": lr,
           "HOROVOD_LOCAL_SIZE": ls, "HOROVOD_CROSS_RANK": cr, "HOROVOD_CROSS_SIZE": cs,
           "HOROVOD_HOSTNAME": hostname, "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr,
           "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_SECRET_KEY": key.hex()}
    iface = _iface_for_other_hosts(record["addr"], hostname, layout)
    if iface and not read_env("HOROVOD_GLOO_IFACE"):
        env["HOROVOD_GLOO_IFACE"] = iface
    os.environ.update({k: str(v) for k, v in env.items()})
    log.debug("torchrun job: rank %d of %d, local %d of %d, cross %d of %d, store %s:%d", tr.rank,
              tr.world_size, lr, ls, cr, cs, addr, port)


def _wait_key_file(path: str, tr: TorchrunEnv, deadline: float) -> tuple[str, int, bytes]:
    """The key file's (address, port, key) once it exists (a stale one is replaced later by rank 0)."""
    while True:
        found = _read_key_file(path)
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            raise ValueError(f"rank {tr.rank} waited {start_timeout():g} s for rank 0 of this torchrun job to "
                             f"publish its rendezvous store in {path}: did RANK=0 call hvd.init()?  (Every rank "
                             "is on this host, LOCAL_WORLD_SIZE == WORLD_SIZE, so rank 0 shares a fresh key "
                             "through that file; set HOROVOD_SECRET_KEY to share one yourself.)")
        time.sleep(_POLL)


def _gather_layout(client: Any, tr: TorchrunEnv, deadline: float, timeout: float) -> dict[str, Any]:
    """Rank 0: every rank's record -> the layout, published (or the error, published, then raised)."""
    from horovod.transport.store import StoreError

    records: list[dict[str, Any]] = []
    try:
        for r in range(tr.world_size):
            try:
                records.append(json.loads(client.get(_RECORD.format(rank=r),
                                                     timeout=max(0.0, deadline - time.monotonic()))))
            except StoreError as e:
                missing = [q for q in range(r, tr.world_size) if not _has(client, _RECORD.format(rank=q))]
                raise ValueError(f"ranks {missing} of WORLD_SIZE={tr.world_size} did not reach rank 0's "
                                 f"rendezvous store within the start timeout ({timeout:g} s); did they call "
                                 f"hvd.init(), or does another process have the RANK of one of them? ({e})") from e
        layout = {"ranks": _layout(records, tr.world_size), "tokens": [rec["token"] for rec in records],
                  "hosts": [rec["host"] for rec in records], "addrs": [rec["addr"] for rec in records]}
    except ValueError as e:
        client.put(_LAYOUT, json.dumps({"error": str(e)}).encode())
        time.sleep(_ERROR_LINGER)  # the store lives in this process: let the others read why before it may exit
        raise ValueError(f"Horovod initialization failed: {e}") from e
    client.put(_LAYOUT, json.dumps(layout).encode())
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
