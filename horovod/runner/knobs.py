"""The runtime-knob flags of ``horovodrun``, the ``--config-file`` and the env they become.

Everything here is derived from :data:`horovod.base.config.KNOBS`, so a knob added to that table gets its
flag, its config-file key and its exported variable without touching the launcher.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Mapping
from typing import Any

from horovod.base.config import KNOBS, LOG_LEVELS, EnvVarError, Knob, parse_bool, read_runtime_config

__all__ = ["add_knob_arguments", "argument_group", "knob_dest", "knobs_from_args", "knobs_from_kwargs",
           "apply_config_file", "load_config_file", "knob_env", "validate_knobs", "LOG_LEVELS"]

logger = logging.getLogger(__name__)

KNOB_BY_ENV: dict[str, Knob] = {k.env: k for k in KNOBS}

# argparse group of a knob: its config-file section, in upstream's titles.
_GROUP_TITLES = {"params": "tuneable parameter arguments", "library_options": "library arguments"}

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
    for knob in _flag_knobs():
        assert knob.flag is not None
        section = (knob.yaml or knob.yaml_off or "params.").split(".", 1)[0]
        group = argument_group(parser, _GROUP_TITLES.get(section, f"{section.replace('_', ' ')} arguments"))
        dest = knob_dest(knob)
        kwargs: dict[str, Any]
        if knob.flag_type is bool and knob.default is None:
            # Tri-state (force on / force off / automatic): --x and --no-x.
            kwargs = {"action": argparse.BooleanOptionalAction}
        elif knob.flag_type is bool:
            kwargs = {"action": "store_true"}
        elif knob.choices:
            kwargs = {"type": _choice_type(knob.choices), "choices": knob.choices}
        else:
            kwargs = {"type": finite_float if knob.flag_type is float else knob.flag_type or str}
        group.add_argument(knob.flag, dest=dest, default=None, help=knob.help, **kwargs)
        for alias in knob.flag_aliases:
            group.add_argument(alias, dest=dest, default=None, help=argparse.SUPPRESS, **kwargs)
        if knob.flag_off:
            group.add_argument(knob.flag_off, dest=dest, action="store_false", default=None, help=argparse.SUPPRESS)


def argument_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The group of ``parser`` titled ``title``, made if there is none (knob and other flags share groups)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _choice_type(choices: tuple[str, ...]) -> Any:
    """argparse type of a text flag with choices: any case, returned as spelled in ``choices``."""
    def convert(text: str) -> str:
        return next((c for c in choices if c.lower() == text.lower()), text)
    return convert


def knobs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The knob values given on the command line (``add_knob_arguments``' dests), keyed by knob name."""
    values = {}
    for knob in _flag_knobs():
        value = getattr(args, knob_dest(knob), None)
        if value is not None:
            values[knob.name] = value
    return values


