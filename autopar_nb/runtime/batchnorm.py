"""BatchNorm under data parallelism: SyncBatchNorm so batch statistics span every data-parallel rank."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed import ProcessGroup


def apply_sync_batchnorm(model: nn.Module, dp_group: ProcessGroup | None) -> nn.Module:
    """Replace every ``BatchNorm*d`` with :class:`nn.SyncBatchNorm` over ``dp_group`` (returns the new root)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=dp_group)
