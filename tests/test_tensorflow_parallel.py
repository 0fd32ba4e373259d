"""Drive tests/parallel/test_tensorflow_*.py and test_keras_*.py under the launcher (every rank runs the
file in lockstep), with a hard timeout per launch.  TensorFlow imports cost ~5 s per process, so the suite
is a few files at np=2, plus subsets of two of them at np=3 in one launch."""

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
NP3_SUBSET = ("(test_tensorflow_ops and ((allreduce and float32) or process_sets))"
              " or (test_tensorflow_many_collectives and opposite_orders)")  # (a module's name is a keyword)
CASES = [(2, (f,), None) for f in FILES] + [(3, ("test_tensorflow_ops.py", "test_tensorflow_many_collectives.py"),
                                             NP3_SUBSET)]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", HOROVOD_DYNAMIC_PROCESS_SETS="1",
                CUDA_VISIBLE_DEVICES="")


IDS = [f"np{n}-{'+'.join(f[:-3] for f in fs)}" + ("-subset" if s else "") for n, fs, s in CASES]


@pytest.mark.parametrize("np_,names,select", CASES, ids=IDS)
def test_tensorflow_parallel(np_, names, select):
    name = " ".join(names)
    cmd = [sys.executable, "-m", "horovod.runner", "-np", str(np_), sys.executable, "-m", "pytest", "-x", "-q",
           "-p", "no:cacheprovider", *(str(PARALLEL / n) for n in names)]
    if select:
        cmd += ["-k", select]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"np={np_} {name} timed out:\n{(e.stdout or b'')[-6000:]!r}")
    assert out.returncode == 0, f"np={np_} {name} failed:\n{out.stdout[-8000:]}\n{out.stderr[-4000:]}"
