"""``horovodrun --check-build``: upstream's table, filled with what is importable here.

We have no compiled extensions, so "built" means: the framework (or mpi4py) can be found on this Python,
and our built-in transport (reported as Gloo, which it replaces) is always there.
"""

from __future__ import annotations

import importlib.util
import logging

__all__ = ["check_build"]

logger = logging.getLogger(__name__)


def _available(module: str, verbose: bool) -> bool:
    if verbose:
        logger.info("Checking whether extension %s was built.", module)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if verbose:
        logger.info("Extension %s was %sbuilt.", module, "" if found else "NOT ")
    return found


def check_build(verbose: bool = False) -> str:
    """The ``--check-build`` text (without print's final newline), in upstream's exact layout."""
    from horovod import __version__

    def mark(flag: bool) -> str:
        return "X" if flag else " "

    tensorflow = _available("tensorflow", verbose)
    torch = _available("torch", verbose)
    mxnet = _available("mxnet", verbose)
    mpi = _available("mpi4py", verbose)
    lines = [
        f"Horovod v{__version__}:",
        "",
        "Available Frameworks:",
        f"    [{mark(tensorflow)}] TensorFlow",
        f"    [{mark(torch)}] PyTorch",
        f"    [{mark(mxnet)}] MXNet",
        "",
        "Available Controllers:",
        f"    [{mark(mpi)}] MPI",
        "    [X] Gloo",
        "",
        "Available Tensor Operations:",
        "    [ ] NCCL",
        "    [ ] DDL",
        "    [ ] CCL",
        f"    [{mark(mpi)}] MPI",
        "    [X] Gloo    ",
    ]
    return ("\n" if verbose else "") + "\n".join(lines)
