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

``info`` binds the scope, both ranks and the channel kind, so a digest cannot be replayed elsewhere.
These three frames (and ``REFUSED``) keep their layout in every wire version, and their header carries the
sender's :data:`~horovod.transport.wire.VERSION`: a client greeted by another version still sends its proof
(so that the server can believe it) and fails naming both versions; a server that verifies the proof of a
rank of another version says so to it and ends the formation with the same error, at once on both sides.
(A rank of version 1 fails with "unsupported frame version" on its side only; the other waits for it.)  The
scope also travels in clear (it is no secret) so that a connection between two meshes -- e.g. generations
``init.4`` and ``init.5`` of ``hvd.init()``, when a port was reused -- is refused with both names instead
of a bare authentication failure.  A server that refuses a proof says so (``REFUSED`` and a short reason)
so the client fails at once instead of waiting for its deadline.

Nothing a stranger sends can hold up the mesh: one thread per rank drives every pending handshake at once
(non-blocking sockets and a selector), each connection has a *total* deadline to prove the key
(``_PREAUTH_TIMEOUT``, not a per-read timeout that a byte every second would keep resetting), at most
``_MAX_PREAUTH_BYTES`` (one AUTH frame) are read from it before the proof, and at most ``_MAX_PREAUTH``
connections handshake at once (beyond that the oldest is dropped; a real peer answers in one round trip,
and a client whose connection was dropped retries until its deadline).  Refused strangers are logged with
their address and byte count, sanitised and the first few only, and never blamed on a rank.

With ``tls`` (``horovodrun --tls``, :mod:`horovod.transport.tls`) every TCP connection first completes a
mutual TLS handshake with the job's certificate -- driven by the same selector, non-blocking, inside the
same total deadline and slot -- and the HMAC handshake above then runs inside the encrypted stream; the
channels are :class:`~horovod.transport.wire.TlsChannel`.  A peer without the job's certificate is refused
at the TLS handshake, before any frame is read.  AF_UNIX connections (same host) stay in clear.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from horovod.base import auth
from horovod.base.config import read_env
from horovod.base.exceptions import WireError
from horovod.transport import netif
from horovod.transport import tls as tls_mod
from horovod.transport.communicator import PeerFailure
from horovod.transport.wire import HEADER, MAGIC, VERSION, Channel, make_channel

__all__ = ["Mesh", "build_mesh", "advertise_address", "CTRL", "DATA"]

logger = logging.getLogger(__name__)

CTRL = 0
DATA = 1
_KIND_NAMES = {CTRL: "ctrl", DATA: "data"}
_HELLO, _AUTH, _OK, _REFUSED = 0xF1, 0xF2, 0xF3, 0xF4
_AUTH_FMT = struct.Struct(f"!IB{auth.NONCE_SIZE}s{auth.DIGEST_SIZE}s")
_MAX_SCOPE = 256  # bytes of the scope name carried in clear in HELLO and AUTH
_MAX_REASON = 256  # bytes of the reason in a REFUSED frame
# Before it proves the key a connection may send one AUTH frame and nothing more ...
_MAX_PREAUTH_BYTES = HEADER.size + _AUTH_FMT.size + _MAX_SCOPE
# ... within this many seconds in total (a real peer answers HELLO at once) ...
_PREAUTH_TIMEOUT = 2.0
# ... and at most this many connections handshake at once; a new one beyond it drops the oldest.
_MAX_PREAUTH = 64
# Refusals logged one by one per mesh formation; the rest are counted in one line.
_LOGGED_REFUSALS = 5
_WANT = (ssl.SSLWantReadError, ssl.SSLWantWriteError)
# TLS failures that mean the connection was dropped (retry), not that the peer refused us or is a stranger.
_TLS_DROPPED = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
# While peers are awaited, the longest stretch between two calls of ``build_mesh``'s ``abort`` check.
_ABORT_POLL = 0.2
# One connect attempt's limit (an unanswered SYN is retried by a new attempt, as the kernel would).
_CONNECT_ATTEMPT = 3.0

Abort = Callable[[], None]
"""Called while a formation waits for peers; raises to abandon it (elastic: the generation ended)."""


