"""Fused attention's speed by head dim, sequence and mask (cost/flash.py), from FlashAttention-2's published
benchmarks on the A100 and H100."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.capture import capture
from autopar_nb.cost import factors_for, profile
from autopar_nb.cost.flash import Attention, attention_efficiency, pass_rates
from autopar_nb.cost.time import layer_compute_time


def test_the_published_points_come_back():
    """At a published point the rate is the bar's label over the benchmarked card's peak: FlashAttention-2, Fig. 4
    (A100, forward + backward, causal, head dim 128, 2k: 155 TFLOP/s); FlashAttention-3, Fig. 5 (H100 forward, no
    mask, head dim 128, 4k: 368), with the backward what the forward + backward figure (326) leaves."""
    assert pass_rates("a100", 128, 2048, True) == pytest.approx((155 / 312, 155 / 312))
    fwd, bwd = pass_rates("h100", 128, 4096, False)
    assert fwd == pytest.approx(368 / 989.4)
    assert 1 / fwd + 2.5 / bwd == pytest.approx(3.5 / (326 / 989.4))


def test_rates_are_interpolated_and_held_at_the_ends():
    """Linear in log2 of the sequence and the head dim between the published points; held outside them."""
    assert pass_rates("h100", 64, 256, True) == pass_rates("h100", 64, 512, True)
    assert pass_rates("h100", 64, 65536, True) == pass_rates("h100", 64, 16384, True)
    assert pass_rates("a100", 64 * math.sqrt(2), 2048, False)[0] == pytest.approx(
        (pass_rates("a100", 64, 2048, False)[0] + pass_rates("a100", 128, 2048, False)[0]) / 2, rel=0.01)
    mid = pass_rates("a100", 128, 2048 * math.sqrt(2), True)[0]
    assert mid == pytest.approx((155 + 173) / 2 / 312)


def test_a_causal_op_does_half_the_work_of_its_count():
    """The capture counts a causal op's FLOPs unhalved (as torch does); the kernel skips the masked half, so its
    efficiency on that count is twice its rate. Short sequences run slower than long ones; a device without figures
    gets None (the constant eff_attention)."""
    causal, full = Attention(128, 2048, True, 1e12), Attention(128, 2048, False, 1e12)
    (cf, _), (ff, _) = (attention_efficiency((a,), seq_ratio=1.0, device="a100-80gb") for a in (causal, full))
    assert cf == pytest.approx(2 * 155 / 312) and ff == pytest.approx(187 / 312)
    short = attention_efficiency((causal,), seq_ratio=0.25, device="h100-80gb")
    long = attention_efficiency((causal,), seq_ratio=4.0, device="h100-80gb")
    assert short[0] < long[0] and short[1] < long[1]
    assert attention_efficiency((causal,), seq_ratio=1.0, device="l4") is None


class _Bidirectional(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 128, 3, 2, 32).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_the_capture_records_each_attention_shape_and_mask():
    """The zoo's LLaMA calls SDPA with is_causal=True, an encoder without: each layer's profile holds the head dim,
    the keys' length and the mask of its attention."""
    cfg = zoo.LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=256)
    with torch.device("meta"):
        llama = zoo.Llama(cfg)
    graph = capture(llama, (torch.zeros(2, 96, dtype=torch.long, device="meta"),))
    atts = [a for lp in profile(graph).layers for a in lp.attentions]
    assert len(atts) == 2 and all(a.causal and a.head_dim == 64 and a.seq == 96 for a in atts)
    enc = capture(_Bidirectional(), (torch.zeros(2, 128, 64),))
    assert [n.causal for n in enc.nodes if n.op_class == "attention"] == [False]


def test_attention_time_follows_the_published_speed_by_sequence():
    """On an H100 a causal LLaMA layer's attention costs more per FLOP at 512 tokens than at 8k (FlashAttention-2's
    published speeds: 141 against 273 TFLOP/s forward + backward at head dim 64); a constant efficiency priced both
    alike."""
    cfg = zoo.LlamaConfig(vocab_size=256, dim=256, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=512)
    with torch.device("meta"):
        llama = zoo.Llama(cfg)
    lp = next(lp for lp in profile(capture(llama, (torch.zeros(1, 512, dtype=torch.long, device="meta"),)))
              .layers if lp.attentions)
    c = ap.Cluster.preset("h100-80gb")
    kw = dict(tp=1, sp=False, precision="autocast", device=c.device, factors=factors_for(c))
    none = dataclasses.replace(lp, flops_split=defaultdict(float, lp.flops_split, attention=0.0),
                               bwd_split=defaultdict(float, lp.bwd_split, attention=0.0))

    def per_flop(scale, quad_scale):  # the attention's seconds per (forward) FLOP at that sequence
        with_, without = (sum(layer_compute_time(x, scale=scale, quad_scale=quad_scale, **kw)[:2])
                          for x in (lp, none))
        return (with_ - without) / (lp.flops_split["attention"] * quad_scale)

    assert per_flop(1.0, 1.0) / per_flop(16.0, 256.0) == pytest.approx(273 / 141, rel=1e-6)
