"""Horovod's ``hvd.SyncBatchNorm``: batch normalization over the batch of every rank together (CPU and
CUDA). Two differentiable Sum allreduces per forward, in float64: per-channel sums and counts give
the global mean, then sums of squared deviations from it the variance (no ``E[x^2] - E[x]^2``
cancellation); ranks may hold different batch sizes. docs/compat.md has the details."""
import itertools

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from byteps import common

from .mpi_ops import Sum, allreduce, global_process_set

_instances = itertools.count()  # construction order, the same on every rank: the tensors' names


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that normalizes over every rank's batch.

    Args as torch's BatchNorm, plus ``process_set`` (Horovod's): the ranks whose batches are pooled.
    Every rank must construct its SyncBatchNorm modules in the same order (their tensors are named
    by it) and run them in the same order.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set
        self._bps_name = f"SyncBatchNorm.{next(_instances)}"

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _factor(self):
        """torch's BatchNorm momentum rule (None: a cumulative average)."""
        if not (self.training and self.track_running_stats):
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input):
        self._check_input_dim(input)
        members = self.process_set.size() if self.process_set is not None else common.size()
        if not self.training or members == 1 or not common.is_initialized():
            return super().forward(input)
        factor = self._factor()
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        # the per-channel statistics travel in float64 (C + 1 numbers): counts stay exact, sums precise
        count = torch.tensor([x.numel() // c], dtype=torch.float64)
        # pass 1: the global per-channel mean
        totals = allreduce(torch.cat([x.sum(dims).double(), count]), op=Sum, name=f"{self._bps_name}.sum",
                           process_set=self.process_set)
        n = totals[c].detach()
        mean = totals[:c] / n
        centred = x - mean.to(x.dtype).reshape(shape)
        # pass 2: the global per-channel sum of squared deviations from it
        ss = allreduce(centred.pow(2).sum(dims).double(), op=Sum, name=f"{self._bps_name}.var",
                       process_set=self.process_set)
        var = ss / n
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = ss / max(float(n) - 1, 1.0)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        out = centred * torch.rsqrt(var + self.eps).to(x.dtype).reshape(shape)
        if self.affine:
            out = out * self.weight.to(x.dtype).reshape(shape) + self.bias.to(x.dtype).reshape(shape)
        return out.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """Replace every ``torch.nn.BatchNorm*d`` in ``module`` by a SyncBatchNorm with its state."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight.copy_(module.weight)
                    out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
                out.num_batches_tracked.copy_(module.num_batches_tracked)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out


