"""``HorovodStrategy``: a Lightning 2.x ``Strategy`` for a process that already is one rank of a Horovod job.

Lightning dropped its own Horovod strategy in 2.0; this one is the smallest that keeps a ``LightningModule``'s
own ``configure_optimizers``, ``training_step``, ``self.log(..., sync_dist=True)``, callbacks and checkpoints:

* no launcher: every Horovod process runs its own ``Trainer`` (``hvd.init()`` was called by the caller);
* ``setup``: the optimizers Lightning made from ``configure_optimizers`` get learning rates x ``hvd.size()``
  (schedulers' ``base_lrs`` too, as upstream), rank 0's parameters and optimizer state are broadcast, and each
  optimizer is wrapped in ``hvd.DistributedOptimizer`` (``backward_passes_per_step`` = the Trainer's
  ``accumulate_grad_batches``) with its own synchronisation switched off: Lightning calls ``step(closure)`` and
  the closure runs the backward pass, so gradients are averaged in ``post_backward`` instead;
* ``reduce``/``all_gather``/``broadcast``/``barrier`` are Horovod's collectives.

Used by :mod:`horovod.spark.lightning.remote`; usable with any Horovod launcher (``horovodrun``).
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any

import torch

from horovod.spark.lightning.compat import pl as default_pl

__all__ = ["HorovodStrategy", "strategy_for"]


def _strategy_class(pl: ModuleType) -> type:
    """``HorovodStrategy`` built on ``pl``'s ``ParallelStrategy`` (one class per Lightning flavour, see
    :mod:`horovod.spark.lightning.compat`)."""

    class HorovodStrategy(pl.strategies.ParallelStrategy):
        """Lightning training as one rank of the Horovod job this process joined (see the module docstring)."""

        strategy_name = "horovod"

        def __init__(self, use_gpu: bool = True, **kwargs: Any) -> None:
            import horovod.torch as hvd

            if not hvd.is_initialized():
                hvd.init()
            cuda = use_gpu and torch.cuda.is_available()
            device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
            super().__init__(parallel_devices=[device], cluster_environment=None, **kwargs)
            self._device = device
            self._exit_stack: contextlib.ExitStack | None = None
            pl.utilities.rank_zero_only.rank = hvd.rank()

        @property
        def global_rank(self) -> int:
            import horovod.torch as hvd

            return hvd.rank()

        @property
        def local_rank(self) -> int:
            import horovod.torch as hvd

            return hvd.local_rank()

        @property
        def world_size(self) -> int:
            import horovod.torch as hvd

            return hvd.size()

        @property
        def root_device(self) -> torch.device:
            return self._device

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def model_to_device(self) -> None:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            assert self.model is not None
            self.model.to(self._device)

        def setup(self, trainer: Any) -> None:
            import horovod.torch as hvd

            super().setup(trainer)
            self._exit_stack = contextlib.ExitStack()
            if not trainer.training:
                return
            optimizers = [getattr(opt, "_optimizer", opt) for opt in self.optimizers]
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= self.world_size
            for config in self.lr_scheduler_configs:
                if hasattr(config.scheduler, "base_lrs"):
                    config.scheduler.base_lrs = [lr * self.world_size for lr in config.scheduler.base_lrs]
            assert self.lightning_module is not None
            hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
            for optimizer in optimizers:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            wrapped = []
            for optimizer in optimizers:
                mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
                named = [(n, p) for n, p in self.lightning_module.named_parameters() if id(p) in mine]
                distributed = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                       backward_passes_per_step=trainer.accumulate_grad_batches)
                self._exit_stack.enter_context(distributed.skip_synchronize())
                wrapped.append(distributed)
            self.optimizers = wrapped

        def post_backward(self, closure_loss: torch.Tensor) -> None:
            for optimizer in self.optimizers:
                optimizer.synchronize()

        def barrier(self, *args: Any, **kwargs: Any) -> None:
            import horovod.torch as hvd

            hvd.barrier()

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            import horovod.torch as hvd

            return hvd.broadcast_object(obj, root_rank=src)

        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            """Average (default), sum, max or min of ``tensor`` over the ranks; ``reduce_op`` a name or a
            ``torch.distributed.ReduceOp`` (Lightning's ``reduce_boolean_decision`` passes ``ReduceOp.SUM``);
            anything not a tensor is returned as is."""
            import horovod.torch as hvd

            if group is not None:
                raise ValueError("HorovodStrategy.reduce: process groups are not supported; leave group unset")
            if not isinstance(tensor, torch.Tensor):
                return tensor
            # By name: torch's ReduceOp members are enums whose value of SUM is 0, which a truth test took for
            # "unset" (the mean), so every all-ranks boolean decision came out False
            op = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
            ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
            if op not in ops:
                raise ValueError(f"HorovodStrategy.reduce: unsupported reduce_op {reduce_op!r} (mean, sum, max or min)")
            return hvd.allreduce(tensor, op=ops[op])

        def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
            """``tensor`` of every rank stacked along a new first dimension (Lightning's contract)."""
            import horovod.torch as hvd

            return hvd.allgather(tensor.reshape(1, *tensor.shape))

        def teardown(self) -> None:
            if self._exit_stack is not None:
                self._exit_stack.close()
                self._exit_stack = None
            super().teardown()

    return HorovodStrategy


HorovodStrategy = _strategy_class(default_pl)
HorovodStrategy.__qualname__ = "HorovodStrategy"
_BY_FLAVOUR: dict[str, type] = {default_pl.__name__: HorovodStrategy}


def strategy_for(pl: ModuleType) -> type:
    """The ``HorovodStrategy`` class for the Lightning package ``pl`` (a model's flavour: ``compat.flavour_of``)."""
    cls = _BY_FLAVOUR.get(pl.__name__)
    if cls is None:
        cls = _BY_FLAVOUR[pl.__name__] = _strategy_class(pl)
    return cls
