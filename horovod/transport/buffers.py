"""Buffer helpers shared by the communicators: block offsets, even splits and a fast copy.

``copy_into`` exists because glibc's ``memcpy`` (what ``np.copyto`` calls) uses ``rep movsb`` for mid-sized
copies, which is several times slower than a SIMD loop on some CPUs/VMs (measured here: 128 KiB at
~2.7 GB/s with memcpy vs ~25 GB/s with a uint64 ufunc loop); above ``MEMCPY_MIN`` memcpy is faster.
The pieces our shared-memory collectives move are exactly in that range.
"""

from __future__ import annotations

import numpy as np

__all__ = ["offsets", "split_counts", "copy_into", "place", "MEMCPY_MIN"]

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


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for 1-D contiguous arrays of one dtype, by the faster of two copy loops."""
    nbytes = src.nbytes
    if nbytes >= MEMCPY_MIN or nbytes < 64:
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
