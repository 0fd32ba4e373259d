"""Every HOROVOD_* variable given garbage, units, a negative number, inf or nan fails loudly, naming itself.

Before, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5min`` (and ``3s``, ``abc`` ...) parsed to 0 -- "never" for the
stall shutdown, "block forever" for other deadlines -- and ``inf`` raised a bare ``OverflowError``.  Now the
one parser in ``horovod.base.config`` raises an ``EnvVarError`` (a ``ValueError``) naming the variable and
the value, from ``hvd.init()`` in a worker and from ``horovodrun`` before any worker starts.
"""

import dataclasses
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import horovod
from horovod.base import config
from horovod.base.config import ENV_VARS, KNOBS, EnvVarError, RuntimeConfig, read_env, read_runtime_config
from horovod.common import bootstrap
from horovod.runner import knobs as knobs_mod
from horovod.runner.launch import JobSpec, _run, make_parser, parse_args

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch_util import clean_env  # noqa: E402

PACKAGE = Path(horovod.__file__).parent

BAD_VALUES = {
    "garbage": "abc",
    "seconds unit": "3s",
    "minutes unit": "5min",
    "size unit": "64MB",
    "negative": "-1",
    "negative float": "-0.5",
    "inf": "inf",
    "negative inf": "-inf",
    "nan": "nan",
}

# Variables whose value is any text (a file, host or interface name): garbage is taken literally.
TEXT_VARS = sorted(name for name, var in ENV_VARS.items() if var.parse is config.parse_str)
CHECKED_VARS = sorted(name for name in ENV_VARS if name not in TEXT_VARS)

# Valid spellings and what they mean (upstream's semantics are kept for valid values).
VALID = [
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0", 0.0),         # literally 0: never (upstream's meaning)
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", " 45 ", 45.0),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "2.5", 2.5),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "7", 7.0),
    ("HOROVOD_CYCLE_TIME", "0.5", 0.5),
    ("HOROVOD_FUSION_THRESHOLD", "0", 0),
    ("HOROVOD_FUSION_THRESHOLD", "67108864", 64 * 1024 * 1024),
    ("HOROVOD_FUSION_THRESHOLD", "1e6", 1_000_000),
    ("HOROVOD_CACHE_CAPACITY", "+12", 12),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "0", False),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", True),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "TRUE", True),
    ("HOROVOD_STALL_CHECK_DISABLE", "no", False),
    ("HOROVOD_STALL_CHECK_DISABLE", "On", True),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "2", True),               # upstream: strtol(...) > 0
    ("HOROVOD_LOG_LEVEL", "debug", "DEBUG"),
    ("HOROVOD_RANK", "3", 3),
    ("HOROVOD_SIZE", "4", 4),
    ("HOROVOD_GLOO_RENDEZVOUS_PORT", "65535", 65535),
    ("HOROVOD_SECRET_KEY", "0aFF", b"\x0a\xff"),
    ("HOROVOD_CONTROLLER", "GLOO", "gloo"),
    ("HOROVOD_CPU_OPERATIONS", "mpi", "mpi"),
    ("HOROVOD_START_TIMEOUT", "0.5", 0.5),
    ("HOROVOD_ELASTIC_TIMEOUT", "600", 600.0),
    ("HOROVOD_ELASTIC_GRACE_SECONDS", "0", 0.0),
    ("HOROVOD_THREAD_AFFINITY", "0, 2", (0, 2)),
    ("HOROVOD_THREAD_AFFINITY", "[3,1]", (3, 1)),                # a YAML list in the config file
    ("HOROVOD_NUM_NCCL_STREAMS", "2", 2),
    ("HOROVOD_MPI_THREADS_DISABLE", "1", True),
]

