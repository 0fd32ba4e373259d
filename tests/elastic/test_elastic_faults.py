"""Elastic mode under real faults: every test checks the exact training outcome and that nothing is left.

The job (``worker_numpy.py``) adds integer contributions per sample, so the final weights equal the
fault-free run's exactly when every sample of every epoch was processed once, whatever the world sizes.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from launch_util import signal_once_ready

from elastic.conftest import FAST_ENV, REPO

pytestmark = pytest.mark.timeout(120) if hasattr(pytest.mark, "timeout") else []

TWO_HOSTS = ["localhost:1", "127.0.0.1:1"]
ARGS = ["-np", "2", "--min-np", "1", "--max-np", "2"]


def test_fault_free(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS, epochs=1, sleep=0.0)
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [2]
    job.assert_no_leftovers()


def test_kill_worker_mid_epoch(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS, sleep_after_resize=0.0)
    job.wait_steps(5, size=2)
    os.kill(job.pid("127.0.0.1:0"), signal.SIGKILL)
    assert job.wait() == 0, job.output()
    result = job.assert_exact()
    assert result["sizes"] == [2, 1], result
    assert "blacklisting host 127.0.0.1" in job.log_text()
    job.assert_no_leftovers()


def test_kill_rank_zero(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS, sleep_after_resize=0.0)
    job.wait_steps(5, size=2)
    os.kill(job.pid("localhost:0"), signal.SIGKILL)
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [2, 1]
    job.assert_no_leftovers()


def test_host_removed(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS, sleep_after_resize=0.0)
    job.wait_steps(5, size=2)
    job.set_hosts(["localhost:1"])
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [2, 1]
    assert "removed from elastic job" in job.log_text()
    job.assert_no_leftovers()


def test_host_removed_and_added_back_before_its_worker_exited(elastic_job):
    """A host removed and added back while its removed worker is still exiting (told rank -1, it raised
    upstream's 'has been removed' error and takes a while to go): the driver starts a fresh worker for the
    slot.  It reused the exiting one, whose exit (1) then counted against the new generation and blacklisted
    the host (sizes 2 -> 1 -> 1).  The worker here takes 30 s to exit; the driver reaps it after its grace."""
    job = elastic_job(TWO_HOSTS, ARGS, env={"TEST_SLOW_REMOVED_EXIT": "30",
                                            "TEST_HOLD_UNTIL_SIZE": "2"})  # the job must not end at size 1
    job.wait_steps(5, size=2)
    job.set_hosts(["localhost:1"])
    deadline = time.monotonic() + 30
    while not (job.out / "removed_exiting").exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.05)
    job.set_hosts(TWO_HOSTS)
    assert job.wait() == 0, job.output()
    result = job.assert_exact()
    assert result["sizes"] == [2, 1, 2], (result, job.output())
    log = job.log_text()
    assert "removed from elastic job" in log
    assert "blacklisting" not in log, job.output()
    job.assert_no_leftovers()


def test_host_added(elastic_job):
    job = elastic_job(["localhost:1"], ["-np", "1", "--min-np", "1", "--max-np", "2"], sleep_after_resize=0.0)
    job.wait_steps(4, size=1)
    job.set_hosts(TWO_HOSTS)
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [1, 2]
    job.assert_no_leftovers()


def test_hung_worker(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS, sleep_after_resize=0.0)
    job.wait_steps(5, size=2)
    pid = job.pid("127.0.0.1:0")
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    assert job.wait() == 0, job.output()
    assert time.monotonic() - started < 60
    assert job.assert_exact()["sizes"] == [2, 1]
    assert "hung?" in job.log_text()
    job.assert_no_leftovers()


def test_busy_worker_is_not_taken_for_hung(elastic_job):
    """A peer dies while rank 0 works 7 s without a collective (a checkpoint, a validation pass): rank 0 is
    alive, only busy, and leaves the generation at its next collective.  The driver killed it as hung once the
    grace period (4 s here) was over and blacklisted its host, so the job failed with both hosts blacklisted
    (upstream waits for it).  Workers now send a heartbeat: only one that stops is hung.  7 s: the peer is
    killed as soon as rank 0 starts its work, so rank 0 stays busy ~3 s past the grace."""
    job = elastic_job(TWO_HOSTS, ARGS, sleep_after_resize=0.0, env={"TEST_BUSY": "localhost:0:5:7"})
    deadline = time.monotonic() + 60
    while not (job.out / "busy").exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.05)
    os.kill(job.pid("127.0.0.1:0"), signal.SIGKILL)
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [2, 1]
    log = job.log_text()
    assert "hung?" not in log and "blacklisting host localhost" not in log, job.output()
    job.assert_no_leftovers()


def test_failure_during_commit(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS, sleep_after_resize=0.0, env={"TEST_DIE_IN_COMMIT": "127.0.0.1:0:6"})
    assert job.wait() == 0, job.output()
    assert (job.out / "died_in_commit").exists()
    assert job.assert_exact()["sizes"] == [2, 1]
    job.assert_no_leftovers()


@pytest.mark.parametrize("slot", ["127.0.0.1:0", "localhost:0"], ids=["rank1", "rank0"])
def test_killed_during_mesh_formation(elastic_job, slot):
    """A worker killed while the first mesh forms: the survivor, waiting for its connection (rank 0) or
    retrying its listener (rank 1), leaves the generation at the driver's reset instead of waiting for the
    start timeout (20 s here) past the grace (4 s) -- which got it killed too and failed the job."""
    job = elastic_job(TWO_HOSTS, ARGS, sleep=0.0, env={"TEST_DIE_IN_MESH": slot})  # no action mid-job
    assert job.wait() == 0, job.output()
    assert (job.out / "died_in_mesh").exists()
    assert job.assert_exact()["sizes"] == [1]
    log = job.log_text()
    assert "could not build the mesh of generation 0" in log, job.output()
    assert "hung?" not in log, job.output()
    job.assert_no_leftovers()


@pytest.mark.parametrize("bug", ["commit_on_rank_0_only", "shape_mismatch"])
def test_a_mismatch_between_the_ranks_ends_the_job_instead_of_resetting_forever(elastic_job, bug):
    """A user's bug, not a fault: ``state.commit()`` on rank 0 only (its broadcast, which rank 1 never runs,
    against rank 1's next allreduce), or an allreduce whose shape differs on one rank.  The stall deadline
    (3 s here, 300 s by default) shut the job down with a recoverable error, or the shape mismatch raised one;
    the elastic loop reset, rolled back, ran into the same mismatch and reset again, a generation per step.
    Now both ranks raise ``PreconditionError`` naming the cause and the job ends in its first generation."""
    env = {"TEST_COMMIT_ONLY_ON_RANK": "0"} if bug == "commit_on_rank_0_only" else {"TEST_MISMATCH_AT": "3"}
    job = elastic_job(["localhost:2"], ["-np", "2", "--min-np", "2"], env=env)
    assert job.wait(timeout=60) != 0
    log = job.log_text()
    expected = {"commit_on_rank_0_only": "PreconditionError: Mismatched collectives: the ranks submitted different "
                                         "collectives and waited for each other for the stall deadline (3 s): rank 0 "
                                         "never submitted ['grad'] and waits for ['broadcast_object.",
                "shape_mismatch": "PreconditionError: Mismatched ALLREDUCE tensor shapes"}[bug]
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:horovod.base.exceptions.{expected}" in log, job.output()
    assert "rolling back to the last commit" not in log, job.output()
    assert "generation 1" not in log, job.output()
    job.assert_no_leftovers()


def test_reset_limit(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS + ["--reset-limit", "0"])
    job.wait_steps(3, size=2)
    os.kill(job.pid("127.0.0.1:0"), signal.SIGKILL)
    assert job.wait() != 0
    assert "Horovod was shutdown because number of resets during elastic job exceeded limit: 0" in job.log_text()
    job.assert_no_leftovers()


def test_discovery_fails_at_start(elastic_job, tmp_path):
    (tmp_path / "fail").touch()
    job = elastic_job(TWO_HOSTS, ARGS)
    assert job.wait(timeout=30) != 0
    assert "Failed to execute discovery script" in job.log_text()
    assert "Exit code: 3" in job.log_text()
    job.assert_no_leftovers()


def test_discovery_fails_mid_run(elastic_job):
    job = elastic_job(TWO_HOSTS, ARGS)
    job.wait_steps(3, size=2)
    job.fail_file.touch()
    time.sleep(2.5)  # discovery runs every second: it fails at least twice
    job.fail_file.unlink()
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [2]
    assert "host discovery failed" in job.log_text()
    job.assert_no_leftovers()


def test_waiting_for_slots_is_reported(elastic_job):
    """No host yet: the driver says what it waits for (not a silent job for up to --elastic-timeout), then
    starts once the hosts appear, and the outcome is exact."""
    job = elastic_job([], ARGS, sleep=0.0)  # no action once the job runs: no step pause
    deadline = time.monotonic() + 30
    while "elastic: waiting for 2 slots to start; 0 available now (usable hosts: none)" not in job.log_text():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.1)
    assert "giving up in" in job.log_text()
    job.set_hosts(TWO_HOSTS)
    assert job.wait() == 0, job.output()
    assert job.assert_exact()["sizes"] == [2]
    assert "elastic: 2 slots available after" in job.log_text()
    job.assert_no_leftovers()


def test_every_host_failed_names_the_first_failed_worker(tmp_path):
    """As upstream: when every host is blacklisted the job ends with the failed workers' message (the first
    one's rank and exit code) and that exit code, not only the driver's own reason."""
    import subprocess
    import sys

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "1", "--min-np", "1",
                          "--host-discovery-script", str(script), sys.executable, "-c", "import sys; sys.exit(3)"],
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert "Horovod detected that one or more processes exited with non-zero status" in text
    assert "Process name: 0\nExit code: 3\n(All hosts are blacklisted; 1 slots needed to continue.)" in text


def test_a_rank_failing_after_another_succeeded_fails_the_job_and_output_files_are_written(tmp_path):
    """As upstream (and as a static job): a rank of the final generation that exits non-zero after another one
    succeeded fails the job (it exited 0); ``--output-filename`` writes every rank's output, as in a static job
    (elastic jobs ignored it)."""
    import subprocess
    import sys

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    body = ("import sys, time, numpy as np, horovod.numpy as hvd\nhvd.init()\n"
            "print('rank', hvd.rank(), 'sum', hvd.allreduce(np.ones(1), op=hvd.Sum)[0], flush=True)\n"
            "if hvd.rank() == 1:\n    time.sleep(1)\n    sys.exit(5)\n")
    out = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", "--min-np", "1", "--output-filename",
                          "logs", "--host-discovery-script", str(script), sys.executable, "-c", body],
                         capture_output=True, text=True, timeout=90, cwd=str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 5, text
    assert "Horovod detected that one or more processes exited with non-zero status" in text
    assert "Process name: 1\nExit code: 5\n" in text
    for rank in (0, 1):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text() == f"rank {rank} sum 2.0\n"


def test_a_job_never_starts_below_min_np(tmp_path):
    """--min-np 2 on one slot waits for 2 slots (-np defaults to --min-np; -np below it is an argument error)."""
    import subprocess
    import sys

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "horovod.runner", "--min-np", "2", "--elastic-timeout", "2",
                          "--host-discovery-script", str(script), sys.executable, "-c", "print('started')"],
                         capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert out.returncode != 0 and "started" not in out.stdout, out.stdout + out.stderr
    assert ("Timed out waiting for minimum number of slots to become available. Please check that you have enough "
            "resources to run at least 2 Horovod processes. Timeout after 2 seconds (2 slots needed to start, 1 "
            "found; --elastic-timeout).") in out.stderr, out.stderr


def test_every_worker_failing_ends_the_job_with_upstreams_message(tmp_path):
    """Every worker of a generation fails (here: the script exits 3 at once, as an import error does) while the
    blacklist cooldown lets their hosts come back: the job ends as upstream's does when all workers failed,
    with the first failed process's message and exit code.  It ended with "No hosts from previous set
    remaining, unable to broadcast state." and exit code 1, which named neither the failure nor the code."""
    import subprocess
    import sys

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    env = {**os.environ, **FAST_ENV, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", "--min-np", "1", "--max-np", "2",
                          "--blacklist-cooldown-range", "1", "1", "--host-discovery-script", str(script),
                          sys.executable, "-c", "import horovod.numpy as hvd; hvd.init(); raise SystemExit(3)"],
                         capture_output=True, text=True, timeout=90, cwd=str(tmp_path), env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text
    assert "Horovod detected that one or more processes exited with non-zero status" in text, text
    assert "Exit code: 3" in text and "No hosts from previous set" not in text, text


def test_every_host_removed_interrupts_the_job(elastic_job):
    """Discovery printing no host at all was ignored: the job went on to finish (exit 0) on hosts that were
    gone.  Every host removed is a removal like any other (upstream: an empty assignment, rank 0 notified): the
    workers leave at their next commit and the driver waits --elastic-timeout for --min-np slots."""
    job = elastic_job(TWO_HOSTS, [*ARGS, "--elastic-timeout", "3"], env={"TEST_HOLD_UNTIL_SIZE": "3"})
    job.wait_steps(3, size=2)
    job.set_hosts([])
    assert job.wait() != 0, job.output()
    log = job.log_text()
    assert "hosts changed (removed)" in log, job.output()
    assert ("enough resources to run at least 1 Horovod processes. Timeout after 3 seconds (1 slots needed to "
            "continue, 0 found; --elastic-timeout).") in log, job.output()
    job.assert_no_leftovers()


def test_every_host_removed_and_back_in_time(elastic_job):
    """Hosts back within --elastic-timeout after discovery printed none: the job resumes on them, exactly."""
    job = elastic_job(TWO_HOSTS, [*ARGS, "--elastic-timeout", "60"])
    job.wait_steps(3, size=2)
    job.set_hosts([])
    deadline = time.monotonic() + 30
    while "waiting for its workers to leave" not in job.log_text():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.05)
    time.sleep(1)
    job.set_hosts(TWO_HOSTS)
    assert job.wait() == 0, job.output()
    job.assert_exact()
    job.assert_no_leftovers()


