"""The pieces of joining an srun step without MPI (horovod/common/slurm.py): Slurm's host lists, the port
every task derives alike, when a step joins instead of bootstrapping through MPI, and the MUNGE key channel
(a real munged when one runs here: CI's Slurm cluster starts it), probed as another user and a stranger would."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from horovod.common import slurm, store_join

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n1"}


@pytest.mark.parametrize("spec, hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,07],gpu1", ["node01", "node02", "node03", "node07", "gpu1"]),
    ("a,b , c", ["a", "b", "c"]),
    ("r[1-2]n[08-10]", ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]),
    ("x[9-11]-ib", ["x9-ib", "x10-ib", "x11-ib"]),
    ("h[007]", ["h007"]),
    ("", []),
])
def test_expand_hostlist(spec, hosts):
    assert slurm.expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[1-3", "node1-3]", "node[a-b]", "node[1-]x", "n[[1]]", "n[3-1]"])
def test_malformed_hostlist_is_named(spec):
    with pytest.raises(ValueError, match="malformed Slurm host list"):
        slurm.expand_hostlist(spec)


def test_derived_port_is_the_same_for_a_step_and_differs_between_steps():
    ports = {store_join.derived_port(f"slurm {job}.{step}") for job in range(100, 400) for step in range(3)}
    assert all(20000 <= p < 32000 for p in ports)
    assert store_join.derived_port("slurm 42.0") == store_join.derived_port("slurm 42.0")
    assert len(ports) > 850  # 900 steps: few collide


@pytest.mark.parametrize("extra, mpi4py, joins", [
    ({}, True, True),  # srun without --mpi: no PMI server
    ({"PMIX_RANK": "1"}, True, False),  # srun --mpi=pmix with mpi4py: MPI bootstraps, as before
    ({"PMIX_RANK": "1"}, False, True),  # ... without mpi4py
    ({"PMIX_RANK": "1", "HOROVOD_CONTROLLER": "gloo"}, True, True),
    ({"HOROVOD_CONTROLLER": "mpi"}, True, False),  # MPI asked for: mpi_job refuses without PMI, naming why
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_PROCID": "0"}, True, False),
    ({"HOROVOD_RANK": "1"}, True, False),  # horovodrun's worker inside a step
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, True, False),  # mpirun inside a step
    ({"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_SLOT": "h:0", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9"}, True,
     False),  # the elastic driver's worker
])
def test_wants_join(monkeypatch, extra, mpi4py, joins):
    monkeypatch.setattr("horovod.transport.mpi.mpi_available", lambda: mpi4py)
    assert slurm.wants_join({**STEP, **extra}) is joins


@pytest.mark.parametrize("without_pmi2, extra, joins", [
    (True, {}, True),  # srun --mpi=pmi2, Open MPI without PMI-2 (Debian's): MPI_Init would abort every task
    (False, {}, False),  # an MPI that can use PMI-2 connects the tasks, as before
    (True, {"HOROVOD_CONTROLLER": "mpi"}, False),  # MPI asked for: mpi_job refuses, naming pmi2 and the fixes
    (False, {"HOROVOD_CONTROLLER": "gloo"}, True),
])
def test_wants_join_under_pmi2(monkeypatch, without_pmi2, extra, joins):
    monkeypatch.setattr("horovod.transport.mpi.mpi_available", lambda: True)
    monkeypatch.setattr("horovod.transport.mpi.open_mpi_without_pmi2", lambda: without_pmi2)
    pmi2 = {"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "PMI_RANK": STEP["SLURM_PROCID"],
            "PMI_SIZE": STEP["SLURM_STEP_NUM_TASKS"], "PMI_JOBID": "417.0"}
    assert slurm.wants_join({**STEP, **pmi2, **extra}) is joins


def test_detect_describes_the_step(monkeypatch):
    monkeypatch.setattr(slurm, "_node_address", lambda node: {"n1": "10.0.0.1"}[node])
    env = slurm.detect({**STEP, "HOROVOD_SECRET_KEY": "ab" * 16})
    assert (env.launcher, env.master_addr, env.rank, env.world_size, env.local_rank, env.local_world_size,
            env.node, env.hostname) == ("srun", "10.0.0.1", 1, 3, 1, 2, 0, "n1")
    assert env.store_port == store_join.derived_port("slurm 42.0") and env.key_channel is None
    door = slurm.detect(STEP).key_channel  # several nodes, no key: MUNGE (when installed)
    assert isinstance(door, slurm.MungeDoor) or shutil.which("munge") is None
    one_node = slurm.detect({**STEP, "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "3"})
    assert one_node.one_host and one_node.key_channel is None  # the key file of store_join


def test_detect_refuses_task_0_off_the_first_node(monkeypatch):
    monkeypatch.setattr(slurm, "_node_address", lambda node: "10.0.0.1")
    with pytest.raises(ValueError, match="srun placed task 0 on n2, not on the step's first node n1"):
        slurm.detect({**STEP, "SLURM_PROCID": "0", "SLURMD_NODENAME": "n2"})
    with pytest.raises(ValueError, match="SLURM_STEP_NODELIST is not set"):
        slurm.detect({k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"})


def test_detect_without_munge_or_key_names_the_ways_to_give_one(monkeypatch):
    monkeypatch.setattr(slurm, "_node_address", lambda node: "10.0.0.1")
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    env = slurm.detect(STEP)
    assert env.key_channel is None
    with pytest.raises(ValueError) as info:
        store_join.join(env)
    text = str(info.value)
    assert text.startswith("srun started 3 tasks on 2 nodes without MPI, and Horovod has no key")
    assert "HOROVOD_SECRET_KEY" in text and "munge" in text and "srun --mpi=pmix" in text


def test_unresolvable_first_node_is_named(monkeypatch):
    monkeypatch.setattr(slurm.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", ""))
    with pytest.raises(ValueError, match="'no-such-node.invalid' .* does not resolve"):
        slurm._node_address("no-such-node.invalid")


# ------------------------------------------------------------------------------------------------ MUNGE
def _munged() -> bool:
    if shutil.which("munge") is None or shutil.which("unmunge") is None:
        return False
    return subprocess.run(["munge", "-n"], capture_output=True, timeout=10).returncode == 0


needs_munged = pytest.mark.skipif(not _munged() and os.environ.get("HOROVOD_TEST_REQUIRE_SLURM") != "1",
                                  reason="needs munge/unmunge and a running munged (.ci/slurm_cluster.sh up)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def door():
    port = _free_port()
    d = slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 0)
    yield d
    d.close()


@needs_munged
def test_door_hands_each_rank_the_key(door):
    key = os.urandom(32)
    door.publish(["127.0.0.1"], 4242, key)
    got = [None] * 4

    def fetch(i):
        got[i] = slurm.MungeDoor("127.0.0.1", door.port, "slurm 42.0", i + 1).fetch(time.monotonic() + 10)

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [("127.0.0.1", 4242, key)] * 4  # a fresh credential each: MUNGE refuses replays
    door.close()
    assert slurm.MungeDoor("127.0.0.1", door.port, "slurm 42.0", 1).refetch() is None  # closed: nothing listens


@needs_munged
def test_door_of_another_launch_is_refused(door):
    door.publish(["127.0.0.1"], 4242, os.urandom(32))
    with pytest.raises(ValueError, match=r"serves the key of another launch of this user's \(slurm 42.0, not "
                                         r"slurm 43.0\)"):
        slurm.MungeDoor("127.0.0.1", door.port, "slurm 43.0", 1)._fetch_once()


def _fake_door(reply: bytes) -> tuple[int, threading.Thread]:
    """A stranger's server on the port: answers every connection with ``reply``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        with listener:
            listener.settimeout(10)
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(reply)
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return port, t


