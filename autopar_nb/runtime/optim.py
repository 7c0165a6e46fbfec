"""The optimizer, its learning-rate schedule and gradient clipping, for sharded and replicated
parameters alike."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .fsdp import on_mesh_device

OPTIMIZER_CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def parameters_of(parts: list) -> list:
    """Every parameter of the model parts a rank holds, once each, in order. Two pipeline stages of
    one rank may hold the same tensor (a weight tied across stages: T5's shared embedding, read by
    the encoder's first stage and the decoder's), which an optimizer given it twice would step twice
    and a gradient norm would count twice."""
    return list({id(p): p for part in parts for p in part.parameters()}.values())


def build_optimizer(params: list, name: str, *, lr: float, weight_decay: float, betas,
                    fused: bool = False):
    """The plan's optimizer over ``params`` (SGD takes no betas; under ZeRO 1-3 FSDP's shards, so
    each data-parallel rank keeps the optimizer state of its share). ``fused``: Adam's fused kernel,
    for parameters offloaded to the host (on CPU tensors torch otherwise steps one parameter at a
    time, ~14x slower: 447M vs 32M parameters/s on one core)."""
    cls = OPTIMIZER_CLASSES[name]
    kwargs = {"lr": lr, "weight_decay": weight_decay} | ({} if name == "sgd"
                                                         else {"betas": tuple(betas)})
    if fused and name != "sgd":
        kwargs["fused"] = True
    # the multi-tensor (foreach) kernels, the CUDA default, take lists of one kind: plain tensors or
    # DTensors of one mesh (TP leaves norms plain, expert parallelism puts the experts on a mesh of
    # their own): a group per kind
    kinds: dict = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return cls([{"params": ps} for ps in kinds.values()] if len(kinds) > 1 else params, **kwargs)


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """The learning rate at ``step`` as a fraction of the peak: linear warm-up over ``warmup``
    steps, then constant or cosine decay to ``min_ratio`` at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_grad_norm(params: list, max_norm: float, *, pp_group=None, repeated=()) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most ``max_norm``; returns the norm before
    clipping.

    The norm covers every parameter of the model: DTensor gradients (TP/FSDP shards) are reduced
    over their mesh (one group per mesh: FSDP over TP-sharded and over replicated modules gives
    two), plain ones are local, and with pipelining each stage's squared norm is summed over
    ``pp_group``; ``repeated``: copies of a parameter another stage holds too (tied across stages),
    clipped but counted once."""
    skip = {id(p) for p in repeated}
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            key = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
             if p.grad is not None]
    total = torch.zeros((), device=local[0].device if local else "cuda" if torch.cuda.is_available()
                        else "cpu")
    for key, group in groups.items():
        counted = [p.grad for p in group if id(p) not in skip]
        if not counted:
            continue
        # one kind per group: torch may use foreach kernels
        norm = torch.nn.utils.get_total_norm(counted)
        total += ((on_mesh_device(norm).full_tensor() if key is not None
                   else norm).float().to(total.device) ** 2)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