def test_host_added_while_a_removal_is_handled(elastic_job):
    """A host removed (rank 0 told: removed only, so the survivors skip sync()) and another added before the
    survivors had left the generation: the next one started a fresh worker, which sync()ed alone while the
    survivors went on training -- mismatched collectives, a hang (the stall shutdown is off by default).  The
    generation now says it started a worker, and the survivors sync() with it."""
    # one epoch: the mismatch shows at generation 1's first collective; the steps after it only repeat it
    job = elastic_job(TWO_HOSTS, ["-np", "2", "--min-np", "1", "--max-np", "3"], sleep=0.2, epochs=1,
                      env={"TEST_SLOW_RESET": "localhost:0:3", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"})
    job.wait_steps(3, size=2)
    job.set_hosts(["localhost:1"])
    deadline = time.monotonic() + 30
    while "generation 0 is over" not in job.log_text():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.05)
    job.set_hosts(["localhost:2"])  # while localhost:0 (rank 0) is still leaving generation 0
    assert job.wait(timeout=60) == 0, job.output()
    log = job.log_text()
    assert "generation 1: 2 workers on localhost" in log, job.output()
    assert "Missing ranks" not in log, job.output()
    job.assert_exact()
    job.assert_no_leftovers()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_the_first_discovery_stops_it(tmp_path, sig):
    """Ctrl-C while the first run of a slow discovery script was under way left the script (in a session of
    its own, out of the terminal's reach) running after horovodrun; SIGTERM waited for the script's 30 s
    timeout.  Now the launcher stops at once and kills the script."""
    import subprocess
    import sys

    import psutil

    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'pid'}\nexec sleep 60\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    launcher = subprocess.Popen([sys.executable, "-m", "horovod.runner", "-np", "2", "--host-discovery-script",
                                 str(script), sys.executable, "-c", "pass"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    elapsed, err = signal_once_ready(launcher, tmp_path / "pid", sig, timeout=40)
    pid = int((tmp_path / "pid").read_text())
    assert elapsed < 5, (elapsed, err)
    assert launcher.returncode == 128 + sig, (launcher.returncode, err)
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the discovery script outlived horovodrun"
        time.sleep(0.05)
