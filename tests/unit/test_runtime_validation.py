"""Every coordinator error text of HOROVOD_SPEC §2.6, produced by ``build_response``, checked verbatim."""

from __future__ import annotations

import numpy as np
import pytest

from horovod.base.reduce_ops import ReduceOp
from horovod.runtime.group_check import group_base, group_size_error, group_sizes_disagree
from horovod.runtime.messages import Request, RequestType, dtype_code
from horovod.runtime.validation import build_response, process_set_ranks_error, shape_str

F32 = dtype_code(np.float32)
I32 = dtype_code(np.int32)
MEMBERS = [0, 1, 2]


def req(rank, rtype=RequestType.ALLREDUCE, *, name="t", dtype=F32, shape=(17, 17), root=-1, op=ReduceOp.SUM, pre=1.0,
        post=1.0, splits=(), device=-1, ps=0):
    return Request(rtype, ps, name, dtype, tuple(shape), root, op, pre, post, -1, tuple(splits), device, rank)


def error_of(requests, members=MEMBERS, joined=()):
    resp = build_response(requests, members, set(joined))
    assert resp.type == RequestType.ERROR, f"expected an error, got {resp}"
    assert resp.names == [requests[0].name]
    return resp.error


def ok(requests, members=MEMBERS, joined=()):
    resp = build_response(requests, members, set(joined))
    assert resp.type != RequestType.ERROR, resp.error
    return resp


def test_shape_str():
    assert shape_str((17, 18)) == "[17, 18]"
    assert shape_str(()) == "[]"
    assert shape_str((5,)) == "[5]"


def test_mismatched_dtypes():
    assert error_of([req(0), req(1, dtype=I32), req(2)]) == \
        "Mismatched data types: One rank had type float32, but another rank had type int32."


@pytest.mark.parametrize("name", ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32",
                                  "float64", "bool"])
def test_dtype_names_in_error(name):
    other = "float64" if name != "float64" else "float32"
    text = error_of([req(0, dtype=dtype_code(np.dtype(name))), req(1, dtype=dtype_code(np.dtype(other)))],
                    members=[0, 1])
    assert text == f"Mismatched data types: One rank had type {name}, but another rank had type {other}."


def test_mismatched_operations():
    assert error_of([req(0), req(1, RequestType.ALLGATHER), req(2)]) == \
        "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."


def test_mismatched_operations_broadcast_alltoall():
    assert error_of([req(0, RequestType.BROADCAST, root=0), req(1, RequestType.ALLTOALL)], members=[0, 1]) == \
        "Mismatched operations: One rank did an BROADCAST, but another rank did an ALLTOALL."


@pytest.mark.parametrize("rtype", [RequestType.ALLREDUCE, RequestType.BROADCAST, RequestType.REDUCESCATTER])
def test_mismatched_shapes(rtype):
    root = 0 if rtype == RequestType.BROADCAST else -1
    text = error_of([req(0, rtype, root=root), req(1, rtype, shape=(17, 18), root=root), req(2, rtype, root=root)])
    assert text == (f"Mismatched {rtype.name} tensor shapes: One rank sent a tensor of shape [17, 17], but "
                    "another rank sent a tensor of shape [17, 18].")


def test_mismatched_scale_factors():
    text = error_of([req(0, pre=0.5, post=2.0), req(1, pre=0.25, post=2.0), req(2, pre=0.5, post=2.0)])
    assert text == ("Mismatched prescale and/or postscale factors: One rank sent factors (0.5, 2), but another "
                    "rank sent factors (0.25, 2).")


def test_mismatched_scale_factors_reducescatter():
    text = error_of([req(0, RequestType.REDUCESCATTER), req(1, RequestType.REDUCESCATTER, post=3.0)],
                    members=[0, 1])
    assert text == ("Mismatched prescale and/or postscale factors: One rank sent factors (1, 1), but another "
                    "rank sent factors (1, 3).")


def test_mismatched_reduce_op():
    assert error_of([req(0, op=ReduceOp.SUM), req(1, op=ReduceOp.AVERAGE), req(2, op=ReduceOp.SUM)]) == \
        "Mismatched reduction operation: One rank sent reduction op 1, but another rank sent reduction op 0."


def test_allgather_with_join():
    text = error_of([req(0, RequestType.ALLGATHER), req(1, RequestType.ALLGATHER)], joined=[2])
    assert text == ("Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using "
                    "DistributedOptimizer")


def test_alltoall_with_join():
    text = error_of([req(0, RequestType.ALLTOALL, splits=(17, 0, 0)),
                     req(1, RequestType.ALLTOALL, splits=(17, 0, 0))], joined=[2])
    assert text == "Alltoall is not supported with Join at this time."


