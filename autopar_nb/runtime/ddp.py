"""Replicated data parallelism: DDP (ZeRO-0; ZeRO-1 adds a sharded optimizer, see ``optim.build_optimizer``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, dp_group, *, device: str) -> nn.Module:
    """Wrap ``model`` in DDP over ``dp_group``; returns the wrapper (parameter names gain a ``module.`` prefix)."""
    return DDP(model, process_group=dp_group, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
