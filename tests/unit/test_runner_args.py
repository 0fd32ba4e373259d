"""horovodrun argument parsing, the flag → env mapping, --config-file precedence, --check-build, mpirun."""

import pytest

from horovod.base.config import KNOBS
from horovod.runner import knobs
from horovod.runner.build_info import check_build
from horovod.runner.hosts import HostInfo, SlotInfo
from horovod.runner.launch import make_parser, parse_args, worker_env
from horovod.runner.mpi_run import is_exportable, mpi_command
from horovod.runner.output import rank_dir_name


def test_basic_flags():
    args = parse_args(["-np", "4", "-H", "localhost:4", "--verbose", "--start-timeout", "5",
                       "--output-filename", "out", "-prefix-timestamp", "--gloo", "python", "train.py", "-x"])
    assert args.num_proc == 4 and args.hosts == "localhost:4" and args.verbose and args.start_timeout == 5
    assert args.output_filename == "out" and args.prefix_output_with_timestamp and args.use_gloo
    assert args.command == ["python", "train.py", "-x"]
    assert not args.use_mpi and not args.check_build


def test_accepted_flags():
    args = parse_args(["-np", "1", "-p", "2222", "-i", "id_rsa", "--network-interface", "eth0",
                       "--network-interfaces", "eth1,eth2", "--disable-cache", "--tcp", "--mpi-args=-v",
                       "--hostfile", "hosts.txt", "true"])
    assert args.ssh_port == 2222 and args.ssh_identity_file == "id_rsa" and args.disable_cache
    assert args.nics == ["eth0", "eth1", "eth2"] and args.tcp and args.mpi_args == "-v"
    assert args.hostfile == "hosts.txt"
    with pytest.raises(SystemExit):
        parse_args(["-np", "1", "-H", "a:1", "--hostfile", "f", "true"])   # mutually exclusive
    with pytest.raises(SystemExit):
        parse_args(["-np", "1", "--gloo", "--mpi", "true"])


def test_every_flagged_knob_has_an_option():
    parser_args = make_parser().parse_args([])
    for knob in KNOBS:
        if knob.flag:
            assert hasattr(parser_args, knobs.knob_dest(knob)), knob.flag


def test_knob_env_mapping():
    args = parse_args(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                       "--cache-capacity", "0", "--timeline-filename", "/tmp/t.json",
                       "--timeline-mark-cycles",
                       "--no-stall-check", "--stall-check-warning-time-seconds", "10",
                       "--stall-check-shutdown-time-seconds", "20", "--log-level", "debug",
                       "--hierarchical-allreduce", "--no-hierarchical-allgather",
                       "--gloo-timeout-seconds", "7",
                       "true"])
    assert args.knob_env() == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_TIMELINE": "/tmp/t.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "7",
    }
    assert parse_args(["-np", "2", "true"]).knob_env() == {}   # nothing given, nothing exported
    assert parse_args(["--stall-check", "true"]).knob_env() == {"HOROVOD_STALL_CHECK_DISABLE": "0"}


@pytest.mark.parametrize("flag,dest", [("--fusion-threshold-mb", "fusion_threshold_mb"),
                                       ("--cycle-time-ms", "cycle_time_ms"),
                                       ("--cache-capacity", "cache_capacity"),
                                       ("--stall-check-warning-time-seconds",
                                        "stall_check_warning_time_seconds")])
def test_negative_values(flag, dest):
    args = parse_args(["-np", "1", flag, "-1", "true"])
    with pytest.raises(ValueError) as e:
        args.check()
    assert str(e.value) == f"{dest}=-1 must be >= 0" or str(e.value) == f"{dest}=-1.0 must be >= 0"


