"""What a TensorFlow graph collective costs a step: ``SyncBatchNormalization`` layers against Keras' own.

Each ``hvd.SyncBatchNormalization`` layer allreduces its batch statistics in the forward pass and again in
the backward pass, one after the other: a model with many of them waits for many small collectives in a row,
so what one costs end to end inside ``tf.function`` (submit op, engine, completer, receive queue) is its step
time.  One ``horovodrun -np 2`` launch; every rank holds both models (``--layers`` x (Dense(64) + norm), batch
32) and alternates blocks of their compiled training steps; it also times a lone one-float ``hvd.allreduce``
inside ``tf.function`` (what each of those collectives costs) and the same through ``horovod.numpy``.

    python benchmarks/tf_sync_batch_norm.py
    python benchmarks/tf_sync_batch_norm.py --env HOROVOD_SPIN_WAIT_US=0   # waiting threads never poll
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import horovod.numpy as hnp
    import horovod.tensorflow as hvd

    hvd.init()
    x = tf.constant(np.random.default_rng(hvd.rank()).normal(size=(32, 64)).astype(np.float32))

    def make_step(norm):
        keras.utils.set_random_seed(0)  # the same weights on every rank
        model = keras.Sequential([keras.Input((64,))] + [
            layer for _ in range(args.layers) for layer in (keras.layers.Dense(64), norm())])
        opt = keras.optimizers.SGD(0.01)

        @tf.function
        def step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return step

    steps = {"plain": make_step(keras.layers.BatchNormalization), "sync": make_step(hvd.SyncBatchNormalization)}
    one = tf.Variable(tf.ones([1]))
    steps["allreduce"] = tf.function(lambda: hvd.allreduce(one, name="bench.one"))
    times: dict[str, list[float]] = {key: [] for key in steps}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    for _ in range(args.rounds):
        for key, step in steps.items():
            hvd.allreduce(tf.zeros(1), name="bench.sync")  # every block starts together on both ranks
            times[key].append(_median_time(lambda s=step: s().numpy(), args.block))
    lone = np.ones(1, np.float32)
    numpy_s = _median_time(lambda: hnp.allreduce(lone, name="bench.numpy"), 200)
    mine = [statistics.median(times[k]) for k in steps] + [numpy_s]
    every = hvd.allgather(tf.constant([mine], tf.float64), name="bench.medians").numpy()
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"keys": [*steps, "numpy"], "seconds": every.max(axis=0).tolist()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20, help="Dense + normalisation pairs")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=15, help="steps per block (the median of each is kept)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the ranks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.update(kv.split("=", 1) for kv in args.env)
    cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, os.path.abspath(__file__), "--worker",
           "--layers", str(args.layers), "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--block",
           str(args.block)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if RESULT in line]
    if proc.returncode or not lines:
        raise SystemExit(f"horovodrun -np 2 failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(lines[0].split(RESULT, 1)[1])
    t = dict(zip(r["keys"], r["seconds"]))
    per_layer = (t["sync"] - t["plain"]) / args.layers
    print(f"np=2, {args.layers} x (Dense(64) + normalisation), batch 32/rank, 1 thread/process, "
          f"{' '.join(args.env) or 'default knobs'} (the slower rank's medians)")
    print(f"step with BatchNormalization:      {t['plain'] * 1e3:8.2f} ms")
    print(f"step with SyncBatchNormalization:  {t['sync'] * 1e3:8.2f} ms  ({per_layer * 1e6:.0f} us per layer: "
          "two allreduces)")
    print(f"one-float allreduce in tf.function: {t['allreduce'] * 1e6:7.0f} us  "
          f"(horovod.numpy, synchronous: {t['numpy'] * 1e6:.0f} us)")
    print(json.dumps({"benchmark": "tf_sync_batch_norm", "layers": args.layers, "env": args.env,
                      "plain_step_ms": t["plain"] * 1e3, "sync_step_ms": t["sync"] * 1e3,
                      "us_per_sync_layer": per_layer * 1e6, "tf_allreduce_us": t["allreduce"] * 1e6,
                      "numpy_allreduce_us": t["numpy"] * 1e6}))


if __name__ == "__main__":
    main()
