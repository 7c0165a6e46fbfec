"""Test models whose attention TP can shard the Megatron way: q, k and v from separate Linears.

Megatron-LM's fused QKV weight is laid out per head ([q_h, k_h, v_h] for each head), so a contiguous row shard holds
whole heads; nanoGPT's ``c_attn(x).split(C, dim=2)`` (zoo GPT) is laid out [q | k | v], which a plain
``ColwiseParallel`` shard would mix: the planner splits it part by part instead (``LayerPlan.tp_parts``). The cost
tests that reproduce Megatron's numbers use this equivalent (same FLOPs, same saved activations) layout, and
``test_cost_time`` checks that the fused one costs the same.
"""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from autopar_nb import zoo


class SplitQKVAttention(nn.Module):
    """zoo GPT's attention with separate q/k/v projections."""

    def __init__(self, cfg: zoo.GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias) for _ in range(3))
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def megatron_gpt(cfg: zoo.GPTConfig) -> zoo.GPT:
    """zoo GPT with :class:`SplitQKVAttention` in every block (build it under ``torch.device("meta")`` if large)."""
    model = zoo.GPT(cfg)
    for block in model.h:
        block.attn = SplitQKVAttention(cfg)
    return model
