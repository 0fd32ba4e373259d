"""``HOROVOD_LOG_LEVEL`` / ``--log-level`` and ``HOROVOD_LOG_HIDE_TIME`` / ``--log-without-timestamp`` applied
to the ``horovod`` logger by ``hvd.init()``: level, time shown or hidden, rank prefix.

The job tests run a worker under the launcher as users do; the worker logs through ``horovod.*`` loggers
after init without configuring Python logging itself.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import textwrap

import pytest
from launch_util import clean_env, launch

from horovod.common import basics, logconfig

WORKER = textwrap.dedent("""
    import logging
    import horovod.numpy as hvd

    hvd.init()
    log = logging.getLogger("horovod.user_test")
    log.debug("debug line of rank %d", hvd.rank())
    log.log(5, "trace line of rank %d", hvd.rank())
    log.warning("warning line of rank %d", hvd.rank())
    hvd.shutdown()
""")

TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}: "
not_in_a_rank = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")


def _run_job(tmp_path, flags, **env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    rc, out, _ = launch(2, [*flags, sys.executable, str(script)], env=clean_env(**env), timeout=180)
    assert rc == 0, out
    return out


@not_in_a_rank
def test_job_default_level_warning_with_time_and_rank(tmp_path):
    out = _run_job(tmp_path, [])
    for r in (0, 1):
        assert re.search(rf"\[{TIME}W horovod\.user_test\] \[rank {r}\] warning line of rank {r}$", out, re.M), out
    assert "debug line" not in out and "trace line" not in out


@not_in_a_rank
def test_job_log_level_flag_and_hidden_time(tmp_path):
    out = _run_job(tmp_path, ["--log-level", "DEBUG", "--log-without-timestamp"])
    for r in (0, 1):
        assert re.search(rf"\[D horovod\.user_test\] \[rank {r}\] debug line of rank {r}$", out, re.M), out
        assert re.search(rf"\[W horovod\.user_test\] \[rank {r}\] warning line of rank {r}$", out, re.M), out
    assert "trace line" not in out
    assert not re.search(TIME, out), out


@not_in_a_rank
def test_job_log_level_env_trace(tmp_path):
    out = _run_job(tmp_path, [], HOROVOD_LOG_LEVEL="trace", HOROVOD_LOG_HIDE_TIME="1")
    for r in (0, 1):
        assert re.search(rf"\[T horovod\.user_test\] \[rank {r}\] trace line of rank {r}$", out, re.M), out


@not_in_a_rank
def test_job_bad_level_is_an_error_naming_the_variable(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    rc, out, _ = launch(2, [sys.executable, str(script)], env=clean_env(HOROVOD_LOG_LEVEL="verbose"), timeout=180)
    assert rc != 0 and "HOROVOD_LOG_LEVEL='verbose' is not one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL" in out


# ------------------------------------------------------------------------------ in this process
@pytest.fixture
def restore_horovod_logger():
    logger = logging.getLogger("horovod")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_init_sets_level_from_knobs(monkeypatch, restore_horovod_logger):
    for var in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "info")
    basics.init()
    try:
        assert restore_horovod_logger.level == logging.INFO
    finally:
        basics.shutdown()
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "FATAL")
    basics.init()
    try:
        assert restore_horovod_logger.level == logging.CRITICAL
    finally:
        basics.shutdown()


def test_handler_prints_only_without_application_handlers(monkeypatch, restore_horovod_logger):
    logconfig.configure("DEBUG", hide_time=True, rank=3)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        logging.getLogger("horovod.x").debug("alone %s", "here")
        try:
            raise KeyError("k")
        except KeyError:
            logging.getLogger("horovod.x").exception("failed")
    finally:
        root.handlers[:] = saved
    lines = err.getvalue().splitlines()
    assert lines[0] == "[D horovod.x] [rank 3] alone here"
    assert lines[1] == "[E horovod.x] [rank 3] failed" and "KeyError: 'k'" in err.getvalue()

    # The application configured logging: its handler gets the record, ours prints nothing.
    err.truncate(0)
    err.seek(0)
    app = io.StringIO()
    handler = logging.StreamHandler(app)
    root.addHandler(handler)
    try:
        logging.getLogger("horovod.x").info("to the application")
    finally:
        root.removeHandler(handler)
    assert err.getvalue() == "" and app.getvalue() == "to the application\n"


def test_levels_cover_the_knob_choices():
    from horovod.base.config import LOG_LEVELS

    assert set(logconfig.LEVELS) == set(LOG_LEVELS)
    assert [logconfig.python_level(n) for n in LOG_LEVELS] == sorted(logconfig.python_level(n) for n in LOG_LEVELS)
    assert logging.getLevelName(logconfig.TRACE) == "TRACE"
