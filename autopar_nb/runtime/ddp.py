"""Replicated data parallelism (ZeRO-0; ZeRO 1-3 are FSDP2, ``runtime/fsdp.py``): DDP, and FSDP2's
``replicate`` for parameters that tensor parallelism made DTensors (DDP does not take them)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from .ep import expert_modules, expert_parameters
from .tp import select


def apply_ddp(model: nn.Module, dp_group, *, device: str) -> nn.Module:
    """Wrap ``model`` in DDP over ``dp_group``; returns the wrapper (parameter names gain a
    ``module.`` prefix)."""
    return DDP(model, process_group=dp_group,
               device_ids=[torch.cuda.current_device()] if device == "cuda" else None)


def replicate_experts(model: nn.Module, experts_mesh, *, dp: int) -> None:
    """Expert parallelism beside DDP, before DDP wraps ``model``: each experts module
    :func:`apply_ep` split gets FSDP2's ``replicate`` over ``experts_mesh``
    (``expert_mesh(...)["dp_mod_ep"]``: the ranks that hold the same experts), which averages its
    gradients there, divided by the whole data-parallel size ``dp`` as DDP divides the others (the
    all-to-all already summed the tokens of the ep group); DDP is told to leave them alone
    (DTensors, other experts on each rank of an ep group)."""
    for module in expert_modules(model):
        replicate(module, mesh=experts_mesh)
        module.set_gradient_divide_factor(dp)  # (no force_sum_reduction: see shard_experts)
    DDP._set_params_and_buffers_to_ignore_for_model(model, list(expert_parameters(model)))


def apply_replicate(model: nn.Module, dp_mesh, *, units: list) -> None:
    """Data parallelism over TP-sharded parameters (Megatron's DDP + TP): FSDP2's ``replicate`` on
    every module matching ``units`` (as for FSDP: each its own gradient all-reduce, overlapping the
    rest of backward), then the root; parameters and optimizer states stay whole on every
    data-parallel rank."""
    for unit in units:
        paths = (select(model, unit) if isinstance(unit, str)
                 else [p for p in unit if p in dict(model.named_modules())])
        for path in paths:
            if any(True for _ in model.get_submodule(path).parameters()):
                replicate(model.get_submodule(path), mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
