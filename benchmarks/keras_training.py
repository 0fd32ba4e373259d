"""Keras training throughput with horovod.tensorflow.keras: np=2 vs 2 x one process (scaling efficiency).

Two models (``--model``), trained with ``model.fit`` on synthetic data, one TensorFlow thread per process
(intra- and inter-op), ``hvd.DistributedOptimizer`` reducing ~20 MB of gradients per step:

* ``cnn``: about 5 M parameters (the same shape as benchmarks/torch_training.py) on 32x32 images, batch 32
  per rank by default;
* ``dense``: 1024-2048-1024-1024-10 on flat inputs, 5.3 M parameters, batch 64 per rank by default: ~20 ms
  of compute per step for the same bytes of gradient, so communication shows.

Default (paired): one ``horovodrun -np 2`` launch; every rank holds two copies of the model, one compiled
with the plain optimizer (the single-process contender) and one with ``hvd.DistributedOptimizer``, and
alternates ``fit`` calls of ``--block`` steps between them.  Both contenders therefore run under the same
machine load (on a shared 2-core host separate launches a minute apart differed by 2x), and the local one
runs while the other rank computes too, as a single process would next to other work.
``efficiency = np2 samples/s / (2 x single samples/s) = local step time / distributed step time`` (medians).
A third copy trains with :func:`lockstep_sgd` (the ranks wait for each other every step, nothing is reduced):
the synchronous bound, printed as "np=2 / synchronous bound" next to the efficiency.
``--separate`` launches np=1 and np=2 jobs alternately instead.

    python benchmarks/keras_training.py                # the CNN: prints a table and a JSON line
    python benchmarks/keras_training.py --batch 32 --rounds 4 --block 5
    python benchmarks/keras_training.py --model dense --rounds 6 --block 10
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


def build_model(keras, name: str = "cnn"):
    """``cnn``: ~5.1 M parameters, four 3x3 conv layers on 32x32x3 images and two dense layers; ``dense``:
    1024-2048-1024-1024-10, ~5.3 M parameters."""
    layers = keras.layers
    if name == "dense":
        return keras.Sequential([keras.Input((1024,)), layers.Dense(2048, activation="relu"),
                                 layers.Dense(1024, activation="relu"), layers.Dense(1024, activation="relu"),
                                 layers.Dense(10)])
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(128, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(256, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Flatten(), layers.Dense(1152, activation="relu"), layers.Dense(10),
    ])


def synthetic_data(args, tf, np, rank: int):
    """Four batches of random samples for ``args.model``, repeated."""
    rng = np.random.default_rng(rank)
    shape = (1024,) if args.model == "dense" else (32, 32, 3)
    x = rng.normal(size=(args.batch * 4, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch * 4)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()


def worker(args) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np

    import horovod.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    if args.paired:
        return paired_worker(args, tf, keras, np, hvd)
    model = build_model(keras, args.model)
    params = model.count_params()
    opt = keras.optimizers.SGD(0.01)
    if hvd.size() > 1:
        opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = synthetic_data(args, tf, np, hvd.rank())

    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    callbacks = [Timer()]
    if hvd.size() > 1:
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0, callbacks=callbacks)
    step = statistics.median(times[args.warmup:])
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"np": hvd.size(), "params": params, "step_s": step,
                                   "samples_per_s": hvd.size() * args.batch / step}), flush=True)


def lockstep_sgd(tf, keras):
    """SGD whose step waits for every rank (a one-float allreduce after the gradients) but reduces nothing:
    synchronous training whose gradient allreduce costs nothing -- the most a data-parallel step can reach
    on this host, where ranks wait for the slower one on every step."""
    import horovod.tensorflow as hvd  # (the Keras module's allreduce takes values, as upstream's does)

    class LockstepSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            with tf.control_dependencies(grads):
                done = hvd.allreduce(tf.zeros([1]), name="bench.lockstep")
            with tf.control_dependencies([done]):
                grads = [tf.identity(g) for g in grads]
            return super().apply(grads, trainable_variables)
    return LockstepSGD


def paired_worker(args, tf, keras, np, hvd) -> None:
    """Alternate fit blocks of a local and a distributed copy of the model in the same processes."""
    data = synthetic_data(args, tf, np, hvd.rank())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    local, dist = build_model(keras, args.model), build_model(keras, args.model)
    local.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    dist.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), compression=compression),
                 loss=loss)
    sync = build_model(keras, args.model)
    sync.compile(optimizer=lockstep_sgd(tf, keras)(0.01), loss=loss)
    times: dict[str, list[float]] = {"local": [], "dist": [], "sync": []}
    cpu: dict[str, list[float]] = {"local": [], "dist": [], "sync": []}  # all threads of this process

    class Timer(keras.callbacks.Callback):
        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_train_batch_begin(self, batch, logs=None):
            self.t, self.cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            if batch > 0:  # the first step of a block pays fit's set-up
                times[self.key].append(time.perf_counter() - self.t)
                cpu[self.key].append(time.process_time() - self.cpu)

    local.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0)
    sync.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0)
    dist.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0,
             callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    for _ in range(args.rounds):
        local.fit(data, steps_per_epoch=args.block + 1, epochs=1, verbose=0, callbacks=[Timer("local")])
        hvd.allreduce(np.zeros(1), name="bench.sync")  # start the distributed block together
        dist.fit(data, steps_per_epoch=args.block + 1, epochs=1, verbose=0, callbacks=[Timer("dist")])
        hvd.allreduce(np.zeros(1), name="bench.sync")
        sync.fit(data, steps_per_epoch=args.block + 1, epochs=1, verbose=0, callbacks=[Timer("sync")])
    step_local = statistics.median(times["local"])
    step_dist = statistics.median(times["dist"])
    # Each rank's own plain step: the two often run at different speeds on a shared VM (efficiency above
    # uses rank 0's, as a user timing one process would).
    mine = np.array([step_local, statistics.median(times["sync"])])
    local_steps = hvd.allgather(mine, name="bench.medians").numpy()
    if hvd.rank() == 0:
        print(RESULT + json.dumps({"np": hvd.size(), "params": local.count_params(), "batch": args.batch,
                                   "model": args.model, "load": os.getloadavg(),
                                   "local_step_s": step_local, "dist_step_s": step_dist,
                                   "single_samples_per_s": args.batch / step_local,
                                   "np_samples_per_s": hvd.size() * args.batch / step_dist,
                                   "efficiency": step_local / step_dist,
                                   "local_steps_s": local_steps[0::2].tolist(),
                                   "sync_step_s": float(local_steps[1::2].max()),
                                   "local_cpu_s": statistics.median(cpu["local"]),
                                   "dist_cpu_s": statistics.median(cpu["dist"]),
                                   "shm_region_bytes": shm_region_bytes()}), flush=True)


def shm_region_bytes() -> int | None:
    """The region size the job's shared-memory allreduces kept (horovod/transport/shm_trials.py)."""
    from horovod.common.basics import engine

    return getattr(engine()._comms.get(0), "large_region_bytes", None)


