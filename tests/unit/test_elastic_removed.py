"""A worker the elastic driver removed (rank -1) never takes a slot again.

When its host comes back, the driver starts a fresh worker for the slot (tests/elastic/test_elastic_faults.py,
``test_host_removed_and_added_back_before_its_worker_exited``).  The removed worker, if it was slow enough
to skip the generation that removed it, must not read the slot's newer assignment -- it would join as the
fresh worker's twin -- but end with upstream's 'has been removed' error.
"""

from __future__ import annotations

from horovod.common.elastic_init import _removed_between
from horovod.transport.store import InMemoryStore

SLOT = "127.0.0.1:0"


def _store(assignments: dict[int, str]) -> InMemoryStore:
    store = InMemoryStore()
    for g, fields in assignments.items():
        store.put(f"elastic/assign.{g}/{SLOT}", fields.encode())
    return store


def test_a_skipped_generation_that_removed_the_slot_counts():
    store = _store({0: "1,2,0,1,1,2", 1: "-1,-1,-1,-1,-1,-1", 2: "1,2,0,1,1,2"})
    assert _removed_between(store, SLOT, 0, 2)


def test_the_next_generation_or_skipped_ones_that_kept_the_slot_do_not():
    store = _store({0: "1,2,0,1,1,2", 1: "0,1,0,1,0,1", 3: "1,2,0,1,1,2"})
    assert not _removed_between(store, SLOT, 0, 1)  # nothing skipped: the assignment read next decides
    assert not _removed_between(store, SLOT, 0, 3)  # generation 2 has no key for the slot: not removed
