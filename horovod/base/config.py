"""One declarative table of the runtime knobs, and the one place where HOROVOD_* variables are parsed.

Each knob has an environment variable (what workers read), an optional ``horovodrun`` flag and an optional
key in the ``--config-file`` YAML.  The launcher builds its argparse options and the env it exports from
this table, and the runtime parses the env through :func:`read_runtime_config`, so the three never drift.

Every other ``HOROVOD_*`` variable the code reads (the rank layout the launcher exports, the rendezvous
address, the job key, ``HOROVOD_START_TIMEOUT`` ...) is listed in :data:`ENV_VARS` too and read with
:func:`read_env`.  Parsing is strict: a value that is not what the variable needs -- ``3s``, ``5min``,
``abc``, a negative number, ``inf``, ``nan`` -- raises :class:`EnvVarError`, a ``ValueError`` whose text
names the variable and the value, e.g.
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='5min' is not a number of seconds``.  A typo therefore can never turn
into 0, which for several deadlines means "wait forever".  An unset or empty variable means its default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Knob", "KNOBS", "RuntimeConfig", "read_runtime_config", "EnvVar", "ENV_VARS", "EnvVarError",
           "read_env", "is_set", "unknown_variables", "explicit_knobs", "env_bool", "env_int", "env_float",
           "start_timeout", "format_number",
           "parse_bool", "parse_int", "parse_core_list", "parse_number", "parse_choice", "LOG_LEVELS",
           "DEFAULT_START_TIMEOUT", "DEFAULT_ELASTIC_TIMEOUT", "DEFAULT_STALL_SHUTDOWN_SECONDS"]

MIB = 1024 * 1024

# The default stall shutdown deadline.  Upstream waits forever (0 = never); we end the job instead so that a
# missing rank becomes an error naming the rank and tensors.  See docs/compatibility.md.
DEFAULT_STALL_SHUTDOWN_SECONDS = 300.0

DEFAULT_START_TIMEOUT = 30
"""Seconds workers may take to meet (``--start-timeout``/``HOROVOD_START_TIMEOUT``): the one definition."""

DEFAULT_ELASTIC_TIMEOUT = 600
"""Seconds an elastic job waits for enough slots (``--elastic-timeout``/``HOROVOD_ELASTIC_TIMEOUT``)."""

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")
_INT_RE = re.compile(r"[+-]?\d+")
_HEX_RE = re.compile(r"(?:[0-9a-fA-F]{2})+")


class EnvVarError(ValueError):
    """A ``HOROVOD_*`` variable (or knob value) that cannot be used; the text names it and its value."""

    def __init__(self, name: str, text: str, problem: str, *, show_value: bool = True) -> None:
        shown = f"{name}={text!r}" if show_value else name
        super().__init__(f"{shown} {problem}")
        self.name = name
        self.text = text


# ---------------------------------------------------------------------------------------------- parsers
# Every parser takes (variable name, text) and returns the value or raises EnvVarError naming the variable.

def parse_str(name: str, text: str) -> str:
    """Any text (file names, host names, interface names)."""
    return text


def parse_bool(name: str, text: str) -> bool:
    """``1/0, true/false, yes/no, on/off`` (any case); any other text is an error, never a silent False."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    if _INT_RE.fullmatch(low) and int(low) > 0:
        return True  # upstream reads these with strtol(...) > 0: "2" still means on
    raise EnvVarError(name, text, "is not a boolean (use 1 or 0; true/false, yes/no and on/off also work)")


def parse_int(name: str, text: str, *, minimum: int | None = 0, maximum: int | None = None,
              what: str = "a whole number") -> int:
    """A whole number in ``[minimum, maximum]``; ``1e6`` and ``64.0`` are accepted, ``64MB`` is not."""
    stripped = text.strip()
    if _INT_RE.fullmatch(stripped):
        value = int(stripped)
    else:
        try:
            number = float(stripped)
        except ValueError:
            raise EnvVarError(name, text, f"is not {what}") from None
        if math.isnan(number) or not number.is_integer():
            raise EnvVarError(name, text, f"is not {what}")
        value = int(number)
    _check_range(name, text, value, minimum, maximum)
    return value


