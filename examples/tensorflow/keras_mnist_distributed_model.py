"""Seed 001 as users write it today: TF2/Keras 3 with hvd.DistributedOptimizer and hvd.DistributedModel.

    horovodrun -np 2 python examples/tensorflow/keras_mnist_distributed_model.py
"""

import argparse
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_data import load_mnist  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    # Initialise Horovod.
    hvd.init()
    # Same random seed on every machine, so results are consistent.
    tf.random.set_seed(42)
    # Only use this process's GPU (no-op without GPUs).
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    size = hvd.size()

    # Load the data; each rank reads its own shard.
    (train_images, train_labels), _ = load_mnist()
    train_images = (train_images / 255.0).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels))
    dataset = dataset.shard(hvd.size(), hvd.rank()).shuffle(10000, seed=hvd.rank()).batch(128)

    model = tf.keras.Sequential([
        tf.keras.Input((28, 28)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.Adam(0.001 * size)
    optimizer = hvd.DistributedOptimizer(optimizer)
    model = hvd.DistributedModel(model)  # broadcasts rank 0's weights at train start, averages metrics
    model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"])
    model.fit(dataset, epochs=args.epochs, verbose=1)

    # Global synchronisation of the model (already identical; kept from the seed program).
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables(), root_rank=0)

    checksum = float(sum(np.sum(v.numpy(), dtype=np.float64) for v in model.trainable_variables))
    checksums = hvd.allgather_object(checksum)
    print(f"rank {hvd.rank()}: weight checksum {checksum:.6f}; all ranks agree: "
          f"{max(checksums) - min(checksums) < 1e-6}")


if __name__ == "__main__":
    main()
