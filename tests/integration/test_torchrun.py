"""hvd.init() in processes started by torchrun, or given its variables by hand (a Kubeflow PyTorchJob).

Real jobs: ``torchrun --nproc_per_node=2`` and ``--nnodes=1 --standalone`` running horovod.torch, and
processes started with torchrun's variables at np=3 (one host with a generated key; no LOCAL_RANK with
HOROVOD_SECRET_KEY).  Results are checked against numpy; ranks against what torchrun assigned.  Then the
errors: malformed or inconsistent variables, a missing or wrong key, a rank that never comes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from horovod.base.config import EnvVarError
from horovod.common import store_join, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "torchrun_worker.py")
sys.path.insert(0, HERE)
from torchrun_worker import problem  # noqa: E402

TIMEOUT = 120


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_"))
           and k not in torchrun_worker_vars()}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def torchrun_worker_vars() -> tuple[str, ...]:
    return ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    """A port p with p and p + 1 free (torchrun's store would hold p, Horovod's p + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 65535:
            try:
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no pair of free ports")


def _results(where: str) -> list[dict]:
    found = []
    for name in sorted(os.listdir(where)):
        with open(os.path.join(where, name)) as f:
            found.append(json.load(f))
    return sorted(found, key=lambda d: d["layout"][0])


def _check_collectives(results: list[dict], n: int) -> None:
    assert [d["layout"][:2] for d in results] == [[r, n] for r in range(n)]
    want = (np.arange(5) * sum(range(1, n + 1))).tolist()
    gathered = np.concatenate([np.full(r + 1, float(r)) for r in range(n)]).tolist()
    for d in results:
        assert d["allreduce"] == want
        assert d["allgather"] == gathered
        assert d["broadcast"] == [10.0 * n]


def _reference_params(steps: int = 3, lr: float = 0.05) -> np.ndarray:
    """Three SGD steps on the whole batch in one process (numpy), from the broadcast start."""
    x, y = problem()
    x, y = x.astype(np.float64), y.astype(np.float64)
    w, b = np.full(4, 0.1), 0.0
    for _ in range(steps):
        err = x @ w + b - y
        w, b = w - lr * 2 / len(y) * (x.T @ err), b - lr * 2 / len(y) * err.sum()
    return np.concatenate([w, [b]])


def _torchrun(args: list[str], where: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args, WORKER, "torch"], cwd=REPO,
                          env=_env(HVD_TEST_RESULT_DIR=where), capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


@pytest.mark.parametrize("args", [["--nproc_per_node=2"], ["--nnodes=1", "--standalone", "--nproc_per_node=2"]],
                         ids=["nproc_per_node", "standalone"])
def test_torchrun_job(args, tmp_path):
    pytest.importorskip("torch")
    proc = _torchrun(args, str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(str(tmp_path))
    assert len(results) == 2, proc.stdout + proc.stderr
    _check_collectives(results, 2)
    for d in results:
        env = d["env"]
        # Horovod's layout is torchrun's: RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, one node.
        assert d["layout"] == [int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                               int(env["LOCAL_WORLD_SIZE"]), 0, 1]
        assert env["TORCHELASTIC_RUN_ID"]
        np.testing.assert_allclose(d["params"], _reference_params(), rtol=1e-5, atol=1e-6)
    assert results[0]["params"] == results[1]["params"]


SLURM_STEP = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
              "SLURM_JOB_ID": "77", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}


@pytest.mark.parametrize("outer", [SLURM_STEP, {"HOROVOD_ELASTIC": "1"}], ids=["in_slurm_step", "horovod_elastic"])
def test_torchrun_job_inside_another_launch(outer, tmp_path):
    """torchrun run in a Slurm step (one task: torchrun itself), or with HOROVOD_ELASTIC=1 in its environment:
    torchrun's world wins (both ranks were rank 0 of size 1 before)."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", WORKER, "numpy"],
                          cwd=REPO, env=_env(HVD_TEST_RESULT_DIR=str(tmp_path), **outer), capture_output=True,
                          text=True, timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(str(tmp_path))
    assert len(results) == 2, proc.stdout + proc.stderr
    _check_collectives(results, 2)
    assert [d["layout"] for d in results] == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]


def test_mpi_comm_under_torchrun_is_refused(tmp_path):
    """init(comm=MPI.COMM_WORLD) in processes torchrun started: every one is an MPI singleton and ran alone as
    rank 0 of size 1; now every rank gets a ValueError naming both sizes and the fix, without hanging."""
    pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    script = tmp_path / "comm.py"
    # one write per line (os.write): the two ranks share torchrun's stdout and print()s interleave
    script.write_text("import os, sys\nfrom mpi4py import MPI\nimport horovod.numpy as hvd\ntry:\n"
                      "    hvd.init(comm=MPI.COMM_WORLD)\nexcept ValueError as e:\n"
                      "    os.write(1, f'refused {os.environ[\"RANK\"]} {e}\\n'.encode())\n    sys.exit(0)\n"
                      "os.write(1, f'joined {hvd.rank()} {hvd.size()}\\n'.encode())\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    refused = sorted(line for line in proc.stdout.splitlines() if line.startswith("refused"))
    assert len(refused) == 2, proc.stdout + proc.stderr
    for r, line in enumerate(refused):
        assert line.startswith(f"refused {r} hvd.init(comm=...) got an MPI communicator of size 1, but torchrun "
                               f"started this process as rank {r} of a job of size 2"), line


def test_key_file_is_gone_when_torchrun_terminates_rank_0(tmp_path):
    """A rank fails after init: torchrun SIGTERMs rank 0, whose atexit never runs; its key file (the job's key)
    stayed in <tmp>/horovod-torchrun-<uid>/.  Rank 0 now removes it once every rank has read it."""
    pytest.importorskip("torch")
    script = tmp_path / "die.py"
    script.write_text("import os, sys, time\nimport horovod.numpy as hvd\nhvd.init()\n"
                      "os.write(1, b'joined %d\\n' % hvd.rank())\n"  # one write: ranks' prints interleave
                      "if hvd.rank() == 1:\n    time.sleep(0.5)\n    os._exit(3)\ntime.sleep(60)\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                          cwd=REPO, env=_env(TMPDIR=str(tmp)), capture_output=True, text=True, timeout=TIMEOUT,
                          start_new_session=True)
    assert proc.returncode != 0 and "joined 0" in proc.stdout and "joined 1" in proc.stdout, proc.stdout + proc.stderr
    key_dir = tmp / f"horovod-torchrun-{os.getuid()}"
    assert key_dir.is_dir(), proc.stdout + proc.stderr
    assert os.listdir(key_dir) == []


# ------------------------------------------------------------------------------------------ env only
def _start_ranks(n: int, per_rank: dict[int, dict[str, str]] | None = None, *, where: str = "", kind: str = "numpy",
                 local: bool = True, master: str = "127.0.0.1", ranks: list[int] | None = None,
                 **common: str) -> list[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for r in range(n) if ranks is None else ranks:
        env = _env(MASTER_ADDR=master, MASTER_PORT=port, RANK=str(r), WORLD_SIZE=str(n), HVD_TEST_RESULT_DIR=where,
                   **common)
        if local:
            env.update(LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        env.update((per_rank or {}).get(r, {}))
        procs.append(subprocess.Popen([sys.executable, WORKER, kind], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 60) -> list[tuple[int | None, str]]:
    deadline = time.monotonic() + timeout
    done = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            done.append((p.returncode, out))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, _ = p.communicate()
            done.append((None, out))
    return done


def test_env_only_one_host_generated_key(tmp_path):
    """np=3 with torchrun's variables set by hand, every rank on this host: rank 0's generated key, no file left."""
    procs = _start_ranks(3, where=str(tmp_path))
    done = _finish(procs)
    assert [rc for rc, _ in done] == [0, 0, 0], "\n".join(out for _, out in done)
    results = _results(str(tmp_path))
    _check_collectives(results, 3)
    assert [d["layout"][2:] for d in results] == [[r, 3, 0, 1] for r in range(3)]
    assert all(d["key_in_env"] for d in results)
    left = os.listdir(os.path.dirname(store_join.key_file_path(_tr(1))))
    assert not [f for f in left if f.endswith(".json")], left


def test_env_only_pytorchjob_style_with_key(tmp_path):
    """A PyTorchJob without torchrun: no LOCAL_RANK, HOROVOD_SECRET_KEY from a Secret; local ranks by host."""
    procs = _start_ranks(3, where=str(tmp_path), local=False, HOROVOD_SECRET_KEY=secrets.token_hex(32))
    done = _finish(procs)
    assert [rc for rc, _ in done] == [0, 0, 0], "\n".join(out for _, out in done)
    results = _results(str(tmp_path))
    _check_collectives(results, 3)
    assert [d["layout"][2:] for d in results] == [[r, 3, 0, 1] for r in range(3)]


def test_env_only_hostnames_make_nodes(tmp_path):
    """Without LOCAL_RANK, ranks are grouped by host name (HOROVOD_HOSTNAME here): upstream's cross ranks."""
    hosts = {0: "nodeA", 1: "nodeB", 2: "nodeA", 3: "nodeB"}
    procs = _start_ranks(4, {r: {"HOROVOD_HOSTNAME": h} for r, h in hosts.items()}, local=False,
                         where=str(tmp_path), HOROVOD_SECRET_KEY=secrets.token_hex(16))
    done = _finish(procs)
    assert [rc for rc, _ in done] == [0] * 4, "\n".join(out for _, out in done)
    results = _results(str(tmp_path))
    _check_collectives(results, 4)
    assert [d["layout"][2:] for d in results] == [[0, 2, 0, 2], [0, 2, 1, 2], [1, 2, 0, 2], [1, 2, 1, 2]]


def test_env_only_with_tls_credentials(tmp_path):
    """HOROVOD_TLS=1 with the certificate and key in every rank's environment: store and TCP mesh over TLS."""
    pytest.importorskip("cryptography")
    from horovod.transport import tls

    creds = tls.worker_env(tls.make_credentials())
    procs = _start_ranks(2, where=str(tmp_path), local=False, HOROVOD_SECRET_KEY=secrets.token_hex(32),
                         HOROVOD_SHM_DISABLE="1", **creds)
    done = _finish(procs)
    assert [rc for rc, _ in done] == [0, 0], "\n".join(out for _, out in done)
    _check_collectives(_results(str(tmp_path)), 2)


def test_stale_key_file_of_an_earlier_job(tmp_path):
    """A key file left by a killed job with the same run id and port: the ranks wait for rank 0's fresh one."""
    port = _free_port()
    tr = torchrun.make_env("127.0.0.1", port, 1, 2, 1, 2, run_id="stale-run")
    path = store_join.key_file_path(tr)
    with open(path, "w") as f:  # an old store's key and a port where nothing listens now
        json.dump({"addr": "127.0.0.1", "port": _free_port(), "key": secrets.token_hex(32), "pid": 1}, f)
    os.chmod(path, 0o600)
    try:
        env = {"MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "stale-run"}
        procs = _start_ranks(2, {1: env, 0: env}, where=str(tmp_path))
        done = _finish(procs)
        assert [rc for rc, _ in done] == [0, 0], "\n".join(out for _, out in done)
        _check_collectives(_results(str(tmp_path)), 2)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _tr(rank: int, **kw) -> store_join.JoinEnv:
    return torchrun.make_env("127.0.0.1", 29500, rank, 3, rank, 3, **kw)


# ------------------------------------------------------------------------------------------ errors
def _failures(done: list[tuple[int | None, str]]) -> str:
    assert all(rc not in (0, None) for rc, _ in done), "\n".join(f"rc={rc}\n{out}" for rc, out in done)
    return "\n".join(out for _, out in done)


def test_multi_host_without_key_is_refused():
    procs = _start_ranks(2, {0: {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"},
                             1: {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}})
    out = _failures(_finish(procs, timeout=30))
    assert "needs HOROVOD_SECRET_KEY" in out and "LOCAL_WORLD_SIZE=1" in out


def test_wrong_key_on_one_rank_is_named():
    key = secrets.token_hex(32)
    procs = _start_ranks(2, {1: {"HOROVOD_SECRET_KEY": secrets.token_hex(32)}}, HOROVOD_SECRET_KEY=key,
                         HOROVOD_START_TIMEOUT="3")
    done = _finish(procs, timeout=30)
    assert done[1][0] not in (0, None)
    assert "refused this rank's key: every rank needs the same HOROVOD_SECRET_KEY" in done[1][1]
    assert done[0][0] not in (0, None) and "ranks [1]" in done[0][1]  # rank 0 names the rank that never came


def test_inconsistent_world_size_is_named_on_every_rank():
    procs = _start_ranks(2, {1: {"WORLD_SIZE": "3", "RANK": "1"}}, local=False,
                         HOROVOD_SECRET_KEY=secrets.token_hex(32), HOROVOD_START_TIMEOUT="10")
    done = _finish(procs, timeout=30)
    _failures(done)
    for _, out in done:
        assert "rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2" in out, out


def test_duplicate_rank_is_named():
    procs = _start_ranks(3, {2: {"RANK": "1", "LOCAL_RANK": "1"}}, local=False,
                         HOROVOD_SECRET_KEY=secrets.token_hex(32), HOROVOD_START_TIMEOUT="3")
    done = _finish(procs, timeout=30)
    out = _failures(done)  # the two RANK=1 processes leave rank 2 missing: every process fails, naming it
    assert all("ranks [2] of WORLD_SIZE=3 did not reach rank 0's rendezvous store" in o for _, o in done), out


def test_missing_rank_zero_times_out_with_the_reason():
    start = time.monotonic()
    rc, out = _finish(_start_ranks(2, ranks=[1], HOROVOD_START_TIMEOUT="3"), timeout=30)[0]
    assert rc not in (0, None)
    assert time.monotonic() - start < 25
    assert "did RANK=0 call hvd.init()" in out, out


# ------------------------------------------------------------------------------------------ detection (in process)
BASE = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4"}


@pytest.mark.parametrize("name,value,text", [
    ("RANK", "one", "RANK='one' is not a rank (a whole number)"),
    ("WORLD_SIZE", "0", "WORLD_SIZE='0' must be >= 1"),
    ("MASTER_PORT", "29500x", "MASTER_PORT='29500x' is not a TCP port number"),
    ("MASTER_PORT", "70000", "MASTER_PORT='70000' must be <= 65535"),
    ("LOCAL_RANK", "-1", "LOCAL_RANK='-1' must be >= 0"),
    ("GROUP_RANK", "1.5", "GROUP_RANK='1.5' is not a node rank"),
    ("MASTER_PORT", "", "MASTER_PORT is not set"),
])
def test_malformed_variable_is_named(name, value, text):
    with pytest.raises(EnvVarError) as e:
        torchrun.detect({**BASE, name: value})
    assert text in str(e.value) and "torchrun's variable" in str(e.value)


def test_inconsistent_variables_in_one_process():
    with pytest.raises(ValueError, match=r"RANK=4 must be below WORLD_SIZE=4"):
        torchrun.detect({**BASE, "RANK": "4"})
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"):
        torchrun.detect({**BASE, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})


def test_detection_precedence():
    assert torchrun.detect({}) is None
    assert torchrun.detect({"RANK": "0", "WORLD_SIZE": "2"}) is None  # not torch.distributed's env://
    assert torchrun.detect({**BASE, "HOROVOD_RANK": "1"}) is None  # horovodrun's worker
    assert torchrun.detect({**BASE, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}) is None  # mpirun
    # torchrun started the process (TORCHELASTIC_RUN_ID): the Slurm step around torchrun does not count
    assert torchrun.detect({**BASE, **SLURM_STEP, "TORCHELASTIC_RUN_ID": "abc"}).world_size == 4
    assert torchrun.detect({**BASE, **SLURM_STEP}) is None  # srun with a PyTorchJob-like env: Slurm's
    # HOROVOD_ELASTIC=1 alone is the user's knob; the elastic driver's workers also have their slot
    assert torchrun.detect({**BASE, "HOROVOD_ELASTIC": "1"}).rank == 1
    assert torchrun.detect({**BASE, "HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_SLOT": "h:0",
                            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}) is None
    tr = torchrun.detect({**BASE, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                          "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert tr == torchrun.make_env("10.0.0.1", 29500, 1, 4, 1, 2, 0, "abc", 2)
    assert not tr.one_host


def _rec(rank, node, local_rank=None, local_size=None, world_size=None):
    return {"rank": rank, "world_size": world_size or 0, "node": node, "local_rank": local_rank,
            "local_size": local_size}


def test_layout_cross_ranks_like_upstream():
    # upstream's 5/4/3 hosts: cross_size of local rank 0 is 3, of local rank 3 is 2, of local rank 4 is 1
    nodes = ["a"] * 5 + ["b"] * 4 + ["c"] * 3
    recs = [_rec(r, h, world_size=12) for r, h in enumerate(nodes)]
    layout = store_join._layout(recs, 12)
    assert layout[0] == [0, 5, 0, 3] and layout[5] == [0, 4, 1, 3] and layout[9] == [0, 3, 2, 3]
    assert layout[4] == [4, 5, 0, 1] and layout[8] == [3, 4, 1, 2]
    given = [_rec(r, f"group {r // 2}", r % 2, 2, 4) for r in range(4)]
    assert store_join._layout(given, 4) == [[0, 2, 0, 2], [1, 2, 0, 2], [0, 2, 1, 2], [1, 2, 1, 2]]


def test_layout_errors():
    bad = [_rec(0, "g0", 0, 2, 4), _rec(1, "g0", 0, 2, 4), _rec(2, "g1", 0, 2, 4), _rec(3, "g1", 1, 2, 4)]
    with pytest.raises(ValueError, match=r"node g0 has ranks \[0, 1\] whose \(LOCAL_RANK, LOCAL_WORLD_SIZE\)"):
        store_join._layout(bad, 4)
    mixed = [_rec(0, "g0", 0, 2, 2), _rec(1, "g0", None, None, 2)]
    with pytest.raises(ValueError, match="rank 1 has no LOCAL_RANK while rank 0 has one"):
        store_join._layout(mixed, 2)


def test_short_key_is_refused(monkeypatch):
    monkeypatch.setenv("HOROVOD_SECRET_KEY", "abcd")
    with pytest.raises(ValueError, match="HOROVOD_SECRET_KEY has 2 bytes; under torchrun it must be at least 16"):
        store_join.join(_tr(1))


def test_private_dir_must_be_ours(tmp_path, monkeypatch):
    monkeypatch.setattr(store_join.tempfile, "gettempdir", lambda: str(tmp_path))
    d = tmp_path / f"horovod-torchrun-{os.getuid()}"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        store_join.key_file_path(_tr(1))
    shutil.rmtree(d)
    assert store_join.key_file_path(_tr(1)).startswith(str(d))
    assert os.stat(d).st_mode & 0o777 == 0o700
