"""numpy batches of the shard readers as torch tensors, and the estimators' loss: shared by the plain torch and the
Lightning estimators' workers and by ``TorchModel.transform``.

How they use it: a batch from :class:`horovod.spark.common.reader.ShardReader` is ``{column: numpy array}``;
:func:`features` turns the feature columns into the model's inputs (reshaped to ``input_shapes``, default
``(-1, size)``, floats in the model's floating dtype), :func:`labels` the label columns, :func:`match_labels`
reshapes labels like the outputs, and :func:`weighted_loss` is upstream's ``calculate_loss``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["default_input_shapes", "features", "labels", "as_outputs", "match_labels", "weighted_loss",
           "float_dtype"]


def float_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating parameter (float32 without any)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def default_input_shapes(feature_columns: Sequence[str], metadata: dict[str, dict[str, Any]]) -> list[list[int]]:
    """``[-1, size]`` per feature column (``[-1, 1]`` for scalars), as upstream."""
    return [[-1, int(metadata.get(c, {}).get("shape") or 1)] for c in feature_columns]


def _tensor(values: np.ndarray, dtype: torch.dtype, device: Any, integers: bool = False) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(values, copy=True, order="C"))  # arrow-backed arrays are read-only
    if tensor.is_floating_point() or tensor.dtype == torch.bool or integers:
        tensor = tensor.to(dtype)
    return tensor.to(device) if device is not None else tensor


def features(batch: dict[str, np.ndarray], columns: Sequence[str], shapes: Sequence[Sequence[int]],
             dtype: torch.dtype = torch.float32, device: Any = None, integers: bool = False) -> list[torch.Tensor]:
    """The model's inputs: one tensor per feature column, reshaped; ``integers``: integer columns in ``dtype``
    too (the plain torch estimator's inputs are all floats, as upstream's ``row[col].float()``)."""
    return [_tensor(batch[c], dtype, device, integers).reshape(list(shape)) for c, shape in zip(columns, shapes)]


def labels(batch: dict[str, np.ndarray], columns: Sequence[str], dtype: torch.dtype = torch.float32,
           device: Any = None) -> list[torch.Tensor]:
    """One tensor per label column (integers stay integers, for classification losses)."""
    return [_tensor(batch[c], dtype, device) for c in columns]


def as_outputs(outputs: Any) -> list[torch.Tensor]:
    """A model's output(s) as a list."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def match_labels(outputs: Sequence[torch.Tensor], label_tensors: Sequence[torch.Tensor],
                 label_shapes: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """Labels reshaped to ``label_shapes``, else to their output's shape when the sizes agree (upstream's rule)."""
    if label_shapes:
        return [t.reshape(list(s)) for t, s in zip(label_tensors, label_shapes)]
    return [t.reshape(o.shape) if hasattr(o, "shape") and o.numel() == t.numel() else t
            for t, o in zip(label_tensors, outputs)]


def _unreduced(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` returning one loss per sample: a loss module copied with ``reduction='none'``, a function
    called with ``reduction='none'`` (torch.nn.functional's convention)."""
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        module = copy.copy(loss_fn)
        module.reduction = "none"
        return module
    return lambda output, label: loss_fn(output, label, reduction="none")


def weighted_loss(outputs: Sequence[torch.Tensor], label_tensors: Sequence[torch.Tensor],
                  loss_fns: Sequence[Callable[..., torch.Tensor]], loss_weights: Sequence[float],
                  sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(loss_i(output_i, label_i) * w_i)``; with sample weights each per-sample loss is multiplied by its
    weight and averaged over the batch (not divided by the weights' sum, as upstream)."""
    total = None
    for output, label, loss_fn, weight in zip(outputs, label_tensors, loss_fns, loss_weights):
        if sample_weights is None:
            loss = loss_fn(output, label)
        else:
            loss = (_unreduced(loss_fn)(output, label).reshape(len(sample_weights), -1).mean(dim=1)
                    * sample_weights.reshape(-1)).mean()
        total = loss * weight if total is None else total + loss * weight
    assert total is not None, "no label columns"
    return total
