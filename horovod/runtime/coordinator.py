"""The coordinator: one per job, driven by global rank 0's engine thread.

It collects every rank's requests, decides when a tensor is ready on all members of its process set,
validates, fuses, and hands out responses.  Because a single coordinator orders the responses of *every*
process set, two ranks that share several sets always execute them in the same order, so overlapping sets
cannot deadlock, while ranks of disjoint sets never wait for each other.

Response cache: a single-tensor response gets a cache id that every member records.  Next time a rank
submits the same name with the same parameters it sends only ``(set, cache id)``; when every member hit,
the cached response is reused without decoding or validation (upstream's all-ranks-hit fast path), and a
response made only of such entries travels to the workers as its cache ids (``Response.cached_ids``): a
step that repeats the last one costs each rank one small frame each way.  Ids are never reused; an evicted
entry stays in a graveyard until every member has acknowledged the eviction notice, so a hit racing an
eviction still resolves.  A batch of hits that repeats one seen before as a whole (a training step, batched
alike on every rank) is replayed: once every member sent it, the responses fused from it before are emitted
again, with no work per tensor (``_Replay``).

Small allreduces whose bytes every contributor sent with its request are reduced here, a fused group at a
time, and the result travels back with the response (one round trip instead of negotiation plus a data
exchange).

Ranks that group different numbers of tensors under one name fail at once instead of waiting for the stall
deadline: the bookkeeping is :mod:`horovod.runtime.group_check` (one ``GroupSizes`` per process set); the
coordinator notes member names as they arrive and settle and, for a base noted with a second size, evicts its
cached members and fails the pending names it is told (:meth:`_check_group`).
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from horovod.base.adasum import adasum_of
from horovod.base.config import RuntimeConfig
from horovod.base.exceptions import MISMATCHED_COLLECTIVES
from horovod.base.reduce_ops import ReduceOp, data_plane_op
from horovod.runtime.group_check import GroupSizes, group_of
from horovod.runtime.messages import Request, RequestType, Response, dtype_of
from horovod.runtime.validation import build_response, process_set_ranks_error
from horovod.transport.communicator import apply_reduce, reduce_into
from horovod.transport.scaling import scale_inplace, scaled_copy

__all__ = ["Coordinator", "collective_failure", "mismatched_collectives"]

log = logging.getLogger(__name__)

_CACHEABLE = {RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.REDUCESCATTER,
              RequestType.ALLGATHER, RequestType.ALLTOALL}
_FUSABLE = {RequestType.ALLREDUCE}
# "rank A: collective failed: rank B: timed out ...": A waited for B inside a collective (see collective_failure).
_FAILURE = re.compile(r"rank (\d+): collective failed: (?:rank (\d+): timed out)?")


def collective_failure(rank: int, cause: BaseException) -> str:
    """The shutdown reason of a rank whose collective failed (a timeout names the silent peer first)."""
    return f"rank {rank}: collective failed: {cause}"


def mismatched_collectives(deadline: float, ranks: dict[int, tuple[list[str], list[str]]]) -> str:
    """The shutdown reason of a stall in which every rank that the stalled tensors wait for is itself waiting
    for tensors that other ranks never submitted (``ranks``: rank -> (never submitted, waits for)): the ranks
    submitted different collectives (one run on some ranks only, e.g. under ``if hvd.rank() == 0:``), each
    waits for the others, and no peer is merely slow or hung -- a program error that a reset (elastic mode)
    cannot cure.  Its prefix makes every rank's pending operations fail with ``PreconditionError``, which
    ``hvd.elastic.run`` does not recover from (see ``horovod.base.exceptions.MISMATCHED_COLLECTIVES``)."""
    detail = "; ".join(f"rank {r} never submitted {lacks[:6]} and waits for {own[:6]}"
                       for r, (lacks, own) in sorted(ranks.items()))
    return (f"{MISMATCHED_COLLECTIVES} the ranks submitted different collectives and waited for each other "
            f"for the stall deadline ({int(deadline)} s): {detail}. Every rank must submit the same collectives "
            "(a collective, or a call that runs one such as an elastic state.commit(), on some ranks only -- e.g. "
            "under `if hvd.rank() == 0:` -- waits forever); this is an error in the program, which an elastic "
            "reset cannot cure.")
EVICTION_WARNING = (
    "A response has been evicted from cache which may indicate reduced performance. Better performance may "
    "be obtained by disabling caching (HOROVOD_CACHE_CAPACITY=0) or increasing the cache capacity "
    "(HOROVOD_CACHE_CAPACITY>1024)."
)


class _Pending:
    """One tensor name some members of a set have submitted."""

    __slots__ = ("requests", "data", "first_seen", "cache_id")

    def __init__(self, first_seen: float, cache_id: int) -> None:
        self.requests: dict[int, Request] = {}
        self.data: dict[int, object] = {}  # inline bytes of small allreduces, per rank
        self.first_seen = first_seen
        self.cache_id = cache_id  # the id every hit so far referred to (-1: some rank sent a full request)


class _CacheEntry:
    __slots__ = ("name", "response", "requests", "key", "key_inline", "nbytes", "shape", "fusable", "group")

    def __init__(self, name: str, response: Response, requests: dict[int, Request],
                 group: tuple[str, int] | None = None) -> None:
        self.name = name
        self.group = group  # (base, size) of a grouped collective's member
        self.response = response
        self.requests = requests
        self.key = _fusion_key(response)
        self.key_inline = (*self.key, True)
        self.nbytes = response.nbytes()
        self.shape = response.shapes[0] if response.shapes else ()
        self.fusable = response.type in _FUSABLE


# A tensor (or an unfusable response) ready to run, as a tuple ``(response, entry, cid, data)``: the response,
# or the cache entry every member hit (``cid`` >= 0); ``data`` holds the inline bytes per rank when every
# contributor sent them.
_Ready = tuple

_REPLAYS = 16  # batches remembered for replay (a training loop repeats one or a few)
_SIGHTINGS = 64  # batches seen once (a replay is built the second time a batch comes)


class _Replay:
    """A batch of cache hits that came before, the same hits in the same order (see :meth:`Coordinator._replay`).

    ``templates``: the responses it was fused into, each with the (cache id, blob index) of its tensors when
    the coordinator reduces them (``None`` otherwise); ``arrived``: the inline bytes of each member that sent
    the batch this time."""

    __slots__ = ("key", "state", "members", "cids", "names", "blob_sizes", "templates", "threshold", "arrived",
                 "since")

    def __init__(self, key: tuple, state: _SetState, entries: list[_CacheEntry], templates: list,
                 threshold: int) -> None:
        self.key = key
        self.state = state
        self.members = frozenset(state.ranks)
        self.cids = [cid for _, cid, _ in key]
        self.names = frozenset(entry.name for entry in entries)
        self.blob_sizes = [(blob, entry.nbytes) for (_, _, blob), entry in zip(key, entries) if blob >= 0]
        self.templates = templates
        self.threshold = threshold
        self.arrived: dict[int, list] = {}
        self.since = 0.0


def _compact(r: Response, cache_ids: list[int], cached_ids: list[int]) -> Response:
    """A new response of ``r``'s kind, names and shapes that travels as ``cached_ids`` (no data, no error)."""
    return Response(r.type, r.process_set_id, r.names, r.dtype, r.shapes, r.root_rank, r.reduce_op, r.prescale,
                    r.postscale, r.rank_dims, r.splits, cache_ids=cache_ids, cached_ids=cached_ids)


