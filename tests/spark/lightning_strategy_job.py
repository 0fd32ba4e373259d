"""Run by tests/spark/test_lightning_estimator.py under ``horovodrun -np 2``: a LightningModule trained with
HorovodStrategy, each rank on its own data; rank 0 prints the final weights as JSON.  ``TEST_LIGHTNING`` names
the Lightning package the module and trainer come from (``lightning.pytorch`` or ``pytorch_lightning``),
``TEST_ACCUMULATE`` the trainer's ``accumulate_grad_batches`` (default 1)."""

from __future__ import annotations

import importlib
import json
import os

import torch

import horovod.torch as hvd
from horovod.spark.lightning.strategy import strategy_for

pl = importlib.import_module(os.environ.get("TEST_LIGHTNING", "lightning.pytorch"))

STEPS, BATCH, EPOCHS, LR = 4, 8, 2, 0.05


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's rows (the test builds the same to compute the reference)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(STEPS * BATCH, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def main() -> None:
    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights: rank 0's must be broadcast
    x, y = rank_data(hvd.rank())
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model = Regression()
    trainer = pl.Trainer(strategy=strategy_for(pl)(), accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False,
                         accumulate_grad_batches=int(os.environ.get("TEST_ACCUMULATE", "1")))
    trainer.fit(model, batches)
    weights = hvd.allgather(torch.cat([model.linear.weight.detach().ravel(), model.linear.bias.detach()])[None])
    # What ModelCheckpoint/EarlyStopping ask the strategy (Lightning passes torch.distributed.ReduceOp.SUM)
    from torch.distributed import ReduceOp

    strategy, mine = trainer.strategy, torch.tensor(float(hvd.rank() + 1))
    reductions = {op: float(strategy.reduce(mine, reduce_op=op)) for op in ("mean", "sum", "max", "min")}
    reductions["ReduceOp.SUM"] = float(strategy.reduce(mine, reduce_op=ReduceOp.SUM))
    decisions = [strategy.reduce_boolean_decision(True), strategy.reduce_boolean_decision(hvd.rank() == 0),
                 strategy.reduce_boolean_decision(hvd.rank() == 0, all=False),
                 strategy.reduce_boolean_decision(False, all=False)]
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"weights": weights.tolist(), "loss": float(trainer.logged_metrics["loss"]),
                                      "reductions": reductions, "decisions": decisions}), flush=True)


if __name__ == "__main__":
    main()
