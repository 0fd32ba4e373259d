"""The mesh: one authenticated connection per pair of ranks (plus control channels to rank 0).

Every rank listens on TCP and on an abstract-namespace AF_UNIX socket (nothing on the filesystem),
publishes ``{host, addr, port, unix}`` under ``<scope>/addr.<rank>`` in the rendezvous store, and connects
to every lower rank; the higher ranks connect to it.  Same-host peers use AF_UNIX (needed to pass shared
memory descriptors) unless shared memory is disabled, in which case TCP is used everywhere so the cross-host
path can be exercised on one machine.

Handshake on every connection (frames of :mod:`horovod.transport.wire`)::

    server -> client  HELLO  s_nonce, scope
    client -> server  AUTH   rank u32, kind u8, c_nonce, HMAC(key, "client", s_nonce, c_nonce, info), scope
    server -> client  OK     HMAC(key, "server", c_nonce, s_nonce, info)

``info`` binds the scope, both ranks and the channel kind, so a digest cannot be replayed elsewhere.  The
scope also travels in clear (it is no secret) so that a connection between two meshes -- e.g. generations
``init.4`` and ``init.5`` of ``hvd.init()``, when a port was reused -- is refused with both names instead
of a bare authentication failure.  A connection that fails, sends garbage or stays silent is closed with a
warning and the listener goes on accepting the real peers until the deadline.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any, Protocol

from horovod.common import auth
from horovod.common.config import env_bool
from horovod.common.exceptions import WireError
from horovod.transport.communicator import PeerFailure
from horovod.transport.wire import Channel

__all__ = ["Mesh", "build_mesh", "advertise_address", "CTRL", "DATA"]

logger = logging.getLogger(__name__)

CTRL = 0
DATA = 1
_KIND_NAMES = {CTRL: "ctrl", DATA: "data"}
_HELLO, _AUTH, _OK = 0xF1, 0xF2, 0xF3
_AUTH_FMT = struct.Struct(f"!IB{auth.NONCE_SIZE}s{auth.DIGEST_SIZE}s")
_MAX_SCOPE = 256  # bytes of the scope name carried in clear in HELLO and AUTH
# A connecting peer answers at once; a silent or slow stranger may hold the listener this long at most.
_HANDSHAKE_TIMEOUT = 2.0


class Store(Protocol):
    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float | None = ...) -> bytes: ...


@dataclasses.dataclass
class Mesh:
    """Connections of one rank: ``ctrl`` to/from rank 0, ``data`` to every other rank."""

    rank: int
    size: int
    hostnames: list[str]
    ctrl: dict[int, Channel] = dataclasses.field(default_factory=dict)
    data: dict[int, Channel] = dataclasses.field(default_factory=dict)
    disable_shm: bool = False

    def local_ranks(self, ranks: list[int] | None = None) -> list[int]:
        """The ranks (of ``ranks``, default all) on this rank's host, sorted."""
        me = self.hostnames[self.rank]
        return [r for r in (range(self.size) if ranks is None else ranks) if self.hostnames[r] == me]

    def close(self) -> None:
        """Close every connection (idempotent); peers see EOF at once."""
        for ch in [*self.ctrl.values(), *self.data.values()]:
            ch.close()
        self.ctrl.clear()
        self.data.clear()


