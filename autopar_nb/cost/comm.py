"""Collectives by an alpha-beta model per link level (Hockney; NCCL's ring and tree algorithms).

A collective over ``p`` ranks moving a tensor of ``n`` bytes (the full, unsharded size):

* all-reduce (ring): 2 (p - 1)/p * n / B  (reduce-scatter then all-gather; Patarasuk & Yuan 2009)
* all-gather, reduce-scatter (ring): (p - 1)/p * n / B
* all-to-all: (p - 1)/p * n / B
* send/recv: n / B

plus a latency term: alpha per ring step (2 (p - 1) for all-reduce, p - 1 otherwise) up to 8 ranks,
and 2 log2 p steps beyond (NCCL switches to tree/hierarchical algorithms at scale). B is the per-GPU
bandwidth of the slowest link the group crosses, derated by ``Factors.eff_link``.

Mesh dims are ordered (pp, dp, tp), TP innermost: a group of ``size`` ranks at ``stride`` stays
inside a node when ``stride * size <= gpus_per_node``. A group that spans nodes with ``k`` of its
ranks on each node, on nodes with one network adapter per GPU, moves its traffic over ``k`` adapters
at once: NCCL builds one ring per adapter and splits each collective among them over NVLink
(NVIDIA/nccl#601: "4 NICs ... creates 4 rings, each using a different NIC"; "multi-NIC aggregation
works well when GPUs are connected through NVLink"); nccl-tests between two HGX H100 nodes reach 360
GB/s of bus bandwidth over 8 x 400 Gb/s adapters (NVIDIA/nccl#1277).
"""

from __future__ import annotations

import dataclasses
import math

from ..hardware import LinkSpec


def link_for(cluster, *, size: int, stride: int) -> LinkSpec:
    """The link a group of ``size`` ranks spaced ``stride`` apart in the rank order uses: the
    node's, or between nodes the adapters of the group's ranks on a node (one per GPU, unless the
    node shares one), at most the node's link, which the traffic crosses too."""
    per_node = cluster.gpus_per_node
    if size <= 1 or stride * size <= per_node:
        return cluster.intra_node
    inter = cluster.inter_node
    rails = 1 if inter.shared else max(1, min(size, per_node // stride))
    if rails == 1:
        return inter
    bandwidth = min(rails * inter.bandwidth, cluster.intra_node.bandwidth)
    return dataclasses.replace(inter, bandwidth=bandwidth, name=f"{inter.name} x {rails} adapters")


def collective_time(kind: str, nbytes: float, size: int, link: LinkSpec,
                    eff_link: float = 0.8) -> float:
    """Seconds for one collective of ``kind`` over ``size`` ranks moving ``nbytes`` (full tensor
    size)."""
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