@needs_munged
@pytest.mark.parametrize("reply, text", [
    (b"x" * 100_000, "sent more than 16384 bytes"),
    (b"not a credential", "its credential did not decode"),
    (b"", "its credential did not decode"),
])
def test_a_stranger_on_the_port_is_not_trusted(reply, text):
    port, t = _fake_door(reply)
    with pytest.raises(ValueError, match=text):
        slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 1)._fetch_once()
    t.join(timeout=10)


@needs_munged
def test_a_credential_of_another_user_or_a_replay_is_refused():
    payload = json.dumps({"launch": "slurm 42.0", "addr": "127.0.0.1", "port": 1, "key": "00" * 32}).encode()
    if os.getuid() == 0:  # root may make a credential in another user's name: its key is not ours
        other = subprocess.run(["munge", "--uid", "65534", "--restrict-uid", str(os.getuid())], input=payload,
                               capture_output=True, timeout=10).stdout
        port, t = _fake_door(other)
        with pytest.raises(ValueError, match="made by uid 65534, not this user's"):
            slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 1)._fetch_once()
        t.join(timeout=10)
    ours = slurm._munge(payload)
    assert json.loads(slurm._unmunge(ours)) == json.loads(payload)
    with pytest.raises(ValueError, match="did not decode"):  # an eavesdropper's copy, replayed
        slurm._unmunge(ours)


