"""Lightning's ``TorchEstimator``: fit a ``LightningModule`` with Horovod on a Spark DataFrame (upstream's
``horovod.spark.lightning.TorchEstimator``, spec 3.5), on current Lightning (``lightning.pytorch``).

The module trains with its own ``configure_optimizers``, ``training_step`` and ``validation_step`` under a
Lightning ``Trainer`` whose strategy is :class:`~horovod.spark.lightning.strategy.HorovodStrategy`; batches are
dicts ``{column: tensor}`` (:mod:`horovod.spark.lightning.remote`).  It returns the same ``TorchModel`` as the
plain torch estimator (``transform`` calls ``module(*features)``), with ``getHistory()`` = the trainer's
``logged_metrics`` (as upstream).  A ``fit`` whose ``run_id`` has a checkpoint in the store resumes from it
(module, optimizers, epoch and step) and trains ``epochs`` more epochs; upstream read it but never applied it.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from horovod.spark.common.backend import Backend
from horovod.spark.common.data import Dataset
from horovod.spark.common.estimator import HorovodEstimator
from horovod.spark.common.params import add_accessors, param
from horovod.spark.lightning import remote
from horovod.spark.torch.estimator import TorchModel, check_input_shapes, worker_spec_fields

__all__ = ["TorchEstimator", "TorchModel", "MIN_PL_VERSION"]

MIN_PL_VERSION = "2.0.0"
"""The oldest Lightning this estimator trains with (upstream's constant, "1.3.8" there for pytorch_lightning 1.x;
its examples skip themselves below it)."""

logger = logging.getLogger("horovod.spark")

_LIGHTNING_PARAMS: dict[str, tuple[Any, str]] = {
    "input_shapes": (None, "shape of each feature column's tensor (default [-1, size])"),
    "num_gpus": (None, "accepted for compatibility: each process uses its local GPU when use_gpu and CUDA"),
    "logger": (None, "Lightning logger (default: TensorBoard, or CSV without tensorboard, in the run's logs)"),
    "log_every_n_steps": (50, "Trainer's log_every_n_steps"),
    "data_module": (None, "accepted for compatibility; the loaders read the store's Parquet with pyarrow"),
    "loader_num_epochs": (None, "accepted for compatibility; the loaders are endless, epochs are counted in steps"),
    "terminate_on_nan": (False, "removed in Lightning 2; accepted and ignored with a warning"),
    "profiler": (None, "Trainer's profiler"),
    "trainer_args": (None, "extra Trainer arguments (they override the estimator's)"),
    "debug_data_loader": (False, "accepted for compatibility"),
    "train_async_data_loader_queue_size": (None, "accepted for compatibility"),
    "val_async_data_loader_queue_size": (None, "accepted for compatibility"),
}


class TorchEstimator(HorovodEstimator):
    """Spark ML Estimator training a ``LightningModule`` with Horovod.

    Parameters (keyword arguments): the common ones (``num_proc`` or ``backend``, ``store``, ``model``,
    ``feature_cols``, ``label_cols``, ``sample_weight_col``, ``validation``, ``batch_size``, ``val_batch_size``,
    ``epochs``, ``callbacks``, ``random_seed``, ``shuffle``, ``run_id``, ``train_steps_per_epoch``,
    ``validation_steps_per_epoch``, ``transformation_fn``, ``verbose`` ...) and ``input_shapes``, ``logger``,
    ``log_every_n_steps``, ``profiler``, ``trainer_args``.  The module's optimizers come from its
    ``configure_optimizers`` (learning rates multiplied by the number of processes); ``optimizer``, ``loss`` and
    ``loss_weights`` are errors, as upstream.

    Example::

        class Regression(lightning.pytorch.LightningModule):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(3, 1)
            def forward(self, features):
                return self.linear(features)
            def training_step(self, batch, batch_idx):
                loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["y"])
                self.log("train_loss", loss, sync_dist=True)
                return loss
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05)

        est = TorchEstimator(num_proc=2, store=Store.create("/shared/tmp"), model=Regression(),
                             feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=10)
        predictions = est.fit(df).transform(df)        # column y__output

    Raises:
        ValueError: not a ``LightningModule``; ``optimizer``, ``loss`` or ``loss_weights`` given; both
            ``num_proc`` and ``backend``; missing columns.
    """

    _run_id_prefix = "pytorch_lightning"

    for _name, (_default, _doc) in _LIGHTNING_PARAMS.items():
        locals()[_name] = param(_name, _doc)
    del _name, _default, _doc

    def _extra_defaults(self) -> dict[str, Any]:
        return {name: spec[0] for name, spec in _LIGHTNING_PARAMS.items()}

    def _check_params(self) -> None:
        from horovod.spark.lightning.compat import FLAVOURS, flavour_of

        super()._check_params()
        if flavour_of(self.getModel()) is None:
            kinds = " or ".join(f"{name}.LightningModule" for name in FLAVOURS)
            raise ValueError(f"model must be a LightningModule ({kinds}), got {type(self.getModel()).__name__}; "
                             f"train a plain torch.nn.Module with horovod.spark.torch.TorchEstimator")
        given = [name for name in ("optimizer", "loss", "loss_weights") if self.getOrDefault(name) is not None]
        if given:
            raise ValueError(f"Parameter(s) {given} must not be given with a LightningModule: it defines its "
                             f"optimizers (configure_optimizers) and loss (training_step) itself")
        if self.getTerminateOnNan():
            logger.warning("horovod.spark.lightning: terminate_on_nan was removed in Lightning 2 and is ignored")

    def _check_metadata_compatibility(self, dataset: Dataset) -> None:
        super()._check_metadata_compatibility(dataset)
        check_input_shapes(self.getFeatureCols(), self.getInputShapes(), dataset.metadata)

    def _fit_on_prepared_data(self, backend: Backend, dataset: Dataset) -> TorchModel:
        run_id = self._resolve_run_id()
        spec = remote.LightningSpec(
            **worker_spec_fields(self, dataset, run_id), callbacks=list(self.getCallbacks() or []),
            logger=self.getLogger(), log_every_n_steps=int(self.getLogEveryNSteps()), profiler=self.getProfiler(),
            trainer_args=dict(self.getTrainerArgs() or {}))
        result = backend.run(remote.train, args=(spec,))[0]
        trained = copy.deepcopy(spec.model)
        trained.load_state_dict(result["model"])
        return TorchModel(history=result["logged_metrics"], model=trained, feature_columns=spec.feature_columns,
                          input_shapes=spec.input_shapes, label_columns=spec.label_columns, optimizer=None,
                          run_id=run_id, _metadata=dataset.metadata, loss=None, loss_constructors=None)


add_accessors(TorchEstimator, {name: None for name in _LIGHTNING_PARAMS})
