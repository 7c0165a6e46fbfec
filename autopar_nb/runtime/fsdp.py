"""Sharded data parallelism with FSDP2 (``fully_shard``): ZeRO-2 keeps parameters gathered after forward,
ZeRO-3 reshards them (gathered again in backward)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .tp import select


def apply_fsdp(model: nn.Module, dp_mesh, *, units: list, reshard_after_forward: bool,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> None:
    """``fully_shard`` every module matching ``units`` (``"layers.*"``: each block its own unit; a list of paths
    is one unit, as torchtitan groups ``[norm, output]``), then the root for the rest (tied parameters stay there).

    ``reshard_after_forward``: True for ZeRO-3, False for ZeRO-2; the root keeps its parameters after forward
    (they are needed first in backward anyway), as torchtitan does. ``param_dtype``/``reduce_dtype``: mixed
    precision (None: the parameters' own dtype)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        paths = select(model, unit) if isinstance(unit, str) else [p for p in unit if p in dict(model.named_modules())]
        modules = [model.get_submodule(p) for p in paths if any(True for _ in model.get_submodule(p).parameters())]
        if isinstance(unit, str):
            for module in modules:
                fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        elif modules:
            fully_shard(modules, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
