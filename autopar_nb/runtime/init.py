"""Initial weights of the parallel model equal to those of the single-process model built with the same seed.

Two ways:

* the model fits in host memory: build it for real on every rank with the same seed (identical weights), then
  shard it (TP/FSDP slice the local copy). Nothing to do here.
* it does not fit: build it on the meta device, apply the plan (shards are still meta), then :func:`materialize`:
  ``to_empty`` allocates only the local shards, and the weights are initialised module by module in construction
  order with the seed re-applied, each module's full weights existing only while its shard is copied out. The random
  stream is consumed exactly as the single-process constructor consumed it, so the values match.

Modules are initialised by their own ``reset_parameters()``; a Hugging Face model's ``_init_weights(module)`` when
the module has none (e.g. ``LlamaRMSNorm``); norm-like modules without either get weight 1 / bias 0.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter name without wrapper prefixes (checkpoint wrapper, torch.compile, DDP's ``module.``)."""
    for s in STRIP:
        name = name.replace(s, "")
    return name.removeprefix("module.")


def _init_module(full: nn.Module, root: nn.Module) -> None:
    if hasattr(full, "reset_parameters"):
        full.reset_parameters()
    elif hasattr(root, "_init_weights"):  # Hugging Face PreTrainedModel
        root._init_weights(full)
    elif any(k in type(full).__name__.lower() for k in ("norm", "scale")):
        for name, p in full.named_parameters(recurse=False):
            with torch.no_grad():
                p.fill_(1.0 if name == "weight" else 0.0)
    else:
        raise NotImplementedError(
            f"cannot initialise {type(full).__name__} on the meta path: it has no reset_parameters(); add one "
            "(initialising the module's own parameters), or build the model for real (it fits in host memory)")


@torch.no_grad()
def materialize(parts: list[nn.Module], skeleton: nn.Module, *, device: str | torch.device, seed: int) -> None:
    """Allocate and initialise the (sharded, meta) parameters of ``parts`` from ``skeleton``.

    ``parts``: the local model pieces after the plan was applied (one per pipeline stage held here, or the model);
    ``skeleton``: the unsharded model on the meta device, in the original module structure (its order is the
    construction order; its module paths name the parameters of ``parts``).
    """
    local: dict[str, torch.Tensor] = {}
    for part in parts:
        part.to_empty(device=device)
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            local[canonical_name(name)] = t
    torch.manual_seed(seed)
    for path, module in skeleton.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if not own:
            continue
        # a full-size, childless copy of this module alone, on the host: its init draws the same random numbers
        full = copy.copy(module)
        full._modules = {}
        full._parameters = {n: None if p is None else nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                            for n, p in module._parameters.items()}
        full._buffers = {n: None if b is None else torch.empty_like(b, device="cpu")
                         for n, b in module._buffers.items()}
        try:
            _init_module(full, skeleton)
        except NotImplementedError:
            if any(True for _ in module.parameters(recurse=False)):
                raise
            warnings.warn(f"{path}: buffers of {type(module).__name__} are left as allocated (no init method)",
                          stacklevel=2)
        for name, value in [*full.named_parameters(recurse=False), *full.named_buffers(recurse=False)]:
            target = local.get(f"{path}.{name}" if path else name)
            if target is None:  # held by another pipeline stage
                continue
            if isinstance(target, DTensor):
                shard = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)  # every rank computed the same full value
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(value)
