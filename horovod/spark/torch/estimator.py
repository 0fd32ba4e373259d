"""``TorchEstimator``: fit a plain ``torch.nn.Module`` with Horovod on a Spark DataFrame; ``TorchModel``: its result.

Upstream's API (spec 3.4), without Petastorm: the data is the common layer's Parquet in the store, read by each
worker with pyarrow (:mod:`horovod.spark.common.reader`); the workers run :func:`horovod.spark.torch.remote.train`.
A ``fit`` whose ``run_id`` has a checkpoint in the store resumes from it: model, optimizer state and history, and
trains ``epochs`` more epochs (numbered on from the checkpoint's), as upstream's and the Keras estimator.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.spark.common.backend import Backend
from horovod.spark.common.data import Dataset
from horovod.spark.common.estimator import HorovodEstimator, HorovodModel
from horovod.spark.common.params import add_accessors, param
from horovod.spark.torch import remote

__all__ = ["TorchEstimator", "TorchModel"]

class TorchEstimator(HorovodEstimator):
    """Spark ML Estimator training a torch model with Horovod (upstream's ``horovod.spark.torch.TorchEstimator``).

    Keyword arguments are the parameters (all optional in the signature, as upstream): the common ones
    (``num_proc`` or ``backend``, ``store``, ``model``, ``optimizer``, ``loss``, ``loss_weights``, ``metrics``,
    ``feature_cols``, ``label_cols``, ``sample_weight_col``, ``validation``, ``batch_size``, ``val_batch_size``,
    ``epochs``, ``verbose``, ``random_seed``, ``shuffle``, ``run_id``, ``train_steps_per_epoch``,
    ``validation_steps_per_epoch``, ``transformation_fn``, ``label_shapes``, ``gradient_compression`` ...) and
    the torch ones: ``input_shapes`` (per feature column, default ``[-1, size]``), ``loss_constructors``
    (functions returning a loss, instead of ``loss``), ``train_minibatch_fn`` (``fn(model, optimizer,
    transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs, loss)``, which then also steps the
    optimizer), ``backward_passes_per_step`` (default 1).  ``optimizer`` is a ``torch.optim`` optimizer built on
    ``model.parameters()``; its learning rates are multiplied by the number of processes on the workers.

    Example::

        model = torch.nn.Linear(3, 1)
        est = TorchEstimator(num_proc=2, store=Store.create("/shared/tmp"), model=model,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                             loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["y"],
                             batch_size=32, epochs=10, validation=0.1)
        torch_model = est.fit(df)
        predictions = torch_model.transform(df)          # column y__output

    Raises:
        ValueError: both ``num_proc`` and ``backend``; no model, optimizer or loss; both ``loss`` and
            ``loss_constructors``; ``backward_passes_per_step`` <= 0; missing columns; shape mismatches.
    """

    _run_id_prefix = "pytorch"

    input_shapes = param("input_shapes", "shape of each feature column's tensor (default [-1, size])")
    loss_constructors = param("loss_constructors", "functions returning the loss of each output")
    train_minibatch_fn = param("train_minibatch_fn", "custom training step of one minibatch")
    backward_passes_per_step = param("backward_passes_per_step", "backward passes between optimizer steps")
    data_module = param("data_module", "accepted for compatibility; the readers are pyarrow")

    def _extra_defaults(self) -> dict[str, Any]:
        return {"input_shapes": None, "loss_constructors": None, "train_minibatch_fn": None,
                "backward_passes_per_step": 1, "data_module": None}

    def _check_params(self) -> None:
        super()._check_params()
        if self.getOptimizer() is None:
            raise ValueError("Optimizer parameter is required")
        if self.getLoss() is not None and self.getLossConstructors() is not None:
            raise ValueError("only one of loss_constructors and loss parameters can be specified.")
        if self.getLoss() is None and self.getLossConstructors() is None:
            raise ValueError("Loss parameter is required (or loss_constructors)")
        if int(self.getBackwardPassesPerStep()) <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {self.getBackwardPassesPerStep()}")

    def _loss_fns(self) -> list[Callable[..., Any]]:
        labels = self.getLabelCols()
        if self.getLossConstructors() is not None:
            fns = [make() for make in _as_list(self.getLossConstructors())]
        else:
            fns = _as_list(self.getLoss())
        if len(fns) == 1 and len(labels) > 1:
            fns = fns * len(labels)
        if len(fns) != len(labels):
            raise ValueError(f"{len(fns)} loss functions for {len(labels)} label columns {labels}")
        return fns

    def _loss_weights(self) -> list[float]:
        labels = self.getLabelCols()
        weights = self.getLossWeights()
        if weights is None:
            return [1.0 / len(labels)] * len(labels)
        if len(weights) != len(labels):
            raise ValueError(f"loss_weights {weights} must have one weight per label column {labels}")
        return [float(w) for w in weights]

    def _check_metadata_compatibility(self, dataset: Dataset) -> None:
        super()._check_metadata_compatibility(dataset)
        check_input_shapes(self.getFeatureCols(), self.getInputShapes(), dataset.metadata)
        label_shapes = self.getLabelShapes()
        if label_shapes is not None and len(label_shapes) != len(self.getLabelCols()):
            raise ValueError(f"label_shapes has {len(label_shapes)} shapes for {len(self.getLabelCols())} labels")

    def _fit_on_prepared_data(self, backend: Backend, dataset: Dataset) -> TorchModel:
        run_id = self._resolve_run_id()
        model, optimizer = self.getModel(), self.getOptimizer()
        spec = remote.TrainSpec(
            **worker_spec_fields(self, dataset, run_id), optimizer_cls=type(optimizer),
            optimizer_groups=remote.optimizer_layout(optimizer, model), optimizer_state=optimizer.state_dict(),
            loss_fns=self._loss_fns(), loss_weights=self._loss_weights(), metrics=list(self.getMetrics() or []),
            label_shapes=self.getLabelShapes(), backward_passes_per_step=int(self.getBackwardPassesPerStep()),
            gradient_compression=self.getGradientCompression(), train_minibatch_fn=self.getTrainMinibatchFn())
        result = backend.run(remote.train, args=(spec,))[0]
        trained = copy.deepcopy(model)
        trained.load_state_dict(result["model"])
        trained_optimizer = remote.rebuild_optimizer(type(optimizer), spec.optimizer_groups, trained)
        trained_optimizer.load_state_dict(result["optimizer"])
        return TorchModel(history=result["history"], model=trained, feature_columns=spec.feature_columns,
                          input_shapes=spec.input_shapes, label_columns=spec.label_columns, optimizer=trained_optimizer,
                          run_id=run_id, _metadata=dataset.metadata, loss=self.getLoss(),
                          loss_constructors=self.getLossConstructors())


add_accessors(TorchEstimator, {"input_shapes": None, "loss_constructors": None, "train_minibatch_fn": None,
                               "backward_passes_per_step": None, "data_module": None})


def worker_spec_fields(estimator: HorovodEstimator, dataset: Dataset, run_id: str) -> dict[str, Any]:
    """The :class:`~horovod.spark.torch.remote.WorkerSpec` fields of a torch or Lightning estimator's ``fit``."""
    from horovod.spark.torch.batches import default_input_shapes

    features = list(estimator.getFeatureCols())
    shapes = estimator.getOrDefault("input_shapes") or default_input_shapes(features, dataset.metadata)
    batch_size = int(estimator.getBatchSize())
    return dict(model=estimator.getModel(), feature_columns=features, label_columns=list(estimator.getLabelCols()),
                sample_weight_col=estimator.getSampleWeightCol(), input_shapes=[list(s) for s in shapes],
                remote_store=estimator.getStore().to_remote(run_id, dataset.dataset_idx), dataset=dataset,
                batch_size=batch_size, val_batch_size=int(estimator.getValBatchSize() or batch_size),
                epochs=int(estimator.getEpochs()), train_steps_per_epoch=estimator.getTrainStepsPerEpoch(),
                validation_steps_per_epoch=estimator.getValidationStepsPerEpoch(), shuffle=bool(estimator.getShuffle()),
                seed=estimator.getRandomSeed(), transformation_fn=estimator.getTransformationFn(),
                inmemory_cache_all=bool(estimator.getInMemoryCacheAll()), use_gpu=bool(estimator.getUseGpu()),
                mp_start_method=estimator.getMpStartMethod(), verbose=int(estimator.getVerbose()),
                checkpoint=estimator._read_checkpoint(run_id))


def check_input_shapes(features: Sequence[str], shapes: Sequence[Sequence[int]] | None,
                       metadata: dict[str, dict[str, Any]]) -> None:
    """One shape per feature column, each holding the column's values per row (``-1``: the batch)."""
    if shapes is None:
        return
    if len(shapes) != len(features):
        raise ValueError(f"input_shapes has {len(shapes)} shapes for {len(features)} feature columns {list(features)}")
    for column, shape in zip(features, shapes):
        size = int(np.prod([d for d in shape if d != -1])) if shape else 1
        column_size = int(metadata.get(column, {}).get("shape") or 1)
        if column_size % max(size, 1) != 0:
            raise ValueError(f"Feature column {column!r} holds {column_size} values per row, which do not fit input "
                             f"shape {list(shape)}")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def predict_fn(model: Any, feature_columns: Sequence[str], input_shapes: Sequence[Sequence[int]]
               ) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """The function ``transform`` runs on the executors: a copy of the model in eval mode, on CPU, one thread."""
    net = copy.deepcopy(model).cpu().eval()
    # A plain module was trained on float inputs (integer columns too); a LightningModule on the columns' types.
    integers = not any(name in sys.modules and isinstance(net, sys.modules[name].LightningModule)
                       for name in ("lightning.pytorch", "pytorch_lightning"))

    # An input shape without -1 is a whole tensor's shape (``[[2]]`` with batch_size=1): upstream's transform
    # reshapes one row at a time to it, so such a model is called row by row here too.
    row_by_row = any(-1 not in list(shape) for shape in input_shapes)

    def call(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        from horovod.spark.torch.batches import as_outputs, features, float_dtype

        outputs = as_outputs(net(*features(batch, feature_columns, input_shapes, float_dtype(net),
                                           integers=integers)))
        return [o.detach().cpu().numpy() for o in outputs]

    def predict(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        torch.set_num_threads(1)
        with torch.no_grad():
            if not row_by_row:
                return call(batch)
            rows = len(next(iter(batch.values())))
            per_row = [call({c: v[i:i + 1] for c, v in batch.items()}) for i in range(rows)]
            return [np.stack([r[k].reshape(-1) for r in per_row]) for k in range(len(per_row[0]))]

    return predict


class TorchModel(HorovodModel):
    """The trained torch model as a Spark ML ``Model`` (upstream's ``TorchModel``); ``transform`` predicts."""

    optimizer = param("optimizer", "the optimizer, with its trained state")
    input_shapes = param("input_shapes", "shape of each feature column's tensor")
    loss = param("loss", "the loss")
    loss_constructors = param("loss_constructors", "the loss constructors")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"optimizer": None, "input_shapes": None, "loss": None, "loss_constructors": None,
                            **kwargs})

    def _predict_fn(self) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        from horovod.spark.torch.batches import default_input_shapes

        features = list(self.getFeatureColumns())
        shapes = self.getInputShapes() or default_input_shapes(features, self._get_metadata() or {})
        return predict_fn(self.getModel(), features, shapes)


add_accessors(TorchModel, {"optimizer": None, "input_shapes": None, "loss": None, "loss_constructors": None})