@needs_munged
def test_door_port_in_use_is_named():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        d = slurm.MungeDoor("127.0.0.1", taken.getsockname()[1], "slurm 42.0", 0)
        with pytest.raises(ValueError, match="could not listen on 127.0.0.1 port .* HOROVOD_GLOO_RENDEZVOUS_PORT"):
            d.publish(["127.0.0.1"], 4242, os.urandom(32))


@needs_munged
def test_door_listens_on_a_spare_port_and_ranks_skip_what_is_no_door():
    """The door's derived port held by another program (an HTTP server here): task 0 could not listen and the
    job failed.  It listens on the next derived port; the ranks read the other program's answer, refuse it,
    and get the key at the next port."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        threading.Thread(target=_answer_garbage, args=(taken,), daemon=True).start()
        spare = _free_port()
        d = slurm.MungeDoor("127.0.0.1", taken.getsockname()[1], "42.0", 0, (spare,))
        key = os.urandom(32)
        d.publish(["127.0.0.1"], 4242, key)
        try:
            assert d.port == spare
            rank = slurm.MungeDoor("127.0.0.1", taken.getsockname()[1], "42.0", 1, (spare,))
            assert rank.fetch(time.monotonic() + 10) == ("127.0.0.1", 4242, key)
            assert rank.serves()
        finally:
            d.close()


def test_fetch_gives_up_at_the_deadline_naming_task_0():
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"rank 2 could not get the job key from task 0 at 127.0.0.1:{port}"):
        slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 2).fetch(time.monotonic() + 1.0)
    assert time.monotonic() - start < 5


# ------------------------------------------------------------------------------------------------ join (processes)
_JOIN = """
import json, os, signal, sys, time
from horovod.common import store_join
spec = json.loads(sys.argv[1])
store_join.join(store_join.JoinEnv(**spec))
handler = signal.getsignal(signal.SIGTERM)
print("JOINED", os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"], "SIGTERM",
      "default" if handler == signal.SIG_DFL else handler, flush=True)
# The store lives in rank 0: it stays until the others have read the layout from it (each marks it has, once
# its join returned), for at most 10 s -- or for TEST_STORE_HOLD seconds, for a process of another launch.
mark = os.path.join(os.environ["TMPDIR"], "read." + spec["launch_id"].replace(" ", "_") + ".{}")
if os.environ.get("TEST_STORE_HOLD"):
    time.sleep(float(os.environ["TEST_STORE_HOLD"]))
elif spec["rank"] == 0:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(os.path.exists(mark.format(r))
                                                  for r in range(1, spec["world_size"])):
        time.sleep(0.05)
else:
    open(mark.format(spec["rank"]), "w").close()
