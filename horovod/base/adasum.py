"""Adasum: the adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with Adaptive
Summation", MLSys 2021), upstream's ``hvd.Adasum`` reduction.

Two gradients combine as ``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b`` (a coefficient stays 1 when its
vector's squared norm is below 1e-8): orthogonal gradients add up, parallel ones average.  Ranks combine in
upstream's binary tree, neighbours ``(2i, 2i + 1)`` first, level by level; every tensor of a fused buffer is
combined on its own.  Upstream allowed only a power-of-two number of ranks in the global set; here a level
with an odd count passes its last member up unchanged (the same tree for powers of two), and any process set
works.

For a power-of-two number of members the data plane runs the tree by recursive doubling: at level ``l``
each rank exchanges its buffer with rank ``r ^ 2**l`` and both combine the same two buffers in the same order
(the lower ranks' side first), so after log2(size) exchanges every rank holds bitwise the same result, the
one :func:`tree` computes from all the buffers at once (upstream's vector-halving exchange computes the same
tree in another order of float operations); for other counts every member gathers all buffers and runs
:func:`tree`.  Dot products and norms accumulate in float64, as upstream's do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["combine", "combine_tensors", "tree", "scaled", "adasum_of", "check_dtype"]

_TINY = 1e-8
_ROW = 4096
_LANES = 64
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def check_dtype(dtype) -> None:
    """Raises ValueError unless ``dtype`` is one Adasum reduces (upstream's: float16, float32, float64)."""
    if np.dtype(dtype) not in _FLOATS:
        raise ValueError(f"The Adasum reduction supports float16, float32 and float64 tensors, not {np.dtype(dtype)}.")


def _dot(x: np.ndarray, y: np.ndarray, scratch: np.ndarray) -> float:
    """``x . y`` summed in float64 in an order that does not depend on where the arrays lie in memory (numpy's
    and BLAS's reductions take SIMD paths by alignment, and partners combining the same two buffers from
    different addresses must get bitwise the same result): element-wise products, added up row by row
    (strided reductions, which have one order) into 4096 and then 64 partial sums, then ``math.fsum``."""
    products = np.multiply(x, y, out=scratch[:x.size])
    terms: list[float] = []
    for width in (_ROW, _LANES):
        rows = products.size // width
        if rows == 0:
            continue
        head = np.add.reduce(products[:rows * width].reshape(rows, width), axis=0, dtype=np.float64)
        terms += products[rows * width:].tolist()
        products = head
    return math.fsum(terms + products.tolist())


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One pairwise Adasum step of two 1-D arrays of the same float dtype (float16 computed in float32)."""
    work = np.float32 if a.dtype == np.float16 else a.dtype.type
    x, y = a.astype(work, copy=False), b.astype(work, copy=False)
    scratch = np.empty_like(x)
    dot, a2, b2 = _dot(x, y, scratch), _dot(x, x, scratch), _dot(y, y, scratch)
    ca = 1.0 - dot / (2.0 * a2) if a2 >= _TINY else 1.0
    cb = 1.0 - dot / (2.0 * b2) if b2 >= _TINY else 1.0
    out = np.multiply(x, work(ca))
    out += np.multiply(y, work(cb), out=scratch)
    return out if out.dtype == a.dtype else out.astype(a.dtype)


def combine_tensors(lower: np.ndarray, upper: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Two flat buffers of the same tensors (``counts`` elements each, back to back) combined tensor by tensor;
    ``lower`` is the lower ranks' side of the tree (the order of the float operations is part of the result)."""
    out = np.empty_like(lower)
    offset = 0
    for n in counts:
        out[offset:offset + n] = combine(lower[offset:offset + n], upper[offset:offset + n])
        offset += n
    return out


def tree(contributions: Sequence[np.ndarray], counts: Sequence[int]) -> np.ndarray:
    """Every member's flat buffer (in set-rank order) combined in upstream's tree (an odd member out of a level
    goes up unchanged): a new flat array."""
    level = list(contributions)
    while len(level) > 1:
        level = [combine_tensors(level[i], level[i + 1], counts) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0].copy() if level[0] is contributions[0] else level[0]


def scaled(buf: np.ndarray, factor: float) -> np.ndarray:
    """``buf * factor`` computed in float64 and stored in ``buf``'s dtype (a new array; ``buf`` if 1.0)."""
    return buf if factor == 1.0 else (buf.astype(np.float64) * factor).astype(buf.dtype)


def adasum_of(contributions: Sequence[np.ndarray], counts: Sequence[int], prescale: float = 1.0,
              postscale: float = 1.0) -> np.ndarray:
    """The Adasum allreduce of the members' flat buffers, with upstream's order of scaling: each input by
    ``prescale``, then the tree, then the result by ``postscale``."""
    return scaled(tree([scaled(c, prescale) for c in contributions], counts), postscale)
