"""Drive tests/parallel/test_tensorflow_*.py and test_keras_*.py under the launcher (every rank runs the
files in lockstep), with a hard timeout per launch.  TensorFlow's import costs ~5 s per process and is most of
a launch, so every file runs in one launch at np=2, and subsets of two of them in one more at np=3.  A failure
names its test in the ranks' output (``-x`` stops the launch there)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parent.parent
PARALLEL = ROOT / "tests" / "parallel"
FILES = sorted(p.name for p in PARALLEL.glob("test_tensorflow_*.py")) + \
    sorted(p.name for p in PARALLEL.glob("test_keras_*.py"))
NP3_SUBSET = ("(test_tensorflow_ops and ((allreduce and float32) or process_sets or adasum or in_place))"
              " or (test_tensorflow_many_collectives and opposite_orders)")  # (a module's name is a keyword)
CASES = [(2, tuple(FILES), None), (3, ("test_tensorflow_ops.py", "test_tensorflow_many_collectives.py"), NP3_SUBSET)]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", HOROVOD_DYNAMIC_PROCESS_SETS="1",
                CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("np_,names,select", CASES, ids=["np2-all", "np3-subset"])
def test_tensorflow_parallel(np_, names, select):
    name = " ".join(names) + (f" -k '{select}'" if select else "")
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable, "-m", "pytest", "-x", "-q",
           "-p", "no:cacheprovider", *(str(PARALLEL / n) for n in names)]
    if select:
        cmd += ["-k", select]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=480)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"np={np_} {name} timed out:\n{(e.stdout or b'')[-6000:]!r}")
    assert out.returncode == 0, f"np={np_} {name} failed:\n{out.stdout[-8000:]}\n{out.stderr[-4000:]}"
