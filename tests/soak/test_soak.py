"""Soak: thousands of random collectives at np=4, then elastic jobs under kill -9 and SIGSTOP; nothing leaks.

* ``test_collectives_soak`` runs ``soak_worker.py`` (see its docstring) under ``python -m horovod.runner -np 4``,
  once with the default transport (shared memory) and knobs, once over TCP with a 4-entry response cache and a
  64 KiB fusion buffer, and checks every rank's summary, then that no process, socket (TCP connection,
  abstract AF_UNIX name, the rendezvous listener), memfd or /dev/shm file of the job is left, and that this
  process holds no more descriptors than before.
* ``test_elastic_rounds`` runs the elastic numpy job of ``tests/elastic`` on two local hosts with a blacklist
  cooldown, so a failed host comes back: each round kills a random worker with SIGKILL (twice, waiting for the
  replacement in between) or SIGSTOPs one (the driver must find it hung, kill it and replace it), and ends with
  every sample processed exactly once per epoch and nothing left running.

Knobs (environment):
  HOROVOD_TEST_SOAK_SEED   the schedule's seed (default: a new one per run, printed; rerun a failure with it)
  HOROVOD_TEST_SOAK_STEPS  steps of the collectives soak (default 2000, about 15 s on two busy cores; the TCP
                      run does half)
  HOROVOD_TEST_SOAK_SCALE  multiplies the steps and the elastic rounds (default 1), e.g. 20 for a soak of 20-30 minutes
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from elastic.conftest import ElasticJob
from launch_util import clean_env, launch, marked_processes

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")

HERE = Path(__file__).resolve().parent
NP = 4
SCALE = max(1, int(os.environ.get("HOROVOD_TEST_SOAK_SCALE") or 1))
STEPS = int(os.environ.get("HOROVOD_TEST_SOAK_STEPS") or 2000) * SCALE
SEED = int(os.environ.get("HOROVOD_TEST_SOAK_SEED") or secrets.randbelow(1 << 31))
# Kinds every CI-sized run must have exercised (the rarer ones only once the run is long enough to expect them).
COMMON_KINDS = {"allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
                "reducescatter", "grouped_reducescatter", "barrier", "objects", "batch", "repeat"}
RARE_KINDS = {"join", "mismatch", "reinit", "ps.add"}


def _dev_shm() -> set[str]:
    """Files in /dev/shm, minus those of other programs that may run meanwhile (Open MPI's segments, Python
    multiprocessing's semaphores); the job itself uses memfds and must add nothing here."""
    try:
        return {n for n in os.listdir("/dev/shm")
                if not n.startswith(("vader_segment", "sm_segment", "psm", "ompi", "sem.mp-"))}
    except FileNotFoundError:
        return set()


def _reproduce(seed: int, steps: int, env: dict[str, str]) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in env.items())
    return (f"seed {seed}: rerun with {knobs} python -m horovod.runner -np {NP} python tests/soak/soak_worker.py "
            f"OUT_DIR {seed} {steps}")


def _memfd_holders(pids: set[int]) -> list[str]:
    """Descriptors or mappings of memfd segments in the given (should-be-dead) processes."""
    found = []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                maps = [line for line in f if "/memfd:" in line]
        except OSError:
            continue  # gone
        found += [f"{pid}: {x.strip()}" for x in links + maps if "memfd:" in x]
    return found