def _no_abort() -> None:
    pass


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
    tls: bool = False  # TCP channels are TLS (horovodrun --tls)
    # The job's mpi4py communicator when data goes through MPI (bootstrapped by mpirun/srun with
    # HOROVOD_CPU_OPERATIONS=mpi, the default there): make_communicator then picks horovod.transport.mpi.
    mpi_comm: Any = None

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
        route = netif.route_source(rendezvous_host)
        if route:
            return route
    try:
        return socket.gethostbyname(hostname or socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _info(scope: str, client: int, server: int, kind: int) -> bytes:
    return f"{scope}|{client}->{server}|{_KIND_NAMES.get(kind, kind)}".encode()


def _version_error(peer: int, peer_version: int, rank: int) -> WireError:
    return WireError(f"rank {peer} runs a different horovod wire version ({peer_version}) than rank {rank} "
                     f"(version {VERSION}): every rank of a job must run the same horovod version")


def _client_handshake(ch: Channel, key: bytes, scope: str, rank: int, server: int, kind: int) -> None:
    """Prove the key to rank ``server`` and check its proof.

    Raises:
        WireError: the server is in another mesh or runs another wire version, refused our proof, or failed to
            prove the key.
        PeerFailure: the connection closed or timed out before the server answered (retryable).
    """
    version, k, hello = ch.recv_frame(max_len=auth.NONCE_SIZE + _MAX_SCOPE)
    if k != _HELLO or len(hello) < auth.NONCE_SIZE:
        raise WireError(f"rank {server} did not greet with a nonce")
    server_nonce, their_scope = hello[:auth.NONCE_SIZE], hello[auth.NONCE_SIZE:]
    if their_scope != _scope_bytes(scope):
        raise WireError(f"rank {server} at that address is in mesh {_shown(their_scope)}, "
                        f"rank {rank} in {scope!r}: the ranks are in different generations of the job")
    client_nonce = auth.nonce()
    info = _info(scope, rank, server, kind)
    proof = auth.digest(key, b"client", server_nonce, client_nonce, info)
    ch.send_msg(_AUTH, _AUTH_FMT.pack(rank, kind, client_nonce, proof) + _scope_bytes(scope))
    if version != VERSION:
        # The proof tells the server which version we run; wait for its answer (a refusal) before closing,
        # so that our close cannot discard the proof unread (an RST when bytes of the server are unread).
        ch.settimeout(_PREAUTH_TIMEOUT)
        try:
            ch.recv_frame(max_len=max(auth.DIGEST_SIZE, _MAX_REASON))
        except (PeerFailure, WireError):
            pass
        raise _version_error(server, version, rank)
    k, answer = ch.recv_msg(max_len=max(auth.DIGEST_SIZE, _MAX_REASON))
    if k == _REFUSED:
        raise WireError(f"rank {server} refused the connection of rank {rank}: {_shown(answer)} "
                        f"(do both ranks have the same job key?)")
    if k != _OK or not auth.verify(key, answer, b"server", client_nonce, server_nonce, info):
        raise WireError(f"rank {server} failed to prove the job key")


def _shown(raw: bytes | str, limit: int = 80) -> str:
    """Untrusted bytes made safe to log or raise: truncated, quoted, every control/non-ASCII char escaped."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else raw
    return ascii(text[:limit]) + ("..." if len(text) > limit else "")


def _scope_bytes(scope: str) -> bytes:
    return scope.encode()[:_MAX_SCOPE]


class _Refused(Exception):
    """A pre-auth connection broke the protocol; the text (already sanitised) says how."""


def _check_auth(payload: bytes, key: bytes, scope: str, rank: int, server_nonce: bytes) -> tuple[int, int, bytes]:
    """Verify an AUTH payload: ``(client rank, kind, our OK digest)``.

    Raises:
        _Refused: malformed, another mesh's scope, or a proof that does not verify.
    """
    if len(payload) < _AUTH_FMT.size:
        raise _Refused(f"AUTH frame of {len(payload)} bytes")
    client, kind, client_nonce, proof = _AUTH_FMT.unpack(payload[:_AUTH_FMT.size])
    their_scope = payload[_AUTH_FMT.size:]
    if their_scope != _scope_bytes(scope):
        raise _Refused(f"connection claiming rank {client} is for mesh {_shown(their_scope)}, rank {rank} is in "
                       f"{scope!r} (a rank of another generation of the job)")
    info = _info(scope, client, rank, kind)
    if not auth.verify(key, proof, b"client", server_nonce, client_nonce, info):
        raise _Refused(f"connection claiming rank {client} failed authentication")
    return client, kind, auth.digest(key, b"server", client_nonce, server_nonce, info)


def _describe(conn: socket.socket, addr: Any) -> str:
    """Where a connection comes from, for logs: ``host:port``, or the pid/uid of a local AF_UNIX peer."""
    if conn.family == socket.AF_UNIX:
        try:
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize("3i")))
            return f"local process {pid} (uid {uid}) on the AF_UNIX socket"
        except (OSError, AttributeError):
            return "a local process on the AF_UNIX socket"
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return _shown(str(addr))


class _Pending:
    """One accepted connection that has not proved the key yet."""

    __slots__ = ("sock", "who", "deadline", "out", "buf", "need", "nonce", "handshaking")

    def __init__(self, sock: socket.socket, who: str, deadline: float, hello: bytes, nonce: bytes,
                 handshaking: bool = False) -> None:
        self.sock, self.who, self.deadline, self.out, self.nonce = sock, who, deadline, hello, nonce
        self.buf = bytearray()
        self.need = HEADER.size  # bytes of the AUTH frame known so far to be due (header, then header+payload)
        self.handshaking = handshaking  # the TLS handshake is not complete yet


class _Acceptor(threading.Thread):
    """Accepts the expected inbound connections on both listeners, every handshake in parallel.

    One selector drives all pending connections with non-blocking sockets; each has ``_PREAUTH_TIMEOUT``
    seconds in total and ``_MAX_PREAUTH_BYTES`` to prove the key (with ``tls``: the TLS handshake first,
    in the same deadline).  Authenticated sockets become :class:`Channel` objects in ``channels``.
    """

    def __init__(self, listeners: list[socket.socket], expected: set[tuple[int, int]], key: bytes,
                 scope: str, rank: int, deadline: float, tls: tls_mod.JobTls | None = None) -> None:
        super().__init__(name=f"hvd-mesh-accept-{rank}", daemon=True)
        self.listeners, self.expected, self.key = listeners, expected, key
        self.scope, self.rank, self.deadline, self.tls = scope, rank, deadline, tls
        self.channels: dict[tuple[int, int], Channel] = {}
        self.error: BaseException | None = None
        self.stop = False
        self.refused = 0  # strangers refused or dropped before the mesh formed
        self._pending: dict[int, _Pending] = {}  # fd -> connection, in accept order (oldest first)
        self._sel = selectors.DefaultSelector()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # handed to the main thread
            self.error = e
        finally:
            unfinished = len(self._pending)
            for p in list(self._pending.values()):
                self._forget(p)
            self._sel.close()
            if unfinished:
                logger.debug("rank %d closed %d unfinished handshakes", self.rank, unfinished)
            if self.refused > _LOGGED_REFUSALS:
                logger.warning("rank %d refused %d connections that did not prove the job key while forming "
                               "the mesh (%d not logged one by one)", self.rank, self.refused,
                               self.refused - _LOGGED_REFUSALS)

    def _run(self) -> None:
        for lst in self.listeners:
            lst.setblocking(False)
            self._sel.register(lst, selectors.EVENT_READ, None)
        while self.expected - self.channels.keys() and not self.stop:
            now = time.monotonic()
            if now >= self.deadline:
                return
            for p in [p for p in self._pending.values() if p.deadline <= now]:
                self._refuse(p, f"did not prove the job key within {_PREAUTH_TIMEOUT:g} s", answer=False)
            wake = min([self.deadline, now + 0.2, *(p.deadline for p in self._pending.values())])
            for sk, events in self._sel.select(max(0.0, wake - now)):
                if sk.data is None:
                    self._accept(sk.fileobj)  # type: ignore[arg-type]
                elif sk.data.sock.fileno() in self._pending:
                    self._step(sk.data, events)

    # -- connections -----------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_MAX_PREAUTH):  # bounded so the other sockets get their turn
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. EMFILE: leave the rest in the backlog for now, without spinning
                logger.debug("rank %d: accept failed: %s", self.rank, e)
                time.sleep(0.01)
                return
            conn.setblocking(False)
            if len(self._pending) >= _MAX_PREAUTH:
                oldest = next(iter(self._pending.values()))
                self._refuse(oldest, f"dropped: more than {_MAX_PREAUTH} connections were handshaking at once",
                             answer=False)
            who = _describe(conn, addr)
            handshaking = self.tls is not None and conn.family != socket.AF_UNIX
            if handshaking:
                try:
                    conn = self.tls.server_socket(conn)  # type: ignore[union-attr]
                except (OSError, ValueError) as e:  # pragma: no cover - wrapping does no I/O
                    logger.debug("rank %d: cannot wrap a connection from %s in TLS: %s", self.rank, who, e)
                    conn.close()
                    continue
            nonce = auth.nonce()
            payload = nonce + _scope_bytes(self.scope)
            p = _Pending(conn, who, time.monotonic() + _PREAUTH_TIMEOUT,
                         HEADER.pack(MAGIC, VERSION, _HELLO, len(payload)) + payload, nonce, handshaking)
            self._pending[conn.fileno()] = p
            if handshaking:  # the client speaks first (ClientHello)
                self._sel.register(conn, selectors.EVENT_READ, p)
                self._step(p, selectors.EVENT_READ)
            else:
                self._sel.register(conn, selectors.EVENT_READ | selectors.EVENT_WRITE, p)
                self._step(p, selectors.EVENT_WRITE)

    def _tls_handshake(self, p: _Pending) -> bool:
        """One non-blocking step of the server's TLS handshake; True once it completed with the job's cert."""
        try:
            p.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            self._sel.modify(p.sock, selectors.EVENT_READ, p)
            return False
        except ssl.SSLWantWriteError:
            self._sel.modify(p.sock, selectors.EVENT_WRITE, p)
            return False
        except OSError as e:  # SSLError included: not TLS, no certificate, another job's certificate ...
            reason = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
            self._refuse(p, f"TLS handshake failed ({_shown(str(reason), 120)})", answer=False)
            return False
        try:
            self.tls.check_peer(p.sock)  # type: ignore[union-attr,arg-type]
        except tls_mod.TlsError as e:
            self._refuse(p, str(e), answer=False)
            return False
        p.handshaking = False
        self._sel.modify(p.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, p)
        return True

    def _step(self, p: _Pending, events: int) -> None:
        if p.handshaking:
            if not self._tls_handshake(p):
                return
            events = selectors.EVENT_WRITE  # the HELLO goes out now; the client's AUTH comes after it
        try:
            if events & selectors.EVENT_WRITE and p.out:
                p.out = p.out[p.sock.send(p.out):]  # after a TLS "want", the same bytes are offered again
                if not p.out:
                    self._sel.modify(p.sock, selectors.EVENT_READ, p)
        except (BlockingIOError, InterruptedError, *_WANT):
            return
        except OSError as e:
            self._refuse(p, f"{type(e).__name__}: {e}", answer=False)
            return
        if not events & selectors.EVENT_READ:
            return
        # A TLS record may hold more than was asked for: keep reading what the SSL object already decrypted.
        while self._read_auth(p) and p.sock.fileno() in self._pending and isinstance(p.sock, ssl.SSLSocket) \
                and p.sock.pending():
            pass

    def _read_auth(self, p: _Pending) -> bool:
        """Read the next part of the AUTH frame; True if bytes were consumed and the connection still waits."""
        try:
            chunk = p.sock.recv(p.need - len(p.buf))
        except (BlockingIOError, InterruptedError, *_WANT):
            return False
        except OSError as e:
            self._refuse(p, f"{type(e).__name__}: {e}", answer=False)
            return False
        if not chunk:
            self._refuse(p, "closed the connection", answer=False)
            return False
        p.buf += chunk
        if len(p.buf) < p.need:
            return True
        try:
            if p.need == HEADER.size:
                magic, _version, kind, n = HEADER.unpack(p.buf)
                if magic != MAGIC or kind != _AUTH:  # (of any version: see the module)
                    raise _Refused(f"not an AUTH frame (header {_shown(bytes(p.buf))})")
                if not _AUTH_FMT.size <= n <= _MAX_PREAUTH_BYTES - HEADER.size:
                    raise _Refused(f"AUTH frame of {n} bytes")
                p.need = HEADER.size + n
                return True
            client, kind, ok = _check_auth(bytes(p.buf[HEADER.size:]), self.key, self.scope, self.rank, p.nonce)
            if (client, kind) not in self.expected or (client, kind) in self.channels:
                raise _Refused(f"unexpected {_KIND_NAMES.get(kind, kind)} connection claiming rank {client}")
        except _Refused as e:
            self._refuse(p, str(e), answer=True)
            return False
        version = HEADER.unpack_from(p.buf)[1]
        if version != VERSION:  # a rank of this job (it proved the key) that cannot talk with us: end here
            error = _version_error(client, version, self.rank)
            self._refuse(p, str(error), answer=True)
            raise error
        self._forget(p, close=False)
        ch = make_channel(p.sock, client, max(0.05, self.deadline - time.monotonic()))
        try:
            ch.send_msg(_OK, ok)
        except (PeerFailure, OSError) as e:
            logger.warning("rank %d lost the connection of rank %d during the handshake: %s", self.rank, client, e)
            ch.close()
            return False
        self.channels[(client, kind)] = ch
        return False

    def _refuse(self, p: _Pending, why: str, *, answer: bool) -> None:
        """Drop a connection that did not prove the key; ``answer``: tell it why first (best effort)."""
        if answer:
            reason = why.encode()[:_MAX_REASON]
            try:
                p.sock.send(HEADER.pack(MAGIC, VERSION, _REFUSED, len(reason)) + reason)
            except OSError:
                pass
        self.refused += 1
        level = logging.WARNING if self.refused <= _LOGGED_REFUSALS else logging.DEBUG
        logger.log(level, "rank %d refused a connection from %s after %d bytes: %s", self.rank, p.who,
                   len(p.buf), why)
        self._forget(p)

    def _forget(self, p: _Pending, close: bool = True) -> None:
        self._pending.pop(p.sock.fileno(), None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        if close:
            p.sock.close()


def _connect(rec: dict[str, Any], use_unix: bool, deadline: float, abort: Abort = _no_abort) -> socket.socket:
    """Connect to a peer's listener, retrying (a peer that published its address may not listen yet) until
    ``deadline``; one attempt waits at most a few seconds, so that ``abort`` is consulted between them."""
    delay = 0.01
    while True:
        if use_unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = "\0" + rec["unix"]
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in rec["addr"] else socket.AF_INET,
                                 socket.SOCK_STREAM)
            target = (rec["addr"], rec["port"])
        sock.settimeout(max(0.05, min(_CONNECT_ATTEMPT, deadline - time.monotonic())))
        try:
            sock.connect(target)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() + delay >= deadline:
                raise
            abort()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _tls_refusal(e: BaseException | None) -> bool:
    """A TLS error that retrying cannot fix: a certificate or protocol failure, not a dropped connection."""
    return isinstance(e, ssl.SSLError) and not isinstance(e, (*_TLS_DROPPED, *_WANT))


def _tls_connect(sock: socket.socket, tls: tls_mod.JobTls, rec: dict[str, Any], deadline: float, rank: int,
                 peer: int) -> socket.socket:
    """The client's TLS handshake with ``peer``.

    Raises:
        WireError: the peer is not this job's (its certificate) or does not speak TLS there.
        PeerFailure: the connection dropped or timed out (retryable).
    """
    sock.settimeout(max(0.05, deadline - time.monotonic()))
    try:
        return tls.client_socket(sock)
    except (ssl.SSLCertVerificationError, tls_mod.TlsError) as e:
        sock.close()
        raise WireError(f"rank {peer} at {rec.get('addr')}:{rec.get('port')} did not present this job's TLS "
                        f"certificate ({_shown(str(e), 160)}); rank {rank} refused it") from e
    except OSError as e:
        sock.close()
        if _tls_refusal(e):
            raise WireError(f"TLS handshake of rank {rank} with rank {peer} at {rec.get('addr')}:"
                            f"{rec.get('port')} failed: {_shown(str(e), 160)} (is every rank started with "
                            "the same horovodrun --tls job?)") from e
        raise PeerFailure(peer, f"TLS handshake failed: {e}") from e


def _connect_and_prove(rec: dict[str, Any], use_unix: bool, deadline: float, key: bytes, scope: str, rank: int,
                       peer: int, kind: int, tls: tls_mod.JobTls | None = None, abort: Abort = _no_abort) -> Channel:
    """Connect to ``peer`` and run the client handshake; a connection the server dropped before answering
    (it was busy with strangers, or we were slow) is retried until the deadline, or until ``abort`` raises."""
    delay = 0.01
    while True:
        try:
            sock = _connect(rec, use_unix, deadline, abort)
        except OSError as e:
            raise PeerFailure(peer, f"cannot connect to {rec}: {e}") from e
        try:
            if tls is not None and not use_unix:
                sock = _tls_connect(sock, tls, rec, deadline, rank, peer)
        except PeerFailure:
            if time.monotonic() + delay >= deadline:
                raise
            abort()
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
            continue
        ch = make_channel(sock, peer, max(0.05, deadline - time.monotonic()))
        try:
            _client_handshake(ch, key, scope, rank, peer, kind)
            return ch
        except PeerFailure as e:
            ch.close()
            if not isinstance(e, WireError) and _tls_refusal(e.__cause__):
                # TLS 1.3: the server checks our certificate after our side of the handshake completed, so
                # its refusal arrives as an alert on the first read.
                raise WireError(f"rank {peer} refused the TLS connection of rank {rank}: "
                                f"{_shown(str(e.__cause__), 160)} (does every rank have this job's "
                                "certificate?)") from e
            if isinstance(e, WireError) or time.monotonic() + delay >= deadline:
                raise
            logger.debug("rank %d: rank %d dropped the handshake (%s); retrying", rank, peer, e)
        except BaseException:
            ch.close()
            raise
        abort()
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def build_mesh(rank: int, size: int, hostname: str, store: Store, key: bytes, *, scope: str,
               timeout: float, iface_addr: str | None = None, disable_shm: bool | None = None,
               tls: tls_mod.JobTls | bool | None = None, abort: Abort | None = None) -> Mesh:
    """Connect this rank to every other rank of the job and return its :class:`Mesh`.

    Args:
        scope: store key prefix unique to this mesh (e.g. per elastic round); also bound into every HMAC.
        timeout: seconds for the whole formation; channels start with it as their per-call deadline.
        iface_addr: the address to listen on and to publish (default: all interfaces / see
            :func:`advertise_address`).
        disable_shm: use TCP between same-host peers too (default: ``HOROVOD_SHM_DISABLE``).
        tls: encrypt the TCP channels with this job identity (default: ``HOROVOD_TLS`` and the credentials
            the launcher put in the environment; False: never), see :mod:`horovod.transport.tls`.
        abort: called every ``_ABORT_POLL`` seconds or so while this rank waits for a peer to connect or to
            listen; what it raises ends the formation at once (the elastic worker's check that its
            generation is still current: a peer that died mid-formation must not hold the others until
            ``timeout``).
    Raises:
        PeerFailure: a peer was not reachable, or did not connect, before the deadline.
        WireError: a peer we connected to failed to prove the job key (or the job's TLS certificate).
        ValueError: ``HOROVOD_TLS`` is on but the environment has no job certificate (not under horovodrun).
    """
    if disable_shm is None:
        disable_shm = read_env("HOROVOD_SHM_DISABLE")
    job_tls = tls_mod.resolve(tls)
    if size == 1:
        return Mesh(rank, size, [hostname], disable_shm=disable_shm, tls=job_tls is not None)
    abort = abort or _no_abort
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

    mesh = Mesh(rank, size, [""] * size, disable_shm=disable_shm, tls=job_tls is not None)
    expected = {(peer, DATA) for peer in range(rank + 1, size)}
    if rank == 0:
        expected |= {(peer, CTRL) for peer in range(1, size)}
    acceptor = _Acceptor(listeners, expected, key, scope, rank, deadline, job_tls)
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
                    if time.monotonic() < deadline:  # the caller's abort (or the store) ended the wait early
                        raise PeerFailure(peer, f"gave up waiting for its address in the rendezvous store: {e}") \
                            from e
                    raise PeerFailure(peer, f"no address in the rendezvous store within {timeout} s: {e}") \
                        from e
                mesh.hostnames[peer] = str(records[peer]["host"])
        mesh.hostnames[rank] = hostname
        for peer in range(rank):
            rec = records[peer]
            use_unix = not disable_shm and rec["host"] == hostname and bool(rec.get("unix"))
            for kind in ((CTRL, DATA) if peer == 0 else (DATA,)):
                (mesh.ctrl if kind == CTRL else mesh.data)[peer] = _connect_and_prove(
                    rec, use_unix, deadline, key, scope, rank, peer, kind, job_tls, abort)
        while acceptor.is_alive() and time.monotonic() < deadline:
            acceptor.join(min(_ABORT_POLL, max(0.0, deadline - time.monotonic())))
            if acceptor.is_alive():
                abort()
        if acceptor.error is not None:
            raise acceptor.error
        missing = sorted(expected - acceptor.channels.keys())
        if missing:
            strangers = (f"; {acceptor.refused} other connections were refused meanwhile, see the warnings"
                         if acceptor.refused else "")
            raise PeerFailure(missing[0][0], f"did not connect to rank {rank} within {timeout} s "
                                             f"(missing {[(r, _KIND_NAMES[k]) for r, k in missing]}{strangers})")
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
    logger.debug("rank %d mesh formed: %d data channels (%d unix)%s", rank, len(mesh.data),
                 sum(ch.is_unix for ch in mesh.data.values()), ", TCP channels in TLS" if job_tls else "")
    return mesh
