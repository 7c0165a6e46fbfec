"""Replicated data parallelism: DDP (ZeRO-0) and ZeRO-1 (optimizer states sharded with ZeroRedundancyOptimizer)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, dp_group: ProcessGroup, *, device: str) -> nn.Module:
    """Wrap ``model`` in DDP over ``dp_group`` (returns the wrapper; parameter names gain a ``module.`` prefix)."""
    device_ids = [torch.cuda.current_device()] if device == "cuda" else None
    return DDP(model, process_group=dp_group, device_ids=device_ids)


def zero1_optimizer(params, dp_group: ProcessGroup, optimizer_class: type, **optimizer_kwargs):
    """ZeRO-1: each data-parallel rank keeps the optimizer state of its share of the parameters only."""
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=dp_group,
                                   **optimizer_kwargs)
