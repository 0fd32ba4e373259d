"""Variable and object broadcasts (``horovod.tensorflow.functions``).

Objects travel as pickled bytes over the engine's byte collectives directly -- no TF graph is needed, so
``session`` arguments are accepted for compatibility and ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from horovod.common import objects as _objects
from horovod.common import ops as _ops
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow._bridge import Wait, refuse_dtypes, run_collective, to_tf_error
from horovod.tensorflow.mpi_ops import _core_name

__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object"]


def _var_names(variables) -> list[str]:
    """The broadcasts' names: the variables' positions only.  Their names are not the same on every rank where
    the ranks made their models differently: Keras names an optimizer's slots after its model's variable paths
    (``sequential_dense_kernel_momentum``), which depend on how many layers this process made before and
    differ between a model ``hvd.load_model`` rebuilt on rank 0 and a fresh one on the others (upstream's
    resume-from-checkpoint examples), and broadcasts named after them never paired up: every rank waited."""
    return [f"HorovodBroadcast_{i}" for i in range(len(variables))]


def broadcast_variables(variables, root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False):
    """Assign ``root_rank``'s values to ``variables`` on every member.

    Eager: every broadcast is enqueued before the first wait, so they travel together.  Graph mode: returns
    the group op of the assignments.
    """
    variables = list(variables)
    refuse_dtypes(variables)
    names = _var_names(variables)
    if tf.executing_eagerly():
        try:
            handles = [_ops.broadcast(v.numpy() if hasattr(v, "numpy") else np.asarray(v), root_rank, name=n,
                                      process_set=process_set) for v, n in zip(variables, names)]
            values = [h.wait() for h in handles]
        except Exception as e:  # noqa: BLE001
            raise to_tf_error(e) from e
        for v, value in zip(variables, values):
            v.assign(value)
        return None
    if not variables:
        return tf.group()
    # One graph collective for all of them (the engine still gets one broadcast per variable, named as
    # upstream's): building a collective's ops costs ~20 ms in tf.function, and a model's and its optimizer's
    # hundreds of variables made the first step's trace take seconds longer than the step without Horovod.
    root = _ops.root_rank_index(root_rank)
    inputs = [tf.convert_to_tensor(v) for v in variables]
    cores = [_core_name("HorovodBroadcast", t, n, False) for t, n in zip(inputs, names)]

    def submit(arrays):
        return Wait([_ops.broadcast(a, root, name=c, process_set=process_set) for a, c in zip(arrays, cores)])

    values = run_collective(submit, inputs, [t.dtype for t in inputs], "HorovodBroadcast")
    assigns = []
    for v, t, value in zip(variables, inputs, values):
        value.set_shape(t.shape)
        assigns.append(v.assign(value))
    return tf.group(*assigns)


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` (any cloudpickle-able object) on every member."""
    try:
        return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)
    except Exception as e:  # noqa: BLE001
        raise to_tf_error(e) from e


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None,
                        process_set: ProcessSet = global_process_set):
    """Return ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (upstream's TF1 placeholder variant)."""
    name = name or "broadcast_object_fn"

    def fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return fn


def allgather_object(obj: Any, session=None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every member's ``obj`` as a list ordered by rank within the set."""
    try:
        return _objects.allgather_object(obj, name=name, process_set=process_set)
    except Exception as e:  # noqa: BLE001
        raise to_tf_error(e) from e
