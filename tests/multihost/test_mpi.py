"""MPI launches: ``mpirun`` (Debian's Open MPI) on this host and across namespace hosts, ``horovodrun --mpi``,
``hvd.init(comm=...)``, env detection for Open MPI, MPICH and Slurm."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, WORKER

from horovod.transport import mpi as mpi_mod
from horovod.transport.mpi import LaunchEnv, detect_launch

MPI_WORKER = os.path.join("tests", "multihost", "mpi_worker.py")
HAVE_MPI = shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI and os.environ.get("HOROVOD_TEST_REQUIRE_MULTIHOST") != "1",
                               reason="needs mpirun and mpi4py")
pytestmark = pytest.mark.timeout(180)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI_", "SLURM_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def mpirun(np_: int, argv: list[str], *, env: dict[str, str] | None = None, extra: list[str] = (),
           ns: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), *extra, *argv]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    return subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


# ------------------------------------------------------------------------------------- env detection
def test_detect_open_mpi_mpich_slurm():
    assert detect_launch({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == \
        LaunchEnv("openmpi", 3, 4, 1, 2)
    assert detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}) == \
        LaunchEnv("mpich", 1, 2, 1, 2)
    slurm = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2),2", "SLURM_JOB_ID": "7"}
    assert detect_launch(slurm) == LaunchEnv("slurm", 5, 6, 1, 2)


def test_detect_srun_pmi2_as_slurm_and_hydra_inside_a_step_as_mpich():
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE too: still srun's task (its local rank is SLURM_LOCALID's); an
    mpiexec (Hydra) started inside a one-task step numbers its own processes: those are MPICH's."""
    step = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_JOB_ID": "7", "SLURM_MPI_TYPE": "pmi2"}
    assert detect_launch({**step, "PMI_FD": "11", "PMI_RANK": "1", "PMI_SIZE": "3"}) == LaunchEnv("slurm", 1, 3, 1, 2)
    one = {**step, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "1"}
    hydra = {"PMI_FD": "5", "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    assert detect_launch({**one, **hydra}) == LaunchEnv("mpich", 3, 4, 3, 4)
    assert detect_launch({**one, **hydra, "PMI_RANK": "0"}) == LaunchEnv("mpich", 0, 4, 3, 4)


def test_open_mpi_components_beside_the_loaded_libmpi(tmp_path):
    """The pmix components of the Open MPI whose libmpi the process mapped: a standard prefix
    (``lib/openmpi``), Debian's layout (``lib/openmpi/lib/openmpi3``), none found (None: unknown)."""
    maps = tmp_path / "maps"
    for layout in ("openmpi", "openmpi/lib/openmpi3"):
        lib = tmp_path / layout.replace("/", "_") / "lib"
        (lib / layout).mkdir(parents=True)
        for name in ("mca_pmix_ext3x.so", "mca_pmix_s2.so", "mca_ess_pmi.so"):
            (lib / layout / name).touch()
        maps.write_text(f"7fb4-7fb5 r--p 00000000 fe:00 5595947   {lib}/libmpi.so.40.30.4\n")
        assert mpi_mod.open_mpi_components("pmix", str(maps), env={}) == {"ext3x", "s2"}
        assert mpi_mod.open_mpi_components("ess", str(maps), env={}) == {"pmi"}
    maps.write_text(f"7fb4-7fb5 r--p 00000000 fe:00 1   {tmp_path}/nowhere/libmpi.so.40\n")
    assert mpi_mod.open_mpi_components("pmix", str(maps), env={}) is None
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "mca_pmix_s1.so").touch()
    assert mpi_mod.open_mpi_components("pmix", str(maps), env={"OMPI_MCA_mca_component_path": str(extra)}) == {"s1"}
    maps.write_text("7fb4-7fb5 r--p 00000000 fe:00 1   /usr/lib/libc.so.6\n")
    assert mpi_mod.open_mpi_components("pmix", str(maps), env={}) is None


