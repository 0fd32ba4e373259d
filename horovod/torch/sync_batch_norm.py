"""``SyncBatchNorm``: batch normalization with statistics over the whole (global) batch, on CPU or GPU.

Training-mode statistics come from two differentiable Sum-allreduces over the process set — first
``(count, sum)`` for the mean, then the sum of squared deviations for the variance (two passes: no
cancellation in ``E[x²] - E[x]²``).  Their gradient is again a Sum-allreduce, which is what BatchNorm over
the global batch needs: with ``DistributedOptimizer`` averaging the parameter gradients, training equals
single-process BatchNorm on the concatenated batch.  Members may have different local batch sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from horovod.common import basics
from horovod.common.basics import Sum
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.torch.mpi_ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Applies synchronous version of N-dimensional BatchNorm.

    In this version, normalization parameters are synchronized across workers during forward pass.
    This is very useful in situations where each GPU can fit a very small number of examples.

    See https://pytorch.org/docs/stable/nn.html#batchnorm2d for more details about BatchNorm.

    Arguments:
        num_features: number of channels `C` from the shape `(N, C, ...)`
        eps: a value added to the denominator for numerical stability. Default: 1e-5
        momentum: the value used for the running_mean and running_var
            computation. Can be set to `None` for cumulative moving average
            (i.e. simple average). Default: 0.1
        affine: a boolean value that when set to `True`, this module has
            learnable affine parameters. Default: `True`
        track_running_stats: a boolean value that when set to `True`, this
            module tracks the running mean and variance, and when set to `False`,
            this module does not track such statistics and always uses batch
            statistics in both training and eval modes. Default: `True`
        process_set: the ranks whose batches form the global batch (ours; default all).

    .. note:: Only the training pass communicates; ``eval()`` with running statistics is local.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked) if self.training and self.track_running_stats else 0.0
        else:
            factor = self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if use_batch_stats and not basics.is_initialized():  # not this process's statistics without a word
            raise ValueError(basics.NOT_INITIALIZED)
        if not use_batch_stats or (self.process_set.size() or 1) == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return self._sync_forward(input, factor)

    def _sync_forward(self, input: torch.Tensor, factor: float) -> torch.Tensor:
        x = input if input.dtype == torch.float64 else input.float()  # half types: statistics in float32
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = allreduce(torch.cat([count, x.sum(dims)]), op=Sum, name=None, process_set=self.process_set)
        n = stats[0].detach()
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = stats[1:] / n
        centered = x - mean.view(shape)
        var = allreduce((centered * centered).sum(dims), op=Sum, process_set=self.process_set) / n
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var.detach() * (n / (n - 1).clamp(min=1.0))  # no .item(): no graph break
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
