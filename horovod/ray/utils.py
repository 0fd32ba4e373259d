"""Upstream's ``horovod.ray.utils``: the helpers Ray Train's ``HorovodConfig`` imports (``detect_nics``,
``nics_to_env_var``) and ``map_blocking``.

``ray.train.horovod`` (``HorovodTrainer``) starts its own worker actors and forms the Horovod job with
:class:`horovod.ray.runner.Coordinator` and these two functions; :class:`~horovod.ray.RayExecutor` does not
need them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ray

__all__ = ["detect_nics", "nics_to_env_var", "map_blocking"]

logger = logging.getLogger(__name__)

COMMON_NICS_ERROR = "Unable to find a set of common task-to-task communication interfaces"
"""Upstream's text when the hosts share no interface."""


def map_blocking(fn: Callable[[Any], Any], collection: Iterable[Any]) -> list[Any]:
    """``ray.get([fn(x) for x in collection])``: ``fn`` returns an ObjectRef per item (upstream's helper)."""
    return ray.get([fn(item) for item in collection])


def nics_to_env_var(nics: Iterable[str]) -> dict[str, str]:
    """The ranks' variables for the interfaces ``nics``: ``HOROVOD_GLOO_IFACE`` = the first,
    ``NCCL_SOCKET_IFNAME`` = all (upstream's)."""
    names = list(nics)
    return {"HOROVOD_GLOO_IFACE": names[0], "NCCL_SOCKET_IFNAME": ",".join(names)}


def _is_local(host: str, local: set[str]) -> bool:
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return any(a in local or a.startswith("127.") or a == "::1" for a in addrs)


def _remote_hosts(all_host_names: Sequence[str]) -> list[str]:
    """The names that are not this host (upstream's ``network.filter_local_addresses``)."""
    from horovod.transport.netif import local_addresses

    local = set(local_addresses())
    return [h for h in all_host_names if not _is_local(h, local)]


def _local_interfaces(settings: Any) -> list[str]:
    """Every host is this one: the interfaces with address 127.0.0.1 (of ``settings.nics`` if given)."""
    from horovod.transport.netif import interface_addresses

    wanted = getattr(settings, "nics", None)
    found = sorted(name for name, addrs in interface_addresses().items()
                   if "127.0.0.1" in addrs and (not wanted or name in wanted))
    if not found:
        raise ValueError("No interface is found for address 127.0.0.1.")
    return found


def _node_interfaces(_: Any = None) -> dict[str, list[str]]:
    """Run on a node: its interfaces with a non-loopback IPv4 address."""
    import ipaddress

    from horovod.transport.netif import interface_addresses

    return {name: addrs for name, addrs in interface_addresses().items()
            if any(not ipaddress.ip_address(a).is_loopback for a in addrs)}


class _DiscoveryActor:
    def execute(self, func: Callable[[Any], Any]) -> Any:
        return func(self)


@contextlib.contextmanager
def _maybe_create_workers(all_host_names: Sequence[str], existing_workers: list[Any] | None) -> Iterator[list[Any]]:
    """``existing_workers`` (one per host), or a temporary 0-CPU actor pinned to each host's ``node:`` resource."""
    if existing_workers:
        yield list(existing_workers)
        return
    remote_cls = ray.remote(_DiscoveryActor)
    workers = [remote_cls.options(resources={f"node:{host}": 0.001}, num_cpus=0).remote() for host in all_host_names]
    try:
        yield workers
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                ray.kill(w)


def detect_nics(settings: Any, all_host_names: Sequence[str], node_workers: list[Any] | None = None) -> list[str]:
    """The interfaces the ranks on ``all_host_names`` use (upstream's signature; feed the result to
    :func:`nics_to_env_var`).

    Every host is this one: the interfaces with address 127.0.0.1.  Otherwise ``settings.nics`` if given, else
    the interfaces (with a non-loopback IPv4 address) that every host has: each host's are listed by one of
    ``node_workers`` (actors with an ``execute(fn)`` method that calls ``fn(self)``, one per host) or, without
    them, by a temporary actor pinned to the host.  Upstream also checked that each host reaches the next one's
    addresses; here the ranks' own connection check at ``hvd.init()`` reports an unreachable address.

    Raises:
        ValueError: no interface has 127.0.0.1 (all local), or the hosts share no interface.
    """
    remote = _remote_hosts(all_host_names)
    if not remote:
        return _local_interfaces(settings)
    if getattr(settings, "nics", None):
        return sorted(settings.nics)
    with _maybe_create_workers(all_host_names, node_workers) as workers:
        per_host = ray.get([w.execute.remote(_node_interfaces) for w in workers])
    common = set(per_host[0]) if per_host else set()
    for found in per_host[1:]:
        common &= set(found)
    if not common:
        listing = [(i, set(found)) for i, found in enumerate(per_host)]
        raise ValueError(f"{COMMON_NICS_ERROR}: {listing}")
    if int(getattr(settings, "verbose", 1) or 0) >= 2:
        logger.info("Common interface found: %s", " ".join(sorted(common)))
    return sorted(common)
