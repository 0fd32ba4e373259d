"""Keras elastic training under a real fault: kill -9 of a worker mid-epoch, every sample exactly once.

The job (``worker_keras.py``) uses ``hvd.elastic.run``, ``KerasState``, ``ElasticBatches`` and the
``RecordBatchCallback``/``CommitStateCallback`` callbacks; its model is exactly additive, so the final
weights must equal the fault-free ones and each sample must be counted once per epoch.
"""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

pytestmark = pytest.mark.timeout(120) if hasattr(pytest.mark, "timeout") else []


def test_keras_kill_worker_mid_epoch(elastic_job):
    job = elastic_job(["localhost:1", "127.0.0.1:1"], ["-np", "2", "--min-np", "1", "--max-np", "2"],
                      worker="worker_keras.py", samples=48, batch=2, epochs=2, sleep=0.05, sleep_after_resize=0.0)
    job.wait_steps(5, size=2, timeout=90)
    epoch, _, _ = job.progress()
    assert epoch == 0  # mid-epoch: 12 steps per epoch on 2 workers
    os.kill(job.pid("127.0.0.1:0"), signal.SIGKILL)
    assert job.wait() == 0, job.output()
    result = job.result()
    assert result["uses"] == [2] * 48, result
    assert result["w"] == result["expected_w"], result
    assert result["sizes"] == [2, 1], result
    assert "blacklisting host 127.0.0.1" in job.log_text()
    job.assert_no_leftovers()


_STATE_CALLBACKS = r"""
import json, sys
import numpy as np
import keras
import horovod.tensorflow.keras as hvd

hvd.init()
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
x, y = np.ones((64, 2), np.float32), np.ones((64, 1), np.float32)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state)]
steps = []

class Steps(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        steps.append(self.params.get("steps"))

def fit(epochs, per_epoch):
    model.fit(x, y, batch_size=8, epochs=epochs, steps_per_epoch=per_epoch, verbose=0,
              callbacks=[*callbacks, Steps()])

fit(1, 4)
after_first = state.epoch
state.epoch, state.batch = 1, 3  # what hvd.elastic.run restores: epoch 1 committed 3 batches in
fit(2, 8)
json.dump({"after_first": after_first, "after_second": state.epoch, "steps": steps}, sys.stdout)
"""


def test_state_callbacks_start_from_the_restored_state_in_every_fit():
    """After a reset ``hvd.elastic.run`` calls ``fit`` again with the same callbacks: the epoch count continues
    from the restored ``state.epoch`` and the first epoch is shortened by the restored ``state.batch`` of *this*
    fit's steps (upstream resets both at ``on_train_begin``; they were kept from the first ``fit``)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", _STATE_CALLBACKS], env=env, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["after_first"] == 1
    assert result["after_second"] == 1 + 2  # restored epoch + the two epochs this fit ran
    assert result["steps"] == [4, 8 - 3, 8]  # the restored batches come off this fit's first epoch only


def test_keras_worker_joins_a_job_traced_at_size_one(elastic_job):
    """One worker traces its training step at size 1, a second host appears: the step traced earlier must still
    reduce with the newcomer (it was traced without any allreduce -- the newcomer waited for the old rank's
    gradients until the stall deadline, then the same again in every generation)."""
    job = elastic_job(["localhost:1"], ["-np", "1", "--min-np", "1", "--max-np", "2"],
                      worker="worker_keras.py", samples=48, batch=2, epochs=2, sleep=0.05, sleep_after_resize=0.0,
                      env={"TEST_HOLD_UNTIL_SIZE": "2"})  # slow steps at size 1: the newcomer joins mid-job
    job.wait_steps(4, size=1, timeout=90)
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    assert job.wait() == 0, job.output()
    result = job.result()
    assert result["uses"] == [2] * 48, result
    assert result["w"] == result["expected_w"], result
    assert result["sizes"] == [1, 2], result
    job.assert_no_leftovers()


_RESET_AT_EPOCH_END = r"""
import json, sys
import numpy as np
import keras
import horovod.tensorflow.keras as hvd
from horovod.tensorflow.keras import elastic

hvd.init()
x = np.arange(16, dtype=np.float32).reshape(8, 2) / 8
y = x.sum(1, keepdims=True)

def run(interrupted):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    sampler = elastic.ElasticSampler(8, shuffle=False, batch_size=2)
    state = elastic.KerasState(model, sampler=sampler, epoch=0)
    callbacks = [elastic.RecordBatchCallback(sampler), elastic.CommitStateCallback(state)]
    state.sampler.set_epoch(state.epoch)
    model.fit(elastic.ElasticBatches(x, y, state.sampler), epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    left = None
    if interrupted:  # a reset before the loop's `state.epoch += 1; state.commit()`: what hvd.elastic.run does
        state.restore()
        state.sampler.set_epoch(state.epoch)
        left = len(elastic.ElasticBatches(x, y, state.sampler))
        model.fit(elastic.ElasticBatches(x, y, state.sampler), epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
    state.epoch += 1
    state.commit()
    return [w.tolist() for w in model.get_weights()], left

straight, _ = run(False)
resumed, left = run(True)
json.dump({"straight": straight, "resumed": resumed, "left": left}, sys.stdout)
"""


def test_a_reset_after_the_last_batch_of_an_epoch_resumes_it():
    """A reset between the epoch's last batch and the loop's epoch commit resumed an epoch with no batch left:
    ``fit`` refused the empty ``ElasticBatches`` and the job failed (the growth test above hit it).  The last
    batch's commit is left to the loop: restored, the last batch runs again from the weights it started from,
    and the weights equal an uninterrupted epoch's."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI_"))}
    out = subprocess.run([sys.executable, "-c", _RESET_AT_EPOCH_END], env=env, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["left"] == 1, result
    assert result["resumed"] == result["straight"], result