def advertise_address(iface_addr: str | None = None, rendezvous_host: str | None = None,
                      hostname: str | None = None) -> str:
    """The address other hosts can reach this rank at.

    ``iface_addr`` wins; otherwise the local address of the route to the rendezvous host (the launcher is
    reachable from every worker, so that interface is too); otherwise what the hostname resolves to.
    """
    if iface_addr:
        return iface_addr
    if rendezvous_host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((rendezvous_host, 9))  # UDP connect sends nothing; it only picks a route
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(hostname or socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _info(scope: str, client: int, server: int, kind: int) -> bytes:
    return f"{scope}|{client}->{server}|{_KIND_NAMES.get(kind, kind)}".encode()


def _client_handshake(ch: Channel, key: bytes, scope: str, rank: int, server: int, kind: int) -> None:
    k, hello = ch.recv_msg(max_len=auth.NONCE_SIZE + _MAX_SCOPE)
    if k != _HELLO or len(hello) < auth.NONCE_SIZE:
        raise WireError(f"rank {server} did not greet with a nonce")
    server_nonce, their_scope = hello[:auth.NONCE_SIZE], hello[auth.NONCE_SIZE:]
    if their_scope != _scope_bytes(scope):
        raise WireError(f"rank {server} at that address is in mesh {their_scope.decode(errors='replace')!r}, "
                        f"rank {rank} in {scope!r}: the ranks are in different generations of the job")
    client_nonce = auth.nonce()
    info = _info(scope, rank, server, kind)
    proof = auth.digest(key, b"client", server_nonce, client_nonce, info)
    ch.send_msg(_AUTH, _AUTH_FMT.pack(rank, kind, client_nonce, proof) + _scope_bytes(scope))
    k, answer = ch.recv_msg(max_len=auth.DIGEST_SIZE)
    if k != _OK or not auth.verify(key, answer, b"server", client_nonce, server_nonce, info):
        raise WireError(f"rank {server} failed to prove the job key")


def _scope_bytes(scope: str) -> bytes:
    return scope.encode()[:_MAX_SCOPE]


def _server_handshake(ch: Channel, key: bytes, scope: str, rank: int) -> tuple[int, int]:
    server_nonce = auth.nonce()
    ch.send_msg(_HELLO, server_nonce + _scope_bytes(scope))
    k, payload = ch.recv_msg(max_len=_AUTH_FMT.size + _MAX_SCOPE)
    if k != _AUTH or len(payload) < _AUTH_FMT.size:
        raise WireError(f"expected an AUTH frame, got kind {k} with {len(payload)} bytes")
    client, kind, client_nonce, proof = _AUTH_FMT.unpack(payload[:_AUTH_FMT.size])
    their_scope = payload[_AUTH_FMT.size:]
    if their_scope != _scope_bytes(scope):
        raise WireError(f"connection claiming rank {client} is for mesh {their_scope.decode(errors='replace')!r}, "
                        f"rank {rank} is in {scope!r} (a rank of another generation of the job)")
    info = _info(scope, client, rank, kind)
    if not auth.verify(key, proof, b"client", server_nonce, client_nonce, info):
        raise WireError(f"connection claiming rank {client} failed authentication")
    ch.send_msg(_OK, auth.digest(key, b"server", client_nonce, server_nonce, info))
    return client, kind


class _Acceptor(threading.Thread):
    """Accepts and authenticates the expected inbound connections on both listeners."""

    def __init__(self, listeners: list[socket.socket], expected: set[tuple[int, int]], key: bytes,
                 scope: str, rank: int, deadline: float) -> None:
        super().__init__(name=f"hvd-mesh-accept-{rank}", daemon=True)
        self.listeners, self.expected, self.key = listeners, expected, key
        self.scope, self.rank, self.deadline = scope, rank, deadline
        self.channels: dict[tuple[int, int], Channel] = {}
        self.error: BaseException | None = None
        self.stop = False

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # handed to the main thread
            self.error = e

    def _run(self) -> None:
        by_fd = {s.fileno(): s for s in self.listeners}
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        while self.expected - self.channels.keys() and not self.stop:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return
            for fd, _ev in poller.poll(min(remaining, 0.2) * 1000.0):
                try:
                    conn, addr = by_fd[fd].accept()
                except OSError:
                    continue
                self._admit(conn, addr or "local peer")

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        ch = Channel(conn, -1, min(_HANDSHAKE_TIMEOUT, max(0.05, self.deadline - time.monotonic())))
        try:
            client, kind = _server_handshake(ch, self.key, self.scope, self.rank)
        except (WireError, PeerFailure, OSError, struct.error) as e:
            logger.warning("rank %d refused a connection from %s: %s", self.rank, addr, e)
            ch.close()
            return
        if (client, kind) not in self.expected or (client, kind) in self.channels:
            logger.warning("rank %d refused an unexpected %s connection claiming rank %d from %s",
                           self.rank, _KIND_NAMES.get(kind, kind), client, addr)
            ch.close()
            return
        ch.peer = client
        self.channels[(client, kind)] = ch


def _connect(rec: dict[str, Any], use_unix: bool, deadline: float) -> socket.socket:
    delay = 0.01
    while True:
        if use_unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = "\0" + rec["unix"]
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in rec["addr"] else socket.AF_INET,
                                 socket.SOCK_STREAM)
            target = (rec["addr"], rec["port"])
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            sock.connect(target)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def build_mesh(rank: int, size: int, hostname: str, store: Store, key: bytes, *, scope: str,
               timeout: float, iface_addr: str | None = None, disable_shm: bool | None = None) -> Mesh:
    """Connect this rank to every other rank of the job and return its :class:`Mesh`.

    Args:
        scope: store key prefix unique to this mesh (e.g. per elastic round); also bound into every HMAC.
        timeout: seconds for the whole formation; channels start with it as their per-call deadline.
        iface_addr: the address to listen on and to publish (default: all interfaces / see
            :func:`advertise_address`).
        disable_shm: use TCP between same-host peers too (default: ``HOROVOD_SHM_DISABLE``).
    Raises:
        PeerFailure: a peer was not reachable, or did not connect, before the deadline.
        WireError: a peer we connected to failed to prove the job key.
    """
    if disable_shm is None:
        disable_shm = env_bool("HOROVOD_SHM_DISABLE")
    if size == 1:
        return Mesh(rank, size, [hostname], disable_shm=disable_shm)
    deadline = time.monotonic() + timeout

    tcp = socket.socket(socket.AF_INET6 if iface_addr and ":" in iface_addr else socket.AF_INET,
                        socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((iface_addr or "", 0))
    tcp.listen(max(64, 2 * size))
    unix_name = f"horovod.{scope}.{rank}.{secrets.token_hex(8)}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + unix_name)
    unix.listen(max(64, 2 * size))
    listeners = [tcp, unix]

    mesh = Mesh(rank, size, [""] * size, disable_shm=disable_shm)
    expected = {(peer, DATA) for peer in range(rank + 1, size)}
    if rank == 0:
        expected |= {(peer, CTRL) for peer in range(1, size)}
    acceptor = _Acceptor(listeners, expected, key, scope, rank, deadline)
    acceptor.start()
    try:
        record = {"host": hostname, "port": tcp.getsockname()[1], "unix": unix_name,
                  "addr": advertise_address(iface_addr, getattr(store, "addr", None), hostname)}
        store.put(f"{scope}/addr.{rank}", json.dumps(record).encode())
        records: dict[int, dict[str, Any]] = {}
        for peer in range(size):
            if peer != rank:
                remaining = max(0.0, deadline - time.monotonic())
                try:
                    records[peer] = json.loads(store.get(f"{scope}/addr.{peer}", timeout=remaining))
                except PeerFailure:  # the store already named the peer and the cause
                    raise
                except Exception as e:
                    raise PeerFailure(peer, f"no address in the rendezvous store within {timeout} s: {e}") \
                        from e
                mesh.hostnames[peer] = str(records[peer]["host"])
        mesh.hostnames[rank] = hostname
        for peer in range(rank):
            rec = records[peer]
            use_unix = not disable_shm and rec["host"] == hostname and bool(rec.get("unix"))
            for kind in ((CTRL, DATA) if peer == 0 else (DATA,)):
                try:
                    sock = _connect(rec, use_unix, deadline)
                except OSError as e:
                    raise PeerFailure(peer, f"cannot connect to {rec}: {e}") from e
                ch = Channel(sock, peer, max(0.05, deadline - time.monotonic()))
                try:
                    _client_handshake(ch, key, scope, rank, peer, kind)
                except BaseException:
                    ch.close()
                    raise
                (mesh.ctrl if kind == CTRL else mesh.data)[peer] = ch
        acceptor.join(max(0.0, deadline - time.monotonic()))
        if acceptor.error is not None:
            raise acceptor.error
        missing = sorted(expected - acceptor.channels.keys())
        if missing:
            raise PeerFailure(missing[0][0], f"did not connect to rank {rank} within {timeout} s "
                                             f"(missing {[(r, _KIND_NAMES[k]) for r, k in missing]})")
        for (peer, kind), ch in acceptor.channels.items():
            (mesh.ctrl if kind == CTRL else mesh.data)[peer] = ch
    except BaseException:
        acceptor.stop = True
        acceptor.join(1.0)
        for ch in acceptor.channels.values():
            ch.close()
        mesh.close()
        raise
    finally:
        for lst in listeners:
            lst.close()
    for ch in [*mesh.ctrl.values(), *mesh.data.values()]:
        ch.settimeout(timeout)
    logger.debug("rank %d mesh formed: %d data channels (%d unix)", rank, len(mesh.data),
                 sum(ch.is_unix for ch in mesh.data.values()))
    return mesh
