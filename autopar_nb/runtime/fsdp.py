"""Sharded data parallelism with FSDP2 (``fully_shard``): ZeRO-2 keeps parameters gathered after
forward, ZeRO-3 reshards them (gathered again in backward)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from .ep import expert_modules
from .tp import select


def apply_fsdp(model: nn.Module, dp_mesh, *, units: list, reshard_after_forward: bool,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
               offload: bool = False) -> None:
    """``fully_shard`` every module matching ``units`` (``"layers.*"``: each block its own unit; a
    list of paths is one unit, as torchtitan groups ``[norm, output]``), then the root for the rest
    (tied parameters stay there).

    ``reshard_after_forward``: True for ZeRO-3, False for ZeRO-2; the root keeps its parameters
    after forward (they are needed first in backward anyway), as torchtitan does. A pipeline stage
    under a schedule that splits the backward needs False (``pp.keep_gathered`` sets it there).
    ``param_dtype``/``reduce_dtype``: mixed precision (None: the parameters' own dtype).
    ``offload``: every unit keeps its shards in host memory (:func:`offload_policy`)."""
    mp, op = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
              offload_policy(dp_mesh, offload))
    for unit in units:
        paths = (select(model, unit) if isinstance(unit, str)
                 else [p for p in unit if p in dict(model.named_modules())])
        modules = [model.get_submodule(p) for p in paths
                   if any(True for _ in model.get_submodule(p).parameters())]
        if isinstance(unit, str):
            for module in modules:
                # after TP's output hook, before the one FSDP adds
                if isinstance(module, nn.Embedding):
                    module.register_forward_hook(_own_storage)
                fully_shard(module, mesh=dp_mesh, mp_policy=mp, offload_policy=op,
                            reshard_after_forward=reshard_after_forward)
        elif modules:
            fully_shard(modules, mesh=dp_mesh, mp_policy=mp, offload_policy=op,
                        reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=op, reshard_after_forward=False)


def offload_policy(dp_mesh, offload: bool) -> OffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy`` where ``offload``: shards and optimizer states in host memory,
    copied in before each all-gather and out after each reduce-scatter, the step on the CPU. On CUDA
    pinned (the copies overlap compute), with the rank's share of the node's cores (torchrun gives
    each rank one thread: a one-core step); on a CPU mesh unpinned (pinning needs an accelerator)
    and nothing moves."""
    if not offload:
        return OffloadPolicy()
    cuda = dp_mesh.device_type == "cuda"
    if cuda:
        torch.set_num_threads(max(1,
                                  (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                              "1"))))
    return CPUOffloadPolicy(pin_memory=cuda)


def buffers_to(parts: list[nn.Module], device) -> None:
    """Move the modules' buffers (rotary tables, running statistics) to ``device``: with CPU offload
    the model stays on the host, where FSDP takes its parameters from, but the device's kernels read
    the buffers."""
    for part in parts:
        for module in part.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device.type != torch.device(device).type:
                    module._buffers[name] = buf.to(device)


def _own_storage(module, args, output):
    """A TP-split embedding hands over ``to_local()`` of its output, a view, and FSDP2 cannot hook
    the backward of a view that the model then changes in place (it warns on every rank): an
    embedding unit's output is copied (one activation of the embedding's width) before FSDP
    registers its hook."""
    return (output.clone() if isinstance(output, torch.Tensor) and output._base is not None
            else output)


def shard_experts(model: nn.Module, experts_mesh, *, dp: int, reshard_after_forward: bool,
                  param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                  offload: bool = False) -> None:
    """Expert parallelism beside FSDP, before :func:`apply_fsdp`: each experts module
    :func:`apply_ep` split becomes its own unit sharded over ``experts_mesh``
    (``expert_mesh(...)["dp_mod_ep"]``: the ranks that hold the same experts, torchtitan's
    ``dp_mod_ep``), so the units around it leave its parameters alone. Its gradients are divided by
    the whole data-parallel size ``dp`` like the others (the all-to-all already summed the tokens of
    its ep group). Other arguments as :func:`apply_fsdp`'s."""
    mp, op = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=reduce_dtype), offload_policy(experts_mesh, offload)
    for module in expert_modules(model):
        fully_shard(module, mesh=experts_mesh, mp_policy=mp, offload_policy=op,
                    reshard_after_forward=reshard_after_forward)
        module.set_gradient_divide_factor(dp)
        if experts_mesh.size() > 1 and experts_mesh.device_type == "cpu":
            # gloo has no PREMUL_SUM, the op a divide factor reduces with: sum, then divide (not at
            # world size 1, where FSDP2 copies the gradient divided and would then divide it again)
            module.set_force_sum_reduction_for_comms(True)


def on_mesh_device(dt):
    """``dt`` (a DTensor) with its local tensor on its mesh's device: CPU offload keeps FSDP's
    shards and gradients on the host, and a CUDA mesh's collectives (NCCL) reduce device tensors
    only."""
    if dt.to_local().device.type == dt.device_mesh.device_type:
        return dt
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(dt.to_local().to(dt.device_mesh.device_type), dt.device_mesh,
                              dt.placements)
