"""Faults, driven from outside the job (not in lockstep): stalls, a killed rank, an early exit, the timeline.

Each test launches a small script with ``python -m horovod.runner`` and checks what every rank reported,
that the job ended within a deadline, and that nothing was left behind (processes, /dev/shm files).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest
from launch_util import clean_env, launch, marked_processes

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

SHUT_DOWN_PREFIX = "Horovod has been shut down."


def _dev_shm() -> set[str]:
    """Files in /dev/shm, minus those of other programs that may run meanwhile (Open MPI's segments)."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    # Horovod's segments are memfds (never in /dev/shm); Python multiprocessing semaphores (sem.mp-*) belong to
    # other programs on the machine (torch, Spark workers), as Open MPI's segments do.
    return {n for n in names if not n.startswith(("vader_segment", "sm_segment", "psm", "ompi", "sem.mp-"))}


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent("""\
        import json, os, signal, sys, time
        import numpy as np
        import horovod.numpy as hvd
        OUT = sys.argv[1]

        def report(**kw):
            with open(os.path.join(OUT, f"rank{hvd.rank()}.json"), "w") as f:
                json.dump(kw, f)
        """) + textwrap.dedent(body))
    return str(path)


def _reports(tmp_path, size):
    out = {}
    for r in range(size):
        p = tmp_path / f"rank{r}.json"
        if p.exists():
            out[r] = json.loads(p.read_text())
    return out


def _run(tmp_path, np_, body, timeout=90.0, **env):
    script = _script(tmp_path, body)
    before = _dev_shm()
    code, out, marker = launch(np_, [sys.executable, script, str(tmp_path)], env=clean_env(**env), timeout=timeout)
    leftovers = marked_processes(marker)
    new_shm = _dev_shm() - before
    print(out)
    assert code is not None, f"the job did not finish within {timeout} s"
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not new_shm, f"new files in /dev/shm: {new_shm}"
    return code, out


def test_stalled_rank_is_reported_and_shuts_the_job_down(tmp_path):
    body = """
        hvd.init()
        t0 = time.monotonic()
        if hvd.rank() == 1:
            # never submits "stalled.tensor"; submits another only once rank 0 has its stall error
            while not os.path.exists(os.path.join(OUT, "rank0.json")) and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            try:
                hvd.allreduce(np.ones(2), name="late")
                report(ok=True)
            except Exception as e:
                report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0)
            sys.exit(1)
        try:
            hvd.allreduce(np.ones(2), name="stalled.tensor")
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0)
        while time.monotonic() - t0 < 30:  # let rank 1 report before the launcher stops it
            try:
                with open(os.path.join(OUT, "rank1.json")) as f:
                    json.load(f)
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        sys.exit(1)
    """
    code, out = _run(tmp_path, 2, body, HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="3")
    assert code != 0
    reports = _reports(tmp_path, 2)
    assert set(reports) == {0, 1}, out
    r0 = reports[0]
    assert "error" in r0, r0
    assert r0["error"].startswith(SHUT_DOWN_PREFIX)
    assert "rank 1" in r0["error"] and "stalled.tensor" in r0["error"]
    assert r0["elapsed"] < 10.0
    assert reports[1]["error"].startswith(SHUT_DOWN_PREFIX)
    assert "Missing ranks:" in out and "stalled.tensor" in out


def _kill_rank_1_then(attempt: str, extra: str = "") -> str:
    """The end of a job body: rank 1 is SIGKILLed after a barrier, the others time ``attempt`` (one line) and
    report its error, then exit non-zero.  Follows a dedented body."""
    return textwrap.dedent(f"""\
        if hvd.rank() == 1:
            hvd.barrier()
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.barrier()
        t0 = time.monotonic()
        try:
            {attempt}
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0, {extra})
        sys.exit(1)
    """)


