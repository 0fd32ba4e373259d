"""Pre/post-scaling with upstream's dtype rules.

Integers are scaled in float64 and truncated toward zero on the cast back (so an integer Average
truncates); float16 and bfloat16 are scaled in float32; other floats in their own precision.
"""

from __future__ import annotations

import numpy as np

__all__ = ["scale_inplace", "scaled_copy"]


def _factor_for(dtype: np.dtype, factor: float):
    kind = dtype.kind
    if kind in "iu":
        return np.float64(factor)
    if kind == "f" and dtype.itemsize > 2:  # float32/64 first: dtype.name costs ~20 us a call
        return dtype.type(factor)
    if dtype.itemsize <= 2 and kind in "fV" or dtype.name == "bfloat16":
        return np.float32(factor)
    return dtype.type(factor)


def scale_inplace(buf: np.ndarray, factor: float) -> None:
    """``buf *= factor`` following the dtype rules above; no-op for 1.0 and for bool."""
    if factor == 1.0 or buf.dtype == np.bool_ or buf.size == 0:
        return
    with np.errstate(all="ignore"):  # (float overflow is inf, silently: see communicator.reduce_into)
        np.multiply(buf, _factor_for(buf.dtype, factor), out=buf, casting="unsafe")


def scaled_copy(src: np.ndarray, factor: float, out: np.ndarray) -> None:
    """``out = src * factor`` with the same rules (``out`` may not alias ``src``)."""
    if factor == 1.0 or src.dtype == np.bool_:
        np.copyto(out, src)
        return
    with np.errstate(all="ignore"):
        np.multiply(src, _factor_for(src.dtype, factor), out=out, casting="unsafe")
