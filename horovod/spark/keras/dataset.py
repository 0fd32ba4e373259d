"""The Keras estimator's input pipeline: a rank's batches from :class:`horovod.spark.common.reader.ShardReader`
as a ``tf.data`` dataset of ``(features, labels[, sample_weights])`` that never runs out.

The reader cycles through the rank's shard without end and every rank runs the same number of steps per epoch
(computed from the total row count), so no rank runs out of batches before the others and waits alone in an
allreduce.  Columns are reshaped to the model's input and output shapes (a flat vector column of 4 values feeds
a ``(2, 2)`` input, as upstream), float64 is cast to Keras' float type, integers (class ids) stay as they are.
One input or output is a tensor, several a tuple in the model's order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["make_dataset", "shape_columns"]

Shape = Sequence[int | None] | None


def _shaped(values: np.ndarray, shape: Shape, floatx: str, name: str) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype.kind == "f" and values.dtype != np.dtype(floatx):
        values = values.astype(floatx)
    if shape is None:
        return values
    dims = list(shape[1:])
    if any(d is None for d in dims):
        return values
    want = int(np.prod(dims)) if dims else 1
    have = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
    if want != have:
        raise ValueError(f"Column {name!r} holds {have} value(s) per row but the model's tensor has shape "
                         f"{tuple(shape)} ({want} values)")
    return values.reshape((len(values), *dims)) if dims else values.reshape(len(values))


def shape_columns(columns: Mapping[str, np.ndarray], names: Sequence[str], shapes: Sequence[Shape],
                  floatx: str = "float32") -> tuple[np.ndarray, ...]:
    """``columns[name]`` reshaped to ``shapes`` (one per name, batch dimension first; None: as it is)."""
    return tuple(_shaped(columns[name], shape, floatx, name) for name, shape in zip(names, shapes))


def _structure(parts: tuple) -> Any:
    return parts[0] if len(parts) == 1 else parts


def make_dataset(batches: Callable[[], Iterator[Mapping[str, np.ndarray]]], *, feature_cols: Sequence[str],
                 label_cols: Sequence[str], input_shapes: Sequence[Shape], label_shapes: Sequence[Shape],
                 sample_weight_col: str | None = None, prefetch: int | None = None,
                 floatx: str = "float32") -> Any:
    """A ``tf.data.Dataset`` of the batches ``batches()`` yields (column name -> numpy values), never ending.

    Args:
        batches: returns an endless iterator of batches (e.g. of a ``ShardReader``); called when the dataset is
            made (its first batch gives the element types) and again should the dataset be iterated anew.
        input_shapes, label_shapes: the model's input and output shapes (batch dimension first).
        sample_weight_col: its values weight every output's loss.
        prefetch: batches to prefetch; ``None`` or 0: ``tf.data.AUTOTUNE``.
    """
    import tensorflow as tf

    def elements() -> Iterator[tuple]:
        for batch in batches():
            x = shape_columns(batch, feature_cols, input_shapes, floatx)
            y = shape_columns(batch, label_cols, label_shapes, floatx)
            if sample_weight_col is None:
                yield _structure(x), _structure(y)
            else:
                weights = _shaped(batch[sample_weight_col], (None,), floatx, sample_weight_col)
                yield _structure(x), _structure(y), _structure((weights,) * len(label_cols))

    stream = elements()
    first = next(stream)
    started = [False]

    def generator() -> Iterator[tuple]:
        if started[0]:  # iterated again: a fresh stream
            yield from elements()
            return
        started[0] = True
        yield first
        yield from stream

    def spec(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(spec(v) for v in value)
        return tf.TensorSpec(shape=(None, *value.shape[1:]), dtype=tf.as_dtype(value.dtype))

    dataset = tf.data.Dataset.from_generator(generator, output_signature=spec(first))
    return dataset.prefetch(prefetch if prefetch and prefetch > 0 else tf.data.AUTOTUNE)