def test_validate_errors():
    with pytest.raises(ValueError, match="-np"):
        parse_args(["true"]).check()
    with pytest.raises(ValueError, match="No command"):
        parse_args(["-np", "2"]).check()
    with pytest.raises(ValueError, match="--jsrun is not supported"):
        parse_args(["-np", "2", "--jsrun", "true"]).check()
    with pytest.raises(ValueError, match=r"--max-np \(1\) must not be less than --min-np \(2\)"):
        parse_args(["-np", "2", "--min-np", "2", "--max-np", "1", "true"]).check()
    with pytest.raises(ValueError, match=r"--max-np \(2\) must not be less than -np \(3\)"):
        parse_args(["-np", "3", "--max-np", "2", "--host-discovery-script", "d.sh", "true"]).check()
    with pytest.raises(ValueError, match=r"--min-np \(3\) must not be greater than -np \(2\)"):
        parse_args(["-np", "2", "--min-np", "3", "-H", "a:2,b:2", "true"]).check()
    with pytest.raises(ValueError, match="-np/--num-proc or --min-np is required in elastic mode"):
        parse_args(["--host-discovery-script", "d.sh", "true"]).check()
    parse_args(["--min-np", "2", "-H", "a:1,b:1", "true"]).check()   # elastic: -np not needed


def test_output_filename_that_is_a_file_is_refused_before_starting(tmp_path):
    afile = tmp_path / "out"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"--output-filename {afile}: not a directory"):
        parse_args(["-np", "2", "--output-filename", str(afile), "true"]).check()
    parse_args(["-np", "2", "--output-filename", str(tmp_path / "new"), "true"]).check()  # created later


CONFIG = """\
# horovodrun config
controller: mpi
params:
  fusion_threshold_mb: 16
  cycle_time_ms: 3.5
  cache_capacity: 128
  hierarchical_allreduce: true
timeline:
  filename: tl.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 30
logging:
  level: info
  with_timestamp: false
library_options:
  gloo_timeout_seconds: 12
"""


