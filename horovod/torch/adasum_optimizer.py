"""``hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)``: upstream's delta optimizer.

Adasum combines what each rank's optimizer would *do*, not its gradients: every rank applies its own
optimizer (its own state: momentum, Adam moments) to its local gradient, and the steps' deltas are
Adasum-reduced (``horovod.base.adasum``), so ranks that move the same way average and ranks that move
orthogonally add up.  Per parameter, as soon as its gradient is complete (the post-accumulate hook)::

    start = p;  optimizer.step() on p alone;  delta = p - start;  allreduce_(delta, op=Adasum)

and ``step()`` sets ``p = start + reduced delta``.  As upstream, ``synchronize()`` does nothing and
``skip_synchronize()`` is refused.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch

from horovod.torch.mpi_ops import allreduce_async_, synchronize
from horovod.torch.optimizer import _DistributedOptimizer, _make_hook

__all__ = ["_DistributedAdasumOptimizer"]

_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """See the module docstring; the wrapping (class, attributes, names) is :class:`_DistributedOptimizer`'s."""

    def _register_hooks(self, params: Iterable[torch.Tensor]) -> None:
        if not hasattr(self, "_starts"):
            self._starts: dict[torch.Tensor, torch.Tensor] = {}
            self._handles: dict[torch.Tensor, tuple[object, object]] = {}
        me = weakref.ref(self)
        for p in params:
            if not p.requires_grad:
                continue
            self._requires_update.append(p)
            self._delay[p] = self.backward_passes_per_step
            self._starts[p] = torch.zeros_like(p, requires_grad=False)
            if p not in self._parameter_names:
                self._parameter_names[p] = f"param.extra.{len(self._parameter_names)}"
            if self._active:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(me)))

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p in self._handles:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._handles[p] = self._launch_delta(p)

    def _launch_delta(self, p: torch.Tensor) -> tuple[object, object]:
        """The wrapped optimizer's step on ``p`` alone, its delta left in ``p`` and reduced in place."""
        start = self._starts[p]
        stashed = [group["params"] for group in self._optimizer.param_groups]
        for group in self._optimizer.param_groups:
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
                self._optimizer.step()
                p.sub_(start)
        finally:
            for group, params in zip(self._optimizer.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names[p], op=self.op,
                                  process_set=self.process_set)
        return handle, ctx

    def synchronize(self) -> None:
        """Nothing to do: the deltas are applied in ``step()`` (upstream's Adasum optimizer)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure=None):
        """Step every parameter not stepped yet, then set each to its start plus the Adasum of the deltas."""
        loss = closure() if closure is not None else None
        if not self._active:
            self._optimizer.step()
            return loss
        for p in self._requires_update:
            if p not in self._handles:
                self._handles[p] = self._launch_delta(p)
        try:
            with torch.no_grad():
                for p, (handle, ctx) in self._handles.items():
                    delta = self._compression.decompress(synchronize(handle), ctx)
                    start = self._starts[p]
                    start.add_(delta.to(start.dtype))
                    p.copy_(start)
        finally:
            self._handles.clear()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def _reset_counters(self) -> None:
        self._handles.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, op=Adasum)"