def test_killed_rank_fails_the_others_quickly(tmp_path):
    body = textwrap.dedent("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the launcher's SIGTERM to report
        hvd.init()
        for i in range(3):
            hvd.allreduce(np.ones(100_000, np.float32), name=f"warmup.{i}")
    """) + _kill_rank_1_then("hvd.allreduce(np.ones(100_000, np.float32), name='after.kill')")
    code, out = _run(tmp_path, 3, body)
    assert code != 0
    reports = _reports(tmp_path, 3)
    assert 1 not in reports
    for r in (0, 2):
        assert r in reports, out
        assert reports[r].get("error", "").startswith(SHUT_DOWN_PREFIX), reports[r]
        assert reports[r]["elapsed"] < 5.0


def test_killed_rank_fails_a_tensorflow_training_step_quickly(tmp_path):
    """``tf.function`` + ``DistributedGradientTape`` over 120 gradient tensors (small ones concatenated in the
    graph, large ones read in place, requests sent by the submit op itself): when a rank is killed between
    steps, the next step fails on the others within seconds with the shutdown error, and nothing is left."""
    body = textwrap.dedent("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the launcher's SIGTERM to report
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import tensorflow as tf
        import horovod.tensorflow as hvd
        hvd.init()
        shapes = [(64, 32) if i % 3 else (70_000,) for i in range(120)]
        variables = [tf.Variable(tf.fill(s, float(i % 7))) for i, s in enumerate(shapes)]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * v) for v in variables]) * float(hvd.rank() + 1)
            grads = hvd.DistributedGradientTape(tape).gradient(loss, variables)
            for v, g in zip(variables, grads):
                v.assign_sub(0.001 * g)
            return grads[1][0, 0]
        for _ in range(3):
            step()
        # the averaged gradient of 2 * (rank + 1) * v: (size + 1) * v on every rank
        expected = (hvd.size() + 1) * float(variables[1][0, 0].numpy())
        got = float(step().numpy())
    """) + _kill_rank_1_then("[step() for _ in range(3)]", "got=got, expected=expected")
    code, out = _run(tmp_path, 3, body, timeout=180.0, OMP_NUM_THREADS="1")
    assert code != 0
    reports = _reports(tmp_path, 3)
    assert 1 not in reports
    for r in (0, 2):
        assert r in reports, out
        assert SHUT_DOWN_PREFIX in reports[r].get("error", ""), reports[r]
        assert reports[r]["elapsed"] < 10.0, reports[r]
        assert abs(reports[r]["got"] - reports[r]["expected"]) < 1e-3 * abs(reports[r]["expected"]), reports[r]


def test_rank_exiting_early_fails_the_next_collective(tmp_path):
    body = """
        hvd.init()
        hvd.allreduce(np.ones(2), name="together")
        if hvd.rank() == 1:
            sys.exit(0)  # normal exit: atexit shuts Horovod down
        time.sleep(1.0)
        t0 = time.monotonic()
        try:
            hvd.allreduce(np.ones(2), name="after.exit")
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0)
    """
    code, out = _run(tmp_path, 2, body, timeout=60.0)
    reports = _reports(tmp_path, 2)
    assert 0 in reports, out
    assert reports[0].get("error", "").startswith(SHUT_DOWN_PREFIX), reports[0]
    assert reports[0]["type"] == "ShutdownError"
    assert reports[0]["elapsed"] < 5.0
    assert code == 0


def test_an_uncaught_exception_is_named_on_the_other_ranks(tmp_path):
    """A rank ending with an uncaught exception: the others' errors say which exception, not only that the
    rank "called shutdown()" (its atexit did)."""
    body = """
        hvd.init()
        hvd.allreduce(np.ones(2), name="together")
        if hvd.rank() == 1:
            raise KeyError("no such column 'label'")
        try:
            hvd.allreduce(np.ones(2), name="after.raise")
            report(ok=True)
        except Exception as e:
            report(error=str(e))
    """
    code, out = _run(tmp_path, 3, body, timeout=60.0)
    reports = _reports(tmp_path, 3)
    for r in (0, 2):
        assert reports[r]["error"].endswith("Cause: rank 1 exited with an uncaught KeyError: \"no such column "
                                            "'label'\""), reports[r]
    assert code != 0


