"""The runtime-knob flags of ``horovodrun``, the ``--config-file`` and the env they become.

Everything here is derived from :data:`horovod.common.config.KNOBS`, so a knob added to that table gets its
flag, its config-file key and its exported variable without touching the launcher.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from horovod.common.config import KNOBS, LOG_LEVELS, EnvVarError, Knob, parse_bool, read_runtime_config

__all__ = ["add_knob_arguments", "knob_dest", "apply_config_file", "load_config_file", "knob_env",
           "validate_knob_args", "LOG_LEVELS"]

logger = logging.getLogger(__name__)

# Config-file keys that mean the opposite of a knob's flag (upstream's YAML says "enabled").
_INVERTED_YAML = {"stall_check.enabled": "stall_check_disable", "logging.with_timestamp": "log_hide_time"}

# Knob flags upstream spells with extra aliases or choices.
_EXTRA_ARGPARSE: dict[str, dict[str, Any]] = {
    "log_level": {"choices": LOG_LEVELS, "type": str.upper},
}
KNOB_BY_ENV: dict[str, Knob] = {k.env: k for k in KNOBS}
_HIDDEN_OPPOSITES = {"stall_check_disable": "--stall-check", "log_hide_time": "--log-with-timestamp"}

# Knobs whose negative values make no sense (upstream's ``'<arg>=<v> must be >= 0'``).
_NONNEGATIVE_TYPES = (int, float)


def finite_float(text: str) -> float:
    """argparse type of float flags: ``nan`` and ``inf`` are refused (they would disable a bound)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"invalid value: {text!r} (must be a finite number)")
    return value


def knob_dest(knob: Knob) -> str:
    """The argparse ``dest`` of a knob's flag: ``--fusion-threshold-mb`` → ``fusion_threshold_mb``."""
    assert knob.flag is not None
    return knob.flag.lstrip("-").replace("-", "_")


def _flag_knobs() -> list[Knob]:
    return [k for k in KNOBS if k.flag]


def add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per knob with a ``flag`` to ``parser``, in argparse groups like upstream's.

    Every dest defaults to None so that "not given" is distinguishable from "given": the config file fills
    only the former, and only given values are exported.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for knob in _flag_knobs():
        section = (knob.yaml or "params.").split(".", 1)[0]
        title = {"params": "tuneable parameter arguments", "timeline": "timeline arguments",
                 "stall_check": "stall check arguments", "logging": "logging arguments",
                 "library_options": "library arguments"}.get(section, "tuneable parameter arguments")
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        dest = knob_dest(knob)
        if knob.flag_type is bool and knob.default is None:
            # Tri-state (force on / force off / automatic): --x and --no-x.
            group.add_argument(knob.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=knob.help)
        elif knob.flag_type is bool:
            group.add_argument(knob.flag, dest=dest, action="store_true", default=None, help=knob.help)
            if knob.name in _HIDDEN_OPPOSITES:
                group.add_argument(_HIDDEN_OPPOSITES[knob.name], dest=dest, action="store_false",
                                   default=None, help=argparse.SUPPRESS)
        else:
            kwargs: dict[str, Any] = {"type": finite_float if knob.flag_type is float else knob.flag_type or str}
            kwargs.update(_EXTRA_ARGPARSE.get(knob.name, {}))
            group.add_argument(knob.flag, dest=dest, default=None, help=knob.help, **kwargs)


def validate_knob_args(args: argparse.Namespace) -> None:
    """Check every knob the workers will see before any of them starts.

    Negative flag values raise upstream's ``ValueError('<arg>=<v> must be >= 0')``; then the knobs of the
    workers' environment (the launcher's, or ``horovod.run``'s, with the flags applied) are parsed as
    ``hvd.init()`` will parse them, so ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5min`` fails here, naming the
    variable, instead of in every worker.
    """
    for knob in _flag_knobs():
        if knob.flag_type in _NONNEGATIVE_TYPES:
            dest = knob_dest(knob)
            value = getattr(args, dest, None)
            if value is not None and value < 0:
                raise ValueError(f"{dest}={value} must be >= 0")
    given = knob_env(args)
    env = dict(args.env if getattr(args, "env", None) is not None else os.environ)
    env.update(given)
    try:
        read_runtime_config(env)
    except EnvVarError as e:
        knob = KNOB_BY_ENV.get(e.name)
        if knob is not None and knob.flag and knob.env in given:  # the bad value came from a flag
            raise ValueError(f"{knob.flag} {getattr(args, knob_dest(knob))}: {e}") from None
        raise


