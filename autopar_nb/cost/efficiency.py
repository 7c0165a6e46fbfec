"""GEMM time by shape: tile and wave quantisation, and the memory bound of skinny GEMMs.

A GPU computes a GEMM's output in tiles, one thread block per tile, and runs the blocks in waves of
one per streaming multiprocessor (SM) (NVIDIA, *Matrix Multiplication Background User's Guide*,
DU-09799-001, 2023: ch. 2.1 "GPU implementation", ch. 2.3 "Typical tile dimensions in cuBLAS":
256x128 and 128x256 the most efficient, then 128x128, 256x64 / 64x256, 128x64 / 64x128, 64x64;
ch. 3.1 "Tile quantization": a dimension that is not a multiple of the tile computes the whole last
tile; ch. 3.2 "Wave quantization": a last wave with fewer tiles than SMs leaves the others idle).
The fraction of the SMs' work that is useful is

    utilisation = b m n / (waves x SMs x tile_m x tile_n),  waves = ceil(tiles / SMs),

taken at the tile of that list that wastes least (which leaves out the smaller tiles' own lower
efficiency: the guide gives no figure for it, so small GEMMs are if anything costed a little fast).
It tends to 1 as the tiles outnumber the SMs (a 16384 x 16384 x 16384 GEMM on 132 SMs: 0.99), so
for the large GEMMs the efficiency factors were measured on (``Factors.eff_matmul``) the time is
the constant efficiency's; a GEMM of few tiles (a small model, a skinny TP shard, a small
micro-batch) pays for the idle SMs. A GEMM whose arithmetic intensity is below the device's
FLOP:byte ratio is memory-bound (the guide's ch. 2 "Math and memory bounds"): it takes at least
the bytes of its operands and output over the HBM bandwidth.

Each GEMM's extra time over FLOPs / (peak x efficiency) is what :func:`gemm_penalty` returns; the
step-time model adds it to the layer's compute time (``cost/time.py``).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))
"""cuBLAS's thread-block tiles, most efficient first (the guide's ch. 2.3)"""

SMS = {"a100-40gb": 108, "a100-80gb": 108, "h100-80gb": 132, "h200": 132, "gh200": 132,
       "h100-nvl": 132, "h100-pcie": 114, "v100": 80, "t4": 40, "a10": 72, "l4": 58, "l40s": 142}
"""device preset -> streaming multiprocessors, from NVIDIA's architecture whitepapers: A100
(GA100) 108; H100 (GH100) SXM5 132, PCIe 114, and the H200, GH200 and H100 NVL the SXM5's 132;
V100 (GV100) 80; T4 (TU104) 40; A10 (GA102) 72; L4 (AD104) 58; L40S (AD102) 142. A device not
listed (the CPU, a preset without a published count) is costed without quantisation"""


class Gemm(NamedTuple):
    """One matrix multiply of a layer's forward at the captured batch: ``batch`` products of an
    (m x k) by a (k x n) matrix."""

    batch: int
    m: int
    n: int
    k: int
    weight: bool
    """a weight's (its right operand a parameter, shared by the batch: the tokens are its rows)"""
    split: str
    """the dimension tensor parallelism divides: "n" (colwise), "k" (rowwise), "batch" (heads of a
    split attention), "" (replicated)"""


