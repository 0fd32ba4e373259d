"""Whether tensors reduced together as one flat buffer have the same shapes on every rank.

The engine compares only the flat buffer's length, and other shapes can have the same length (``[2, 3]``
and ``[3, 2]``, two members swapped, or the alignment gaps between a group's members): their elements were
summed into the wrong tensors without a word.  So the first reduction of such a buffer in each participation
epoch (``basics.participation_epoch()``) also sums :func:`shape_moments` over the ranks; the torch
optimizer's buckets and TensorFlow's flat allreduce both use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from horovod.base.exceptions import PreconditionError

__all__ = ["shape_moments", "parameter_moments", "shapes_agree", "mismatch_error", "parameters_mismatch_error"]


def _moments(key: bytes) -> np.ndarray:
    d = (int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") & 0xFFFFF) + 1
    return np.array([1, d, d * d], dtype=np.int64)


def shape_moments(shapes: Sequence[Sequence[int]]) -> np.ndarray:
    """``[1, d, d*d]`` (int64) for a 20-bit hash ``d`` of ``shapes``."""
    return _moments(repr([tuple(int(d) for d in s) for s in shapes]).encode())


def parameter_moments(names: Sequence[str]) -> np.ndarray:
    """:func:`shape_moments` of the names of the parameters a model reduces: ranks with other parameters
    (another number of layers, a layer frozen on one rank) reduce names no other rank sends, which the engine
    can only report as a stall.  (Shapes that differ under the same names are the engine's and the buckets'
    own shape mismatch, upstream's error.)"""
    return _moments(repr([str(n) for n in names]).encode())


def shapes_agree(sums: Sequence[int], moments: Sequence[int]) -> bool:
    """Summed over the ranks that take part (a joined rank adds zeros), ``d`` is everyone's iff
    ``sum(d) == n*d`` and ``sum(d*d) == n*d*d``."""
    n, sum_d, sum_d2 = (int(x) for x in sums)
    _, d, d2 = (int(x) for x in moments)
    return sum_d == n * d and sum_d2 == n * d2


def mismatch_error(what: str, name: str | None, shapes: Sequence[Sequence[int]]) -> PreconditionError:
    """The engine's shape-mismatch error for a flat buffer (``what``: "gradients", "tensors")."""
    shown = ", ".join(str(list(s)) for s in shapes[:8]) + (", ..." if len(shapes) > 8 else "")
    return PreconditionError(
        f"Mismatched ALLREDUCE tensor shapes: the {what} reduced together as {name} do not have the same shapes "
        f"on every rank; this rank's: [{shown}] ({len(shapes)} tensors). Every rank must reduce the same tensors "
        "(train the same model).")


def parameters_mismatch_error(names: Sequence[str]) -> PreconditionError:
    """The error of ranks whose optimizers reduce different parameters (see :func:`parameter_moments`)."""
    return PreconditionError(
        "Mismatched parameters: the ranks' DistributedOptimizers do not reduce the same parameters; this rank's "
        f"{len(names)} trainable parameters run from {names[0]} to {names[-1]}.  Every rank must train the same "
        "model, with the same parameters trainable.")
