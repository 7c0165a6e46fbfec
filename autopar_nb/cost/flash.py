"""Fused attention's speed by head dimension, sequence length and causality, from the published
benchmarks of FlashAttention-2, the kernel eager PyTorch's SDPA runs in 16 bits on A100 and H100.

The figures are the bars' labels, TFLOP/s, fp16, batch x sequence = 16k tokens, hidden 2048 (head
dim 64: 32 heads; 128: 16 heads), FLOPs counted 4 x seq^2 x head dim x heads forward, 2.5 x that
backward, both halved under a causal mask (Dao, *FlashAttention-2*, 2023, section 4.1):

* A100 80GB SXM4, forward + backward: Dao 2023, Fig. 4 (the repository's
  ``assets/flash2_a100_fwd_bwd_benchmark.png``, Dao-AILab/flash-attention at 0251105). Two labels
  hide behind the legend (head dim 128, no mask, 512 and 1k): read from the bars' heights against
  the labelled ones, 151 and 173 (the 1k label shows in part: "173").
* H100 80GB SXM5, forward + backward: the same repository's
  ``assets/flash2_h100_fwd_bwd_benchmark.png`` (FlashAttention-2's README, "H100").
* H100 80GB SXM5, forward: Shah et al., *FlashAttention-3*, 2024, Fig. 5 (the FlashAttention-2
  bars; the repository's ``assets/flash3_fp16_fwd.png``). Backward is what the forward + backward
  figure leaves: 2.5 / (3.5 / fwd_bwd - 1 / fwd) (head dim 128, no mask, 16k: 327 TFLOP/s). On
  the A100 no forward figure is used: both passes at the forward + backward rate.

Between the published points the rate is interpolated linearly in log2 of the sequence and of the
head dimension; outside them it is held at the nearest (a sequence under 512 or a head dim under 64
is if anything costed fast). A rate is a fraction of the benchmarked card's dense 16-bit peak (A100
312, H100 SXM5 989.4 TFLOP/s), applied to the peak of each device of its class
(:data:`DEVICE_CLASS`). The capture counts causal attention's FLOPs unhalved (as torch's counter
does), so a causal op's efficiency on that count is twice its rate on the kernel's.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
"""the sequence lengths of every published figure below"""

REF_PEAK = {"a100": 312e12, "h100": 989.4e12}
"""the benchmarked cards' dense fp16 peak, FLOP/s (NVIDIA's A100 and H100 SXM5 datasheets)"""

FWD_BWD = {
    # (class, head dim, causal) -> TFLOP/s at SEQS, forward + backward
    ("a100", 64, False): (132, 153, 162, 171, 175, 176),
    ("a100", 128, False): (151, 173, 187, 196, 201, 203),
    ("a100", 64, True): (88, 119, 140, 156, 165, 171),
    ("a100", 128, True): (99, 133, 155, 173, 182, 189),
    ("h100", 64, False): (215, 254, 274, 288, 294, 296),
    ("h100", 128, False): (248, 294, 320, 326, 335, 338),
    ("h100", 64, True): (141, 192, 232, 257, 273, 284),
    ("h100", 128, True): (163, 221, 265, 294, 308, 328),
}
"""FlashAttention-2 forward + backward (see the module docstring for each figure's source)"""

FWD = {
    ("h100", 64, False): (282, 306, 318, 321, 322, 324),
    ("h100", 128, False): (309, 350, 362, 368, 370, 370),
    ("h100", 64, True): (180, 229, 262, 284, 295, 299),
    ("h100", 128, True): (191, 260, 298, 319, 333, 335),
}
"""FlashAttention-2 forward on the H100 (FlashAttention-3, Fig. 5; its head dim 256 panels are not
used: no forward + backward figure beside them)"""

DEVICE_CLASS = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-80gb": "h100", "h200": "h100",
                "gh200": "h100", "h100-nvl": "h100", "h100-pcie": "h100"}
"""device preset -> the card whose figures it takes: the same SMs and tensor cores (the H200 and
GH200 are the H100 SXM5's compute; the NVL and PCIe cards its SMs at lower clocks, scaled by their
peak). A device not listed (the H20's cut compute, other generations, the CPU) keeps the constant
``Factors.eff_attention``"""


class Attention(NamedTuple):
    """One attention op of a layer's forward at the captured batch."""

    head_dim: int
    seq: int
    """the keys' length"""
    causal: bool
    flops: float
    """its forward FLOPs (unhalved when causal)"""


def attention_of(n) -> Attention | None:
    """The :class:`Attention` of SDPA node ``n`` (query, key, value of (..., seq, head dim))."""
    if len(n.in_shapes) < 2 or len(n.in_shapes[0]) < 2 or not n.flops:
        return None
    return Attention(int(n.in_shapes[0][-1]), int(n.in_shapes[1][-2]), bool(n.causal),
                     float(n.flops))


def _interp(points: tuple, x: float, xs: tuple) -> float:
    """``points`` at ``xs`` read at ``x``, linear in log2, held at the ends."""
    lx = math.log2(min(max(x, xs[0]), xs[-1]))
    for i in range(len(xs) - 1):
        lo, hi = math.log2(xs[i]), math.log2(xs[i + 1])
        if lx <= hi:
            w = (lx - lo) / (hi - lo)
            return points[i] * (1 - w) + points[i + 1] * w
    return points[-1]


def _rate(table: dict, cls: str, head_dim: int, seq: float, causal: bool) -> float:
    """TFLOP/s of ``table`` at (head dim, sequence), interpolated in both."""
    dims = (64, 128)
    at = [_interp(table[(cls, d, causal)], seq, SEQS) for d in dims]
    return _interp(tuple(at), head_dim, dims)


def pass_rates(cls: str, head_dim: int, seq: float, causal: bool) -> tuple[float, float]:
    """(forward, backward) fraction of the class's peak on the kernel's own FLOP count."""
    both = _rate(FWD_BWD, cls, head_dim, seq, causal)
    if (cls, 64, causal) not in FWD:
        return both / (REF_PEAK[cls] / 1e12), both / (REF_PEAK[cls] / 1e12)
    fwd = _rate(FWD, cls, head_dim, seq, causal)
    bwd = 2.5 / (3.5 / both - 1.0 / fwd)
    return fwd / (REF_PEAK[cls] / 1e12), bwd / (REF_PEAK[cls] / 1e12)


@lru_cache(maxsize=4096)
def attention_efficiency(ops: tuple[Attention, ...], *, seq_ratio: float, device: str
                         ) -> tuple[float, float] | None:
    """(forward, backward) fraction of ``device``'s 16-bit peak the layer's attention ops reach on
    the captured FLOP count (unhalved when causal), at ``seq_ratio`` x the captured sequence: the
    FLOP-weighted harmonic mean of each op's. None where the device has no published figure
    (:data:`DEVICE_CLASS`) or the layer no attention op."""
    cls = DEVICE_CLASS.get(device)
    total = sum(a.flops for a in ops)
    if cls is None or not total:
        return None
    fwd = bwd = 0.0
    for a in ops:
        f, b = pass_rates(cls, a.head_dim, a.seq * seq_ratio, a.causal)
        work = 0.5 if a.causal else 1.0  # the kernel skips the masked half of the scores
        fwd += a.flops * work / f
        bwd += a.flops * work / b
    return total / fwd, total / bwd