def _fusion_key(resp: Response) -> tuple:
    return (resp.type, resp.process_set_id, resp.dtype, resp.reduce_op, resp.prescale, resp.postscale)


@dataclass
class _SetState:
    id: int
    ranks: list[int]
    pending: dict[str, _Pending] = field(default_factory=dict)
    cache: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # id -> _CacheEntry
    cache_by_name: dict[str, int] = field(default_factory=dict)
    graveyard: dict[int, tuple[_CacheEntry, dict[int, int]]] = field(default_factory=dict)
    groups: GroupSizes = field(default_factory=GroupSizes)  # sizes of grouped collectives (group_check)


_DEFAULTS = RuntimeConfig()  # the knob table's defaults (a Coordinator built without a config: tests)


class Coordinator:
    """Collects requests and produces, per rank, the ordered responses it must execute."""

    def __init__(self, size: int, process_sets: dict[int, list[int]], *, cache_capacity: int,
                 fusion_threshold: int, disable_group_fusion: bool = False, timeline=None,
                 stall_warning: float = _DEFAULTS.stall_check_time, stall_shutdown: float = 0.0,
                 stall_disable: bool = False, failure_settle: float = 0.5, failure_wait: float = 30.0) -> None:
        self.size = size
        self.sets: dict[int, _SetState] = {i: _SetState(i, list(r)) for i, r in process_sets.items()}
        self.cache_capacity = cache_capacity
        self.fusion_threshold = fusion_threshold
        self.disable_group_fusion = disable_group_fusion
        self.timeline = timeline
        self.stall_warning = stall_warning
        if 0 < stall_shutdown < stall_warning and not stall_disable:
            log.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, "
                        "will not shutdown.")
            stall_shutdown = 0.0
        self.stall_shutdown = stall_shutdown
        self.stall_disable = stall_disable
        self.joined: set[int] = set()
        self.last_joined = -1
        self.shutdown_reason: str | None = None
        # Failures reported meanwhile: (reporting rank or -1, suspect rank or None, text).
        self.failure_settle = failure_settle
        self.failure_wait = max(failure_wait, failure_settle)
        self._failures: list[tuple[int, int | None, str]] = []
        self._failures_since = 0.0
        self._next_cache_id = 0
        self._ready: list[_Ready] = []
        self._evictions: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        self._sent_seq = [0] * size  # frames sent to each rank
        self._acked = [0] * size
        self._warned_eviction = False
        self._next_set_id = max(self.sets) + 1 if self.sets else 1
        self._free_set_ids: collections.deque[int] = collections.deque()
        self._last_stall_check = time.monotonic()
        self._replays: collections.OrderedDict[tuple, _Replay] = collections.OrderedDict()
        self._sightings: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._parked: _Replay | None = None  # the replay some members sent and others not yet
        self._replayed: list[Response] = []  # responses of completed replays, for the next take_responses
        # (set id, base) -> set: bases pending with a second size, checked at the end of the batch
        self._groups_to_check: dict[tuple[int, str], _SetState] = {}

    # ------------------------------------------------------------------ input
    def submit(self, rank: int, ack: int, shutdown: str | None, requests: list[Request],
               cached: list[tuple[int, int, int]], blobs: list | None = None) -> None:
        """Record one rank's batch (``cached`` = (set id, cache id, blob index) hits; ``blobs`` the bytes or
        arrays of inline tensors)."""
        if ack > self._acked[rank]:
            self._acked[rank] = ack
        if shutdown is not None:
            self.report(rank, shutdown)
        now = time.monotonic()
        for req in requests:
            req.rank = rank
            if req.type == RequestType.JOIN:
                self._join(rank)
                continue
            state = self.sets.get(req.process_set_id)
            if state is None:  # removed meanwhile: answer with an error for this rank only
                self._ready.append((Response(
                    RequestType.ERROR, req.process_set_id, [req.name],
                    error="Process set provided does not exist, or has not been registered.", payload=[rank]),
                    None, -1, None))
                continue
            cid = state.cache_by_name.get(req.name)
            if cid is not None:
                self._evict(state, cid)  # a full request for a cached name means its parameters changed
            if req.group_size:
                group = group_of(req)
                if group is not None and state.groups.note(req.name, *group):
                    self._groups_to_check[(state.id, group[0])] = state
            self._add(state, req.name, rank, req, -1, now, blobs[req.inline] if req.inline >= 0 else None)
        if cached and (requests or not self._replay(rank, cached, blobs, now)):
            if self._parked is not None:
                self._unpark()
            self._take_hits(rank, cached, blobs, now)
        if self._groups_to_check:
            self._check_groups()
        if self._graveyard_pending():
            self._collect_graveyard()

    def _take_hits(self, rank: int, cached, blobs: list | None, now: float) -> None:
        """Record one rank's cache hits, tensor by tensor (the general path; see :meth:`_replay`)."""
        state = None
        last_ps = None
        slow = self.timeline is not None or bool(self.joined)
        ready = self._ready
        for ps_id, cid, blob in cached:
            if ps_id != last_ps:
                state = self.sets.get(ps_id)
                last_ps = ps_id
                if state is not None:
                    cache, pending_map, members = state.cache, state.pending, len(state.ranks)
            entry = None if state is None else cache.get(cid)
            if entry is not None:
                cache.move_to_end(cid)
            elif state is not None and cid in state.graveyard:
                entry = state.graveyard[cid][0]
                if entry.group is not None and state.groups.note(entry.name, *entry.group):
                    # (the entries of a base seen with a second size are evicted: their hits come this way)
                    self._groups_to_check[(state.id, entry.group[0])] = state
            if entry is None:
                log.error("rank %d referred to unknown cache entry %d of process set %d", rank, cid, ps_id)
                self.shutdown_reason = f"protocol error: rank {rank} sent an unknown cache id"
                continue
            data = None
            if blob >= 0:
                data = blobs[blob]
                if memoryview(data).nbytes != entry.nbytes:
                    log.error("rank %d sent %d inline bytes for cached tensor %s", rank,
                              memoryview(data).nbytes, entry.name)
                    self.shutdown_reason = f"protocol error: rank {rank} sent a tensor of the wrong size"
                    continue
            if slow:
                self._add(state, entry.name, rank, entry.requests[rank], cid, now, data)
                continue
            # The hot path of a repeated step, inlined: record the hit; all members hit -> ready.
            name = entry.name
            pending = pending_map.get(name)
            if pending is None:
                pending = pending_map[name] = _Pending(now, cid)
            elif pending.cache_id != cid:
                pending.cache_id = -1
            requests = pending.requests
            requests[rank] = entry.requests[rank]
            if data is not None:
                pending.data[rank] = data
            if len(requests) >= members:
                if pending.cache_id == cid and cid in cache:
                    del pending_map[name]
                    pdata = pending.data
                    ready.append((None, entry, cid, pdata if pdata and len(pdata) == members else None))
                else:
                    self._check_ready(state, name, pending)

    # ------------------------------------------------------------------ replay of repeated batches
    def _replay(self, rank: int, cached: list[tuple[int, int, int]], blobs: list | None, now: float) -> bool:
        """Record a batch that repeats one seen before, as a whole; False leaves it to the general path.

        A training step sends the same tensors in the same order every time, and so, batched alike, every
        member's batch is the same list of cache hits.  When all members sent that list, the coordinator
        emits the responses it fused the list into when it built the replay -- nothing is done per tensor
        (that was ~1 us per tensor and rank, the largest part of rank 0's work for a step of small tensors).
        One replay at a time waits for members (``_parked``); anything else that comes through the general
        path meanwhile, a join, an eviction or a stall check first turns its arrivals into ordinary hits, so
        the general path sees every rank's submissions as before."""
        if self.timeline is not None or self.joined:
            return False
        key = tuple(cached)
        replay = self._replays.get(key)
        if replay is None:
            replay = self._build_replay(key)
            if replay is None:
                return False
        parked = self._parked
        if parked is not None and (parked is not replay or rank in replay.arrived):
            return False
        state = replay.state
        if replay.threshold != self.fusion_threshold or self.sets.get(state.id) is not state:
            del self._replays[key]
            return False
        if rank not in replay.members or (state.pending and not replay.names.isdisjoint(state.pending)):
            return False
        for blob, nbytes in replay.blob_sizes:
            if memoryview(blobs[blob]).nbytes != nbytes:
                return False  # the general path names the error
        if parked is None:
            self._parked = replay
            replay.since = now
        replay.arrived[rank] = blobs
        if len(replay.arrived) == len(replay.members):
            self._complete_replay(replay)
        return True

    def _build_replay(self, key: tuple) -> _Replay | None:
        """A replay of ``key`` when it came before and every hit is a live entry of one set, once each."""
        sightings = self._sightings
        if key not in sightings:
            sightings[key] = None
            if len(sightings) > _SIGHTINGS:
                sightings.popitem(last=False)
            return None
        state = self.sets.get(key[0][0])
        if state is None:
            return None
        entries = []
        items = []
        for ps, cid, blob in key:
            entry = state.cache.get(cid)
            if ps != state.id or entry is None:
                return None
            entries.append(entry)
            items.append((None, entry, cid, blob if blob >= 0 else None))  # _group: data or not is all it asks
        if len({cid for _, cid, _ in key}) != len(key):
            return None
        templates = []
        for group in self._group(items):
            if type(group) is not list:
                templates.append((group, None))
                continue
            inline = None if group[1][0][3] is None else [(item[2], item[3]) for item in group[1]]
            templates.append((self._fused_response(group), inline))
        replay = self._replays[key] = _Replay(key, state, entries, templates, self.fusion_threshold)
        if len(self._replays) > _REPLAYS:
            self._replays.popitem(last=False)
        return replay

    def _complete_replay(self, replay: _Replay) -> None:
        arrived, replay.arrived = replay.arrived, {}
        self._parked = None
        move_to_end = replay.state.cache.move_to_end  # the entries were used: keep the cache's LRU order
        for cid in replay.cids:
            move_to_end(cid)
        out = self._replayed
        for t, inline in replay.templates:
            response = _compact(t, t.cache_ids, t.cached_ids)
            if inline is not None:
                self._reduce_inline(response, [(None, None, cid, {r: blobs[blob] for r, blobs in arrived.items()})
                                               for cid, blob in inline])
            out.append(response)

    def _unpark(self) -> None:
        """Turn the waiting replay's arrivals into ordinary hits (first seen when they came)."""
        replay, self._parked = self._parked, None
        if replay is None:
            return
        arrived, replay.arrived = replay.arrived, {}
        for rank, blobs in arrived.items():
            self._take_hits(rank, replay.key, blobs, replay.since)

    def _forget_replays(self) -> None:
        """An eviction or a process set change: replays may name entries that are gone."""
        self._unpark()
        self._replays.clear()
        self._sightings.clear()

    def _add(self, state: _SetState, name: str, rank: int, req: Request, cid: int, now: float, data) -> None:
        pending = state.pending.get(name)
        timeline = self.timeline
        if pending is None:
            pending = state.pending[name] = _Pending(now, cid)
            if timeline is not None:
                timeline.negotiate_start(name, req.type)
        elif pending.cache_id != cid:
            pending.cache_id = -1
        pending.requests[rank] = req
        if data is not None:
            pending.data[rank] = data
        if timeline is not None:
            timeline.negotiate_rank_ready(name, rank, req.type)
        if len(pending.requests) >= len(state.ranks) or self.joined:
            self._check_ready(state, name, pending)

    def _check_ready(self, state: _SetState, name: str, pending: _Pending) -> None:
        submitted = len(pending.requests)
        if self.joined:
            submitted += sum(1 for r in state.ranks if r in self.joined and r not in pending.requests)
        if submitted < len(state.ranks):
            return
        del state.pending[name]
        groups = state.groups
        group = groups.settled(name) if groups.names else None
        if self.timeline is not None:
            self.timeline.negotiate_end(name)
        data = pending.data if pending.data and len(pending.data) == len(pending.requests) else None
        cid = pending.cache_id
        if cid >= 0 and not self.joined:
            entry = state.cache.get(cid)
            if entry is not None:
                self._ready.append((None, entry, cid, data))
                return
        response = build_response(list(pending.requests.values()), state.ranks,
                                  self.joined if state.id == 0 else set())
        if response.type == RequestType.ADD_PROCESS_SET:
            response = self._add_process_set(response)
        elif response.type == RequestType.REMOVE_PROCESS_SET:
            self._remove_process_set(response)
        elif response.type in _CACHEABLE and self.cache_capacity > 0 and ".noname." not in name and \
                len(pending.requests) == len(state.ranks):  # unnamed tensors never repeat a name
            if group is None:  # (every request of it was a cache hit: none was counted)
                group = group_of(next(iter(pending.requests.values())))
            if group is None or groups.may_cache(group):
                response.cache_ids = [self._insert_cache(state, name, response, pending.requests, group)]
        self._ready.append((response, None, -1, data if response.type == RequestType.ALLREDUCE else None))

    def _reduce_inline(self, response: Response, items: list[_Ready]) -> None:
        """Reduce a group of small allreduces here, every contributor having sent its bytes with its request:
        the result (one flat array, tensors in order) travels back with the response, saving the data-plane
        round trip (dominant for small tensors)."""
        state = self.sets.get(response.process_set_id)
        ranks = state.ranks if state is not None else sorted(items[0][3])
        dtype = dtype_of(response.dtype)
        counts = []
        for shape in response.shapes:
            n = 1
            for d in shape:
                n *= d
            counts.append(n)
        total = sum(counts)
        op, post = data_plane_op(response.reduce_op, response.postscale, len(ranks))

        def contribution(rank: int) -> np.ndarray:
            if len(items) == 1:
                d = items[0][3].get(rank)
                return np.zeros(total, dtype) if d is None else np.frombuffer(d, dtype, total)
            parts = []
            for item, n in zip(items, counts):
                d = item[3].get(rank)
                parts.append(np.zeros(n, dtype) if d is None else np.frombuffer(d, dtype, n))
            return np.concatenate(parts)

        if response.reduce_op == ReduceOp.ADASUM:
            response.data = adasum_of([contribution(r) for r in ranks], counts, response.prescale,
                                      response.postscale)
            return
        acc = np.empty(total, dtype)
        if response.prescale == 1.0 and len(ranks) > 1:  # the common case: one ufunc call, no copy
            reduce_into(op, contribution(ranks[0]), contribution(ranks[1]), acc)
            rest = ranks[2:]
        else:
            scaled_copy(contribution(ranks[0]), response.prescale, acc)
            rest = ranks[1:]
        scratch = np.empty(total, dtype) if response.prescale != 1.0 else None
        for r in rest:
            x = contribution(r)
            if scratch is not None:
                scaled_copy(x, response.prescale, scratch)
                x = scratch
            apply_reduce(op, acc, x)
        scale_inplace(acc, post)
        response.data = acc

    # ------------------------------------------------------------------ cache
    def _insert_cache(self, state: _SetState, name: str, response: Response,
                      requests: dict[int, Request], group: tuple[str, int] | None = None) -> int:
        cid = self._next_cache_id
        self._next_cache_id += 1
        state.cache[cid] = _CacheEntry(name, response, dict(requests), group)
        state.cache_by_name[name] = cid
        if group is not None:
            state.groups.entry_cached(group)
        while len(state.cache) > self.cache_capacity:
            old = next(iter(state.cache))
            if not self._warned_eviction:
                log.warning(EVICTION_WARNING)
                self._warned_eviction = True
            self._evict(state, old)
        return cid

    def set_cache_capacity(self, capacity: int) -> None:
        """Change the capacity at run time (autotune switches the cache off with 0): entries beyond it are
        evicted with the usual notices, so every member stops using them in step."""
        self.cache_capacity = capacity
        for state in self.sets.values():
            while len(state.cache) > capacity:
                self._evict(state, next(iter(state.cache)))

    def _evict(self, state: _SetState, cid: int) -> None:
        if cid not in state.cache:
            return
        if self._replays:
            self._forget_replays()
        entry = state.cache.pop(cid, None)
        if entry is None:  # evicted meanwhile (the waiting replay's hits went the general way)
            return
        if state.cache_by_name.get(entry.name) == cid:
            del state.cache_by_name[entry.name]
        if entry.group is not None:
            state.groups.entry_evicted(entry.group)
        notice_seq = {}
        for r in state.ranks:
            self._evictions[r].append((state.id, cid))
            notice_seq[r] = self._sent_seq[r] + 1
        state.graveyard[cid] = (entry, notice_seq)

    # ------------------------------------------------------------------ grouped collectives
    def _check_groups(self) -> None:
        """Check the bases noted with a second size (``_groups_to_check``), at the end of a batch."""
        while self._groups_to_check:  # (a check may unpark hits that note more)
            (_, base), state = self._groups_to_check.popitem()
            if self.sets.get(state.id) is state:
                self._check_group(state, base)

    def _check_group(self, state: _SetState, base: str) -> None:
        """Fail every pending name of ``base`` on every member when the ranks grouped different numbers of
        tensors under it (:meth:`GroupSizes.mismatch` says when); first evict its cached members, whose hits
        would bypass the check, and turn the waiting replay's hits into pending names like the others."""
        groups = state.groups
        checked = groups.vary(base)
        if checked is None:
            return
        sizes, cached_names = checked
        for name in cached_names:
            cid = state.cache_by_name.get(name)
            if cid is not None:
                self._evict(state, cid)
        if self._parked is not None:
            self._unpark()
        failed = groups.mismatch(base, sizes, state.pending, state.ranks, self.joined)
        if failed is None:
            return
        names, error = failed
        for name in names:
            del state.pending[name]
            groups.settled(name)
            if self.timeline is not None:
                self.timeline.negotiate_end(name)
        self._ready.append((Response(RequestType.ERROR, state.id, names, error=error), None, -1, None))

    def _graveyard_pending(self) -> bool:
        return any(s.graveyard for s in self.sets.values())

    def _collect_graveyard(self) -> None:
        for state in self.sets.values():
            done = [cid for cid, (_, seqs) in state.graveyard.items()
                    if all(self._acked[r] >= s for r, s in seqs.items())]
            for cid in done:
                del state.graveyard[cid]

    # ------------------------------------------------------------------ join / process sets
    def _join(self, rank: int) -> None:
        self._unpark()
        self.joined.add(rank)
        self.last_joined = rank
        state = self.sets[0]
        for name, pending in list(state.pending.items()):
            self._check_ready(state, name, pending)
        for st in self.sets.values():  # a mismatch that waited only for this rank's part fails now
            for base in st.groups.pending:
                self._groups_to_check[(st.id, base)] = st
        if len(self.joined) == self.size:
            self._ready.append((Response(RequestType.JOIN, 0, ["join.noname"],
                                         last_joined_rank=self.last_joined), None, -1, None))
            self.joined.clear()

    def _add_process_set(self, response: Response) -> Response:
        ranks = sorted(response.payload)
        for state in self.sets.values():
            if state.ranks == ranks:
                return Response(RequestType.ERROR, 0, response.names,
                                error=f"Attempted to add a duplicate process set: {ranks}")
        error = process_set_ranks_error(ranks, self.size) if ranks else "Tried to register an empty process set"
        if error:
            return Response(RequestType.ERROR, 0, response.names, error=error)
        if self._free_set_ids:
            new_id = self._free_set_ids.popleft()
        else:
            new_id = self._next_set_id
            self._next_set_id += 1
        self.sets[new_id] = _SetState(new_id, ranks)
        response.payload = [new_id, *ranks]
        return response

    def _remove_process_set(self, response: Response) -> None:
        set_id = response.payload[0] if response.payload else -1
        if set_id > 0 and set_id in self.sets:
            if self._parked is not None and self._parked.state.id == set_id:
                self._parked = None  # like the general path's pending tensors, they go with the set
            self._forget_replays()
            del self.sets[set_id]
            self._free_set_ids.append(set_id)

    # ------------------------------------------------------------------ output
    def take_responses(self) -> dict[int, tuple[list[Response], list[tuple[int, int]]]]:
        """Fuse what became ready and return, per rank with something to do, its responses and evictions."""
        if self._groups_to_check:  # noted outside submit (hits unparked by the stall inspector or a join)
            self._check_groups()
        if not self._ready and not self._evictions and not self._replayed:
            return {}
        ready, self._ready = self._ready, []
        fused = self._fuse(ready) if ready else []
        if self._replayed:
            fused.extend(self._replayed)
            self._replayed = []
        out: dict[int, tuple[list[Response], list[tuple[int, int]]]] = {}
        for response in fused:
            if response.type == RequestType.ERROR and response.payload and response.process_set_id not in \
                    self.sets:
                targets = response.payload
            elif response.type in (RequestType.ADD_PROCESS_SET, RequestType.REMOVE_PROCESS_SET, RequestType.JOIN):
                targets = range(self.size)
            else:
                state = self.sets.get(response.process_set_id)
                targets = state.ranks if state is not None else range(self.size)
            for r in targets:
                out.setdefault(r, ([], []))[0].append(response)
        for r, notices in self._evictions.items():
            if notices:
                out.setdefault(r, ([], []))[1].extend(notices)
        self._evictions.clear()
        for r in out:
            self._sent_seq[r] += 1
        return out

    def _fuse(self, ready: list[_Ready]) -> list[Response]:
        """Turn the ready items into responses, in order (see :meth:`_group`)."""
        result = []
        for group in self._group(ready):
            if type(group) is not list:
                result.append(group)
                continue
            fused = self._fused_response(group)
            if group[1][0][3] is not None:
                self._reduce_inline(fused, group[1])
            result.append(fused)
        return result

    def _group(self, ready: list[_Ready]) -> list:
        """Responses, and groups ``[bytes, items, prototype response, only cache hits]``: allreduces of one
        kind (set, dtype, op, factors, and whether the coordinator reduces them) are fused up to the
        threshold; a group made only of cache hits keeps its ids so that it travels compactly."""
        order: list = []
        open_groups: dict[tuple, list] = {}
        threshold = self.fusion_threshold
        for item in ready:
            response, entry, cid, data = item
            if entry is not None:
                if not entry.fusable:  # a cached broadcast, allgather...: alone, still compact
                    order.append(_compact(entry.response, [-2], [cid]))
                    continue
                key = entry.key if data is None else entry.key_inline
                nbytes = entry.nbytes
                response = entry.response
            else:
                if response.type not in _FUSABLE:
                    order.append(response)
                    continue
                key = _fusion_key(response) if data is None else (*_fusion_key(response), True)
                nbytes = response.nbytes()
            group = open_groups.get(key)
            if group is not None and group[0] + nbytes <= threshold:
                group[0] += nbytes
                group[1].append(item)
                if entry is None:
                    group[3] = False
            else:
                group = [nbytes, [item], response, entry is not None]
                if threshold > 0:
                    open_groups[key] = group
                order.append(group)
        return order

    @staticmethod
    def _fused_response(group: list) -> Response:
        """The response of one group of :meth:`_group` (without the coordinator-reduced data)."""
        _, items, proto, only_hits = group
        if only_hits:
            names = [item[1].name for item in items]
            shapes = [item[1].shape for item in items]
            cache_ids = [-2] * len(items)  # already cached everywhere
            cached_ids = [item[2] for item in items]
        else:
            names, shapes, cache_ids, cached_ids = [], [], [], []
            for response, entry, _, _ in items:
                if entry is not None:
                    names.append(entry.name)
                    shapes.append(entry.shape)
                    cache_ids.append(-2)
                else:
                    names.extend(response.names)
                    shapes.extend(response.shapes)
                    cache_ids.extend(response.cache_ids or [-1])
        return Response(proto.type, proto.process_set_id, names, proto.dtype, shapes, proto.root_rank,
                        proto.reduce_op, proto.prescale, proto.postscale, cache_ids=cache_ids,
                        cached_ids=cached_ids)

    def seq_for(self, rank: int) -> int:
        return self._sent_seq[rank]

    # ------------------------------------------------------------------ failures and liveness
    def report(self, rank: int, reason: str, now: float | None = None, suspect: int | None = None) -> None:
        """A rank's shutdown notice; a failed collective goes through :meth:`settle` first.

        When a rank stops inside a collective, every member waiting for it times out, and a member that waits
        for one of *those* (a ring, a chain) may time out too -- even first, when the one in the middle was
        still draining buffered data -- and blame a live rank.  So a report is believed at once only when its
        suspect did not complain itself and is not alive (silent or gone); otherwise the reports are
        collected until one is, or for ``failure_wait`` seconds at most.
        """
        if self.shutdown_reason is not None:
            return
        match = _FAILURE.match(reason)
        if match is None and not self._failures:
            self.shutdown_reason = reason
            return
        if not self._failures:
            self._failures_since = time.monotonic() if now is None else now
        if match is not None and match.group(2) is not None:
            suspect = int(match.group(2))
        self._failures.append((rank, suspect, reason))

    def peer_lost(self, rank: int, reason: str) -> None:
        """``rank``'s control connection closed or it went silent: it is the suspect, unless it reported a
        failure itself (then it is just exiting)."""
        if all(r != rank for r, _, _ in self._failures):
            self.report(-1, reason, suspect=rank)

    @property
    def failures_pending(self) -> bool:
        return self.shutdown_reason is None and bool(self._failures)

    def settle(self, now: float | None = None, alive: Callable[[int], bool] | None = None) -> None:
        """Turn the collected failure reports into the shutdown reason once one is believable or they are old.

        ``alive(rank)``: whether the rank still sends keep-alives (the engine knows); without it every rank
        counts as not alive.
        """
        if not self.failures_pending:
            return
        now = time.monotonic() if now is None else now
        complainers = {r for r, _, _ in self._failures if r >= 0}
        suspects = [(s, reason) for _, s, reason in self._failures if s is not None and s not in complainers]
        chosen = next((reason for s, reason in suspects if alive is None or not alive(s)), None)
        waited = now - self._failures_since
        if chosen is None:
            if waited < self.failure_settle or (suspects and waited < self.failure_wait):
                return  # a suspect that is alive probably waits for someone else: let it report
            chosen = suspects[0][1] if suspects else self._failures[0][2]
        self.shutdown_reason = chosen
        if len(self._failures) > 1:
            log.error("collective failures reported: %s; cause: %s",
                      "; ".join(r for _, _, r in self._failures), self.shutdown_reason)

    def waiting_on(self) -> set[int]:
        """Ranks whose requests some pending tensor still lacks (and that have not joined)."""
        missing: set[int] = set()
        if self._parked is not None:
            missing.update(self._parked.members.difference(self._parked.arrived))
        for state in self.sets.values():
            for pending in state.pending.values():
                missing.update(r for r in state.ranks if r not in pending.requests and r not in self.joined)
        return missing

    # ------------------------------------------------------------------ stall inspector
    def check_stalls(self, now: float | None = None) -> str | None:
        """Warn about tensors some ranks are waiting on; return a shutdown reason past the deadline."""
        if self.stall_disable or self.stall_warning <= 0:
            return None
        now = time.monotonic() if now is None else now
        if now - self._last_stall_check < min(self.stall_warning, 1.0):
            return None
        self._last_stall_check = now
        if self._parked is not None and now - self._parked.since >= self.stall_warning:
            self._unpark()  # the inspector reads the general path's pending tensors
        missing: dict[int, list[str]] = collections.defaultdict(list)
        waits: dict[int, list[str]] = collections.defaultdict(list)  # stalled tensors each rank did submit
        overdue: set[int] = set()
        for state in self.sets.values():
            for name, pending in state.pending.items():
                waited = now - pending.first_seen
                if waited < self.stall_warning:
                    continue
                for r in state.ranks:
                    if r in pending.requests:
                        waits[r].append(name)
                    elif r not in self.joined:
                        missing[r].append(name)
                        if self.stall_warning <= self.stall_shutdown <= waited:
                            overdue.add(r)
        if not missing:
            return None
        lines = [
            "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and "
            f"are waiting for remainder of ranks for more than {int(self.stall_warning)} seconds. This may "
            "indicate that different ranks are trying to submit different tensors or that only subset of "
            "ranks is submitting tensors, which will cause deadlock. ",
            "Missing ranks:",
        ]
        for r in sorted(missing):
            names = missing[r][:6]
            more = " ..." if len(missing[r]) > 6 else ""
            lines.append(f"{r}{'!' if r in overdue else ''}: [{', '.join(names)}]{more}")
        if overdue:
            lines.append(f'One or more rank (marked by "!") is stalled for longer than '
                         f"{int(self.stall_shutdown)} seconds. Will shutdown.")
            log.error("\n".join(lines))
            if all(r in waits for r in overdue):
                return mismatched_collectives(self.stall_shutdown, {r: (missing[r], waits[r]) for r in overdue})
            detail = "; ".join(f"rank {r} never submitted {missing[r][:6]}" for r in sorted(overdue))
            return f"stall deadline of {int(self.stall_shutdown)} s passed: {detail}"
        log.warning("\n".join(lines))
        self._last_stall_check = now + self.stall_warning - min(self.stall_warning, 1.0)
        return None