@pytest.mark.parametrize("version, components, without", [
    ("Open MPI v4.1.4, package: Debian OpenMPI", {"ext3x", "flux", "isolated"}, True),
    ("Open MPI v4.1.4", {"ext3x", "s1", "s2"}, False),  # built --with-pmi
    ("Open MPI v4.1.4", None, False),  # components not found: MPI is left to try
    ("Open MPI v5.0.3, package: Open MPI", None, True),  # PMIx only
    ("MPICH Version: 4.1", set(), False),
])
def test_open_mpi_without_pmi2(monkeypatch, version, components, without):
    monkeypatch.setattr(mpi_mod, "mpi_available", lambda: True)
    monkeypatch.setattr(mpi_mod, "library_version", lambda: version)
    monkeypatch.setattr(mpi_mod, "open_mpi_components", lambda framework: components)
    assert mpi_mod.open_mpi_without_pmi2() is without


def test_detect_ignores_horovodrun_and_batch_scripts():
    # horovodrun's own variables win over an outer mpirun/srun.
    assert detect_launch({"HOROVOD_RANK": "0", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}) is None
    # An sbatch script is rank 0 of the allocation but no srun step: not a launch.
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}) is None
    assert detect_launch({}) is None


@needs_mpi
def test_fake_slurm_step():
    code = "import horovod.numpy as hvd; hvd.init(); print('SLURM', hvd.size(), hvd.mpi_enabled())"
    one = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "1"}
    # One task and no PMI server from srun: a single process, run without MPI (Open MPI's MPI_Init would end it
    # under a real srun: tests/multihost/test_slurm.py).
    proc = subprocess.run([sys.executable, "-c", code], env=_env(**one), capture_output=True, text=True,
                          timeout=60)
    _ok(proc)
    assert "SLURM 1 False" in proc.stdout
    # srun started 2 tasks with no PMI server (no --mpi=pmix), MPI asked for (HOROVOD_CONTROLLER=mpi; without
    # it the tasks join through task 0's store: tests/multihost/test_slurm.py) and the MPI is Open MPI: refused
    # before MPI_Init, naming the fix, instead of Open MPI's abort (real srun) or two jobs of size 1.
    two = dict(one, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2", HOROVOD_CONTROLLER="mpi")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(**two), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "srun started 2 tasks (this is task 0) without MPI process management" \
        in proc.stderr, proc.stderr
    assert "run srun --mpi=pmix" in proc.stderr
    # Another MPI (one that falls back to a singleton, e.g. MPICH): MPI sees 1 of the 2 tasks -> a clear error
    # instead of two jobs of size 1.
    other = ("import horovod.transport.mpi as m; m.library_version = lambda: 'MPICH Version: 4.0'; " + code)
    proc = subprocess.run([sys.executable, "-c", other], env=_env(**two), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "slurm started 2 processes but MPI sees 1" in proc.stderr, proc.stderr
    assert "srun with --mpi=pmix" in proc.stderr
    # A PMI server's variables (srun --mpi=pmix): an MPI job of any size, as before.
    proc = subprocess.run([sys.executable, "-c", code], env=_env(**dict(two, PMIX_RANK="0")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "slurm started 2 processes but MPI sees 1" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------- mpirun on this host
@needs_mpi
@pytest.mark.parametrize("how", ["without-mpi4py", "gloo-controller"])
def test_mpirun_on_one_host_without_mpi_joins_through_rank_0s_store(tmp_path, how):
    """``mpirun -np 3 python train.py`` where mpi4py is not installed (it failed, naming mpi4py), or with
    ``HOROVOD_CONTROLLER=gloo`` (it was refused): on one host the processes meet at rank 0's store instead and
    run on Horovod's own transport; ranks as mpirun assigned them; no key file left."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, json\n"
        + ("sys.modules['mpi4py'] = None  # as if not installed\n" if how == "without-mpi4py" else "")
        + "import numpy as np\n"
        "import horovod.numpy as hvd\n"
        "hvd.init()\n"
        "r = hvd.rank()\n"
        "out = dict(rank=r, size=hvd.size(), local=(hvd.local_rank(), hvd.local_size()), mpi=hvd.mpi_enabled(),\n"
        "           ompi=int(os.environ['OMPI_COMM_WORLD_RANK']),\n"
        "           sum=hvd.allreduce(np.arange(4.0) * (r + 1), op=hvd.Sum, name='s').tolist(),\n"
        "           gather=hvd.allgather(np.full((r + 1,), r), name='g').tolist())\n"
        "os.write(1, ('RESULT ' + json.dumps(out) + '\\n').encode())\n")
    key_dir = f"/tmp/horovod-mpirun-{os.getuid()}"
    before = set(os.listdir(key_dir)) if os.path.isdir(key_dir) else set()
    extra = ["-x", "HOROVOD_CONTROLLER=gloo"] if how == "gloo-controller" else []
    proc = mpirun(3, [sys.executable, str(script)], extra=extra)
    _ok(proc)
    res = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
                  if "RESULT " in line), key=lambda r: r["rank"])
    assert [(r["rank"], r["ompi"], r["size"], r["local"], r["mpi"]) for r in res] == \
        [(rank, rank, 3, [rank, 3], False) for rank in range(3)], res
    for r in res:
        assert r["sum"] == (np.arange(4.0) * 6).tolist() and r["gather"] == [0, 1, 1, 2, 2, 2]
    assert (set(os.listdir(key_dir)) if os.path.isdir(key_dir) else set()) <= before


@needs_mpi
def test_numpy_suite_under_mpirun():
    proc = mpirun(4, [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                      "tests/parallel/test_numpy_ops.py", "-k", "not test_layout_matches_launcher"], timeout=170)
    _ok(proc)
    assert proc.stdout.count("passed") >= 4


@needs_mpi
def test_layout_and_mpi_data_plane(tmp_path):
    proc = mpirun(4, [sys.executable, WORKER, "check", "MpiCommunicator", str(tmp_path)])
    _ok(proc)
    assert "MULTIHOST-OK size=4 local_size=4 cross_size=1 backend=MpiCommunicator mpi=True" in proc.stdout


@needs_mpi
@pytest.mark.parametrize("mode,env,marker", [
    ("mix", {}, "MIX-OK"),                # the user's own mpi4py calls while Horovod's are in flight
    ("ranks", {}, "RANKS-OK"),            # hvd.init(comm=[0, 2])
    ("ranks-unordered", {}, "RANKS-UNORDERED-OK"),  # hvd.init(comm=[3, 1]): world rank 3 is rank 0
    ("comm", {}, "COMM-OK"),              # hvd.init(comm=<split communicator>)
    ("threads-off", {"HOROVOD_MPI_THREADS_DISABLE": "1"}, "THREADS-OFF-OK"),
    ("gloo-ops", {"HOROVOD_CPU_OPERATIONS": "gloo"}, "GLOO-OPS-OK"),
])
def test_mpi_modes(mode, env, marker):
    proc = mpirun(4, [sys.executable, MPI_WORKER, mode], env=_env(**env))
    _ok(proc)
    expected = 2 if mode.startswith("ranks") else 4
    assert proc.stdout.count(marker) == expected, proc.stdout


MULTI_COMM_SCRIPT = """
import json, os
import torch
from mpi4py import MPI
import horovod.torch as hvd
world = MPI.COMM_WORLD
sub = world.Split(color=world.rank % 2, key=world.rank)
world_dup, sub_dup = world.Dup(), sub.Dup()
evens = hvd.ProcessSet(range(0, world.size, 2))  # on the even ranks: the same set as their `sub`
errors = []
def attempt(sets):
    try:
        hvd.init(comm=world, process_sets=sets)
    except ValueError as e:
        errors.append(str(e).split(": ProcessSet")[0])
        return
    errors.append("ok")
attempt([hvd.ProcessSet(sub), hvd.ProcessSet(world_dup), hvd.ProcessSet(sub_dup), evens, hvd.ProcessSet([0])])
attempt([hvd.ProcessSet(sub), hvd.ProcessSet(world_dup), hvd.ProcessSet([0])])
attempt([hvd.ProcessSet(sub), evens, hvd.ProcessSet([0])])
mine = hvd.ProcessSet(sub)
attempt([mine, hvd.ProcessSet([0])])
total = hvd.allreduce(torch.tensor([float(world.rank + 1)]), op=hvd.Sum, process_set=mine, name="sub")
out = dict(rank=hvd.rank(), errors=errors, table=hvd.mpi_ops._basics._get_process_set_ids_and_ranks(),
           mine=[mine.process_set_id, mine.ranks], dup_id=hvd.mpi_ops._basics._comm_process_set_id(sub_dup),
           global_comm=hvd.global_process_set.mpi_comm == world, total=float(total[0]))
os.write(1, ("RESULT " + json.dumps(out) + "\\n").encode())
world.barrier()
hvd.shutdown()
"""


@needs_mpi
def test_process_sets_from_communicators_with_duplicates_as_upstream(tmp_path):
    """Upstream's test_process_sets_multi_comm: an entry whose set an earlier entry already has (a ``Dup()`` of a
    communicator, a list of ranks equal to this rank's ``Split`` group) makes init() raise, but only on the
    ranks where it is one, and Horovod stays initialized, so a later init() with a clean list goes on.  The other
    ranks' groups were inserted into each rank's list: [sub, evens] was a duplicate on the odd ranks too (their
    init() failed while upstream's succeeds), error indices named the expanded list, and the next init() was a
    new job on some ranks only: the job hung."""
    script = tmp_path / "multi_comm.py"
    script.write_text(MULTI_COMM_SCRIPT)
    proc = mpirun(4, [sys.executable, str(script)], env=_env(OMP_NUM_THREADS="1"))
    _ok(proc)
    res = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
                  if "RESULT " in line), key=lambda r: r["rank"])
    assert [r["rank"] for r in res] == [0, 1, 2, 3], proc.stdout + proc.stderr
    dup = "Horovod could not be initialized because process_sets entry number {} is a duplicate"
    # upstream's core: the communicators' groups first (in order of lowest rank), then the lists of ranks
    table = {"0": [0, 1, 2, 3], "1": [0, 2], "2": [1, 3], "3": [0]}
    for r in res:
        even = r["rank"] % 2 == 0
        assert r["errors"] == [dup.format(1), dup.format(1), dup.format(1) if even else "ok", "ok"], r
        assert r["table"] == table, r
        assert r["mine"] == ([1, [0, 2]] if even else [2, [1, 3]]), r
        assert r["dup_id"] == r["mine"][0] and r["global_comm"] is True, r
        assert r["total"] == float(sum(q + 1 for q in range(4) if q % 2 == r["rank"] % 2)), r


@needs_mpi
def test_horovodrun_mpi_and_check_build(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "--mpi", "-np", "2", "--mpi-args=--oversubscribe",
                           sys.executable, WORKER, "check", "MpiCommunicator", str(tmp_path)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    _ok(proc)
    assert "MULTIHOST-OK size=2" in proc.stdout and "mpi=True" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "--check-build"], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert "Available Controllers:\n    [X] MPI\n    [X] Gloo" in proc.stdout


# ------------------------------------------------------------------------------------- mpirun across hosts
@needs_mpi
def test_horovodrun_mpi_across_namespace_hosts(netns_hosts, tmp_path):
    # Every namespace host has the same hostname, so Open MPI's shared-memory transport would mix up the
    # nodes' segments: TCP only (a property of this test bed, not of real clusters).
    proc = netns_hosts.horovodrun("hvdh1", [
        "--mpi", "-np", "4", "-H", "hvdh2:2,hvdh3:2", "--network-interface", "eth0",
        "--mpi-args=--mca btl tcp,self --mca oob_tcp_if_include eth0", sys.executable, WORKER, "check",
        "MpiCommunicator", str(tmp_path)], timeout=120)
    _ok(proc)
    assert "MULTIHOST-OK size=4 local_size=2 cross_size=2 backend=MpiCommunicator mpi=True" in proc.stdout


@needs_mpi
def test_mpi_start_up_unpickles_nothing(tmp_path):
    """hvd.init() under mpirun exchanges the key, layout and addresses with buffer collectives and JSON: with
    mpi4py's pickling calls (bcast, allgather, ...) made to raise, it still starts and reduces correctly."""
    script = tmp_path / "nopickle.py"
    script.write_text(
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "class NoPickle(MPI.Intracomm):  # Dup/Split of it stay NoPickle\n"
        "    def _refuse(self, *a, **k):\n"
        "        raise AssertionError('pickled MPI call during Horovod start-up')\n"
        "    bcast = allgather = gather = scatter = recv = send = sendrecv = alltoall = allreduce = _refuse\n"
        "import horovod.numpy as hvd\n"
        "hvd.init(comm=NoPickle(MPI.COMM_WORLD))\n"
        "out = hvd.allreduce(np.full(4, hvd.rank() + 1.0), op=hvd.Sum, name='x')\n"
        "assert out.tolist() == [hvd.size() * (hvd.size() + 1) / 2] * 4, out\n"
        "import os\n"
        "os.write(1, f'ok {hvd.rank()}\\n'.encode())  # one write: two ranks' lines do not interleave\n")
    proc = mpirun(2, [sys.executable, str(script)])
    _ok(proc)
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("ok ")) == ["ok 0", "ok 1"], \
        proc.stdout