def gemm_of(n, split: str) -> Gemm | None:
    """The :class:`Gemm` of matmul node ``n`` (its contraction length from its FLOPs, 2 m n k per
    product), or None when its output is no matrix."""
    out = n.out_shapes[0] if n.out_shapes else ()
    if len(out) < 2 or not n.flops:
        return None
    cols, elems = int(out[-1]), math.prod(int(s) for s in out)
    k = round(n.flops / (2 * elems))
    if k < 1 or elems == 0:
        return None
    if len(out) == 2 or _weight_rhs(n):
        return Gemm(1, elems // cols, cols, k, True, split)
    rows = int(out[-2])
    return Gemm(elems // (rows * cols), rows, cols, k, False, split)


def _weight_rhs(n) -> bool:
    """Whether ``n``'s right operand is 2-D (a Linear's weight: its rows are every token)."""
    ranks = [len(s) for s in n.in_shapes]
    return bool(n.params) or (len(ranks) >= 2 and ranks[1] == 2)


def utilisation(batch: int, m: int, n: int, sms: int) -> float:
    """Useful fraction of the SMs' tile work for ``batch`` outputs of m x n on ``sms`` SMs, at
    the least wasteful tile of :data:`TILES`."""
    best = 0.0
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / sms)
        best = max(best, batch * m * n / (waves * sms * tm * tn))
    return best


def gemm_seconds(batch: int, m: int, n: int, k: int, *, shared_rhs: bool, rate: float, hbm: float,
                 sms: int, itemsize: int) -> float:
    """Seconds of ``batch`` (m x k) @ (k x n) products: the FLOPs at ``rate`` (peak x efficiency)
    over the utilisation, at least the bytes moved (both operands, once when ``shared_rhs``, and
    the output) at ``hbm`` bytes/s."""
    flops = 2.0 * batch * m * n * k
    moved = itemsize * (batch * m * k + (1 if shared_rhs else batch) * k * n + batch * m * n)
    return max(flops / (rate * utilisation(batch, m, n, sms)), moved / hbm)


def _penalties(g: Gemm, *, rate: float, hbm: float, sms: int, itemsize: int
               ) -> tuple[float, float]:
    """(forward, backward) seconds ``g`` takes beyond its FLOPs at ``rate``: the forward product,
    and in backward its input's gradient (m x n by n x k) and its right operand's (k x m by m x n,
    summed over the batch for a weight)."""
    b, m, n, k, w = g.batch, g.m, g.n, g.k, g.weight
    ideal = 2.0 * b * m * n * k / rate
    kw = {"rate": rate, "hbm": hbm, "sms": sms, "itemsize": itemsize}
    fwd = gemm_seconds(b, m, n, k, shared_rhs=w, **kw)
    dx = gemm_seconds(b, m, k, n, shared_rhs=w, **kw)
    # a weight's gradient is one (k x n) product over every token; a batched operand's, one each
    dw = gemm_seconds(*((1, k, n, m * b) if w else (b, k, n, m)), shared_rhs=False, **kw)
    return fwd - ideal, dx + dw - 2 * ideal


def at_micro_batch(g: Gemm, scale: float, tp: int) -> Gemm:
    """``g`` as a micro-batch ``scale`` x the captured batch runs it on one of ``tp`` ranks."""
    rows, batch = (max(1, round(g.m * scale)), g.batch) if g.weight else (
        g.m, max(1, round(g.batch * scale)))
    div = {g.split: tp} if tp > 1 else {}
    return Gemm(max(1, batch // div.get("batch", 1)), rows, max(1, g.n // div.get("n", 1)),
                max(1, g.k // div.get("k", 1)), g.weight, g.split)


@lru_cache(maxsize=65536)
def gemm_penalty(gemms: tuple[Gemm, ...], *, scale: float, tp: int, device: str, rate: float,
                 hbm: float, itemsize: int) -> tuple[float, float]:
    """(forward, backward) seconds a layer's GEMMs take beyond their FLOPs at ``rate`` (FLOP/s:
    peak x ``Factors.efficiency``), at a micro-batch ``scale`` x the captured one on one of ``tp``
    ranks of ``device`` (a preset name: its :data:`SMS`; 0 for one not listed). ``hbm``: the
    achieved HBM bandwidth; ``itemsize``: bytes per element the GEMMs read and write."""
    sms = SMS.get(device, 0)
    if not sms or not gemms:
        return 0.0, 0.0
    fwd = bwd = 0.0
    for g in gemms:
        f, b = _penalties(at_micro_batch(g, scale, tp), rate=rate, hbm=hbm, sms=sms,
                          itemsize=itemsize)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd
