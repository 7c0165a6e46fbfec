"""Collectives by an alpha-beta model per link level (Hockney; NCCL's ring and tree algorithms).

A collective over ``p`` ranks moving a tensor of ``n`` bytes (the full, unsharded size):

* all-reduce (ring): 2 (p - 1)/p * n / B  (reduce-scatter then all-gather; Patarasuk & Yuan 2009)
* all-gather, reduce-scatter (ring): (p - 1)/p * n / B
* all-to-all: (p - 1)/p * n / B
* send/recv: n / B

plus a latency term: alpha per ring step (2 (p - 1) for all-reduce, p - 1 otherwise) up to 8 ranks, and
2 log2 p steps beyond (NCCL switches to tree/hierarchical algorithms at scale). B is the per-GPU bandwidth of the
slowest link the group crosses, derated by ``Factors.eff_link``.

Mesh dims are ordered (pp, dp, tp), TP innermost: a group of ``size`` ranks at ``stride`` stays inside a node when
``stride * size <= gpus_per_node``.
"""

from __future__ import annotations

import math

from ..hardware import LinkSpec


def link_for(cluster, *, size: int, stride: int) -> LinkSpec:
    """The link a group of ``size`` ranks spaced ``stride`` apart in the rank order uses."""
    if size <= 1:
        return cluster.intra_node
    return cluster.intra_node if stride * size <= cluster.gpus_per_node else cluster.inter_node


def collective_time(kind: str, nbytes: float, size: int, link: LinkSpec, eff_link: float = 0.8) -> float:
    """Seconds for one collective of ``kind`` over ``size`` ranks moving ``nbytes`` (full tensor size)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bw = link.bandwidth * eff_link
    p = size
    if kind == "all_reduce":
        volume, steps = 2 * (p - 1) / p, 2 * (p - 1)
    elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
        volume, steps = (p - 1) / p, p - 1
    elif kind == "send_recv":
        volume, steps = 1.0, 1
    else:
        raise ValueError(f"unknown collective {kind!r}")
    if p > 8 and kind != "send_recv":
        steps = 2 * math.ceil(math.log2(p))
    return volume * nbytes / bw + steps * link.latency
