"""Pre/post-scaling dtype rules (HOROVOD_SPEC §1.3), compared with numpy computed independently."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.transport.scaling import scale_inplace, scaled_copy

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # optional dependency
    BF16 = None

INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64]


def _ints(dtype, n=257, seed=0):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(seed)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return rng.integers(lo, hi + 1, n).astype(dtype)


def _reference_int(x, factor):
    # float64 product, then truncation toward zero (np.trunc, not floor)
    return np.trunc(x.astype(np.float64) * np.float64(factor)).astype(x.dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 1 / 7, 0.1, 2.5])
def test_integer_scaling_truncates_toward_zero(dtype, factor):
    x = _ints(dtype)
    expected = _reference_int(x, factor)
    if np.iinfo(dtype).max * factor > np.iinfo(dtype).max:  # only compare values that stay in range
        keep = np.abs(x.astype(np.float64) * factor) <= np.iinfo(dtype).max
        keep &= x.astype(np.float64) * factor >= np.iinfo(dtype).min
    else:
        keep = np.ones(x.shape, bool)
    buf = x.copy()
    scale_inplace(buf, factor)
    assert buf.dtype == x.dtype
    np.testing.assert_array_equal(buf[keep], expected[keep])
    out = np.empty_like(x)
    scaled_copy(x, factor, out)
    np.testing.assert_array_equal(out[keep], expected[keep])


def test_negative_integer_average_truncates_not_floors():
    buf = np.array([-7, 7, -5, 5, -1, 1, -3, 3, 0], np.int32)
    scale_inplace(buf, 1 / 3)
    np.testing.assert_array_equal(buf, [-2, 2, -1, 1, 0, 0, -1, 1, 0])
    buf = np.array([-7, 7, -5, 5, -1, 1], np.int64)
    scale_inplace(buf, 0.5)
    np.testing.assert_array_equal(buf, [-3, 3, -2, 2, 0, 0])


def test_int64_is_scaled_in_float64():
    big = np.array([2**40 + 1, -(2**40) - 3], np.int64)
    buf = big.copy()
    scale_inplace(buf, 0.5)
    np.testing.assert_array_equal(buf, np.trunc(big.astype(np.float64) * 0.5).astype(np.int64))


def _fp16_reference(x, factor):
    return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)


@pytest.mark.parametrize("factor", [1 / 3, 0.1, 1 / 7, 3.3])
def test_float16_scaled_in_float32(factor):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(4096) * 100).astype(np.float16)
    expected = _fp16_reference(x, factor)
    buf = x.copy()
    scale_inplace(buf, factor)
    assert buf.dtype == np.float16
    np.testing.assert_array_equal(buf, expected)
    out = np.empty_like(x)
    scaled_copy(x, factor, out)
    np.testing.assert_array_equal(out, expected)


def test_float16_reference_really_differs_from_half_precision_arithmetic():
    # Guard for the test above: computing in float16 would give different bits for some elements.
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(4096) * 100).astype(np.float16)
    in_half = x * np.float16(1 / 3)
    assert in_half.dtype == np.float16
    assert (in_half != _fp16_reference(x, 1 / 3)).any()


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes not installed")
@pytest.mark.parametrize("factor", [1 / 3, 0.1])
def test_bfloat16_scaled_in_float32(factor):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(1024) * 10).astype(BF16)
    expected = (x.astype(np.float32) * np.float32(factor)).astype(BF16)
    buf = x.copy()
    scale_inplace(buf, factor)
    assert buf.dtype == BF16
    np.testing.assert_array_equal(buf.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_scaled_in_own_precision(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(dtype)
    buf = x.copy()
    scale_inplace(buf, 1 / 3)
    assert buf.dtype == dtype
    np.testing.assert_array_equal(buf, x * dtype(1 / 3))


def test_factor_one_is_a_no_op_and_bool_is_untouched():
    x = np.array([1.5, -2.0], np.float32)
    scale_inplace(x, 1.0)
    np.testing.assert_array_equal(x, [1.5, -2.0])
    b = np.array([True, False, True])
    scale_inplace(b, 0.5)
    np.testing.assert_array_equal(b, [True, False, True])
    out = np.zeros(3, bool)
    scaled_copy(b, 0.5, out)
    np.testing.assert_array_equal(out, b)
    empty = np.zeros(0, np.int32)
    scale_inplace(empty, 0.5)


def test_scaled_copy_with_factor_one_copies():
    x = np.arange(5, dtype=np.int16)
    out = np.zeros_like(x)
    scaled_copy(x, 1.0, out)
    np.testing.assert_array_equal(out, x)
