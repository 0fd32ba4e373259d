"""horovodrun end to end on this host, with tiny worker scripts that do not need the engine."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from launch_util import signal_once_ready

import horovod

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 60


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def horovodrun(*args, timeout=TIMEOUT, text=True, env=None):
    return subprocess.run([sys.executable, "-m", "horovod.runner", *args], env={**_env(), **(env or {})},
                          capture_output=True, text=text, timeout=timeout)


def _lines(text, rank, stream="stdout"):
    tag = f"[{rank}]<{stream}>:"
    return [line[len(tag):] for line in text.splitlines() if line.startswith(tag)]


def _gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


ENV_SCRIPT = textwrap.dedent("""
    import json, os
    names = ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
             "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
             "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "PYTHONUNBUFFERED",
             "HOROVOD_SECRET_KEY", "HOROVOD_START_TIMEOUT", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
             "LAUNCHER_VAR"]
    print(json.dumps({n: os.environ.get(n) for n in names}))
""")


def test_env_per_rank():
    os.environ["LAUNCHER_VAR"] = "inherited"
    try:
        proc = horovodrun("-np", "3", "--fusion-threshold-mb", "8", "--cycle-time-ms", "2.5",
                          "--start-timeout", "17", sys.executable, "-c", ENV_SCRIPT)
    finally:
        del os.environ["LAUNCHER_VAR"]
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads(_lines(proc.stdout, r)[0]) for r in range(3)]
    for r, env in enumerate(envs):
        assert env["HOROVOD_RANK"] == str(r) and env["HOROVOD_SIZE"] == "3"
        assert env["HOROVOD_LOCAL_RANK"] == str(r) and env["HOROVOD_LOCAL_SIZE"] == "3"
        assert env["HOROVOD_CROSS_RANK"] == "0" and env["HOROVOD_CROSS_SIZE"] == "1"
        assert env["HOROVOD_HOSTNAME"] == "localhost"
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]) > 0
        assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env["PYTHONUNBUFFERED"] == "1" and env["HOROVOD_START_TIMEOUT"] == "17"
        assert re.fullmatch(r"[0-9a-f]{64}", env["HOROVOD_SECRET_KEY"])
        assert env["HOROVOD_FUSION_THRESHOLD"] == str(8 * 1024 * 1024) and env["HOROVOD_CYCLE_TIME"] == "2.5"
        assert env["LAUNCHER_VAR"] == "inherited"
    assert len({e["HOROVOD_SECRET_KEY"] for e in envs}) == 1
    assert len({e["HOROVOD_GLOO_RENDEZVOUS_PORT"] for e in envs}) == 1
    assert "starting 3 ranks on localhost:3" in proc.stderr


def test_env_multi_slot_hosts_cross_values():
    # Two names of this host: local/cross values follow the slot plan.
    proc = horovodrun("-np", "3", "-H", "localhost:2,127.0.0.1:1", sys.executable, "-c", ENV_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(_lines(proc.stdout, r)[0]) for r in range(3)]
    assert [(e["HOROVOD_HOSTNAME"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"], e["HOROVOD_CROSS_RANK"],
             e["HOROVOD_CROSS_SIZE"]) for e in got] == [
        ("localhost", "0", "2", "0", "2"), ("localhost", "1", "2", "0", "1"), ("127.0.0.1", "0", "1", "1", "2")]


OUTPUT_SCRIPT = textwrap.dedent("""
    import os, sys
    r = os.environ["HOROVOD_RANK"]
    sys.stdout.write("line one " + r + "\\nprogress 50%\\rprogress 100%\\r\\nunicode \\u00e9\\u4e2d\\n")
    sys.stderr.write("error line " + r + "\\n")
    sys.stdout.flush()
    sys.stdout.buffer.write("split \\u00e9".encode()[:-1]); sys.stdout.flush()
    sys.stdout.buffer.write("split \\u00e9".encode()[-1:] + b"\\n")
    sys.stdout.write("partial last " + r)