# Values valid for a number but not for this variable.
OUT_OF_RANGE = [
    # 0 would switch the stall inspector (and its shutdown) off; HOROVOD_STALL_CHECK_DISABLE is the way to do that
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "0", "must be > 0 (a plain number such as 60, no unit; "
                                              "HOROVOD_STALL_CHECK_DISABLE=1"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "0", "must be > 0"),      # 0 would make every socket non-blocking
    ("HOROVOD_START_TIMEOUT", "0", "must be > 0"),
    ("HOROVOD_ELASTIC_TIMEOUT", "0", "must be > 0"),
    ("HOROVOD_SIZE", "0", "must be >= 1"),
    ("HOROVOD_LOCAL_SIZE", "0", "must be >= 1"),
    ("HOROVOD_GLOO_RENDEZVOUS_PORT", "0", "must be >= 1"),
    ("HOROVOD_GLOO_RENDEZVOUS_PORT", "70000", "must be <= 65535"),
    ("HOROVOD_FUSION_THRESHOLD", "1.5", "is not a whole number"),
    ("HOROVOD_RANK", "1.5", "is not a rank"),
    ("HOROVOD_CPU_OPERATIONS", "ccl", "is not one of gloo, mpi"),
    ("HOROVOD_SECRET_KEY", "abc", "is not a hex string"),       # odd length
    ("HOROVOD_SECRET_KEY", "my-password", "that you set for torchrun or srun (the same random hex key"),
    ("HOROVOD_THREAD_AFFINITY", "0,,1", "is not a comma-separated list of CPU core ids"),
    ("HOROVOD_NUM_NCCL_STREAMS", "0", "must be >= 1"),
]


@pytest.fixture
def env(monkeypatch):
    """A clean environment: no HOROVOD_* variable from an outer launcher."""
    for name in list(os.environ):
        if name.startswith("HOROVOD_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_registry_covers_the_table():
    assert {k.env for k in KNOBS} <= set(ENV_VARS)
    assert set(CHECKED_VARS) >= {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_RANK", "HOROVOD_SECRET_KEY",
                                 "HOROVOD_START_TIMEOUT", "HOROVOD_GLOO_RENDEZVOUS_PORT"}


def test_runtime_config_is_the_table():
    """One definition per knob: RuntimeConfig's fields and defaults are the table's, in its order."""
    fields = dataclasses.fields(RuntimeConfig)
    assert [f.name for f in fields] == [k.name for k in KNOBS]
    assert [f.default for f in fields] == [k.default for k in KNOBS]
    assert read_runtime_config({}) == RuntimeConfig()


def test_every_variable_the_code_reads_is_registered():
    """A HOROVOD_* name read anywhere in the package must go through the registry (one parser)."""
    read = re.compile(r"(?:read_env|is_set|env_int|env_float|env_bool|environ\.get|environ\[)"
                      r"\(?\s*f?[\"'](HOROVOD_[A-Z_]+)")
    found = set()
    for path in PACKAGE.rglob("*.py"):
        found |= set(read.findall(path.read_text()))
    assert found, "the scan found nothing: the pattern is broken"
    assert found - set(ENV_VARS) == set()


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("name", CHECKED_VARS)
def test_bad_value_is_an_error_naming_the_variable(name, kind):
    text = BAD_VALUES[kind]
    with pytest.raises(EnvVarError) as info:
        read_env(name, {name: text})
    message = str(info.value)
    assert message.startswith(name) and info.value.name == name
    if name == "HOROVOD_SECRET_KEY":
        assert text not in message.replace(name, "")     # the job key is never printed
    else:
        assert repr(text) in message
    assert isinstance(info.value, ValueError) and not isinstance(info.value, OverflowError)


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("knob", [k for k in KNOBS if k.parse is not config.parse_str], ids=lambda k: k.env)
def test_runtime_config_refuses_bad_knobs(knob, kind):
    with pytest.raises(ValueError, match=f"^{knob.env}="):
        read_runtime_config({knob.env: BAD_VALUES[kind]})


@pytest.mark.parametrize("name", TEXT_VARS)
def test_text_variables_are_taken_literally(name):
    for text in BAD_VALUES.values():
        assert read_env(name, {name: text}) == text


@pytest.mark.parametrize("name", sorted(ENV_VARS))
def test_unset_or_empty_means_default(name):
    assert read_env(name, {}) == ENV_VARS[name].default
    assert read_env(name, {name: ""}) == ENV_VARS[name].default
    assert read_env(name, {name: "  "}) == ENV_VARS[name].default


@pytest.mark.parametrize("name,text,expected", VALID)
def test_valid_values_keep_their_meaning(name, text, expected):
    assert read_env(name, {name: text}) == expected


@pytest.mark.parametrize("name,text,problem", OUT_OF_RANGE)
def test_out_of_range(name, text, problem):
    with pytest.raises(EnvVarError, match=re.escape(problem)) as info:
        read_env(name, {name: text})
    assert str(info.value).startswith(name)


def test_seconds_messages_say_what_to_write():
    with pytest.raises(EnvVarError) as info:
        read_env("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5min"})
    assert str(info.value) == ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='5min' is not a number of seconds (a plain "
                               "number such as 300, no unit; 0 means never)")


