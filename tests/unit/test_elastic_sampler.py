"""The exactly-once sampler and ObjectState, simulated in one process (no launcher)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from horovod.common.elastic import ObjectState
from horovod.common.elastic_sampler import ElasticSampler, plan_batches


@pytest.mark.parametrize("m,n,bs", [(0, 2, 3), (1, 2, 3), (9, 2, 4), (17, 4, 4), (100, 3, 7), (5, 8, 2)])
def test_plan_covers_remaining_once_with_equal_steps(m, n, bs):
    plan = plan_batches(list(range(m)), n, bs)
    flat = [i for step in plan for batch in step for i in batch]
    assert sorted(flat) == list(range(m))
    for step in plan:
        assert len(step) == n
        assert all(len(b) <= bs for b in step)
        if m >= n:
            assert all(b for b in step), plan  # nobody idles while samples are left


def _world(samplers_state, size, n_samples, batch_size, epoch):
    samplers = []
    for r in range(size):
        s = ElasticSampler(n_samples, shuffle=True, seed=5, batch_size=batch_size,
                           get_rank=lambda r=r: r, get_size=lambda: size)
        if samplers_state is not None:
            s.load_state_dict(samplers_state)
        s.set_epoch(epoch)
        samplers.append(s)
    return samplers


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("batch_size", [None, 3])
def test_exactly_once_across_failures_and_resizes(seed, batch_size):
    rng = random.Random(seed)
    n_samples, epochs = 37, 3
    bs = batch_size or 3
    size = rng.randint(1, 4)
    seen = np.zeros(n_samples, np.int64)
    committed = (0, None, seen.copy(), 0)  # epoch, sampler state, model, padding in it
    epoch, state, padding = 0, None, 0
    while epoch < epochs:
        samplers = _world(state, size, n_samples, batch_size, epoch)
        per_rank = [list(s) if batch_size else [list(s)[i:i + bs] for i in range(0, len(s), bs)] for s in samplers]
        steps = len(per_rank[0])
        assert all(len(p) == steps for p in per_rank)  # index mode too: a step more on one rank is a stall
        if not batch_size:
            padding += size - 1  # index mode pads the remainder to a multiple of the world size
        fail_at = rng.randint(0, steps + 2) if rng.random() < 0.6 else None
        failed = False
        for step in range(max(len(p) for p in per_rank)):
            if step == fail_at:
                failed = True
                break
            for p in per_rank:
                if step < len(p):
                    seen[p[step]] += 1
            for s in samplers:
                s.record_batch(step, bs)
            if rng.random() < 0.5:  # commit
                committed = (epoch, samplers[0].state_dict(), seen.copy(), padding)
        if failed:
            epoch, state, seen, padding = committed[0], committed[1], committed[2].copy(), committed[3]
            size = rng.randint(1, 4)
            continue
        epoch += 1
        state = samplers[0].state_dict()
        committed = (epoch, state, seen.copy(), padding)
    if batch_size:
        assert seen.tolist() == [epochs] * n_samples  # exactly once
    else:  # at least once; twice only for the padding of the resets that the final model saw
        assert seen.min() == epochs and seen.sum() - epochs * n_samples <= padding, (seen, padding)


def test_set_epoch_same_epoch_keeps_progress():
    s = ElasticSampler(10, batch_size=2, get_rank=lambda: 0, get_size=lambda: 2)
    s.record_batch(1, 2)
    assert s.processed_num == 8
    s.set_epoch(0)
    assert s.processed_num == 8 and len(s) == 1
    s.set_epoch(1)
    assert s.processed_num == 0 and len(s) == 3


class _Sampler:
    def __init__(self):
        self.value = 0
        self.resets = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]

    def reset(self):
        self.resets += 1


def test_object_state_save_restore_sync_and_stateful_attributes():
    sampler = _Sampler()
    state = ObjectState(lambda obj, root_rank=0: obj, lambda: 0, epoch=0, items=[1], sampler=sampler)
    state.epoch, sampler.value = 3, 7
    state.items.append(2)
    state.restore()
    assert (state.epoch, state.items, sampler.value) == (0, [1], 0)
    assert state.sampler is sampler  # restored in place
    state.epoch, sampler.value = 4, 9
    state.commit()
    state.epoch, sampler.value = 5, 10
    state.sync()
    assert (state.epoch, sampler.value) == (4, 9)
    state.on_reset()
    assert sampler.resets == 1


def test_check_host_updates_raises_with_skip_sync_for_removals():
    from horovod.base.exceptions import HostsUpdatedInterrupt

    state = ObjectState(lambda obj, root_rank=0: obj, lambda: 1, epoch=0)
    state.check_host_updates()  # nothing queued
    state.on_hosts_updated(5.0, 1)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is True
    state.on_hosts_updated(4.0, 2)  # older than the last one seen: ignored
    state.check_host_updates()
    state.on_hosts_updated(6.0, 2)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is False