def test_grouped_lists_of_different_lengths_end_the_job_within_seconds(tmp_path):
    """Rank 2 groups 2 gradients, ranks 0 and 1 group 3 (a model that differs on one rank): the names never
    matched, and the job hung until the stall deadline (300 s; upstream: forever).  Every rank now raises the
    same error at once and, uncaught, it ends the job cleanly."""
    body = """
        hvd.init()
        hvd.grouped_allreduce([np.ones(4)] * 3, name="grads")  # a first step that matches (then cached)
        t0 = time.monotonic()
        try:
            hvd.grouped_allreduce([np.ones(4)] * (2 if hvd.rank() == 2 else 3), name="grads")
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0)
            raise
    """
    t0 = time.monotonic()
    code, out = _run(tmp_path, 3, body, timeout=60.0)
    assert time.monotonic() - t0 < 30, "the job took too long to end"
    reports = _reports(tmp_path, 3)
    assert sorted(reports) == [0, 1, 2], out
    for r in range(3):
        assert reports[r]["type"] == "PreconditionError", reports[r]
        assert reports[r]["error"] == (
            "Mismatched grouped ALLREDUCE sizes for grads: ranks 0 and 1 sent a group of 3 tensors, but rank 2 sent "
            "a group of 2 tensors. Every rank must pass the same number of tensors to a grouped collective of one "
            "name."), reports[r]
        assert reports[r]["elapsed"] < 15, reports[r]
    assert code != 0


@pytest.mark.parametrize("differ", ["extra_layers", "frozen_layer", "extra_large_layer"])
def test_torch_models_with_other_parameters_end_the_job_within_seconds(tmp_path, differ):
    """``DistributedOptimizer`` over a 40-block model where the last rank's model differs in its parameters: two
    blocks more (all in small-gradient buckets), a block frozen, or one more large layer (reduced alone).  Their
    gradients are reduced under names the other ranks never send, and the job waited forever, the stall warning
    naming them every minute.  Every rank now fails the first step at once, naming the mismatch."""
    pytest.importorskip("torch")
    body = f"""
        import torch
        import horovod.torch as hvd
        hvd.init()
        last = hvd.rank() == hvd.size() - 1
        differ = {differ!r}
        blocks = 40 + (2 if last and differ == "extra_layers" else 0)
        layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)) for _ in range(blocks)]
        if last and differ == "extra_large_layer":
            layers.append(torch.nn.Linear(16, 40_000))
        model = torch.nn.Sequential(*layers)
        if last and differ == "frozen_layer":
            model[3].requires_grad_(False)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        t0 = time.monotonic()
        try:
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0)
            raise
    """
    t0 = time.monotonic()
    code, out = _run(tmp_path, 3, body, timeout=90.0, OMP_NUM_THREADS="1")
    assert time.monotonic() - t0 < 60, "the job took too long to end"
    reports = _reports(tmp_path, 3)
    assert sorted(reports) == [0, 1, 2], out
    last_rank = {"extra_layers": 4 * 42, "frozen_layer": 4 * 40 - 4, "extra_large_layer": 4 * 40 + 2}[differ]
    for r in range(3):
        assert reports[r]["type"] == "PreconditionError", reports[r]
        count = last_rank if r == 2 else 4 * 40
        assert reports[r]["error"].startswith(
            "Mismatched parameters: the ranks' DistributedOptimizers do not reduce the same parameters; this "
            f"rank's {count} trainable parameters run from 0.0.weight to "), reports[r]
        assert reports[r]["elapsed"] < 15, reports[r]
    assert code != 0