def test_generic_helpers_are_strict(env):
    env.setenv("HOROVOD_SHM_DISABLE", "maybe")
    with pytest.raises(EnvVarError, match="HOROVOD_SHM_DISABLE='maybe' is not a boolean"):
        config.env_bool("HOROVOD_SHM_DISABLE")
    env.setenv("HOROVOD_X_INT", "12abc")
    with pytest.raises(EnvVarError, match="HOROVOD_X_INT='12abc'"):
        config.env_int("HOROVOD_X_INT", 1)
    env.setenv("HOROVOD_X_FLOAT", "inf")
    with pytest.raises(EnvVarError, match="HOROVOD_X_FLOAT='inf' must be a finite number"):
        config.env_float("HOROVOD_X_FLOAT", 1.0)
    env.setenv("HOROVOD_X_FLOAT", "2.5")
    assert config.env_float("HOROVOD_X_FLOAT", 1.0) == 2.5


# ------------------------------------------------------------------ through the code that reads them
@pytest.mark.parametrize("kind", ["garbage", "seconds unit", "negative", "inf", "nan"])
@pytest.mark.parametrize("name", ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                                  "HOROVOD_GLOO_TIMEOUT_SECONDS", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_RANK",
                                  "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_ELASTIC"])
def test_init_refuses(env, name, kind):
    import horovod.numpy as hvd

    env.setenv(name, BAD_VALUES[kind])
    with pytest.raises(ValueError, match=f"^{name}="):
        hvd.init()
    assert not hvd.is_initialized()


@pytest.mark.parametrize("name,text", [("HOROVOD_GLOO_RENDEZVOUS_PORT", "abc"), ("HOROVOD_GLOO_RENDEZVOUS_PORT", "inf"),
                                       ("HOROVOD_SECRET_KEY", "zz"), ("HOROVOD_START_TIMEOUT", "abc"),
                                       ("HOROVOD_START_TIMEOUT", "5min"), ("HOROVOD_START_TIMEOUT", "nan"),
                                       ("HOROVOD_START_TIMEOUT", "-3")])
def test_init_of_a_launched_rank_refuses(env, name, text):
    """A rank of a 2-process job: the rendezvous variables fail before any connection is tried."""
    import horovod.numpy as hvd

    for k, v in {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT": "9", "HOROVOD_SECRET_KEY": "00" * 32}.items():
        env.setenv(k, v)
    env.setenv(name, text)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"^{name}"):
        hvd.init()
    assert time.monotonic() - start < 5
    assert not hvd.is_initialized()


@pytest.mark.parametrize("name,text", [("HOROVOD_ELASTIC_TIMEOUT", "10min"), ("HOROVOD_ELASTIC_TIMEOUT", "inf"),
                                       ("HOROVOD_ELASTIC_SLOT", None)])
def test_elastic_init_refuses(env, name, text):
    import horovod.numpy as hvd

    for k, v in {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                 "HOROVOD_GLOO_RENDEZVOUS_PORT": "9", "HOROVOD_SECRET_KEY": "00" * 32,
                 "HOROVOD_LOCAL_RANK": "x"}.items():
        env.setenv(k, v)
    if text is not None:
        env.setenv("HOROVOD_ELASTIC_SLOT", "localhost:0")  # the elastic driver's worker
        env.setenv(name, text)
        expected = name
    else:
        expected = "HOROVOD_LOCAL_RANK"   # no slot: a static worker, whose local rank is garbage
    with pytest.raises(ValueError, match=f"^{expected}="):
        hvd.init()