def test_config_file_precedence(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG)
    args = parse_args(["-np", "2", "--config-file", str(path), "--fusion-threshold-mb", "64", "--gloo",
                       "--stall-check-warning-time-seconds", "5", "true"])
    env = args.knob_env()
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(64 * 1024 * 1024)          # CLI wins
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "5"                     # CLI wins
    assert env["HOROVOD_CYCLE_TIME"] == "3.5"                                 # from the file
    assert env["HOROVOD_CACHE_CAPACITY"] == "128"
    assert env["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert env["HOROVOD_TIMELINE"] == "tl.json" and env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"                          # enabled: false
    assert env["HOROVOD_LOG_LEVEL"] == "INFO" and env["HOROVOD_LOG_HIDE_TIME"] == "1"
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "12"
    assert args.use_gloo and not args.use_mpi                                 # explicit --gloo wins
    args = parse_args(["-np", "2", "--config-file", str(path), "true"])
    assert args.use_mpi


def test_config_file_unknown_controller_has_upstreams_text(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("controller: Foo\n")
    with pytest.raises(ValueError, match=r"^No such controller supported: Foo\b"):
        parse_args(["-np", "2", "--config-file", str(path), "true"])
    path.write_text("controller: MPI\n")  # any case, as upstream
    assert parse_args(["-np", "2", "--config-file", str(path), "true"]).use_mpi


def test_simple_yaml_matches_pyyaml():
    yaml = pytest.importorskip("yaml")
    assert knobs._parse_simple_yaml(CONFIG, "cfg") == yaml.safe_load(CONFIG)


def test_worker_env():
    slot = SlotInfo("localhost", rank=1, local_rank=1, cross_rank=0, size=3, local_size=3, cross_size=1)
    env = worker_env(slot, base={"PATH": "/bin", "HOROVOD_RANK": "9", "_HOROVOD_SECRET_KEY": "x"},
                     store_addr="127.0.0.1", store_port=1234, key=b"\x01" * 32,
                     knobs={"HOROVOD_CYCLE_TIME": "2.0"}, start_timeout=17, nics=["lo", "eth0"], tcp=True)
    assert env == {
        "PATH": "/bin", "HOROVOD_CYCLE_TIME": "2.0",
        "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "3", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_START_TIMEOUT": "17",
        "PYTHONUNBUFFERED": "1", "HOROVOD_SECRET_KEY": "01" * 32, "HOROVOD_GLOO_IFACE": "lo",
        "NCCL_SOCKET_IFNAME": "lo,eth0", "NCCL_IB_DISABLE": "1",
    }


def test_command_forms():
    assert parse_args(["-np", "1", "python", "-c", "print(1)"]).command_line() == ["python", "-c", "print(1)"]
    assert parse_args(["-np", "1", "python a.py | tee x"]).command_line() == "python a.py | tee x"
    assert parse_args(["-np", "1", "hostname"]).command_line() == ["hostname"]


def test_rank_dir_name():
    assert rank_dir_name(0, 1) == "rank.0"
    assert rank_dir_name(3, 10) == "rank.3"
    assert rank_dir_name(3, 11) == "rank.03"
    assert rank_dir_name(42, 101) == "rank.042"


def test_check_build_layout():
    text = check_build()
    lines = text.split("\n")
    assert lines[0].startswith("Horovod v") and lines[0].endswith(":")
    assert lines[1:3] == ["", "Available Frameworks:"]
    assert [line[8:] for line in lines[3:6]] == ["TensorFlow", "PyTorch", "MXNet"]
    assert lines[6:8] == ["", "Available Controllers:"]
    assert lines[9] == "    [X] Gloo"
    assert lines[10:12] == ["", "Available Tensor Operations:"]
    assert [line[8:] for line in lines[12:17]] == ["NCCL", "DDL", "CCL", "MPI", "Gloo    "]
    assert lines[-1] == "    [X] Gloo    "
    for line in lines[3:6] + lines[8:10] + lines[12:17]:
        assert line[:5] == "    [" and line[5] in "X " and line[6:8] == "] "
    assert check_build(verbose=True).startswith("\nHorovod v")


def test_mpi_command():
    env = {"PATH": "/bin", "HOROVOD_CYCLE_TIME": "2", "BASH_FUNC_x%%": "f", "OLDPWD": "/",
           "CUDA_VISIBLE_DEVICES": "0"}
    cmd = mpi_command(4, [HostInfo("a", 2), HostInfo("b", 2)], "python train.py", env, nics=["eth0"],
                      output_filename="logs", mpi_args="--report-bindings")
    assert cmd == ("mpirun --allow-run-as-root --tag-output -np 4 -H a:2,b:2 -bind-to none -map-by slot "
                   "-mca pml ob1 -mca btl '^openib' -mca btl_tcp_if_include eth0 -x NCCL_SOCKET_IFNAME "
                   "--output-filename logs -x HOROVOD_CYCLE_TIME -x PATH --report-bindings python train.py")
    stamped = mpi_command(2, [HostInfo("a", 2)], "python train.py", {}, timestamp=True)
    assert stamped.startswith("mpirun --allow-run-as-root --tag-output --timestamp-output -np 2 -H a:2 ")
    assert not is_exportable("OLDPWD") and not is_exportable("BASH_FUNC_foo%%")
    assert not is_exportable("_HOROVOD_SECRET_KEY") and is_exportable("HOROVOD_SECRET_KEY")


def test_upstream_knob_spellings():
    """Upstream's hidden opposites and deprecated aliases, all from the knob table."""
    assert parse_args(["--log-hide-timestamp", "true"]).knob_env() == {"HOROVOD_LOG_HIDE_TIME": "1"}
    assert parse_args(["--log-with-timestamp", "true"]).knob_env() == {"HOROVOD_LOG_HIDE_TIME": "0"}
    assert parse_args(["--log-level", "Trace", "true"]).knob_env() == {"HOROVOD_LOG_LEVEL": "TRACE"}
    autotune = parse_args(["--autotune", "--autotune-log-file", "at.csv", "--autotune-warmup-samples", "1",
                           "--autotune-steps-per-sample", "2", "--autotune-bayes-opt-max-samples", "3",
                           "--autotune-gaussian-process-noise", "0.5", "true"]).knob_env()
    assert autotune == {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "at.csv",
                        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
                        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "3",
                        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}
    assert parse_args(["--no-autotune", "true"]).knob_env() == {"HOROVOD_AUTOTUNE": "0"}
    help_text = make_parser().format_help()
    for hidden in ("--log-hide-timestamp", "--log-with-timestamp", "--stall-check ", "--no-autotune"):
        assert hidden not in help_text
    assert "(not supported yet)" not in help_text and "elastic arguments:" in help_text
    assert "(default: HOROVOD_START_TIMEOUT or 30)" in help_text


def test_a_knob_added_to_the_table_is_a_flag_a_config_key_and_a_run_argument(monkeypatch, tmp_path):
    from horovod.base import config

    extra = config.Knob("demo_ratio", "HOROVOD_DEMO_RATIO", config.parse_number, 0.5, "--demo-ratio", float,
                        "A demo knob.", "params.demo_ratio")
    monkeypatch.setattr(knobs, "KNOBS", (*knobs.KNOBS, extra))
    monkeypatch.setattr(knobs, "read_runtime_config", lambda env: None)
    assert parse_args(["--demo-ratio", "0.25", "true"]).knob_env() == {"HOROVOD_DEMO_RATIO": "0.25"}
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  demo_ratio: 0.75\n")
    assert parse_args(["--config-file", str(path), "true"]).knob_env() == {"HOROVOD_DEMO_RATIO": "0.75"}
    assert knobs.knob_env(knobs.knobs_from_kwargs({"demo_ratio": 2})) == {"HOROVOD_DEMO_RATIO": "2.0"}
    assert "--demo-ratio" in make_parser().format_help()


def test_job_spec_is_the_one_job_object():
    """horovodrun's arguments and horovod.run() both become a JobSpec; the driver never imports launch."""
    import ast
    import inspect

    from horovod.runner import job as job_mod
    from horovod.runner.elastic import driver

    job = parse_args(["-np", "3", "--min-np", "2", "--max-np", "4", "--elastic-timeout", "9", "-H", "a:2,b:2",
                      "--network-interface", "eth0,eth1", "--blacklist-cooldown-range", "1", "5", "true"])
    assert isinstance(job, job_mod.JobSpec) and job.is_elastic()
    assert job.elastic_bounds() == (3, 2, 4) and job.elastic_timeout_seconds() == 9
    assert job.nics == ["eth0", "eth1"] and job.cooldown_range == (1, 5)
    assert [h.hostname for h in job.host_list()] == ["a", "b"]
    job.env = {"HOROVOD_START_TIMEOUT": "12"}
    assert job.start_timeout_seconds() == 12 and job_mod.JobSpec(env={}).start_timeout_seconds() == 30
    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(driver)))
                if isinstance(node, ast.ImportFrom)}
    assert "horovod.runner.launch" not in imported


@pytest.mark.parametrize("user_value", [None, "1"])
def test_mpirun_workers_keep_python_buffering(monkeypatch, user_value):
    """Under ``--mpi`` the launcher no longer forces PYTHONUNBUFFERED (upstream sets it for gloo workers only):
    mpirun's --tag-output tags each write(2), and an unbuffered print('a', 'b') is several writes, so a line of
    upstream's pytorch_mnist.py came out as ``...Loss: 2.333871[1,0]<stdout>:Train...``.  A value the user
    exported is still passed on."""
    from horovod.runner import launch, mpi_run

    seen: dict = {}

    def fake_exec(cmd: str, env: dict) -> None:
        seen.update(env=env, cmd=cmd)
        raise SystemExit(0)

    monkeypatch.setattr(mpi_run, "exec_mpirun", fake_exec)
    if user_value is None:
        monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    else:
        monkeypatch.setenv("PYTHONUNBUFFERED", user_value)
    with pytest.raises(SystemExit):
        launch.run_commandline(["--mpi", "-np", "2", "python", "train.py"])
    assert seen["env"].get("PYTHONUNBUFFERED") == user_value
    assert seen["env"]["HOROVOD_START_TIMEOUT"] == "30"
