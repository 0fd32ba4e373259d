"""What every Horovod process of a ``TorchEstimator.fit`` runs: :func:`train` (shipped by ``SparkBackend``).

Per process: ``hvd.init()``, seed, the model and optimizer rebuilt from the driver's copies (the optimizer's
learning rates multiplied by ``hvd.size()``, as upstream), or restored from the run's checkpoint; rank 0's state
broadcast; ``hvd.DistributedOptimizer`` with ``backward_passes_per_step``.  Each epoch runs the same number of
steps on every rank (:func:`horovod.spark.common.reader.steps_per_epoch`) over the rank's own rows, then the
validation rows; losses and metrics are averaged over the ranks.  After each epoch rank 0 saves
``{"model", "optimizer" (learning rates divided back), "epoch", "history"}`` with ``torch.save`` and copies it
(and the logs) to ``runs/<run_id>/`` in the store.  Rank 0 returns the history and the final states.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerSpec", "TrainSpec", "train", "init_worker", "rebuild_optimizer", "optimizer_layout"]

logger = logging.getLogger("horovod.spark")


@dataclass(kw_only=True)
class WorkerSpec:
    """What the workers of the torch and Lightning estimators both need, pickled once by the driver."""

    model: Any
    feature_columns: list[str]
    label_columns: list[str]
    sample_weight_col: str | None
    input_shapes: list[list[int]]
    remote_store: Any
    dataset: Any
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    shuffle: bool
    seed: int | None
    transformation_fn: Callable[[Any], Any] | None
    inmemory_cache_all: bool
    use_gpu: bool
    mp_start_method: str | None
    verbose: int
    checkpoint: bytes | None = None


@dataclass(kw_only=True)
class TrainSpec(WorkerSpec):
    """A plain torch estimator's workers: the optimizer to rebuild, losses, metrics, the training step."""

    optimizer_cls: type
    optimizer_groups: list[dict[str, Any]]      # hyper-parameters and parameter indices per group
    optimizer_state: dict[str, Any]
    loss_fns: list[Callable[..., Any]]
    loss_weights: list[float]
    metrics: list[Any]
    label_shapes: list[list[int]] | None
    backward_passes_per_step: int
    gradient_compression: Any
    train_minibatch_fn: Callable[..., Any] | None


def optimizer_layout(optimizer: Any, model: Any) -> list[dict[str, Any]]:
    """The optimizer's groups as (hyper-parameters, indices into ``model.parameters()``), to rebuild it there."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in index]
        if unknown:
            raise ValueError("The optimizer holds parameters that are not the model's; build it from "
                             "model.parameters()")
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": [index[id(p)] for p in group["params"]]})
    return groups


def rebuild_optimizer(cls: type, groups: list[dict[str, Any]], model: Any) -> Any:
    """The optimizer of :func:`optimizer_layout`, on ``model``'s parameters."""
    params = list(model.parameters())
    return cls([{**g["hyper"], "params": [params[i] for i in g["params"]]} for g in groups])


def _scale_lr(optimizer: Any, factor: float) -> None:
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = group["lr"] * factor


def _metric_names(metrics: Sequence[Any], label_columns: Sequence[str]) -> list[tuple[str, Callable, int]]:
    """(name, function, output index) per metric: a group is one function for every output or one per label."""
    named = []
    for g, group in enumerate(metrics):
        fns = list(group) if isinstance(group, (list, tuple)) else [group] * len(label_columns)
        for i, (fn, label) in enumerate(zip(fns, label_columns)):
            named.append((f"group_{g}_{label}", fn, i))
    return named


def _device(spec: TrainSpec, hvd: Any) -> Any:
    import torch

    cuda = spec.use_gpu and torch.cuda.is_available()
    kinds = hvd.allgather_object("cuda" if cuda else "cpu", name="horovod.spark.device")
    if len(set(kinds)) != 1:
        raise RuntimeError("All ranks don't have same device type!")
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
        return torch.device("cuda", hvd.local_rank())
    return None


def init_worker(mp_start_method: str | None) -> tuple[int, int]:
    """A training process's start: the multiprocessing start method first (as upstream), ``hvd.init()``; its
    rank and the job's size."""
    import multiprocessing

    import horovod.torch as hvd

    if mp_start_method:
        multiprocessing.set_start_method(mp_start_method, force=True)
    hvd.init()
    return hvd.rank(), hvd.size()


