"""Drive tests/parallel/test_torch_*.py under the launcher: every rank runs the files in lockstep.

All files run in one launch at np=2 and in one at np=3 (torch's import and pytest's start were most of a launch
per file); the op tests on global float32/int32 data, Adasum's optimizer and SyncBatchNorm also run at np=4.
A hard timeout per launch turns a hang into a failure with the ranks' output, which names the failing test
(``-x`` stops the launch there).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
# test_torch_ops.py first: its module-level init(process_sets="dynamic") must be the launch's first init (the
# other files' plain init() is then a no-op, as upstream's second init() is).
FILES = sorted((p.name for p in (ROOT / "tests" / "parallel").glob("test_torch_*.py")),
               key=lambda name: (name != "test_torch_ops.py", name))
NP4_SUBSET = ("(test_torch_ops and global and (float32 or int32))"
              " or (test_torch_optimizer and (adasum or sync_batch_norm))")  # Adasum needs a power of two
CASES = [(n, tuple(FILES), None) for n in (2, 3)] + [(4, ("test_torch_ops.py", "test_torch_optimizer.py"), NP4_SUBSET)]


@pytest.mark.parametrize("np_,names,select", CASES, ids=["np2-all", "np3-all", "np4-subset"])
def test_torch_parallel(np_, names, select):
    name = " ".join(names)
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable, "-m", "pytest", "-x", "-q",
           "-p", "no:cacheprovider", *(str(ROOT / "tests" / "parallel" / n) for n in names)]
    if select:
        cmd += ["-k", select]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"np={np_} {name} timed out:\n{(e.stdout or b'')[-6000:]!r}")
    assert out.returncode == 0, f"np={np_} {name} failed:\n{out.stdout[-8000:]}\n{out.stderr[-4000:]}"
