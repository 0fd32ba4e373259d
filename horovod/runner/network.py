"""Which network interface the job uses, decided by the launcher.

Upstream probes interfaces with task services on every host and, with everything on one host, ends up on
``lo``.  Here the kernel's routing table answers the question: the interface this host would use to reach
the remote hosts is the one they share with it (they can reach us back on it), and loopback is never chosen
when any host is remote.  ``--network-interface`` overrides the choice; the name must exist on this host.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from collections.abc import Sequence

from horovod.transport.netif import interface_addresses, route_source

__all__ = ["Interface", "choose_interface"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Interface:
    """The chosen interface: its name and this host's IPv4 address on it (what remote hosts connect to)."""

    name: str
    address: str


def _is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def choose_interface(remote_hosts: Sequence[str], nics: Sequence[str] = ()) -> Interface:
    """The interface for a job whose hosts other than this one are ``remote_hosts``.

    With no remote host the job stays on loopback.  Otherwise the first of ``nics`` (the user's choice) or
    the interface of the route to the remote hosts.

    Raises:
        ValueError: a named interface does not exist here or has no IPv4 address, or no remote host is
            routable through a non-loopback interface.
    """
    addresses = interface_addresses()
    by_addr = {a: name for name, addrs in addresses.items() for a in addrs}
    if nics:
        name = nics[0]
        if name not in addresses:
            known = ", ".join(sorted(addresses)) or "none"
            raise ValueError(f"network interface {name!r} has no IPv4 address on this host "
                             f"(interfaces with one: {known})")
        if remote_hosts and _is_loopback(addresses[name][0]):
            raise ValueError(f"network interface {name!r} is loopback, but hosts {', '.join(remote_hosts)} "
                             "are remote; choose the interface they share with this host")
        return Interface(name, addresses[name][0])
    if not remote_hosts:
        return Interface(by_addr.get("127.0.0.1", "lo"), "127.0.0.1")
    chosen: dict[str, list[str]] = {}
    for host in remote_hosts:
        src = route_source(host)
        if src is None or _is_loopback(src):
            continue
        chosen.setdefault(src, []).append(host)
    if not chosen:
        raise ValueError(f"no route from this host to {', '.join(remote_hosts)} over a non-loopback interface; "
                         "check the host names or pass --network-interface")
    src, hosts = max(chosen.items(), key=lambda item: len(item[1]))
    if len(chosen) > 1:
        logger.warning("hosts are reached through different interfaces (%s); using %s for the job",
                       ", ".join(f"{by_addr.get(a, a)}: {', '.join(h)}" for a, h in chosen.items()),
                       by_addr.get(src, src))
    return Interface(by_addr.get(src, src), src)
