"""Seed 000 as users write it today: TF1 graph style (tf.compat.v1) with Horovod.

Session config pinned by ``local_rank``, placeholders, ``hvd.DistributedOptimizer`` around a
``tf.compat.v1.train`` optimizer, ``hvd.allreduce`` of a metric, per-rank data shards, and a broadcast of
the initial variables from rank 0.

    horovodrun -np 2 python examples/tensorflow/tensorflow_mnist_tf1.py
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
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    tf.compat.v1.disable_eager_execution()
    hvd.init()
    local_rank = hvd.local_rank()

    # Pin one GPU per process (no-op on CPU-only machines).
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    config.gpu_options.visible_device_list = str(local_rank) if tf.config.list_physical_devices("GPU") else ""

    (x_train, y_train), (x_test, y_test) = load_mnist()
    # Every rank trains on its own shard of the data.
    x_train = x_train[hvd.rank()::hvd.size()].reshape(-1, 784).astype(np.float32) / 255.0
    y_train = y_train[hvd.rank()::hvd.size()]
    x_test = x_test.reshape(-1, 784).astype(np.float32) / 255.0

    tf.compat.v1.set_random_seed(hvd.rank())  # different init per rank: the broadcast below aligns them
    images = tf.compat.v1.placeholder(tf.float32, [None, 784], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    init = tf.compat.v1.glorot_uniform_initializer()
    w1 = tf.compat.v1.get_variable("w1", [784, 128], initializer=init)
    b1 = tf.compat.v1.get_variable("b1", [128], initializer=tf.compat.v1.zeros_initializer())
    w2 = tf.compat.v1.get_variable("w2", [128, 10], initializer=init)
    b2 = tf.compat.v1.get_variable("b2", [10], initializer=tf.compat.v1.zeros_initializer())
    hidden = tf.nn.relu(tf.matmul(images, w1) + b1)
    logits = tf.matmul(hidden, w2) + b2
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    avg_loss = hvd.allreduce(loss, name="avg_loss")  # averaged across ranks

    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(args.lr * hvd.size())  # scale lr by workers
    optimizer = hvd.DistributedOptimizer(optimizer)
    grads_and_vars = optimizer.compute_gradients(loss)  # already averaged across ranks
    train_op = optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    bcast = hvd.broadcast_global_variables(0)

    with tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(bcast)
        steps = len(x_train) // args.batch_size
        for epoch in range(args.epochs):
            for step in range(steps):
                sl = slice(step * args.batch_size, (step + 1) * args.batch_size)
                _, lv = sess.run([train_op, avg_loss], {images: x_train[sl], labels: y_train[sl]})
            acc = sess.run(accuracy, {images: x_test, labels: y_test})
            if hvd.rank() == 0:
                print(f"epoch {epoch + 1}: loss {lv:.4f} test accuracy {acc:.4f}")
        weights = sess.run(tf.compat.v1.trainable_variables())
    checksum = float(sum(np.sum(w, dtype=np.float64) for w in weights))
    checksums = hvd.allgather_object(checksum)
    print(f"rank {hvd.rank()}: weight checksum {checksum:.6f}; all ranks agree: "
          f"{max(checksums) - min(checksums) < 1e-6}")


if __name__ == "__main__":
    main()
