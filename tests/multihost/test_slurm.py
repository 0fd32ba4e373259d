"""Real Slurm jobs on the one-node cluster of ``.ci/slurm_cluster.sh`` (Debian's slurm-wlm 22.05, munge,
Debian's Open MPI 4.1 with PMIx 4.2): ``srun --mpi=pmix``, an ``sbatch`` script as users write it, and what
a careless user does (``srun`` without ``--mpi``, ``horovodrun`` inside an allocation).  With the
network-namespace hosts of ``.ci/netns_hosts.sh`` up, the cluster also has a two-node partition ``hosts``
(a slurmd in each of two namespaces): ``srun -N 2`` there runs one task per "host", connected across the bridge.

The cluster is started here when Slurm is installed and we are root (the script is idempotent); otherwise
the tests skip, unless ``HOROVOD_TEST_REQUIRE_SLURM=1`` (CI) makes that a failure.  Every job has a Slurm
time limit and a timeout here (the job is cancelled by name when it runs out), so a broken cluster fails
the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import slurm_worker  # noqa: E402

SCRIPT = os.path.join(REPO, ".ci", "slurm_cluster.sh")
WORKER = os.path.join("tests", "multihost", "slurm_worker.py")
JOB_TIMEOUT = 60  # seconds, for this test's wait; Slurm's own limit is a minute too (-t 1)
pytestmark = pytest.mark.timeout(180)


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("HOROVOD_TEST_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm tests required but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm() -> None:
    """The CI cluster, up (started when installed and not running)."""
    missing = [c for c in ("srun", "sbatch", "slurmctld", "slurmd") if shutil.which(c) is None]
    if missing:
        _skip_or_fail(f"Slurm is not installed ({', '.join(missing)} missing): .ci/slurm_cluster.sh up, as "
                      "root, installs Debian's slurm-wlm and starts a one-node cluster")
    if os.geteuid() != 0:
        _skip_or_fail("the one-node Slurm cluster of .ci/slurm_cluster.sh needs root")
    proc = subprocess.run(["bash", SCRIPT, "up"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        _skip_or_fail(f"could not start the Slurm cluster: {proc.stderr.strip()[-800:]}")


def _env() -> dict[str, str]:
    """The test's environment without an outer launcher's variables; srun passes it to the tasks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "SBATCH_", "SRUN_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(argv: list[str], name: str) -> subprocess.CompletedProcess:
    """``argv`` (an srun/sbatch command naming its job ``name``); the job is cancelled if it runs out."""
    try:
        return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name], capture_output=True, timeout=30)
        pytest.fail(f"Slurm job {name} did not finish in {JOB_TIMEOUT} s: {' '.join(argv)}")


def srun(*args: str) -> subprocess.CompletedProcess:
    name = f"hvd-test-{uuid.uuid4().hex[:8]}"
    return _run(["srun", "-J", name, "-t", "1", *args], name)


