"""Where tensors that do not live in host memory (CUDA, ...) meet the engine.

The engine works on host numpy buffers.  CPU tensors are handed over without a copy (``tensor.numpy()``).
Tensors on another device take one of two paths:

* a **device backend** (``set_device_backend``), e.g. an NCCL process group of ``torch.distributed`` or
  CuPy's NCCL binding, runs the collective on the device itself when ``backend.supports(...)`` says so;
* otherwise **host staging**: the tensor is copied to host memory, the engine runs the collective, and the
  result is copied back to the tensor's device (into the caller's tensor for in-place ops).

The seam is this module: ``mpi_ops`` asks :func:`device_backend_for` first and falls back to
:data:`staging`.  Both are replaceable objects, so tests mock them without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["HostStaging", "DeviceBackend", "staging", "set_device_backend", "device_backend_for", "on_host"]

log = logging.getLogger(__name__)


def on_host(tensor: torch.Tensor) -> bool:
    """True for tensors the engine can read directly (CPU memory)."""
    return tensor.device.type == "cpu"


class HostStaging:
    """Copy to host, run in the engine, copy back.  Synchronous copies keep the ordering obvious."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu").contiguous()

    def to_device(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A new tensor on ``like``'s device holding ``host``'s values (out-of-place results)."""
        return host.to(like.device)

    def copy_back(self, host: torch.Tensor, target: torch.Tensor) -> None:
        """Write ``host``'s values into the caller's device tensor (in-place results)."""
        with torch.no_grad():
            target.copy_(host)


class DeviceBackend(Protocol):
    """A collective library that works on device memory (NCCL).  ``kind`` is one of ``"allreduce"``,
    ``"allgather"``, ``"broadcast"``, ``"alltoall"``, ``"reducescatter"``."""

    def supports(self, kind: str, tensors: Sequence[torch.Tensor], process_set: Any) -> bool:
        """Whether this backend runs ``kind`` on these tensors; False sends them through host staging."""
        ...

    def submit(self, kind: str, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor] | None,
               **kwargs: Any) -> Any:
        """Start the collective; return an object with ``done() -> bool`` and ``wait() -> list`` (one result
        per tensor, torch tensors on the device; for alltoall ``(output, received_splits)``)."""
        ...


staging = HostStaging()
_backend: DeviceBackend | None = None


def set_device_backend(backend: DeviceBackend | None) -> DeviceBackend | None:
    """Install (or remove, with None) the device backend; returns the previous one."""
    global _backend
    previous, _backend = _backend, backend
    if backend is not None:
        log.info("horovod.torch: device tensors use %s", type(backend).__name__)
    return previous


def device_backend_for(kind: str, tensors: Sequence[torch.Tensor], process_set: Any) -> DeviceBackend | None:
    """The backend that runs this collective on the device, or None (host memory, or staging)."""
    if _backend is None or not tensors or any(on_host(t) for t in tensors):
        return None
    return _backend if _backend.supports(kind, tensors, process_set) else None
