"""Drive the lockstep files of tests/parallel/ under the launcher, the way users run them:

    python -m horovod.runner -np N python -m pytest -x -q -p no:cacheprovider tests/parallel/<file>

for N in 2, 3, 4, plus one run over TCP only (HOROVOD_SHM_DISABLE=1).  The ops and error files (both a plain
``hvd.init()``) share a launch: a launch's process starts and imports cost more than most of their tests.  The
process-set file stays alone: its ``init(process_sets=...)`` must be its process's first.
"""

from __future__ import annotations

import os
import sys

import pytest
from launch_util import clean_env, launch, marked_processes

LAUNCHES = [("test_numpy_ops.py", "test_numpy_errors.py"), ("test_numpy_process_sets.py",)]
TIMEOUT = 240.0

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")


def _run(np_: int, names: tuple[str, ...], **env: str) -> None:
    paths = [os.path.join("tests", "parallel", name) for name in names]
    code, out, marker = launch(np_, [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *paths],
                               env=clean_env(**env), timeout=TIMEOUT)
    name = " ".join(names)
    leftovers = marked_processes(marker)
    if code != 0 or leftovers:
        print(out)
    assert code is not None, f"{name} with -np {np_} did not finish within {TIMEOUT:.0f} s"
    assert code == 0, f"{name} with -np {np_} failed (exit status {code}); output above"
    assert not leftovers, f"processes left behind: {leftovers}"


_IDS = ["+".join(names) for names in LAUNCHES]


@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("names", LAUNCHES, ids=_IDS)
def test_parallel_file(names, np_):
    _run(np_, names)


@pytest.mark.parametrize("names", LAUNCHES, ids=_IDS)
def test_parallel_file_tcp_only(names):
    _run(3, names, HOROVOD_SHM_DISABLE="1")
