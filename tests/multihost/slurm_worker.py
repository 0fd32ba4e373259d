"""Training worker of tests/multihost/test_slurm.py: ``srun -n 2 --mpi=pmix python slurm_worker.py <mode>``.

Prints one ``RESULT <json>`` line per rank: the layout Horovod reports, the launcher's variables, and the
numbers the test recomputes with numpy.

* ``numpy``: ``allreduce`` (sum and average), ``allgather`` and ``broadcast`` of rank-dependent arrays.
* ``torch``: three SGD steps of ``hvd.DistributedOptimizer`` on a linear model, every rank with its own
  data (:func:`data`), weights broadcast from rank 0 first.

``--rank0-exits``: task 0 exits at once, without ``hvd.init()``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

STEPS = 3
LR = 0.1


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s batch (4 samples, 3 features) and targets; the test uses the same."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 + rank
    y = np.arange(4, dtype=np.float32).reshape(4, 1) - rank
    return x, y


def initial_weights(rank: int) -> np.ndarray:
    """Different on every rank, so that the test sees the broadcast of rank 0's."""
    return np.array([[0.1, -0.2, 0.3]], dtype=np.float32) + rank


def main(mode: str) -> None:
    if mode == "torch":
        import torch

        import horovod.torch as hvd
    else:
        import horovod.numpy as hvd
    hvd.init()
    rank = hvd.rank()
    out: dict = {"rank": rank, "size": hvd.size(), "local_rank": hvd.local_rank(),
                 "local_size": hvd.local_size(), "cross_size": hvd.cross_size(), "mpi": hvd.mpi_enabled(),
                 "slurm_procid": os.environ.get("SLURM_PROCID"), "slurm_job": os.environ.get("SLURM_JOB_ID"),
                 "slurm_node": os.environ.get("SLURMD_NODENAME"), "netns": os.readlink("/proc/self/ns/net")}
    if mode == "numpy":
        mine = np.arange(5, dtype=np.float64) * (rank + 1)
        out["sum"] = hvd.allreduce(mine, op=hvd.Sum, name="sum").tolist()
        out["avg"] = hvd.allreduce(mine, op=hvd.Average, name="avg").tolist()
        out["gather"] = hvd.allgather(np.full((rank + 1, 2), rank, np.int64), name="gather").tolist()
        out["bcast"] = hvd.broadcast(np.array([rank + 10.0]), root_rank=hvd.size() - 1, name="bcast").tolist()
    else:
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(initial_weights(rank)))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        x, y = (torch.from_numpy(a) for a in data(rank))
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        out["weights"] = model.weight.detach().numpy().tolist()
    hvd.shutdown()
    # One write: ranks sharing a stdout (torchrun's) would interleave print()'s pieces.
    os.write(1, ("RESULT " + json.dumps(out) + "\n").encode())


if __name__ == "__main__":
    if "--rank0-exits" in sys.argv and os.environ.get("SLURM_PROCID") == "0":
        sys.exit(0)  # a task 0 that never calls hvd.init()
    main(sys.argv[1])
