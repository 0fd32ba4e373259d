"""A frozen rank (SIGSTOP) never hangs the job: every live rank gets an error naming it within the deadline.

Driven from outside like ``test_faults.py``: each case launches a small job with ``python -m horovod.runner``
in which one rank (the victim) stops itself with SIGSTOP -- while idle, while the others wait for it to
negotiate, or in the middle of a large TCP or shared-memory collective (hooks in the job script stop it
after part of the data moved) -- and checks that

* every live rank's collective fails with ``ShutdownError`` whose cause blames the victim and no other rank,
* within the documented deadline: ``HOROVOD_GLOO_TIMEOUT_SECONDS`` plus 2 s (keep-alive granularity and the
  coordinator settling the ranks' reports) of the moment the victim stopped or a rank began waiting for it,
  plus a margin for a loaded 2-core machine,
* the launcher exits non-zero and no process of the job is left (the stopped one included).
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest
from launch_util import clean_env, launch, marked_processes

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

OP_TIMEOUT = 3.0
DEADLINE = OP_TIMEOUT + 2.0  # docs/running.md, "Deadlines"
MARGIN = 3.0  # scheduling on a loaded 2-core machine
SHUT_DOWN_PREFIX = "Horovod has been shut down."

# The phrases that blame a rank: a silent control channel, a peer that timed out in a collective, a stall.
_BLAME = (re.compile(r"rank (\d+)(?: on host [^\s)]+)?\)? has been unresponsive"),
          re.compile(r"rank (\d+): timed out"),
          re.compile(r"rank (\d+) never submitted"))

_PRELUDE = """\
import json, os, signal, sys, threading, time
import numpy as np
import horovod.numpy as hvd

OUT, VICTIM = sys.argv[1], int(sys.argv[2])
hvd.init()
RANK = hvd.rank()
if RANK != VICTIM:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the launcher's SIGTERM long enough to report


def stop_me():
    with open(os.path.join(OUT, "stopped.json"), "w") as f:
        json.dump({"rank": RANK, "at": time.time()}, f)
    os.kill(os.getpid(), signal.SIGSTOP)


def attempt(fn):
    t0 = time.time()
    try:
        fn()
        out = {"ok": True}
    except Exception as e:
        out = {"type": type(e).__name__, "error": str(e)}
    out.update(start=t0, end=time.time())
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(out, f)
    sys.exit(1)


def stop_in_tcp_transfer():
    # Stop once half of a large receive arrived: the others are in the middle of sending to / receiving from us.
    import horovod.transport.tcp as tcp
    orig = tcp.exchange

    def exchange(sends, recvs, timeout, *spin):
        for t in recvs:
            if t.view.nbytes >= 1 << 20:
                inner, half = t.on_progress, t.view.nbytes // 2

                def progress(done, inner=inner, half=half):
                    if inner is not None:
                        inner(done)
                    if done >= half and tcp.exchange is exchange:
                        tcp.exchange = orig
                        stop_me()

                t.on_progress = progress
                break
        return orig(sends, recvs, timeout, *spin)

    tcp.exchange = exchange


def stop_in_shm_collective(after=4):
    # Stop before the 4th token round of a many-piece allreduce through the segments, or before the 4th copy
    # of one that goes member to member (the others then read and write a stopped process's memory).
    from horovod.transport.shm import ShmCommunicator
    calls = [0]

    def stopping(name):
        orig = getattr(ShmCommunicator, name)

        def hook(self, *args):
            calls[0] += 1
            if calls[0] == after:
                stop_me()
            return orig(self, *args)
        setattr(ShmCommunicator, name, hook)

    stopping("_signal")
    stopping("_copy")


BIG = np.arange(8 << 20, dtype=np.float32)  # 32 MiB: many socket buffers, many shm pieces
for i in range(3):
    hvd.allreduce(np.ones(1000, np.float32), name=f"warmup.{i}")
