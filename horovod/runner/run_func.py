"""The launcher's side of ``horovod.run()``: the function goes into the job's store, results come back from it.

The worker's side is :mod:`horovod.runner.run_task`.  Both the static launcher and the elastic driver use
these, so the store keys are written once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FUNC_KEY", "RESULT_SCOPE", "func_payload", "worker_command", "decode_results"]

FUNC_KEY = "runfunc/func"
RESULT_SCOPE = "runfunc_result"
"""Each rank stores its pickled result under ``runfunc_result/<rank>``."""


def func_payload(run_func: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]) -> bytes:
    """``cloudpickle((func, args, kwargs))``: what :data:`FUNC_KEY` holds."""
    import cloudpickle

    return cloudpickle.dumps(run_func)


def worker_command(executable: str | None, addr: str | None = None, port: int | None = None) -> list[str]:
    """The command each worker runs; without ``addr``/``port`` the worker reaches the store its environment
    names (``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``: elastic workers, whose store address depends on their host)."""
    command = [executable or sys.executable, "-m", "horovod.runner.run_task"]
    return command if addr is None else [*command, addr, str(port)]


def decode_results(payloads: Sequence[bytes | None]) -> list[Any]:
    """The results in rank order.

    Raises:
        RuntimeError: a rank exited successfully without storing a result.
    """
    import cloudpickle

    results = []
    for rank, payload in enumerate(payloads):
        if payload is None:
            raise RuntimeError(f"Process {rank} exited successfully but did not return a result.")
        results.append(cloudpickle.loads(payload))
    return results