@pytest.mark.parametrize("differ", ["extra_leading_layer", "renamed_first_module"])
def test_torch_models_whose_first_parameter_differs_end_the_job_within_seconds(tmp_path, differ):
    """Rank 1's model has one more layer before the others (``stem``), or its first module has another name
    (``inp`` for ``fc1``, same shapes).  The parameter check was named after the first parameter
    (``parameters_of.<first>``): the ranks sent differently named checks, neither ever matched, and the job
    stalled instead of failing.  The check's name is now the optimizer's creation ordinal, the same on every
    rank, and every rank raises the mismatch error at once."""
    pytest.importorskip("torch")
    body = f"""
        import collections
        import torch
        import horovod.torch as hvd
        hvd.init()
        odd = hvd.rank() == 1
        differ = {differ!r}
        layers = [("fc1", torch.nn.Linear(16, 16)), ("fc2", torch.nn.Linear(16, 4))]
        if odd and differ == "extra_leading_layer":
            layers.insert(0, ("stem", torch.nn.Linear(16, 16)))
        if odd and differ == "renamed_first_module":
            layers[0] = ("inp", layers[0][1])
        model = torch.nn.Sequential(collections.OrderedDict(layers))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        t0 = time.monotonic()
        try:
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__, elapsed=time.monotonic() - t0)
            raise
    """
    t0 = time.monotonic()
    code, out = _run(tmp_path, 2, body, timeout=60.0, OMP_NUM_THREADS="1")
    assert time.monotonic() - t0 < 45, "the job took too long to end"
    reports = _reports(tmp_path, 2)
    assert sorted(reports) == [0, 1], out
    odd_count, odd_first = {"extra_leading_layer": (6, "stem.weight"),
                            "renamed_first_module": (4, "inp.weight")}[differ]
    for r in range(2):
        assert reports[r]["type"] == "PreconditionError", reports[r]
        count, start = (odd_count, odd_first) if r == 1 else (4, "fc1.weight")
        assert reports[r]["error"].startswith(
            "Mismatched parameters: the ranks' DistributedOptimizers do not reduce the same parameters; this "
            f"rank's {count} trainable parameters run from {start} to fc2.bias."), reports[r]
        assert reports[r]["elapsed"] < 15, reports[r]
    assert code != 0


@pytest.mark.parametrize("prefixed", [False, True], ids=["same-names", "prefixed"])
def test_two_torch_optimizers_over_parameters_of_the_same_names(tmp_path, prefixed):
    """A GAN: a generator and a discriminator built alike, each with its ``DistributedOptimizer``; one backward
    pass reaches both models' parameters.  With the same parameter names, upstream's duplicate-name error did
    not say why; it now names the other optimizer and the fix (prefixes), and the job ends.  With prefixes
    both train, and the parameter check of each (named after its first parameter) never meets the other's."""
    pytest.importorskip("torch")
    body = f"""
        import torch
        import horovod.torch as hvd
        hvd.init()
        torch.manual_seed(0)
        G = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        D = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        og = hvd.DistributedOptimizer(torch.optim.SGD(G.parameters(), lr=0.1),
                                      named_parameters=G.named_parameters(prefix="G" if {prefixed} else ""))
        od = hvd.DistributedOptimizer(torch.optim.SGD(D.parameters(), lr=0.1),
                                      named_parameters=D.named_parameters(prefix="D" if {prefixed} else ""))
        try:
            for _ in range(3):
                og.zero_grad()
                od.zero_grad()
                D(G(torch.randn(4, 8, generator=torch.Generator().manual_seed(hvd.rank())))).sum().backward()
                og.step()
                od.step()
            report(ok=True, w=D[1].weight.sum().item())
        except Exception as e:
            report(error=str(e), type=type(e).__name__)
            raise
    """
    code, out = _run(tmp_path, 2, body, timeout=60.0, OMP_NUM_THREADS="1")
    reports = _reports(tmp_path, 2)
    if prefixed:
        assert code == 0 and [reports[r].get("ok") for r in (0, 1)] == [True, True], out
        assert reports[0]["w"] == reports[1]["w"], reports
        return
    assert code != 0
    hinted = [r for r in reports.values() if "another DistributedOptimizer reduces a parameter of this name; give "
              "each optimizer's parameters their own names, e.g. named_parameters=generator.named_parameters(" in
              r.get("error", "")]
    assert hinted, out  # the other rank may instead see this one's exit, named