hvd.barrier()
"""

_CASES = {
    # rank 0 idle between collectives; the others then submit one
    "rank0_idle": ("0", """
        if RANK == VICTIM:
            stop_me()
        time.sleep(0.5)
        attempt(lambda: hvd.allreduce(np.ones(4), name="after.stop"))
    """),
    # the others wait in a collective that rank 0 has not submitted yet when it stops
    "rank0_negotiating": ("0", """
        if RANK == VICTIM:
            time.sleep(1.0)
            stop_me()
        attempt(lambda: hvd.allreduce(np.ones(4), name="never.submitted.by.0"))
    """),
    # rank 0 stops in the middle of a large TCP allreduce
    "rank0_mid_tcp": ("0", """
        if RANK == VICTIM:
            stop_in_tcp_transfer()
        attempt(lambda: hvd.allreduce(BIG, name="big"))
    """),
    # a non-zero rank stops in the middle of a large TCP allreduce (np=3: rank 1 sits in the middle of the ring)
    "mid_tcp": ("1", """
        if RANK == VICTIM:
            stop_in_tcp_transfer()
        attempt(lambda: hvd.allreduce(BIG, name="big"))
    """),
    # a non-zero rank stops in the middle of a shared-memory allreduce: member to member, and through the
    # segments (where the kernel refuses cross-memory copies)
    "mid_shm": ("last", """
        if RANK == VICTIM:
            stop_in_shm_collective()
        attempt(lambda: hvd.allreduce(BIG, name="big"))
    """),
    "mid_shm_segments": ("last", """
        if RANK == VICTIM:
            stop_in_shm_collective()
        attempt(lambda: hvd.allreduce(BIG, name="big"))
    """),
    # a non-zero rank stops while idle; the others wait for it (the stall shutdown alone would not end it:
    # 4 s is below the 60 s stall check time, so upstream's rule disables it)
    "idle_nonzero": ("last", """
        if RANK == VICTIM:
            stop_me()
        time.sleep(0.5)
        attempt(lambda: hvd.allreduce(np.ones(4), name="after.stop"))
    """),
    # a rank stops at an arbitrary moment of a training-like loop of mixed collectives
    "timer_tcp": ("1", """
        if RANK == VICTIM:
            threading.Timer(1.0, stop_me).start()

        def loop():
            deadline = time.monotonic() + 60
            i = 0
            while time.monotonic() < deadline:
                hvd.allreduce(BIG[: (1 << 20) * (1 + i % 4)], name=f"grad.{i % 4}")
                hvd.allgather(np.ones((RANK + 1, 3)), name="gather")
                hvd.broadcast(np.ones(1000), 0, name="bcast")
                i += 1

        attempt(loop)
    """),
}

_TCP_ONLY = {"rank0_mid_tcp", "mid_tcp", "timer_tcp"}
_SEGMENTS_ONLY = {"mid_shm_segments"}


def _culprits(text: str) -> set[int]:
    return {int(m.group(1)) for pattern in _BLAME for m in pattern.finditer(text)}


# A rank stopped inside a collective at both sizes (a 2-member exchange and a 3-member ring differ); the idle,
# negotiating and timer cases at 3 ranks only, where two live ranks must each name the stopped one.
_SIZES = [(case, np_) for case in sorted(_CASES) for np_ in ((2, 3) if "mid" in case else (3,))]


@pytest.mark.parametrize(("case", "np_"), _SIZES, ids=[f"{case}-{np_}" for case, np_ in _SIZES])
def test_stopped_rank_is_named_on_every_live_rank(tmp_path, case, np_):
    which, body = _CASES[case]
    victim = {"0": 0, "1": 1, "last": np_ - 1}[which]
    script = tmp_path / "job.py"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    env = clean_env(HOROVOD_GLOO_TIMEOUT_SECONDS=str(OP_TIMEOUT), HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="4")
    if case in _TCP_ONLY:
        env["HOROVOD_SHM_DISABLE"] = "1"
    if case in _SEGMENTS_ONLY:
        env["HOROVOD_SHM_CROSS_MEMORY"] = "0"
    code, out, marker = launch(np_, [sys.executable, str(script), str(tmp_path), str(victim)], env=env,
                               timeout=90.0)
    leftovers = marked_processes(marker)
    print(out)
    assert code is not None, "the job did not finish within 90 s"
    assert not leftovers, f"processes left behind: {leftovers}"
    assert code != 0
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert stopped["rank"] == victim
    for r in range(np_):
        if r == victim:
            assert not (tmp_path / f"rank{r}.json").exists()
            continue
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} reported nothing\n{out}"
        rep = json.loads(path.read_text())
        assert rep.get("type") == "ShutdownError", (r, rep)
        assert rep["error"].startswith(SHUT_DOWN_PREFIX), (r, rep)
        assert _culprits(rep["error"]) == {victim}, (r, rep["error"])
        waited = rep["end"] - max(rep["start"], stopped["at"])
        print(f"rank {r} reported after {waited:.1f} s: {rep['error'].partition(' Cause: ')[2]}")
        assert waited < DEADLINE + MARGIN, (r, waited, rep["error"])
