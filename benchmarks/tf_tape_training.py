"""TF2 custom training loop (``tf.function`` + ``hvd.DistributedGradientTape``) vs two independent processes.

The model is MobileNetV2 (``weights=None``, 32x32x3 inputs, 10 classes: 158 trainable tensors, 2.2 M
parameters), batch 8 per process, SGD, one TensorFlow thread per process (intra- and inter-op).  On a
host with fewer cores than ``2 x`` what the model could use, two processes slow each other down whether
they talk or not, so the bound for ``horovodrun -np 2`` is not twice one lone process but **two independent
single processes run at the same time**.  The ratio is

    np=2 samples/s / (samples/s of process A + samples/s of process B)    (median step times)

(paired mode: each rank's median plain step is one of the two processes; they often differ by 5-20% on a
shared VM, and the np=2 step cannot be shorter than the slower one's).

Default (paired): one ``horovodrun -np 2`` launch in which every rank holds three copies of the model and
alternates blocks of ``--block`` steps: a plain ``tf.function`` step that never talks to the other rank
(both ranks run it at the same time: the two independent processes), the same step with
``DistributedGradientTape``, and the plain step followed by a one-float allreduce before the update
(synchronous training whose gradient allreduce costs nothing: what any data-parallel step can reach on this
host, given that the ranks wait for the slower one).  Load from other jobs on a shared host hits all alike.
It also prints the minor page faults per step: glibc sometimes hands the top of its heap back to the system
after a step and faults it in again on the next (a tenth of the CPU when it does), whichever step it is.  ``--separate``
instead launches, per round, two plain ``python`` processes side by side and then ``horovodrun -np 2``
(whole processes, as a user would run them, but a minute apart: on a busy host rounds differ by 3x).

    python benchmarks/tf_tape_training.py                  # paired, prints a table and a JSON line
    python benchmarks/tf_tape_training.py --separate --rounds 3
    python benchmarks/tf_tape_training.py --pin            # every process bound to a core of its own
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from keras_training import shm_region_bytes  # benchmarks/, the script's directory

RESULT = "RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    if args.pin:  # before TensorFlow starts a thread: every thread of the process inherits the core
        allowed = sorted(os.sched_getaffinity(0))  # (a container's cpuset need not start at 0)
        os.sched_setaffinity(0, {allowed[int(os.environ.get("HOROVOD_RANK", args.seed)) % len(allowed)]})
    import tensorflow as tf

    if args.threads:  # 0: TensorFlow's default (a thread per core, intra- and inter-op)
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import keras
    import numpy as np

    hvd = None
    if args.horovod or args.paired:
        import horovod.tensorflow as hvd

        hvd.init()
    rank = hvd.rank() if hvd else args.seed
    keras.utils.set_random_seed(0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.normal(size=(args.batch, 32, 32, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, size=args.batch))

    def make_step(mode: str):
        """A compiled training step of a fresh model (its variables broadcast when it talks to the other rank).

        ``local``: never talks; ``dist``: ``DistributedGradientTape``; ``sync``: local gradients, then a one-float
        allreduce before they are applied -- synchronous training with a gradient allreduce that costs nothing,
        the best any data-parallel step can do on this host."""
        model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
        opt = keras.optimizers.SGD(0.01)

        @tf.function
        def train_step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if mode == "dist":
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            if mode == "sync":
                with tf.control_dependencies(grads):
                    done = hvd.allreduce(tf.zeros([1]), name="bench.lockstep")
                with tf.control_dependencies([done]):
                    grads = [tf.identity(g) for g in grads]
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        train_step()  # builds the optimizer's variables before they are broadcast
        if mode != "local":
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return train_step, model

    cpu: list[float] = []  # CPU seconds per step, all threads of this process, in the order run

    def timed(step, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start, start_cpu = time.perf_counter(), time.process_time()
            step().numpy()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return times

    if args.paired:
        steps = {key: make_step(key) for key in ("local", "sync", "dist")}
        model = steps["local"][1]
        times: dict[str, list[float]] = {key: [] for key in steps}
        cpus: dict[str, list[float]] = {key: [] for key in steps}
        faults = dict.fromkeys(steps, 0)  # minor page faults: glibc handing memory back and taking it again
        for step, _ in steps.values():
            timed(step, args.warmup)
        for _ in range(args.rounds):
            for key, (step, _) in steps.items():
                hvd.allreduce(tf.zeros(1), name="bench.sync")  # every block starts together on both ranks
                cpu.clear()
                faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                times[key] += timed(step, args.block)
                faults[key] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
                cpus[key] += cpu
        mine = [statistics.median(times["local"]), statistics.median(times["dist"]),
                statistics.median(cpus["local"]), statistics.median(cpus["dist"]), statistics.median(times["sync"]),
                faults["local"] / len(times["local"]), faults["dist"] / len(times["dist"])]
        every = hvd.allgather(tf.constant([mine], tf.float64), name="bench.medians").numpy()  # one row per rank
        # The i-th plain steps of both ranks ran at about the same time: had they waited for each other (with
        # a free allreduce), each would have taken the longer of the two.
        plain = hvd.allgather(tf.constant([times["local"]], tf.float64), name="bench.plain").numpy()
        if rank == 0:
            print(RESULT + json.dumps({"local_step_s": every[:, 0].tolist(), "dist_step_s": every[:, 1].tolist(),
                                       "lockstep_s": statistics.median(plain.max(axis=0).tolist()),
                                       "sync_step_s": every[:, 4].tolist(),
                                       "local_faults": every[:, 5].tolist(), "dist_faults": every[:, 6].tolist(),
                                       "local_cpu_s": every[0, 2], "dist_cpu_s": every[0, 3],
                                       "tensors": len(model.trainable_variables), "params": model.count_params(),
                                       "load": os.getloadavg()[0],
                                       "shm_region_bytes": shm_region_bytes()}), flush=True)
        return
    step, model = make_step("dist" if args.horovod else "local")
    times_ = timed(step, args.warmup + args.steps)[args.warmup:]
    if not args.horovod or rank == 0:
        print(RESULT + json.dumps({"step_s": statistics.median(times_), "tensors": len(model.trainable_variables),
                                   "params": model.count_params()}), flush=True)


def _env(threads: int, knobs: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") and k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.update(kv.split("=", 1) for kv in knobs)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _threads(args: argparse.Namespace) -> str:
    return f"{args.threads} thread(s)/process" if args.threads else "TensorFlow's default threads"


def _result(proc: subprocess.Popen, what: str) -> dict:
    out, err = proc.communicate(timeout=900)
    for line in out.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"{what} failed:\n{out[-3000:]}\n{err[-3000:]}")


def _start(args: argparse.Namespace, extra: list[str], horovod: bool) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(args.batch), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--block",
           str(args.block), "--threads", str(args.threads), *(["--pin"] if args.pin else []), *extra]
    if horovod:
        cmd = [sys.executable, "-m", "horovod.runner", "-np", "2", *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(args.threads, args.env))


def one_round(args: argparse.Namespace) -> dict:
    """Two independent single processes at the same time, then ``horovodrun -np 2``."""
    load = os.getloadavg()[0]
    pair = [_start(args, ["--seed", str(i)], False) for i in range(2)]
    singles = [_result(p, "single process") for p in pair]
    dist = _result(_start(args, ["--horovod"], True), "horovodrun -np 2")
    bound = sum(args.batch / s["step_s"] for s in singles)
    np2 = 2 * args.batch / dist["step_s"]
    return {"load": load, "single_step_s": [s["step_s"] for s in singles], "dist_step_s": dist["step_s"],
            "bound_samples_per_s": bound, "np_samples_per_s": np2, "ratio": np2 / bound,
            "tensors": dist["tensors"], "params": dist["params"]}


def paired(args: argparse.Namespace) -> None:
    """One ``horovodrun -np 2`` launch alternating plain and distributed blocks on every rank."""
    load = os.getloadavg()[0]
    r = _result(_start(args, ["--paired"], True), "horovodrun -np 2 (paired)")
    # Each process's own samples/s, summed: the two plain processes run at their own (often different) speeds.
    bound = sum(args.batch / s for s in r["local_step_s"])
    np2 = sum(args.batch / s for s in r["dist_step_s"])
    lockstep = 2 * args.batch / r["lockstep_s"]
    sync = sum(args.batch / s for s in r["sync_step_s"])

    def ms(steps: list[float]) -> str:
        return " / ".join(f"{s * 1e3:.1f}" for s in steps)
    print(f"tf.function + DistributedGradientTape, MobileNetV2 32x32: {r['tensors']} trainable tensors, "
          f"{r['params'] / 1e6:.1f} M params, batch {args.batch}/process, {_threads(args)}, paired "
          f"({args.rounds} x {args.block} steps each), load average {load:.1f} -> {r['load']:.1f}")
    print(f"two concurrent single processes: {bound:.1f} samples/s ({ms(r['local_step_s'])} ms/step, "
          f"CPU {r['local_cpu_s'] * 1e3:.1f} ms/step on rank 0)")
    print(f"horovodrun -np 2:                {np2:.1f} samples/s ({ms(r['dist_step_s'])} ms/step, "
          f"CPU {r['dist_cpu_s'] * 1e3:.1f} ms/step on rank 0)")
    print(f"local gradients + one-float allreduce: {sync:.1f} samples/s ({ms(r['sync_step_s'])} ms/step)")
    print("page faults per step, plain / np=2: " + ", ".join(
        f"rank {i} {a:.0f} / {b:.0f}" for i, (a, b) in enumerate(zip(r["local_faults"], r["dist_faults"]))))
    print(f"np=2 / two concurrent single processes: {np2 / bound:.3f}  (synchronous with a free gradient "
          f"allreduce: {sync / bound:.3f}; the i-th plain steps' longer one: {lockstep / bound:.3f}; "
          f"np=2 / synchronous bound: {np2 / sync:.3f}; shared-memory regions kept: {r['shm_region_bytes']} "
          "bytes)")
    print(json.dumps({"benchmark": "tf_tape_training", "mode": "paired", "batch": args.batch, "ratio": np2 / bound,
                      "lockstep_ratio": lockstep / bound, "sync_ratio": sync / bound,
                      "bound_samples_per_s": bound, "np_samples_per_s": np2,
                      "load": [load, r["load"]],
                      "local_cpu_ms": r["local_cpu_s"] * 1e3, "dist_cpu_ms": r["dist_cpu_s"] * 1e3,
                      "local_faults": r["local_faults"], "dist_faults": r["dist_faults"],
                      "tensors": r["tensors"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6, help="alternations (paired: of step blocks; "
                        "--separate: of launches)")
    parser.add_argument("--block", type=int, default=10, help="paired: timed steps per block")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per process, intra- and "
                        "inter-op (0: TensorFlow's default, one per core)")
    parser.add_argument("--separate", action="store_true", help="separate launches instead of paired blocks")
    parser.add_argument("--pin", action="store_true", help="each process on a core of its own (rank, or the "
                        "single process's index, modulo the cores it may use), as mpirun binds at np <= 2")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="a knob for the ranks, e.g. HOROVOD_SHM_REGION_BYTES=2097152 (repeatable; the "
                             "caller's HOROVOD_* variables are not passed on)")
    parser.add_argument("--paired", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--horovod", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.separate:
        paired(args)
        return
    rounds = [one_round(args) for _ in range(args.rounds)]
    first = rounds[0]
    print(f"tf.function + DistributedGradientTape, MobileNetV2 32x32: {first['tensors']} trainable tensors, "
          f"{first['params'] / 1e6:.1f} M params, batch {args.batch}/process, {_threads(args)}")
    print("| round | load avg | single A / B step ms | 2 singles samples/s | np=2 step ms | np=2 samples/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rounds, 1):
        a, b = (s * 1e3 for s in r["single_step_s"])
        print(f"| {i} | {r['load']:.1f} | {a:.1f} / {b:.1f} | {r['bound_samples_per_s']:.1f} | "
              f"{r['dist_step_s'] * 1e3:.1f} | {r['np_samples_per_s']:.1f} | {r['ratio']:.3f} |")
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"np=2 / two concurrent single processes: {ratio:.3f} (median of {len(rounds)} rounds)")
    print(json.dumps({"benchmark": "tf_tape_training", "batch": args.batch, "ratio": ratio, "rounds": rounds}))


if __name__ == "__main__":
    main()
