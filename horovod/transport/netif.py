"""This host's network interfaces and their addresses: the one place that asks the OS.

The launcher (:mod:`horovod.runner.network`, :mod:`horovod.runner.hosts`), the workers' bootstrap
(``HOROVOD_GLOO_IFACE``), torchrun joining, MPI bootstraps and the mesh all look addresses up here.  It lives in
the transport layer so that every layer above can use it (docs/architecture.md: imports only point down).
"""

from __future__ import annotations

import logging
import socket

__all__ = ["interface_addresses", "interface_address", "local_addresses", "route_source"]

logger = logging.getLogger(__name__)


def interface_addresses(family: int = socket.AF_INET) -> dict[str, list[str]]:
    """Addresses of ``family`` per interface name (IPv6 without its ``%scope``); ``{}`` if the OS says nothing."""
    try:
        import psutil

        found = psutil.net_if_addrs()
    except Exception as e:  # noqa: BLE001 - psutil missing or the OS refused: no interface is known
        logger.debug("could not list this host's interface addresses: %s", e)
        return {}
    result: dict[str, list[str]] = {}
    for name, entries in found.items():
        for entry in entries:
            if entry.family == family:
                result.setdefault(name, []).append(entry.address.split("%", 1)[0])
    return result


def interface_address(name: str) -> str | None:
    """The first IPv4 address of interface ``name``, or None (no such interface, or it has none)."""
    addresses = interface_addresses().get(name)
    return addresses[0] if addresses else None


def local_addresses() -> dict[str, str]:
    """Every IPv4 and IPv6 address of this host → the name of its interface."""
    return {addr: name for family in (socket.AF_INET, socket.AF_INET6)
            for name, addrs in interface_addresses(family).items() for addr in addrs}


def route_source(host: str) -> str | None:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing), or None."""
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, 9))
            return probe.getsockname()[0]
    except OSError:
        return None
