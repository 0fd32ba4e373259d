"""Drive tests/parallel/test_torch_*.py under the launcher: every rank runs the file in lockstep.

Each file runs at np=2 and np=3; the op tests on global float32/int32 data also run at np=4.  A hard
timeout per launch turns a hang into a failure with the ranks' output.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p.name for p in (ROOT / "tests" / "parallel").glob("test_torch_*.py"))
CASES = [(n, f, None) for n in (2, 3) for f in FILES] + [(4, "test_torch_ops.py", "global and (float32 or int32)")]


@pytest.mark.parametrize("np_,name,select", CASES, ids=[f"np{n}-{f[:-3]}" + ("-subset" if s else "")
                                                         for n, f, s in CASES])
def test_torch_parallel(np_, name, select):
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable, "-m", "pytest", "-x", "-q",
           "-p", "no:cacheprovider", str(ROOT / "tests" / "parallel" / name)]
    if select:
        cmd += ["-k", select]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"np={np_} {name} timed out:\n{(e.stdout or b'')[-6000:]!r}")
    assert out.returncode == 0, f"np={np_} {name} failed:\n{out.stdout[-8000:]}\n{out.stderr[-4000:]}"
