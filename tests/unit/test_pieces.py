"""``Pieces``: several arrays read as their concatenation (the allreduce input of TensorFlow's flat path)."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.transport import buffers
from horovod.transport.buffers import Pieces


def _parts(sizes, dtype=np.float32):
    rng = np.random.default_rng(len(sizes))
    return [rng.standard_normal(n).astype(dtype) for n in sizes]


@pytest.mark.parametrize("merge_below", [buffers.MERGE_BELOW, 2])
def test_segments_cover_every_range(monkeypatch, merge_below):
    monkeypatch.setattr(buffers, "MERGE_BELOW", merge_below)
    parts = _parts([3, 40_000, 5, 0, 7, 20_000, 1, 2])  # 160 KB and 80 KB parts, tiny ones between
    pieces = Pieces(parts)
    whole = np.concatenate(parts)
    assert (pieces.size, pieces.nbytes, pieces.shape, pieces.dtype) == (whole.size, whole.nbytes, whole.shape,
                                                                        whole.dtype)
    np.testing.assert_array_equal(np.asarray(pieces), whole)
    np.testing.assert_array_equal(pieces.concatenate(np.empty(whole.size, np.float32)), whole)
    rng = np.random.default_rng(0)
    for _ in range(500):
        lo = int(rng.integers(0, whole.size))
        hi = int(rng.integers(lo, whole.size + 1))
        got = np.full(hi - lo, np.nan, np.float32)
        for off, view in pieces.segments(lo, hi):
            got[off:off + view.size] = view
        np.testing.assert_array_equal(got, whole[lo:hi])


def test_small_parts_are_merged_large_ones_kept_as_views():
    parts = _parts([10, 20, 30_000, 4, 5])  # 30_000 float32 = 120 KB: at least MERGE_BELOW
    pieces = Pieces(parts)
    assert [p.size for p in pieces.parts] == [30, 30_000, 9]
    assert np.shares_memory(pieces.parts[1], parts[2])  # no copy of a large part
    assert len(pieces.segments(0, pieces.size)) == 3


def test_shapes_and_errors():
    pieces = Pieces([np.ones((2, 3), np.float32), np.zeros((4,), np.float32)])  # flattened
    assert pieces.reshape(-1) is pieces and pieces.size == 10
    with pytest.raises(ValueError, match="1-D"):
        pieces.reshape(2, 5)
    with pytest.raises(ValueError, match="one dtype"):
        Pieces([np.ones(3, np.float32), np.ones(3, np.float64)])


def test_output_pieces_keep_every_part_and_scatter_into_them():
    """As an output (merge=False) even tiny parts stay the caller's own arrays: results are written into them."""
    parts = [np.zeros(n, np.float32) for n in (3, 1, 40_000, 0, 2)]
    pieces = Pieces(parts, merge=False)
    assert [p.size for p in pieces.parts] == [3, 1, 40_000, 2]
    assert all(np.shares_memory(p, q) for p, q in zip(pieces.parts, [parts[0], parts[1], parts[2], parts[4]]))
    src = np.arange(pieces.size, dtype=np.float32)
    pieces.scatter(src)
    np.testing.assert_array_equal(np.concatenate(parts), src)
    for off, view in pieces.segments(2, 10):  # a write through segments lands in the caller's arrays too
        view[:] = -1 - (off + np.arange(view.size))
    np.testing.assert_array_equal(np.concatenate(parts)[2:10], -1 - np.arange(8, dtype=np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        Pieces([np.zeros((4, 4), np.float32)[:, 1]], merge=False)


@pytest.mark.parametrize("simd", [True, False], ids=["ufunc-loop", "memcpy"])
def test_copy_into_either_loop(monkeypatch, simd):
    """``copy_into`` copies exactly, whichever loop the machine's measurement picked (odd byte counts too)."""
    monkeypatch.setattr(buffers, "_simd_copy", simd)
    rng = np.random.default_rng(1)
    for nbytes in (1, 63, 64, 65, 4096 + 3, 100_000, buffers.MEMCPY_MIN - 1, buffers.MEMCPY_MIN + 5):
        src = rng.integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes + 8, np.uint8)
        buffers.copy_into(dst[3:3 + nbytes], src)  # a destination that is not 8-byte aligned
        np.testing.assert_array_equal(dst[3:3 + nbytes], src)
        assert not dst[:3].any() and not dst[3 + nbytes:].any()
    for nbytes in (4096 + 4, 100_000):  # strided on either side (as the shm communicator may get)
        wide = rng.standard_normal(nbytes // 2).astype(np.float32)
        dst = np.zeros(nbytes // 4, np.float32)
        buffers.copy_into(dst, wide[::2])
        np.testing.assert_array_equal(dst, wide[::2])
        back = np.zeros(nbytes // 2, np.float32)
        buffers.copy_into(back[1::2], dst)
        np.testing.assert_array_equal(back[1::2], dst)
        assert not back[::2].any()
    assert isinstance(buffers.simd_copy_faster(), bool)
