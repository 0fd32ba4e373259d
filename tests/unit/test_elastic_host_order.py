"""The elastic driver's host order: a host that comes back (cooldown over, or listed again by discovery)
queues up behind the hosts that stayed, so rank 0 stays on a worker that kept the job's state.

Found by the soak (tests/soak): kill -9 of rank 0 after a replaced host had returned gave rank 0 to a fresh
worker, whose empty state ``sync()`` broadcast, and training silently restarted from the beginning.
"""

from __future__ import annotations

import pytest

from horovod.runner.elastic.discovery import HostManager


class _Discovery:
    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = hosts

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.hosts)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _names(manager: HostManager) -> list[str]:
    return [h.hostname for h in manager.usable_hosts()]


def test_host_back_from_the_blacklist_goes_last():
    clock = _Clock()
    manager = HostManager(_Discovery({"a": 1, "b": 1}), cooldown_range=(1, 2), clock=clock)
    manager.update_available_hosts()
    assert _names(manager) == ["a", "b"]
    manager.blacklist("a")
    assert not manager.update_available_hosts()
    assert _names(manager) == ["b"]
    clock.now = 10.0
    manager.update_available_hosts()
    assert _names(manager) == ["b", "a"]  # "b" kept the state: it keeps rank 0
    manager.blacklist("b")
    clock.now = 20.0
    manager.update_available_hosts()
    assert _names(manager) == ["a", "b"]


def test_host_listed_again_goes_last():
    discovery = _Discovery({"a": 1, "b": 1, "c": 1})
    manager = HostManager(discovery)
    manager.update_available_hosts()
    del discovery.hosts["a"]
    assert manager.update_available_hosts()
    assert _names(manager) == ["b", "c"]
    discovery.hosts["a"] = 2
    assert manager.update_available_hosts()
    assert _names(manager) == ["b", "c", "a"]


def test_blacklisted_for_good_stays_out():
    manager = HostManager(_Discovery({"a": 1, "b": 1}))
    manager.update_available_hosts()
    manager.blacklist("a")
    manager.update_available_hosts()
    assert _names(manager) == ["b"]
    assert not manager.all_blacklisted()
    manager.blacklist("b")
    assert manager.all_blacklisted()


def _script(tmp_path, output: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    path.chmod(0o755)
    return str(path)


def test_discovery_script_lines(tmp_path):
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    found = HostDiscoveryScript(_script(tmp_path, "a:2\\n\\n  b \\nc.example-1:3\\n"), slots=4)
    assert found.find_available_hosts_and_slots() == {"a": 2, "b": 4, "c.example-1": 3}


@pytest.mark.parametrize("output,expected", [
    ("", {}), ("host-1", {"host-1": 3}), ("host-1:2", {"host-1": 2}),
    ("host-1\\nhost-5", {"host-1": 3, "host-5": 3}), ("host-1:2\\nhost-4:3", {"host-1": 2, "host-4": 3}),
])
def test_discovery_script_upstream_keywords(tmp_path, output, expected):
    # upstream's constructor is HostDiscoveryScript(discovery_script, slots), called by keyword in its tests
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    found = HostDiscoveryScript(discovery_script=_script(tmp_path, output), slots=3)
    assert found.find_available_hosts_and_slots() == expected


@pytest.mark.parametrize("line,problem", [
    ("bad host name", "expected 'host' or 'host:slots' on each line"),  # once a host the driver waited on
    ("a:x", "Invalid host input"),
])
def test_discovery_script_garbage_names_the_script_and_line(tmp_path, line, problem):
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    script = _script(tmp_path, f"a:1\\n{line}\\n")
    with pytest.raises(ValueError) as e:
        HostDiscoveryScript(script, slots=1).find_available_hosts_and_slots()
    assert str(e.value).startswith(f"Discovery script {script} printed {line!r}: ")
    assert problem in str(e.value)


def test_discovery_script_that_hangs_is_killed_whole_and_its_stderr_shown(tmp_path, capfd):
    """A timed-out script used to lose only its shell: the script and its children outlived horovodrun. And a
    failing script's own words (stderr) were swallowed."""
    import os
    import time

    from horovod.runner.elastic.discovery import HostDiscoveryScript

    pid_file = tmp_path / "child.pid"
    hang = tmp_path / "hang.sh"
    hang.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pid_file}\nwait\n")
    hang.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^Failed to execute discovery script: .*timed out after 1 s$"):
        HostDiscoveryScript(str(hang), slots=1, timeout=1.0).find_available_hosts_and_slots()
    assert time.monotonic() - started < 5
    child = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the script's child {child} survived its timeout")

    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\necho 'no inventory service' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"Exit code: 3$"):
        HostDiscoveryScript(str(failing), slots=1).find_available_hosts_and_slots()
    assert "no inventory service" in capfd.readouterr().err


def test_a_slow_discovery_does_not_hold_up_the_driver_loop():
    """The driver runs discovery on a thread and takes its answer when it is there (a hung script held the
    loop that notices dead workers for the script's timeout)."""
    import threading
    import time

    from horovod.runner.elastic.driver import ElasticDriver

    release = threading.Event()

    class Slow(_Discovery):
        calls = 0

        def find_available_hosts_and_slots(self):
            Slow.calls += 1
            if Slow.calls > 1:
                release.wait(10)
            return dict(self.hosts)

    discovery = Slow({"a": 1})
    driver = ElasticDriver(discovery, ["true"], num_proc=1, min_np=1, max_np=None, base_env={}, knobs={},
                           start_timeout=10, elastic_timeout=10, reset_limit=None, cooldown_range=None)
    driver.hosts.update_available_hosts()
    last = [0.0]
    started = time.monotonic()
    driver._discover(last)  # starts the slow call
    discovery.hosts = {"a": 1, "b": 2}
    driver._discover(last)
    assert time.monotonic() - started < 1 and _names(driver.hosts) == ["a"]
    release.set()
    driver._discovery_call.join(5)
    driver._discover(last)  # takes the answer
    assert _names(driver.hosts) == ["a", "b"]


def test_fixed_hosts_takes_upstreams_dict_and_set():
    # upstream: FixedHosts({'host-1': 2}) and discovery.set({'host-1': 2, 'host-2': 2}) script the hosts
    from horovod.runner.elastic.discovery import FixedHosts, HostManager

    discovery = FixedHosts({"host-1": 2})
    assert discovery.find_available_hosts_and_slots() == {"host-1": 2}
    discovery.set({"host-1": 2, "host-2": 2})
    assert discovery.find_available_hosts_and_slots() == {"host-1": 2, "host-2": 2}
    manager = HostManager(discovery)
    manager.update_available_hosts()
    assert [(h.hostname, h.slots) for h in manager.usable_hosts()] == [("host-1", 2), ("host-2", 2)]
