"""Buffer helpers shared by the communicators: block offsets, even splits and a fast copy.

``copy_into`` exists because glibc's ``memcpy`` (what ``np.copyto`` calls) uses ``rep movsb`` for mid-sized
copies, which is several times slower than a SIMD loop on some CPUs/VMs (measured on one host of this
project: 128 KiB at ~2.7 GB/s with memcpy vs ~25 GB/s with a uint64 ufunc loop) and faster on others (another
host: memcpy 1.2-2.5x faster from 16 to 192 KiB, also into shared memory); above ``MEMCPY_MIN`` memcpy is
faster everywhere.  The pieces our shared-memory collectives move are exactly in that range, so each process
measures once which loop this machine prefers (:func:`simd_copy_faster`).
"""

from __future__ import annotations

import bisect
import time

import numpy as np

__all__ = ["offsets", "split_counts", "copy_into", "simd_copy_faster", "place", "Pieces", "MEMCPY_MIN",
           "MERGE_BELOW"]

MEMCPY_MIN = 256 * 1024


def offsets(counts: list[int]) -> list[int]:
    """Start of each block when blocks of ``counts`` are concatenated (plus the total at the end)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def split_counts(n: int, parts: int) -> list[int]:
    """``n`` elements in ``parts`` nearly equal blocks (the boundaries every member computes alike)."""
    return [n * (i + 1) // parts - n * i // parts for i in range(parts)]


_simd_copy: bool | None = None


def simd_copy_faster() -> bool:
    """Whether a uint64 ufunc loop copies 128 KiB clearly faster than ``memcpy`` here (measured once, ~1 ms;
    the best of five timings of each, so that a busy moment does not decide)."""
    global _simd_copy
    if _simd_copy is None:
        src = np.ones(16384, np.uint64)
        dst = np.empty_like(src)

        def best(copy) -> float:
            copy()
            fastest = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(8):
                    copy()
                fastest = min(fastest, time.perf_counter() - start)
            return fastest
        memcpy = best(lambda: np.copyto(dst, src))
        simd = best(lambda: np.bitwise_or(src, 0, out=dst))
        _simd_copy = simd * 1.25 < memcpy
    return _simd_copy


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for 1-D arrays of one dtype, by the faster of two copy loops (the ufunc loop only
    between contiguous ones: a strided view, which the shared-memory communicator accepts, takes ``np.copyto``)."""
    nbytes = src.nbytes
    if nbytes >= MEMCPY_MIN or nbytes < 64 or not (_simd_copy if _simd_copy is not None else simd_copy_faster()) \
            or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        np.copyto(dst, src)
        return
    d8, s8 = dst.view(np.uint8), src.view(np.uint8)
    bulk = nbytes & ~7
    np.bitwise_or(s8[:bulk].view(np.uint64), 0, out=d8[:bulk].view(np.uint64))
    if bulk != nbytes:
        d8[bulk:] = s8[bulk:]


def place(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` unless it is the very same memory (in-place collectives); overlap-safe."""
    if not src.size or dst.__array_interface__["data"][0] == src.__array_interface__["data"][0]:
        return
    copy_into(dst, src if not np.shares_memory(dst, src) else src.copy())


MERGE_BELOW = 64 * 1024
"""Runs of :class:`Pieces` parts smaller than this are copied together once, so a model's hundreds of small
tensors cost a few slices per collective, not hundreds (their bytes are a small share of the total)."""


class Pieces:
    """Several contiguous arrays of one dtype read (or written) as their 1-D concatenation, without making it.

    As an allreduce input the shared-memory transport copies and reduces straight from the parts: the
    gradients of a TensorFlow step would otherwise first be concatenated, one more pass over every byte.  As an
    output (``merge=False``: every part is the caller's own memory) it writes the results straight into the
    parts, e.g. buffers TensorFlow owns, which its optimizer can then update in place.  Consumers that need
    one array call :meth:`concatenate` (``np.asarray`` does too) and, for an output, :meth:`scatter`."""

    __slots__ = ("parts", "dtype", "size", "nbytes", "shape", "_starts")
    ndim = 1

    def __init__(self, parts: list[np.ndarray], merge: bool = True) -> None:
        if not merge and not all(p.flags.c_contiguous for p in parts):
            raise ValueError("output Pieces must be contiguous arrays (results are written into them)")
        flat = [np.ascontiguousarray(p).reshape(-1) for p in parts]
        self.dtype = flat[0].dtype if flat else np.dtype(np.float32)
        merged: list[np.ndarray] = []
        run: list[np.ndarray] = []
        for p in flat:
            if p.dtype != self.dtype:
                raise ValueError(f"Pieces of one dtype expected, got {self.dtype} and {p.dtype}")
            if not merge:
                merged.append(p)
                continue
            if p.nbytes < MERGE_BELOW:
                run.append(p)
                continue
            if run:
                merged.append(np.concatenate(run) if len(run) > 1 else run[0])
                run = []
            merged.append(p)
        if run:
            merged.append(np.concatenate(run) if len(run) > 1 else run[0])
        self.parts = [p for p in merged if p.size]
        self._starts = offsets([p.size for p in self.parts])
        self.size = self._starts[-1]
        self.nbytes = self.size * self.dtype.itemsize
        self.shape = (self.size,)

    def reshape(self, *shape) -> Pieces:
        if shape not in ((-1,), (self.size,), ((-1,),), ((self.size,),)):
            raise ValueError(f"Pieces are 1-D ({self.size} elements); cannot reshape to {shape}")
        return self

    def concatenate(self, out: np.ndarray | None = None) -> np.ndarray:
        """The concatenation, into ``out`` when given (1-D, ``size`` elements)."""
        if out is None:
            out = np.empty(self.size, self.dtype)
        if self.parts:
            np.concatenate(self.parts, out=out)
        return out

    def scatter(self, src: np.ndarray) -> None:
        """Copy the 1-D ``src`` (``size`` elements) into the parts, in order."""
        for p, lo, hi in zip(self.parts, self._starts, self._starts[1:]):
            copy_into(p, src[lo:hi])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self.concatenate()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def segments(self, lo: int, hi: int) -> list[tuple[int, np.ndarray]]:
        """The parts' views covering elements ``[lo, hi)``, each with its offset from ``lo``."""
        starts = self._starts
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        found = []
        while i < len(self.parts) and starts[i] < hi:
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if b > a:
                found.append((a - lo, self.parts[i][a - starts[i]:b - starts[i]]))
            i += 1
        return found
