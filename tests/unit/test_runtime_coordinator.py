"""The coordinator without processes: readiness, process sets, join, fusion, response cache, stall inspector."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pytest

from horovod.base.reduce_ops import ReduceOp
from horovod.runtime.coordinator import EVICTION_WARNING, Coordinator
from horovod.runtime.messages import Request, RequestType, dtype_code

F32 = dtype_code(np.float32)
F64 = dtype_code(np.float64)
I32 = dtype_code(np.int32)


def make(size=2, sets=None, capacity=1024, threshold=1 << 20, **kw):
    sets = sets if sets is not None else {0: list(range(size))}
    return Coordinator(size, sets, cache_capacity=capacity, fusion_threshold=threshold, **kw)


def ar(name, shape=(4,), dtype=F32, ps=0, op=ReduceOp.SUM, pre=1.0, post=1.0):
    return Request(RequestType.ALLREDUCE, ps, name, dtype, tuple(shape), -1, op, pre, post)


def ag(name, rows, ps=0):
    return Request(RequestType.ALLGATHER, ps, name, F32, (rows, 2))


def bc(name, root=0, ps=0):
    return Request(RequestType.BROADCAST, ps, name, F32, (3,), root)


def join_req():
    return Request(RequestType.JOIN, 0, "join.noname")


def submit_all(c, requests_by_rank, ack=0):
    """Each rank submits its own copies (the coordinator stamps the sender's rank into a request)."""
    for rank, reqs in requests_by_rank.items():
        reqs = reqs if isinstance(reqs, list) else [reqs]
        c.submit(rank, ack, None, [dataclasses.replace(r) for r in reqs], [])


def hit(ps, cid):
    """One cache-hit entry of a worker's batch: (set id, cache id, inline blob index)."""
    return (ps, cid, -1)


def hits(c, ranks, ps, cid, ack=0):
    for r in ranks:
        c.submit(r, ack, None, [], [hit(ps, cid)])


def responses(out, rank):
    return out.get(rank, ([], []))[0]


def names(out, rank):
    return [tuple(r.names) for r in responses(out, rank)]


# ------------------------------------------------------------------------------------------------ readiness
def test_ready_only_when_every_rank_submitted():
    c = make(size=3)
    c.submit(0, 0, None, [ar("x")], [])
    c.submit(2, 0, None, [ar("x")], [])
    assert c.take_responses() == {}
    c.submit(1, 0, None, [ar("x")], [])
    out = c.take_responses()
    assert set(out) == {0, 1, 2}
    for r in range(3):
        [resp] = responses(out, r)
        assert resp.type == RequestType.ALLREDUCE and resp.names == ["x"] and resp.shapes == [(4,)]
    assert c.take_responses() == {}


def test_every_rank_gets_the_same_order():
    c = make(size=2, threshold=0)
    c.submit(0, 0, None, [ar("a"), ar("b"), bc("c")], [])
    c.submit(1, 0, None, [bc("c"), ar("b"), ar("a")], [])
    out = c.take_responses()
    assert names(out, 0) == names(out, 1)
    assert sorted(names(out, 0)) == [("a",), ("b",), ("c",)]


def test_mismatch_becomes_error_for_every_member():
    c = make(size=2)
    c.submit(0, 0, None, [ar("x", dtype=F32)], [])
    c.submit(1, 0, None, [ar("x", dtype=I32)], [])
    out = c.take_responses()
    for r in (0, 1):
        [resp] = responses(out, r)
        assert resp.type == RequestType.ERROR
        assert resp.error == "Mismatched data types: One rank had type float32, but another rank had type int32."


def test_process_set_membership():
    c = make(size=3, sets={0: [0, 1, 2], 1: [0, 2], 2: [1]})
    c.submit(0, 0, None, [ar("s1", ps=1)], [])
    assert c.take_responses() == {}
    c.submit(1, 0, None, [ar("s2", ps=2)], [])  # a one-member set is ready at once
    out = c.take_responses()
    assert set(out) == {1}
    assert responses(out, 1)[0].process_set_id == 2
    c.submit(2, 0, None, [ar("s1", ps=1)], [])
    out = c.take_responses()
    assert set(out) == {0, 2}
    assert responses(out, 0)[0].process_set_id == 1


def test_same_name_in_two_sets_is_two_tensors():
    c = make(size=2, sets={0: [0, 1], 1: [0, 1]})
    c.submit(0, 0, None, [ar("x", ps=0), ar("x", ps=1)], [])
    c.submit(1, 0, None, [ar("x", ps=1)], [])
    out = c.take_responses()
    assert [(r.process_set_id, r.names) for r in responses(out, 1)] == [(1, ["x"])]
    c.submit(1, 0, None, [ar("x", ps=0)], [])
    out = c.take_responses()
    assert [(r.process_set_id, r.names) for r in responses(out, 1)] == [(0, ["x"])]


def test_unknown_process_set_errors_only_for_the_sender():
    c = make(size=2)
    c.submit(1, 0, None, [ar("x", ps=7)], [])
    out = c.take_responses()
    assert set(out) == {1}
    [resp] = responses(out, 1)
    assert resp.type == RequestType.ERROR
    assert "Process set provided does not exist, or has not been registered." in resp.error


def test_allgather_response_carries_each_ranks_rows():
    c = make(size=3)
    c.submit(1, 0, None, [ag("g", 5)], [])
    c.submit(0, 0, None, [ag("g", 1)], [])
    c.submit(2, 0, None, [ag("g", 0)], [])
    out = c.take_responses()
    assert responses(out, 2)[0].rank_dims == [[1, 5, 0]]


def test_barrier_and_never_cached():
    c = make(size=2)
    for _ in range(2):
        submit_all(c, {0: Request(RequestType.BARRIER, 0, "barrier.noname"),
                       1: Request(RequestType.BARRIER, 0, "barrier.noname")})
        out = c.take_responses()
        [resp] = responses(out, 0)
        assert resp.type == RequestType.BARRIER
        assert resp.cache_ids in ([], [-1])


# ------------------------------------------------------------------------------------------------ join
def test_join_lowers_the_threshold_and_reports_last_joined_rank():
    c = make(size=3)
    c.submit(2, 0, None, [join_req()], [])
    c.submit(0, 0, None, [ar("x")], [])
    assert c.take_responses() == {}
    c.submit(1, 0, None, [ar("x")], [])
    out = c.take_responses()
    assert set(out) == {0, 1, 2}  # the joined rank executes with zeros
    assert responses(out, 2)[0].type == RequestType.ALLREDUCE
    assert responses(out, 2)[0].shapes == [(4,)]
    c.submit(0, 0, None, [join_req()], [])
    assert c.take_responses() == {}
    c.submit(1, 0, None, [join_req()], [])
    out = c.take_responses()
    assert set(out) == {0, 1, 2}
    for r in range(3):
        [resp] = responses(out, r)
        assert resp.type == RequestType.JOIN
        assert resp.last_joined_rank == 1
    assert c.joined == set()


def test_join_releases_a_tensor_already_waiting():
    c = make(size=2)
    c.submit(0, 0, None, [ar("x")], [])
    assert c.take_responses() == {}
    c.submit(1, 0, None, [join_req()], [])
    out = c.take_responses()
    assert [r.type for r in responses(out, 1)] == [RequestType.ALLREDUCE]


def test_last_joined_rank_is_the_last_one():
    c = make(size=3)
    for r in (1, 0, 2):
        c.submit(r, 0, None, [join_req()], [])
    out = c.take_responses()
    assert responses(out, 0)[0].last_joined_rank == 2


def test_allgather_while_joined_is_an_error():
    c = make(size=2)
    c.submit(1, 0, None, [join_req()], [])
    c.submit(0, 0, None, [ag("g", 2)], [])
    out = c.take_responses()
    [resp] = responses(out, 0)
    assert resp.type == RequestType.ERROR
    assert resp.error.startswith("Allgather is not supported with Join at this time.")


def test_join_again_after_a_completed_join():
    c = make(size=2)
    submit_all(c, {0: join_req(), 1: join_req()})
    assert responses(c.take_responses(), 0)[0].last_joined_rank == 1
    submit_all(c, {0: ar("y"), 1: ar("y")})
    assert responses(c.take_responses(), 0)[0].type == RequestType.ALLREDUCE
    c.submit(1, 0, None, [join_req()], [])
    c.submit(0, 0, None, [join_req()], [])
    assert responses(c.take_responses(), 1)[0].last_joined_rank == 0


# ------------------------------------------------------------------------------------------------ fusion
def test_fusion_by_threshold():
    c = make(size=2, threshold=40)  # 10 float32 = 40 bytes
    reqs = [ar(n, shape=(5,)) for n in "abcde"]  # 20 bytes each
    submit_all(c, {0: reqs, 1: reqs})
    out = c.take_responses()
    assert names(out, 0) == [("a", "b"), ("c", "d"), ("e",)]
    fused = responses(out, 0)[0]
    assert fused.shapes == [(5,), (5,)]
    assert len(fused.cache_ids) == 2
    assert names(out, 1) == names(out, 0)


def test_fusion_only_of_compatible_responses():
    c = make(size=2, threshold=1 << 20)
    reqs = [ar("f32a"), ar("f64", dtype=F64), ar("f32b"), ar("avg", op=ReduceOp.AVERAGE), ar("pre", pre=2.0),
            ar("post", post=2.0), ar("f32c"), bc("bcast"), ar("avg2", op=ReduceOp.AVERAGE)]
    submit_all(c, {0: reqs, 1: reqs})
    groups = names(c.take_responses(), 0)
    assert ("f32a", "f32b", "f32c") in groups
    assert ("avg", "avg2") in groups
    for single in ("f64", "pre", "post", "bcast"):
        assert (single,) in groups
    assert sorted(n for g in groups for n in g) == sorted(r.name for r in reqs)


def test_fusion_never_crosses_process_sets_or_types():
    c = make(size=2, sets={0: [0, 1], 1: [0, 1]})
    reqs = [ar("a", ps=0), ar("b", ps=1), bc("c"), bc("d"), ag("e", 1), ag("f", 1)]
    submit_all(c, {0: reqs, 1: reqs})
    groups = names(c.take_responses(), 0)
    assert sorted(groups) == [("a",), ("b",), ("c",), ("d",), ("e",), ("f",)]


def test_fusion_disabled_by_zero_threshold():
    c = make(size=2, threshold=0)
    reqs = [ar(n) for n in "abc"]
    submit_all(c, {0: reqs, 1: reqs})
    assert names(c.take_responses(), 0) == [("a",), ("b",), ("c",)]


def test_tensor_bigger_than_threshold_goes_alone():
    c = make(size=2, threshold=16)
    reqs = [ar("big", shape=(100,)), ar("s1", shape=(2,)), ar("s2", shape=(2,))]
    submit_all(c, {0: reqs, 1: reqs})
    assert names(c.take_responses(), 0) == [("big",), ("s1", "s2")]


# ------------------------------------------------------------------------------------------------ cache
def test_cache_ids_assigned_and_all_hit_fast_path():
    c = make(size=2, threshold=0)
    submit_all(c, {0: ar("x"), 1: ar("x")})
    [resp] = responses(c.take_responses(), 0)
    [cid] = resp.cache_ids
    assert cid >= 0
    submit_all(c, {0: ar("y"), 1: ar("y")})
    [resp_y] = responses(c.take_responses(), 1)
    assert resp_y.cache_ids[0] not in (cid, -1, -2)
    # all ranks hit -> the cached response is reused, flagged as already cached
    hits(c, [0, 1], 0, cid, ack=2)
    out = c.take_responses()
    for r in (0, 1):
        [again] = responses(out, r)
        assert again.type == RequestType.ALLREDUCE and again.names == ["x"] and again.shapes == [(4,)]
        assert again.cache_ids == [-2]


def test_partial_hits_wait_for_everyone():
    c = make(size=3)
    submit_all(c, {r: ar("x") for r in range(3)})
    cid = responses(c.take_responses(), 0)[0].cache_ids[0]
    hits(c, [0, 2], 0, cid, ack=1)
    assert c.take_responses() == {}
    hits(c, [1], 0, cid, ack=1)
    assert names(c.take_responses(), 1) == [("x",)]


def test_hit_and_full_request_mix_rebuilds():
    c = make(size=2)
    submit_all(c, {0: ar("x"), 1: ar("x")})
    cid = responses(c.take_responses(), 0)[0].cache_ids[0]
    hits(c, [0], 0, cid, ack=1)
    c.submit(1, 1, None, [ar("x")], [])  # same parameters, but rank 1 sent a full request
    out = c.take_responses()
    [resp] = responses(out, 0)
    assert resp.type == RequestType.ALLREDUCE


def test_noname_and_partial_responses_are_not_cached():
    c = make(size=2)
    submit_all(c, {0: ar("allreduce.noname.1"), 1: ar("allreduce.noname.1")})
    assert responses(c.take_responses(), 0)[0].cache_ids in ([], [-1])
    c.submit(0, 0, None, [join_req()], [])
    c.submit(1, 0, None, [ar("z")], [])
    resp = [r for r in responses(c.take_responses(), 1) if r.type == RequestType.ALLREDUCE][0]
    assert resp.cache_ids in ([], [-1])


def test_full_request_for_cached_name_evicts_it():
    c = make(size=2)
    submit_all(c, {0: ar("x"), 1: ar("x")})
    cid = responses(c.take_responses(), 0)[0].cache_ids[0]
    submit_all(c, {0: ar("x", shape=(8,)), 1: ar("x", shape=(8,))}, ack=1)  # parameters changed
    out = c.take_responses()
    for r in (0, 1):
        resps, evicted = out[r]
        assert (0, cid) in evicted
        assert resps[0].shapes == [(8,)]
        new_cid = resps[0].cache_ids[0]
        assert new_cid >= 0 and new_cid != cid  # ids are never reused


def test_graveyard_resolves_a_hit_racing_an_eviction():
    c = make(size=2, capacity=1, threshold=0)
    submit_all(c, {0: ar("a"), 1: ar("a")})
    cid_a = responses(c.take_responses(), 0)[0].cache_ids[0]
    submit_all(c, {0: ar("b"), 1: ar("b")}, ack=1)  # capacity 1: "a" is evicted
    out = c.take_responses()
    assert (0, cid_a) in out[0][1] and (0, cid_a) in out[1][1]
    # Rank 1 sent a hit for "a" before it read the eviction notice; rank 0 already knows and sends a
    # full request.  The hit resolves through the graveyard and the tensor completes normally.
    hits(c, [1], 0, cid_a, ack=1)
    c.submit(0, 2, None, [ar("a")], [])
    out = c.take_responses()
    assert c.shutdown_reason is None
    for r in (0, 1):
        [resp] = [x for x in responses(out, r) if x.names == ["a"]]
        assert resp.type == RequestType.ALLREDUCE


def test_graveyard_is_collected_once_every_member_acknowledged():
    c = make(size=2, capacity=1, threshold=0)
    submit_all(c, {0: ar("a"), 1: ar("a")})
    cid_a = responses(c.take_responses(), 0)[0].cache_ids[0]
    submit_all(c, {0: ar("b"), 1: ar("b")}, ack=1)
    c.take_responses()  # frame 2 carries the eviction notice
    notice = c.seq_for(1)
    assert cid_a in c.sets[0].graveyard
    c.submit(0, notice, None, [], [])
    assert cid_a in c.sets[0].graveyard
    c.submit(1, notice, None, [], [])
    assert cid_a not in c.sets[0].graveyard
    # A hit on a collected id is a protocol error that shuts the job down with a reason.
    hits(c, [1], 0, cid_a, ack=notice)
    assert c.shutdown_reason is not None and "rank 1" in c.shutdown_reason


def test_lru_eviction_and_single_warning(caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runtime.coordinator")
    c = make(size=2, capacity=2, threshold=0)
    ids = {}
    for n in ("a", "b"):
        submit_all(c, {0: ar(n), 1: ar(n)})
        ids[n] = responses(c.take_responses(), 0)[0].cache_ids[0]
    hits(c, [0, 1], 0, ids["a"], ack=2)  # "a" is now the most recently used
    c.take_responses()
    submit_all(c, {0: ar("c"), 1: ar("c")}, ack=3)
    out = c.take_responses()
    assert out[0][1] == [(0, ids["b"])]  # least recently used goes first
    submit_all(c, {0: ar("d"), 1: ar("d")}, ack=4)
    out = c.take_responses()
    assert out[0][1] == [(0, ids["a"])]
    warnings = [r for r in caplog.records if r.getMessage() == EVICTION_WARNING]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING


def test_eviction_warning_text():
    assert EVICTION_WARNING == (
        "A response has been evicted from cache which may indicate reduced performance. Better performance may "
        "be obtained by disabling caching (HOROVOD_CACHE_CAPACITY=0) or increasing the cache capacity "
        "(HOROVOD_CACHE_CAPACITY>1024).")


def test_cache_disabled():
    c = make(size=2, capacity=0)
    submit_all(c, {0: ar("x"), 1: ar("x")})
    assert responses(c.take_responses(), 0)[0].cache_ids in ([], [-1])


def test_cached_hits_fused_together():
    c = make(size=2)
    reqs = [ar("p"), ar("q")]
    submit_all(c, {0: reqs, 1: reqs})
    [fused] = responses(c.take_responses(), 0)
    cids = fused.cache_ids
    assert len(cids) == 2 and all(x >= 0 for x in cids)
    for r in (0, 1):
        c.submit(r, 1, None, [], [hit(0, cids[0]), hit(0, cids[1])])
    [again] = responses(c.take_responses(), 0)
    assert again.names == ["p", "q"]


# ------------------------------------------------------------------------------------------------ stalls
STALL_HEAD = (
    "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting "
    "for remainder of ranks for more than 60 seconds. This may indicate that different ranks are trying to submit "
    "different tensors or that only subset of ranks is submitting tensors, which will cause deadlock. \n"
    "Missing ranks:\n")


def test_stall_warning_text(caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runtime.coordinator")
    c = make(size=3, stall_warning=60.0, stall_shutdown=0.0)
    c.submit(0, 0, None, [ar("tensor_a"), ar("tensor_b")], [])
    c.submit(2, 0, None, [ar("tensor_a")], [])
    assert c.check_stalls(now=time.monotonic() + 10) is None
    assert not caplog.records
    assert c.check_stalls(now=time.monotonic() + 61) is None
    [record] = [r for r in caplog.records if "Missing ranks" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == STALL_HEAD + "1: [tensor_a, tensor_b]\n2: [tensor_b]"


def test_stall_warning_lists_at_most_six_names(caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runtime.coordinator")
    c = make(size=2, stall_warning=60.0, stall_shutdown=0.0)
    c.submit(0, 0, None, [ar(f"t{i}") for i in range(8)], [])
    c.check_stalls(now=time.monotonic() + 61)
    [record] = [r for r in caplog.records if "Missing ranks" in r.getMessage()]
    assert record.getMessage().endswith("\n1: [t0, t1, t2, t3, t4, t5] ...")


def test_stall_shutdown_names_missing_ranks_and_tensors(caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runtime.coordinator")
    c = make(size=3, stall_warning=60.0, stall_shutdown=120.0)
    c.submit(0, 0, None, [ar("grad.w")], [])
    c.submit(1, 0, None, [ar("grad.w")], [])
    assert c.check_stalls(now=time.monotonic() + 61) is None  # warning only
    reason = c.check_stalls(now=time.monotonic() + 200)
    assert reason is not None
    assert "rank 2" in reason and "grad.w" in reason
    [record] = [r for r in caplog.records if "Will shutdown" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (STALL_HEAD + "2!: [grad.w]\n"
                                   'One or more rank (marked by "!") is stalled for longer than 120 seconds. '
                                   "Will shutdown.")


def test_stall_of_ranks_that_each_wait_for_a_collective_the_others_never_submitted_is_a_mismatch():
    """Rank 0 in a broadcast only it runs (an elastic ``state.commit()`` under ``if hvd.rank() == 0``), rank 1
    in the next step's allreduce: neither is slow or hung, each waits for the other.  The shutdown reason says
    so (mismatched collectives: a program error, PreconditionError on every rank, no elastic reset)."""
    c = make(size=2, stall_warning=60.0, stall_shutdown=120.0)
    c.submit(0, 0, None, [bc("broadcast_object.noname.2.sz")], [])
    c.submit(1, 0, None, [ar("grad")], [])
    reason = c.check_stalls(now=time.monotonic() + 200)
    assert reason == (
        "Mismatched collectives: the ranks submitted different collectives and waited for each other for the "
        "stall deadline (120 s): rank 0 never submitted ['grad'] and waits for ['broadcast_object.noname.2.sz']; "
        "rank 1 never submitted ['broadcast_object.noname.2.sz'] and waits for ['grad']. Every rank must submit "
        "the same collectives (a collective, or a call that runs one such as an elastic state.commit(), on some "
        "ranks only -- e.g. under `if hvd.rank() == 0:` -- waits forever); this is an error in the program, which "
        "an elastic reset cannot cure.")


def test_stall_with_a_rank_that_submitted_nothing_stays_a_plain_stall():
    """A rank that waits for nothing (hung, or busy for longer than the deadline) may be a fault: the reason
    stays the recoverable stall's, also when two other ranks disagree meanwhile."""
    c = make(size=3, stall_warning=60.0, stall_shutdown=120.0)
    c.submit(0, 0, None, [ar("x")], [])
    c.submit(1, 0, None, [ar("y")], [])
    reason = c.check_stalls(now=time.monotonic() + 200)
    assert reason is not None and reason.startswith("stall deadline of 120 s passed: rank 0 never submitted"), reason
    c = make(size=2, stall_warning=60.0, stall_shutdown=120.0)
    c.submit(0, 0, None, [ar("x")], [])
    assert c.check_stalls(now=time.monotonic() + 200) == "stall deadline of 120 s passed: rank 1 never submitted ['x']"


def test_stall_ignores_joined_ranks_and_complete_tensors():
    c = make(size=3, stall_warning=60.0, stall_shutdown=61.0)
    c.submit(2, 0, None, [join_req()], [])
    c.submit(0, 0, None, [ar("x")], [])
    submit_all(c, {0: ar("done"), 1: ar("done")})
    reason = c.check_stalls(now=time.monotonic() + 100)
    assert reason is not None and "rank 1" in reason and "rank 2" not in reason and "done" not in reason


def test_stall_in_a_process_set_only_names_its_members():
    c = make(size=3, sets={0: [0, 1, 2], 1: [1, 2]}, stall_warning=60.0, stall_shutdown=61.0)
    c.submit(1, 0, None, [ar("sub", ps=1)], [])
    reason = c.check_stalls(now=time.monotonic() + 100)
    assert reason is not None and "rank 2" in reason and "rank 0" not in reason


def test_stall_check_disabled():
    c = make(size=2, stall_warning=60.0, stall_shutdown=61.0, stall_disable=True)
    c.submit(0, 0, None, [ar("x")], [])
    assert c.check_stalls(now=time.monotonic() + 1000) is None


def test_stall_shutdown_less_than_warning_does_not_shut_down(caplog):
    caplog.set_level(logging.WARNING, logger="horovod.runtime.coordinator")
    c = make(size=2, stall_warning=60.0, stall_shutdown=30.0)
    c.submit(0, 0, None, [ar("x")], [])
    assert c.check_stalls(now=time.monotonic() + 1000) is None
    messages = [r.getMessage() for r in caplog.records]
    assert ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, will not "
            "shutdown.") in messages
    stall = [m for m in messages if "Missing ranks" in m]
    assert stall and stall[0].endswith("\n1: [x]"), "no '!' marker when the job will not shut down"


@pytest.mark.parametrize("warning", [60.0, 5.0])
def test_stall_check_interval(caplog, warning):
    caplog.set_level(logging.WARNING, logger="horovod.runtime.coordinator")
    c = make(size=2, stall_warning=warning, stall_shutdown=0.0)
    c.submit(0, 0, None, [ar("x")], [])
    t0 = time.monotonic()
    c.check_stalls(now=t0 + warning + 1)
    c.check_stalls(now=t0 + warning + 1.5)  # too soon: no second warning
    assert len([r for r in caplog.records if "Missing ranks" in r.getMessage()]) == 1
    c.check_stalls(now=t0 + 2 * warning + 2)
    assert len([r for r in caplog.records if "Missing ranks" in r.getMessage()]) == 2


# ------------------------------------------------------------------------------------------------ inline
def _inline(c, rank, name, arr, op=ReduceOp.SUM, pre=1.0, post=1.0):
    req = Request(RequestType.ALLREDUCE, 0, name, dtype_code(arr.dtype), arr.shape, -1, op, pre, post)
    req.inline = 0
    c.submit(rank, 0, None, [req], [], [arr.reshape(-1)])


def test_inline_small_allreduce_is_reduced_by_the_coordinator():
    c = make(size=3)
    xs = [np.array([1.5, -2.0, 3.0], np.float32) * (r + 1) for r in range(3)]
    for r in range(3):
        _inline(c, r, "s", xs[r], op=ReduceOp.SUM, pre=2.0, post=0.5)
    [resp] = responses(c.take_responses(), 1)
    np.testing.assert_allclose(np.asarray(resp.data).reshape(-1), (xs[0] + xs[1] + xs[2]) * 2.0 * 0.5)


def test_inline_integer_average_truncates_and_joined_ranks_count():
    c = make(size=3)
    c.submit(2, 0, None, [join_req()], [])
    _inline(c, 0, "i", np.array([-7, 7, 4], np.int32), op=ReduceOp.AVERAGE)
    _inline(c, 1, "i", np.array([0, 1, 0], np.int32), op=ReduceOp.AVERAGE)
    [resp] = [r for r in responses(c.take_responses(), 0) if r.type == RequestType.ALLREDUCE]
    # (sum of the two contributions) / 3 (the full size), truncated toward zero
    np.testing.assert_array_equal(np.asarray(resp.data).reshape(-1), [-2, 2, 1])


# ------------------------------------------------------------------------------------------------ compact
def test_all_hit_groups_travel_as_their_cache_ids():
    c = make(size=2)
    reqs = [ar(n, shape=(i + 1,)) for i, n in enumerate("abc")]
    submit_all(c, {0: reqs, 1: reqs})
    [first] = responses(c.take_responses(), 0)
    assert first.cached_ids == []  # new entries: every member needs names and shapes
    cids = first.cache_ids
    assert len(cids) == 3 and min(cids) >= 0
    for r in (1, 0):
        c.submit(r, 1, None, [], [(0, cid, -1) for cid in cids])
    out = c.take_responses()
    for r in (0, 1):
        [again] = responses(out, r)
        assert again.cached_ids == cids
        assert again.names == ["a", "b", "c"] and again.shapes == [(1,), (2,), (3,)]
        assert again.cache_ids == [-2, -2, -2]


def test_a_group_with_a_new_request_travels_in_full():
    c = make(size=2)
    submit_all(c, {0: ar("a"), 1: ar("a")})
    [cid] = responses(c.take_responses(), 0)[0].cache_ids
    for r in (0, 1):
        c.submit(r, 1, None, [ar("new")], [(0, cid, -1)])
    [fused] = responses(c.take_responses(), 0)
    assert sorted(fused.names) == ["a", "new"]
    assert fused.cached_ids == []
    assert sorted(fused.cache_ids)[0] == -2 and sorted(fused.cache_ids)[1] >= 0


def test_a_hit_waiting_for_a_rank_that_changed_parameters_is_rebuilt():
    c = make(size=2)
    submit_all(c, {0: ar("a"), 1: ar("a")})
    [cid] = responses(c.take_responses(), 0)[0].cache_ids
    c.submit(0, 1, None, [], [(0, cid, -1)])
    c.submit(1, 1, None, [ar("a", shape=(9,))], [])  # rank 1 changed the shape: a mismatch, not a hit
    [resp] = responses(c.take_responses(), 0)
    assert resp.type == RequestType.ERROR and "Mismatched ALLREDUCE tensor shapes" in resp.error
    assert resp.cached_ids == []


def _inline_batch(c, rank, arrays, ids=None, op=ReduceOp.SUM, pre=1.0, post=1.0):
    """Rank ``rank`` submits ``arrays`` with their bytes (as full requests, or as hits on ``ids``)."""
    blobs = [a.reshape(-1) for a in arrays]
    if ids is None:
        reqs = []
        for i, a in enumerate(arrays):
            req = Request(RequestType.ALLREDUCE, 0, f"t{i}", dtype_code(a.dtype), a.shape, -1, op, pre, post)
            req.inline = i
            reqs.append(req)
        c.submit(rank, 0, None, reqs, [], blobs)
    else:
        c.submit(rank, 1, None, [], [(0, cid, i) for i, cid in enumerate(ids)], blobs)


def test_inline_group_is_reduced_at_once_in_member_order():
    rng = np.random.default_rng(5)
    shapes = [(3,), (2, 2), (), (5,)]
    data = {r: [rng.standard_normal(s).astype(np.float32) for s in shapes] for r in range(3)}
    c = make(size=3)
    for r in (2, 0, 1):
        _inline_batch(c, r, data[r], pre=0.5, post=3.0)
    [resp] = responses(c.take_responses(), 1)
    assert resp.names == ["t0", "t1", "t2", "t3"] and resp.shapes == shapes
    expected = np.concatenate([((data[0][i] * np.float32(0.5) + data[1][i] * np.float32(0.5))
                                + data[2][i] * np.float32(0.5)) * np.float32(3.0) for i in range(4)], axis=None)
    np.testing.assert_array_equal(np.asarray(resp.data).reshape(-1), expected)
    ids = resp.cache_ids
    # the next step: cache hits with their bytes -> one compact response carrying the result
    data2 = {r: [a + 1 for a in data[r]] for r in range(3)}
    for r in (1, 2, 0):
        _inline_batch(c, r, data2[r], ids=ids)
    [again] = responses(c.take_responses(), 2)
    assert again.cached_ids == ids
    expected = np.concatenate([((data2[0][i] * np.float32(0.5) + data2[1][i] * np.float32(0.5))
                                + data2[2][i] * np.float32(0.5)) * np.float32(3.0) for i in range(4)], axis=None)
    np.testing.assert_array_equal(np.asarray(again.data).reshape(-1), expected)


def test_inline_and_data_plane_tensors_never_share_a_response():
    c = make(size=2)
    x = np.arange(4, dtype=np.float32)
    for r in (0, 1):
        inline = Request(RequestType.ALLREDUCE, 0, "small", F32, (4,))
        inline.inline = 0
        c.submit(r, 0, None, [inline, ar("plane")] if r == 0 else [ar("plane"), inline], [], [x])
    out = responses(c.take_responses(), 0)
    assert sorted((tuple(r.names), r.data is not None) for r in out) == [(("plane",), False), (("small",), True)]
    [small] = [r for r in out if r.names == ["small"]]
    np.testing.assert_array_equal(np.asarray(small.data), x * 2)


def test_inline_only_when_every_contributor_sent_its_bytes():
    c = make(size=2)
    x = np.ones(4, np.float32)
    req = Request(RequestType.ALLREDUCE, 0, "half", F32, (4,))
    req.inline = 0
    c.submit(0, 0, None, [req], [], [x])
    c.submit(1, 0, None, [ar("half")], [])  # rank 1 ran out of inline budget: the data plane reduces it
    [resp] = responses(c.take_responses(), 0)
    assert resp.data is None and resp.names == ["half"]


# ------------------------------------------------------------------------------------------------ replay
def _step_batches(c, ranks, data, ids, split=None):
    """Every rank submits this step's hits (inline bytes for the float32 tensors of ``data``); ``split``
    maps a rank to the index at which it splits its batch in two."""
    for r in ranks:
        hits_r = [(0, cid, i if i < len(data[r]) else -1) for i, cid in enumerate(ids)]
        blobs = [a.reshape(-1) for a in data[r]]
        cut = (split or {}).get(r)
        if cut is None:
            c.submit(r, 1, None, [], hits_r, blobs)
        else:
            c.submit(r, 1, None, [], hits_r[:cut], blobs)
            c.submit(r, 1, None, [], [(ps, cid, -1 if b < 0 else b - cut) for ps, cid, b in hits_r[cut:]],
                     blobs[cut:])


def _repeatable(size=3, inline=3, plane=5, threshold=1 << 20):
    """A coordinator that answered a first step of ``inline`` small tensors sent with their bytes and
    ``plane`` data-plane tensors: returns it, the cache ids in submission order and the first responses."""
    c = make(size=size, threshold=threshold)
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(inline + plane):
        req = ar(f"t{i}", shape=(i % 3 + 1, 2))
        req.inline = i if i < inline else -1
        reqs.append(req)
    for r in range(size):
        blobs = [rng.standard_normal(q.shape).astype(np.float32).reshape(-1) for q in reqs[:inline]]
        c.submit(r, 0, None, [dataclasses.replace(q) for q in reqs], [], blobs)
    first = responses(c.take_responses(), 0)
    by_name = {n: cid for resp in first for n, cid in zip(resp.names, resp.cache_ids)}
    return c, [by_name[q.name] for q in reqs], first


def _check_step(out, size, data, ids):
    """Every rank got every tensor once, as compact responses naming the cached ids, and the inline results
    are the sums of this step's bytes."""
    for r in range(size):
        got = responses(out, r)
        assert sorted(cid for resp in got for cid in resp.cached_ids) == sorted(ids)
        inline = [resp for resp in got if resp.data is not None]
        assert len(inline) == 1
        expected = np.concatenate([sum(data[q][i] for q in range(size)) for i in range(len(data[0]))], axis=None)
        np.testing.assert_allclose(np.asarray(inline[0].data).reshape(-1), expected, rtol=1e-6)
        assert inline[0].names == [f"t{i}" for i in range(len(data[0]))]


@pytest.mark.parametrize("size", [2, 3])
def test_a_repeated_batch_is_replayed_with_this_steps_bytes(size):
    c, ids, _ = _repeatable(size=size)
    rng = np.random.default_rng(1)
    general = None
    for step in range(5):
        data = {r: [rng.standard_normal((i % 3 + 1, 2)).astype(np.float32) for i in range(3)] for r in range(size)}
        _step_batches(c, list(range(size))[::-1] if step % 2 else range(size), data, ids)
        out = c.take_responses()
        _check_step(out, size, data, ids)
        shape = [(tuple(r.names), r.shapes, r.cached_ids, r.cache_ids) for r in responses(out, 1)]
        general = general or shape  # the first repeat goes through the general path: the reference
        assert shape == general
    assert len(c._replays) == 1 and c._parked is None  # the later steps were replays


def test_batches_split_differently_across_ranks_still_complete():
    c, ids, _ = _repeatable(size=3)
    rng = np.random.default_rng(2)
    splits = [None, None, {1: 4}, None, {0: 2, 2: 6}, {2: 1}, None]
    for step, split in enumerate(splits):
        data = {r: [rng.standard_normal((i % 3 + 1, 2)).astype(np.float32) for i in range(3)] for r in range(3)}
        _step_batches(c, [2, 0, 1] if step % 2 else [0, 1, 2], data, ids, split)
        out = c.take_responses()
        for r in range(3):
            got = responses(out, r)
            assert sorted(n for resp in got for n in resp.names) == sorted(f"t{i}" for i in range(8)), (step, r)
            inline = np.concatenate([np.asarray(resp.data).reshape(-1) for resp in got if resp.data is not None])
            by_name = [n for resp in got if resp.data is not None for n in resp.names]
            expected = {f"t{i}": sum(data[q][i] for q in range(3)).reshape(-1) for i in range(3)}
            np.testing.assert_allclose(inline, np.concatenate([expected[n] for n in by_name]), rtol=1e-6)
        assert not any(s.pending for s in c.sets.values()) and c._parked is None


def test_a_rank_missing_from_a_replay_is_waited_on_and_named_by_the_stall_inspector(caplog):
    c, ids, _ = _repeatable(size=3)
    data = {r: [np.ones((i % 3 + 1, 2), np.float32) for i in range(3)] for r in range(3)}
    for _ in range(2):
        _step_batches(c, range(3), data, ids)
        c.take_responses()
    t0 = time.monotonic()
    _step_batches(c, [0, 2], data, ids)
    assert c._parked is not None and c.take_responses() == {}
    assert c.waiting_on() == {1}
    with caplog.at_level(logging.WARNING, logger="horovod.runtime.coordinator"):
        c.check_stalls(now=t0 + c.stall_warning + 1)
    [msg] = [r.getMessage() for r in caplog.records if "Missing ranks" in r.getMessage()]
    assert "1: [t0, t1, t2, t3, t4, t5] ..." in msg and "0:" not in msg.split("Missing ranks:")[1]
    _step_batches(c, [1], data, ids)  # the late rank completes the step through the general path
    _check_step(c.take_responses(), 3, data, ids)


def _replay_waiting_for_rank_1(plane: int):
    """Two ranks, ``plane`` tensors: two repeated steps (a replay exists), then rank 0 alone sends the batch."""
    c, ids, _ = _repeatable(size=2, inline=0, plane=plane)
    for _ in range(2):
        _step_batches(c, range(2), {0: [], 1: []}, ids)
        c.take_responses()
    _step_batches(c, [0], {0: [], 1: []}, ids)
    return c, ids


def test_changed_parameters_while_a_replay_waits_are_a_mismatch_for_that_tensor_only():
    c, ids = _replay_waiting_for_rank_1(plane=4)
    assert c._parked is not None
    c.submit(1, 1, None, [ar("t1", shape=(9,))], [(0, cid, -1) for i, cid in enumerate(ids) if i != 1])
    out = responses(c.take_responses(), 1)
    [error] = [r for r in out if r.type == RequestType.ERROR]
    assert error.names == ["t1"] and "Mismatched ALLREDUCE tensor shapes" in error.error
    assert sorted(n for r in out if r.type == RequestType.ALLREDUCE for n in r.names) == ["t0", "t2", "t3"]
    assert not c.sets[0].pending and c._parked is None and not c._replays


def test_a_join_while_a_replay_waits_releases_it():
    c, ids = _replay_waiting_for_rank_1(plane=3)
    c.submit(1, 1, None, [join_req()], [])
    out = responses(c.take_responses(), 0)
    assert sorted(n for r in out for n in r.names) == ["t0", "t1", "t2"]


def test_wrong_inline_size_in_a_repeated_batch_is_a_protocol_error():
    c, ids, _ = _repeatable(size=2)
    data = {r: [np.ones((i % 3 + 1, 2), np.float32) for i in range(3)] for r in range(2)}
    for _ in range(2):
        _step_batches(c, range(2), data, ids)
        c.take_responses()
    bad = {0: data[0], 1: [data[1][0], np.ones(5, np.float32), data[1][2]]}
    _step_batches(c, range(2), bad, ids)
    assert c.shutdown_reason == "protocol error: rank 1 sent a tensor of the wrong size"


def test_a_new_fusion_threshold_refuses_the_replay_built_under_the_old_one():
    c, ids, _ = _repeatable(size=2, inline=0, plane=6)
    for _ in range(3):
        _step_batches(c, range(2), {0: [], 1: []}, ids)
        [resp] = responses(c.take_responses(), 0)
        assert len(resp.names) == 6
    c.fusion_threshold = 2 * 6 * 4  # two (3, 2) float32 tensors: the six no longer fit one response
    for _ in range(3):
        _step_batches(c, range(2), {0: [], 1: []}, ids)
        out = responses(c.take_responses(), 0)
        assert len(out) > 1 and all(r.nbytes() <= c.fusion_threshold for r in out)
        assert sorted(n for r in out for n in r.names) == [f"t{i}" for i in range(6)]


def test_a_replay_in_a_process_set_of_some_ranks():
    c = make(size=3, sets={0: [0, 1, 2], 1: [0, 2]})
    reqs = [ar(f"s{i}", ps=1) for i in range(4)]
    for r in (0, 2):
        c.submit(r, 0, None, [dataclasses.replace(q) for q in reqs], [])
    [first] = responses(c.take_responses(), 0)
    for _ in range(3):
        for r in (2, 0):
            c.submit(r, 1, None, [], [(1, cid, -1) for cid in first.cache_ids])
        out = c.take_responses()
        assert sorted(out) == [0, 2]
        assert [r.cached_ids for r in responses(out, 2)] == [first.cache_ids]
    assert len(c._replays) == 1


# ------------------------------------------------------------------------------------------ grouped sizes
def grouped(base, n, ps=0, shape=(4,), rtype=RequestType.ALLREDUCE):
    """The requests of one grouped call of ``n`` tensors (names as horovod.common.ops builds them)."""
    return [Request(rtype, ps, f"{base}_{i + 1}of{n}", F32, shape, -1, ReduceOp.SUM, group_size=n)
            for i in range(n)]


def group_error(out, rank):
    [resp] = responses(out, rank)
    assert resp.type == RequestType.ERROR
    return sorted(resp.names), resp.error


G3_G2 = ("Mismatched grouped ALLREDUCE sizes for g: rank 0 sent a group of 3 tensors, but rank 1 sent a group of 2 "
         "tensors. Every rank must pass the same number of tensors to a grouped collective of one name.")
ALL5 = sorted([f"g_{i}of3" for i in (1, 2, 3)] + [f"g_{i}of2" for i in (1, 2)])


@pytest.mark.parametrize("first", [0, 1])
def test_group_sizes_that_differ_fail_every_member_at_once(first):
    """Names g_1of3.. and g_1of2.. never match: upstream waits for them forever, the stall inspector here
    until its deadline.  The second rank's batch fails both calls on both ranks with one error."""
    c = make(size=2)
    by_rank = {0: grouped("g", 3), 1: grouped("g", 2)}
    c.submit(first, 0, None, by_rank[first], [])
    assert c.take_responses() == {}
    c.submit(1 - first, 0, None, by_rank[1 - first], [])
    out = c.take_responses()
    for r in (0, 1):
        assert group_error(out, r) == (ALL5, G3_G2)
    assert not c.sets[0].pending and not c.sets[0].groups.names and not c.sets[0].groups.pending
    submit_all(c, {0: grouped("g", 2), 1: grouped("g", 2)})  # the same name agreed on works
    assert [resp.type for resp in responses(c.take_responses(), 1)] == [RequestType.ALLREDUCE]


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (2, 0, 1), (2, 1, 0)])
def test_one_rank_of_three_with_another_group_size(order):
    """The error waits for every member's part, so all three get it for the same call and go on in step."""
    c = make(size=3)
    by_rank = {0: grouped("g", 3), 1: grouped("g", 3), 2: grouped("g", 2)}
    for r in order[:2]:
        c.submit(r, 0, None, by_rank[r], [])
        assert c.take_responses() == {}
    c.submit(order[2], 0, None, by_rank[order[2]], [])
    out = c.take_responses()
    text = ("Mismatched grouped ALLREDUCE sizes for g: ranks 0 and 1 sent a group of 3 tensors, but rank 2 sent a "
            "group of 2 tensors. Every rank must pass the same number of tensors to a grouped collective of one "
            "name.")
    for r in range(3):
        assert group_error(out, r) == (ALL5, text)


def _cached_group(c, base, n, ranks):
    submit_all(c, {r: grouped(base, n) for r in ranks})
    [resp] = responses(c.take_responses(), ranks[0])
    assert min(resp.cache_ids) >= 0
    return resp.cache_ids


@pytest.mark.parametrize("hits_first", [True, False])
def test_group_size_change_on_one_rank_after_cached_steps(hits_first):
    """Rank 0 repeats a cached group (12-byte hits, no group size); rank 1 sends a group of another size.
    The differing size arrives as a full request, whichever comes first; rank 0's hits that raced the eviction
    of the base's entries still count."""
    c = make(size=2)
    cids = _cached_group(c, "g", 3, [0, 1])
    for _ in range(3):  # steps that repeat: the third is a replay
        for r in (0, 1):
            c.submit(r, 1, None, [], [hit(0, cid) for cid in cids])
        assert [resp.cached_ids for resp in responses(c.take_responses(), 0)] == [cids]
    if hits_first:
        c.submit(0, 1, None, [], [hit(0, cid) for cid in cids])
        assert c._parked is not None  # waiting as a replay
        c.submit(1, 1, None, grouped("g", 2), [])
    else:
        c.submit(1, 1, None, grouped("g", 2), [])
        assert c.take_responses()[0][1] == [(0, cid) for cid in cids]  # evicted everywhere
        c.submit(0, 1, None, [], [hit(0, cid) for cid in cids])  # sent before rank 0 read the eviction
    out = c.take_responses()
    for r in (0, 1):
        assert group_error(out, r) == (ALL5, G3_G2)
    assert "g" in c.sets[0].groups.varying and not c.sets[0].groups.cached


def test_names_that_only_look_grouped_are_plain_tensors():
    c = make(size=2)
    c.submit(0, 0, None, [ar("x_1of2"), ar("x_2of2")], [])
    c.submit(1, 0, None, [ar("x_1of3")], [])
    assert c.take_responses() == {}
    c.submit(1, 0, None, [ar("x_1of2"), ar("x_2of2")], [])
    c.submit(0, 0, None, [ar("x_1of3")], [])
    out = c.take_responses()
    assert sorted(n for resp in responses(out, 0) for n in resp.names) == ["x_1of2", "x_1of3", "x_2of2"]
    assert all(resp.type == RequestType.ALLREDUCE for resp in responses(out, 0))


def test_a_group_size_that_changes_on_every_rank_alike_is_no_error():
    """Sizes that vary in step (or calls of two sizes in flight, submitted in the same order everywhere) are
    fine; such a base is no longer cached, so that a later difference still arrives as full requests."""
    c = make(size=2)
    cids = _cached_group(c, "g", 3, [0, 1])
    c.submit(0, 1, None, grouped("g", 2) + grouped("g", 1), [])
    assert c.take_responses()[0][1] == [(0, cid) for cid in cids]  # g_*of3 evicted
    c.submit(1, 1, None, grouped("g", 2), [])
    c.submit(1, 1, None, grouped("g", 1), [])
    out = c.take_responses()
    assert sorted(n for resp in responses(out, 1) for n in resp.names) == ["g_1of1", "g_1of2", "g_2of2"]
    assert all(resp.type == RequestType.ALLREDUCE and set(resp.cache_ids) == {-1} for resp in responses(out, 1))
    submit_all(c, {0: grouped("g", 3), 1: grouped("g", 3)})
    [resp] = responses(c.take_responses(), 0)
    assert resp.type == RequestType.ALLREDUCE and set(resp.cache_ids) == {-1}
    assert not c.sets[0].groups.pending and not c.sets[0].groups.names


def test_a_group_mismatch_waiting_for_a_rank_fails_when_that_rank_joins():
    """Ranks 0 and 1 disagree while rank 2 has not sent its part; rank 2 then joins instead: the error is due
    now (before, nothing rechecked the base and ranks 0 and 1 waited for the stall deadline)."""
    c = make(size=3, sets={0: [0, 1, 2], 1: [0, 1, 2]})
    submit_all(c, {0: grouped("g", 2) + grouped("h", 2, ps=1), 1: grouped("g", 1) + grouped("h", 1, ps=1)})
    assert c.take_responses() == {}
    c.submit(2, 0, None, [join_req()], [])
    out = c.take_responses()
    text = ("Mismatched grouped ALLREDUCE sizes for {}: rank 0 sent a group of 2 tensors, but rank 1 sent a group "
            "of 1 tensor. Every rank must pass the same number of tensors to a grouped collective of one name.")
    for r in range(3):
        got = sorted((resp.process_set_id, sorted(resp.names), resp.error) for resp in responses(out, r))
        assert got == [(0, ["g_1of1", "g_1of2", "g_2of2"], text.format("g")),
                       (1, ["h_1of1", "h_1of2", "h_2of2"], text.format("h"))]
    assert not c.sets[0].pending and not c.sets[1].pending


def test_group_sizes_are_checked_per_process_set():
    c = make(size=3, sets={0: [0, 1, 2], 1: [0, 1]})
    c.submit(0, 0, None, grouped("g", 3, ps=1) + grouped("g", 2, ps=0), [])
    c.submit(1, 0, None, grouped("g", 3, ps=1) + grouped("g", 2, ps=0), [])
    c.submit(2, 0, None, grouped("g", 2, ps=0), [])
    out = c.take_responses()
    assert all(resp.type == RequestType.ALLREDUCE for r in range(3) for resp in responses(out, r))
    c.submit(0, 0, None, grouped("g", 3, ps=1), [])
    c.submit(1, 0, None, grouped("g", 1, ps=1), [])
    out = c.take_responses()
    assert set(out) == {0, 1}
    assert group_error(out, 1)[1].startswith("Mismatched grouped ALLREDUCE sizes for g: rank 0 sent a group of 3 "
                                             "tensors, but rank 1 sent a group of 1 tensor.")


@pytest.mark.parametrize("order", [(0, 2, 1), (2, 0, 1), (1, 0, 2)])
def test_one_rank_of_three_changes_a_cached_group_size(order):
    c = make(size=3)
    cids = _cached_group(c, "g", 3, [0, 1, 2])
    parts = {0: ([], [hit(0, cid) for cid in cids]), 1: ([], [hit(0, cid) for cid in cids]),
             2: (grouped("g", 2), [])}
    for r in order:
        c.submit(r, 1, None, *parts[r])
    out = c.take_responses()
    for r in range(3):
        assert group_error(out, r)[1].startswith("Mismatched grouped ALLREDUCE sizes for g: ranks 0 and 1 sent a "
                                                 "group of 3 tensors, but rank 2 sent a group of 2 tensors.")
