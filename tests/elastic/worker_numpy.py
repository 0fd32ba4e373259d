"""A deterministic elastic training job on numpy, run by the fault tests under ``horovodrun``.

The "model" is exact integer arithmetic in float64: each sample i contributes ``g(i)`` to the weights and
1 to ``counts[i]``, summed over ranks with allreduce.  Every sample processed exactly once per epoch gives
``w == -EPOCHS * sum(g)`` and ``counts == EPOCHS`` whatever the world sizes along the way; a skipped or
duplicated sample changes both.  Rank 0 writes ``progress`` after each commit and ``result.json`` at the
end; every worker registers ``pids/<slot>.<pid>`` so the test can kill or stop it.

Environment: TEST_OUT (directory), TEST_SAMPLES, TEST_BATCH, TEST_EPOCHS, TEST_STEP_SLEEP,
TEST_STEP_SLEEP_AFTER_RESIZE (the step sleep once the world changed size TEST_RESIZES times, default once;
default TEST_STEP_SLEEP: a test that only needs the job to finish after its last fault sets 0 and does not wait
for the remaining steps),
TEST_DIE_IN_COMMIT=<slot>:<global step> (SIGKILL itself inside commit(), once),
TEST_SLOW_REMOVED_EXIT=<seconds> (a worker told it was removed prints its traceback, touches
``removed_exiting`` and takes that long to exit, as a large process does),
TEST_HOLD_UNTIL_SIZE=<n> (steps take 0.5 s while the world is smaller than n: a newcomer joins mid-job however
slowly a loaded host starts it),
TEST_SLOW_RESET=<slot>:<seconds> (its first re-initialisation waits that long before leaving the generation: the
driver sees hosts change meanwhile),
TEST_DIE_IN_MESH=<slot> (SIGKILL itself in its first mesh formation, once: as it is about to connect to its
peer, which then waits for a connection that never comes, or as its peer's connection arrives, which then
retries a listener that is gone),
TEST_BUSY=<slot>:<global step>:<seconds> (after that step's commit the slot works that long without a collective,
once, as a checkpoint or a validation pass does; it touches ``busy`` when it starts),
TEST_COMMIT_ONLY_ON_RANK=<rank> (a user's bug: only that rank calls ``state.commit()``, whose broadcast the others
never run),
TEST_MISMATCH_AT=<global step> (a user's bug: from that step on, the last rank's "grad" has another shape).
"""

import json
import os
import signal
import sys
import time

import numpy as np

import horovod.numpy as hvd
from horovod.common import elastic
from horovod.common.elastic_sampler import ElasticSampler

OUT = os.environ["TEST_OUT"]
N = int(os.environ.get("TEST_SAMPLES", "40"))
BS = int(os.environ.get("TEST_BATCH", "2"))
EPOCHS = int(os.environ.get("TEST_EPOCHS", "2"))
SLEEP = float(os.environ.get("TEST_STEP_SLEEP", "0.05"))
SLEEP_AFTER_RESIZE = float(os.environ.get("TEST_STEP_SLEEP_AFTER_RESIZE", SLEEP))
RESIZES = int(os.environ.get("TEST_RESIZES", "1"))
DIE_IN_COMMIT = os.environ.get("TEST_DIE_IN_COMMIT", "")
DIE_IN_MESH = os.environ.get("TEST_DIE_IN_MESH", "")
SLOT = os.environ.get("HOROVOD_ELASTIC_SLOT", "?")
SLOW_REMOVED_EXIT = float(os.environ.get("TEST_SLOW_REMOVED_EXIT", "0"))
HOLD_UNTIL_SIZE = int(os.environ.get("TEST_HOLD_UNTIL_SIZE", "0"))
SLOW_RESET = os.environ.get("TEST_SLOW_RESET", "")
BUSY = os.environ.get("TEST_BUSY", "")
COMMIT_ONLY_ON_RANK = int(os.environ.get("TEST_COMMIT_ONLY_ON_RANK", "-1"))
MISMATCH_AT = int(os.environ.get("TEST_MISMATCH_AT", "-1"))


def g(indices):
    x = np.asarray(indices, dtype=np.float64)
    return np.stack([np.ones_like(x), x + 1, np.mod(x * 7, 5)], axis=1).sum(axis=0) if len(x) else np.zeros(3)


