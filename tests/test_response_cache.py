"""The response cache when responses outnumber its capacity, under the launcher.

Found by the soak (tests/soak, seed 21 with ``HOROVOD_CACHE_CAPACITY=4``): a grouped allreduce of more tensors
than the cache holds gets cache ids that the coordinator evicts in the very frame that carries them.  A rank
applied the eviction notice before running the response, then recorded the id anyway, and the next time the
name came round it sent a hit for an id the coordinator had already forgotten: "protocol error: rank 0 sent
an unknown cache id", and the job shut down.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from launch_util import clean_env, launch, marked_processes

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

SCRIPT = """
    import numpy as np
    import horovod.numpy as hvd

    hvd.init()
    n = hvd.size()
    for i in range(4):
        xs = [np.full(k + 1, float(hvd.rank() + i)) for k in range(5)]  # more tensors than the cache holds
        for k, out in enumerate(hvd.grouped_allreduce(xs, op=hvd.Sum, name="group")):
            assert out.tolist() == [float(n * (n - 1) // 2 + n * i)] * (k + 1), (i, k, out)
        for j in range(3):  # other traffic: every rank acknowledges the eviction notices meanwhile
            assert hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"other.{i}.{j}").tolist() == [float(n)] * 2
        out = hvd.allreduce(np.arange(3.0), op=hvd.Sum, name="single")
        assert out.tolist() == [0.0, n * 1.0, n * 2.0]
    print("done", hvd.rank())
"""


@pytest.mark.parametrize("capacity", [1, 2, 4])
@pytest.mark.parametrize("np_", [2, 3])
def test_group_larger_than_the_cache(tmp_path, np_, capacity):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    code, out, marker = launch(np_, [sys.executable, str(script)],
                               env=clean_env(HOROVOD_CACHE_CAPACITY=str(capacity)), timeout=60)
    assert code == 0, out
    assert out.count("done") == np_, out
    assert "unknown cache" not in out, out
    assert not marked_processes(marker)