def train(spec: TrainSpec) -> dict[str, Any] | None:
    """Train on this process's shard (see the module docstring); rank 0 returns ``{history, model, optimizer}``."""
    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.spark.common.reader import ShardReader, open_readers, reader_columns
    from horovod.spark.torch import batches as tb

    rank, size = init_worker(spec.mp_start_method)
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
        np.random.seed(spec.seed)
    device = _device(spec, hvd)
    model = spec.model
    if device is not None:
        model = model.to(device)
    optimizer = rebuild_optimizer(spec.optimizer_cls, spec.optimizer_groups, model)
    optimizer.load_state_dict(spec.optimizer_state)
    history: list[dict[str, Any]] = []
    start_epoch = 0
    if spec.checkpoint is not None:
        state = torch.load(io.BytesIO(spec.checkpoint), map_location=device or "cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        history = list(state.get("history") or [])
        start_epoch = int(state.get("epoch", -1)) + 1
    _scale_lr(optimizer, size)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = spec.gradient_compression or hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=spec.backward_passes_per_step)
    dtype = tb.float_dtype(model)
    readers = open_readers(spec.dataset, spec.remote_store.filesystem,
                           reader_columns(spec.feature_columns, spec.label_columns, spec.sample_weight_col), rank, size,
                           batch_size=spec.batch_size, val_batch_size=spec.val_batch_size, shuffle=spec.shuffle,
                           seed=spec.seed, transformation_fn=spec.transformation_fn, cache=spec.inmemory_cache_all,
                           train_steps=spec.train_steps_per_epoch, val_steps=spec.validation_steps_per_epoch,
                           val_ceil=True)
    metric_fns = _metric_names(spec.metrics, spec.label_columns)
    bpps = spec.backward_passes_per_step

    def prepare(batch: dict[str, np.ndarray]) -> tuple[list, list, Any]:
        inputs = tb.features(batch, spec.feature_columns, spec.input_shapes, dtype, device, integers=True)
        targets = tb.labels(batch, spec.label_columns, dtype, device)
        weights = (tb.labels(batch, [spec.sample_weight_col], dtype, device)[0] if spec.sample_weight_col
                   else None)
        return inputs, targets, weights

    def transform_outputs(outputs: Any, targets: list) -> tuple[list, list]:
        outputs = tb.as_outputs(outputs)
        return outputs, tb.match_labels(outputs, targets, spec.label_shapes)

    def loss_fn(outputs: list, targets: list, weights: Any) -> Any:
        return tb.weighted_loss(outputs, targets, spec.loss_fns, spec.loss_weights, weights)

    def default_minibatch(model: Any, optimizer: Any, transform_outputs: Callable, loss_fn: Callable,
                          inputs: list, targets: list, weights: Any) -> tuple[list, Any]:
        outputs, targets = transform_outputs(model(*inputs), targets)
        loss = loss_fn(outputs, targets, weights)
        (loss / bpps).backward()
        return outputs, loss

    def run_epoch(reader: ShardReader, steps: int, training: bool) -> dict[str, Any]:
        sums = {"loss": 0.0, **{name: 0.0 for name, _, _ in metric_fns}}
        model.train(training)
        if training:
            optimizer.zero_grad()
        for step, batch in enumerate(reader.batches(steps)):
            inputs, targets, weights = prepare(batch)
            if training and spec.train_minibatch_fn is not None:
                outputs, loss = spec.train_minibatch_fn(model, optimizer, transform_outputs, loss_fn, inputs,
                                                        targets, weights)
            elif training:
                outputs, loss = default_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, targets,
                                                  weights)
                if (step + 1) % bpps == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            if training:
                if metric_fns:  # the metrics compare the labels shaped as the loss saw them
                    outputs, targets = transform_outputs(outputs, targets)
            else:
                with torch.no_grad():
                    outputs, targets = transform_outputs(model(*inputs), targets)
                    loss = loss_fn(outputs, targets, weights)
            sums["loss"] += float(loss.detach())
            with torch.no_grad():
                for name, fn, i in metric_fns:
                    sums[name] += float(torch.as_tensor(fn(outputs[i].detach(), targets[i])).float().mean())
        local = torch.tensor([sums[k] / steps for k in sums], dtype=torch.float64)
        averaged = hvd.allreduce(local, name=f"horovod.spark.metrics.{'train' if training else 'val'}",
                                 op=hvd.Average).tolist()
        values = dict(zip(sums, averaged))
        return {"loss": values.pop("loss"), "all_metrics": values}

    with spec.remote_store.get_local_output_dir() as local_dir:
        writer = _summary_writer(os.path.join(local_dir, spec.remote_store.logs_subdir)) if rank == 0 else None
        for epoch in range(start_epoch, start_epoch + spec.epochs):
            record: dict[str, Any] = {"epoch": epoch, "train": run_epoch(readers.train, readers.train_steps, True)}
            if readers.val is not None:
                readers.val.reset()
                record["validation"] = run_epoch(readers.val, readers.val_steps, False)
            history.append(record)
            if rank == 0:
                if spec.verbose:
                    print(f"epoch {epoch}: {json.dumps({k: v for k, v in record.items() if k != 'epoch'})}",
                          flush=True)
                _log(writer, os.path.join(local_dir, spec.remote_store.logs_subdir), history)
                if spec.remote_store.saving_runs:
                    _scale_lr(optimizer, 1.0 / size)
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                                "history": history},
                               os.path.join(local_dir, spec.remote_store.checkpoint_filename))
                    _scale_lr(optimizer, size)
                    spec.remote_store.sync(local_dir)
        if writer is not None:
            writer.close()
    if rank != 0:
        return None
    _scale_lr(optimizer, 1.0 / size)
    return {"history": history, "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict()}


def _summary_writer(path: str) -> Any:
    """A TensorBoard writer when tensorboard is installed (else the logs hold only ``history.json``)."""
    os.makedirs(path, exist_ok=True)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(path)


def _log(writer: Any, logs_dir: str, history: list[dict[str, Any]]) -> None:
    """The history so far as ``logs/history.json``, and the last epoch's values to TensorBoard."""
    with open(os.path.join(logs_dir, "history.json"), "w") as f:
        json.dump(history, f)
    if writer is None:
        return
    record = history[-1]
    for stage in ("train", "validation"):
        if stage in record:
            writer.add_scalar(f"{stage}/loss", record[stage]["loss"], record["epoch"])
            for name, value in record[stage]["all_metrics"].items():
                writer.add_scalar(f"{stage}/{name}", value, record["epoch"])
    writer.flush()
