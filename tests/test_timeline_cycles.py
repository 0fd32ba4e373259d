"""``HOROVOD_TIMELINE_MARK_CYCLES=1``: every engine round (the engine's equivalent of upstream's cycle) writes
upstream's ``CYCLE_START`` marker, and the timeline still shows each tensor's negotiation and processing."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict

import pytest
from test_engine_paths import _run

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

STEPS = 3


@pytest.mark.parametrize("mark", ["1", "0"])
def test_cycle_markers(tmp_path, mark):
    timeline = tmp_path / "timeline.json"
    body = f"""
        hvd.init()
        n = hvd.size()
        for step in range({STEPS}):
            xs = [np.full(size, float(i + step), np.float32) for i, size in enumerate((16, 1000, 60_000))]
            handles = [hvd.allreduce_async(x, op=hvd.Sum, name=f"t{{i}}") for i, x in enumerate(xs)]
            for i, h in enumerate(handles):
                assert np.array_equal(hvd.synchronize(h), xs[i] * n)
        report(ok=True)
    """
    code, out, reports = _run(tmp_path, 2, body, HOROVOD_TIMELINE=str(timeline),
                              HOROVOD_TIMELINE_MARK_CYCLES=mark)
    assert code == 0 and set(reports) == {0, 1}, out
    records = json.loads(timeline.read_text())  # valid JSON as written
    marks = [r for r in records if r.get("name") == "CYCLE_START"]
    if mark == "0":
        assert marks == []
        return
    assert len(marks) >= STEPS, len(marks)  # at least one round per step
    assert all(m == {"ph": "i", "name": "CYCLE_START", "ts": m["ts"], "s": "g"} for m in marks), marks[:3]
    assert [m["ts"] for m in marks] == sorted(m["ts"] for m in marks)
    pid_name = {r["pid"]: r["args"]["name"] for r in records if r.get("name") == "process_name" and r["pid"]}
    begins = defaultdict(Counter)
    for r in records:
        if r.get("ph") == "B" and r.get("pid") in pid_name:
            begins[pid_name[r["pid"]]][r["name"]] += 1
    for name in ("t0", "t1", "t2"):
        assert begins[name]["NEGOTIATE_ALLREDUCE"] == STEPS and begins[name]["ALLREDUCE"] == STEPS, begins[name]
