"""horovodrun across network-namespace hosts over ssh (see conftest.py and .ci/netns_hosts.sh).

Hosts hvdh1..hvdh3 each have eth0 on 10.213.0.0/24 and an sshd on port 2222; hvdh4 has no sshd.  The
launcher runs inside hvdh1 (like a user on one cluster node) or in the root namespace (on the bridge).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from conftest import REPO, WORKER

pytestmark = pytest.mark.timeout(180)


def _pids(piddir: str, n: int, within: float = 60.0) -> dict[int, dict]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = {}
        for name in os.listdir(piddir):
            try:
                with open(os.path.join(piddir, name)) as f:
                    found[int(name.split(".")[1])] = json.load(f)
            except (OSError, ValueError):
                pass
        if len(found) == n:
            return found
        time.sleep(0.1)
    raise AssertionError(f"only {os.listdir(piddir)} of {n} ranks wrote their pid")


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _all_gone(pids: list[int], within: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def test_numpy_suite_across_two_hosts(netns_hosts):
    """The lockstep numpy collectives suite, 2 hosts x 2 ranks, launcher on a third host."""
    proc = netns_hosts.horovodrun("hvdh1", [
        "-np", "4", "-H", "hvdh2:2,hvdh3:2", sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
        "tests/parallel/test_numpy_ops.py", "-k", "not test_layout_matches_launcher"], timeout=170)
    _ok(proc)
    assert "network interface eth0 (10.213.0.11)" in proc.stderr
    assert "remote over ssh: hvdh2, hvdh3" in proc.stderr
    for rank in range(4):
        assert any(line.startswith(f"[{rank}]<stdout>:") and " passed" in line for line in proc.stdout.splitlines())


def test_layout_and_hierarchical_from_bridge(netns_hosts, tmp_path):
    """Launcher in the root namespace: the store listens on the bridge, never on loopback."""
    hosts = "10.213.0.12:2,10.213.0.13:2"
    proc = netns_hosts.horovodrun(None, ["-np", "4", "-H", hosts, sys.executable, WORKER, "check",
                                         "HierarchicalCommunicator", str(tmp_path)])
    _ok(proc)
    assert f"network interface hvdbr0 ({netns_hosts.bridge_addr})" in proc.stderr
    assert "MULTIHOST-OK size=4 local_size=2 cross_size=2 backend=HierarchicalCommunicator" in proc.stdout


def test_mixed_local_and_remote_flat_tcp(netns_hosts, tmp_path):
    """Ranks on the launcher's host and a remote one, --network-interface, hierarchical collectives off."""
    proc = netns_hosts.horovodrun("hvdh1", [
        "-np", "4", "-H", "hvdh1:2,hvdh2:2", "--network-interface", "eth0", "--start-timeout", "20",
        sys.executable, WORKER, "check", "HierarchicalCommunicator", str(tmp_path)])
    _ok(proc)
    assert "remote over ssh: hvdh2" in proc.stderr and "network interface eth0" in proc.stderr
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLGATHER": "0"}
    proc = netns_hosts.horovodrun("hvdh1", ["-np", "4", "-H", "hvdh1:2,hvdh2:2", sys.executable, WORKER, "check",
                                            "TcpCommunicator", str(tmp_path)], env_extra=env)
    _ok(proc)


def test_training_example_across_three_hosts(netns_hosts):
    hostfile = os.path.join(tempfile.mkdtemp(), "hostfile")
    with open(hostfile, "w") as f:
        f.write("# three namespace hosts\nhvdh1 slots=2\nhvdh2 slots=1\nhvdh3 slots=1\n")
    proc = netns_hosts.horovodrun("hvdh1", ["-np", "4", "--hostfile", hostfile, sys.executable,
                                            "examples/numpy/train_linear.py"])
    _ok(proc)
    assert "ranks=4" in proc.stdout and "weights identical on all ranks: True" in proc.stdout


def test_host_refusing_ssh_is_named_quickly(netns_hosts):
    started = time.monotonic()
    proc = netns_hosts.horovodrun("hvdh1", ["-np", "4", "-H", f"hvdh2:2,{netns_hosts.refusing}:2",
                                            sys.executable, "-c", "print('must not run')"], timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert f"could not connect to some hosts via ssh: {netns_hosts.refusing}" in proc.stderr
    assert "hvdh2:" not in proc.stderr.split("could not connect")[1]  # only the bad host is named
    assert "must not run" not in proc.stdout
    assert elapsed < 15, elapsed


def _launch(netns_hosts, args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.Popen(["ip", "netns", "exec", "hvdh1", sys.executable, "-m", "horovod.runner",
                             *netns_hosts.ssh_args(), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_remote_rank_killed_mid_job(netns_hosts, tmp_path):
    proc = _launch(netns_hosts, ["-np", "4", "-H", "hvdh2:2,hvdh3:2", sys.executable, WORKER, "loop",
                                 str(tmp_path)])
    try:
        ranks = _pids(str(tmp_path), 4)
        time.sleep(1.0)  # in the middle of the allreduce loop
        assert ranks[3]["host"] == "hvdh3"
        os.kill(ranks[3]["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "Process 3 exit with status code" in err or "Terminating remaining workers" in err, err[-3000:]
    left = _all_gone([r["pid"] for r in ranks.values()])
    assert not left, f"orphaned workers: {left}"


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_by_sigkill_is_reported_alike_here_and_over_ssh(netns_hosts, victim):
    """Rank 0 runs on the launcher's host, rank 1 over ssh: each killed by SIGKILL is reported with upstream's
    words and 137 (the local one was -9, Popen's returncode, where upstream's launcher reports 137)."""
    kill = ("import os, signal, time\n"
            f"if os.environ['HOROVOD_RANK'] == '{victim}': os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(30)")
    proc = netns_hosts.horovodrun("hvdh1", ["-np", "2", "-H", "hvdh1:1,hvdh2:1", sys.executable, "-c", kill],
                                  timeout=60)
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert f"Process {victim} exit with status code 137.\n" in proc.stderr, proc.stderr[-3000:]
    assert f"The first process to do so was:\nProcess name: {victim}\nExit code: 137\n" in proc.stderr


def test_failure_on_one_host_ends_hung_ranks_everywhere(netns_hosts, tmp_path):
    started = time.monotonic()
    proc = _launch(netns_hosts, ["-np", "4", "-H", "hvdh1:2,hvdh2:1,hvdh3:1", sys.executable, WORKER,
                                 "fail-one", str(tmp_path)])
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ranks = _pids(str(tmp_path), 4, within=1)
    assert proc.returncode == 3, err[-3000:]
    assert "Process 3 exit with status code 3." in err
    assert time.monotonic() - started < 40
    left = _all_gone([r["pid"] for r in ranks.values()])
    assert not left, f"orphaned workers: {left}"


def test_remote_processes_die_with_the_launcher(netns_hosts, tmp_path):
    """Even a SIGKILLed launcher leaves nothing behind: the remote wrapper sees its ssh connection close."""
    proc = _launch(netns_hosts, ["-np", "2", "-H", "hvdh2:1,hvdh3:1", sys.executable, WORKER, "loop",
                                 str(tmp_path)])
    try:
        ranks = _pids(str(tmp_path), 2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its ssh clients see stdin close
        proc.communicate(timeout=30)
    left = _all_gone([r["pid"] for r in ranks.values()], within=20)
    assert not left, f"orphaned workers: {left}"