def launch(np_: int, args, paired: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model, "--batch", str(args.batch),
           "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--block",
           str(args.block)] + (["--fp16"] if args.fp16 else []) + (["--paired"] if paired else [])
    if np_ > 1:
        cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_)] + cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.update(kv.split("=", 1) for kv in args.env)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in out.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"np={np_} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--model", choices=["cnn", "dense"], default="cnn")
    parser.add_argument("--batch", type=int, default=0, help="samples per rank per step (default 32 cnn, 64 dense)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternations (paired: of fit blocks)")
    parser.add_argument("--block", type=int, default=5, help="paired: timed steps per fit block")
    parser.add_argument("--separate", action="store_true", help="separate np=1 and np=N launches")
    parser.add_argument("--paired", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fp16", action="store_true", help="fp16 gradient compression")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="a knob for the ranks, e.g. HOROVOD_SHM_REGION_BYTES=2097152 (repeatable; the "
                             "caller's HOROVOD_* variables are not passed on)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.batch = args.batch or (64 if args.model == "dense" else 32)
    if not args.separate:
        load = os.getloadavg()[0]
        r = launch(args.np, args, paired=True)
        print(f"Keras fit, {args.model}, ~{r['params'] / 1e6:.1f} M params, batch {args.batch}/rank, "
              f"1 thread/process, paired, load average {load:.1f} -> {r['load'][0]:.1f}")
        print(f"{'contender':<28}{'samples/s':>12}{'step ms':>10}{'CPU ms/step (rank 0)':>22}")
        print(f"{'2 x single process':<28}{2 * r['single_samples_per_s']:>12.1f}{r['local_step_s'] * 1e3:>10.1f}"
              f"{r['local_cpu_s'] * 1e3:>22.1f}")
        print(f"{f'np={args.np} DistributedOptimizer':<28}{r['np_samples_per_s']:>12.1f}"
              f"{r['dist_step_s'] * 1e3:>10.1f}{r['dist_cpu_s'] * 1e3:>22.1f}")
        print(f"scaling efficiency: {r['efficiency']:.3f}  (rank 0's plain step; the ranks' own plain steps "
              f"{' / '.join(f'{t * 1e3:.1f}' for t in r['local_steps_s'])} ms; synchronous with a free gradient "
              f"allreduce: {r['sync_step_s'] * 1e3:.1f} ms, efficiency {r['local_step_s'] / r['sync_step_s']:.3f}; "
              f"np={args.np} / synchronous bound: {r['sync_step_s'] / r['dist_step_s']:.3f}; shared-memory "
              f"regions kept: {r['shm_region_bytes']} bytes)")
        print(json.dumps({"benchmark": "keras_training", "mode": "paired", "fp16": args.fp16, **r}))
        return
    single, multi = [], []
    for _ in range(args.rounds):
        single.append(launch(1, args))
        multi.append(launch(args.np, args))
    s = statistics.median(r["samples_per_s"] for r in single)
    m = statistics.median(r["samples_per_s"] for r in multi)
    eff = m / (args.np * s)
    print(f"Keras fit, {args.model}, ~{single[0]['params'] / 1e6:.1f} M params, batch {args.batch}/rank, "
          "1 thread/process")
    print(f"{'run':<12}{'samples/s':>12}{'step ms':>10}")
    print(f"{'np=1':<12}{s:>12.1f}{statistics.median(r['step_s'] for r in single) * 1e3:>10.1f}")
    print(f"{f'np={args.np}':<12}{m:>12.1f}{statistics.median(r['step_s'] for r in multi) * 1e3:>10.1f}")
    print(f"scaling efficiency np={args.np} / ({args.np} x np=1): {eff:.3f}")
    print(json.dumps({"benchmark": "keras_training", "model": args.model, "np": args.np, "batch": args.batch,
                      "fp16": args.fp16,
                      "single_samples_per_s": s, "np_samples_per_s": m, "efficiency": eff,
                      "params": single[0]["params"]}))


if __name__ == "__main__":
    main()