"""


def _join(rank: int, world_size: int, launch_id: str, tmp_path, port: int | None = None,
          spares: tuple[int, ...] = (), **environ: str):
    """A process that joins as ``rank`` of an srun-like launch on this host (rank 0 runs the store at ``port``,
    else at the first of ``spares`` free)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "SLURM_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=REPO, TMPDIR=str(tmp_path), **environ)
    spec = {"launcher": "srun", "master_addr": "127.0.0.1", "rank": rank, "world_size": world_size,
            "local_rank": rank, "local_world_size": world_size, "node": 0, "launch_id": launch_id,
            "store_port": port, "store_port_source": "the test's port", "spare_ports": spares}
    return subprocess.Popen([sys.executable, "-c", _JOIN, json.dumps(spec)], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _outcome(proc, timeout: float = 30) -> tuple[int | None, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return None, out
    return proc.returncode, out


def _wait_listening(port: int, proc, timeout: float = 30.0) -> None:
    """Until a socket listens on ``port`` (read from /proc: no connection the store would see)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
            if any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows):  # 0A: LISTEN
                return
        time.sleep(0.02)
    raise AssertionError(f"nothing listens on port {port} (the process exited: {proc.poll()})")


def test_a_process_of_another_step_with_the_same_key_and_port_never_joins(tmp_path):
    """Two srun steps with the same ``HOROVOD_SECRET_KEY`` and ``HOROVOD_GLOO_RENDEZVOUS_PORT`` (or whose
    derived ports collide): step B's task 0 cannot listen, and step B's task 1 reached step A's store.  It
    used to take task 1's place in step A (whose own task 1 then failed: 'another process also has
    SLURM_PROCID=1'): the two steps mixed.  Records are per launch, and a rank writes its record only into a
    store whose rank 0 marked it as its launch's: step A runs, step B's task (its task 0 absent) fails naming
    the store as another job's."""
    port = _free_port()
    common = {"HOROVOD_SECRET_KEY": os.urandom(32).hex(), "HOROVOD_START_TIMEOUT": "3"}
    a0 = _join(0, 2, "slurm 42.0", tmp_path, port, TEST_STORE_HOLD="3", **common)  # until b1 was answered
    b1 = _join(1, 2, "slurm 42.1", tmp_path, port, **common)
    time.sleep(2.0)  # step B's task reaches step A's store first
    a1 = _join(1, 2, "slurm 42.0", tmp_path, port, **common)
    (rc_a0, out_a0), (rc_a1, out_a1), (rc_b1, out_b1) = (_outcome(p) for p in (a0, a1, b1))
    assert (rc_a0, rc_a1) == (0, 0), out_a0 + out_a1 + out_b1
    assert rc_b1 not in (0, None) and "JOINED" not in out_b1, out_b1
    assert f"the rendezvous store at 127.0.0.1:{port} is another job's (one with the same key)" in out_b1, out_b1


def test_two_steps_whose_derived_ports_collide_both_run(tmp_path):
    """Two steps with the same key whose derived ports collide (or whose port another program holds): step B's
    task 0 could not listen ('set HOROVOD_GLOO_RENDEZVOUS_PORT'), and the job failed.  Task 0 now listens on
    the first of the launch's derived ports free; its tasks try each, skipping a store that is not their
    launch's and a program that is no Horovod store."""
    port, spare_b, spare_c = _free_port(), _free_port(), _free_port()
    common = {"HOROVOD_SECRET_KEY": os.urandom(32).hex(), "HOROVOD_START_TIMEOUT": "20"}
    a0 = _join(0, 2, "slurm 42.0", tmp_path, port, **common)
    _wait_listening(port, a0)  # step A's store holds the port
    with socket.create_server(("127.0.0.1", spare_b)) as squatter:  # a program that is no store
        threading.Thread(target=_answer_garbage, args=(squatter,), daemon=True).start()
        b = [_join(rank, 2, "slurm 42.1", tmp_path, port, (spare_b, spare_c), **common) for rank in (1, 0)]
        a1 = _join(1, 2, "slurm 42.0", tmp_path, port, **common)
        outcomes = [_outcome(p) for p in (a0, a1, *b)]
    assert [rc for rc, _ in outcomes] == [0] * 4, outcomes
    assert all("JOINED" in out for _, out in outcomes), outcomes


def _answer_garbage(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")


def test_sigterm_while_task_0_waits_removes_the_key_file(tmp_path):
    """srun -K (or torchrun) ends the tasks with SIGTERM when one fails, often while task 0 still waits for a
    task that never comes: atexit does not run, and the job's key file stayed in /tmp/horovod-srun-<uid>/."""
    proc = _join(0, 2, "slurm 43.0", tmp_path, HOROVOD_START_TIMEOUT="30")
    key_dir = tmp_path / f"horovod-srun-{os.getuid()}"
    deadline = time.monotonic() + 20
    while not (key_dir.is_dir() and os.listdir(key_dir)) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    assert os.listdir(key_dir), "task 0 never published its key file"
    proc.send_signal(signal.SIGTERM)
    rc, out = _outcome(proc)
    assert rc == -signal.SIGTERM, (rc, out)  # ended by the signal, as without Horovod's handler
    assert os.listdir(key_dir) == [], out


def _new_key_files(key_dir, old: set[str], timeout: float = 20) -> set[str]:
    """The key files that appeared in ``key_dir`` besides ``old`` (waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = set(os.listdir(key_dir)) if key_dir.is_dir() else set()
        new = {n for n in names - old if not n.endswith(".tmp")}
        if new:
            return new
        time.sleep(0.05)
    raise AssertionError(f"no new key file appeared in {key_dir}")


def test_a_key_file_left_by_a_killed_task_0_is_removed_by_the_next_job(tmp_path):
    """Task 0 killed outright (SIGKILL, the OOM killer) while it waits for the others runs nothing of its own:
    its key file stayed in /tmp/horovod-srun-<uid>/ for good.  The next job's task 0 removes it; the file of
    a task 0 still alive, and one written in another pid namespace (a container sharing /tmp), stay."""
    key_dir = tmp_path / f"horovod-srun-{os.getuid()}"
    killed = _join(0, 2, "slurm 44.0", tmp_path, HOROVOD_START_TIMEOUT="30")
    (stale,) = _new_key_files(key_dir, set())
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=10)
    assert os.listdir(key_dir) == [stale]
    foreign = key_dir / "f00.json"
    foreign.write_text(json.dumps({"addr": "127.0.0.1", "port": 1, "key": "00", "pid": killed.pid,
                                   "pidns": "pid:[1]"}))
    live = _join(0, 2, "slurm 44.1", tmp_path, HOROVOD_START_TIMEOUT="30")
    try:
        (live_file,) = _new_key_files(key_dir, {stale, "f00.json"})
        assert stale not in os.listdir(key_dir)
        jobs = [_join(rank, 2, "slurm 44.2", tmp_path) for rank in (0, 1)]
        outcomes = [_outcome(p) for p in jobs]
        assert [rc for rc, _ in outcomes] == [0, 0], outcomes
        assert set(os.listdir(key_dir)) == {live_file, "f00.json"}
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait(timeout=10)


def test_the_sigterm_handler_is_put_back_once_every_task_joined(tmp_path):
    procs = [_join(r, 2, "slurm 44.0", tmp_path) for r in range(2)]
    done = [_outcome(p) for p in procs]
    assert [rc for rc, _ in done] == [0, 0], done
    assert [out.split()[-1] for _, out in done] == ["default", "default"], done
    assert os.listdir(tmp_path / f"horovod-srun-{os.getuid()}") == []


def test_key_in_one_task_only_is_named_at_once(tmp_path):
    """``HOROVOD_SECRET_KEY`` exported in task 1's environment only: task 1 used to wait out the start timeout
    and say it 'could not reach the rendezvous store'; it sees task 0's key file and says why, at once."""
    start = time.monotonic()
    r0 = _join(0, 2, "slurm 45.0", tmp_path, HOROVOD_START_TIMEOUT="4")
    r1 = _join(1, 2, "slurm 45.0", tmp_path, _free_port(), HOROVOD_START_TIMEOUT="10",
               HOROVOD_SECRET_KEY=os.urandom(32).hex())
    rc1, out1 = _outcome(r1)
    assert rc1 not in (0, None) and time.monotonic() - start < 8, out1
    assert "rank 1 has HOROVOD_SECRET_KEY but rank 0 of this srun job has none" in out1, out1
    rc0, out0 = _outcome(r0)
    assert rc0 not in (0, None), out0
    assert "is HOROVOD_SECRET_KEY set in every rank or in none (rank 0 has none)" in out0, out0


def test_a_rank_without_the_key_at_task_0s_store_is_told_at_once():
    """Across nodes, task 0 has ``HOROVOD_SECRET_KEY`` (its store is at the port) and this task has none (it
    expects the MUNGE door there): the store's HTTP answer says so, without waiting for the deadline.  Another
    program's HTTP answer is not taken for it (task 0 may be at the next port)."""
    from horovod.runner.rendezvous import _unsigned

    port, t = _fake_door(_unsigned(408))
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 has no HOROVOD_SECRET_KEY but task 0 of this srun step"):
        slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 1).fetch(time.monotonic() + 30)
    assert time.monotonic() - start < 10
    t.join(timeout=10)
    port, t = _fake_door(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(ValueError, match="rank 1 could not get the job key from task 0 at 127.0.0.1:"):
        slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 1).fetch(time.monotonic() + 2)
    t.join(timeout=10)


@pytest.mark.parametrize("reply, serves", [(b"MUNGE:AwQDAACx...:", True), (b"HTTP/1.1 408 x\r\n\r\n", False),
                                           (b"", False)])
def test_door_serves_tells_a_munge_door(reply, serves):
    port, t = _fake_door(reply)
    assert slurm.MungeDoor("127.0.0.1", port, "slurm 42.0", 1).serves() is serves
    t.join(timeout=10)
    assert slurm.MungeDoor("127.0.0.1", _free_port(), "slurm 42.0", 1).serves() is False  # nothing listens


def test_the_key_file_check_of_a_rank_with_the_key_needs_no_sound_directory(tmp_path, monkeypatch):
    """A rank with the key never needed <tmp>/horovod-srun-<uid>/: its check neither makes it nor trips on a
    directory another user made there."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    env = store_join.JoinEnv(launcher="srun", master_addr="127.0.0.1", rank=1, world_size=2, local_rank=1,
                             local_world_size=2, launch_id="slurm 46.0")
    store_join._refuse_if_rank_0_has_no_key(env, OSError("refused"))
    assert os.listdir(tmp_path) == []
    squatted = tmp_path / f"horovod-srun-{os.getuid()}"
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)
    store_join._refuse_if_rank_0_has_no_key(env, OSError("refused"))  # no PermissionError


_RETRY = """
import json, os, sys
from horovod.common import store_join
store_join._ERROR_LINGER = 0.2
for attempt in (1, 2):
    try:
        store_join.join(store_join.JoinEnv(**json.loads(sys.argv[1])))
    except ValueError as e:
        print("FAILED", attempt, str(e)[:160].replace(chr(10), " "), flush=True)
        continue
    print("JOINED", attempt, os.environ["HOROVOD_RANK"], flush=True)
    if os.environ["HOROVOD_RANK"] == "0":
        import time; time.sleep(1)  # the store lives in rank 0: the others read the layout from it
    break
"""


def _retrying(rank: int, world_size: int, launch_id: str, tmp_path):
    """A process that joins as ``rank`` like ``hvd.init()`` in a retry loop: a second join after a failed one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "SLURM_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=REPO, TMPDIR=str(tmp_path), HOROVOD_START_TIMEOUT="1")
    spec = {"launcher": "srun", "master_addr": "127.0.0.1", "rank": rank, "world_size": world_size,
            "local_rank": rank, "local_world_size": world_size, "node": 0, "launch_id": launch_id}
    return subprocess.Popen([sys.executable, "-c", _RETRY, json.dumps(spec)], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_join_retried_after_a_rank_came_late_meets_the_others(tmp_path):
    """Rank 2 comes after rank 0 gave up (start timeout): every rank's first join fails, and the second (init()
    again) used to read the first one's error in rank 0's store at once, so no retry could ever succeed."""
    r0, r1 = (_retrying(r, 3, "slurm 47.0", tmp_path) for r in range(2))
    first = r0.stdout.readline()
    assert first.startswith("FAILED 1 ") and "ranks [2]" in first, first + r0.communicate()[0]
    r2 = _retrying(2, 3, "slurm 47.0", tmp_path)  # reads attempt 1's error, then meets the others' retry
    done = [_outcome(p, timeout=20) for p in (r0, r1, r2)]
    assert [rc for rc, _ in done] == [0, 0, 0], done
    assert [out.splitlines()[-1] for _, out in done] == [f"JOINED 2 {r}" for r in range(3)], done


def test_a_join_retried_while_rank_0_was_not_up_meets_rank_0s_first(tmp_path):
    """Rank 1's first join found no key file (rank 0 not started): its record never reached a store, so its
    retry meets rank 0's first join (not a later attempt that rank 0 never makes)."""
    r1 = _retrying(1, 2, "slurm 48.0", tmp_path)
    first = r1.stdout.readline()
    assert first.startswith("FAILED 1 rank 1 waited"), first + r1.communicate()[0]
    r0 = _retrying(0, 2, "slurm 48.0", tmp_path)
    done = [_outcome(p, timeout=20) for p in (r0, r1)]
    assert [out.splitlines()[-1] for _, out in done] == ["JOINED 1 0", "JOINED 2 1"], done
    assert os.listdir(tmp_path / f"horovod-srun-{os.getuid()}") == []