@pytest.mark.parametrize("rtype", [RequestType.ALLGATHER, RequestType.ALLTOALL])
def test_rank_zero_tensor(rtype):
    text = error_of([req(0, rtype, shape=()), req(1, rtype, shape=(3,))], members=[0, 1])
    assert text == f"Process-set rank zero tried to {rtype.name} a rank-zero tensor."


def test_rank_zero_tensor_is_about_the_sets_first_member():
    # Set-rank 0 is global rank 1 here: its scalar is what counts, in whatever order requests arrive.
    text = error_of([req(2, RequestType.ALLGATHER, shape=(3,)), req(1, RequestType.ALLGATHER, shape=())],
                    members=[1, 2])
    assert text == "Process-set rank zero tried to ALLGATHER a rank-zero tensor."


def test_allgather_rank_mismatch():
    text = error_of([req(0, RequestType.ALLGATHER, shape=(4, 17)), req(1, RequestType.ALLGATHER, shape=(4, 17, 1))],
                    members=[0, 1])
    assert text == ("Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank 2, but another rank sent "
                    "a tensor of rank 3.")


def test_allgather_dimension_mismatch():
    text = error_of([req(0, RequestType.ALLGATHER, shape=(4, 17)), req(1, RequestType.ALLGATHER, shape=(9, 18))],
                    members=[0, 1])
    assert text == ("Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 17, but "
                    "another rank sent a tensor with dimension 1 equal to 18.")


def test_alltoall_dimension_mismatch():
    text = error_of([req(0, RequestType.ALLTOALL, shape=(2, 5), splits=(1, 1)),
                     req(1, RequestType.ALLTOALL, shape=(2, 6), splits=(1, 1))], members=[0, 1])
    assert text == ("Mismatched ALLTOALL tensor shapes: One rank sent a tensor with dimension 1 equal to 5, but "
                    "another rank sent a tensor with dimension 1 equal to 6.")


def test_reducescatter_with_join():
    text = error_of([req(0, RequestType.REDUCESCATTER), req(1, RequestType.REDUCESCATTER)], joined=[2])
    assert text == "Reducescatter is not supported with Join at this time."


def test_reducescatter_rank_zero_tensor():
    text = error_of([req(0, RequestType.REDUCESCATTER, shape=()), req(1, RequestType.REDUCESCATTER, shape=())],
                    members=[0, 1])
    assert text == "Process-set rank zero tried to REDUCESCATTER a rank-zero tensor."


def test_reducescatter_only_average_and_sum():
    text = error_of([req(r, RequestType.REDUCESCATTER, op=ReduceOp.MAX) for r in (0, 1)], members=[0, 1])
    assert text == "Reducescatter currently only supports AVERAGE and SUM."


def test_broadcast_with_join():
    text = error_of([req(0, RequestType.BROADCAST, root=0), req(1, RequestType.BROADCAST, root=0)], joined=[2])
    assert text == "Broadcast is not supported with Join at this time."


def test_mismatched_root_ranks():
    text = error_of([req(0, RequestType.BROADCAST, root=0), req(1, RequestType.BROADCAST, root=1),
                     req(2, RequestType.BROADCAST, root=0)])
    assert text == ("Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified "
                    "root rank 1.")


def test_root_ranks_are_global_ranks():
    text = error_of([req(1, RequestType.BROADCAST, root=2), req(2, RequestType.BROADCAST, root=1)], members=[1, 2])
    assert text == ("Mismatched BROADCAST root ranks: One rank specified root rank 2, but another rank specified "
                    "root rank 1.")


def test_mismatched_device():
    text = error_of([req(0, device=-1), req(1, device=0), req(2, device=-1)])
    assert text == ("Mismatched ALLREDUCE CPU/GPU device selection: One rank specified device CPU, but another "
                    "rank specified device GPU.")


# ---------------------------------------------------------------------------------------------- order
def test_order_dtype_before_operation():
    text = error_of([req(0), req(1, RequestType.ALLGATHER, dtype=I32)], members=[0, 1])
    assert text.startswith("Mismatched data types")


def test_order_operation_before_shape():
    text = error_of([req(0), req(1, RequestType.BROADCAST, shape=(1,), root=0)], members=[0, 1])
    assert text.startswith("Mismatched operations")


def test_order_shape_before_factors_before_op():
    assert error_of([req(0), req(1, shape=(1,), pre=2.0, op=ReduceOp.AVERAGE)], members=[0, 1]).startswith(
        "Mismatched ALLREDUCE tensor shapes")
    assert error_of([req(0), req(1, pre=2.0, op=ReduceOp.AVERAGE)], members=[0, 1]).startswith("Mismatched prescale")


def test_order_root_rank_before_device():
    # Upstream checks the device last (§2.6: "Checks in this order, first failure wins").
    text = error_of([req(0, RequestType.BROADCAST, root=0), req(1, RequestType.BROADCAST, root=1, device=0)],
                    members=[0, 1])
    assert text.startswith("Mismatched BROADCAST root ranks")


