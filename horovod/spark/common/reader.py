"""The workers' half of an estimator's data: each rank reads its own rows of the Parquet data with pyarrow.

How an estimator's training function uses it (on every rank)::

    steps = steps_per_epoch(dataset.train_rows, batch_size, hvd.size(), user_steps)
    reader = ShardReader(remote_store.filesystem, dataset.train_data_path, columns, hvd.rank(), hvd.size(),
                         batch_size, shuffle=True, seed=seed, metadata=dataset.metadata)
    for epoch in range(epochs):
        for batch in reader.batches(steps):      # exactly `steps` batches on every rank
            batch["x"]                           # numpy array: (batch, *shape) for vector/array columns

Sharding: the row groups of all files, in file-name order, form one sequence of rows; rank ``r`` of ``n`` owns
rows ``[r*N//n, (r+1)*N//n)`` and reads only the row groups that overlap them (every rank gets data when
``N >= n``, whatever the number of files).  The reader cycles through its shard without end -- a new pass
reshuffles with ``seed + pass`` (row-group order and rows within each row group) -- so every rank runs the same
number of steps and no rank waits alone in an allreduce; the steps of an epoch (upstream's rule) come from the
total row count.  ``transformation_fn`` receives each row group as a pandas DataFrame and returns one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ShardReader", "EpochReaders", "open_readers", "reader_columns", "steps_per_epoch", "column_to_numpy"]


def steps_per_epoch(rows: int, batch_size: int, size: int, given: int | None = None, *, ceil: bool = False) -> int:
    """Batches per epoch on each rank: ``given``, else ``rows / (batch_size * size)`` rounded down (or up), >= 1."""
    if given is not None:
        if given <= 0:
            raise ValueError(f"steps per epoch must be positive, got {given}")
        return int(given)
    if batch_size <= 0:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    per_step = batch_size * size
    return max(1, math.ceil(rows / per_step) if ceil else rows // per_step)


def column_to_numpy(values: Any, shape: int | None = None) -> np.ndarray:
    """A pyarrow array / chunked array or pandas Series as numpy: list columns become ``(rows, size)``."""
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.StructArray) and is_vector_struct(values.type):
        return _vectors_to_numpy(values)
    if isinstance(values, pa.Array):
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or \
                pa.types.is_fixed_size_list(values.type):
            flat = values.flatten().to_numpy(zero_copy_only=False)
            return flat.reshape(len(values), -1) if len(values) else flat.reshape(0, shape or 0)
        return values.to_numpy(zero_copy_only=False)
    array = np.asarray(values)
    if array.dtype == object and len(array) and isinstance(array[0], (list, tuple, np.ndarray)):
        return np.stack([np.asarray(v) for v in array])
    return array


def is_vector_struct(kind: Any) -> bool:
    """Whether an Arrow type is how Spark writes a ``VectorUDT`` column to Parquet (type, size, indices, values)."""
    import pyarrow as pa

    return pa.types.is_struct(kind) and {kind.field(i).name for i in range(kind.num_fields)} >= {
        "type", "size", "indices", "values"}


def _vectors_to_numpy(values: Any) -> np.ndarray:
    """Spark ML vectors as written to Parquet (1: dense, 0: sparse with ``size``) as a dense ``(rows, size)`` array."""
    kinds = values.field("type").to_numpy(zero_copy_only=False)
    dense = values.field("values")
    if len(kinds) and (kinds == 1).all():
        return dense.flatten().to_numpy(zero_copy_only=False).reshape(len(values), -1)
    rows = []
    for kind, size, indices, vals in zip(kinds, values.field("size").to_pylist(), values.field("indices").to_pylist(),
                                         dense.to_pylist()):
        if kind == 1:
            rows.append(np.asarray(vals, dtype=np.float64))
        else:
            row = np.zeros(size, dtype=np.float64)
            row[np.asarray(indices, dtype=np.int64)] = vals
            rows.append(row)
    return np.stack(rows) if rows else np.zeros((0, 0))


def _row_groups(filesystem: Any, files: Sequence[str]) -> list[tuple[str, int, int]]:
    import pyarrow.parquet as pq

    groups = []
    for file in files:
        with filesystem.open(file, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        groups.extend((file, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups))
    return groups


def _shard(groups: list[tuple[str, int, int]], rank: int, size: int) -> list[tuple[str, int, int, int]]:
    """This rank's pieces: (file, row group, first row, end row) of the row groups overlapping its row range."""
    total = sum(g[2] for g in groups)
    lo, hi = rank * total // size, (rank + 1) * total // size
    pieces, start = [], 0
    for file, index, rows in groups:
        end = start + rows
        if start < hi and end > lo:
            pieces.append((file, index, max(lo, start) - start, min(hi, end) - start))
        start = end
    return pieces


