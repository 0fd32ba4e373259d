"""horovod.transport.netif: the one place that asks the OS for this host's interface addresses."""

import pathlib
import socket

import psutil

from horovod.transport import netif

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "horovod"


def test_addresses_match_psutil():
    expected = {name: [e.address for e in entries if e.family == socket.AF_INET]
                for name, entries in psutil.net_if_addrs().items()}
    expected = {name: addrs for name, addrs in expected.items() if addrs}
    assert netif.interface_addresses() == expected
    for name, addrs in expected.items():
        assert netif.interface_address(name) == addrs[0]
        assert all(netif.local_addresses()[a] == name for a in addrs)
    assert netif.interface_address("no-such-interface0") is None


def test_route_source():
    assert netif.route_source("127.0.0.1") == "127.0.0.1"
    assert netif.route_source("no-such-host.invalid") is None


def test_no_other_module_asks_the_os():
    """Callers use netif instead of their own psutil / SIOCGIFADDR lookups."""
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "netif.py" and ("net_if_addrs" in p.read_text() or "SIOCGIFADDR" in p.read_text())]
    assert offenders == []
