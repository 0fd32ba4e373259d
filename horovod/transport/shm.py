"""Collectives among ranks on one host through shared memory.

Each member owns one segment: an anonymous ``memfd_create`` file, mmapped, whose descriptor is passed to
the other members over the AF_UNIX data channels (``SCM_RIGHTS``) and closed right after mapping — so no
name exists anywhere (nothing in ``/dev/shm``) and the kernel frees the memory when the last member exits,
even after ``SIGKILL``.

A segment holds two *slots* of ``piece_bytes`` (double buffering); a slot has one *region* per member.
Large buffers are processed in pieces, so memory stays bounded and every piece is still in cache when it
is reduced and copied.  Members signal each other with one-byte tokens over the AF_UNIX data channels
(the kernel wakes the waiter; a member polls for a token briefly before it sleeps, see
:meth:`ShmCommunicator._recv_token`).  Allreduce, per piece ``k`` (member ``r`` owns region ``r``)::

    copy_in(k+1): my input parts the others own -> my slot (k+1)%2, their regions
    reduce(k):    my part = all members' inputs of it, in member order (then scaled) -> my slot k%2,
                  region r; -> out
    signal;  copy_out(k): the others' reduced parts from their slots k%2 -> out

One token round per piece suffices: a slot is rewritten two rounds after it was read, and every reader
finished reading it before sending the token in between.  The slot parity carries over from one
collective to the next for the same reason.  Each part is reduced by exactly one member in member order,
so every member gets bit-identical results.  A buffer that fits one piece skips the owners: each member
publishes all of its input, one token round, and every member reduces the whole buffer in member order
(one round instead of two; beyond two members only while small, see ``_allreduce_one_round``).  Small
buffers (``<= small_bytes``) and alltoallv go over the AF_UNIX sockets
(:class:`~horovod.transport.tcp.TcpCommunicator`), which is faster for them.

Where the kernel lets the members reach each other's memory (:mod:`horovod.transport.cma`, probed when the
segments are set up, used only if every member can), a large allreduce skips the segments
(``_allreduce_direct``): each member sends the others where its input and output lie, reads the others' inputs
of the part it owns, reduces them in member order and writes the result straight into every member's output;
one token round ends it: two rounds in all instead of one per piece, and no byte copied twice (64 MiB at np=2:
10.7 against 14.9 ms on one host).  Only plain arrays: where a member holds :class:`Pieces` (TensorFlow's own
buffers, or several smaller arrays: the kernel copies them measured slower than the segments' copies, most
likely its page pinning without numpy's huge pages -- MobileNetV2's 8.8 MB of gradients 4.2-4.6 ms against
3.8-3.9) every member takes the segments.  Large broadcasts and allgathers read the root's / the others'
buffers the same way.  Every member keeps its buffers until the closing round, so no peer touches freed memory.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod.base.config import RuntimeConfig
from horovod.base.cores import Spin
from horovod.base.exceptions import WireError
from horovod.transport.buffers import Pieces, copy_into, offsets, place, split_counts
from horovod.transport.cma import CrossMemory, allow_peers, cross_memory
from horovod.transport.communicator import Communicator, PeerFailure, ReduceOp, reduce_into
from horovod.transport.mesh import Mesh
from horovod.transport.scaling import scale_inplace
from horovod.transport.shm_trials import Trial
from horovod.transport.tcp import TcpCommunicator
from horovod.transport.wire import Channel

__all__ = ["ShmCommunicator", "REGION_BYTES", "REGION_CHOICES", "MAX_PIECE_BYTES", "ONE_ROUND_BYTES",
           "SMALL_BYTES"]

logger = logging.getLogger(__name__)

# A member's region of a piece: 1 MiB measured best at np=2 and np=4 on a 1 MiB-L2 host (21 MB allreduce:
# 3.35 ms of CPU against 4.2 with 512 KiB regions; each piece costs one token round, i.e. a wake-up per
# member); a piece is one region per member, at most MAX_PIECE_BYTES (segments are two pieces).  Large
# allreduces also try REGION_CHOICES on this host and keep the faster (horovod/transport/shm_trials.py).
REGION_BYTES = 1024 * 1024
REGION_CHOICES = (REGION_BYTES, 2 * REGION_BYTES)
MAX_PIECE_BYTES = 8 * 1024 * 1024
# Beyond two members a one-piece allreduce takes one token round while size x bytes (what each member then
# reads) stays within this; two members always do (as many bytes moved as the owner scheme).
ONE_ROUND_BYTES = 1024 * 1024
SMALL_BYTES = 64 * 1024
# Allreduces of at least this many bytes go member to member where the kernel allows it (see the module doc);
# each member reduces its part in chunks of DIRECT_CHUNK_BYTES, which stay in cache between read and write.
DIRECT_MIN_BYTES = 384 * 1024
DIRECT_CHUNK_BYTES = 256 * 1024
_WHERE = struct.Struct("<IQBQQ")  # magic, bytes of my input, my buffers are plain arrays, input, output address
_WHERE_MAGIC = 0x48565748
_PROBE_WAIT = "agreeing on cross-memory copies"
_FD_FRAME = 0x51
_TOKEN = b"\x01"
_TOKEN_WAIT = "waiting for a shared-memory signal"
_ALIGN = 64
_STAGGER = 4096 + 3 * 64


class ShmCommunicator(Communicator):
    """Collectives among members of one host over shared segments.

    Args:
        piece_bytes: bytes of one slot (the unit of pipelining); segments are ``2 * piece_bytes``.
            Default: :data:`REGION_BYTES` per member, at most :data:`MAX_PIECE_BYTES`.
        regions: region sizes large allreduces try, the default first (:class:`Trial`); default
            ``HOROVOD_SHM_REGION_BYTES`` if set, else those of :data:`REGION_CHOICES` whose piece fits
            :data:`MAX_PIECE_BYTES`; with ``piece_bytes`` given, that piece's region only.
        small_bytes: allreduce/allgather/broadcast at or below this go over the sockets.
        cross_memory: let large allreduces, broadcasts and allgathers copy member to member; used only where
            every member's probe succeeds.  True: allreduces of plain arrays always do; None (default): as
            ``HOROVOD_SHM_CROSS_MEMORY`` says, and allreduces measure it against the segments on their first
            eligible calls and keep the faster (:class:`Trial`).
        direct_min_bytes / direct_chunk_bytes: where that starts, and the unit each member reduces at once.
    Raises:
        ValueError: a member is not connected over AF_UNIX (another host, or shm disabled in the mesh).
    """

    def __init__(self, mesh: Mesh, ranks: list[int], config: RuntimeConfig, *,
                 piece_bytes: int | None = None, regions: Sequence[int] | None = None,
                 small_bytes: int = SMALL_BYTES,
                 cross_memory: bool | None = None, direct_min_bytes: int = DIRECT_MIN_BYTES,
                 direct_chunk_bytes: int = DIRECT_CHUNK_BYTES) -> None:
        self.sockets = TcpCommunicator(mesh, ranks, config)
        self.ranks, self.rank, self.size = self.sockets.ranks, self.sockets.rank, self.sockets.size
        self.peers = self.sockets.peers
        for i, ch in self.peers.items():
            if not ch.is_unix:
                raise ValueError(f"rank {self.ranks[i]} is not connected over AF_UNIX; shared memory needs "
                                 "every member on this host and a mesh built with shm enabled")
        self.small_bytes = small_bytes
        if regions is None:
            regions = _default_regions(self.size, piece_bytes, config.shm_region_bytes)
        regions = [max(_ALIGN, r // _ALIGN * _ALIGN) for r in regions]
        # region_bytes / slot_bytes: the default piece (small allreduces, allgather, broadcast,
        # reducescatter); large allreduces use large_region_bytes, which the trial may change.
        self.regions = tuple(regions)
        self.region_bytes = self.large_region_bytes = regions[0]
        self.slot_bytes = self.region_bytes * self.size
        self._region_trial = Trial(regions, 2 * max(regions) * self.size) if len(regions) > 1 else None
        # Slots (and members' segments) start at staggered offsets so that the streams one reduction
        # touches do not all map to the same cache sets (power-of-two strides measured 2x slower).
        self._stride = max(regions) * self.size + _STAGGER
        self._segs: list[np.ndarray] | None = None
        self._maps: list[mmap.mmap] = []
        self._parity = 0
        self._tok = bytearray(1)
        # polls for a token before sleeping (see _recv_token)
        self._spin = Spin.for_peers(config.spin_wait_us, mesh.hostnames.count(mesh.hostnames[mesh.rank]))
        self._want_direct = config.shm_cross_memory if cross_memory is None else cross_memory
        self.direct_min_bytes, self.direct_chunk_bytes = direct_min_bytes, max(_ALIGN, direct_chunk_bytes)
        # Allreduces of plain arrays member to member (True) or through the segments, per size class (a
        # factor of 4: the kernel's copies gain on numpy's huge-page arrays of 4 MiB and up): measured.
        self._measure_path = cross_memory is None
        self._direct_by_size: dict[int, bool] = {}
        self._path_trials: dict[int, Trial] = {}
        self._cma: CrossMemory | None = None  # set by _setup where every member can use it
        self._pids: dict[int, int] = {}
        self._scratch = np.empty(0, np.uint8)
        self._held: tuple = ()
        self._summed = np.zeros(0)  # the last trial's medians, added over the members

    # -- setup ---------------------------------------------------------------------------------------
    def _setup(self) -> list[np.ndarray]:
        """Create my segment, pass its descriptor (and where I mapped it) to every member, map theirs, then
        agree on cross-memory copies (a collective)."""
        probe_at = 2 * self._stride + _STAGGER * self.size  # 8 bytes per member for the probe, after the slots
        size = probe_at + 8 * self.size
        pids = {i: _peer_pid(ch.sock) for i, ch in self.peers.items()}
        if self._want_direct:
            allow_peers([pid for pid in pids.values() if pid])  # before any member can probe me
        fd = os.memfd_create(f"horovod-shm-{self.ranks[self.rank]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            maps: dict[int, mmap.mmap] = {self.rank: mmap.mmap(fd, size)}
            mine = np.frombuffer(maps[self.rank], np.uint8)
            for ch in self.peers.values():
                ch.send_fd(_FD_FRAME, fd, struct.pack(f"<QQ{len(self.regions)}Q", size,
                                                      mine.__array_interface__["data"][0], *self.regions))
        finally:
            os.close(fd)
        where: dict[int, int] = {}
        for i, ch in self.peers.items():
            peer_fd, payload = ch.recv_fd(_FD_FRAME)
            try:
                theirs = struct.unpack(f"<{(len(payload) - 16) // 8}Q", payload[16:]) \
                    if len(payload) >= 24 and len(payload) % 8 == 0 else None
                if theirs is not None and theirs != self.regions:
                    raise WireError(f"rank {ch.peer} divides shared-memory allreduces into regions of {list(theirs)} "
                                    f"bytes, this rank into {list(self.regions)}: HOROVOD_SHM_REGION_BYTES must be "
                                    "the same on every rank")
                if theirs is None or struct.unpack("<Q", payload[:8])[0] != size \
                        or os.fstat(peer_fd).st_size != size:
                    raise WireError(f"rank {ch.peer} sent a segment of the wrong size")
                where[i] = struct.unpack("<Q", payload[8:16])[0]
                maps[i] = mmap.mmap(peer_fd, size)
            finally:
                os.close(peer_fd)
        self._maps = [maps[i] for i in range(self.size)]
        self._segs = [np.frombuffer(m, np.uint8) for m in self._maps]
        self._cma = self._agree_on_direct(where, pids, probe_at)
        return self._segs

    def _agree_on_direct(self, where: dict[int, int], pids: dict[int, int], probe_at: int) -> CrossMemory | None:
        """Whether every member can copy to and from every other's memory: each writes a nonce into each peer's
        segment through the peer's own mapping (``where``), checks it through its mapping of the same segment,
        reads it back, then all members swap their verdicts; any refusal anywhere keeps the segments."""
        cma = cross_memory() if self._want_direct else None
        reason = "off (HOROVOD_SHM_CROSS_MEMORY=0)" if not self._want_direct else "libc lacks process_vm_readv"
        at = probe_at + 8 * self.rank
        for i, ch in self.peers.items():
            if cma is None:
                break
            pid = pids[i]
            nonce = np.frombuffer(os.urandom(8), np.uint8).copy()
            back = np.zeros(8, np.uint8)
            try:
                if not pid:
                    raise OSError(0, "the peer's process id is not visible here (another pid namespace)")
                cma.write(pid, [(nonce.ctypes.data, 8)], [(where[i] + at, 8)])
                cma.read(pid, [(back.ctypes.data, 8)], [(where[i] + at, 8)])
            except OSError as e:
                cma, reason = None, f"refused for rank {ch.peer}: {e.strerror or e}"
                break
            if not (np.array_equal(back, nonce) and np.array_equal(self._segs[i][at:at + 8], nonce)):
                cma, reason = None, f"rank {ch.peer}'s memory did not hold what was copied there"
                break
            self._pids[i] = pid
        verdict = b"\x01" if cma is not None else b"\x00"
        for ch in self.peers.values():
            try:
                ch.sock.sendall(verdict)
            except OSError as e:
                raise ch._fail(e, _PROBE_WAIT) from e
        for ch in self.peers.values():
            got = self._recv_exactly(ch, bytearray(1), _PROBE_WAIT)
            if got not in (b"\x00", b"\x01"):
                raise PeerFailure(ch.peer, f"sent {bytes(got)!r} while {_PROBE_WAIT}")
            if got == b"\x00" and cma is not None:
                cma, reason = None, f"rank {ch.peer} cannot use them"
        logger.debug("shm %s: cross-memory copies %s", self.ranks, "on" if cma is not None else reason)
        if cma is None:
            self._pids = {}
        return cma

    def _region(self, member: int, slot: int, region: int, dtype: np.dtype, count: int,
                region_bytes: int | None = None) -> np.ndarray:
        segs = self._segs
        assert segs is not None
        start = _STAGGER * member + slot * self._stride + region * (region_bytes or self.region_bytes)
        return segs[member][start:start + count * dtype.itemsize].view(dtype)

    def _ready(self) -> None:
        """Map the segments on first use; every member calls this at the start of every shm collective."""
        if self._segs is None:
            self._setup()

    def _signal(self) -> None:
        """Send a token to every member, then wait for one from each (kernel wake-ups, no spinning)."""
        for ch in self.peers.values():
            try:
                ch.sock.sendall(_TOKEN)
            except OSError as e:
                raise ch._fail(e, "signalling") from e
        tok = self._tok
        for ch in self.peers.values():
            try:
                k = self._recv_token(ch, tok)
            except OSError as e:
                raise ch._fail(e, _TOKEN_WAIT) from e
            if k != 1:
                raise ch._fail(None, _TOKEN_WAIT)
            if tok[0] != 1:
                raise PeerFailure(ch.peer, f"sent {bytes(tok)!r} instead of a shared-memory signal")

    def _recv_exactly(self, ch: Channel, buf: bytearray, what: str) -> bytearray:
        """Fill ``buf`` from ``ch`` (polling first, like a token); ``PeerFailure`` on EOF or the deadline."""
        try:
            k = self._recv_token(ch, buf)
        except OSError as e:
            raise ch._fail(e, what) from e
        if k == 0:
            raise ch._fail(None, what)
        if k < len(buf):
            ch.recv_buffer_into(memoryview(buf)[k:], what)
        return buf

    def _recv_token(self, ch: Channel, tok: bytearray) -> int:
        """Receive token bytes from ``ch`` into ``tok`` (bytes received, 0 = EOF; fewer than ``len(tok)`` only
        when they came while polling), polling the socket for a while before sleeping in it.

        The members of a collective reach each token a few tens of microseconds apart (a region's copy); a
        sleeping member is woken 20-100 us after the token on a VM, and the sender pays for the wake-up too,
        which made a 256 KiB allreduce 3x slower than its copies (0.44 against 0.14 ms, np=2).  The final
        wait is the channel's blocking receive, bounded by its deadline as before."""
        sock, n = ch.sock, len(tok)

        def attempt() -> int | None:
            try:
                return sock.recv_into(tok, n, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None

        k = self._spin.poll(attempt)
        if k is None:
            ch.recv_buffer_into(tok, _TOKEN_WAIT)
            return n
        return k

    def close(self) -> None:
        self._segs = None
        self._held = ()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # an array still views it; the mapping goes with the process
                pass
        self._maps = []

    # -- allreduce -----------------------------------------------------------------------------------
    def allreduce(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        self.allreduce_scaled(inp, out, op, 1.0)

    takes_pieces = True

    def allreduce_scaled(self, inp: np.ndarray | Pieces, out: np.ndarray | Pieces, op: ReduceOp,
                         scale: float) -> None:
        """Also takes :class:`Pieces`: each piece is copied and reduced straight from the input's parts and
        its results copied straight into the output's."""
        if self.size == 1 or inp.nbytes <= self.small_bytes:
            if type(out) is Pieces:
                flat = np.empty(out.size, out.dtype)
                self.allreduce_scaled(inp, flat, op, scale)
                out.scatter(flat)
                return
            if type(inp) is Pieces:
                inp = inp.concatenate(out)
            self.sockets.allreduce_scaled(inp, out, op, scale)
            return
        size_class = inp.nbytes.bit_length() // 2
        if self._direct_by_size.get(size_class, True) and self._direct(inp.nbytes):
            plain = type(inp) is np.ndarray and type(out) is np.ndarray
            where = self._swap_addresses(inp if plain else None, out if plain else None,
                                         [inp.nbytes] * self.size, "an allreduce")
            if where is not None:
                self._allreduce_plain(inp, out, op, scale, where, size_class)
                return
            # a member holds Pieces (TensorFlow's own buffers): through the segments, where they measured faster
        self._allreduce_segments(inp, out, op, scale)

    def _allreduce_plain(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp, scale: float,
                         where: dict[int, tuple[int, int]], size_class: int) -> None:
        """Plain arrays on every member: member to member, or through the segments while this size class is
        measured (and after, where they won)."""
        trial = None
        if self._measure_path and size_class not in self._direct_by_size:
            trial = self._path_trials.setdefault(size_class, Trial((True, False), 0))
        direct = trial is None or trial.candidate_for(inp.nbytes) is not False
        start = time.perf_counter()  # all members are together after the swap of addresses
        if direct:
            self._allreduce_direct(inp, out, op, scale, where)
        else:
            self._allreduce_segments(inp, out, op, scale)
        if trial is None or not self._decided(trial, direct, time.perf_counter() - start, inp.nbytes):
            return
        chosen = self._direct_by_size[size_class] = trial.choose(self._summed)
        del self._path_trials[size_class]
        how = "member to member" if chosen else "through the segments"
        self._log_choice(f"allreduces of plain arrays of {2 ** (2 * size_class - 1)} to {2 ** (2 * size_class + 1)} "
                         f"bytes {how}", ["member to member", "segments"])

    def direct_for(self, nbytes: int) -> bool | None:
        """Whether an allreduce of ``nbytes`` of plain arrays goes member to member where the kernel allows
        it; None while that is being measured."""
        size_class = nbytes.bit_length() // 2
        if size_class in self._direct_by_size or not self._measure_path:
            return self._direct_by_size.get(size_class, True)
        return None

    def _allreduce_segments(self, inp: np.ndarray | Pieces, out: np.ndarray | Pieces, op: ReduceOp,
                            scale: float) -> None:
        """Through the shared segments: one round for a buffer that fits a piece, else the owner scheme."""
        self._ready()
        dtype, size, me = inp.dtype, self.size, self.rank
        if inp.nbytes <= self.slot_bytes and (size == 2 or size * inp.nbytes <= ONE_ROUND_BYTES):
            self._allreduce_one_round(inp, inp.size, dtype, out, op, scale)
            return
        trial = self._region_trial
        region_bytes = trial.candidate_for(inp.nbytes) if trial is not None else None
        timed = region_bytes is not None
        region_bytes = region_bytes or self.large_region_bytes
        region = region_bytes // dtype.itemsize
        piece = region * size
        total = inp.size
        npieces = -(-total // piece)
        base_slot = self._parity

        def part(k: int, i: int) -> tuple[int, int]:
            lo = k * piece + i * region
            return lo, min(lo + region, total)

        if type(inp) is Pieces:
            segments = inp.segments
        else:
            def segments(lo: int, hi: int) -> tuple[tuple[int, np.ndarray], ...]:
                return ((0, inp[lo:hi]),)
        if type(out) is Pieces:
            def put(lo: int, src: np.ndarray) -> None:
                for off, dst in out.segments(lo, lo + src.size):
                    copy_into(dst, src[off:off + dst.size])
        else:
            def put(lo: int, src: np.ndarray) -> None:
                copy_into(out[lo:lo + src.size], src)

        def copy_in(k: int) -> None:
            slot = (base_slot + k) & 1
            for i in range(size):
                if i != me:
                    lo, hi = part(k, i)
                    if hi > lo:
                        dst = self._region(me, slot, i, dtype, hi - lo, region_bytes)
                        for off, src in segments(lo, hi):
                            copy_into(dst[off:off + src.size], src)

        copy_in(0)
        self._signal()
        start = time.perf_counter()  # the members are together from here: what the region size changes
        for k in range(npieces):
            slot = (base_slot + k) & 1
            lo, hi = part(k, me)
            if hi > lo:
                n = hi - lo
                dst = self._region(me, slot, me, dtype, n, region_bytes)
                theirs = [None if i == me else self._region(i, slot, me, dtype, n, region_bytes)
                          for i in range(size)]
                for off, mine in segments(lo, hi):  # one segment unless the input is Pieces
                    m = mine.size
                    srcs = [mine if i == me else theirs[i][off:off + m] for i in range(size)]
                    seg = dst[off:off + m]
                    reduce_into(op, srcs[0], srcs[1], seg)
                    for src in srcs[2:]:
                        reduce_into(op, seg, src, seg)
                scale_inplace(dst, scale)  # my part only, still in cache; the others copy it scaled
                put(lo, dst)
            if k + 1 < npieces:
                copy_in(k + 1)
            self._signal()
            for i in range(size):
                if i != me:
                    plo, phi = part(k, i)
                    if phi > plo:
                        put(plo, self._region(i, slot, i, dtype, phi - plo, region_bytes))
        self._parity = (base_slot + npieces) & 1
        if timed and self._decided(trial, region_bytes, time.perf_counter() - start, inp.nbytes):
            self.large_region_bytes, self._region_trial = trial.choose(self._summed), None
            self._log_choice(f"large allreduces in regions of {self.large_region_bytes // 1024} KiB",
                             [f"{c // 1024} KiB" for c in trial.candidates])

    def _decided(self, trial: Trial, candidate: Any, seconds: float, nbytes: int) -> bool:
        """Record one allreduce of ``trial``; once it is complete, swap every member's medians (into
        ``self._summed``, added in member order, so every member chooses alike) and say so."""
        trial.record(candidate, seconds, nbytes)
        if not trial.complete:
            return False
        mine = trial.medians()
        everyone = np.empty(mine.size * self.size, np.float64)
        self.sockets.allgatherv(mine, everyone, [mine.size] * self.size)
        self._summed = everyone.reshape(self.size, mine.size).sum(axis=0)
        return True

    def _log_choice(self, chosen: str, tried: list[str]) -> None:
        logger.info("shm %s: %s (measured %s: %s ns per MB, all members)", self.ranks, chosen, ", ".join(tried),
                    [round(t * 1e15) for t in self._summed])

    def _allreduce_one_round(self, inp: np.ndarray | Pieces, total: int, dtype: np.dtype,
                             out: np.ndarray | Pieces, op: ReduceOp, scale: float) -> None:
        """A buffer that fits one piece: publish it whole, one token round, every member reduces all of it.

        Saves the second token round (a wake-up per member, most of the cost below a few hundred KiB: 80 KiB
        at np=2 176 -> 105 us end to end); at two members it moves about as many bytes as the owner scheme,
        beyond two every member reads every input, so there it is for small buffers (:data:`ONE_ROUND_BYTES`).
        Every member reads all inputs from the segments in member order, so results are bit-identical (and
        ``out`` may be the input)."""
        slot = self._parity
        mine = self._region(self.rank, slot, 0, dtype, total)
        if type(inp) is Pieces:
            inp.concatenate(mine)  # one C call however many parts
        else:
            copy_into(mine, inp)
        self._signal()
        srcs = [self._region(i, slot, 0, dtype, total) for i in range(self.size)]
        for off, dst in (out.segments(0, total) if type(out) is Pieces else ((0, out),)):
            n = dst.size
            reduce_into(op, srcs[0][off:off + n], srcs[1][off:off + n], dst)
            for src in srcs[2:]:
                reduce_into(op, dst, src[off:off + n], dst)
            scale_inplace(dst, scale)
        self._parity = (slot + 1) & 1

    def _allreduce_direct(self, inp: np.ndarray, out: np.ndarray, op: ReduceOp, scale: float,
                          where: dict[int, tuple[int, int]]) -> None:
        """Member to member (see the module doc; ``where``: each other member's input and output address): per
        chunk of the part I own, read the others' inputs of it, reduce them with mine in member order straight
        into my output, scale, and write that into theirs; one token round.  Every part is reduced by one
        member, so all get the same bits."""
        read, write = self._cma.read, self._cma.write  # type: ignore[union-attr]
        dtype, size, me = inp.dtype, self.size, self.rank
        itemsize = dtype.itemsize
        bounds = offsets(split_counts(inp.size, size))
        lo, hi = bounds[me], bounds[me + 1]
        step = max(1, self.direct_chunk_bytes // itemsize)
        rows = [r.view(dtype) for r in self._scratch_rows(size, step * itemsize)]  # the members' inputs
        # Beyond two members the result may overwrite my input (in place) before the third is added: copy it.
        copy_mine = me >= 2
        self._held = (inp, out)  # a peer that failed mid-copy may still write into out: keep it allocated
        for s in range(lo, hi, step):
            e = min(s + step, hi)
            nbytes, at = (e - s) * itemsize, s * itemsize
            for i, (their_in, _) in where.items():
                self._copy(read, i, rows[i], their_in + at, nbytes)
            mine = inp[s:e]
            if copy_mine:
                copy_into(rows[me][:e - s], mine)
                mine = rows[me][:e - s]
            acc = out[s:e]
            srcs = [mine if i == me else rows[i][:e - s] for i in range(size)]
            reduce_into(op, srcs[0], srcs[1], acc)
            for src in srcs[2:]:
                reduce_into(op, acc, src, acc)
            scale_inplace(acc, scale)
            for i, (_, their_out) in where.items():
                self._copy(write, i, acc, their_out + at, nbytes)
        self._signal()
        self._held = ()

    def _direct(self, nbytes: int) -> bool:
        """Whether a collective of ``nbytes`` may go member to member (maps the segments first)."""
        self._ready()
        return self._cma is not None and nbytes >= self.direct_min_bytes

    def _copy(self, call: Any, member: int, local: np.ndarray, remote: int, nbytes: int) -> None:
        """``call`` (read or write) between ``local`` and ``nbytes`` at address ``remote`` of ``member``."""
        try:
            call(self._pids[member], [(_address(local), nbytes)], [(remote, nbytes)])
        except OSError as e:
            gone = e.errno == errno.ESRCH
            raise PeerFailure(self.ranks[member], "exited during a cross-memory copy" if gone else
                              f"cross-memory copy failed: {e.strerror or e}", closed=gone) from e

    def _swap_addresses(self, inp: np.ndarray | None, out: np.ndarray | None, nbytes: list[int],
                        collective: str) -> dict[int, tuple[int, int]] | None:
        """Send every member where my input and output lie (None, or strided: not plain arrays); receive theirs,
        member ``i``'s input checked to be ``nbytes[i]`` long.  None unless every member's buffers are plain
        contiguous arrays: then nobody copies member to member (every member learns the same)."""
        plain = inp is not None and out is not None and inp.flags.c_contiguous and out.flags.c_contiguous
        msg = _WHERE.pack(_WHERE_MAGIC, nbytes[self.rank], plain, _address(inp) if plain else 0,
                          _address(out) if plain else 0)
        what = "swapping buffer addresses"
        for ch in self.peers.values():
            try:
                ch.sock.sendall(msg)
            except OSError as e:
                raise ch._fail(e, what) from e
        where = {}
        for i, ch in self.peers.items():
            magic, size, their_plain, their_in, their_out = _WHERE.unpack(
                self._recv_exactly(ch, bytearray(_WHERE.size), what))
            if magic != _WHERE_MAGIC or size != nbytes[i] or their_plain > 1:
                raise PeerFailure(ch.peer, f"sent a malformed buffer description ({size} bytes) for {collective} "
                                           f"expecting {nbytes[i]} bytes from it")
            plain = plain and bool(their_plain)
            where[i] = (their_in, their_out)
        return where if plain else None

    def _scratch_rows(self, count: int, nbytes: int) -> list[np.ndarray]:
        """``count`` cache-sized rows of scratch, kept between collectives."""
        stride = -(-nbytes // _ALIGN) * _ALIGN
        if self._scratch.size < count * stride:
            self._scratch = np.empty(count * stride + _ALIGN, np.uint8)
        base = (-self._scratch.__array_interface__["data"][0]) % _ALIGN
        return [self._scratch[base + k * stride:base + k * stride + nbytes] for k in range(count)]

    # -- publish/consume rounds (allgatherv, broadcast) ----------------------------------------------
    def _rounds(self, nrounds: int, copy_in: Any, consume: Any) -> None:
        """``copy_in(k, slot)`` into my slot, token round, ``consume(k, slot)`` from the others' slots."""
        self._ready()
        base = self._parity
        copy_in(0, base & 1)
        self._signal()
        for k in range(nrounds):
            consume(k, (base + k) & 1)
            if k + 1 < nrounds:
                copy_in(k + 1, (base + k + 1) & 1)
                self._signal()
        self._parity = (base + nrounds) & 1

    def allgatherv(self, inp: np.ndarray, out: np.ndarray, counts: list[int]) -> None:
        if self.size == 1 or out.nbytes <= self.small_bytes:
            self.sockets.allgatherv(inp, out, counts)
            return
        dtype, me = out.dtype, self.rank
        offs = offsets(counts)
        where = self._swap_addresses(inp, out, [c * dtype.itemsize for c in counts], "an allgather") \
            if self._direct(out.nbytes) else None
        if where is not None:  # each member reads the others' inputs straight into its output
            self._held = (inp, out)
            place(out[offs[me]:offs[me + 1]], inp)
            for i, (their_in, _) in where.items():
                if counts[i]:
                    part = out[offs[i]:offs[i + 1]]
                    self._copy(self._cma.read, i, part, their_in, part.nbytes)
            self._signal()  # nobody returns (and frees its input) before every member has read it
            self._held = ()
            return
        chunk = self.slot_bytes // dtype.itemsize  # a member's whole slot per round
        nrounds = -(-max(counts) // chunk)
        place(out[offs[me]:offs[me + 1]], inp)

        def copy_in(k: int, slot: int) -> None:
            lo, hi = k * chunk, min((k + 1) * chunk, counts[me])
            if hi > lo:
                copy_into(self._slot(me, slot, dtype, hi - lo), inp[lo:hi])

        def consume(k: int, slot: int) -> None:
            for i in range(self.size):
                lo, hi = k * chunk, min((k + 1) * chunk, counts[i])
                if i != me and hi > lo:
                    copy_into(out[offs[i] + lo:offs[i] + hi], self._slot(i, slot, dtype, hi - lo))

        self._rounds(nrounds, copy_in, consume)

    def _slot(self, member: int, slot: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._region(member, slot, 0, dtype, count)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.size == 1 or buf.nbytes <= self.small_bytes:
            self.sockets.broadcast(buf, root)
            return
        dtype, me = buf.dtype, self.rank
        where = self._swap_addresses(buf, buf, [buf.nbytes] * self.size, "a broadcast") \
            if self._direct(buf.nbytes) else None
        if where is not None:  # the others read the root's buffer where it lies
            self._held = (buf,)
            if me != root:
                self._copy(self._cma.read, root, buf, where[root][0], buf.nbytes)
            self._signal()  # the root returns once every member has read its buffer
            self._held = ()
            return
        chunk = self.slot_bytes // dtype.itemsize
        nrounds = -(-buf.size // chunk)

        def copy_in(k: int, slot: int) -> None:
            if me == root:
                lo, hi = k * chunk, min((k + 1) * chunk, buf.size)
                copy_into(self._slot(me, slot, dtype, hi - lo), buf[lo:hi])

        def consume(k: int, slot: int) -> None:
            if me != root:
                lo, hi = k * chunk, min((k + 1) * chunk, buf.size)
                copy_into(buf[lo:hi], self._slot(root, slot, dtype, hi - lo))

        self._rounds(nrounds, copy_in, consume)

    def reducescatterv(self, inp: np.ndarray, out: np.ndarray, counts: list[int], op: ReduceOp) -> None:
        if self.size == 1 or inp.nbytes <= self.small_bytes:
            self.sockets.reducescatterv(inp, out, counts, op)
            return
        dtype, me, size = inp.dtype, self.rank, self.size
        offs = offsets(counts)
        region = self.region_bytes // dtype.itemsize
        nrounds = -(-max(counts) // region)
        if counts[me] and np.shares_memory(out, inp):
            inp = inp.copy()

        def copy_in(k: int, slot: int) -> None:
            for i in range(size):
                lo, hi = k * region, min((k + 1) * region, counts[i])
                if i != me and hi > lo:
                    copy_into(self._region(me, slot, i, dtype, hi - lo), inp[offs[i] + lo:offs[i] + hi])

        def consume(k: int, slot: int) -> None:
            lo, hi = k * region, min((k + 1) * region, counts[me])
            if hi <= lo:
                return
            n = hi - lo
            srcs = [inp[offs[me] + lo:offs[me] + hi] if i == me else self._region(i, slot, me, dtype, n)
                    for i in range(size)]
            dst = out[lo:hi]
            reduce_into(op, srcs[0], srcs[1], dst)
            for src in srcs[2:]:
                reduce_into(op, dst, src, dst)

        self._rounds(nrounds, copy_in, consume)

    # -- the rest over the sockets ---------------------------------------------------------------------
    def alltoallv(self, inp: np.ndarray, send_counts: list[int], out: np.ndarray,
                  recv_counts: list[int]) -> None:
        self.sockets.alltoallv(inp, send_counts, out, recv_counts)

    def barrier(self) -> None:
        self.sockets.barrier()


def _peer_pid(sock: socket.socket) -> int:
    """The process at the other end of an AF_UNIX socket, as the kernel saw it connect (0: not visible)."""
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    except OSError:
        return 0


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _default_regions(size: int, piece_bytes: int | None, configured: int) -> list[int]:
    """Region sizes a communicator of ``size`` members tries (see ``ShmCommunicator``'s ``regions``)."""
    if piece_bytes is not None:
        return [piece_bytes // size]
    if configured:
        return [configured]
    return [r for r in REGION_CHOICES if r * size <= MAX_PIECE_BYTES] or [MAX_PIECE_BYTES // size]
