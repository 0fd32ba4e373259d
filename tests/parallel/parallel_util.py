"""Helpers for the lockstep parallel tests: every rank can build every rank's input.

Inputs come from a seed derived from (test name, rank), so each rank knows what every other rank
contributed and computes the expected result with numpy on its own.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # optional
    BF16 = None

ALL_DTYPES = [np.dtype(n) for n in ("uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32",
                                    "float64", "bool")] + ([BF16] if BF16 is not None else [])
SHUT_DOWN_PREFIX = "Horovod has been shut down."


def seed(*parts) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


def data(key, rank: int, shape, dtype, *, low: int = -8, high: int = 8) -> np.ndarray:
    """Rank ``rank``'s input for test ``key``: small integers (exact in every dtype, any summation order)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed(key), rank])
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "u":
        low = max(low, 0)
    values = rng.integers(low, high + 1, shape)
    return values.astype(dtype)


def launcher_rank_size() -> tuple[int, int]:
    return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])


def reduce_expected(xs: list[np.ndarray], op: int) -> np.ndarray:
    """Sum/Min/Max/Product (ops 1, 3, 4, 5) across ``xs`` in their own dtype."""
    ufunc = {1: np.add, 3: np.minimum, 4: np.maximum, 5: np.multiply}[op]
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = ufunc(acc, x).astype(xs[0].dtype)
    return acc


def scale_expected(x: np.ndarray, factor: float) -> np.ndarray:
    """Upstream's scaling rules: ints in float64 truncated toward zero; 16-bit floats in float32."""
    if factor == 1.0 or x.dtype == np.bool_:
        return x.copy()
    if x.dtype.kind in "iu":
        return np.trunc(x.astype(np.float64) * np.float64(factor)).astype(x.dtype)
    if x.dtype.itemsize == 2:
        return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)
    return (x * x.dtype.type(factor)).astype(x.dtype)


def allreduce_expected(xs: list[np.ndarray], op: int, prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    scaled = [scale_expected(x, prescale) for x in xs]
    if op == 0:  # Average = Sum then postscale / n
        return scale_expected(reduce_expected(scaled, 1), postscale / len(xs))
    return scale_expected(reduce_expected(scaled, op), postscale)


def adasum_expected(xs: list[np.ndarray]) -> np.ndarray:
    """Upstream's test reference of hvd.Adasum, in float64: neighbours (2i, 2i+1) combined level by level with
    ``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b`` (coefficient 1 for a zero vector)."""
    level = [np.asarray(x, np.float64).ravel() for x in xs]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, a2, b2 = np.inner(a, b), np.inner(a, a), np.inner(b, b)
            pairs.append((1.0 - dot / a2 * 0.5 if a2 else 1.0) * a + (1.0 - dot / b2 * 0.5 if b2 else 1.0) * b)
        if len(level) % 2:  # ours beyond upstream: an odd member out goes up unchanged
            pairs.append(level[-1])
        level = pairs
    return level[0].reshape(np.shape(xs[0]))


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.dtype == BF16 and BF16 is not None:
        np.testing.assert_array_equal(actual.astype(np.float32), expected.astype(np.float32))
    else:
        np.testing.assert_array_equal(actual, expected)


def reducescatter_rows(dim0: int, n: int) -> list[int]:
    return [dim0 // n + (1 if j < dim0 % n else 0) for j in range(n)]


def last_rank_short_text(op: str, base: str, size: int) -> str:
    """The error every rank gets when the last rank passes 2 tensors to a grouped collective and the others 3
    (written out here, not with the engine's formatting)."""
    others = list(range(size - 1))
    who = f"rank {others[0]}" if len(others) == 1 else \
        f"ranks {', '.join(str(r) for r in others[:-1])} and {others[-1]}"
    return (f"Mismatched grouped {op} sizes for {base}: {who} sent a group of 3 tensors, but rank {size - 1} sent a "
            "group of 2 tensors. Every rank must pass the same number of tensors to a grouped collective of one "
            "name.")