def test_topology_rank_below_size(env):
    env.setenv("HOROVOD_SIZE", "2")
    env.setenv("HOROVOD_RANK", "2")
    with pytest.raises(ValueError, match="HOROVOD_RANK=2 must be below HOROVOD_SIZE=2"):
        bootstrap.topology_from_env()
    env.setenv("HOROVOD_RANK", "1")
    env.setenv("HOROVOD_LOCAL_RANK", "1")
    with pytest.raises(ValueError, match="HOROVOD_LOCAL_RANK=1 must be below HOROVOD_LOCAL_SIZE=1"):
        bootstrap.topology_from_env()


def test_run_task_rank(env):
    from horovod.runner import run_task

    env.setenv("HOROVOD_RANK", "two")
    with pytest.raises(ValueError, match="HOROVOD_RANK='two'"):
        run_task._rank()


# ------------------------------------------------------------------ horovodrun
def _launch_args(argv, environ):
    args = parse_args(argv)
    args.env = environ
    return args


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("knob", [k for k in KNOBS if k.parse is not config.parse_str], ids=lambda k: k.env)
def test_launcher_refuses_bad_knob_env_before_starting(knob, kind):
    args = _launch_args(["-np", "2", "true"], {"PATH": os.environ["PATH"], knob.env: BAD_VALUES[kind]})
    with pytest.raises(ValueError, match=f"^{knob.env}="):
        _run(args)


@pytest.mark.parametrize("text", ["abc", "3s", "-1", "inf", "nan", "0"])
def test_launcher_refuses_bad_start_timeout_env(text):
    args = _launch_args(["-np", "2", "true"], {"PATH": os.environ["PATH"], "HOROVOD_START_TIMEOUT": text})
    with pytest.raises(ValueError, match="^HOROVOD_START_TIMEOUT="):
        _run(args)


@pytest.mark.parametrize("name,text", [("HOROVOD_ELASTIC_TIMEOUT", "5min"), ("HOROVOD_ELASTIC_TIMEOUT", "nan"),
                                       ("HOROVOD_ELASTIC_GRACE_SECONDS", "30s"),
                                       ("HOROVOD_ELASTIC_GRACE_SECONDS", "-inf")])
def test_elastic_launcher_refuses(name, text):
    args = _launch_args(["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1", "true"],
                        {"PATH": os.environ["PATH"], name: text})
    with pytest.raises(ValueError, match=f"^{name}="):
        _run(args)


