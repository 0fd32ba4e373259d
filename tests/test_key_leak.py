"""The job key never leaks: not in a command line, the launcher's output, debug logs, exception texts, the
timeline or any file the job writes (issue 10).  Neither does the TLS private key of ``--tls`` jobs.

Real jobs run under ``horovodrun`` as users run them -- a static ``-np 2`` numpy job that also hits a
mismatched allreduce, writes a timeline and ends with a worker's uncaught error; an elastic job with a
discovery script; and a job over ssh on the network-namespace hosts when they are up -- with
``HOROVOD_LOG_LEVEL=debug`` and ``--verbose``.  The test learns the key the way a same-user process could,
from ``/proc/<pid>/environ`` of a worker (workers wait for that before they start), then searches for it in
hex (both cases), raw bytes and base64 (standard, URL-safe, with and without padding) in:

* every command line of every process, polled while the job runs, and every ``execve`` of the launcher's
  process tree when ``strace`` is installed (nothing short-lived slips between two polls);
* the launcher's stdout and stderr (workers' output, logs and tracebacks included);
* every file written under the job's directory (timeline, ``--output-filename`` logs, results) and every
  new entry in the temporary directory and ``/dev/shm``.

With ``--tls`` (a static job over TCP channels, the elastic job, the ssh job) the TLS private key is read from
the workers' ``HOROVOD_TLS_KEY`` the same way and searched for in the same places: as PEM, as each line and
the whole of its base64 body, as DER (raw, hex, base64) and as its raw private scalar (raw, hex).
"""

from __future__ import annotations

import base64
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from launch_util import MARKER, REPO, clean_env, kill_marked

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")
# --tls needs the optional ``cryptography`` (pip install 'horovod[tls]'); without it the jobs run without TLS.
HAVE_TLS = importlib.util.find_spec("cryptography") is not None
TLS_ARGS = ["--tls"] if HAVE_TLS else []
needs_tls = pytest.mark.skipif(not HAVE_TLS, reason="pip install 'horovod[tls]' (cryptography) for --tls")

WORKER = textwrap.dedent("""
    import logging, os, sys, time, traceback
    import numpy as np
    import horovod.numpy as hvd

    # Every debug line of horovod's loggers goes to stderr (HOROVOD_LOG_LEVEL alone does not configure
    # Python logging in the workers).
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    out = sys.argv[1]
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)  # the test reads the key from this process's environment first
    hvd.init()
    r = hvd.rank()
    x = hvd.allreduce(np.full(4, float(r)), name="fine")
    obj = hvd.broadcast_object({"rank": r, "text": "payload"}, root_rank=0)
    try:
        hvd.allreduce(np.ones(2 + r), name="mismatch")
    except Exception as e:
        print("caught:", repr(e), flush=True)
        traceback.print_exc()
    with open(os.path.join(out, f"result.{r}.txt"), "w") as f:
        f.write(f"{x.tolist()} {obj}\\n")
    hvd.shutdown()
    if r == 1 and os.environ.get("LEAK_TEST_FAIL_AT_END") == "1":
        raise RuntimeError("deliberate failure of rank 1 after its work")
""")


def key_forms(key_hex: str) -> dict[str, bytes]:
    """Every spelling of the key we search for."""
    raw = bytes.fromhex(key_hex)
    forms = {"hex": key_hex.lower().encode(), "HEX": key_hex.upper().encode(), "raw": raw}
    for name, enc in (("base64", base64.b64encode), ("base64url", base64.urlsafe_b64encode)):
        forms[name] = enc(raw)
        forms[name + "-nopad"] = enc(raw).rstrip(b"=")
    forms["base32"] = base64.b32encode(raw).rstrip(b"=")
    return forms


def tls_key_forms(pem: str) -> dict[str, bytes]:
    """Every spelling of a TLS private key (PEM) we search for."""
    from cryptography.hazmat.primitives import serialization

    lines = [line for line in pem.strip().splitlines() if line and not line.startswith("-----")]
    der = base64.b64decode("".join(lines))
    key = serialization.load_der_private_key(der, password=None)
    scalar = key.private_numbers().private_value.to_bytes(32, "big")  # type: ignore[union-attr]
    forms = {"PEM": pem.strip().encode(), "base64 body": "".join(lines).encode(), "DER": der,
             "DER hex": der.hex().encode(), "DER base64url": base64.urlsafe_b64encode(der).rstrip(b"="),
             "scalar": scalar, "scalar hex": scalar.hex().encode(), "scalar HEX": scalar.hex().upper().encode()}
    forms.update({f"base64 line {i}": line.encode() for i, line in enumerate(lines) if len(line) >= 32})
    return forms


