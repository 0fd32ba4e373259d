"""One declarative table of the runtime knobs.

Each knob has an environment variable (what workers read), an optional ``horovodrun`` flag and an optional
key in the ``--config-file`` YAML.  The launcher builds its argparse options and the env it exports from
this table, and the runtime parses the env through :func:`read_runtime_config`, so the three never drift.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Knob", "KNOBS", "RuntimeConfig", "read_runtime_config", "env_bool", "env_int", "env_float"]

MIB = 1024 * 1024

# The default stall shutdown deadline.  Upstream waits forever (0 = never); we end the job instead so that a
# missing rank becomes an error naming the rank and tensors.  See docs/compatibility.md.
DEFAULT_STALL_SHUTDOWN_SECONDS = 300.0


def _parse_bool(text: str) -> bool:
    text = text.strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    try:
        return float(text) > 0
    except ValueError:
        return False


def _parse_int(text: str) -> int:
    # Upstream's C++ core parses with strtol: garbage (even run()'s accidental "(None,)") reads as 0.
    try:
        return int(float(text))
    except ValueError:
        return 0


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


@dataclasses.dataclass(frozen=True)
class Knob:
    """A runtime setting: where it is read from and how it is parsed.

    ``flag_to_env`` converts the launcher flag's value to the env text (e.g. MB → bytes).
    """

    name: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    flag: str | None = None
    flag_type: type | None = None
    help: str = ""
    yaml: str | None = None
    flag_to_env: Callable[[Any], str] = str


def _mb_to_bytes(v: Any) -> str:
    return str(int(v) * MIB)


def _bool_env(v: Any) -> str:
    return "1" if v else "0"


KNOBS: tuple[Knob, ...] = (
    Knob("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", _parse_int, 128 * MIB,
         "--fusion-threshold-mb", int, "Fusion buffer threshold in MB (0 disables fusion).",
         "params.fusion_threshold_mb", _mb_to_bytes),
    Knob("cycle_time_ms", "HOROVOD_CYCLE_TIME", _parse_float, 1.0,
         "--cycle-time-ms", float, "Upper bound in ms on how long the engine waits for more tensors to fuse.",
         "params.cycle_time_ms"),
    Knob("cache_capacity", "HOROVOD_CACHE_CAPACITY", _parse_int, 1024,
         "--cache-capacity", int, "Response cache capacity (0 disables the cache).", "params.cache_capacity"),
    Knob("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", _parse_bool, None,
         "--hierarchical-allreduce", bool, "Force (1) or forbid (0) hierarchical allreduce; unset = automatic.",
         "params.hierarchical_allreduce", _bool_env),
    Knob("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", _parse_bool, None,
         "--hierarchical-allgather", bool, "Force (1) or forbid (0) hierarchical allgather; unset = automatic.",
         "params.hierarchical_allgather", _bool_env),
    Knob("timeline", "HOROVOD_TIMELINE", str, "",
         "--timeline-filename", str, "Write a Chrome-trace timeline to this file (rank 0).", "timeline.filename"),
    Knob("timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", _parse_bool, False,
         "--timeline-mark-cycles", bool, "Mark engine cycles in the timeline.", "timeline.mark_cycles",
         _bool_env),
    Knob("stall_check_disable", "HOROVOD_STALL_CHECK_DISABLE", _parse_bool, False,
         "--no-stall-check", bool, "Disable the stall inspector.", None, _bool_env),
    Knob("stall_check_time", "HOROVOD_STALL_CHECK_TIME_SECONDS", _parse_float, 60.0,
         "--stall-check-warning-time-seconds", int, "Seconds before a stalled tensor is reported.",
         "stall_check.warning_time_seconds"),
    Knob("stall_shutdown_time", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", _parse_float,
         DEFAULT_STALL_SHUTDOWN_SECONDS,
         "--stall-check-shutdown-time-seconds", int,
         "Seconds after which a stalled job is shut down (0 = never).", "stall_check.shutdown_time_seconds"),
    Knob("log_level", "HOROVOD_LOG_LEVEL", str, "WARNING",
         "--log-level", str, "Log level of the workers' engine.", "logging.level"),
    Knob("log_hide_time", "HOROVOD_LOG_HIDE_TIME", _parse_bool, False,
         "--log-without-timestamp", bool, "Hide timestamps in engine log lines.", None, _bool_env),
    Knob("op_timeout", "HOROVOD_GLOO_TIMEOUT_SECONDS", _parse_float, 30.0,
         "--gloo-timeout-seconds", int, "Seconds a peer may take inside a collective before the job fails.",
         "library_options.gloo_timeout_seconds"),
    Knob("disable_shm", "HOROVOD_SHM_DISABLE", _parse_bool, False,
         None, None, "Use TCP even between ranks on the same host (tests the cross-host path).", None,
         _bool_env),
    Knob("dynamic_process_sets", "HOROVOD_DYNAMIC_PROCESS_SETS", _parse_bool, False,
         None, None, "Allow add_process_set/remove_process_set after init.", None, _bool_env),
    Knob("disable_group_fusion", "HOROVOD_DISABLE_GROUP_FUSION", _parse_bool, False,
         None, None, "Fuse grouped ops only with their own group.", None, _bool_env),
    Knob("elastic", "HOROVOD_ELASTIC", _parse_bool, False, None, None, "Elastic mode.", None, _bool_env),
)

KNOBS_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


@dataclasses.dataclass
class RuntimeConfig:
    """The parsed knobs; attribute names are :attr:`Knob.name`."""

    fusion_threshold: int = 128 * MIB
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    timeline: str = ""
    timeline_mark_cycles: bool = False
    stall_check_disable: bool = False
    stall_check_time: float = 60.0
    stall_shutdown_time: float = DEFAULT_STALL_SHUTDOWN_SECONDS
    log_level: str = "WARNING"
    log_hide_time: bool = False
    op_timeout: float = 30.0
    disable_shm: bool = False
    dynamic_process_sets: bool = False
    disable_group_fusion: bool = False
    elastic: bool = False


def read_runtime_config(environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    """Parse every knob from ``environ`` (default ``os.environ``); unset knobs keep their defaults."""
    environ = os.environ if environ is None else environ
    values = {}
    for knob in KNOBS:
        text = environ.get(knob.env)
        values[knob.name] = knob.default if text is None or text == "" and knob.parse is not str \
            else knob.parse(text)
    return RuntimeConfig(**values)


def env_bool(name: str, default: bool = False) -> bool:
    text = os.environ.get(name)
    return default if text is None else _parse_bool(text)


def env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    return default if text in (None, "") else _parse_int(text)


def env_float(name: str, default: float) -> float:
    text = os.environ.get(name)
    return default if text in (None, "") else _parse_float(text)