""")


def test_output_prefixing(tmp_path):
    proc = horovodrun("-np", "2", "--output-filename", str(tmp_path / "logs"), sys.executable, "-c",
                      OUTPUT_SCRIPT, text=False)
    assert proc.returncode == 0, proc.stderr
    raw = proc.stdout.decode()
    proc.stdout, proc.stderr = raw.replace("\r\n", "\n").replace("\r", "\n"), proc.stderr.decode()
    for r in range(2):
        assert _lines(proc.stdout, r) == [f"line one {r}", "progress 50%", "progress 100%", "unicode é中",
                                          "split é", f"partial last {r}"]
        # Each segment keeps its own terminator ("\r" stays "\r"); the other rank's lines may come in between.
        ends = re.findall(rf"\[{r}\]<stdout>:(progress [^\r\n]*)([\r\n])", raw)
        assert ends == [("progress 50%", "\r"), ("progress 100%", "\n")], ends
        assert _lines(proc.stderr, r, "stderr") == [f"error line {r}"]
        rank_dir = tmp_path / "logs" / f"rank.{r}"
        stdout = (rank_dir / "stdout").read_text()
        assert stdout.startswith(f"line one {r}\n") and stdout.endswith(f"partial last {r}")
        assert (rank_dir / "stderr").read_text() == f"error line {r}\n"


def test_output_filename_np1_and_timestamp(tmp_path):
    proc = horovodrun("-np", "1", "--output-filename", str(tmp_path), "-prefix-timestamp",
                      sys.executable, "-c", "print('hello')")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "rank.0" / "stdout").read_text() == "hello\n"
    assert re.search(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:hello$", proc.stdout, re.M), proc.stdout


ELASTIC_TWO_SLOTS = ["--min-np", "1", "-H", "localhost:1,127.0.0.1:1"]


@pytest.mark.parametrize("mode", [[], ELASTIC_TWO_SLOTS])
def test_output_filename_that_cannot_be_created_is_named(tmp_path, mode):
    """An --output-filename below a regular file failed with a bare "[Errno 20] Not a directory: '...'" (a
    static job after starting the rendezvous store): the error names the option, the path and the part of it
    that is a file, before anything starts.  A rank directory that cannot be made is named the same way."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = afile / "logs"
    proc = horovodrun("-np", "2", *mode, "--output-filename", str(out), sys.executable, "-c", "print('started')")
    assert proc.returncode == 1, proc.stderr
    assert (f"horovodrun: error: --output-filename {out}: cannot create the directory: {afile} is not a "
            "directory\n") in proc.stderr, proc.stderr
    assert "started" not in proc.stdout and "rendezvous" not in proc.stderr, proc.stderr
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank.1").write_text("x")
    proc = horovodrun("-np", "2", *mode, "--output-filename", str(logs), sys.executable, "-c", "print('started')")
    assert proc.returncode == 1, proc.stderr
    assert (f"horovodrun: error: --output-filename {logs}: cannot create {logs / 'rank.1'}: {logs / 'rank.1'} "
            "is not a directory\n") in proc.stderr, proc.stderr


def test_horovod_run_output_filename_that_cannot_be_created(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"^--output-filename {afile}/out: cannot create the directory: "
                                         f"{afile} is not a directory$"):
        horovod.run(_rank_env, np=1, output_filename=str(afile / "out"))


@pytest.mark.parametrize("mode", [[], ELASTIC_TWO_SLOTS[:2], ["--mpi"]])
def test_missing_hostfile_is_named(tmp_path, mode):
    """A mistyped --hostfile failed with a bare "[Errno 2] No such file or directory: '...'"."""
    missing = tmp_path / "hosts.txt"
    proc = horovodrun("-np", "2", *mode, "--hostfile", str(missing), "true")
    assert proc.returncode == 1, proc.stderr
    assert f"horovodrun: error: --hostfile {missing}: cannot read it: No such file or directory\n" in proc.stderr, \
        proc.stderr
    proc = horovodrun("-np", "2", *mode, "--hostfile", str(tmp_path), "true")
    assert f"horovodrun: error: --hostfile {tmp_path}: cannot read it: Is a directory\n" in proc.stderr, \
        proc.stderr


def test_shell_command_string():
    proc = horovodrun("-np", "2", "echo rank $HOROVOD_RANK | tr a-z A-Z")
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout, 0) == ["RANK 0"] and _lines(proc.stdout, 1) == ["RANK 1"]


FAIL_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    r = int(os.environ["HOROVOD_RANK"])
    child = subprocess.Popen(["sleep", "60"])          # a grandchild must die too
    print("pids", os.getpid(), child.pid, flush=True)
    if r == 1:
        time.sleep(1.0)
        sys.exit(3)
    time.sleep(60)