def test_a_name_the_other_ranks_cannot_receive_is_refused_at_the_call(tmp_path):
    """A tensor name that is not a str or not encodable as UTF-8 (a lone surrogate, as os.fsdecode makes of a
    file name's stray byte): it reached the engine, whose next send to rank 0 failed, and every rank's
    operations failed with ShutdownError -- the job ended over one bad argument.  Now the call raises on the
    rank that made it, as upstream's ``name.encode()`` did, and the job goes on."""
    body = """
        hvd.init()
        errors = []
        for name in ("batch\\udcff.grad", b"bytes.name", 5):
            try:
                hvd.allreduce(np.ones(2), name=name)
                errors.append("no error")
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        try:
            hvd.grouped_allreduce([np.ones(2), np.ones(3)], name="group\\udcff")
            errors.append("no error")
        except ValueError as e:
            errors.append(f"{type(e).__name__}: {e}")
        got = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum, name="after.bad.names")
        report(errors=errors, after=got.tolist())
    """
    code, out = _run(tmp_path, 2, body, timeout=60.0)
    reports = _reports(tmp_path, 2)
    assert code == 0, out
    for rank in (0, 1):
        errors = reports[rank]["errors"]
        assert errors[0].startswith("ValueError: the tensor name 'batch\\udcff.grad' cannot be encoded as UTF-8 "
                                    "to be sent to the other ranks"), errors
        assert errors[1] == "TypeError: a tensor name must be a str, got bytes b'bytes.name'", errors
        assert errors[2] == "TypeError: a tensor name must be a str, got int 5", errors
        assert errors[3].startswith("ValueError: the tensor name 'group\\udcff' cannot be encoded"), errors
        assert reports[rank]["after"] == [3.0, 3.0]


def test_garbage_on_a_control_channel_is_named_as_such(tmp_path):
    """Bytes that are not a frame on rank 1's control channel (a broken rank, a stray write into its socket):
    rank 0 blamed rank 1 for having "exited or lost its connection" while it was alive.  Now its cause says
    that rank 1 sent a malformed control message, and what was wrong with it."""
    body = """
        from horovod.common import basics
        hvd.init()
        hvd.allreduce(np.ones(2), name="together")
        if hvd.rank() == 1:
            basics.engine().mesh.ctrl[0].sock.sendall(b"\\x00GARBAGE" * 4)
        try:
            hvd.allreduce(np.ones(2), name="after.garbage")
            report(ok=True)
        except Exception as e:
            report(error=str(e), type=type(e).__name__)
    """
    _run(tmp_path, 2, body, timeout=60.0)
    reports = _reports(tmp_path, 2)
    assert reports[0]["type"] == "ShutdownError", reports
    assert reports[0]["error"].endswith("Cause: rank 1 on host localhost sent a malformed control message: bad "
                                        "frame magic b'\\x00G' from rank 1"), reports[0]


def test_forked_child_of_a_rank_fails_at_once_and_leaves_the_rank_working(tmp_path):
    """A DataLoader worker (fork) that calls a collective: the child has the engine's state but not its threads,
    so the op waited forever (the loader with it).  Now it fails at once; the child exits normally (atexit) and
    the rank's own channels keep working."""
    body = """
        hvd.init()
        hvd.allreduce(np.ones(2), name="before.fork")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            t0 = time.monotonic()
            try:
                hvd.allreduce(np.ones(2), name="in.child")
                text = "no error"
            except RuntimeError as e:
                text = f"{e} after {time.monotonic() - t0:.1f} s; rank {hvd.rank()} of {hvd.size()}"
            os.write(write, text.encode())
            sys.exit(0)  # a normal exit: atexit's shutdown() must not touch the rank's channels
        os.close(write)
        child = os.read(read, 4096).decode()
        os.waitpid(pid, 0)
        got = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum, name="after.fork")
        report(child=child, after=got.tolist())
    """
    code, out = _run(tmp_path, 2, body, timeout=60.0)
    reports = _reports(tmp_path, 2)
    assert code == 0, out
    for rank in (0, 1):
        child = reports[rank]["child"]
        assert child.startswith(f"Horovod operations cannot run in a process forked from a Horovod rank (this "
                                f"process was forked from rank {rank}, pid "), child
        assert child.endswith(f"after 0.0 s; rank {rank} of 2"), child
        assert reports[rank]["after"] == [3.0, 3.0]


