"""Drive the lockstep files of tests/parallel/ under the launcher, the way users run them:

    python -m horovod.runner -np N python -m pytest -x -q -p no:cacheprovider tests/parallel/<file>

for N in 2, 3, 4, plus one run per file over TCP only (HOROVOD_SHM_DISABLE=1).
"""

from __future__ import annotations

import os
import sys

import pytest
from launch_util import clean_env, launch, marked_processes

PARALLEL_FILES = ["test_numpy_ops.py", "test_numpy_process_sets.py", "test_numpy_errors.py"]
TIMEOUT = 240.0

pytestmark = pytest.mark.skipif(bool(os.environ.get("HOROVOD_RANK")), reason="drives the launcher itself")


def _run(np_: int, name: str, **env: str) -> None:
    path = os.path.join("tests", "parallel", name)
    code, out, marker = launch(np_, [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", path],
                               env=clean_env(**env), timeout=TIMEOUT)
    leftovers = marked_processes(marker)
    if code != 0 or leftovers:
        print(out)
    assert code is not None, f"{name} with -np {np_} did not finish within {TIMEOUT:.0f} s"
    assert code == 0, f"{name} with -np {np_} failed (exit status {code}); output above"
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("name", PARALLEL_FILES)
def test_parallel_file(name, np_):
    _run(np_, name)


@pytest.mark.parametrize("name", PARALLEL_FILES)
def test_parallel_file_tcp_only(name):
    _run(3, name, HOROVOD_SHM_DISABLE="1")