def _parse_scalar(text: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "~", ""):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _parse_simple_yaml(text: str, filename: str) -> dict[str, Any]:
    """The two-level ``section:\\n  key: value`` subset of YAML that the config file uses (no PyYAML)."""
    result: dict[str, Any] = {}
    section: dict[str, Any] | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() or line.strip() == "---":
            continue
        key, sep, value = line.strip().partition(":")
        if not sep:
            raise ValueError(f"{filename}:{lineno}: expected 'key: value', got {raw!r}")
        if line[0] not in " \t":
            if value.strip():
                result[key.strip()] = _parse_scalar(value)
                section = None
            else:
                section = result.setdefault(key.strip(), {})
        elif section is None:
            raise ValueError(f"{filename}:{lineno}: indented key outside a section: {raw!r}")
        else:
            section[key.strip()] = _parse_scalar(value)
    return result


def load_config_file(filename: str) -> dict[str, Any]:
    """Read the YAML config file (PyYAML if installed, else the two-level subset)."""
    with open(filename) as f:
        text = f.read()
    try:
        import yaml
    except ImportError:
        return _parse_simple_yaml(text, filename)
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {filename} must contain a mapping, got {type(data).__name__}")
    return data


def _lookup(config: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def apply_config_file(args: argparse.Namespace, config: Mapping[str, Any]) -> None:
    """Fill knob flags not given on the command line from ``config``: explicit CLI flags win.

    Also applies ``controller: gloo|mpi`` to ``args.use_gloo``/``args.use_mpi`` when neither was given.
    """
    by_name = {k.name: k for k in _flag_knobs()}
    for knob in by_name.values():
        dest = knob_dest(knob)
        if getattr(args, dest, None) is not None or not knob.yaml:
            continue
        found, value = _lookup(config, knob.yaml)
        if found and value is not None:
            setattr(args, dest, _coerce(knob, value))
    for dotted, name in _INVERTED_YAML.items():
        knob = by_name.get(name)
        if knob is None or getattr(args, knob_dest(knob), None) is not None:
            continue
        found, value = _lookup(config, dotted)
        if found and value is not None:
            setattr(args, knob_dest(knob), not bool(value))
    controller = config.get("controller")
    if controller and not getattr(args, "use_gloo", False) and not getattr(args, "use_mpi", False):
        controller = str(controller).lower()
        if controller not in ("gloo", "mpi"):
            raise ValueError(f"config file: controller must be 'gloo' or 'mpi', got {controller!r}")
        setattr(args, "use_gloo" if controller == "gloo" else "use_mpi", True)


def _coerce(knob: Knob, value: Any) -> Any:
    """A config-file value as the flag's type; a value of the wrong kind names the key (never a bare error)."""
    key = f"config file: {knob.yaml}"
    if knob.flag_type is bool:
        return value if isinstance(value, bool) else parse_bool(key, str(value))
    if knob.name == "log_level":
        level = str(value).upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(LOG_LEVELS)}")
        return level
    if knob.flag_type in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not a number (units such as 's' or 'MB' are not accepted)") \
                from None
        if not math.isfinite(number):
            raise ValueError(f"{key}={value!r} must be a finite number")
        if knob.flag_type is int and not number.is_integer():
            raise ValueError(f"{key}={value!r} is not a whole number")
        return knob.flag_type(number)
    return (knob.flag_type or str)(value)


def knob_env(args: argparse.Namespace) -> dict[str, str]:
    """The env variables for every knob that was given (flag or config file)."""
    env = {}
    for knob in _flag_knobs():
        value = getattr(args, knob_dest(knob), None)
        if value is not None:
            env[knob.env] = knob.flag_to_env(value)
    return env