""")


def _pids(stdout, np):
    pids = []
    for r in range(np):
        for line in _lines(stdout, r):
            if line.startswith("pids "):
                pids += [int(p) for p in line.split()[1:]]
    return pids


def test_failure_kills_others_and_reports_first():
    start = time.monotonic()
    proc = horovodrun("-np", "3", sys.executable, "-c", FAIL_SCRIPT)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 20
    assert "Process 1 exit with status code 3." in proc.stderr
    assert "Terminating remaining workers after failure of Process 1." in proc.stderr
    assert ("Horovod detected that one or more processes exited with non-zero status, thus causing the job to "
            "be terminated. The first process to do so was:\nProcess name: 1\nExit code: 3\n") in proc.stderr
    pids = _pids(proc.stdout, 3)
    assert len(pids) == 6
    assert _gone(pids, within=5)


EXITS_BEFORE_INIT_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import horovod.numpy as hvd
    if os.environ["HOROVOD_RANK"] == "1":
        sys.exit(0)  # returns early, without a word, as a script with a rank-dependent branch can
    hvd.init()
    hvd.allreduce(np.ones(2))
""")


@pytest.mark.parametrize("np_", [2, 3])
def test_rank_exiting_zero_before_init_is_named_at_once(np_):
    """Its peers waited out the start timeout (30 s) in init(); the launcher saw the process end, and says so
    through the store: every waiting rank fails within a poll, naming it."""
    start = time.monotonic()
    proc = horovodrun("-np", str(np_), sys.executable, "-c", EXITS_BEFORE_INIT_SCRIPT,
                      env={"HOROVOD_START_TIMEOUT": "60"})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert elapsed < 20, elapsed
    assert "the process of rank 1 exited (status 0) without calling init() while rank 0 waited" in proc.stderr, \
        proc.stderr[-3000:]


RAISES_IN_A_STEP_SCRIPT = textwrap.dedent("""
    import time
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    for step in range(5):
        if hvd.rank() == 1 and step == 3:
            time.sleep(0.2)  # the others wait in the step's allreduce
            raise RuntimeError("rank one broke at step 3")
        hvd.allreduce(np.ones(4), name=f"step.{step}")
""")


def test_summary_names_the_rank_that_raised_not_a_peer_it_shut_down():
    """Rank 1 raises while its peers wait in a collective: they fail at once with a ShutdownError naming rank 1
    and often exit before it (its own shutdown takes longer), and the summary named one of them.  The launcher
    now reads each failed rank's last error and names the rank whose failure was not caused by another's."""
    for _ in range(2):
        proc = horovodrun("-np", "3", sys.executable, "-c", RAISES_IN_A_STEP_SCRIPT)
        assert proc.returncode == 1, proc.stderr
        assert "RuntimeError: rank one broke at step 3" in proc.stderr
        assert "Process 1 exit with status code 1." in proc.stderr, proc.stderr[-3000:]
        assert "The first process to do so was:\nProcess name: 1\nExit code: 1\n" in proc.stderr


def test_a_stopped_rank_is_not_waited_for_to_name_the_cause(tmp_path):
    """Rank 0 fails with a ShutdownError caused by rank 1, which is stopped (SIGSTOP; a rank that never reads
    does the same): the launcher waited its whole 3 s grace for rank 1 to exit, which a stopped process never
    does.  It now ends the job once every rank left is stopped, naming rank 0 as before."""
    script = (
        "import os, signal, sys, time\n"
        "if os.environ['HOROVOD_RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "time.sleep(0.5)\n"
        "print('horovod.base.exceptions.ShutdownError: Horovod has been shut down. Cause: rank 1: timed out',\n"
        "      file=sys.stderr)\n"
        f"open({str(tmp_path / 'exited')!r}, 'w').write(repr(time.time()))\n"
        "sys.exit(1)\n")
    proc = horovodrun("-np", "2", sys.executable, "-c", script)
    took = time.time() - float((tmp_path / "exited").read_text())
    assert proc.returncode == 1, proc.stderr
    assert "The first process to do so was:\nProcess name: 0\nExit code: 1\n" in proc.stderr, proc.stderr
    assert took < 2.5, took  # 3 s and more when it waited


