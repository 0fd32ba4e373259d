"""A Kubeflow PyTorchJob-shaped torchrun job across network-namespace hosts (see conftest.py).

Two "pods" (hvdh1, hvdh2) with two ranks each, torchrun's variables set as the training operator and torchrun
set them: the master pod has ``MASTER_ADDR=localhost``, the worker pod the master's address; the key comes
from ``HOROVOD_SECRET_KEY`` (a Secret).  Rank 0's store must then listen on the pod's eth0 too, and the
master pod's ranks must advertise eth0, not loopback, or the other pod cannot reach them.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

pytestmark = pytest.mark.timeout(120)

WORKER = os.path.join(REPO, "tests", "integration", "torchrun_worker.py")
MASTER_IP = "10.213.0.11"  # hvdh1's eth0 (.ci/netns_hosts.sh)


def test_pytorchjob_master_with_localhost(netns_hosts, tmp_path):
    key = secrets.token_hex(32)
    procs = []
    for r in range(4):
        pod = r // 2
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
        env.update(PYTHONPATH=REPO, HOROVOD_SECRET_KEY=key, MASTER_PORT="29700", WORLD_SIZE="4", RANK=str(r),
                   LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(pod), GROUP_WORLD_SIZE="2",
                   MASTER_ADDR="localhost" if pod == 0 else MASTER_IP, HOROVOD_HOSTNAME=f"pod{pod}",
                   HVD_TEST_RESULT_DIR=str(tmp_path))
        procs.append(subprocess.Popen(["ip", "netns", "exec", netns_hosts.hosts[pod], sys.executable, WORKER,
                                       "numpy"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)
    results = sorted((json.load(open(tmp_path / f)) for f in os.listdir(tmp_path)), key=lambda d: d["layout"][0])
    assert [d["layout"] for d in results] == [[r, 4, r % 2, 2, r // 2, 2] for r in range(4)]
    want = (np.arange(5) * 10).tolist()
    assert all(d["allreduce"] == want for d in results)
    assert all(d["broadcast"] == [40.0] for d in results)
