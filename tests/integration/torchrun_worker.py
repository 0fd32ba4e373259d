"""A rank of tests/integration/test_torchrun.py: hvd.init() from torchrun's variables, then a few collectives.

``python torchrun_worker.py torch|numpy``: writes ``$HVD_TEST_RESULT_DIR/rank.<r>.json`` (and prints it)
with torchrun's variables, Horovod's layout, an allreduce, an allgather, a broadcast and (torch) the
parameters after three DistributedOptimizer steps on this rank's shard of a fixed regression problem.
"""

import json
import os
import sys

import numpy as np

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def problem():
    """The regression every test solves: 8 rows, 4 features (shared with the test's numpy reference)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.25).astype(np.float32)
    return x, y


def main(kind: str) -> None:
    if kind == "torch":
        import torch

        import horovod.torch as hvd
    else:
        import horovod.numpy as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {
        "env": {k: os.environ.get(k) for k in TORCHRUN_VARS},
        "layout": [r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
        "key_in_env": bool(os.environ.get("HOROVOD_SECRET_KEY")),
    }
    if kind == "torch":
        x = torch.arange(5, dtype=torch.float64) * (r + 1)
        out["allreduce"] = hvd.allreduce(x, op=hvd.Sum).tolist()
        out["allgather"] = hvd.allgather(torch.full((r + 1,), float(r))).tolist()
        out["broadcast"] = hvd.broadcast(torch.tensor([10.0 * (r + 1)]), root_rank=n - 1).tolist()
        xs, ys = problem()
        model = torch.nn.Linear(4, 1)
        with torch.no_grad():
            model.weight.copy_(torch.full((1, 4), 0.1 * (r + 1)))  # differs per rank: broadcast must fix it
            model.bias.fill_(float(r))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters())
        xb, yb = torch.from_numpy(xs[r::n]), torch.from_numpy(ys[r::n])
        for _ in range(3):
            opt.zero_grad()
            loss = ((model(xb).squeeze(1) - yb) ** 2).mean()
            loss.backward()
            opt.step()
        out["params"] = model.weight.detach().flatten().tolist() + model.bias.detach().tolist()
    else:
        out["allreduce"] = hvd.allreduce(np.arange(5, dtype=np.float64) * (r + 1), op=hvd.Sum).tolist()
        out["allgather"] = hvd.allgather(np.full((r + 1,), float(r))).tolist()
        out["broadcast"] = hvd.broadcast(np.array([10.0 * (r + 1)]), root_rank=n - 1).tolist()
    where = os.environ.get("HVD_TEST_RESULT_DIR")
    if where:  # one file per rank: the ranks' stdout lines may interleave
        with open(os.path.join(where, f"rank.{r}.json"), "w") as f:
            json.dump(out, f)
    print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
