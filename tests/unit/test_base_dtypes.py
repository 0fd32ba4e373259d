"""The wire's dtype table: bfloat16 works end to end, yet nothing imports ml_dtypes until it is used.

ml_dtypes' import costs ~0.6 s; every rank of every job paid it at start-up while the table imported it
eagerly.  Each check runs in a fresh interpreter, where nothing imported ml_dtypes before."""

import subprocess
import sys

import numpy as np
import pytest

from horovod.base import dtypes


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


@pytest.mark.parametrize("module", ["horovod.common.basics", "horovod.numpy", "horovod.torch"])
def test_importing_horovod_does_not_import_ml_dtypes(module):
    if module == "horovod.torch":
        pytest.importorskip("torch")
    assert _fresh(f"import sys, {module}; print('ml_dtypes' in sys.modules)") == "False"


def test_bfloat16_code_decoded_before_anyone_imported_ml_dtypes():
    pytest.importorskip("ml_dtypes")
    code = (
        "import sys\n"
        "from horovod.runtime.messages import Request, RequestType, decode_requests, encode_requests\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        "frame = encode_requests(0, None, [Request(int(RequestType.ALLREDUCE), 0, 'g', 10, (3, 5))], [])\n"
        "_, _, (req,), _, _ = decode_requests(frame, 1)\n"
        "print(req.nbytes(), 'ml_dtypes' in sys.modules)\n"
    )
    assert _fresh(code) == f"{3 * 5 * 2} True"  # bfloat16: two bytes each, its type loaded on demand


def test_torch_bfloat16_allreduce_in_a_fresh_process():
    pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    code = (
        "import torch, horovod.torch as hvd\n"
        "hvd.init()\n"
        "t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)\n"
        "r = hvd.allreduce(t, op=hvd.Sum)\n"
        "print(r.dtype, r.float().tolist())\n"
        "hvd.shutdown()\n"
    )
    assert _fresh(code) == "torch.bfloat16 [1.5, -2.25, 3.0]"


def test_dtype_codes_round_trip():
    for code in range(dtypes.DTYPE_COUNT):
        dt = dtypes.dtype_of(code)
        assert dtypes.dtype_code(dt) == code and dtypes.dtype_code(dt.name) == code
    if dtypes.HAS_BFLOAT16:
        assert dtypes.bfloat16().name == "bfloat16"
    with pytest.raises(ValueError, match="complex128 is not supported"):
        dtypes.dtype_code(np.complex128)
    with pytest.raises(ValueError, match="not supported on this rank"):
        dtypes.dtype_of(dtypes.DTYPE_COUNT)
