"""Train a small PyTorch model with Horovod inside Spark tasks: ``horovod.spark.run``.

Runs as written on a laptop (a local Spark with two task slots):

    pip install -e '.[spark,torch]'      # needs a Java runtime (17+) for Spark 4
    python examples/spark/spark_torch.py                       # local[2], 2 Horovod processes
    python examples/spark/spark_torch.py --master local[4] --num-proc 4

On a cluster, submit it with ``spark-submit --master <url> examples/spark/spark_torch.py --master ''``
(an empty ``--master`` keeps the one spark-submit set); every executor needs horovod and torch installed.
"""

from __future__ import annotations

import argparse

import numpy as np


def train(x: np.ndarray, y: np.ndarray, epochs: int, lr: float) -> dict:
    """Runs on every Horovod process: data-parallel SGD on this rank's shard of (x, y)."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    shard = slice(hvd.rank(), None, hvd.size())
    xs, ys = torch.from_numpy(x[shard]), torch.from_numpy(y[shard])
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for epoch in range(epochs):
        for start in range(0, len(xs), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xs[start:start + 32]), ys[start:start + 32])
            loss.backward()
            optimizer.step()
        total = hvd.allreduce(torch.nn.functional.mse_loss(model(xs), ys).detach(), name="loss")
        if hvd.rank() == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}: loss {total.item():.5f}", flush=True)
    return {"rank": hvd.rank(), "loss": float(total),
            "state": {k: v.numpy() for k, v in model.state_dict().items()} if hvd.rank() == 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]", help="Spark master ('' = keep spark-submit's)")
    parser.add_argument("--num-proc", type=int, default=None, help="Horovod processes (default: parallelism)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    import horovod.spark

    builder = SparkSession.builder.appName("horovod-spark-torch")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1024, 4))
        y = np.sin(x @ np.array([[1.0], [-0.5], [0.25], [2.0]])) + 0.05 * rng.normal(size=(1024, 1))
        results = horovod.spark.run(train, args=(x, y, args.epochs, args.lr), num_proc=args.num_proc)
        print(f"{len(results)} ranks finished; final loss {results[0]['loss']:.5f}; rank 0 returned "
              f"{sum(v.size for v in results[0]['state'].values())} trained parameters")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