def write(name, text):
    tmp = os.path.join(OUT, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(OUT, name))


os.makedirs(os.path.join(OUT, "pids"), exist_ok=True)
open(os.path.join(OUT, "pids", f"{SLOT}.{os.getpid()}"), "w").close()

if DIE_IN_MESH == SLOT and not os.path.exists(os.path.join(OUT, "died_in_mesh")):
    from horovod.transport import mesh

    def die(*_args, **_kwargs):
        open(os.path.join(OUT, "died_in_mesh"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    mesh._connect_and_prove = die  # rank 1: every peer's address is known, none connected
    mesh._Acceptor._accept = die  # rank 0: a peer's connection is waiting in the listener

if SLOW_REMOVED_EXIT:
    def slow_exit(kind, value, tb):
        sys.__excepthook__(kind, value, tb)
        if "has been removed from elastic job" in str(value):
            sys.stderr.flush()
            open(os.path.join(OUT, "removed_exiting"), "w").close()
            time.sleep(SLOW_REMOVED_EXIT)

    sys.excepthook = slow_exit

if SLOW_RESET and SLOW_RESET.rsplit(":", 1)[0] == SLOT:
    from horovod.common import basics

    real_shutdown, slowed = basics.shutdown, []

    def slow_shutdown():
        if not slowed:
            slowed.append(True)
            time.sleep(float(SLOW_RESET.rsplit(":", 1)[1]))
        real_shutdown()

    basics.shutdown = slow_shutdown  # elastic.run's reset: shutdown(); init()

hvd.init()
sampler = ElasticSampler(N, shuffle=True, seed=3, batch_size=BS)
state = elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, steps=0, w=np.zeros(3),
                            counts=np.zeros(N, np.int64), sampler=sampler, sizes=[])

if DIE_IN_COMMIT:
    die_slot, die_step = DIE_IN_COMMIT.rsplit(":", 1)
    marker = os.path.join(OUT, "died_in_commit")
    check = state.check_host_updates

    def check_host_updates():
        if SLOT == die_slot and state.steps >= int(die_step) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # the others are in commit's broadcast now
        check()

    state.check_host_updates = check_host_updates


def commit(state):
    if COMMIT_ONLY_ON_RANK < 0 or hvd.rank() == COMMIT_ONLY_ON_RANK:
        state.commit()


def contribution(batch):
    if 0 <= MISMATCH_AT <= state.steps and hvd.rank() == hvd.size() - 1:
        return np.append(g(batch), 0.0)
    return g(batch)


@elastic.run
def train(state):
    if not state.sizes or state.sizes[-1] != hvd.size():
        state.sizes.append(hvd.size())
    while state.epoch < EPOCHS:
        state.sampler.set_epoch(state.epoch)
        for step, batch in enumerate(state.sampler):
            grad = hvd.allreduce(contribution(batch), op=hvd.Sum, name="grad")
            counts = hvd.allreduce(np.bincount(np.asarray(batch, np.int64), minlength=N), op=hvd.Sum,
                                   name="counts")
            state.w -= grad
            state.counts += counts
            state.steps += 1
            state.sampler.record_batch(step, BS)
            if hvd.size() < HOLD_UNTIL_SIZE:
                time.sleep(0.5)
            else:
                time.sleep(SLEEP if len(state.sizes) <= RESIZES else SLEEP_AFTER_RESIZE)
            commit(state)
            if hvd.rank() == 0:
                write("progress", f"{state.epoch} {state.steps} {hvd.size()}")
            if BUSY and BUSY.split(":")[:2] == SLOT.split(":") and state.steps == int(BUSY.split(":")[2]) \
                    and not os.path.exists(os.path.join(OUT, "busy")):
                open(os.path.join(OUT, "busy"), "w").close()
                time.sleep(float(BUSY.split(":")[3]))
        state.epoch += 1
        commit(state)


train(state)
if hvd.rank() == 0:
    write("result.json", json.dumps({"w": state.w.tolist(), "counts": state.counts.tolist(),
                                     "sizes": state.sizes, "steps": state.steps, "size": hvd.size()}))
print(f"worker {SLOT} done as rank {hvd.rank()} of {hvd.size()}", file=sys.stderr)
