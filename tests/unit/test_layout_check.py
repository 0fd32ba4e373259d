"""The flat-buffer shape check shared by the torch optimizer's buckets and TensorFlow's flat allreduce
(horovod/common/layout_check.py): sums over ranks agree only when every rank has the same shapes."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.base.exceptions import PreconditionError
from horovod.common.layout_check import mismatch_error, shape_moments, shapes_agree


@pytest.mark.parametrize("other", [[(3, 2), (4,)], [(4,), (2, 3)], [(2, 3)], [(2, 3), (4,), (1,)]])
def test_other_shapes_of_the_same_length_disagree(other):
    mine = [(2, 3), (4,)]
    for n_same in (0, 1, 2):  # the ranks with this rank's shapes, besides it, and one with other shapes
        sums = shape_moments(mine) * (1 + n_same) + shape_moments(other)
        assert not shapes_agree(sums, shape_moments(mine))


def test_same_shapes_agree_and_a_joined_rank_adds_nothing():
    mine = [(2, 3), (4,)]
    assert shapes_agree(shape_moments(mine) * 3 + np.zeros(3, np.int64), shape_moments(mine))
    assert shapes_agree(shape_moments([[2, 3], [4]]), shape_moments(mine))  # lists or tuples alike


def test_error_names_the_buffer_and_this_ranks_shapes():
    error = mismatch_error("gradients", "bucket.x", [(2, 3)] * 10)
    assert isinstance(error, PreconditionError)
    assert str(error).startswith("Mismatched ALLREDUCE tensor shapes: the gradients reduced together as bucket.x")
    assert "[[2, 3], [2, 3], [2, 3], [2, 3], [2, 3], [2, 3], [2, 3], [2, 3], ...] (10 tensors)" in str(error)
