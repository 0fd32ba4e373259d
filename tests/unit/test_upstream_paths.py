"""Upstream's module paths that user code and upstream's test files import, against upstream's behaviour.

Each expectation below is upstream's documented (or tested) behaviour, computed independently of our code:
digests with ``hmac`` directly, host assignments by hand, thread results from the arguments.
"""

import hashlib
import hmac
import importlib
import io
import json
import os
import sys
import threading
import time
import warnings

import pytest

from horovod.common import basics
from horovod.common import util as hvd_util

UPSTREAM_PATHS = {
    "horovod.common.util": ["env", "is_version_greater_equal_than", "gpu_available", "extension_available",
                            "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "split_list",
                            "is_iterable", "check_installed_version", "num_rank_is_power_2",
                            "get_average_backwards_compatibility_fun", "_cache", "check_extension",
                            "get_ext_suffix", "get_extension_full_path"],
    "horovod.runner.util.threads": ["in_thread", "on_event", "execute_function_multithreaded"],
    "horovod.runner.common.util.env": ["get_env_rank_and_size", "is_exportable", "LOG_LEVEL_STR",
                                       "IGNORE_REGEXES", "is_kubeflow_mpi"],
    "horovod.runner.common.util.secret": ["make_secret_key", "compute_digest", "check_digest",
                                          "HOROVOD_SECRET_KEY", "SECRET_LENGTH", "DIGEST_LENGTH"],
    "horovod.runner.common.util.timeout": ["Timeout", "TimeoutException"],
    "horovod.runner.common.util.settings": ["BaseSettings", "Settings"],
    "horovod.runner.common.util.codec": ["dumps_base64", "loads_base64"],
    "horovod.runner.common.util.hosts": ["HostInfo", "SlotInfo", "get_host_assignments", "parse_hosts"],
    "horovod.runner.common.util.safe_shell_exec": ["execute", "GRACEFUL_TERMINATION_TIME_S"],
    "horovod.runner.elastic.worker": ["HostUpdateResult", "WorkerNotificationManager"],
    "horovod.runner.elastic.discovery": ["HostDiscovery", "HostDiscoveryScript", "FixedHosts", "HostManager"],
}


