"""BatchNorm under data parallelism: batch statistics over every data-parallel rank.

On GPUs this is PyTorch's :class:`nn.SyncBatchNorm`. PyTorch has no CPU kernel for it, so on CPU
(gloo) the plan's ``sync_batchnorm`` runs with :class:`CPUSyncBatchNorm`, written by hand here
because nothing in PyTorch covers it: it sums each channel's sum, sum of squares and count over the
group with torch's own differentiable collective
``torch.distributed._functional_collectives.all_reduce`` (whose backward all-reduces the gradients,
so the statistics' gradients reach every rank's inputs as with ``nn.SyncBatchNorm``), then
normalises like ``nn.BatchNorm``. The exported script embeds this class's source (it never imports
autopar_nb).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed import ProcessGroup


class CPUSyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``nn.SyncBatchNorm`` for CPU: training statistics over ``process_group`` (see the module
    docstring; the exported script holds this class's source, so it names torch's modules in full
    and ``funcol`` only)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {x.dim()}D")

    def forward(self, x):
        if not self.training and self.track_running_stats:
            return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var,
                                                  self.weight, self.bias, False, 0.0, self.eps)
        xf, c = x.float(), x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = xf.new_full((1,), x.numel() // c)
        # functional all_reduce has autograd (torch.distributed.nn.functional's is deprecated: a
        # FutureWarning)
        stats = funcol.all_reduce(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]), "sum",
                                  self.process_group or torch.distributed.group.WORLD)
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean  # biased, as BatchNorm normalises
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (self.momentum if self.momentum is not None
                     else 1.0 / float(self.num_batches_tracked))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), m)
                # unbiased, as BatchNorm
                self.running_var.lerp_((var * n / (n - 1)).to(self.running_var.dtype), m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @classmethod
    def convert(cls, module, process_group=None):
        """Replace every ``BatchNorm*d`` under ``module`` (keeping its parameters and buffers);
        returns the root."""
        out = module
        if (isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, cls)):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert(child, process_group))
        return out


def apply_sync_batchnorm(model: nn.Module, dp_group: ProcessGroup | None, *,
                         device: str | torch.device = "cuda") -> nn.Module:
    """Replace every ``BatchNorm*d`` with :class:`nn.SyncBatchNorm` over ``dp_group``
    (:class:`CPUSyncBatchNorm` when ``device`` is the CPU); returns the new root."""
    if torch.device(device).type == "cpu":
        return CPUSyncBatchNorm.convert(model, process_group=dp_group)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=dp_group)
