"""What every Horovod process of a Lightning ``TorchEstimator.fit`` runs: :func:`train` (shipped by ``SparkBackend``).

Per process: ``hvd.init()``, then a Lightning ``Trainer`` with :class:`~.strategy.HorovodStrategy`
over this rank's shard of the Parquet data.  The loaders are iterables of ``steps`` batches (the same number on
every rank), each batch a dict ``{column: tensor}``: feature columns reshaped to ``input_shapes`` (default
``[-1, size]``) in the module's floating dtype, label and sample-weight columns as stored (scalars ``(batch,)``,
arrays ``(batch, size)``).  After each epoch every rank calls ``trainer.save_checkpoint`` (rank 0 writes) and
rank 0 copies the local run directory (checkpoint, logs, a user ``ModelCheckpoint``'s files) to the run's path in
the store.  A resumed run restores the whole checkpoint (module, optimizers, epoch, step) through
``trainer.fit(ckpt_path=...)`` and trains ``epochs`` more epochs.  Rank 0 returns the trained ``state_dict``
and ``trainer.logged_metrics``.
"""

from __future__ import annotations

import importlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from horovod.spark.torch.remote import WorkerSpec

__all__ = ["LightningSpec", "train"]

logger = logging.getLogger("horovod.spark")


@dataclass(kw_only=True)
class LightningSpec(WorkerSpec):
    """A Lightning estimator's workers: the Trainer's callbacks, logger and arguments."""

    callbacks: list[Any]
    logger: Any
    log_every_n_steps: int
    profiler: Any
    trainer_args: dict[str, Any]


class _Loader:
    """``steps`` batches per iteration from an endless :class:`~horovod.spark.common.reader.ShardReader`."""

    def __init__(self, reader: Any, steps: int, to_tensors: Callable[[dict], dict], restart: bool) -> None:
        self.reader, self.steps, self.to_tensors, self.restart = reader, steps, to_tensors, restart

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        if self.restart:
            self.reader.reset()  # validation: the same rows every epoch
        for batch in self.reader.batches(self.steps):
            yield self.to_tensors(batch)


def _store_checkpoint_callback(pl: Any, path: str, remote_store: Any, rank: int) -> Any:
    class StoreCheckpoint(pl.Callback):
        """After each epoch: the full checkpoint (all ranks call, rank 0 writes), the run directory to the store."""

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            # weights_only=False is Lightning's default, but left unset Lightning logs a notice saying so, on
            # every rank after every epoch
            trainer.save_checkpoint(path, weights_only=False)
            if rank == 0 and remote_store.saving_runs:
                remote_store.sync(os.path.dirname(path))

    return StoreCheckpoint()


def _default_logger(pl: Any, logs_dir: str) -> Any:
    try:
        import tensorboard  # noqa: F401

        return pl.loggers.TensorBoardLogger(logs_dir, name="", version="")
    except ImportError:
        return pl.loggers.CSVLogger(logs_dir, name="", version="")


def train(spec: LightningSpec) -> dict[str, Any] | None:
    """Train on this process's shard (see the module docstring); rank 0 returns ``{model, logged_metrics}``."""
    import torch

    from horovod.spark.common.reader import open_readers, reader_columns
    from horovod.spark.lightning import compat
    from horovod.spark.lightning.strategy import strategy_for
    from horovod.spark.torch import batches as tb
    from horovod.spark.torch.remote import init_worker

    rank, size = init_worker(spec.mp_start_method)
    model = spec.model
    pl = compat.flavour_of(model) or compat.pl  # the Lightning package the model's class comes from
    if spec.seed is not None:
        pl.seed_everything(spec.seed, workers=True, verbose=False)
    dtype = tb.float_dtype(model)
    columns = reader_columns(spec.feature_columns, spec.label_columns, spec.sample_weight_col)
    others = [c for c in columns if c not in spec.feature_columns]

    def to_tensors(batch: dict) -> dict:
        inputs = tb.features(batch, spec.feature_columns, spec.input_shapes, dtype)
        return {**dict(zip(spec.feature_columns, inputs)), **dict(zip(others, tb.labels(batch, others, dtype)))}

    readers = open_readers(spec.dataset, spec.remote_store.filesystem, columns, rank, size,
                           batch_size=spec.batch_size, val_batch_size=spec.val_batch_size, shuffle=spec.shuffle,
                           seed=spec.seed, transformation_fn=spec.transformation_fn, cache=spec.inmemory_cache_all,
                           train_steps=spec.train_steps_per_epoch, val_steps=spec.validation_steps_per_epoch)
    train_loader = _Loader(readers.train, readers.train_steps, to_tensors, restart=False)
    val_loader = _Loader(readers.val, readers.val_steps, to_tensors, restart=True) if readers.val else None

    with spec.remote_store.get_local_output_dir() as local_dir, tempfile.TemporaryDirectory() as scratch:
        callbacks = list(spec.callbacks or [])
        for callback in callbacks:
            if isinstance(callback, pl.callbacks.ModelCheckpoint):
                callback.dirpath = local_dir  # its files reach the store with the run directory
        callbacks.append(_store_checkpoint_callback(
            pl, os.path.join(local_dir, spec.remote_store.checkpoint_filename), spec.remote_store, rank))
        cuda = spec.use_gpu and torch.cuda.is_available()
        trainer_args = dict(
            accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy_for(pl)(use_gpu=spec.use_gpu),
            max_epochs=spec.epochs, callbacks=callbacks, default_root_dir=local_dir, num_sanity_val_steps=0,
            logger=spec.logger if spec.logger is not None else _default_logger(
                pl, os.path.join(local_dir, spec.remote_store.logs_subdir)),
            log_every_n_steps=spec.log_every_n_steps, use_distributed_sampler=False,
            enable_progress_bar=spec.verbose >= 2 and rank == 0, enable_model_summary=spec.verbose >= 2 and rank == 0,
            enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
            profiler=spec.profiler,
            # The ranks are Horovod's: without a cluster environment of its own, Lightning probes for one, and
            # its MPI probe imports mpi4py, i.e. MPI_Init in every worker (a failure or a hang under some
            # schedulers) for an answer HorovodStrategy does not use.
            plugins=[importlib.import_module(f"{pl.__name__}.plugins.environments").LightningEnvironment()])
        resume = None
        if spec.checkpoint is not None:
            resume = os.path.join(scratch, "resume.ckpt")
            with open(resume, "wb") as f:
                f.write(spec.checkpoint)
            done = int(torch.load(resume, map_location="cpu", weights_only=False).get("epoch", -1)) + 1
            trainer_args["max_epochs"] = done + spec.epochs  # `epochs` more, as the other estimators
        trainer_args.update(spec.trainer_args or {})
        trainer = pl.Trainer(**trainer_args)
        trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader, ckpt_path=resume)
        # As upstream: with a user ModelCheckpoint, the module returned is that of its best checkpoint (rank 0
        # wrote it), not the last epoch's
        best = next((c.best_model_path for c in callbacks if isinstance(c, pl.callbacks.ModelCheckpoint)), "")
        if rank == 0 and best and os.path.exists(best):
            model.load_state_dict(torch.load(best, map_location="cpu", weights_only=False)["state_dict"])
    if rank != 0:
        return None
    metrics = {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
               for k, v in trainer.logged_metrics.items()}
    return {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "logged_metrics": metrics,
            "epochs": int(trainer.current_epoch)}