@pytest.mark.parametrize("module", sorted(UPSTREAM_PATHS))
def test_upstream_module_imports(module):
    mod = importlib.import_module(module)
    missing = [name for name in UPSTREAM_PATHS[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks {missing}"


def test_upstream_from_imports():
    # The import lines of upstream's test files and of user code, verbatim.
    from horovod.common.util import env, gpu_available, split_list  # noqa: F401
    from horovod.runner.common.util import codec, hosts, safe_shell_exec, secret, timeout  # noqa: F401
    from horovod.runner.common.util import settings as hvd_settings  # noqa: F401
    from horovod.runner.common.util.hosts import SlotInfo, get_host_assignments, parse_hosts  # noqa: F401
    from horovod.runner.elastic.discovery import FixedHosts, HostManager  # noqa: F401
    from horovod.runner.elastic.worker import HostUpdateResult, WorkerNotificationManager  # noqa: F401
    from horovod.runner.util.threads import in_thread, on_event  # noqa: F401


def test_host_update_result_flags():
    # upstream's IntFlag: no_update=0, removed=1, added=2, mixed=3 (removed | added)
    from horovod.runner.elastic.worker import HostUpdateResult

    assert [int(HostUpdateResult.no_update), int(HostUpdateResult.removed), int(HostUpdateResult.added),
            int(HostUpdateResult.mixed)] == [0, 1, 2, 3]
    assert HostUpdateResult.removed | HostUpdateResult.added == HostUpdateResult.mixed


@pytest.mark.parametrize("front_end", ["horovod.numpy", "horovod.torch", "horovod.tensorflow",
                                       "horovod.tensorflow.keras", "horovod.keras"])
def test_front_ends_export_the_build_probes(front_end):
    """Upstream's examples choose devices with these (newer ones: ``hvd.sycl_built()`` for Intel GPUs)."""
    pytest.importorskip("torch" if front_end == "horovod.torch" else "numpy")
    if "tensorflow" in front_end or "keras" in front_end:
        pytest.importorskip("tensorflow")
    mod = importlib.import_module(front_end)
    probes = {"gloo_built": True, "mpi_built": basics.mpi_built(), "nccl_built": 0, "ddl_built": False,
              "ccl_built": False, "cuda_built": False, "rocm_built": False, "sycl_built": False}
    assert {name: getattr(mod, name)() for name in probes} == probes
    assert set(probes) <= set(mod.__all__)


# ------------------------------------------------------------------------------ horovod.common.util
def test_env_sets_ignores_none_and_restores(monkeypatch):
    monkeypatch.setenv("HVD_TEST_KEEP", "old")
    monkeypatch.delenv("HVD_TEST_NEW", raising=False)
    monkeypatch.setenv("HVD_TEST_UNTOUCHED", "same")
    with hvd_util.env(HVD_TEST_KEEP="new", HVD_TEST_NEW="1", HVD_TEST_UNTOUCHED=None):
        assert os.environ["HVD_TEST_KEEP"] == "new"
        assert os.environ["HVD_TEST_NEW"] == "1"
        assert os.environ["HVD_TEST_UNTOUCHED"] == "same"
    assert os.environ["HVD_TEST_KEEP"] == "old"
    assert "HVD_TEST_NEW" not in os.environ
    assert os.environ["HVD_TEST_UNTOUCHED"] == "same"
    with pytest.raises(KeyError), hvd_util.env(HVD_TEST_NEW="2"):
        raise KeyError("restored on error too")
    assert "HVD_TEST_NEW" not in os.environ


@pytest.mark.parametrize("n_items,n", [(10, 3), (3, 3), (2, 5), (0, 2), (17, 4)])
def test_split_list(n_items, n):
    items = list(range(n_items))
    chunks = hvd_util.split_list(items, n)
    assert len(chunks) == n
    assert [x for c in chunks for x in c] == items
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert hvd_util.split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]


def test_is_iterable_and_power_of_two():
    assert hvd_util.is_iterable([1]) and hvd_util.is_iterable("ab") and hvd_util.is_iterable(iter(()))
    assert not hvd_util.is_iterable(3) and not hvd_util.is_iterable(None)
    assert [n for n in range(0, 17) if hvd_util.num_rank_is_power_2(n)] == [1, 2, 4, 8, 16]


def test_is_version_greater_equal_than():
    assert hvd_util.is_version_greater_equal_than("2.21.0", "2.16.0")
    assert hvd_util.is_version_greater_equal_than("2.16.0", "2.16.0")
    assert not hvd_util.is_version_greater_equal_than("2.9.1", "2.10.0")  # numeric, not lexical
    assert hvd_util.is_version_greater_equal_than("2.13.0+cpu", "2.0.0")
    with pytest.raises(ValueError, match="only accepts string arguments"):
        hvd_util.is_version_greater_equal_than(2, "1.0.0")
    with pytest.raises(ValueError, match="major.minor.patch. Received: 1.0"):
        hvd_util.is_version_greater_equal_than("1.0.0", "1.0")


def test_cache_memoises_by_arguments():
    calls = []

    @hvd_util._cache
    def f(a, b=0):
        calls.append((a, b))
        return a + b

    assert f(1, b=2) == 3 and f(1, b=2) == 3 and f(1) == 1
    assert calls == [(1, 2), (1, 0)]


def test_average_backwards_compatibility():
    class Ops:
        Average, Sum, Adasum = "avg", "sum", "adasum"

    handle = hvd_util.get_average_backwards_compatibility_fun(Ops)
    assert handle(None, None) == "avg"
    assert handle("adasum", None) == "adasum"
    with pytest.warns(DeprecationWarning):
        assert handle(None, True) == "avg"
    with pytest.warns(DeprecationWarning):
        assert handle(None, False) == "sum"
    with pytest.raises(ValueError, match="^The op parameter supersedes average. Please provide only one of them.$"):
        handle("sum", True)


def test_built_probes_match_basics():
    assert hvd_util.gloo_built() is True
    assert hvd_util.mpi_built() == basics.mpi_built()
    assert hvd_util.mpi_built(verbose=True) == basics.mpi_built()
    assert hvd_util.nccl_built() == 0
    assert hvd_util.ddl_built() is False and hvd_util.ccl_built() is False


def test_extension_available():
    assert hvd_util.extension_available("mxnet") is False  # no horovod.mxnet here
    assert hvd_util.extension_available("no_such_framework") is False
    for name in ("torch", "tensorflow"):
        framework_installed = importlib.util.find_spec(name) is not None
        assert hvd_util.extension_available(name) is framework_installed
    assert hvd_util.gpu_available("mxnet") is False


def test_gpu_available_asks_the_framework(monkeypatch):
    torch = pytest.importorskip("torch")
    assert hvd_util.gpu_available("torch") is torch.cuda.is_available()


def test_check_extension_and_paths():
    hvd_util.check_extension("horovod.torch", "HOROVOD_WITH_PYTORCH", "/pkg/horovod/torch/__init__.py", "mpi_lib")
    path = hvd_util.get_extension_full_path("/pkg/horovod/torch/__init__.py", "sub", "mpi_lib")
    assert path == os.path.join("/pkg/horovod/torch", "sub", "mpi_lib" + hvd_util.get_ext_suffix())
    assert hvd_util.get_ext_suffix().endswith(".so") or hvd_util.get_ext_suffix().endswith(".pyd")


def test_check_installed_version(monkeypatch, tmp_path):
    pkg = tmp_path / "horovod"
    (pkg / "common").mkdir(parents=True)
    monkeypatch.setattr(hvd_util, "__file__", str(pkg / "common" / "util.py"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_util.check_installed_version("torch", "2.0.0")  # no metadata.json: nothing to compare
    (pkg / "metadata.json").write_text(json.dumps({"torch": "1.9.0"}))
    with pytest.warns(UserWarning, match="installed with version 1.9.0 but found version 2.0.0"):
        hvd_util.check_installed_version("torch", "2.0.0")
    cause = RuntimeError("undefined symbol")
    from horovod.base.exceptions import HorovodVersionMismatchError

    with pytest.raises(HorovodVersionMismatchError) as info:
        hvd_util.check_installed_version("torch", "2.0.0", exception=cause)
    assert info.value.__cause__ is cause and isinstance(info.value, ImportError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_util.check_installed_version("torch", "1.9.0")


# ------------------------------------------------------------------------------ horovod.runner.util.threads
def test_in_thread():
    from horovod.runner.util.threads import in_thread

    got = []
    t = in_thread(lambda *a: got.append(a), args=(1, 2))
    t.join(5)
    assert got == [(1, 2)] and t.daemon
    t = in_thread(lambda: got.append("named"), name="worker-x", daemon=False)
    t.join(5)
    assert t.name == "worker-x" and not t.daemon and got[-1] == "named"
    with pytest.raises(ValueError,
                       match=r"^args must be a tuple, not <class 'int'>, for a single argument use \(arg,\)$"):
        in_thread(lambda x: None, args=1)

    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        def boom():
            raise RuntimeError("x")
        in_thread(boom, silent=True).join(5)
        assert errors == []
        in_thread(boom).join(5)
        assert len(errors) == 1
    finally:
        threading.excepthook = old_hook


def test_on_event():
    from horovod.runner.util.threads import on_event

    event, got = threading.Event(), []
    t = on_event(event, got.append, ("a",))
    time.sleep(0.05)
    assert got == []
    event.set()
    t.join(5)
    assert got == ["a"]

    event, stop, got = threading.Event(), threading.Event(), []
    t = on_event(event, got.append, (1,), stop=stop, check_stop_interval_s=0.01)
    stop.set()
    t.join(5)
    event.set()
    assert not t.is_alive() and got == []

    with pytest.raises(ValueError, match="^Event must not be None$"):
        on_event(None, print)
    with pytest.raises(ValueError, match="^args must be a tuple"):
        on_event(threading.Event(), print, args=1)
    with pytest.raises(ValueError, match="^Stop event must be given for non-daemon event thread$"):
        on_event(threading.Event(), print, stop=None, daemon=False)


def test_execute_function_multithreaded():
    from horovod.runner.util.threads import execute_function_multithreaded

    active, peak, lock = [0], [0], threading.Lock()

    def fn(a, b):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return a * b

    args = [[i, i + 1] for i in range(12)]
    assert execute_function_multithreaded(fn, args, max_concurrent_executions=3) == \
        {i: i * (i + 1) for i in range(12)}
    assert peak[0] <= 3
    assert execute_function_multithreaded(fn, [[2, 3]], block_until_all_done=False) is None

    def sometimes(x):
        if x == 2:
            raise ValueError("no")
        return x

    old_hook = threading.excepthook
    threading.excepthook = lambda args: None
    try:
        with pytest.raises(RuntimeError, match="^Some threads for func sometimes did not complete successfully.$"):
            execute_function_multithreaded(sometimes, [[1], [2], [3]])
    finally:
        threading.excepthook = old_hook


# ------------------------------------------------------------------------------ horovod.runner.common.util
def test_secret_digests():
    from horovod.runner.common.util import secret

    key = secret.make_secret_key()
    assert isinstance(key, bytes) and len(key) == secret.SECRET_LENGTH
    assert secret.make_secret_key() != key
    digest = secret.compute_digest(key, b"message")
    assert digest == hmac.new(key, b"message", hashlib.sha256).digest()
    assert len(digest) == secret.DIGEST_LENGTH
    assert secret.check_digest(key, b"message", digest)
    assert not secret.check_digest(key, b"messagE", digest)
    assert not secret.check_digest(secret.make_secret_key(), b"message", digest)


def test_codec_roundtrip():
    from horovod.runner.common.util import codec

    obj = {"f": (lambda x: x + 1), "data": [1, 2.5, "x"]}
    text = codec.dumps_base64(obj)
    assert isinstance(text, str) and text.isascii()
    assert isinstance(codec.dumps_base64(obj, to_ascii=False), bytes)
    back = codec.loads_base64(text)
    assert back["f"](1) == 2 and back["data"] == [1, 2.5, "x"]
    assert codec.loads_base64(codec.dumps_base64(3, to_ascii=False)) == 3


def test_timeout():
    from horovod.runner.common.util.timeout import Timeout, TimeoutException

    t = Timeout(60, "Timed out waiting for {activity}. Please check connectivity")
    assert 59 < t.remaining() <= 60 and not t.timed_out()
    t.check_time_out_for("workers")  # not yet
    t = Timeout(0.01, "Timed out waiting for {activity}")
    time.sleep(0.05)
    assert t.timed_out() and t.remaining() == 0
    with pytest.raises(TimeoutException) as info:
        t.check_time_out_for("workers")
    assert info.value.message == "Timed out waiting for workers. Timeout after 0.01 seconds."
    t = Timeout(0.01, "Done waiting for {activity}.")
    time.sleep(0.05)
    with pytest.raises(TimeoutException, match=r"^Done waiting for x\. Timeout after"):
        t.check_time_out_for("x")


def test_settings():
    from horovod.runner.common.util import settings as hvd_settings

    s = hvd_settings.Settings(hosts="a:2,b:2", num_proc=4, verbose=2, elastic=False, key=b"k")
    assert (s.hosts, s.num_proc, s.verbose, s.key, s.elastic) == ("a:2,b:2", 4, 2, b"k", False)
    base = hvd_settings.BaseSettings()
    assert base.num_proc is None and base.verbose == 0 and base.timestamp_output is False
    assert isinstance(s, hvd_settings.BaseSettings)


def test_hosts():
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    hosts = parse_hosts("a:2,b:1")
    assert [(h.hostname, h.slots) for h in hosts] == [("a", 2), ("b", 1)]
    slots = get_host_assignments(hosts, 3)
    got = [(s.hostname, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size) for s in slots]
    assert got == [("a", 0, 0, 0, 3, 2, 2), ("a", 1, 1, 0, 3, 2, 1), ("b", 2, 0, 1, 3, 1, 2)]
    with pytest.raises(ValueError, match=r"Requested more processes \(4\) than there are available slots \(3\)"):
        get_host_assignments(hosts, 4)


def test_env_rank_and_size(monkeypatch):
    from horovod.runner.common.util import env as env_util

    for var in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert env_util.get_env_rank_and_size() == (0, 1)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    assert env_util.get_env_rank_and_size() == (3, 4)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(RuntimeError, match="only one of OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE"):
        env_util.get_env_rank_and_size()
    monkeypatch.setenv("HOROVOD_RANK", "2")
    monkeypatch.setenv("HOROVOD_SIZE", "5")
    assert env_util.get_env_rank_and_size() == (2, 5)
    assert env_util.LOG_LEVEL_STR == ["FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]
    assert env_util.is_exportable("PATH") and env_util.is_exportable("HOROVOD_FUSION_THRESHOLD")
    for name in ("BASH_FUNC_foo%%", "OLDPWD", "CUDA_VISIBLE_DEVICES", "X_CUDA_VISIBLE_DEVICES",
                 "_HOROVOD_SECRET_KEY"):
        assert not env_util.is_exportable(name), name
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", "/etc/mpi/kubexec.sh")
    assert env_util.is_kubeflow_mpi()


def test_safe_shell_exec():
    from horovod.runner.common.util import safe_shell_exec

    out, err = io.StringIO(), io.StringIO()
    code = safe_shell_exec.execute("echo one; echo two 1>&2; echo $HVD_X; exit 3",
                                   env={**os.environ, "HVD_X": "from env"}, stdout=out, stderr=err, index=7)
    assert code == 3
    assert out.getvalue() == "[7]<stdout>:one\n[7]<stdout>:from env\n"
    assert err.getvalue() == "[7]<stderr>:two\n"

    out = io.StringIO()
    assert safe_shell_exec.execute("printf 'a\\nb'", stdout=out) == 0
    assert out.getvalue() == "a\nb"

    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    code = safe_shell_exec.execute(f"{sys.executable} -c 'import time; time.sleep(60)' & wait",
                                   stdout=io.StringIO(), stderr=io.StringIO(), events=[stop])
    assert code != 0 and time.monotonic() - start < 30


# ------------------------------------------------------------------------------ horovod.tensorflow
def test_tensorflow_util():
    tf = pytest.importorskip("tensorflow")
    import horovod.tensorflow as hvd
    from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs

    assert hvd._executing_eagerly is _executing_eagerly
    assert _executing_eagerly() is True
    seen = []

    def body(x):
        seen.append(_executing_eagerly())
        return x * 2

    graph_fn = _make_subgraph(body)
    assert float(graph_fn(tf.constant(3.0))) == 6.0 and seen == [False]
    with tf.Graph().as_default():
        assert _executing_eagerly() is False

    calls = []

    @_cache
    def make(n):
        calls.append(n)
        return [n]

    assert make(1) is make(1) and calls == [1]
    with tf.Graph().as_default():
        assert make(1) == [1] and calls == [1, 1]  # graph mode caches separately

    a, b = tf.Variable(1.0), tf.Variable(2.0)
    refs = vars_to_refs([a, [b]])
    assert isinstance(refs, tuple) and hash(refs) is not None
    back = refs_to_vars(refs)
    assert back[0] is a and back[1][0] is b