def results(text: str) -> list[dict]:
    """The workers' ``RESULT`` lines (also behind horovodrun's ``[rank]<stdout>:`` prefix), by rank."""
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT {" in line]
    return sorted(found, key=lambda r: r["rank"])


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def check_layout(res: list[dict], mpi: bool) -> None:
    """Two ranks on this node; under srun Horovod's rank is Slurm's task id."""
    assert [r["rank"] for r in res] == [0, 1], res
    for r in res:
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"], r["mpi"]) == \
            (2, r["rank"], 2, 1, mpi), r
    assert len({r["slurm_job"] for r in res}) == 1 and res[0]["slurm_job"], res


def check_numpy(res: list[dict]) -> None:
    size = len(res)
    mine = [np.arange(5, dtype=np.float64) * (rank + 1) for rank in range(size)]
    for r in res:
        np.testing.assert_allclose(r["sum"], np.sum(mine, axis=0))
        np.testing.assert_allclose(r["avg"], np.mean(mine, axis=0))
        assert r["gather"] == [[rank, rank] for rank in range(size) for _ in range(rank + 1)]
        assert r["bcast"] == [size - 1 + 10.0]


def test_srun_pmix_numpy(slurm):
    """docs/running.md's command: ``srun --mpi=pmix -n 2 python train.py``."""
    proc = srun("-n", "2", "--mpi=pmix", sys.executable, WORKER, "numpy")
    _ok(proc)
    res = results(proc.stdout)
    check_layout(res, mpi=True)
    assert [r["slurm_procid"] for r in res] == ["0", "1"]
    check_numpy(res)


@pytest.mark.parametrize("mpi", [True, False], ids=["pmix", "without-mpi"])
def test_srun_torch_distributed_optimizer(slurm, mpi):
    proc = srun("-n", "2", *(["--mpi=pmix"] if mpi else []), sys.executable, WORKER, "torch")
    _ok(proc)
    res = results(proc.stdout)
    check_layout(res, mpi=mpi)
    check_torch(res)


def check_torch(res: list[dict]) -> None:
    """The same SGD in numpy: rank 0's weights, gradients of the mean squared error averaged over the ranks."""
    w = slurm_worker.initial_weights(0).astype(np.float64)
    batches = [tuple(a.astype(np.float64) for a in slurm_worker.data(rank)) for rank in range(len(res))]
    for _ in range(slurm_worker.STEPS):
        grads = [2 * (x @ w.T - y).T @ x / y.size for x, y in batches]
        w = w - slurm_worker.LR * np.mean(grads, axis=0)
    for r in res:
        np.testing.assert_allclose(r["weights"], w, rtol=1e-5, atol=1e-6)


def test_sbatch_script_with_srun_and_horovodrun(slurm, tmp_path):
    """A batch script as users write it: an ``srun`` step, then ``horovodrun`` in the same allocation."""
    name = f"hvd-test-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "job.out"
    horovodrun = shutil.which("horovodrun")
    launcher = horovodrun if horovodrun else f"{sys.executable} -m horovod.runner"
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -J {name}
#SBATCH -n 2
#SBATCH -t 1
#SBATCH -o {out}
set -e
echo STEP-SRUN
srun --mpi=pmix {sys.executable} {WORKER} numpy
echo STEP-HOROVODRUN
{launcher} -np 2 {sys.executable} {WORKER} numpy
echo BATCH-DONE
""")
    proc = _run(["sbatch", "--wait", "--chdir", REPO, str(script)], name)
    text = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, f"rc={proc.returncode} {proc.stderr}\njob output:\n{text[-4000:]}"
    assert "BATCH-DONE" in text, text
    in_srun, in_horovodrun = text.split("STEP-HOROVODRUN")
    srun_res, hvdrun_res = results(in_srun), results(in_horovodrun)
    check_layout(srun_res, mpi=True)
    check_layout(hvdrun_res, mpi=False)  # horovodrun's own transport, as on any host
    assert srun_res[0]["slurm_job"] == hvdrun_res[0]["slurm_job"]
    check_numpy(srun_res)
    check_numpy(hvdrun_res)


def _key_files() -> set[str]:
    d = f"/tmp/horovod-srun-{os.getuid()}"
    return set(os.listdir(d)) if os.path.isdir(d) else set()


def test_srun_without_mpi_flag_joins_through_task_0s_store(slurm):
    """``srun -n 3 python train.py`` without ``--mpi`` (Slurm's default MpiDefault=none): no PMI server, so MPI
    cannot connect the tasks (Open MPI's MPI_Init used to abort them); the tasks meet at task 0's store instead,
    the key shared through a file of this user's that is gone when the job ends."""
    before = _key_files()
    proc = srun("-n", "3", sys.executable, WORKER, "numpy")
    _ok(proc)
    res = results(proc.stdout)
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"], r["cross_size"], r["mpi"]) for r in res] == \
        [(rank, 3, rank, 3, 1, False) for rank in range(3)], res
    assert [r["slurm_procid"] for r in res] == ["0", "1", "2"]
    check_numpy(res)
    assert _key_files() <= before


def test_srun_pmix_with_gloo_controller_runs_without_mpi(slurm):
    """``HOROVOD_CONTROLLER=gloo`` under ``srun --mpi=pmix``: the user asked for Horovod's own transport (it
    used to be refused): the tasks join through task 0's store, MPI untouched."""
    proc = srun("--export=ALL,HOROVOD_CONTROLLER=gloo", "-n", "2", "--mpi=pmix", sys.executable, WORKER, "numpy")
    _ok(proc)
    res = results(proc.stdout)
    check_layout(res, mpi=False)
    check_numpy(res)


def _open_mpi_without_pmi2() -> bool:
    """What horovod.transport.mpi says of this machine's MPI, asked in a process of its own (it loads libmpi)."""
    proc = subprocess.run([sys.executable, "-c", "from horovod.transport.mpi import open_mpi_without_pmi2 as f; "
                           "print(f())"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() in ("True", "False"), proc.stderr
    return proc.stdout.strip() == "True"


def test_srun_pmi2_with_an_open_mpi_without_pmi2(slurm):
    """``srun --mpi=pmi2`` (a common MpiDefault) with an Open MPI built without Slurm's PMI-2, as Debian's is:
    MPI_Init aborted every task with Open MPI's advice to rebuild it.  Now the tasks join through task 0's
    store, as without ``--mpi``; an Open MPI that has PMI-2 is left to connect them."""
    if "pmi2" not in subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30).stdout \
            + subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30).stderr:
        pytest.skip("this Slurm has no pmi2 plugin")
    proc = srun("-n", "2", "--mpi=pmi2", sys.executable, WORKER, "torch")
    _ok(proc)
    res = results(proc.stdout)
    check_layout(res, mpi=not _open_mpi_without_pmi2())
    check_torch(res)


def test_srun_pmi2_told_to_use_mpi_is_refused_with_the_fix(slurm):
    """``HOROVOD_CONTROLLER=mpi`` under ``srun --mpi=pmi2`` with such an Open MPI: refused before MPI_Init, the
    text naming pmi2, the Open MPI and both fixes (not Open MPI's abort)."""
    if not _open_mpi_without_pmi2():
        pytest.skip("this Open MPI can use PMI-2")
    proc = srun("--export=ALL,HOROVOD_CONTROLLER=mpi", "-n", "2", "--mpi=pmi2", sys.executable, WORKER, "numpy")
    assert proc.returncode != 0 and not results(proc.stdout), proc.stdout
    assert "srun started 2 tasks (this is task 0) under srun --mpi=pmi2, but this Open MPI (Open MPI v" \
        in proc.stderr, proc.stderr
    assert "run srun --mpi=pmix" in proc.stderr and "unset HOROVOD_CONTROLLER=mpi" in proc.stderr, proc.stderr
    assert "MPI_Init" not in proc.stderr, proc.stderr


def test_srun_one_task_without_mpi_flag_runs_alone(slurm):
    """``srun python train.py`` (one task, no ``--mpi``) is a single process: it runs as one, without MPI."""
    proc = srun("-n", "1", sys.executable, WORKER, "numpy")
    _ok(proc)
    (r,) = results(proc.stdout)
    assert (r["rank"], r["size"], r["local_size"], r["mpi"]) == (0, 1, 1, False), r
    assert r["sum"] == list(np.arange(5.0)), r


def test_torchrun_in_an_srun_step(slurm):
    """``srun -n 1 torchrun --nproc_per_node=2 train.py``: torchrun's world wins over the one-task step."""
    pytest.importorskip("torch")
    proc = srun("-n", "1", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", WORKER, "numpy")
    _ok(proc)
    res = results(proc.stdout)
    check_layout(res, mpi=False)
    check_numpy(res)


@pytest.fixture(scope="module")
def hosts_partition(slurm) -> None:
    """The two-node partition ``hosts`` (nodes in the namespaces of .ci/netns_hosts.sh, run before the cluster)."""
    proc = subprocess.run(["sinfo", "-h", "-p", "hosts", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
    if not proc.stdout.strip():
        reason = ("no Slurm partition 'hosts': .ci/netns_hosts.sh up, then .ci/slurm_cluster.sh up, gives the "
                  "cluster a slurmd in each of two network-namespace hosts")
        if os.environ.get("HOROVOD_TEST_REQUIRE_MULTIHOST") == "1" and \
                os.environ.get("HOROVOD_TEST_REQUIRE_SLURM") == "1":
            pytest.fail(f"multi-node Slurm tests required but unavailable: {reason}")
        pytest.skip(reason)


@pytest.mark.timeout(90)
def test_srun_two_nodes_pmix_numpy(hosts_partition):
    """``srun -N 2 -n 2 --mpi=pmix`` on two nodes (network namespaces): one task per node, each its own
    network, Open MPI wired by Slurm's PMIx across nodes and Horovod's collectives across the bridge."""
    proc = srun("-p", "hosts", "-N", "2", "-n", "2", "--mpi=pmix", sys.executable, WORKER, "numpy")
    _ok(proc)
    res = results(proc.stdout)
    assert [r["rank"] for r in res] == [0, 1], res
    for r in res:
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"], r["mpi"]) == \
            (2, 0, 1, 2, True), r
    assert [r["slurm_procid"] for r in res] == ["0", "1"]
    assert len({r["slurm_job"] for r in res}) == 1 and res[0]["slurm_job"], res
    assert sorted(r["slurm_node"] for r in res) == ["hvdh1", "hvdh2"], res
    assert len({r["netns"] for r in res} | {os.readlink("/proc/self/ns/net")}) == 3, res
    check_numpy(res)


def check_two_node_layout(res: list[dict]) -> None:
    """``-N 2 -n 3``: srun's block distribution puts tasks 0 and 1 on hvdh1, task 2 on hvdh2."""
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"], r["slurm_node"]) for r in res] == \
        [(0, 3, 0, 2, "hvdh1"), (1, 3, 1, 2, "hvdh1"), (2, 3, 0, 1, "hvdh2")], res
    assert [r["cross_size"] for r in res] == [2, 1, 2] and not any(r["mpi"] for r in res), res
    assert len({r["netns"] for r in res} | {os.readlink("/proc/self/ns/net")}) == 3, res


@pytest.mark.timeout(90)
@pytest.mark.parametrize("key, mode", [(False, "numpy"), (True, "torch")], ids=["munge", "users-key"])
def test_srun_two_nodes_without_mpi(hosts_partition, key, mode):
    """``srun -N 2 -n 3`` without ``--mpi``.  Without a key, task 0 hands a fresh one to the tasks of the other
    node in MUNGE credentials (Slurm's own authentication) only this user can decode; with
    ``export HOROVOD_SECRET_KEY=...`` before srun, every task uses the key srun passed on."""
    export = [f"--export=ALL,HOROVOD_SECRET_KEY={os.urandom(32).hex()}"] if key else []
    proc = srun(*export, "-p", "hosts", "-N", "2", "-n", "3", sys.executable, WORKER, mode)
    _ok(proc)
    res = results(proc.stdout)
    check_two_node_layout(res)
    (check_torch if mode == "torch" else check_numpy)(res)


@pytest.mark.timeout(90)
def test_srun_two_nodes_pmi2_with_an_open_mpi_without_pmi2(hosts_partition):
    """``srun -N 2 -n 3 --mpi=pmi2``: the PMI-2 variables make the tasks look MPICH-launched; they are srun's
    tasks, and (this Open MPI unable to use PMI-2) they join across the nodes through MUNGE."""
    if not _open_mpi_without_pmi2():
        pytest.skip("this Open MPI can use PMI-2")
    proc = srun("-p", "hosts", "-N", "2", "-n", "3", "--mpi=pmi2", sys.executable, WORKER, "numpy")
    _ok(proc)
    res = results(proc.stdout)
    check_two_node_layout(res)
    check_numpy(res)


@pytest.mark.timeout(90)
def test_srun_two_nodes_without_mpi_task_0_never_initializes(hosts_partition):
    """Task 0 exits without ``hvd.init()``: the other tasks name it within the start timeout, never hang."""
    proc = srun("--export=ALL,HOROVOD_START_TIMEOUT=4", "-p", "hosts", "-N", "2", "-n", "2", sys.executable,
                WORKER, "numpy", "--rank0-exits")
    assert proc.returncode != 0 and not results(proc.stdout), proc.stdout
    assert "rank 1 could not get the job key from task 0 at 10.213.0.11 (ports " in proc.stderr, proc.stderr
    assert "within the start timeout (4 s)" in proc.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keyed, text", [
    (2, "rank 2 has HOROVOD_SECRET_KEY but rank 0 of this srun job has none"),
    (0, "rank 1 has no HOROVOD_SECRET_KEY but task 0 of this srun step"),
])
def test_srun_two_nodes_key_in_one_task_only(hosts_partition, keyed, text):
    """``HOROVOD_SECRET_KEY`` in one task's environment only (set inside the job script, not exported before
    srun): the tasks said they could not reach the store or decode a credential; they name the key now."""
    script = (f'if [ "$SLURM_PROCID" = {keyed} ]; then export HOROVOD_SECRET_KEY={os.urandom(32).hex()}; fi; '
              f'exec {sys.executable} {WORKER} numpy')
    proc = srun("--export=ALL,HOROVOD_START_TIMEOUT=3", "-p", "hosts", "-N", "2", "-n", "3", "bash", "-c", script)
    assert proc.returncode != 0 and not results(proc.stdout), proc.stdout
    assert text in proc.stderr, proc.stderr
    assert "is HOROVOD_SECRET_KEY set in every rank or in none" in proc.stderr, proc.stderr