def find_leaks(keys: set[str], where: str, data: bytes, tls_keys: set[str] = frozenset()) -> list[str]:
    found = [f"{name} form of the key in {where}" for k in keys for name, form in key_forms(k).items()
             if form in data]
    return found + [f"{name} of the TLS private key in {where}" for k in tls_keys
                    for name, form in tls_key_forms(k).items() if form in data]


class _Watcher(threading.Thread):
    """Polls every process: command lines seen, and the job key from the environment of the job's workers."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.halt = marker, threading.Event()
        self.cmdlines: set[str] = set()
        self.keys: set[str] = set()
        self.tls_keys: set[str] = set()
        self.key_seen = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for p in psutil.process_iter(["cmdline"]):
                cmd = p.info.get("cmdline")
                if not cmd:
                    continue
                self.cmdlines.add("\0".join(cmd))
                if not any(a.endswith("worker.py") for a in cmd):
                    continue
                try:
                    env = p.environ()
                except (psutil.Error, OSError):
                    continue
                if env.get(MARKER) == self.marker and env.get("HOROVOD_SECRET_KEY"):
                    self.keys.add(env["HOROVOD_SECRET_KEY"])
                    if env.get("HOROVOD_TLS_KEY"):
                        self.tls_keys.add(env["HOROVOD_TLS_KEY"])
                    self.key_seen.set()
            self.halt.wait(0.02)


def _snapshot(dirs: list[str]) -> set[str]:
    names = set()
    for d in dirs:
        try:
            names |= {os.path.join(d, n) for n in os.listdir(d)}
        except OSError:
            pass
    return names


def _files_under(path: str, limit: int = 64 << 20) -> list[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            try:
                if os.path.isfile(full) and os.path.getsize(full) <= limit:
                    found.append(full)
            except OSError:
                pass
    return found


def run_job(tmp: Path, argv: list[str], *, env: dict[str, str], prefix: list[str] | None = None,
            timeout: float = 120.0) -> tuple[int | None, bytes, set[str], list[str]]:
    """Run ``horovodrun <argv> python worker.py <tmp>/out`` in ``tmp``; return (rc, output, keys, leaks)."""
    out_dir = tmp / "out"
    out_dir.mkdir()
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    marker = uuid.uuid4().hex
    full_env = dict(env)
    full_env[MARKER] = marker
    watched = [tempfile.gettempdir(), "/dev/shm"]
    before = _snapshot(watched)
    strace = shutil.which("strace")
    trace_file = tmp / "execve.trace"
    cmd = [sys.executable, "-m", "horovod.runner", *argv, sys.executable, str(worker), str(out_dir)]
    if strace:
        cmd = [strace, "-f", "-qq", "-s", "65536", "-e", "trace=execve", "-o", str(trace_file), *cmd]
    watcher = _Watcher(marker)
    watcher.start()
    proc = subprocess.Popen([*(prefix or []), *cmd], cwd=str(tmp), env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    reader = {}

    def read(name, stream):
        reader[name] = stream.read()

    readers = [threading.Thread(target=read, args=(n, s), daemon=True)
               for n, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for t in readers:
        t.start()
    try:
        assert watcher.key_seen.wait(60), "no worker with the job key appeared"
        (out_dir / "go").touch()
        rc: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_marked(marker)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(10)
        for t in readers:
            t.join(10)
        time.sleep(0.1)
        watcher.halt.set()
        watcher.join(5)
    keys, tls_keys = watcher.keys, watcher.tls_keys
    output = reader.get("stdout", b"") + b"\n" + reader.get("stderr", b"")
    leaks = find_leaks(keys, "the launcher's output", output, tls_keys)
    for cmdline in watcher.cmdlines:
        leaks += find_leaks(keys, f"a command line ({cmdline[:200]!r})", cmdline.encode(), tls_keys)
    if strace and trace_file.exists():
        leaks += find_leaks(keys, "an execve of the job (strace)", trace_file.read_bytes(), tls_keys)
    new = _snapshot(watched) - before
    for path in [*_files_under(str(out_dir)), *(f for p in sorted(new) for f in _files_under(p))]:
        if path == str(trace_file) or os.path.basename(path) == "worker.py":
            continue
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue
        leaks += find_leaks(keys, f"file {path}", data, tls_keys)
    return rc, output, keys | {f"tls:{k}" for k in tls_keys}, leaks


def _env(**extra: str) -> dict[str, str]:
    return clean_env(HOROVOD_LOG_LEVEL="debug", **extra)


def _split(keys: set[str], tls: bool) -> set[str]:
    """The job keys seen; with ``tls`` also exactly one TLS key (without, none)."""
    tls_keys = {k for k in keys if k.startswith("tls:")}
    assert len(tls_keys) == (1 if tls else 0), tls_keys
    return keys - tls_keys


@pytest.mark.parametrize("tls", [False, pytest.param(True, marks=needs_tls)], ids=["plain", "tls"])
def test_static_job_with_errors_and_timeline(tmp_path, tls):
    extra = {"HOROVOD_SHM_DISABLE": "1"} if tls else {}  # TLS channels between the two ranks
    rc, output, keys, leaks = run_job(
        tmp_path, ["-np", "2", "--verbose", "--output-filename", str(tmp_path / "out" / "logs"),
                   *(["--tls"] if tls else [])],
        env=_env(HOROVOD_TIMELINE=str(tmp_path / "out" / "timeline.json"), LEAK_TEST_FAIL_AT_END="1", **extra))
    text = output.decode(errors="replace")
    assert rc not in (None, 0), text[-4000:]
    assert len(_split(keys, tls)) == 1, keys
    if tls:
        assert "TLS on TCP and the store" in text and "TCP channels in TLS" in text, text[-4000:]
    assert "Mismatched ALLREDUCE tensor shapes" in text, text[-4000:]  # the error path ran
    assert "deliberate failure of rank 1" in text, text[-4000:]
    assert "DEBUG horovod.transport.mesh: rank 1 mesh formed" in text, text[-4000:]  # debug logs were on
    assert (tmp_path / "out" / "timeline.json").stat().st_size > 0
    assert list((tmp_path / "out" / "logs").rglob("*")), "no --output-filename logs were written"
    assert not leaks, leaks


ELASTIC_ENV = {"HOROVOD_ELASTIC_GRACE_SECONDS": "2", "HOROVOD_START_TIMEOUT": "30"}


def test_elastic_job(tmp_path):
    script = tmp_path / "discover.sh"
    # The discovery script is the user's program, not a worker: it has no use for the key (its environment
    # lands in a file the job wrote, which is searched).
    script.write_text(f"#!/bin/sh\nenv > '{tmp_path}/out/discovery.env'\necho localhost:2\n")
    script.chmod(0o755)
    rc, output, keys, leaks = run_job(
        tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "2", "--verbose", *TLS_ARGS, "--host-discovery-script",
                   str(script)],
        env=_env(HOROVOD_TIMELINE=str(tmp_path / "out" / "timeline.json"), **ELASTIC_ENV))
    text = output.decode(errors="replace")
    assert rc == 0, text[-4000:]
    assert len(_split(keys, tls=HAVE_TLS)) == 1, keys
    assert "Mismatched ALLREDUCE tensor shapes" in text, text[-4000:]
    assert (tmp_path / "out" / "discovery.env").exists()
    assert not leaks, leaks


def test_job_over_ssh_on_netns_hosts(tmp_path):
    """Two ranks on two network-namespace hosts over ssh (skipped when the hosts are not up)."""
    spec = importlib.util.spec_from_file_location("_multihost_conftest",
                                                  os.path.join(REPO, "tests", "multihost", "conftest.py"))
    mh = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)  # how tests/multihost finds hosts
    sys.modules[spec.name] = mh
    spec.loader.exec_module(mh)
    env_file = os.path.join(mh.STATE, "hosts.env")
    if os.geteuid() != 0 or not mh.hosts_ready():
        pytest.skip("network-namespace hosts are not up (tests/multihost/conftest.py sets them up as root)")
    values = mh._read_env(env_file)
    ssh = ["-p", values["HVD_NETNS_SSH_PORT"], "-i", values["HVD_NETNS_KEY"]]
    rc, output, keys, leaks = run_job(
        tmp_path, [*ssh, "-np", "2", "-H", "hvdh2:1,hvdh3:1", "--verbose", *TLS_ARGS],
        env=_env(HOROVOD_TIMELINE=str(tmp_path / "out" / "timeline.json")),
        prefix=["ip", "netns", "exec", "hvdh1"])
    text = output.decode(errors="replace")
    assert rc == 0, text[-4000:]
    assert "remote over ssh" in text and (not HAVE_TLS or "TLS on TCP and the store" in text), text[-4000:]
    assert len(_split(keys, tls=HAVE_TLS)) == 1, keys
    assert not leaks, leaks


def test_the_search_finds_a_planted_key(tmp_path):
    """The checks above can fail: a key on a command line, in output or in a file is found in each form."""
    key = os.urandom(32).hex()
    forms = key_forms(key)
    for name, form in forms.items():
        assert find_leaks({key}, "x", b"prefix " + form + b" suffix") != [], name
    assert find_leaks({key}, "x", b"nothing here " + os.urandom(64).hex().encode()) == []
    if not HAVE_TLS:
        pytest.skip("the job-key forms are found; the TLS-key forms need cryptography (pip install 'horovod[tls]')")
    from horovod.transport.tls import make_credentials

    pem = make_credentials().key_pem.decode()
    for name, form in tls_key_forms(pem).items():
        assert find_leaks(set(), "x", b"prefix " + form + b" suffix", {pem}) != [], name
    assert find_leaks(set(), "x", make_credentials().key_pem, {pem}) == []  # another job's key is not this one