def test_a_child_with_a_ranks_environment_cannot_join_as_that_rank(tmp_path):
    """A 'spawn'/'forkserver' DataLoader worker re-running an unguarded main module calls hvd.init() with its
    rank's environment: it joined the running job's store as a second copy of the rank, and the job broke
    after the start timeout.  Now the copy fails at once, naming the fix, and the rank goes on."""
    body = """
        hvd.init()
        import subprocess
        t0 = time.monotonic()
        child = subprocess.run([sys.executable, "-c", "import horovod.numpy as hvd; hvd.init()"],
                               capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - t0
        got = hvd.allreduce(np.full(2, hvd.rank() + 1.0), op=hvd.Sum, name="after.child")
        report(code=child.returncode, err=child.stderr[-1500:], elapsed=elapsed, after=got.tolist(), pid=os.getpid())
    """
    code, out = _run(tmp_path, 2, body, timeout=60.0)
    reports = _reports(tmp_path, 2)
    assert code == 0, out
    for rank in (0, 1):
        r = reports[rank]
        assert r["code"] != 0, r
        assert (f"has the environment of rank {rank}, which process {r['pid']} already initialized: a second "
                "process cannot join the job as the same rank") in r["err"], r["err"]
        assert "if __name__ == '__main__':" in r["err"]
        assert r["elapsed"] < 20.0  # an interpreter start and an import, not the 30 s start timeout
        assert r["after"] == [3.0, 3.0]


def _timeline_records(path):
    with open(path) as f:
        return json.load(f)


def test_timeline_file(tmp_path):
    timeline = tmp_path / "timeline.json"
    body = """
        hvd.init()
        for _ in range(3):
            hvd.allreduce(np.ones(10), name="test_allreduce")
        hvd.allreduce(np.ones(300_000, np.float32), name="test_big_allreduce")
        hvd.allgather(np.ones((hvd.rank() + 1, 2)), name="test_allgather")
        hvd.broadcast(np.ones(3), 0, name="test_broadcast")
        hvd.barrier()
        report(ok=True)
    """
    code, out = _run(tmp_path, 2, body, HOROVOD_TIMELINE=str(timeline))
    assert code == 0, out
    records = _timeline_records(timeline)
    text = timeline.read_text()
    for needle in ("NEGOTIATE_ALLREDUCE", '"ALLREDUCE"', "test_allreduce", "test_big_allreduce", "ALLGATHER",
                   "BROADCAST", "start_time_since_epoch_in_micros"):
        assert needle in text, needle
    names = {r["args"]["name"] for r in records if r.get("name") == "process_name" and "name" in r.get("args", {})}
    assert {"test_allreduce", "test_big_allreduce", "test_allgather", "test_broadcast"} <= names
    ends = [r for r in records if r.get("ph") == "E" and "args" in r]
    assert any(r["args"].get("dtype") == "float32" and r["args"].get("shape") == "[300000]" for r in ends)


def test_dynamic_timeline(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    body = f"""
        hvd.init()
        hvd.allreduce(np.ones(4), name="before_start")
        hvd.start_timeline({str(first)!r})
        hvd.allreduce(np.ones(4), name="while_recording")
        hvd.stop_timeline()
        hvd.barrier()  # rank 0 has stopped before anyone submits the next tensor
        hvd.allreduce(np.ones(4), name="after_stop")
        hvd.start_timeline({str(second)!r}, mark_cycles=True)
        hvd.allreduce(np.ones(4), name="second_file")
        hvd.stop_timeline()
        report(ok=True)
    """
    code, out = _run(tmp_path, 2, body, HOROVOD_TIMELINE="DYNAMIC")
    assert code == 0, out
    text1 = first.read_text()
    _timeline_records(first)
    assert "while_recording" in text1 and "NEGOTIATE_ALLREDUCE" in text1
    assert "before_start" not in text1 and "after_stop" not in text1 and "second_file" not in text1
    text2 = second.read_text()
    _timeline_records(second)
    assert "second_file" in text2 and "while_recording" not in text2
    assert not (tmp_path / "DYNAMIC").exists()


def test_unnamed_ops_in_dynamic_sets_with_different_histories(tmp_path):
    # Engine bug 9: unnamed names come from one per-process counter, so members of a set whose histories
    # differ submit different names.  Expected: success (names agree within a set); today: a stall.
    body = """
        hvd.init()
        r = hvd.rank()
        for members in ([1, 2], [2, 3]):
            ps = hvd.add_process_set(members)
            if r in members:
                out = hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=ps)
                assert out.tolist() == [2.0, 2.0]
            hvd.remove_process_set(ps)
        report(ok=True)
    """
    code, out = _run(tmp_path, 4, body, timeout=60.0, HOROVOD_DYNAMIC_PROCESS_SETS="1",
                     HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="3")
    assert code == 0, out
    assert set(_reports(tmp_path, 4)) == {0, 1, 2, 3}
