"""``ElasticSampler`` for torch ``DataLoader``s: the exactly-once partition of
:mod:`horovod.common.elastic_sampler` as a ``torch.utils.data.Sampler``.

Index mode, upstream's usage::

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

Batch mode, equal step counts on every rank with no padding (recommended)::

    sampler = hvd.elastic.ElasticSampler(dataset, batch_size=32)
    loader = DataLoader(dataset, batch_sampler=sampler)
"""

from __future__ import annotations

from collections.abc import Sized

import torch.utils.data

from horovod.common.elastic_sampler import ElasticSampler as _ExactSampler

__all__ = ["ElasticSampler"]


class ElasticSampler(_ExactSampler, torch.utils.data.Sampler):
    """Partitions the unprocessed samples of the epoch over the current ranks; see the module docstring.

    Args:
        dataset: the dataset (only its length is used).
        shuffle: reshuffle every epoch with ``random.Random(seed + epoch)``.
        seed: must be equal on every rank.
        batch_size: batch mode (use as ``batch_sampler=``); None for index mode.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, *,
                 batch_size: int | None = None) -> None:
        _ExactSampler.__init__(self, dataset, shuffle=shuffle, seed=seed, batch_size=batch_size)
