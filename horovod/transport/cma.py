"""Cross-memory attach: one kernel copy between this process's memory and a peer's on the same host.

``process_vm_readv`` / ``process_vm_writev`` (Linux 3.2+) copy straight between two address spaces, so a
collective among ranks of one host need not stage every byte in a shared segment (one copy in, one copy out):
the owner of a part reads the others' inputs of it and writes its result into their outputs.  The kernel
allows it between processes that may ptrace each other (same user; under Yama's ``ptrace_scope`` 1 only
once the target names an ancestor of the caller with ``PR_SET_PTRACER``, which :func:`allow_peers` does for the
launcher that started the ranks); where the kernel, a seccomp profile or Yama refuses, the shared segments
carry the bytes (:class:`~horovod.transport.shm.ShmCommunicator` probes first).

Addresses come from peers over the job's authenticated channels; a wrong one makes the call fail (``EFAULT``)
or touch only memory of the peer, which this process may ptrace anyway.  Buffers are described by
:class:`Layout`: where each contiguous part of a logical 1-D byte range lives.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import struct

import numpy as np

from horovod.transport.buffers import Pieces

__all__ = ["Layout", "CrossMemory", "cross_memory", "allow_peers", "common_ancestor"]

_IOV_MAX = 1024  # the kernel's limit of iovecs per call (UIO_MAXIOV)
_PR_SET_PTRACER = 0x59616D61


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Layout:
    """Where the bytes ``[0, nbytes)`` of a logical 1-D buffer live: part ``i`` starts at byte ``starts[i]`` of
    the buffer and at address ``addrs[i]``.  Built from a local buffer, or decoded from a peer's message."""

    __slots__ = ("starts", "addrs", "nbytes")
    _PAIR = struct.Struct("<QQ")

    def __init__(self, starts: list[int], addrs: list[int], nbytes: int) -> None:
        self.starts, self.addrs, self.nbytes = starts, addrs, nbytes

    @classmethod
    def of(cls, buf: np.ndarray | Pieces) -> Layout:
        if type(buf) is Pieces:
            size = buf.dtype.itemsize
            parts = [p for p in buf.parts if p.size]
            starts, at = [], 0
            for p in parts:
                starts.append(at)
                at += p.size * size
            return cls(starts, [p.__array_interface__["data"][0] for p in parts], at)
        if not buf.flags.c_contiguous:  # the communicators' contract; a strided view would read other memory
            raise ValueError("cross-memory copies need C-contiguous buffers")
        return cls([0], [buf.__array_interface__["data"][0]], buf.nbytes)

    def encode(self) -> bytes:
        return b"".join(self._PAIR.pack(s, a) for s, a in zip(self.starts, self.addrs))

    @classmethod
    def decode(cls, data: bytes, nbytes: int) -> Layout:
        """The inverse of :meth:`encode`; ``ValueError`` unless the parts start at 0 and in increasing order
        within ``nbytes``."""
        pairs = np.frombuffer(data, "<u8").reshape(-1, 2)
        starts, addrs = pairs[:, 0].tolist(), pairs[:, 1].tolist()
        if nbytes and (not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:]))
                       or starts[-1] >= nbytes):
            raise ValueError("a buffer layout whose parts do not start at 0 and increase")
        return cls(starts, addrs, nbytes)

    def iovecs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(address, length) of the bytes ``[lo, hi)``, part by part."""
        starts, addrs = self.starts, self.addrs
        i = bisect.bisect_right(starts, lo) - 1
        out = []
        while lo < hi:
            end = starts[i + 1] if i + 1 < len(starts) else self.nbytes
            take = min(hi, end) - lo
            out.append((addrs[i] + lo - starts[i], take))
            lo += take
            i += 1
        return out


class CrossMemory:
    """The two calls, bound once through ctypes; each raises ``OSError`` unless every byte was copied."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._calls = []
        for name in ("process_vm_readv", "process_vm_writev"):
            fn = getattr(libc, name)  # AttributeError: a libc without it
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
            self._calls.append(fn)
        self._single = (_Iovec(), _Iovec())

    def read(self, pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
        """Copy the peer's ``remote`` (address, length) ranges, in order, into this process's ``local`` ones."""
        self._copy(self._calls[0], pid, local, remote)

    def write(self, pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
        """Copy this process's ``local`` (address, length) ranges, in order, into the peer's ``remote`` ones."""
        self._copy(self._calls[1], pid, local, remote)

    def _copy(self, call, pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
        nbytes = sum(n for _, n in remote)
        if len(local) > _IOV_MAX or len(remote) > _IOV_MAX or sum(n for _, n in local) != nbytes:
            raise ValueError(f"{len(local)} and {len(remote)} ranges of different or too many bytes")
        done = call(pid, self._iovecs(local, 0), len(local), self._iovecs(remote, 1), len(remote), 0)
        if done != nbytes:
            err = ctypes.get_errno() if done < 0 else errno.EFAULT
            raise OSError(err, f"{os.strerror(err)} ({done} of {nbytes} bytes copied)")

    def _iovecs(self, ranges: list[tuple[int, int]], which: int):
        if len(ranges) == 1:  # the common case, without building an array
            iov = self._single[which]
            iov.base, iov.len = ranges[0]
            return ctypes.byref(iov)
        return (_Iovec * len(ranges))(*ranges)


_cross_memory: CrossMemory | None | bool = False


def cross_memory() -> CrossMemory | None:
    """This process's :class:`CrossMemory`, or None where libc lacks the calls."""
    global _cross_memory
    if _cross_memory is False:
        try:
            _cross_memory = CrossMemory()
        except (AttributeError, OSError):
            _cross_memory = None
    return _cross_memory  # type: ignore[return-value]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[1])  # after the name, which may hold spaces and ')'


def _ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent ... up to (not including) init."""
    chain = []
    pid = _parent(pid)
    while pid > 1 and len(chain) < 256:
        chain.append(pid)
        pid = _parent(pid)
    return chain


def common_ancestor(pids: list[int]) -> int | None:
    """The nearest process (other than init) that is an ancestor of this one and of every process in ``pids``:
    the launcher that started this host's ranks, whatever stands between it and them (None if there is none or
    a process is not visible)."""
    try:
        mine = _ancestors(os.getpid())
        shared = set(mine)
        for pid in pids:
            shared.intersection_update(_ancestors(pid))
    except (OSError, ValueError, IndexError):
        return None
    return next((pid for pid in mine if pid in shared), None)


def _yama_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def allow_peers(pids: list[int]) -> None:
    """Under Yama's ``ptrace_scope`` 1 a process may only trace its own descendants, and the ranks of a host are
    cousins at best (``horovodrun`` puts a watchdog above each): name our nearest common ancestor as allowed
    tracer (``PR_SET_PTRACER``), which admits its descendants -- the peers -- and nothing outside its tree.  No
    effect without Yama; scope 2 and 3 refuse anyway (the probe then falls back to the segments)."""
    if _yama_scope() != 1:
        return
    ancestor = common_ancestor(pids)
    if ancestor is None:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, ctypes.c_ulong(ancestor), 0, 0, 0)
    except (AttributeError, OSError):
        pass
