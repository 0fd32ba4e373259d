"""Cross-memory attach: one kernel copy between this process's memory and a peer's on the same host.

``process_vm_readv`` / ``process_vm_writev`` (Linux 3.2+) copy straight between two address spaces, so a
collective among ranks of one host need not stage every byte in a shared segment (one copy in, one copy out):
the owner of a part reads the others' inputs of it and writes its result into their outputs.  The kernel
allows it between processes that may ptrace each other (same user; under Yama's ``ptrace_scope`` 1 only
once the target names an ancestor of the caller with ``PR_SET_PTRACER``, which :func:`allow_peers` does for the
launcher that started the ranks); where the kernel, a seccomp profile or Yama refuses, the shared segments
carry the bytes (:class:`~horovod.transport.shm.ShmCommunicator` probes first).

Addresses come from peers over the job's authenticated channels; a wrong one makes the call fail (``EFAULT``)
or touch only memory of the peer, which this process may ptrace anyway.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["CrossMemory", "cross_memory", "allow_peers", "common_ancestor"]

_IOV_MAX = 1024  # the kernel's limit of iovecs per call (UIO_MAXIOV)
_PR_SET_PTRACER = 0x59616D61


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


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
        done = call(pid, self._iovecs(local), len(local), self._iovecs(remote), len(remote), 0)
        if done != nbytes:
            err = ctypes.get_errno() if done < 0 else errno.EFAULT
            raise OSError(err, f"{os.strerror(err)} ({done} of {nbytes} bytes copied)")

    @staticmethod
    def _iovecs(ranges: list[tuple[int, int]]):
        """A ``struct iovec`` array, new for each call (communicators of several threads share this object)."""
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