def test_worker_killed_by_signal():
    """A rank killed by SIGKILL on this host was reported with Popen's -9 (and a note), one on another host
    with ssh's 137; upstream's local launcher reports 137 too (its middleman exits 128+N): 137, upstream's
    exact words, and the launcher exits 137."""
    proc = horovodrun("-np", "2", sys.executable, "-c",
                      "import os, signal, time\n"
                      "if os.environ['HOROVOD_RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(60)")
    assert proc.returncode == 137, proc.stderr
    assert "Process 0 exit with status code 137.\nTerminating remaining workers after failure of Process 0.\n" \
        in proc.stderr, proc.stderr
    assert proc.stderr.endswith("Horovod detected that one or more processes exited with non-zero status, thus "
                                "causing the job to be terminated. The first process to do so was:\nProcess name: "
                                "0\nExit code: 137\n\n"), proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_kills_workers(sig):
    launcher = subprocess.Popen([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, "-c",
                                 FAIL_SCRIPT.replace("r == 1", "False")],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if "pids" in line:
                seen.append(line)
        pids = _pids("".join(seen), 2)
        assert len(pids) == 4
        launcher.send_signal(sig)
        launcher.wait(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert _gone(pids, within=5)


def test_check_build():
    proc = horovodrun("--check-build")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"Horovod v{horovod.__version__}:\n\nAvailable Frameworks:\n")
    assert proc.stdout.endswith("    [X] Gloo    \n")
    assert "Available Controllers:\n" in proc.stdout and "Available Tensor Operations:\n" in proc.stdout


def test_version_and_errors():
    proc = horovodrun("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == horovod.__version__
    proc = horovodrun("-np", "1", "-H", "not_a_host_spec", "true")
    assert proc.returncode != 0 and "Invalid host input" in proc.stderr
    proc = horovodrun("-np", "1", "-H", "remote-host.invalid:1", "true")
    assert proc.returncode != 0 and "could not connect to some hosts via ssh: remote-host.invalid" in proc.stderr
    # Under --mpi as well, before mpirun's own ssh (which failed with "Host key verification failed" and Open
    # MPI's page of advice on a host never reached before: the check also makes the host known, as upstream's).
    proc = horovodrun("--mpi", "-np", "1", "-H", "remote-host.invalid:1", "true")
    assert proc.returncode != 0 and "could not connect to some hosts via ssh: remote-host.invalid" in proc.stderr
    proc = horovodrun("-np", "1", "--cache-capacity", "-2", "true")
    assert proc.returncode != 0 and "cache_capacity=-2 must be >= 0" in proc.stderr


def _rank_env():
    return os.environ["HOROVOD_RANK"]


def test_horovod_run():
    assert horovod.run(lambda: os.environ["HOROVOD_RANK"], np=2) == ["0", "1"]

    def add(a, b=0):
        return int(os.environ["HOROVOD_RANK"]) + a + b

    assert horovod.run(add, args=(10,), kwargs={"b": 100}, np=3) == [110, 111, 112]


def test_horovod_run_error(capfd):
    def boom():
        if os.environ["HOROVOD_RANK"] == "1":
            raise ValueError("deliberate")
        return 1

    with pytest.raises(RuntimeError, match=r"Process name: 1\nExit code: 1"):
        horovod.run(boom, np=2)
    assert "User function raise error: deliberate" in capfd.readouterr().err


def test_horovod_run_knob_arguments():
    """run()'s knob arguments come from the knob table: a flag's value reaches every worker's environment
    (MB -> bytes as for the flag) and hvd.init() applies it."""
    def settings():
        from horovod.base.config import read_runtime_config

        config = read_runtime_config()   # what hvd.init() parses
        return (os.environ["HOROVOD_FUSION_THRESHOLD"], config.fusion_threshold, config.log_level,
                os.environ.get("HOROVOD_STALL_CHECK_DISABLE"))

    results = horovod.run(settings, np=2, fusion_threshold_mb=2, log_level="info", no_stall_check=None)
    assert results == [(str(2 * 1024 * 1024), 2 * 1024 * 1024, "INFO", None)] * 2
    with pytest.raises(TypeError, match="fusion_threshold_megabytes.*fusion_threshold_mb"):
        horovod.run(_rank_env, fusion_threshold_megabytes=2)
    with pytest.raises(ValueError, match="cycle_time_ms='fast' is not a number"):
        horovod.run(_rank_env, cycle_time_ms="fast")
    with pytest.raises(ValueError, match="fusion_threshold_mb=-1 must be >= 0"):
        horovod.run(_rank_env, fusion_threshold_mb=-1)


def test_horovod_run_elastic(tmp_path):
    """horovod.run() with elastic arguments runs under the elastic driver and returns the last generation's
    results in rank order; a worker failing in generation 0 makes its host leave and the job go on."""
    def train(marker):
        import numpy as np

        import horovod.numpy as hvd
        from horovod.common import elastic

        hvd.init()
        state = elastic.ObjectState(hvd.broadcast_object, hvd.rank, steps=0)

        @elastic.run
        def loop(state):
            while state.steps < 3:
                total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
                if hvd.size() == 2 and hvd.rank() == 1 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(3)   # dies in generation 0: its host is blacklisted, rank 0 goes on alone
                state.steps += 1
                state.commit()
            return float(total[0])

        total = loop(state)
        return hvd.rank(), hvd.size(), total

    results = horovod.run(train, args=(str(tmp_path / "died"),), min_np=1, max_np=2, np=2,
                          hosts="localhost:1,127.0.0.1:1", start_timeout=30)
    assert (tmp_path / "died").exists()
    assert results == [(0, 1, 1.0)]


def test_horovod_run_elastic_function_without_init(tmp_path):
    """Upstream's elastic horovod.run() returns one result per worker (rank order) also for a function that
    never calls hvd.init(); here every such worker stored its result as rank 0's, and the job failed with
    "Process 1 exited successfully but did not return a result"."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    results = horovod.run(lambda x: (os.environ["HOROVOD_ELASTIC_SLOT"], x), args=(7,), np=2, min_np=2, max_np=2,
                          host_discovery_script=str(script), start_timeout=30)
    assert results == [("localhost:0", 7), ("localhost:1", 7)]


def test_horovod_run_argument_errors():
    with pytest.raises(ValueError, match="Argument hosts and hostfile only allow one provided."):
        horovod.run(_rank_env, hosts="a:1", hostfile="f")
    with pytest.raises(ValueError, match="Argument use_gloo and use_mpi only allow one set True."):
        horovod.run(_rank_env, use_gloo=True, use_mpi=True)


@pytest.mark.parametrize("args,message", [
    (["-np", "2", "--min-np", "3"], "--min-np (3) must not be greater than -np (2)."),
    (["-np", "4", "--min-np", "1", "--max-np", "2"], "--max-np (2) must not be less than -np (4)."),
    (["-np", "3", "--max-np", "2"], "--max-np (2) must not be less than -np (3)."),
    (["--min-np", "3", "--max-np", "2"], "--max-np (2) must not be less than --min-np (3)."),
])
def test_elastic_process_counts_out_of_order_are_argument_errors(args, message):
    """-np 2 --min-np 3 waited --elastic-timeout for 3 slots, -np 4 --max-np 2 started 2 workers: both without
    a word.  -np, --min-np and --max-np out of order are an argument error at start (status 2, as argparse's),
    naming both options and their values."""
    proc = horovodrun(*args, "--elastic-timeout", "3", "-H", "localhost:1,127.0.0.1:1", sys.executable, "-c",
                      "print('started')")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"horovodrun: error: {message}\n" in proc.stderr and "started" not in proc.stdout, proc.stderr


def test_horovod_run_elastic_process_counts_out_of_order(monkeypatch):
    """horovod.run() raises the same words as a ValueError before anything starts."""
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "3")
    with pytest.raises(ValueError, match=r"^--min-np \(3\) must not be greater than -np \(2\)\.$"):
        horovod.run(_rank_env, np=2, min_np=3, hosts="localhost:1,127.0.0.1:1")
    with pytest.raises(ValueError, match=r"^--max-np \(2\) must not be less than -np \(4\)\.$"):
        horovod.run(_rank_env, np=4, min_np=1, max_np=2, hosts="localhost:1,127.0.0.1:1")


ALLREDUCE_SCRIPT = textwrap.dedent("""
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum, name="x")
    print("rank", hvd.rank(), "size", hvd.size(), "sum", float(total[0]), flush=True)
""")


def test_static_job_with_horovod_elastic_in_env():
    """HOROVOD_ELASTIC=1 in the user's environment does not make a static job's workers wait for an elastic
    driver (there is none: they failed after the elastic timeout); they take their ranks from horovodrun."""
    start = time.monotonic()
    proc = horovodrun("-np", "2", "--start-timeout", "20", sys.executable, "-c", ALLREDUCE_SCRIPT,
                      env={"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_TIMEOUT": "2",
                           "HOROVOD_ELASTIC_GRACE_SECONDS": "0", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [_lines(proc.stdout, r) for r in range(2)] == [["rank 0 size 2 sum 3.0"], ["rank 1 size 2 sum 3.0"]]
    assert time.monotonic() - start < 30


COMM_SCRIPT = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    import horovod.numpy as hvd
    try:
        hvd.init(comm=MPI.COMM_WORLD)
    except ValueError as e:
        print("refused:", e, flush=True)
        sys.exit(0)
    print("joined", hvd.rank(), hvd.size(), flush=True)
""")


def test_mpi_comm_under_horovodrun_gloo_is_refused():
    """init(comm=MPI.COMM_WORLD) in ranks horovodrun started without --mpi: each is an MPI singleton, and
    every rank ran alone as rank 0 of size 1; now every rank gets a ValueError naming both sizes and the fix."""
    pytest.importorskip("mpi4py")
    proc = horovodrun("-np", "2", sys.executable, "-c", COMM_SCRIPT, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        out = _lines(proc.stdout, r)
        assert len(out) == 1 and out[0].startswith("refused: hvd.init(comm=...) got an MPI communicator of size 1, "
                                                   f"but horovodrun started this process as rank {r} of a job of "
                                                   "size 2"), proc.stdout
        assert "mpirun (or horovodrun --mpi)" in out[0] and "without comm=" in out[0]


# one write(2): print() under PYTHONUNBUFFERED writes "pid", " ", the number and "\n" apart, and mpirun tags
# each piece on its own line
MPI_SLEEP_SCRIPT = "import os, time\nos.write(1, b'pid %d\\n' % os.getpid())\ntime.sleep(60)"


def test_mpi_sigterm_to_launcher_leaves_no_process():
    """horovodrun --mpi ran mpirun under /bin/sh -c, which took SIGTERM without forwarding it: mpirun (re-parented
    to init) and the ranks kept running.  Now the shell execs mpirun: the signal stops mpirun and the ranks."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    launcher = subprocess.Popen([sys.executable, "-m", "horovod.runner", "--mpi", "-np", "2", sys.executable, "-c",
                                 MPI_SLEEP_SCRIPT], env={**_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids, seen = [], ""
    try:
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()   # mpirun's tagged lines may come in pieces: look at all of it
            if not line:
                break
            seen += line
            pids = [int(p) for p in re.findall(r"<stdout>:pid (\d+)", seen)]
        assert len(pids) == 2, seen
        family = [launcher.pid] + [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=20)
        assert _gone(pids + family, within=10), [psutil.Process(p).cmdline() for p in pids + family
                                                 if psutil.pid_exists(p)]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.communicate()


def test_mpi_timestamp_output_and_command_only_with_verbose():
    """--prefix-output-with-timestamp reaches mpirun (--timestamp-output, as upstream); the mpirun command line
    is printed only with --verbose (it was printed on every run)."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    script = "print('hello', flush=True)"
    proc = horovodrun("--mpi", "-np", "2", "--prefix-output-with-timestamp", sys.executable, "-c", script,
                      env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        # (mpirun may tag the line's end separately: "...<stdout>:hello[1,1]<stdout>:")
        assert re.search(rf"\w{{3}} \w{{3}} [ \d]\d \d\d:\d\d:\d\d \d{{4}}\[1,{r}\]<stdout>:hello", proc.stdout), \
            proc.stdout
    assert "mpirun" not in proc.stderr and "mpirun" not in proc.stdout
    proc = horovodrun("--mpi", "-np", "1", "--verbose", sys.executable, "-c", script, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpirun --allow-run-as-root --tag-output -np 1 " in proc.stderr, proc.stderr


TIMELINE_SCRIPT = textwrap.dedent("""
    import numpy as np
    import horovod.numpy as hvd
    hvd.init()
    r = hvd.rank()
    for step in range(2):
        hvd.allreduce(np.ones(200000, np.float32) * r, op=hvd.Sum, name="big")
        hvd.allgather(np.full(3, float(r)), name="gather")
        hvd.broadcast(np.full(3, float(r)), root_rank=0, name="bcast")
        hvd.reducescatter(np.ones(4) * r, op=hvd.Sum, name="rs")
    hvd.shutdown()
""")


def test_mpi_timeline_names_the_mpi_data_plane(tmp_path):
    """Under the MPI data plane the timeline's transport activities are upstream's MPI_ALLREDUCE, MPI_ALLGATHER,
    MPI_BCAST, MPI_REDUCESCATTER (they were named GLOO_* whatever moved the bytes)."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    timeline = tmp_path / "tl.json"
    proc = horovodrun("--mpi", "-np", "2", "--timeline-filename", str(timeline), sys.executable, "-c",
                      TIMELINE_SCRIPT, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {e.get("name") for e in json.loads(timeline.read_text()) if e.get("ph") == "B"}
    for activity in ("MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BCAST", "MPI_REDUCESCATTER"):
        assert activity in names, sorted(names)
    assert not {n for n in names if n.startswith("GLOO_")}, sorted(names)


COMM_SETS_SCRIPT = textwrap.dedent("""
    import os
    import numpy as np
    from mpi4py import MPI
    import horovod.numpy as hvd
    world = MPI.COMM_WORLD
    parity = hvd.ProcessSet(world.Split(color=world.rank % 2, key=world.rank))
    pair = hvd.ProcessSet(world.Split(color=0 if world.rank < 2 else MPI.UNDEFINED, key=world.rank))
    hvd.init(world, process_sets=[parity, pair])
    r = hvd.rank()
    total = hvd.allreduce(np.array([float(r)]), op=hvd.Sum, process_set=parity, name="parity")
    line = f"rank {r}: parity {parity.process_set_id} {parity.ranks} {parity.rank()} {total[0]:g}"
    if pair.included():
        line += f"; pair {pair.process_set_id} {pair.ranks} {hvd.allgather(np.array([r]), process_set=pair)}"
    os.write(1, (line + "\\n").encode())
    hvd.shutdown()
""")


def test_mpi_static_process_sets_from_communicators():
    """Upstream's "static process sets from MPI communicators" (hvd.ProcessSet(comm.Split(...)), each rank its own
    communicator) were refused under mpirun with "Process sets from mpi4py communicators need the MPI
    controller."  Now every distinct group is a set (ids in order of lowest rank) and each rank's object has its
    own group's id and ranks; a rank whose communicator is MPI.COMM_NULL leaves its object unregistered."""
    if not shutil.which("mpirun"):
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    proc = horovodrun("--mpi", "-np", "3", sys.executable, "-c", COMM_SETS_SCRIPT, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {0: "rank 0: parity 1 [0, 2] 0 2; pair 3 [0, 1] [0 1]",
                1: "rank 1: parity 2 [1] 0 1; pair 3 [0, 1] [0 1]",
                2: "rank 2: parity 1 [0, 2] 1 2"}
    for r, line in expected.items():
        assert re.search(rf"\[1,{r}\]<stdout>:{re.escape(line)}$", proc.stdout, re.M), proc.stdout


def test_program_not_executable_or_a_directory_is_named(tmp_path):
    """A program that exists but cannot run was reported as '[Errno 2] No such file or directory'."""
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    script.chmod(0o644)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mytool").write_text("#!/bin/sh\necho never\n")   # on PATH, not executable
    cases = [("./train.py", "[Errno 13] Permission denied: './train.py'"),
             ("./bin", "[Errno 21] Is a directory: './bin'"),
             ("./missing.py", "[Errno 2] No such file or directory: './missing.py'"),
             ("mytool", "[Errno 13] Permission denied: 'mytool'")]
    for program, text in cases:
        proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", program], cwd=tmp_path,
                              env={**_env(), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"},
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode != 0 and f"horovodrun: error: {text}" in proc.stderr, (program, proc.stderr)
        assert "never" not in proc.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_the_ssh_check_stops_at_once(tmp_path, sig):
    """Ctrl-C or SIGTERM while ``ssh <host> true`` waits on a host that does not answer (a firewall dropping
    packets, a hung sshd): the launcher waited for every ssh attempt to time out (~20 s) and SIGTERM then
    ended as the ssh error with status 1.  Now it stops the check, kills its ssh clients and exits with the
    signal's status."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"  # a host that never answers: the check's ssh client just hangs
    ssh.write_text(f"#!/bin/sh\necho $$ >> {tmp_path / 'ssh_pids'}\nexec sleep 60\n")
    ssh.chmod(0o755)
    launcher = subprocess.Popen([sys.executable, "-m", "horovod.runner", "-np", "1", "-H", "silent-host.invalid:1",
                                 "true"], env={**_env(), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed, err = signal_once_ready(launcher, tmp_path / "ssh_pids", sig)
    assert elapsed < 5, (elapsed, err)
    assert launcher.returncode == 128 + sig, (launcher.returncode, err)
    assert "could not connect" not in err
    ssh_pids = [int(p) for p in (tmp_path / "ssh_pids").read_text().split()]
    assert _gone(ssh_pids, within=5)


def test_missing_ssh_identity_file_is_named(tmp_path):
    """A mistyped ``-i`` was reported as ssh's 'Permission denied (publickey)' for every host, as if the key
    were not authorized there (ssh only warns that it cannot read the file)."""
    missing = tmp_path / "id_typo"
    for controller in ([], ["--mpi"]):
        proc = horovodrun(*controller, "-np", "1", "-H", "remote-host.invalid:1", "-i", str(missing), "true")
        assert proc.returncode == 1, proc.stderr
        assert f"ssh identity file {str(missing)!r} (-i/--ssh-identity-file) does not exist" in proc.stderr, \
            proc.stderr
    # a local-only job does not use ssh: the option is ignored, as upstream
    proc = horovodrun("-np", "1", "-i", str(missing), sys.executable, "-c", "print('ran')")
    assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr


def _in_a_deleted_directory(gone, code, *args):
    """Run ``code`` (``sys.argv[1:]`` are ``args``) in a directory that was removed after the process entered it."""
    enter = "import os, sys; os.mkdir(sys.argv[1]); os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); sys.argv[1:2] = []; "
    return subprocess.run([sys.executable, "-c", enter + code, str(gone), *args], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)


GONE_DIRECTORY = "horovodrun's working directory no longer exists"


def test_launcher_in_a_deleted_directory(tmp_path):
    """A shell left in a directory that was removed (``rm -rf build; mkdir build`` from another shell):
    horovodrun failed with a bare '[Errno 2] No such file or directory'.  Ranks on this host inherit the
    directory as any child does; ranks on other hosts start in the launcher's directory, so that is named."""
    def run(*args):
        return _in_a_deleted_directory(tmp_path / "gone", "from horovod.runner.launch import run_commandline; "
                                       "run_commandline()", *args)

    proc = run("-np", "2", sys.executable, "-c", "print('ran')")
    assert proc.returncode == 0 and _lines(proc.stdout, 1) == ["ran"], proc.stderr
    proc = run("-np", "1", "-H", "remote-host.invalid:1", "true")
    assert proc.returncode == 1
    assert GONE_DIRECTORY in proc.stderr, proc.stderr


def test_elastic_launcher_in_a_deleted_directory(tmp_path):
    """The same for an elastic job: it failed with the bare '[Errno 2] No such file or directory' when it
    started its worker on the remote host, after the local one.  Now named before any worker starts; a job on
    this host only runs."""
    def run(hosts):
        return _in_a_deleted_directory(tmp_path / "gone", "from horovod.runner.launch import run_commandline; "
                                       "run_commandline()", "-np", "2", "--min-np", "2", "-H", hosts,
                                       "--elastic-timeout", "10", sys.executable, "-c", "print('ran')")

    proc = run("localhost:1,127.0.0.1:1")
    assert proc.returncode == 0 and _lines(proc.stdout, 0) == _lines(proc.stdout, 1) == ["ran"], proc.stderr
    proc = run("localhost:1,remote-host.invalid:1")
    assert proc.returncode == 1, proc.stderr
    assert f"horovodrun: error: {GONE_DIRECTORY}" in proc.stderr and "ran" not in proc.stdout, proc.stderr
    assert "generation 0" not in proc.stderr, proc.stderr


def test_ssh_start_in_a_deleted_directory(tmp_path):
    """A host that an elastic job's discovery adds later starts over ssh too: the spawner names the cause."""
    proc = _in_a_deleted_directory(
        tmp_path / "gone", "from horovod.runner.spawn import WorkerSpec; from horovod.runner.ssh import SshOptions, "
        "SshSpawner; SshSpawner(SshOptions())(WorkerSpec(rank=1, command=['true'], env={}, "
        "hostname='remote-host.invalid'))")
    assert proc.returncode == 1 and f"RuntimeError: {GONE_DIRECTORY}" in proc.stderr, proc.stderr


def test_mpi_args_without_mpi_are_named_not_dropped():
    """``horovodrun -np 2 --mpi-args="--bind-to none" ...`` (upstream's docs; its horovodrun runs mpirun by default
    when Horovod has MPI, so the arguments took effect): our default is the built-in transport, which dropped
    them without a word.  The launcher now says they are ignored and how to use them; the job still runs (the
    ranks' own sums checked), and under ``--mpi`` nothing is said."""
    # one write per line: mpirun's tagged output prefixes every chunk a rank writes, and print() may write a
    # line in pieces ('SUM', ' ', '3.0')
    script = ("import os, numpy as np, horovod.numpy as hvd; hvd.init(); "
              "os.write(1, f'SUM {hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)[0]}\\n'.encode())")
    proc = horovodrun("-np", "2", "--mpi-args=--bind-to none", "--binding-args=--map-by core", sys.executable, "-c",
                      script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("horovodrun: warning: --mpi-args and --binding-args are only passed to mpirun (--mpi); this job runs on "
            "the built-in transport without mpirun and ignores them: add --mpi to launch with mpirun") in proc.stderr
    assert [_lines(proc.stdout, r) for r in (0, 1)] == [["SUM 3.0"], ["SUM 3.0"]], proc.stdout
    if shutil.which("mpirun") and importlib.util.find_spec("mpi4py") is not None:
        proc = horovodrun("--mpi", "-np", "2", "--mpi-args=--bind-to none --oversubscribe", sys.executable, "-c",
                          script)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "warning" not in proc.stderr and proc.stdout.count("SUM 3.0") == 2, proc.stdout + proc.stderr
