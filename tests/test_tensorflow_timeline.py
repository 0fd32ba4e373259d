"""horovod.tensorflow's flat allreduce keeps the timeline's row per tensor (issue 11, item 5).

Inside ``tf.function`` a grouped allreduce travels as one engine tensor; the timeline must still show every
member's row (``<name>_<i>of<n>``, as the general grouped path names them) with its negotiation (each rank's
tick) and its processing, every step, and no row of the group itself.  The sums are checked against numpy.
"""

from __future__ import annotations

import os

import pytest
from test_engine_paths import _run, assert_allreduce_row, timeline_rows

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

STEPS = 3
SHAPES = [(3,), (200, 100), (5, 5)]  # the middle one (80 KB) gets a TensorFlow-owned buffer of its own
BODY = f"""
    import tensorflow as tf
    import horovod.tensorflow as hvt
    hvt.init()
    shapes = {SHAPES!r}

    @tf.function
    def step(*xs):
        return hvt.grouped_allreduce(list(xs), op=hvt.Sum, name="grads")
    worst = 0.0
    for s in range({STEPS}):
        xs = [[np.random.default_rng(100 * s + 10 * r + i).standard_normal(shape).astype(np.float32)
               for i, shape in enumerate(shapes)] for r in range(2)]
        outs = step(*[tf.constant(x) for x in xs[hvt.rank()]])
        for i, out in enumerate(outs):
            worst = max(worst, float(np.abs(out.numpy() - (xs[0][i] + xs[1][i])).max()))
    report(worst=worst)
    hvt.shutdown()
"""


def test_flat_allreduce_keeps_a_timeline_row_per_tensor(tmp_path):
    timeline = tmp_path / "timeline.json"
    code, out, reports = _run(tmp_path, 2, BODY, timeout=180.0, HOROVOD_TIMELINE=str(timeline))
    assert code == 0 and set(reports) == {0, 1}, out
    for rank in (0, 1):
        assert reports[rank]["worst"] < 1e-5, reports[rank]
    events = timeline_rows(timeline)
    assert "grads" not in events, sorted(events)
    for i in range(len(SHAPES)):
        assert_allreduce_row(events, f"grads_{i + 1}of{len(SHAPES)}", STEPS)