@pytest.mark.parametrize("flag", [k.flag for k in KNOBS if k.flag and k.flag_type in (int, float)])
@pytest.mark.parametrize("text", ["abc", "3s", "inf", "nan"])
def test_numeric_flags_refuse_bad_values(flag, text, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["-np", "1", flag, text, "true"])
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--start-timeout", "--elastic-timeout", "-np"])
def test_other_numeric_flags_refuse_units(flag, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args([flag, "5min", "true"])
    assert "invalid int value: '5min'" in capsys.readouterr().err


def test_zero_deadline_flags():
    with pytest.raises(ValueError, match=r"^--gloo-timeout-seconds 0: HOROVOD_GLOO_TIMEOUT_SECONDS='0' must be > 0"):
        _run(_launch_args(["-np", "2", "--gloo-timeout-seconds", "0", "true"], {"PATH": os.environ["PATH"]}))
    with pytest.raises(ValueError, match="start_timeout=0 must be > 0"):
        _run(_launch_args(["-np", "2", "--start-timeout", "0", "true"], {"PATH": os.environ["PATH"]}))


@pytest.mark.parametrize("line,problem", [
    ("stall_check:\n  shutdown_time_seconds: 5min\n", "stall_check.shutdown_time_seconds='5min' is not a number"),
    ("params:\n  cycle_time_ms: .nan\n", "params.cycle_time_ms="),
    ("params:\n  fusion_threshold_mb: 1.5\n", "params.fusion_threshold_mb=1.5 is not a whole number"),
    ("timeline:\n  mark_cycles: maybe\n", "timeline.mark_cycles='maybe' is not a boolean"),
    ("logging:\n  level: loud\n", "logging.level='loud' is not one of"),
    # keys no knob reads (a misspelt key left its knob at the default without a word)
    ("params:\n  fusion_threshhold_mb: 32\n",
     "'params.fusion_threshhold_mb' (did you mean 'params.fusion_threshold_mb'?)"),
    ("fusion_threshold_mb: 32\n", "'fusion_threshold_mb' (did you mean 'params.fusion_threshold_mb'?)"),
    ("stall_checks:\n  enabled: false\n", "'stall_checks' (did you mean 'stall_check'?)"),
    ("params: 32\n", "'params' must be a section"),
    ("params: [1,2\n", "is not valid YAML: line 2, column 1: expected ',' or ']', but got '<stream end>'"),
])
def test_config_file_values_are_checked(tmp_path, line, problem):
    path = tmp_path / "c.yaml"
    path.write_text(line)
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_args(["-np", "1", "--config-file", str(path), "true"])


def test_run_exports_no_unset_knob():
    """Upstream's run() exported HOROVOD_CYCLE_TIME='(None,)' (a tuple by accident); ours exports none."""
    assert knobs_mod.knob_env(knobs_mod.knobs_from_args(make_parser().parse_args([]))) == {}
    assert JobSpec().knob_env() == {}


def test_launcher_fails_fast_naming_the_variable(tmp_path):
    """``horovodrun -np 2`` with a stall shutdown of '5min' fails at once; no worker starts, nothing hangs."""
    marker = tmp_path / "started"
    env = clean_env(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="5min")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, "-c",
                           f"open({str(marker)!r}, 'a').write('x')"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - start < 30
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='5min' is not a number of seconds" in proc.stderr
    assert not marker.exists()


def test_worker_that_sets_a_bad_knob_fails_fast_naming_it(tmp_path):
    """The same typo made inside the training script reaches hvd.init() on every rank: the job ends at once."""
    script = tmp_path / "w.py"
    script.write_text("import os\nos.environ['HOROVOD_GLOO_TIMEOUT_SECONDS'] = '3s'\n"
                      "import horovod.numpy as hvd\nhvd.init()\nprint('initialised')\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, str(script)],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS='3s' is not a number of seconds" in proc.stdout + proc.stderr
    assert "initialised" not in proc.stdout


def test_horovod_run_workers_see_no_garbage_knobs():
    names = [k.env for k in KNOBS]
    env_before = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        seen = horovod.run(lambda: {n: os.environ.get(n) for n in names}, np=1)
    finally:
        os.environ.update(env_before)
    assert seen == [dict.fromkeys(names)]
    assert not math.isnan(config.read_runtime_config({}).cycle_time_ms)


# ------------------------------------------------------------------ names nothing reads
def test_unknown_variables_name_the_closest_known_one():
    environ = {"HOROVOD_FUSION_THRESHHOLD": "1", "HOROVOD_CYCLETIME": "5", "HOROVOD_FROBNICATE": "1",
               "HOROVOD_FUSION_THRESHOLD": "1", "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_GPU_OPERATIONS": "NCCL",
               "HOROVOD_TEST_ANYTHING": "1", "HOROVOD_THREAD_AFFINITY": "0", "PATH": "/bin", "XHOROVOD_A": "1"}
    assert config.unknown_variables(environ) == [
        "HOROVOD_CYCLETIME is not a variable Horovod reads and has no effect; did you mean HOROVOD_CYCLE_TIME?",
        "HOROVOD_FROBNICATE is not a variable Horovod reads and has no effect",
        "HOROVOD_FUSION_THRESHHOLD is not a variable Horovod reads and has no effect; "
        "did you mean HOROVOD_FUSION_THRESHOLD?"]
    assert config.unknown_variables({name: "1" for name in ENV_VARS}) == []


def test_a_misspelt_variable_is_reported_once_by_rank_0(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import horovod.numpy as hvd\nhvd.init()\nhvd.shutdown()\nhvd.init()\nprint('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", sys.executable, str(script)],
                          env=clean_env(HOROVOD_FUSION_THRESHHOLD="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "FUSION_THRESHHOLD" in line]
    assert len(warnings) == 1 and "[rank 0]" in warnings[0], warnings
    assert "did you mean HOROVOD_FUSION_THRESHOLD?" in warnings[0]
    assert proc.stdout.count("ran") == 2


def test_config_file_with_an_empty_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("params:\nlogging:\n  level: debug\n")
    assert parse_args(["-np", "1", "--config-file", str(path), "true"]).knob_env() == {"HOROVOD_LOG_LEVEL": "DEBUG"}


def test_upstream_library_flags_and_keys_are_knobs(tmp_path):
    """Scripts written for upstream pass --mpi-threads-disable, --num-nccl-streams, --thread-affinity and
    --[no-]torus-allreduce (or the config file's keys): each becomes its variable, as upstream exports it."""
    expected = {"HOROVOD_MPI_THREADS_DISABLE": "1", "HOROVOD_NUM_NCCL_STREAMS": "2",
                "HOROVOD_THREAD_AFFINITY": "1,0", "HOROVOD_TORUS_ALLREDUCE": "0"}
    job = parse_args(["-np", "2", "--mpi-threads-disable", "--num-nccl-streams", "2", "--thread-affinity", "1,0",
                      "--no-torus-allreduce", "true"])
    assert job.knob_env() == expected
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  torus_allreduce: false\nlibrary_options:\n  mpi_threads_disable: true\n"
                    "  num_nccl_streams: 2\n  thread_affinity: 1,0\n")
    assert parse_args(["-np", "2", "--config-file", str(path), "true"]).knob_env() == expected
    parsed = read_runtime_config(expected)
    assert (parsed.mpi_threads_disable, parsed.num_nccl_streams, parsed.thread_affinity, parsed.torus_allreduce) \
        == (True, 2, (1, 0), False)


def test_engine_core_is_the_local_ranks_entry_and_refuses_what_cannot_be_pinned():
    from horovod.runtime.engine import Topology, engine_core

    allowed = sorted(os.sched_getaffinity(0))
    two = read_runtime_config({"HOROVOD_THREAD_AFFINITY": f"{allowed[-1]},{allowed[0]}"})
    assert engine_core(two, Topology(rank=3, size=4, local_rank=0, local_size=2)) == allowed[-1]
    assert engine_core(two, Topology(rank=1, size=4, local_rank=1, local_size=2)) == allowed[0]
    assert engine_core(read_runtime_config({}), Topology(rank=0, size=1)) is None
    with pytest.raises(EnvVarError, match="names 2 core\\(s\\) but this host runs 3 ranks"):
        engine_core(two, Topology(rank=0, size=3, local_rank=0, local_size=3))
    missing = max(allowed) + 1
    with pytest.raises(EnvVarError, match=f"gives local rank 0 core {missing}, which this process may not run on"):
        engine_core(read_runtime_config({"HOROVOD_THREAD_AFFINITY": str(missing)}), Topology(rank=0, size=1))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell the pinning apart")
def test_thread_affinity_pins_each_ranks_engine_thread(tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    script = tmp_path / "w.py"
    script.write_text("import os\nimport numpy as np\nimport horovod.numpy as hvd\nfrom horovod.common import basics\n"
                      "hvd.init()\nengine = basics._engine._thread.native_id\n"
                      "assert hvd.allreduce(np.ones(3), op=hvd.Sum).tolist() == [2.0] * 3\n"
                      "print('pinned', hvd.local_rank(), sorted(os.sched_getaffinity(engine)), "
                      "len(os.sched_getaffinity(0)))\n")
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", "--thread-affinity",
                           f"{second},{first}", sys.executable, str(script)],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = sorted(line.split("pinned ", 1)[1] for line in proc.stdout.splitlines() if "pinned" in line)
    width = len(os.sched_getaffinity(0))
    assert seen == [f"0 [{second}] {width}", f"1 [{first}] {width}"]  # the caller's threads stay unpinned


def test_unwritable_timeline_fails_the_job_at_init_naming_it(tmp_path):
    target = tmp_path / "missing" / "timeline.json"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "horovod.runner", "-np", "2", "--timeline-filename", str(target),
                           sys.executable, "-c", "import horovod.numpy as hvd; hvd.init(); print('initialised')"],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert f"HOROVOD_TIMELINE='{target}' cannot be written by rank 0: no directory" in proc.stdout + proc.stderr
    assert "initialised" not in proc.stdout
