"""Upstream's ``hosts``: host specs and the rank assignment, from ``horovod.runner.hosts``."""

from __future__ import annotations

from horovod.runner.hosts import HostInfo, SlotInfo, get_host_assignments, parse_host_files, parse_hosts

__all__ = ["HostInfo", "SlotInfo", "get_host_assignments", "parse_hosts", "parse_host_files"]