def test_order_join_before_rank_zero_for_allgather():
    text = error_of([req(0, RequestType.ALLGATHER, shape=()), req(1, RequestType.ALLGATHER, shape=())],
                    joined=[2])
    assert text.startswith("Allgather is not supported with Join")


def test_error_message_is_identical_whatever_the_arrival_order():
    reqs = [req(0), req(1, shape=(17, 18)), req(2)]
    first = error_of(reqs)
    assert error_of(list(reversed(reqs))) == first


# ---------------------------------------------------------------------------------------------- success
def test_allreduce_response():
    resp = ok([req(r, pre=0.5, post=3.0, op=ReduceOp.AVERAGE) for r in (2, 0, 1)])
    assert resp.type == RequestType.ALLREDUCE
    assert resp.names == ["t"]
    assert resp.shapes == [(17, 17)]
    assert resp.dtype == F32
    assert (resp.prescale, resp.postscale, resp.reduce_op) == (0.5, 3.0, ReduceOp.AVERAGE)


def test_allreduce_with_joined_rank_is_fine():
    resp = ok([req(0), req(1)], joined=[2])
    assert resp.type == RequestType.ALLREDUCE
    assert resp.shapes == [(17, 17)]


def test_allgather_response_has_first_dims_in_set_order():
    resp = ok([req(2, RequestType.ALLGATHER, shape=(5, 3)), req(0, RequestType.ALLGATHER, shape=(1, 3)),
               req(1, RequestType.ALLGATHER, shape=(0, 3))])
    assert resp.type == RequestType.ALLGATHER
    assert resp.rank_dims == [[1, 0, 5]]


def test_allgather_response_non_global_set():
    resp = ok([req(2, RequestType.ALLGATHER, shape=(5,), ps=1), req(1, RequestType.ALLGATHER, shape=(2,), ps=1)],
              members=[1, 2])
    assert resp.process_set_id == 1
    assert resp.rank_dims == [[2, 5]]


def test_alltoall_response_has_split_matrix_in_set_order():
    resp = ok([req(1, RequestType.ALLTOALL, shape=(3, 2), splits=(2, 1)),
               req(0, RequestType.ALLTOALL, shape=(4, 2), splits=(0, 4))], members=[0, 1])
    assert resp.splits == [[0, 4], [2, 1]]


def test_broadcast_response_keeps_root():
    resp = ok([req(0, RequestType.BROADCAST, root=1), req(1, RequestType.BROADCAST, root=1)], members=[0, 1])
    assert resp.type == RequestType.BROADCAST
    assert resp.root_rank == 1


def test_process_set_ranks_error_has_upstreams_text():
    assert process_set_ranks_error([0, 2, 1], 3) is None
    assert process_set_ranks_error([0, 3], 3) == "Tried to register process set with invalid rank: 3"
    assert process_set_ranks_error([2, -1], 3) == "Tried to register process set with invalid rank: -1"
    assert process_set_ranks_error([1, 0, 1], 3) == "Tried to register process set with duplicate rank: 1"


# ---------------------------------------------------------------------------------------- grouped collectives
def test_group_base_only_for_names_of_the_groups_form():
    assert group_base("grouped_allreduce.g_2of3", 3) == "grouped_allreduce.g"
    assert group_base("a_b_1of1", 1) == "a_b"
    for name, size in [("g_1of3", 2), ("g_0of3", 3), ("g_4of3", 3), ("g1of3", 3), ("g_of3", 3), ("g_x1of3", 3)]:
        assert group_base(name, size) is None, name


def test_group_sizes_disagree_only_when_no_size_is_shared():
    assert not group_sizes_disagree({0: {3}, 1: {3}})
    assert not group_sizes_disagree({0: {3, 2}, 1: {3}})  # rank 0 ahead by one call
    assert group_sizes_disagree({0: {3}, 1: {2}})
    assert group_sizes_disagree({0: {3}, 1: {3, 2}, 2: {2}})


def test_group_size_error_names_every_rank_and_what_it_sent():
    assert group_size_error(RequestType.ALLGATHER, "b", {3: {1}, 0: {2}, 1: {2}, 2: {2, 1}}) == (
        "Mismatched grouped ALLGATHER sizes for b: ranks 0 and 1 sent a group of 2 tensors, rank 2 sent groups of "
        "2 and 1 tensors, but rank 3 sent a group of 1 tensor. Every rank must pass the same number of tensors to "
        "a grouped collective of one name.")
    many = group_size_error(RequestType.ALLREDUCE, "b", {r: {2 if r else 1} for r in range(12)})
    assert "rank 0 sent a group of 1 tensor, but ranks 1, 2, 3, 4, 5, 6, 7, 8, ... (11 ranks) sent" in many
