"""A deterministic elastic Keras job, run by test_elastic_keras.py under ``horovodrun``.

``hvd.elastic.run`` + ``KerasState`` + ``ElasticBatches`` with ``RecordBatchCallback`` and
``CommitStateCallback``, ``fit`` one epoch at a time.  The model is exact: ``y_pred = x @ w`` (no bias) with
the loss ``-sum(y_true * y_pred)`` (reduction "sum") and gradients *summed* over ranks, so each sample i
moves ``w`` by ``lr * y_i * x_i`` whatever the batch boundaries and world sizes, and with small integers and
``lr = 1`` float32 is exact: every sample processed once per epoch gives ``w == EPOCHS * x.T @ y``.
``uses`` (committed with the model) counts each sample's batches, summed over ranks.

Writes like worker_numpy.py: ``pids/<slot>.<pid>``, ``progress`` after each commit (rank 0) and
``result.json`` at the end.  Environment: TEST_OUT, TEST_SAMPLES, TEST_BATCH, TEST_EPOCHS, TEST_STEP_SLEEP,
TEST_STEP_SLEEP_AFTER_RESIZE and TEST_RESIZES (as in worker_numpy.py), TEST_HOLD_UNTIL_SIZE.
"""

import json
import os
import sys
import time

OUT = os.environ["TEST_OUT"]
SLOT = os.environ.get("HOROVOD_ELASTIC_SLOT", "?")
os.makedirs(os.path.join(OUT, "pids"), exist_ok=True)
open(os.path.join(OUT, "pids", f"{SLOT}.{os.getpid()}"), "w").close()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402
from horovod.tensorflow.keras import elastic  # noqa: E402

N = int(os.environ.get("TEST_SAMPLES", "48"))
BS = int(os.environ.get("TEST_BATCH", "2"))
EPOCHS = int(os.environ.get("TEST_EPOCHS", "2"))
SLEEP = float(os.environ.get("TEST_STEP_SLEEP", "0.05"))
SLEEP_AFTER_RESIZE = float(os.environ.get("TEST_STEP_SLEEP_AFTER_RESIZE", SLEEP))
RESIZES = int(os.environ.get("TEST_RESIZES", "1"))
# steps after the 4th last at least 0.5 s while the world is smaller than this: time for a new worker to start
HOLD_UNTIL_SIZE = int(os.environ.get("TEST_HOLD_UNTIL_SIZE", "0"))


def data():
    i = np.arange(N)
    x = np.stack([np.ones(N), i % 5, (i * 3) % 7], axis=1).astype("float32")
    y = ((i % 3) + 1).astype("float32")[:, None]
    return x, y


def expected_w():
    x, y = data()
    return (EPOCHS * (x.T @ y)).ravel()


def write(name, text):
    tmp = os.path.join(OUT, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(OUT, name))


class LinearLoss(keras.losses.Loss):
    def __init__(self):
        super().__init__(reduction="sum", name="linear")

    def call(self, y_true, y_pred):
        return -y_true * y_pred


hvd.init()
x, y = data()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum), loss=LinearLoss())
sampler = elastic.ElasticSampler(N, shuffle=True, seed=5, batch_size=BS)
state = elastic.KerasState(model, sampler=sampler, epoch=0, steps=0, uses=np.zeros(N, np.int64), sizes=[])


class Account(keras.callbacks.Callback):
    """Counts each sample of a finished batch (all ranks); runs before RecordBatch/Commit."""

    def on_train_batch_end(self, batch, logs=None):
        mine = np.asarray(state.sampler.batches()[batch], np.int64)
        state.uses += hvd.allreduce(np.bincount(mine, minlength=N), op=hvd.Sum, name="uses").numpy().astype(
            np.int64)
        state.steps += 1
        if hvd.size() < HOLD_UNTIL_SIZE and state.steps >= 4:
            time.sleep(0.5)
        else:
            time.sleep(SLEEP if len(state.sizes) <= RESIZES else SLEEP_AFTER_RESIZE)


class Progress(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 0:
            write("progress", f"{state.epoch} {state.steps} {hvd.size()}")


@elastic.run
def train(state):
    if not state.sizes or state.sizes[-1] != hvd.size():
        state.sizes.append(hvd.size())
    while state.epoch < EPOCHS:
        state.sampler.set_epoch(state.epoch)
        model.fit(elastic.ElasticBatches(x, y, state.sampler), epochs=1, verbose=0, shuffle=False,
                  callbacks=[Account(), elastic.RecordBatchCallback(state.sampler),
                             elastic.CommitStateCallback(state), Progress()])
        state.epoch += 1
        state.commit()


train(state)
if hvd.rank() == 0:
    w = model.get_weights()[0].ravel()
    write("result.json", json.dumps({"w": w.tolist(), "expected_w": expected_w().tolist(),
                                     "uses": state.uses.tolist(), "sizes": state.sizes, "steps": state.steps}))
print(f"worker {SLOT} done as rank {hvd.rank()} of {hvd.size()}", file=sys.stderr)
