"""Host specs and the slot plan: which rank runs where.

Kept apart from spawning so that the local spawner, a remote (ssh) spawner and the elastic driver all share
one rank assignment, computed exactly as upstream's ``get_host_assignments`` does.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Iterable

from horovod.transport import netif

__all__ = [
    "HostInfo", "SlotInfo", "parse_hosts", "parse_host_files", "get_host_assignments", "is_local_host",
    "INVALID_HOST_MESSAGE",
]

_HOST_RE = re.compile(r"^[\w.-]+:[0-9]+$")
INVALID_HOST_MESSAGE = "Invalid host input, please make sure it has format as : worker-0:2,worker-1:2."


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """One host and how many worker slots it offers."""

    hostname: str
    slots: int

    @staticmethod
    def from_string(spec: str) -> HostInfo:
        """Parse ``host:slots`` (upstream's format and error text)."""
        spec = spec.strip()
        if not _HOST_RE.match(spec):
            raise ValueError(INVALID_HOST_MESSAGE)
        hostname, slots = spec.rsplit(":", 1)
        return HostInfo(hostname, int(slots))


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """The identity of one worker: what the launcher exports as ``HOROVOD_RANK`` etc."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_env(self) -> dict[str, str]:
        """The per-worker variables of the launcher → worker contract (docs/architecture.md)."""
        return {
            "HOROVOD_HOSTNAME": self.hostname,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
        }


def parse_hosts(hosts_string: str) -> list[HostInfo]:
    """Parse ``-H host1:2,host2:4`` into hosts in the given order.

    Raises:
        ValueError: an item is not ``host:slots`` (upstream's text), or a host is listed twice (upstream then
            exports a cross rank at or above the cross size, and the job fails in its workers).
    """
    hosts = [HostInfo.from_string(item) for item in hosts_string.split(",") if item.strip()]
    seen: dict[str, list[int]] = {}
    for host in hosts:
        seen.setdefault(host.hostname, []).append(host.slots)
    twice = {name: slots for name, slots in seen.items() if len(slots) > 1}
    if twice:
        listed = "; ".join(f"{name} ({', '.join(f'{name}:{n}' for n in slots)})" for name, slots in twice.items())
        merged = ",".join(f"{name}:{sum(slots)}" for name, slots in seen.items())
        raise ValueError(f"Host listed more than once: {listed}. List each host once with all its slots, "
                         f"e.g. {merged}")
    return hosts


_SLOTS_FIELD = re.compile(r"slots?\s*=\s*(\S+)")


def parse_host_files(filename: str) -> str:
    """Turn a hostfile into the ``-H`` string form.

    A line is ``<host> slots=<n>`` (upstream's form; ``slot=<n>`` and spaces around ``=`` are read as upstream
    reads them, by the number after ``=``), or ``<host>`` alone for one slot; ``#`` starts a comment.

    Raises:
        ValueError: a line with anything else after the host name, a slot count that is not a whole number,
            or ``<host>:<n>`` (the -H form) (the text names the file, the line and the expected form).
    """
    items = []
    with open(filename) as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            hostname, *others = line.split(None, 1)
            rest = others[0] if others else ""
            slots = 1
            if ":" in hostname:
                raise ValueError(f"Invalid host in hostfile {filename!r} line {number}: {raw.strip()!r}; a hostfile "
                                 "line is '<host> slots=<n>' ('<host>:<n>' is the form of -H)")
            if rest:
                match = _SLOTS_FIELD.fullmatch(rest)
                text = match.group(1) if match else None
                if text is None or not text.isdigit():
                    what = "slot count" if match else "field"
                    raise ValueError(f"Invalid {what} in hostfile {filename!r} line {number}: {raw.strip()!r}; "
                                     "expected '<host> slots=<n>' or '<host>' alone for one slot")
                slots = int(text)
            items.append(f"{hostname}:{slots}")
    return ",".join(items)


def get_host_assignments(hosts: list[HostInfo], min_num_proc: int | None = None, max_num_proc: int | None = None,
                         *, min_np: int | None = None, max_np: int | None = None) -> list[SlotInfo]:
    """Assign ranks to slots, filling hosts in order (upstream's algorithm, error text and keyword names:
    upstream's tests call ``get_host_assignments(hosts, min_num_proc=1, max_num_proc=2)``, and
    ``min_np=``/``max_np=``, its names before the rename, in older releases; both are accepted).

    ``cross_rank`` is the index of a host among the hosts that have a slot with the same ``local_rank``;
    ``cross_size`` is the number of such hosts.  Without ``max_num_proc`` every listed slot gets a rank.

    Raises:
        ValueError: the hosts offer fewer than ``min_num_proc`` slots.
    """
    if min_np is not None or max_np is not None:
        if min_num_proc is not None or max_num_proc is not None:
            raise TypeError("get_host_assignments() takes min_num_proc/max_num_proc or their old names "
                            "min_np/max_np, not both")
        min_num_proc, max_num_proc = min_np, max_np
    if min_num_proc is None:
        raise TypeError("get_host_assignments() missing required argument: 'min_num_proc'")
    host_ranks: list[tuple[HostInfo, list[int]]] = []
    cross_ranks: dict[int, dict[str, int]] = {}
    rank = 0
    for host in hosts:
        ranks = []
        for local_rank in range(host.slots):
            if rank == max_num_proc:
                break
            ranks.append(rank)
            rank += 1
            cross_ranks_at_local = cross_ranks.setdefault(local_rank, {})
            cross_ranks_at_local[host.hostname] = len(cross_ranks_at_local)
        host_ranks.append((host, ranks))

    world_size = rank
    if world_size < min_num_proc:
        raise ValueError(f"Requested more processes ({min_num_proc}) than there are available slots ({world_size})")

    slots = []
    for host, ranks in host_ranks:
        for local_rank, r in enumerate(ranks):
            cross_ranks_at_local = cross_ranks[local_rank]
            slots.append(SlotInfo(hostname=host.hostname, rank=r, local_rank=local_rank,
                                  cross_rank=cross_ranks_at_local[host.hostname], size=world_size,
                                  local_size=len(ranks), cross_size=len(cross_ranks_at_local)))
    return slots


def is_local_host(hostname: str, _local: Iterable[str] | None = None) -> bool:
    """Whether ``hostname`` names this machine (a loopback name, our hostname, or one of our addresses)."""
    if hostname in ("localhost", "127.0.0.1", "::1") or hostname in (socket.gethostname(), socket.getfqdn()):
        return True
    local = set(_local) if _local is not None else {"127.0.0.1", "::1", *netif.local_addresses()}
    try:
        infos = socket.getaddrinfo(hostname, None)
    except OSError:
        return False
    resolved = {info[4][0] for info in infos}
    return bool(resolved) and all(addr.startswith("127.") or addr in local for addr in resolved)
