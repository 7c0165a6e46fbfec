"""Activation checkpointing (recompute) per layer with PyTorch's checkpoint wrapper.

``full`` keeps only each layer's input and recomputes the rest in backward; ``selective`` is
torchtitan's op-level policy (``parallelize_llama``'s ``_save_list``): it keeps the outputs of
attention kernels, batched and grouped matmuls and convolutions, and of every other weight matmul
(the first, third, ... ``mm``/``addmm`` of the layer's forward), and recomputes the rest: the
element-wise ops and the other half of the weight matmuls.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .tp import select

# ops whose outputs selective recompute always keeps (recomputing them would cost as much as the
# forward)
SAVE_OPS = {torch.ops.aten.bmm.default,
            torch.ops.aten.convolution.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._grouped_mm.default}  # the experts' matmuls of a mixture of experts


SAVE_CUSTOM = frozenset({"transformers::grouped_mm_fallback", "autopar_zoo::grouped_linear"})
"""custom ops (by name: no import of their libraries) that are grouped matmuls over experts, kept
like SAVE_OPS"""


ALTERNATE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
"""weight matmuls: selective recompute keeps the output of every other one, counted in the layer's
forward order"""


def _save_matmuls(counts: dict[bool, int], ctx, op, *args, **kwargs):
    """Selective-recompute policy: keep attention/conv/batched-matmul outputs and those of the
    odd-numbered weight matmuls; recompute everything else. ``counts``: the weight matmuls so far,
    in the forward and in its recompute (counted apart so that both pick the same ones)."""
    if op in ALTERNATE_OPS:
        counts[ctx.is_recompute] += 1
        keep = counts[ctx.is_recompute] % 2 == 1
    else:
        keep = op in SAVE_OPS or (hasattr(op, "name") and op.name() in SAVE_CUSTOM)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The checkpoint's ``context_fn`` for selective recompute: fresh matmul counts for each call of
    the layer."""
    return create_selective_checkpoint_contexts(functools.partial(_save_matmuls,
                                                                  {False: 0, True: 0}))


def apply_ac(model: nn.Module, recompute: dict[str, str]) -> None:
    """Wrap the modules matching each pattern of ``recompute`` (``"layers.*"``: every block) in a
    checkpoint wrapper: ``"full"`` or ``"selective"``. A Hugging Face model's key/value cache must
    be off (:func:`.train.switch_off_kv_cache`, which the script calls first): a recomputed layer
    would append its keys and values to it a second time."""
    for pattern, mode in recompute.items():
        if mode not in ("full", "selective"):
            raise ValueError(f"recompute={mode!r} for {pattern!r}: choose 'selective' or 'full'")
        context = {} if mode == "full" else {"context_fn": selective_contexts}
        for path in select(model, pattern):
            parent, _, name = path.rpartition(".")
            module = model.get_submodule(path)
            model.get_submodule(parent).register_module(name,
                                                        checkpoint_wrapper(module,
                                                                           preserve_rng_state=False,
                                                                           **context))

