"""Fit a PyTorch model on a Spark DataFrame with ``horovod.spark.torch.TorchEstimator`` (or, with ``--lightning``, a
LightningModule with ``horovod.spark.lightning.TorchEstimator``), then predict with the returned Spark ML model.

Runs as written on a laptop (a local Spark with two task slots, two Horovod processes):

    pip install -e '.[spark,torch]'          # + '.[lightning]' for --lightning; needs a Java runtime (17+)
    python examples/spark/pytorch_spark_estimator.py
    python examples/spark/pytorch_spark_estimator.py --lightning

The task has a known answer: ``y = x @ [0.5, -1.0, 2.0] - 0.4``; the script prints the learned weights.  On a
cluster, pass ``--master ''`` under spark-submit and ``--store`` a path every executor sees (NFS, hdfs://...).
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch

WEIGHTS, BIAS = np.array([0.5, -1.0, 2.0]), -0.4


def lightning_module(lr: float):
    """A LightningModule for the same regression: batches are dicts of column tensors."""
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.linear(features)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch: dict, batch_idx: int) -> None:
            loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Regression()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]", help="Spark master ('' = keep spark-submit's)")
    parser.add_argument("--num-proc", type=int, default=2, help="Horovod processes")
    parser.add_argument("--store", default=None, help="store prefix (default: a temporary directory)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lightning", action="store_true", help="train a LightningModule instead")
    args = parser.parse_args()

    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession

    from horovod.spark.common.store import Store

    builder = SparkSession.builder.appName("horovod-pytorch-estimator").config("spark.ui.showConsoleProgress", "false")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1000, 3))
        y = x @ WEIGHTS + BIAS
        df = spark.createDataFrame([(Vectors.dense(r.tolist()), float(t)) for r, t in zip(x, y)], ["features", "y"])
        store = Store.create(args.store or tempfile.mkdtemp(prefix="horovod_store_"))
        common = dict(num_proc=args.num_proc, store=store, feature_cols=["features"], label_cols=["y"],
                      validation=0.1, batch_size=32, epochs=args.epochs, verbose=1)
        if args.lightning:
            from horovod.spark.lightning import TorchEstimator

            estimator = TorchEstimator(model=lightning_module(args.lr), **common)
        else:
            from horovod.spark.torch import TorchEstimator

            model = torch.nn.Linear(3, 1)
            estimator = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr),
                                       loss=torch.nn.functional.mse_loss, **common)
        torch_model = estimator.fit(df)
        trained = torch_model.getModel()
        learned = trained.linear.weight if args.lightning else trained.weight
        bias = trained.linear.bias if args.lightning else trained.bias
        print(f"run {torch_model.getRunId()}: learned weights {np.round(learned.detach().numpy().ravel(), 3)}, "
              f"bias {bias.item():.3f} (answer {WEIGHTS}, {BIAS})")
        predictions = torch_model.transform(df)
        error = max(abs(r["y"] - r["y__output"]) for r in predictions.select("y", "y__output").collect())
        print(f"largest prediction error over {df.count()} rows: {error:.4f}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
