"""The reduction operations: one definition for the public API, the engine and the data plane.

The values are upstream's (``hvd.Average == 0``, ``Sum == 1``, ``Adasum == 2``, ``Min == 3``, ``Max == 4``,
``Product == 5``), so requests on the wire and user code that compares ops with integers agree.  The data
plane only knows the element-wise ops; :func:`data_plane_op` is the one place where Average becomes Sum plus
a postscale by the number of contributors.
"""

from __future__ import annotations

import enum

__all__ = ["ReduceOp", "data_plane_op", "predivide_scales"]


class ReduceOp(enum.IntEnum):
    """A reduction; members are ``int`` s, so ``op == 0`` and ``struct.pack`` work as with upstream's ints."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


def data_plane_op(op: int, postscale: float, set_size: int) -> tuple[ReduceOp, float]:
    """The element-wise op a communicator runs for ``op`` and the postscale to apply after it.

    Average is a Sum whose postscale is divided by ``set_size`` (upstream's order: prescale, sum, then
    postscale / size), every other op is itself.

    Raises:
        ValueError: ``op`` is not a :class:`ReduceOp` value.
    """
    if op == ReduceOp.AVERAGE:
        return ReduceOp.SUM, postscale / set_size
    return ReduceOp(op), postscale


def predivide_scales(op: int, gradient_predivide_factor: float) -> tuple[float, float]:
    """(prescale, postscale) of upstream's ``gradient_predivide_factor``: for Average, divide by the factor
    before the sum and multiply it back after (the average's ``1 / size`` stays in :func:`data_plane_op`);
    other ops are not scaled."""
    if op == ReduceOp.AVERAGE:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0
