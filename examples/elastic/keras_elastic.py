"""Elastic Keras training that survives workers coming and going and counts every sample once.

    printf 'localhost:1\n127.0.0.1:1\n' > hosts.txt
    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script "cat hosts.txt" \
        python examples/elastic/keras_elastic.py

``fit`` runs one epoch at a time over ``ElasticBatches``, the current partition of the samples this epoch
has not committed yet; ``RecordBatchCallback`` marks each finished batch (of every rank) and
``CommitStateCallback`` commits model, optimizer and sampler together after it.
"""

import argparse
import time

import keras
import numpy as np

import horovod.tensorflow.keras as hvd
from horovod.tensorflow.keras import elastic

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--step-sleep", type=float, default=0.02)
args = parser.parse_args()

hvd.init()
rng = np.random.RandomState(0)
x = rng.randn(args.samples, 8).astype("float32")
y = (x @ np.arange(1.0, 9.0, dtype="float32"))[:, None] + 0.5
ids = np.arange(args.samples)

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
sampler = elastic.ElasticSampler(args.samples, shuffle=True, seed=42, batch_size=args.batch_size)
state = elastic.KerasState(model, sampler=sampler, epoch=0, uses=np.zeros(args.samples, np.int64))


class CountUses(keras.callbacks.Callback):
    """Counts how often each sample was trained on (summed over ranks); part of the committed state."""

    def on_train_batch_end(self, batch, logs=None):
        mine = state.sampler.batches()[batch]
        state.uses += hvd.allreduce(np.bincount(ids[mine], minlength=args.samples), op=hvd.Sum,
                                    name="uses").numpy().astype(np.int64)
        time.sleep(args.step_sleep)


@elastic.run
def train(state):
    while state.epoch < args.epochs:
        state.sampler.set_epoch(state.epoch)
        model.fit(elastic.ElasticBatches(x, y, state.sampler), epochs=1, verbose=0,
                  callbacks=[CountUses(), elastic.RecordBatchCallback(state.sampler),
                             elastic.CommitStateCallback(state)])
        if hvd.rank() == 0:
            print(f"epoch {state.epoch} done on {hvd.size()} workers", flush=True)
        state.epoch += 1
        state.commit()


train(state)
if hvd.rank() == 0:
    exact = bool((state.uses == args.epochs).all())
    print(f"every sample used exactly {args.epochs} times: {exact} "
          f"(histogram of uses: {np.bincount(state.uses, minlength=args.epochs + 2).tolist()})", flush=True)