class ShardReader:
    """Endless, optionally shuffled batches of this rank's rows of a Parquet dataset (see the module docstring)."""

    def __init__(self, filesystem: Any, path: str, columns: Sequence[str], rank: int, size: int, batch_size: int,
                 *, shuffle: bool = True, seed: int | None = None, metadata: dict[str, dict[str, Any]] | None = None,
                 transformation_fn: Callable[[Any], Any] | None = None, cache: bool = False) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError("ShardReader: path must name a Parquet dataset")
        files = sorted(p for p in filesystem.find(path) if p.endswith(".parquet")) if filesystem.exists(path) else []
        if not files:
            raise ValueError(f"{path} holds no Parquet files")
        self.filesystem = filesystem
        self.columns = list(columns)
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = 0 if seed is None else int(seed)
        self.rank = rank
        self.metadata = metadata or {}
        self.transformation_fn = transformation_fn
        self.pieces = _shard(_row_groups(filesystem, files), rank, size)
        self.rows = sum(p[3] - p[2] for p in self.pieces)
        if self.rows == 0:
            raise ValueError(f"rank {rank} of {size} has no rows of {path}: the dataset has fewer rows than "
                             f"processes")
        self._cache: dict[int, dict[str, np.ndarray]] | None = {} if cache else None
        self.reset()

    def reset(self) -> None:
        """Start again from the first pass (a validation reader does this each epoch: the same rows each time)."""
        self._chunks = self._passes()
        self._pending: dict[str, np.ndarray] | None = None

    def _load(self, number: int) -> dict[str, np.ndarray]:
        import pyarrow.parquet as pq

        if self._cache is not None and number in self._cache:
            return self._cache[number]
        file, index, first, end = self.pieces[number]
        with self.filesystem.open(file, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(index, columns=self.columns).slice(first, end - first)
        if self.transformation_fn is not None:
            frame = self.transformation_fn(table.to_pandas())
            chunk = {c: column_to_numpy(frame[c]) for c in frame.columns}
        else:
            chunk = {c: column_to_numpy(table.column(c), self.metadata.get(c, {}).get("shape")) for c in self.columns}
        if self._cache is not None:
            self._cache[number] = chunk
        return chunk

    def _passes(self) -> Iterator[dict[str, np.ndarray]]:
        passes = 0
        while True:
            rng = np.random.default_rng([self.seed, passes, self.rank])
            order = rng.permutation(len(self.pieces)) if self.shuffle else range(len(self.pieces))
            for number in order:
                chunk = self._load(int(number))
                if self.shuffle:
                    perm = rng.permutation(len(next(iter(chunk.values()))))
                    chunk = {c: v[perm] for c, v in chunk.items()}
                yield chunk
            passes += 1

    def batches(self, steps: int) -> Iterator[dict[str, np.ndarray]]:
        """The next ``steps`` batches of ``batch_size`` rows each (column name -> numpy array)."""
        for _ in range(steps):
            parts, have = [], 0
            while have < self.batch_size:
                chunk = self._pending if self._pending is not None else next(self._chunks)
                self._pending = None
                rows = len(next(iter(chunk.values())))
                take = min(rows, self.batch_size - have)
                parts.append({c: v[:take] for c, v in chunk.items()})
                if take < rows:
                    self._pending = {c: v[take:] for c, v in chunk.items()}
                have += take
            yield parts[0] if len(parts) == 1 else {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


def reader_columns(feature_columns: Sequence[str], label_columns: Sequence[str],
                   sample_weight_col: str | None = None) -> list[str]:
    """The columns a training process reads: features, labels and the sample weights, each once."""
    return list(dict.fromkeys([*feature_columns, *label_columns, *([sample_weight_col] if sample_weight_col else [])]))


@dataclass
class EpochReaders:
    """A training process's readers and steps per epoch; ``val`` is None without validation data."""

    train: ShardReader
    train_steps: int
    val: ShardReader | None
    val_steps: int


def open_readers(dataset: Any, filesystem: Any, columns: Sequence[str], rank: int, size: int, *, batch_size: int,
                 val_batch_size: int, shuffle: bool = True, seed: int | None = None,
                 transformation_fn: Callable[[Any], Any] | None = None, cache: bool = False,
                 train_steps: int | None = None, val_steps: int | None = None, val_ceil: bool = False) -> EpochReaders:
    """This rank's readers of a prepared :class:`~horovod.spark.common.data.Dataset` (validation unshuffled) and
    the steps per epoch (``train_steps``/``val_steps`` if given, else from the row counts; ``val_ceil``: round the
    validation steps up, as upstream's torch estimator)."""
    common = dict(metadata=dataset.metadata, transformation_fn=transformation_fn, cache=cache)
    train = ShardReader(filesystem, dataset.train_data_path, columns, rank, size, batch_size, shuffle=shuffle,
                        seed=seed, **common)
    steps = steps_per_epoch(dataset.train_rows, batch_size, size, train_steps)
    if not (dataset.val_data_path and dataset.val_rows):
        return EpochReaders(train, steps, None, 0)
    val = ShardReader(filesystem, dataset.val_data_path, columns, rank, size, val_batch_size, shuffle=False,
                      **common)
    return EpochReaders(train, steps, val, steps_per_epoch(dataset.val_rows, val_batch_size, size, val_steps,
                                                           ceil=val_ceil))