# The default transport and knobs; then TCP only with a tiny response cache (evictions all the time) and a
# small fusion buffer (many fused batches), on half the steps.
CONFIGS = {
    "shm": ({}, STEPS, SEED),
    "tcp-tiny-cache": ({"HOROVOD_SHM_DISABLE": "1", "HOROVOD_CACHE_CAPACITY": "4",
                        "HOROVOD_FUSION_THRESHOLD": "65536"}, STEPS // 2, SEED + 1),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_collectives_soak(tmp_path, config):
    knobs, steps, seed = CONFIGS[config]
    own = psutil.Process()
    fds_before = own.num_fds()
    shm_before = _dev_shm()
    timeout = 90.0 + steps * 0.03
    started = time.monotonic()
    code, out, marker = launch(NP, [sys.executable, str(HERE / "soak_worker.py"), str(tmp_path), str(seed),
                                    str(steps)], env=clean_env(OMP_NUM_THREADS="1", **knobs), timeout=timeout)
    elapsed = time.monotonic() - started
    how = _reproduce(seed, steps, knobs)
    failures = [line for line in out.splitlines() if "SOAK FAILURE" in line]
    assert code is not None, f"the soak did not finish within {timeout:.0f} s; {how}\n{out[-8000:]}"
    assert code == 0, f"the soak failed (exit status {code}); {how}\n" + "\n".join(failures) + f"\n{out[-8000:]}"
    print(f"soak {config}: {steps} steps, seed {seed}, {elapsed:.1f} s")

    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NP)}
    ops = 0
    for r, rep in reports.items():
        assert rep["seed"] == seed and rep["steps"] == steps, rep
        kinds = rep["kinds"]
        missing = COMMON_KINDS - set(kinds)
        assert not missing, f"rank {r} never ran {missing} in {steps} steps: {kinds}"
        if steps >= 2000:
            assert not RARE_KINDS - set(kinds), f"rank {r} never ran {RARE_KINDS - set(kinds)}: {kinds}"
        assert rep["generations"] == kinds.get("reinit", 0) + 1 >= 2, rep
        assert len(rep["dtypes"]) >= 10, f"rank {r} covered only {sorted(rep['dtypes'])}"
        ops += sum(v for k, v in kinds.items() if k in COMMON_KINDS - {"batch"})
        # the worker checked this after every shutdown(); check its record independently
        before = rep["census_before_init"]
        for census in rep["census_after_shutdown"]:
            for kind in ("socket", "memfd", "memfd_maps", "threads"):
                assert census.get(kind, 0) <= before.get(kind, 0), (r, kind, census, before)
            assert census == rep["census_after_shutdown"][0], (r, rep["census_after_shutdown"])
        assert len(rep["census_after_shutdown"]) == rep["generations"], rep
    assert ops >= steps, f"only {ops} collectives ran in {steps} steps"
    print(f"soak: {ops} checked collectives over {NP} ranks; rank 0: {reports[0]['kinds']}")

    # nothing of the job is left: processes, memfds, sockets, /dev/shm files, descriptors of this process
    pids = {rep["pid"] for rep in reports.values()}
    deadline = time.monotonic() + 10
    while (marked_processes(marker) or any(psutil.pid_exists(p) for p in pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = marked_processes(marker)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert not _memfd_holders(pids), _memfd_holders(pids)
    conns = {(*c.laddr, *c.raddr) for c in psutil.net_connections(kind="inet") if c.raddr and c.pid}
    job_tcp = {tuple(t) for rep in reports.values() for t in rep["tcp"]}
    assert not conns & job_tcp, f"TCP connections of the job still open: {conns & job_tcp}"
    unix = {c.laddr for c in psutil.net_connections(kind="unix") if c.laddr}
    job_unix = {name for rep in reports.values() for name in rep["unix_names"]}
    assert bool(job_unix) == (config == "shm"), f"AF_UNIX listeners: {job_unix}"
    assert not unix & job_unix, f"abstract sockets of the job still open: {unix & job_unix}"
    rendezvous = re.search(r"rendezvous [\d.]+:(\d+)", out)
    assert rendezvous, out[:2000]
    port = int(rendezvous.group(1))
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid in pids | {None}]
    assert not listening, f"the rendezvous port {port} is still listening: {listening}"
    assert _dev_shm() - shm_before == set(), f"new files in /dev/shm: {_dev_shm() - shm_before}"
    assert own.num_fds() == fds_before, f"this process had {fds_before} descriptors, now {own.num_fds()}"


# ------------------------------------------------------------------------------------------------ elastic
TWO_HOSTS = ["localhost:1", "127.0.0.1:1"]
SLOTS = ["localhost:0", "127.0.0.1:0"]
# Cooldown: a failed host is blacklisted for 1-2 s, then discovery brings it back and a new worker replaces
# the lost one.
ARGS = ["-np", "2", "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "1", "2"]
ROUNDS = [("kill", 2)] * SCALE + [("stop", 1)] * SCALE  # (one kill round by default: suite time)


@pytest.mark.parametrize("round_", range(len(ROUNDS)), ids=[f"{k}{i}" for i, (k, _) in enumerate(ROUNDS)])
def test_elastic_rounds(tmp_path, round_):
    kind, faults = ROUNDS[round_]
    seed = SEED + round_
    rng = random.Random(seed)
    own = psutil.Process()
    fds_before = own.num_fds()
    shm_before = _dev_shm()
    # 200 samples x 2 epochs at 2 samples per rank and step: enough steps for every fault and replacement.
    # Once the last fault's replacement joined (2 resizes per fault), the job only has to finish: no pause.
    job = ElasticJob(tmp_path, TWO_HOSTS, ARGS, samples=200, batch=2, epochs=2, sleep=0.08, sleep_after_resize=0.0,
                     resizes=2 * faults)
    done = []
    try:
        target = 0
        for _ in range(faults):
            target = max(target, job.progress()[1]) + rng.randint(2, 8)
            job.wait_steps(target, timeout=60, size=2)  # size 2 again: the previous fault's host is back
            slot = rng.choice(SLOTS)
            pid = job.pid(slot)
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            done.append((slot, pid, job.progress()[1]))
        code = job.wait(timeout=120)
        assert code == 0, f"seed {seed}, faults {done}: exit status {code}\n{job.output()}"
        result = job.assert_exact()  # every sample exactly once per epoch, whatever happened
        sizes = result["sizes"]
        # each fault shrinks the job to one worker until the host is back (the last may not come back in time)
        assert sizes in ([2, 1] * faults, [2, 1] * faults + [2]), \
            f"seed {seed}, faults {done}: sizes {sizes}\n{job.output()}"
        output = job.output()
        if kind == "stop":
            assert "hung?" in output, output
        assert output.count("blacklisting host") >= faults, output
        job.assert_no_leftovers()
        for _slot, pid, _step in done:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    except AssertionError as e:
        raise AssertionError(f"{kind} round, seed {seed} (HOROVOD_TEST_SOAK_SEED={SEED}), faults (slot, pid, step) "
                             f"{done}: {e}") from None
    finally:
        job.stop()
    assert _dev_shm() - shm_before == set(), f"new files in /dev/shm: {_dev_shm() - shm_before}"
    assert own.num_fds() == fds_before, f"this process had {fds_before} descriptors, now {own.num_fds()}"