def knobs_from_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``horovod.run(**knobs)``: keyword arguments named like the flags' dests (``fusion_threshold_mb=32``,
    ``timeline_filename=...``), each checked and converted as a config-file value is; None means not given.

    Raises:
        TypeError: a name that is no knob's (the text lists the known names).
        ValueError: a value the knob cannot take.
    """
    by_dest = {knob_dest(k): k for k in _flag_knobs()}
    unknown = sorted(set(kwargs) - set(by_dest))
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s) {', '.join(unknown)}; the knob arguments are "
                        f"{', '.join(sorted(by_dest))}")
    return {by_dest[dest].name: _coerce(by_dest[dest], value, f"{dest}")
            for dest, value in kwargs.items() if value is not None}


def validate_knobs(values: Mapping[str, Any], base_env: Mapping[str, str]) -> None:
    """Check every knob the workers will see before any of them starts.

    ``values``: the knobs given (name → flag value).  Negative values raise upstream's
    ``ValueError('<arg>=<v> must be >= 0')``; then ``base_env`` with ``values`` applied is parsed as
    ``hvd.init()`` will parse it, so ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5min`` fails here, naming the
    variable, instead of in every worker.
    """
    for knob in _flag_knobs():
        value = values.get(knob.name)
        if knob.flag_type in _NONNEGATIVE_TYPES and value is not None and value < 0:
            raise ValueError(f"{knob_dest(knob)}={value} must be >= 0")
    given = knob_env(values)
    try:
        read_runtime_config({**base_env, **given})
    except EnvVarError as e:
        knob = KNOB_BY_ENV.get(e.name)
        if knob is not None and knob.flag and knob.env in given:  # the bad value came from a flag
            raise ValueError(f"{knob.flag} {values[knob.name]}: {e}") from None
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
    """Read the YAML config file (PyYAML if installed, else the two-level subset).

    Raises:
        ValueError: the file is not a mapping, or has a key no knob reads (a misspelt key would otherwise
            leave its knob at the default without a word).
    """
    with open(filename) as f:
        text = f.read()
    try:
        import yaml
    except ImportError:
        data = _parse_simple_yaml(text, filename)
    else:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:  # a one-line error naming the file, as for every other config problem
            mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            raise ValueError(f"config file {filename} is not valid YAML: {where}{problem or e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {filename} must contain a mapping, got {type(data).__name__}")
    _check_config_keys(data, filename)
    return data


def _check_config_keys(config: Mapping[str, Any], filename: str) -> None:
    known = {key for knob in KNOBS for key in (knob.yaml, knob.yaml_off) if key}
    sections = {key.split(".", 1)[0] for key in known}
    unknown = []
    for top, value in config.items():
        if top == "controller" or (top in sections and value is None):  # an empty section
            continue
        if top not in sections:
            unknown.append(str(top))
        elif not isinstance(value, Mapping):
            raise ValueError(f"config file {filename}: '{top}' must be a section of 'key: value' lines, got "
                             f"{value!r}")
        else:
            unknown += [f"{top}.{key}" for key in value if f"{top}.{key}" not in known]
    if unknown:
        import difflib

        def hint(key: str) -> str:
            close = difflib.get_close_matches(key, sorted(known | sections | {"controller"}), n=1, cutoff=0.75)
            return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)

        raise ValueError(f"config file {filename}: unknown key(s) {', '.join(hint(k) for k in unknown)}; the "
                         f"keys are {', '.join(sorted(known))} and controller")


def _lookup(config: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def apply_config_file(values: dict[str, Any], config: Mapping[str, Any]) -> str | None:
    """Fill the knobs not given on the command line (``values``, name → value) from ``config``: explicit
    flags win.

    Returns:
        The file's ``controller`` (``"gloo"`` or ``"mpi"``), or None when it names none.
    """
    for knob in _flag_knobs():
        if knob.name in values or not knob.yaml:
            continue
        found, value = _lookup(config, knob.yaml)
        if found and value is not None:
            values[knob.name] = _coerce(knob, value)
    for knob in _flag_knobs():
        if knob.name in values or not knob.yaml_off:
            continue
        found, value = _lookup(config, knob.yaml_off)
        if found and value is not None:
            values[knob.name] = not _coerce(knob, value, f"config file: {knob.yaml_off}")
    controller = config.get("controller")
    if not controller:
        return None
    if str(controller).lower() not in ("gloo", "mpi"):
        # upstream's text first (scripts match on it), then what is accepted
        raise ValueError(f"No such controller supported: {controller} (config file: controller must be 'gloo' "
                         "or 'mpi')")
    return str(controller).lower()


def _coerce(knob: Knob, value: Any, key: str | None = None) -> Any:
    """A config-file (or ``run()``) value as the flag's type; a value of the wrong kind names the key."""
    key = key or f"config file: {knob.yaml}"
    if knob.flag_type is bool:
        return value if isinstance(value, bool) else parse_bool(key, str(value))
    if knob.choices:
        choice = _choice_type(knob.choices)(str(value))
        if choice not in knob.choices:
            raise ValueError(f"{key}={value!r} is not one of {', '.join(knob.choices)}")
        return choice
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


def knob_env(values: Mapping[str, Any]) -> dict[str, str]:
    """The variables of the knobs given in ``values`` (name → flag value), e.g. MB → bytes."""
    return {knob.env: knob.flag_to_env(values[knob.name]) for knob in _flag_knobs()
            if values.get(knob.name) is not None}
