"""Fixtures of the multi-host tests: network-namespace hosts with sshd (``.ci/netns_hosts.sh``).

The hosts are set up on demand when running as root; without root or network-namespace support the tests
skip with the reason, unless ``HOROVOD_TEST_REQUIRE_MULTIHOST=1`` (CI) turns the skip into a failure.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATE = os.environ.get("HVD_NETNS_DIR", "/tmp/hvd-netns")
WORKER = os.path.join("tests", "multihost", "mh_worker.py")


@dataclasses.dataclass
class NetnsHosts:
    hosts: list[str]
    refusing: str
    bridge_addr: str
    port: int
    key: str

    def ssh_args(self) -> list[str]:
        return ["-p", str(self.port), "-i", self.key]

    def run_in(self, ns: str | None, argv: list[str], timeout: float = 120,
               env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` in namespace ``ns`` (None: the root namespace) from the repository root."""
        env = dict(os.environ)
        env.update(env_extra or {})
        env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.pop("HOROVOD_RANK", None)
        prefix = ["ip", "netns", "exec", ns] if ns else []
        return subprocess.run(prefix + argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)

    def horovodrun(self, ns: str | None, args: list[str], timeout: float = 120, **kwargs):
        return self.run_in(ns, [sys.executable, "-m", "horovod.runner", *self.ssh_args(), *args],
                           timeout=timeout, **kwargs)


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("HOROVOD_TEST_REQUIRE_MULTIHOST") == "1":
        pytest.fail(f"multi-host tests required but unavailable: {reason}")
    pytest.skip(reason)


def _read_env(path: str) -> dict[str, str]:
    values = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.strip().split("=", 1)
                values[k] = shlex.split(v)[0] if v else ""
    return values


def hosts_ready() -> bool:
    """The namespaces exist and every host's sshd is alive (namespaces can outlive their sshds)."""
    if not os.path.exists(os.path.join(STATE, "hosts.env")) or subprocess.run(
            ["ip", "netns", "exec", "hvdh2", "true"], capture_output=True).returncode != 0:
        return False
    for host in ("hvdh1", "hvdh2", "hvdh3"):
        try:
            with open(os.path.join(STATE, f"sshd_{host}.pid")) as f:
                os.kill(int(f.read().split()[0]), 0)
        except (OSError, ValueError, IndexError):
            return False
    return True


@pytest.fixture(scope="session")
def netns_hosts() -> NetnsHosts:
    if os.geteuid() != 0:
        _skip_or_fail("multi-host tests need root (network namespaces, sshd)")
    env_file = os.path.join(STATE, "hosts.env")
    script = os.path.join(REPO, ".ci", "netns_hosts.sh")
    if not hosts_ready():
        proc = subprocess.run(["bash", script, "up"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            _skip_or_fail(f"could not set up network-namespace hosts: {proc.stderr.strip()[-500:]}")
    values = _read_env(env_file)
    return NetnsHosts(hosts=values["HVD_NETNS_HOSTS"].split(), refusing=values["HVD_NETNS_REFUSING"],
                      bridge_addr=values["HVD_NETNS_BRIDGE_ADDR"], port=int(values["HVD_NETNS_SSH_PORT"]),
                      key=values["HVD_NETNS_KEY"])
