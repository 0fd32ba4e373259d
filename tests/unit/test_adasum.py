"""horovod.base.adasum: the pairwise rule's limits, and results that do not depend on memory alignment (two
partners combine the same two buffers from different addresses and must get bitwise the same result)."""

import numpy as np
import pytest

from horovod.base import adasum


def _at(x: np.ndarray, offset: int) -> np.ndarray:
    """A copy of ``x`` starting ``offset`` elements into a fresh buffer (another alignment)."""
    buf = np.empty(x.size + 16, x.dtype)
    view = buf[offset:offset + x.size]
    view[...] = x
    return view


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_pairwise_rule(dtype):
    v = np.array([1.0, -2.0, 0.5, 4.0], dtype)
    np.testing.assert_allclose(adasum.combine(v, v), v, rtol=1e-3)  # parallel: their average
    e0, e1 = np.eye(2, dtype=dtype)
    np.testing.assert_array_equal(adasum.combine(3 * e0, 2 * e1), np.array([3, 2], dtype))  # orthogonal: sum
    np.testing.assert_array_equal(adasum.combine(v, np.zeros_like(v)), v)  # a zero vector keeps coefficient 1
    a, b = np.array([1.0, 1.0], dtype), np.array([1.0, 0.0], dtype)  # a.b = 1, |a|^2 = 2, |b|^2 = 1
    np.testing.assert_allclose(adasum.combine(a, b), 0.75 * a + 0.5 * b, rtol=1e-3)
    assert adasum.combine(a, b).dtype == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_results_do_not_depend_on_alignment(dtype):
    rng = np.random.default_rng(3)
    a = rng.normal(size=300_007).astype(dtype)
    b = rng.normal(size=300_007).astype(dtype)
    results = {adasum.combine(_at(a, i), _at(b, j)).tobytes() for i, j in [(0, 0), (1, 3), (5, 2), (7, 7), (3, 0)]}
    assert len(results) == 1
    expected = a.astype(np.float64), b.astype(np.float64)
    dot, a2, b2 = expected[0] @ expected[1], expected[0] @ expected[0], expected[1] @ expected[1]
    reference = (1 - dot / (2 * a2)) * expected[0] + (1 - dot / (2 * b2)) * expected[1]
    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(np.frombuffer(results.pop(), dtype), reference, rtol=tol, atol=tol)


def test_tree_order_and_preconditions():
    xs = [np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0]), np.array([-1.0, 0.0])]
    level1 = [adasum.combine(xs[0], xs[1]), adasum.combine(xs[2], xs[3])]  # neighbours first, as upstream
    np.testing.assert_array_equal(adasum.tree(xs, [2]), adasum.combine(*level1))
    np.testing.assert_array_equal(adasum.tree(xs[:3], [2]), adasum.combine(level1[0], xs[2]))  # odd one goes up
    with pytest.raises(ValueError, match="not int32"):
        adasum.check_dtype(np.int32)
