"""``hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)``: upstream's delta optimizer.

Adasum combines what each rank's optimizer would *do*, not its gradients: every rank applies its own
optimizer (its own state: momentum, Adam moments) to its local gradients, and the steps' deltas are
Adasum-reduced (``horovod.base.adasum``), so ranks that move the same way average and ranks that move
orthogonally add up.  ``step()``::

    start = p;  optimizer.step();  delta = p - start;  grouped allreduce(deltas, op=Adasum);  p = start + delta

Upstream stepped each parameter alone from its gradient hook (the wrapped optimizer's ``step`` with the
parameter groups narrowed to it) to start its allreduce during the backward pass.  Here one ``step`` over all
parameters gives the same deltas for the optimizers whose update of a parameter depends on that parameter's
gradient and state alone (SGD, Adam, RMSprop ...) without rewriting the parameter groups under the optimizer
(which optimizers that cache their groups, or step several parameters jointly, do not expect); the deltas
travel as one grouped allreduce per dtype.  On this project's 2-core hosts the overlap measured nothing
(both versions within noise on a 164-tensor model).  The hooks only count backward passes (upstream's error
on too many).
As upstream, ``synchronize()`` does nothing and ``skip_synchronize()`` is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from horovod.common.basics import Adasum
from horovod.torch.mpi_ops import grouped_allreduce_async_, synchronize
from horovod.torch.optimizer import _DistributedOptimizer

__all__ = ["_DistributedAdasumOptimizer"]


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """See the module docstring; the wrapping (class, attributes, names) is :class:`_DistributedOptimizer`'s."""

    def _register_hooks(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        super()._register_hooks(params)
        if not hasattr(self, "_starts"):
            self._starts: dict[torch.Tensor, torch.Tensor] = {}
        for p in params:
            if p.requires_grad:
                self._starts[p] = torch.zeros_like(p, requires_grad=False)

    def _make_buckets(self, params: list[torch.Tensor]) -> None:
        """No gradient buckets: the deltas are reduced in ``step()``, not the gradients."""

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                 "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1

    def synchronize(self) -> None:
        """Nothing to do: the deltas are reduced and applied in ``step()`` (upstream's Adasum optimizer)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure=None):
        """The wrapped optimizer's step, then every parameter set to its start plus the Adasum of the deltas."""
        loss = closure() if closure is not None else None
        if not self._active:
            self._optimizer.step()
            return loss
        if self._frozen:  # unfrozen since they were registered: their deltas are reduced from this step on
            self._adopt_unfrozen()
        params = self._requires_update
        starts = [self._starts[p] for p in params]
        try:
            with torch.no_grad():
                torch._foreach_copy_(starts, params)
                self._optimizer.step()
                torch._foreach_sub_(params, starts)  # each parameter now holds its delta
                compressed = [self._compression.compress(p.data) for p in params]
                by_dtype: dict[torch.dtype, list[int]] = {}
                for i, (tensor, _) in enumerate(compressed):
                    by_dtype.setdefault(tensor.dtype, []).append(i)
                handles = [(idx, grouped_allreduce_async_([compressed[i][0] for i in idx], op=Adasum,
                                                          name=f"adasum.delta.{str(dtype).split('.')[-1]}",
                                                          process_set=self.process_set))
                           for dtype, idx in by_dtype.items()]
                for idx, handle in handles:
                    for i, reduced in zip(idx, synchronize(handle)):
                        delta = self._compression.decompress(reduced, compressed[i][1])
                        starts[i].add_(delta.to(starts[i].dtype))
                torch._foreach_copy_(params, starts)
        finally:
            self._reset_counters()
        return loss

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, op=Adasum)"
