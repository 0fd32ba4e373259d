"""horovod.torch's gradient buckets keep the timeline's row per gradient (issue 11, item 5).

Small gradients are reduced as one bucket tensor; the timeline must still show every parameter's
``allreduce.<name>`` row with its negotiation (each rank's tick) and its processing, every step, and no row of
the bucket itself.  The averaged gradients are checked against the mean of both ranks' local gradients.
"""

from __future__ import annotations

import os

import pytest
from test_engine_paths import _run, assert_allreduce_row, timeline_rows

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

STEPS = 3
BODY = f"""
    import copy
    import time
    import torch
    import horovod.torch as hvt
    hvt.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)]
    layers.append(torch.nn.Linear(16, 5000))  # 320 KB of weight: reduced alone, not bucketed
    model = torch.nn.Sequential(*layers)
    ref = copy.deepcopy(model)  # no hooks: each rank's local gradients, to check the average (lr=0)
    if hvt.rank() == 0:  # rank 1's first bucket reaches the coordinator before rank 0 has built (named) it
        time.sleep(1.0)
    opt = hvt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    worst = 0.0
    for step in range({STEPS}):
        batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(2)]
        local = []
        for x in batches:
            ref.zero_grad()
            ref(x).square().mean().backward()
            local.append([p.grad.clone() for p in ref.parameters()])
        opt.zero_grad()
        model(batches[hvt.rank()]).square().mean().backward()
        opt.step()
        for p, a, b in zip(model.parameters(), *local):
            worst = max(worst, float((p.grad - (a + b) / 2).abs().max()))
    names = [n for n, _ in model.named_parameters()]
    report(worst=worst, names=names)
    hvt.shutdown()  # writes the timeline out
"""


def test_bucketed_gradients_keep_their_timeline_rows(tmp_path):
    timeline = tmp_path / "timeline.json"
    code, out, reports = _run(tmp_path, 2, BODY, HOROVOD_TIMELINE=str(timeline))
    assert code == 0 and set(reports) == {0, 1}, out
    for rank in (0, 1):
        assert reports[rank]["worst"] < 1e-6, reports[rank]
    events = timeline_rows(timeline)
    # a bucket has no row of its own; its one-time check that every rank's bucket holds the same shapes has
    layout_checks = [row for row in events if "bucket" in row]
    assert layout_checks and all(row.endswith(".layout") for row in layout_checks), sorted(events)
    for row in layout_checks:
        assert_allreduce_row(events, row, 1)
    for name in reports[0]["names"]:
        assert_allreduce_row(events, f"allreduce.{name}", STEPS)
