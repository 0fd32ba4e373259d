"""horovod.tensorflow collectives called before hvd.init(): upstream's kernels check initialisation first and
fail with a PRECONDITION status, so eager calls raise ``tf.errors.FailedPreconditionError`` with upstream's
text (HOROVOD_SPEC §1.3); the queries keep their ``ValueError``.  A fresh process, outside any launcher.

Inside ``tf.function`` upstream's kernels fail the same way when the function runs; ours raise that class when
the function is traced (the submit op's ``ValueError`` became ``InvalidArgumentError``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parent.parent
CODE = """
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
calls = {
    "allreduce": lambda: hvd.allreduce(tf.ones(2)),
    "grouped_allreduce": lambda: hvd.grouped_allreduce([tf.ones(2)]),
    "allgather": lambda: hvd.allgather(tf.ones(2)),
    "broadcast": lambda: hvd.broadcast(tf.ones(2), 0),
    "alltoall": lambda: hvd.alltoall(tf.ones(2)),
    "reducescatter": lambda: hvd.reducescatter(tf.ones(2)),
    "broadcast_variables": lambda: hvd.broadcast_variables([tf.Variable(1.0)], 0),
    "size": hvd.size,
}
for name, fn in calls.items():
    try:
        fn()
    except Exception as e:
        print(name, type(e).__name__, str(e))
    else:
        print(name, "no error")

v = tf.Variable(1.0)
in_function = {
    "allreduce": lambda x: hvd.allreduce(x),
    "allreduce_sum": lambda x: hvd.allreduce(x, op=hvd.Sum),
    "grouped_allreduce": lambda x: hvd.grouped_allreduce([x, 2 * x]),
    "allgather": lambda x: hvd.allgather(x),
    "broadcast": lambda x: hvd.broadcast(x, 0),
    "alltoall": lambda x: hvd.alltoall(x),
    "reducescatter": lambda x: hvd.reducescatter(x),
    "broadcast_variables": lambda x: [hvd.broadcast_variables([v], 0), v.read_value()][1],
    "join": lambda x: hvd.join(),
    "size_op": lambda x: hvd.size_op(),
    "rank_op": lambda x: hvd.rank_op(),
}
for name, fn in in_function.items():
    try:
        tf.function(tf.autograph.experimental.do_not_convert(fn))(tf.ones(2))
    except Exception as e:
        print("function_" + name, type(e).__name__, str(e).replace("\\n", " "))
    else:
        print("function_" + name, "no error")
for name in ("size_op", "rank_op"):
    try:
        getattr(hvd, name)()
    except Exception as e:
        print("eager_" + name, type(e).__name__, str(e))


def tape_gradient():
    with tf.GradientTape() as tape:
        loss = v * v
    return hvd.DistributedGradientTape(tape).gradient(loss, [v])


def keras_fit():
    import keras
    import horovod.tensorflow.keras as hvdk
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)


steps = {"tape_eager": tape_gradient, "tape_function": tf.function(tape_gradient), "keras_fit": keras_fit}
for name, fn in steps.items():
    try:
        fn()
    except Exception as e:
        print(name, type(e).__name__, str(e).replace("\\n", " "))
    else:
        print(name, "no error")
"""


def test_collectives_before_init_are_failed_precondition():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3",
               CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    text = "Horovod has not been initialized; use hvd.init()."
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    for name in ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                 "broadcast_variables"):
        assert lines[name] == f"FailedPreconditionError {text}", (name, lines[name])
    assert lines["size"] == f"ValueError {text}"
    for name in ("allreduce", "allreduce_sum", "grouped_allreduce", "allgather", "broadcast", "alltoall",
                 "reducescatter", "broadcast_variables", "join", "size_op", "rank_op"):
        assert lines["function_" + name] == f"FailedPreconditionError {text}", (name, lines["function_" + name])
    for name in ("tape_eager", "tape_function", "keras_fit"):  # (asking the process set: a ValueError)
        assert lines[name] == f"FailedPreconditionError {text}", (name, lines[name])
    for name in ("size_op", "rank_op"):  # upstream's kernels, as the collectives
        assert lines["eager_" + name] == f"FailedPreconditionError {text}", (name, lines["eager_" + name])