def parse_number(name: str, text: str, *, minimum: float | None = 0.0, positive: bool = False,
                 what: str = "a number", hint: str = "") -> float:
    """A finite number ``>= minimum`` (``> 0`` when ``positive``); units such as ``3s`` are errors."""
    try:
        value = float(text.strip())
    except ValueError:
        raise EnvVarError(name, text, f"is not {what}{hint}") from None
    if math.isnan(value):
        raise EnvVarError(name, text, f"is not {what}{hint}")
    if math.isinf(value):
        raise EnvVarError(name, text, f"must be a finite number{hint}")
    if positive and value <= 0:
        raise EnvVarError(name, text, f"must be > 0{hint}")
    _check_range(name, text, value, minimum, None, hint)
    return value


def _check_range(name: str, text: str, value: float, minimum: float | None, maximum: float | None,
                 hint: str = "") -> None:
    if minimum is not None and value < minimum:
        raise EnvVarError(name, text, f"must be >= {minimum:g}{hint}")
    if maximum is not None and value > maximum:
        raise EnvVarError(name, text, f"must be <= {maximum:g}{hint}")


def parse_choice(name: str, text: str, *, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (any case); returned in the case of ``choices``."""
    key = text.strip()
    for choice in choices:
        if key.lower() == choice.lower():
            return choice
    raise EnvVarError(name, text, f"is not one of {', '.join(choices)}")


def parse_hex_key(name: str, text: str) -> bytes:
    """A hex job key; the value itself is never shown in the error."""
    stripped = text.strip()
    if not _HEX_RE.fullmatch(stripped):
        raise EnvVarError(name, text, f"is not a hex string ({len(text)} characters); it is the per-job key "
                          "that horovodrun sets, or that you set for torchrun or srun (the same random hex key in "
                          "every process: python -c 'import secrets; print(secrets.token_hex(32))') -- fix it, or "
                          "unset it", show_value=False)
    return bytes.fromhex(stripped)


def _seconds(*, positive: bool = False, never: bool = False) -> Callable[[str, str], float]:
    hint = " (a plain number such as 300, no unit; 0 means never)" if never else \
        " (a plain number such as 30, no unit)"
    return functools.partial(parse_number, positive=positive, what="a number of seconds", hint=hint)


def _count(what: str = "a whole number", minimum: int = 0) -> Callable[[str, str], int]:
    return functools.partial(parse_int, minimum=minimum, what=what)


def parse_core_list(name: str, text: str) -> tuple[int, ...]:
    """Comma-separated CPU core ids (upstream's ``HOROVOD_THREAD_AFFINITY``: one per local rank)."""
    parts = [p.strip() for p in text.strip().strip("[]").split(",")]
    if not all(_INT_RE.fullmatch(p) and int(p) >= 0 for p in parts):
        raise EnvVarError(name, text, "is not a comma-separated list of CPU core ids (e.g. 0,1), one per "
                          "local rank")
    return tuple(int(p) for p in parts)


def _unit_interval(name: str, text: str) -> float:
    """A number in [0, 1] (autotune's Gaussian-process noise)."""
    value = parse_number(name, text, what="a number in [0, 1]")
    _check_range(name, text, value, 0.0, 1.0)
    return value


def _region_bytes(name: str, text: str) -> int:
    """0 (measure) or a byte count in [4 KiB, 16 MiB] (each rank's part of a shared-memory piece)."""
    value = parse_int(name, text, minimum=None, what="a whole number of bytes")
    if value != 0 and not 4096 <= value <= 16 * MIB:
        raise EnvVarError(name, text, "must be 0 (measure the best) or between 4096 and 16777216 bytes")
    return value



# ---------------------------------------------------------------------------------------------- knob table
@dataclasses.dataclass(frozen=True)
class Knob:
    """A runtime setting: where it is read from and how it is parsed.

    ``parse(env_name, text)`` returns the value or raises :class:`EnvVarError`.  ``flag_to_env`` converts
    the launcher flag's value to the env text (e.g. MB → bytes).  The launcher's spelling of a knob is here
    too, so a knob added to the table is a ``horovodrun`` flag, a config-file key and a ``horovod.run()``
    argument without further edits: ``flag_off`` is a hidden flag setting the opposite of a boolean flag
    (upstream's ``--stall-check``), ``flag_aliases`` are hidden other spellings (deprecated names),
    ``yaml_off`` a config-file key meaning the opposite (upstream's ``stall_check.enabled``), ``choices``
    the values a text flag takes (any case).
    """

    name: str
    env: str
    parse: Callable[[str, str], Any]
    default: Any
    flag: str | None = None
    flag_type: type | None = None
    help: str = ""
    yaml: str | None = None
    flag_to_env: Callable[[Any], str] = str
    flag_off: str | None = None
    flag_aliases: tuple[str, ...] = ()
    yaml_off: str | None = None
    choices: tuple[str, ...] = ()


def _mb_to_bytes(v: Any) -> str:
    return str(int(v) * MIB)


def _bool_env(v: Any) -> str:
    return "1" if v else "0"


KNOBS: tuple[Knob, ...] = (
    Knob("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", _count("a whole number of bytes"), 128 * MIB,
         "--fusion-threshold-mb", int, "Fusion buffer threshold in MB (0 disables fusion).",
         "params.fusion_threshold_mb", _mb_to_bytes),
    Knob("cycle_time_ms", "HOROVOD_CYCLE_TIME",
         functools.partial(parse_number, what="a number of milliseconds"), 1.0,
         "--cycle-time-ms", float, "Upper bound in ms on how long the engine waits for more tensors to fuse.",
         "params.cycle_time_ms"),
    Knob("spin_wait_us", "HOROVOD_SPIN_WAIT_US",
         functools.partial(parse_number, what="a number of microseconds"), 500.0,
         None, None, "Most microseconds a thread waiting for a result polls before it sleeps (0: never); it "
         "polls for twice the typical wait seen lately and backs off by itself when polling finds nothing; a "
         "member waiting for a shared-memory token polls for at most 100 us of it.",
         None),
    Knob("cache_capacity", "HOROVOD_CACHE_CAPACITY", _count(), 1024,
         "--cache-capacity", int, "Response cache capacity (0 disables the cache).", "params.cache_capacity"),
    Knob("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", parse_bool, None,
         "--hierarchical-allreduce", bool, "Force (1) or forbid (0) hierarchical allreduce; unset = automatic.",
         "params.hierarchical_allreduce", _bool_env),
    Knob("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", parse_bool, None,
         "--hierarchical-allgather", bool, "Force (1) or forbid (0) hierarchical allgather; unset = automatic.",
         "params.hierarchical_allgather", _bool_env),
    # Upstream's NCCL torus allreduce: the flags and key are accepted (scripts written for upstream run); there
    # is no NCCL data plane here, so it changes nothing (docs/compatibility.md).
    Knob("torus_allreduce", "HOROVOD_TORUS_ALLREDUCE", parse_bool, None,
         "--torus-allreduce", bool, "Upstream's NCCL torus allreduce; accepted, no effect without NCCL.",
         "params.torus_allreduce", _bool_env),
    Knob("timeline", "HOROVOD_TIMELINE", parse_str, "",
         "--timeline-filename", str, "Write a Chrome-trace timeline to this file (rank 0).", "timeline.filename"),
    Knob("timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", parse_bool, False,
         "--timeline-mark-cycles", bool, "Mark engine cycles in the timeline.", "timeline.mark_cycles",
         _bool_env),
    Knob("stall_check_disable", "HOROVOD_STALL_CHECK_DISABLE", parse_bool, False,
         "--no-stall-check", bool, "Disable the stall inspector.", None, _bool_env,
         flag_off="--stall-check", yaml_off="stall_check.enabled"),
    # 0 would silently switch the stall inspector (and so the stall shutdown) off: HOROVOD_STALL_CHECK_DISABLE
    # is the one way to do that, so 0 is refused with a hint naming it.
    Knob("stall_check_time", "HOROVOD_STALL_CHECK_TIME_SECONDS",
         functools.partial(parse_number, positive=True, what="a number of seconds",
                           hint=" (a plain number such as 60, no unit; HOROVOD_STALL_CHECK_DISABLE=1 turns the "
                                "stall inspector off)"), 60.0,
         "--stall-check-warning-time-seconds", int, "Seconds before a stalled tensor is reported.",
         "stall_check.warning_time_seconds"),
    Knob("stall_shutdown_time", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", _seconds(never=True),
         DEFAULT_STALL_SHUTDOWN_SECONDS,
         "--stall-check-shutdown-time-seconds", int,
         "Seconds after which a stalled job is shut down (0 = never).", "stall_check.shutdown_time_seconds"),
    Knob("log_level", "HOROVOD_LOG_LEVEL", functools.partial(parse_choice, choices=LOG_LEVELS), "WARNING",
         "--log-level", str, "Log level of the workers' engine.", "logging.level", choices=LOG_LEVELS),
    Knob("log_hide_time", "HOROVOD_LOG_HIDE_TIME", parse_bool, False,
         "--log-without-timestamp", bool, "Hide timestamps in engine log lines.", None, _bool_env,
         flag_off="--log-with-timestamp", flag_aliases=("--log-hide-timestamp",), yaml_off="logging.with_timestamp"),
    Knob("op_timeout", "HOROVOD_GLOO_TIMEOUT_SECONDS", _seconds(positive=True), 30.0,
         "--gloo-timeout-seconds", int, "Seconds a peer may take inside a collective before the job fails.",
         "library_options.gloo_timeout_seconds"),
    Knob("mpi_threads_disable", "HOROVOD_MPI_THREADS_DISABLE", parse_bool, False,
         "--mpi-threads-disable", bool, "Under MPI, initialise MPI with MPI_THREAD_SERIALIZED instead of "
         "MPI_THREAD_MULTIPLE.", "library_options.mpi_threads_disable", _bool_env),
    Knob("num_nccl_streams", "HOROVOD_NUM_NCCL_STREAMS", _count("a number of streams", 1), 1,
         "--num-nccl-streams", int, "Upstream's NCCL streams per GPU; accepted, no effect without NCCL.",
         "library_options.num_nccl_streams"),
    Knob("thread_affinity", "HOROVOD_THREAD_AFFINITY", parse_core_list, (),
         "--thread-affinity", str, "Pin each rank's engine thread to a CPU core: a comma-separated list of "
         "core ids, one per local rank (e.g. 0,2).", "library_options.thread_affinity"),
    Knob("disable_shm", "HOROVOD_SHM_DISABLE", parse_bool, False,
         None, None, "Use TCP even between ranks on the same host (tests the cross-host path).", None,
         _bool_env),
    Knob("shm_cross_memory", "HOROVOD_SHM_CROSS_MEMORY", parse_bool, True,
         None, None, "Let ranks on one host copy large allreduces, broadcasts and allgathers straight between "
         "their buffers (process_vm_readv/writev, probed at start; allreduces keep it per size class where it measured "
         "faster than the segments); off: through the shared segments.", None,
         _bool_env),
    # 0 = measured per job (horovod/transport/shm_trials.py); bounded so that the segments stay a few MiB each.
    Knob("shm_region_bytes", "HOROVOD_SHM_REGION_BYTES",
         _region_bytes, 0,
         None, None, "Bytes of each rank's part of a shared-memory piece in large allreduces; 0 (default): "
         "the job measures 1 MiB and 2 MiB on its first large allreduces and keeps the faster.", None),
    Knob("retain_heap", "HOROVOD_RETAIN_HEAP", parse_bool, False,
         None, None, "Keep the C heap's memory between training steps instead of glibc handing its top back and "
         "faulting it in again on the next step (horovod/common/heap.py); off (default): glibc's defaults.", None,
         _bool_env),
    Knob("dynamic_process_sets", "HOROVOD_DYNAMIC_PROCESS_SETS", parse_bool, False,
         None, None, "Allow add_process_set/remove_process_set after init.", None, _bool_env),
    Knob("disable_group_fusion", "HOROVOD_DISABLE_GROUP_FUSION", parse_bool, False,
         None, None, "Fuse grouped ops only with their own group.", None, _bool_env),
    Knob("elastic", "HOROVOD_ELASTIC", parse_bool, False, None, None, "Elastic mode.", None, _bool_env),
    Knob("tls", "HOROVOD_TLS", parse_bool, False,
         "--tls", bool, "Encrypt the rendezvous store and the TCP channels between ranks with mutual TLS "
         "(a per-job certificate the launcher makes; needs the 'cryptography' package on the launcher's host).",
         None, _bool_env),
    # Autotune (horovod/runtime/autotune.py): rank 0 searches fusion threshold, cycle time, cache and
    # hierarchical collectives while the job trains, then keeps the best.
    Knob("autotune", "HOROVOD_AUTOTUNE", parse_bool, False,
         "--autotune", bool, "Tune fusion threshold, cycle time, response cache and hierarchical collectives "
         "while the job runs (rank 0 decides; every rank switches at the same point).", "autotune.enabled",
         _bool_env, flag_off="--no-autotune"),
    Knob("autotune_log", "HOROVOD_AUTOTUNE_LOG", parse_str, "",
         "--autotune-log-file", str, "Rank 0 writes every autotune trial (CSV, last row = best) to this file.",
         "autotune.log_file"),
    Knob("autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", _count("a number of samples"), 3,
         "--autotune-warmup-samples", int, "Autotune samples discarded before scores count.",
         "autotune.warmup_samples"),
    Knob("autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", _count("a number of steps", 1), 10,
         "--autotune-steps-per-sample", int, "Training steps (a tensor name seen again) per autotune sample.",
         "autotune.steps_per_sample"),
    Knob("autotune_bayes_opt_max_samples", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
         _count("a number of samples", 1), 20,
         "--autotune-bayes-opt-max-samples", int, "Trials of the Bayesian search of fusion threshold and "
         "cycle time.", "autotune.bayes_opt_max_samples"),
    Knob("autotune_gaussian_process_noise", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", _unit_interval, 0.8,
         "--autotune-gaussian-process-noise", float, "Noise of the scores the Gaussian process assumes, in "
         "[0, 1].", "autotune.gaussian_process_noise"),
)

KNOBS_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


def _field_type(knob: Knob) -> Any:
    """The annotation of a knob's field: the type of its default (a tri-state knob is ``bool | None``)."""
    return bool | None if knob.default is None else type(knob.default)


RuntimeConfig = dataclasses.make_dataclass(
    "RuntimeConfig",
    [(k.name, _field_type(k), dataclasses.field(default=k.default)) for k in KNOBS],
)
RuntimeConfig.__module__ = __name__  # pickling and repr find it here
RuntimeConfig.__doc__ = """The parsed knobs, generated from :data:`KNOBS` (one field per knob, named :attr:`Knob.name`,
defaulting to :attr:`Knob.default`), so no default is written twice."""


# ---------------------------------------------------------------------------------------------- other variables
@dataclasses.dataclass(frozen=True)
class EnvVar:
    """A ``HOROVOD_*`` variable: its parser, its default when unset or empty, and who sets it."""

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    help: str = ""


_PORT = functools.partial(parse_int, minimum=1, maximum=65535, what="a TCP port number")

_OTHER_VARS: tuple[EnvVar, ...] = (
    # The rank layout the launcher exports (horovod.common.bootstrap.topology_from_env).
    EnvVar("HOROVOD_RANK", _count("a rank (a whole number)"), 0, "this process's rank (set by the launcher)"),
    EnvVar("HOROVOD_SIZE", _count("a number of processes", minimum=1), 1, "number of ranks (launcher)"),
    EnvVar("HOROVOD_LOCAL_RANK", _count("a rank (a whole number)"), 0, "rank on this host (launcher)"),
    EnvVar("HOROVOD_LOCAL_SIZE", _count("a number of processes", minimum=1), 1, "ranks on this host"),
    EnvVar("HOROVOD_CROSS_RANK", _count("a rank (a whole number)"), 0, "this host's index (launcher)"),
    EnvVar("HOROVOD_CROSS_SIZE", _count("a number of hosts", minimum=1), 1, "hosts with this local rank"),
    EnvVar("HOROVOD_HOSTNAME", parse_str, "", "host name as the launcher knows it"),
    # Rendezvous and transport.
    EnvVar("HOROVOD_GLOO_RENDEZVOUS_ADDR", parse_str, "", "the launcher's rendezvous store address"),
    EnvVar("HOROVOD_GLOO_RENDEZVOUS_PORT", _PORT, None, "the launcher's rendezvous store port"),
    EnvVar("HOROVOD_GLOO_IFACE", parse_str, "", "network interface to listen on"),
    EnvVar("HOROVOD_SECRET_KEY", parse_hex_key, None, "the per-job key (hex), set by the launcher"),
    EnvVar("HOROVOD_TLS_CERT", parse_str, "", "the job's TLS certificate (PEM), set by horovodrun --tls"),
    EnvVar("HOROVOD_TLS_KEY", parse_str, "", "the job's TLS private key (PEM), set by horovodrun --tls"),
    EnvVar("HOROVOD_CONTROLLER", functools.partial(parse_choice, choices=("gloo", "mpi")), "",
           "gloo (launcher's store) or mpi"),
    EnvVar("HOROVOD_CPU_OPERATIONS", functools.partial(parse_choice, choices=("gloo", "mpi")), "",
           "data plane under MPI: mpi (default) or gloo (built-in)"),
    # Deadlines.
    EnvVar("HOROVOD_START_TIMEOUT", _seconds(positive=True), DEFAULT_START_TIMEOUT,
           "seconds workers may take to meet at the rendezvous"),
    EnvVar("HOROVOD_ELASTIC_TIMEOUT", _seconds(positive=True), DEFAULT_ELASTIC_TIMEOUT,
           "seconds an elastic job waits for enough slots"),
    EnvVar("HOROVOD_ELASTIC_GRACE_SECONDS", _seconds(), 30.0,
           "elastic driver: seconds a worker that has not left a failed generation may go without a heartbeat "
           "before it counts as hung"),
    EnvVar("HOROVOD_ELASTIC_SLOT", parse_str, "", "elastic worker's slot host:local_rank (set by the driver)"),
    EnvVar("HOROVOD_SPARK_START_TIMEOUT", _seconds(positive=True), 600,
           "horovod.spark: seconds the Spark tasks may take to start (its start_timeout's default)"),
)

ENV_VARS: dict[str, EnvVar] = {
    **{k.env: EnvVar(k.env, k.parse, k.default, k.help) for k in KNOBS},
    **{v.name: v for v in _OTHER_VARS},
}
"""Every ``HOROVOD_*`` variable the package reads, by name."""

# Variables no code here reads that are still no mistake: upstream Horovod's build switches (nothing is
# compiled here) and its GPU/library tuning without a counterpart, what upstream's launchers export, and
# this project's own test and Spark-task variables.
_UNREAD_PREFIXES = ("HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_BUILD_", "HOROVOD_CUDA_", "HOROVOD_ROCM_",
                    "HOROVOD_NCCL_", "HOROVOD_CCL_", "HOROVOD_GPU", "HOROVOD_TEST_")
_UNREAD_NAMES = frozenset({
    "HOROVOD_CMAKE", "HOROVOD_ALLOW_MIXED_GPU_IMPL", "HOROVOD_MIXED_INSTALL", "HOROVOD_SKIP_COMPILE",
    "HOROVOD_LOCAL_VERSION", "HOROVOD_MPICXX_SHOW", "HOROVOD_DEBUG",
    "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_DISABLE_NVTX_RANGES",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE", "HOROVOD_ENABLE_ASYNC_COMPLETION", "HOROVOD_CONTROLLER_DEFAULT",
    "HOROVOD_CPU_OPERATIONS_DEFAULT",
    "HOROVOD_GLOO_GLOBAL_PREFIX", "HOROVOD_GLOO_LOCAL_PREFIX", "HOROVOD_GLOO_CROSS_PREFIX",
    "HOROVOD_SPARK_PYTHONPATH", "HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX", "HOROVOD_SPARK_WORK_DIR",
    "HOROVOD_SPARK_TASK_GPUS", "HOROVOD_SPARK_RESULT_FILE", "HOROVOD_SPARK_ERROR_FILE",
})


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``HOROVOD_*`` variable in ``environ`` (default ``os.environ``) that nothing reads,
    naming the closest registered one: a misspelt knob (``HOROVOD_FUSION_THRESHHOLD``) would otherwise be
    ignored without a word.  Not an error: other software may export such names."""
    import difflib

    env = os.environ if environ is None else environ
    warnings = []
    for name in sorted(env):
        if (not name.startswith("HOROVOD_") or name in ENV_VARS or name in _UNREAD_NAMES
                or name.startswith(_UNREAD_PREFIXES)):
            continue
        close = difflib.get_close_matches(name, ENV_VARS, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.append(f"{name} is not a variable Horovod reads and has no effect{hint}")
    return warnings


def _text(name: str, environ: Mapping[str, str] | None) -> str | None:
    text = (os.environ if environ is None else environ).get(name)
    return None if text is None or text.strip() == "" else text


def read_env(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of the registered variable ``name`` (its default when unset or empty).

    Raises:
        EnvVarError: the value is not valid for the variable; the text names it.
    """
    var = ENV_VARS[name]
    text = _text(name, environ)
    return var.default if text is None else var.parse(name, text)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the registered variable ``name`` has a value (not unset, not empty): e.g. ``HOROVOD_RANK``
    set by a launcher, where its parsed value (0 by default) cannot tell."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not in horovod.base.config.ENV_VARS; register it there")
    return _text(name, environ) is not None


def read_runtime_config(environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    """Parse every knob from ``environ`` (default ``os.environ``); unset knobs keep their defaults.

    Raises:
        EnvVarError: a knob has a value it cannot take (``hvd.init()`` and ``horovodrun`` both call this).
    """
    values = {}
    for knob in KNOBS:
        text = _text(knob.env, environ)
        values[knob.name] = knob.default if text is None else knob.parse(knob.env, text)
    return RuntimeConfig(**values)


def explicit_knobs(environ: Mapping[str, str] | None = None) -> set[str]:
    """Names of the knobs set (not empty) in ``environ`` (default ``os.environ``): autotune leaves what the
    user chose out of its search, as upstream does."""
    return {knob.name for knob in KNOBS if _text(knob.env, environ) is not None}


def start_timeout(environ: Mapping[str, str] | None = None) -> float:
    """``HOROVOD_START_TIMEOUT`` in seconds (default :data:`DEFAULT_START_TIMEOUT`)."""
    return float(read_env("HOROVOD_START_TIMEOUT", environ))


def format_number(value: float) -> str:
    """Env text for a number: ``30`` rather than ``30.0`` when whole."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def env_bool(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean variable (strict, see :func:`parse_bool`); ``default`` when unset or empty."""
    text = _text(name, environ)
    return default if text is None else parse_bool(name, text)


def env_int(name: str, default: int, *, minimum: int | None = 0, maximum: int | None = None,
            environ: Mapping[str, str] | None = None) -> int:
    """A whole-number variable in ``[minimum, maximum]``; ``default`` when unset or empty."""
    text = _text(name, environ)
    return default if text is None else parse_int(name, text, minimum=minimum, maximum=maximum)


def env_float(name: str, default: float, *, minimum: float | None = 0.0, positive: bool = False,
              environ: Mapping[str, str] | None = None) -> float:
    """A finite number variable (``>= minimum``, ``> 0`` if ``positive``); ``default`` when unset or empty."""
    text = _text(name, environ)
    return default if text is None else parse_number(name, text, minimum=minimum, positive=positive)
