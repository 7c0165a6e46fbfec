"""Activation checkpointing (recompute) per layer with PyTorch's checkpoint wrapper.

``full`` keeps only each layer's input and recomputes the rest in backward; ``selective`` keeps the outputs of
matrix multiplies and attention (expensive to recompute) and recomputes the cheap element-wise ops between them.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# ops whose outputs selective recompute keeps (recomputing them would cost as much as the forward)
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def save_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective-recompute policy: keep matmul/conv/attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, *, recompute: dict[str, str]) -> None:
    """Wrap each module named in ``recompute`` (path -> ``"full"`` | ``"selective"``) in a checkpoint wrapper."""
    for path, mode in recompute.items():
        if mode == "none":
            continue
        if mode not in ("full", "selective"):
            raise ValueError(f"recompute={mode!r} for {path!r}: choose 'none', 'selective' or 'full'")
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        module = parent.get_submodule(name)
        if mode == "full":
            wrapped = checkpoint_wrapper(module, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(module, preserve_rng_state=False,
                                         context_fn=partial(create_selective_checkpoint_contexts, save_matmuls_policy))
        parent.register_module(name, wrapped)
