"""One ReduceOp: upstream's public constants, the engine's wire values and the data plane's ops are the same
objects, and Average becomes Sum plus a postscale in one helper (checked against numpy here)."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.base.reduce_ops import ReduceOp, data_plane_op, predivide_scales

# upstream's values (horovod/common/basics.py, from operations.cc's ReduceOp enum)
UPSTREAM = {"Average": 0, "Sum": 1, "Adasum": 2, "Min": 3, "Max": 4, "Product": 5}


@pytest.mark.parametrize("module", ["horovod.common.basics", "horovod.numpy", "horovod.torch",
                                    "horovod.tensorflow"])
def test_public_constants_keep_upstreams_values(module):
    mod = pytest.importorskip(module, exc_type=ImportError)
    for name, value in UPSTREAM.items():
        const = getattr(mod, name)
        assert const == value and isinstance(const, int)
        assert const is ReduceOp[name.upper()]


def test_transport_uses_the_same_definition():
    from horovod.transport import ReduceOp as transport_op
    from horovod.transport.communicator import ReduceOp as communicator_op

    assert transport_op is communicator_op is ReduceOp


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("post", [1.0, 0.5, 3.0])
def test_average_is_sum_then_postscale_over_size(size, post):
    rng = np.random.default_rng(size)
    xs = rng.standard_normal((size, 5))
    op, scale = data_plane_op(ReduceOp.AVERAGE, post, size)
    assert op is ReduceOp.SUM
    np.testing.assert_allclose(xs.sum(axis=0) * scale, xs.mean(axis=0) * post)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT])
def test_other_ops_are_themselves(op):
    assert data_plane_op(int(op), 2.0, 4) == (op, 2.0)


def test_unknown_op_is_an_error():
    with pytest.raises(ValueError):
        data_plane_op(9, 1.0, 2)


def test_predivide_scales():
    xs = np.array([[4.0, 8.0], [2.0, 6.0]])
    pre, post = predivide_scales(ReduceOp.AVERAGE, 4.0)
    op, post = data_plane_op(ReduceOp.AVERAGE, post, 2)
    np.testing.assert_allclose((xs * pre).sum(axis=0) * post, xs.mean(axis=0))
    assert predivide_scales(ReduceOp.SUM, 4.0) == (1.0, 1.0)
