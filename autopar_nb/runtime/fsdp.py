"""Sharded data parallelism with FSDP2 (``fully_shard``): ZeRO-2 keeps parameters gathered after forward,
ZeRO-3 reshards them (gathered again in backward)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, units: list[str], reshard_after_forward: bool,
               param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """``fully_shard`` each module in ``units`` (e.g. every transformer block), then the root for the rest.

    ``reshard_after_forward``: True for ZeRO-3, False for ZeRO-2. The root keeps its parameters after forward
    (they are needed first in backward anyway), as torchtitan does.
    """
    # fp32 throughout: no policy (FSDP's default), as one would write it by hand
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype) \
        if (param_dtype, reduce_dtype) != (torch.float32, torch.float32) else MixedPrecisionPolicy()
    for path in units:
        fully_shard(model.get_submodule(path), mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    return model
