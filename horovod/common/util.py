"""Upstream's ``horovod.common.util``: helpers that user code and upstream's test files import.

Upstream probes its compiled extensions (``horovod/torch/mpi_lib*.so`` ...) in a forked process.  We have no
compiled extensions: an "extension" is the framework adapter ``horovod.<name>``, available when it and its
framework can be imported here (what ``horovodrun --check-build`` reports), and the ``*_built`` probes
answer what this package supports whatever the framework.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from horovod.base.exceptions import HorovodVersionMismatchError

__all__ = [
    "EXTENSIONS", "get_ext_suffix", "get_extension_full_path", "check_extension", "extension_available",
    "gpu_available", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "env",
    "get_average_backwards_compatibility_fun", "num_rank_is_power_2", "split_list", "check_installed_version",
    "get_version_mismatch_message", "is_iterable", "is_version_greater_equal_than", "_cache",
]

logger = logging.getLogger(__name__)

EXTENSIONS = ["tensorflow", "torch", "mxnet"]

# How a framework reports a usable GPU, run in a child process so that asking does not import the framework
# (and claim a GPU) in the caller, as upstream's forked probe.
_GPU_PROBES = {
    "tensorflow": "import tensorflow as tf; print(bool(tf.config.list_physical_devices('GPU')))",
    "torch": "import torch; print(torch.cuda.is_available())",
}
_PROBE_TIMEOUT = 120.0


def _cache(f: Callable) -> Callable:
    """Memoise ``f`` by its positional and keyword arguments (upstream's helper)."""
    cache: dict = {}

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        key = (args, frozenset(kwargs.items()))
        if key not in cache:
            cache[key] = f(*args, **kwargs)
        return cache[key]
    return wrapper


def get_ext_suffix() -> str:
    """The file suffix of a compiled extension module on this Python (``.cpython-311-x86_64-linux-gnu.so``)."""
    return sysconfig.get_config_var("EXT_SUFFIX") or sysconfig.get_config_var("SO") or ".so"


def get_extension_full_path(pkg_path: str, *args: str) -> str:
    """Where upstream's build puts an extension: ``args`` are sub-directories and the module name."""
    if not args:
        raise ValueError("get_extension_full_path needs at least the extension's name")
    return os.path.join(os.path.dirname(pkg_path), *args[:-1], args[-1] + get_ext_suffix())


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Upstream raises ImportError when a compiled extension is missing; pure Python has none to miss."""


def _adapter_importable(ext_base_name: str) -> bool:
    try:
        return (importlib.util.find_spec(ext_base_name) is not None
                and importlib.util.find_spec(f"horovod.{ext_base_name}") is not None)
    except (ImportError, ValueError):
        return False


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ``horovod.<ext_base_name>`` can be used here: the adapter and its framework are installed."""
    if verbose:
        logger.info("Checking whether extension %s was built.", ext_base_name)
    found = _adapter_importable(ext_base_name)
    if verbose:
        logger.info("Extension %s %s built.", ext_base_name, "was" if found else "was NOT")
    return found


@_cache
def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework of ``horovod.<ext_base_name>`` sees a GPU, asked in a child process."""
    probe = _GPU_PROBES.get(ext_base_name)
    if probe is None or not _adapter_importable(ext_base_name):
        return False
    if verbose:
        logger.info("Checking whether extension %s was running with GPU.", ext_base_name)
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=_PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.debug("GPU probe for %s failed: %s", ext_base_name, e)
        return False
    found = out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == ["True"]
    if verbose:
        logger.info("Extension %s %s running with GPU.", ext_base_name, "was" if found else "was NOT")
    return found


def mpi_built(verbose: bool = False) -> bool:
    """Whether jobs can use MPI (mpi4py is installed); the same answer as ``hvd.mpi_built()``."""
    from horovod.common import basics

    return basics.mpi_built()


def gloo_built(verbose: bool = False) -> bool:
    """Always True: the built-in transport takes Gloo's place (``hvd.gloo_built()``)."""
    from horovod.common import basics

    return basics.gloo_built()


def nccl_built(verbose: bool = False) -> int:
    """0: no NCCL (upstream returns the NCCL version code when built with it)."""
    from horovod.common import basics

    return basics.nccl_built()


def ddl_built(verbose: bool = False) -> bool:
    from horovod.common import basics

    return basics.ddl_built()


def ccl_built(verbose: bool = False) -> bool:
    from horovod.common import basics

    return basics.ccl_built()


@contextlib.contextmanager
def env(**kwargs: str | None) -> Iterator[None]:
    """Set environment variables for the ``with`` block and restore the previous values after it.

    Arguments whose value is None are ignored (the variable is left as it is).
    """
    values = {k: v for k, v in kwargs.items() if v is not None}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, Any], Any]:
    """A function ``(op, average) -> op`` for ``reduce_ops`` (a module with ``Average`` and ``Sum``).

    ``op`` wins; ``average`` alone is deprecated and maps to Average/Sum; both given is a ValueError (the
    rules of ``hvd.handle_average_backwards_compatibility``, with ``reduce_ops``' constants).
    """
    def impl(op, average):
        from horovod.common import basics, ops

        resolved = ops.handle_average_backwards_compatibility(op, average)
        if op is not None:
            return op
        return reduce_ops.Average if resolved == basics.Average else reduce_ops.Sum
    return impl


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (upstream's Adasum precondition)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: Sequence, n: int) -> list:
    """``items`` in ``n`` consecutive chunks whose lengths differ by at most one (longer ones first)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    return (f"Framework {name} installed with version {installed_version} but found version {version}.\n"
            "             This can result in unexpected behavior including runtime errors.\n"
            "             Reinstall Horovod using `pip install --no-cache-dir` to build with the new version.")


def check_installed_version(name: str, version: str, exception: BaseException | None = None) -> None:
    """Compare ``version`` with the one recorded at build time in ``horovod/metadata.json``.

    Upstream writes that file when it compiles against a framework; a pure-Python install records none,
    so a missing or unreadable file means "nothing to compare" (as upstream's launcher-only builds).  A
    recorded version that differs warns, or raises HorovodVersionMismatchError from ``exception``.
    """
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metadata.json")
    try:
        with open(path) as f:
            installed = json.load(f).get(name)
    except (OSError, ValueError):
        return
    if installed != version:
        if exception is None:
            warnings.warn(get_version_mismatch_message(name, version, installed), stacklevel=2)
        else:
            raise HorovodVersionMismatchError(name, version, installed) from exception


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def _version_key(text: str) -> Any:
    try:
        from packaging import version
    except ImportError:  # packaging is not a dependency: compare the leading release numbers
        return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])
    return version.parse(text)


@_cache
def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """``ver >= target`` as versions; ``target`` must be ``major.minor.patch``; both must be strings."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError("This function only accepts string arguments. \n"
                         "Received:\n"
                         f"\t- ver (type {type(ver)}: {ver})"
                         f"\t- target (type {type(target)}: {target})")
    if len(target.split(".")) != 3:
        raise ValueError("We only accepts target version values in the form of: major.minor.patch. "
                         f"Received: {target}")
    return _version_key(ver) >= _version_key(target)
