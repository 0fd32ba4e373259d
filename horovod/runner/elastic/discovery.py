"""Where the elastic driver learns which hosts exist, and which of them it no longer trusts.

``HostDiscoveryScript`` runs ``--host-discovery-script`` (stdout lines ``host`` or ``host:slots``);
``FixedHosts`` stands for ``-H``/``--hostfile``.  ``HostManager`` keeps hosts in order of arrival (so that
old hosts keep low ranks; a host back from the blacklist or from outside discovery's output arrives anew)
and applies the blacklist: a host whose worker failed is excluded, for
good without ``--blacklist-cooldown-range``, else for ``lo * 2**count + U(0, 1) * lo`` seconds clamped to
``[lo, hi]`` (upstream's rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable

from horovod.runner.hosts import HostInfo

_HOSTNAME_RE = re.compile(r"[\w.-]+")  # what -H accepts before ':slots'

__all__ = ["HostDiscovery", "HostDiscoveryScript", "FixedHosts", "HostManager", "DISCOVER_HOSTS_FREQUENCY_SECS"]

logger = logging.getLogger(__name__)

DISCOVER_HOSTS_FREQUENCY_SECS = 1.0


class HostDiscovery:
    """Source of the current hosts and their slots."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Returns ``{host: slots}``.

        Raises:
            RuntimeError: the source failed (upstream's text for a failing script).
        """
        raise NotImplementedError

    def close(self) -> None:
        """Stop a discovery still running (the job is over)."""


class HostDiscoveryScript(HostDiscovery):
    """Runs the user's script; a bare ``host`` line gets ``slots`` slots."""

    # ``discovery_script``: upstream's keyword name (its tests and users' code construct it by keyword)
    def __init__(self, discovery_script: str, slots: int | None, timeout: float = 30.0) -> None:
        self.script = discovery_script
        self.slots = slots or 1
        self.timeout = timeout
        self._running: subprocess.Popen | None = None

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        # A session of its own, killed whole on a timeout: killing the shell alone left the script and its
        # children running after horovodrun (one more per timed-out call).  Its stderr reaches the user.
        proc = subprocess.Popen(self.script, shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self._running = proc
        try:
            stdout, _ = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            proc.communicate()
            raise RuntimeError(f"Failed to execute discovery script: {self.script}. Exit code: timed out "
                               f"after {self.timeout:.0f} s") from None
        finally:
            self._running = None
        if proc.returncode != 0:
            raise RuntimeError(f"Failed to execute discovery script: {self.script}. Exit code: {proc.returncode}")
        hosts: dict[str, int] = {}
        for raw in stdout.decode(errors="replace").splitlines():
            line = raw.strip()
            if not line:
                continue
            if ":" in line:
                try:
                    info = HostInfo.from_string(line)
                except ValueError as e:
                    raise ValueError(f"Discovery script {self.script} printed {line!r}: {e}") from None
                hosts[info.hostname] = info.slots
            elif _HOSTNAME_RE.fullmatch(line):
                hosts[line] = self.slots
            else:
                raise ValueError(f"Discovery script {self.script} printed {line!r}: expected 'host' or "
                                 f"'host:slots' on each line")
        return hosts

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        proc = self._running  # the discovery thread, in communicate(), reaps it
        if proc is not None:
            self._kill(proc)


class FixedHosts(HostDiscovery):
    """``-H``/``--hostfile`` in elastic mode: the hosts never change (only the blacklist does)."""

    def __init__(self, hosts: list[HostInfo] | dict[str, int]) -> None:
        self.set(hosts)

    def set(self, hosts: list[HostInfo] | dict[str, int]) -> None:
        """Replace the hosts.  A ``{host: slots}`` dict is upstream's form (``FixedHosts({'host-1': 2})`` and
        ``set()`` are how upstream's tests and users' drivers script discovery)."""
        if isinstance(hosts, dict):
            self._hosts = dict(hosts)
        else:
            self._hosts = {h.hostname: h.slots for h in hosts}

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self._hosts)


@dataclasses.dataclass
class _Blacklisted:
    count: int
    until: float  # monotonic time; inf = forever


class HostManager:
    """Discovered hosts, oldest first, minus blacklisted ones; a host that returns (from the blacklist or to
    discovery's output) counts as new."""

    def __init__(self, discovery: HostDiscovery, cooldown_range: tuple[int, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cooldown_range is not None:
            lo, hi = cooldown_range
            if lo < 1 or hi > 3600 or lo > hi:
                raise ValueError(f"--blacklist-cooldown-range {lo} {hi}: need 1 <= min <= max <= 3600")
        self.discovery = discovery
        self.cooldown_range = cooldown_range
        self._clock = clock
        self._order: list[str] = []
        self._current: dict[str, int] = {}
        self._blacklist: dict[str, _Blacklisted] = {}

    def update_available_hosts(self) -> bool:
        """Run discovery; True if the usable hosts changed.  Discovery errors propagate."""
        return self.apply(self.discovery.find_available_hosts_and_slots())

    def apply(self, found: dict[str, int]) -> bool:
        """Take ``found`` (a discovery's answer) as the current hosts; True if the usable hosts changed."""
        before = self.usable_hosts()
        # A host that left discovery (or was blacklisted, see blacklist()) queues up behind the others when it
        # comes back: rank 0 must stay on a host whose worker kept the job's state, which sync() broadcasts.
        self._order = [h for h in self._order if h in found]
        for host in found:
            if host not in self._order:
                self._order.append(host)
        self._current = found
        return self.usable_hosts() != before

    def usable_hosts(self) -> list[HostInfo]:
        """Hosts to assign ranks to, oldest first."""
        now = self._clock()
        return [HostInfo(h, self._current[h]) for h in self._order
                if h in self._current and self._current[h] > 0 and not self._is_blacklisted(h, now)]

    def _is_blacklisted(self, host: str, now: float) -> bool:
        entry = self._blacklist.get(host)
        return entry is not None and now < entry.until

    def is_blacklisted(self, host: str) -> bool:
        return self._is_blacklisted(host, self._clock())

    def blacklist(self, host: str) -> float:
        """Exclude ``host``; returns the cooldown in seconds (inf without a cooldown range)."""
        entry = self._blacklist.get(host)
        count = entry.count + 1 if entry is not None else 1
        if self.cooldown_range is None:
            delay = float("inf")
        else:
            lo, hi = self.cooldown_range
            delay = min(max(lo * 2 ** (count - 1) + random.uniform(0, 1) * lo, lo), hi)
        self._blacklist[host] = _Blacklisted(count, self._clock() + delay)
        if host in self._order:
            self._order.remove(host)  # back at the end after the cooldown (the next discovery appends it)
        return delay

    def all_blacklisted(self) -> bool:
        """Every discovered host is blacklisted for good (nothing left to wait for)."""
        now = self._clock()
        return bool(self._current) and all(
            self._is_blacklisted(h, now) and self._blacklist[h].until == float("inf") for h in self._current)
