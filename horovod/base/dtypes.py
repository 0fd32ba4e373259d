"""Wire codes of tensor dtypes: the numpy dtypes the engine moves and reduces, and bfloat16 on demand.

bfloat16 is ml_dtypes' numpy type, an optional dependency whose import costs ~0.6 s: it is imported the
first time a bfloat16 array or code is seen (a caller holding such an array imported it already), not by
every rank of every job at start-up.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

import numpy as np

__all__ = ["DTYPES", "DTYPE_COUNT", "HAS_BFLOAT16", "dtype_code", "dtype_of", "bfloat16", "is_bfloat16"]

_NAMES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
_BFLOAT16 = len(_NAMES)  # bfloat16's code: ml_dtypes' type, an optional dependency
DTYPES: list[np.dtype] = [np.dtype(n) for n in _NAMES]
"""Wire code -> numpy dtype; bfloat16 joins on first use (:func:`dtype_of`)."""
_DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}
HAS_BFLOAT16 = importlib.util.find_spec("ml_dtypes") is not None
DTYPE_COUNT = len(_NAMES) + HAS_BFLOAT16
"""Codes a frame may carry: bfloat16 only where ml_dtypes is installed."""
_load_lock = threading.Lock()


def _load_bfloat16() -> bool:
    """Add ml_dtypes' bfloat16 to the table (importing it if nobody did yet); False without ml_dtypes."""
    if len(DTYPES) > _BFLOAT16:
        return True
    with _load_lock:  # (the engine's threads may meet their first bfloat16 at once)
        if len(DTYPES) > _BFLOAT16:
            return True
        try:
            import ml_dtypes
        except ImportError:  # bfloat16 is optional
            return False
        bf16 = np.dtype(ml_dtypes.bfloat16)
        _DTYPE_CODES[bf16] = _BFLOAT16
        DTYPES.append(bf16)  # last: a reader that sees the entry finds its code too
        return True


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported now if it was not; ValueError where ml_dtypes cannot be imported (a
    caller must never fall back to another view of the same bits)."""
    if not _load_bfloat16():
        raise ValueError("bfloat16 tensors need ml_dtypes, which cannot be imported here")
    return DTYPES[_BFLOAT16]


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16, without importing ml_dtypes."""
    return len(DTYPES) > _BFLOAT16 and dtype == DTYPES[_BFLOAT16]


def dtype_of(code: int) -> np.dtype:
    """The numpy dtype of a wire code (frames are validated against :data:`DTYPE_COUNT` when decoded)."""
    if code < len(DTYPES) or (code == _BFLOAT16 and _load_bfloat16()):
        return DTYPES[code]
    raise ValueError(f"dtype code {code} is not supported on this rank")


def dtype_code(dtype: np.dtype) -> int:
    """Wire code of a numpy dtype; ValueError for unsupported dtypes."""
    code = _DTYPE_CODES.get(dtype)  # an array's dtype object: one dict lookup
    if code is not None:
        return code
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16" and "ml_dtypes" in sys.modules:
        _load_bfloat16()
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"Tensor type {dtype} is not supported.") from None
