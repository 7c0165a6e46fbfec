"""Collectives by an alpha-beta model per link level (Hockney; NCCL's ring and tree algorithms).

A collective over ``p`` ranks moving a tensor of ``n`` bytes (the full, unsharded size):

* all-reduce (ring): 2 (p - 1)/p * n / B  (reduce-scatter then all-gather; Patarasuk & Yuan 2009)
* all-gather, reduce-scatter (ring): (p - 1)/p * n / B
* all-to-all: (p - 1)/p * n / B
* send/recv: n / B

plus a latency term per ring step (2 (p - 1) for all-reduce, p - 1 otherwise) up to 8 ranks, and
2 log2 p steps beyond (NCCL switches to tree/hierarchical algorithms at scale). B is the per-GPU
bandwidth of the slowest link the group crosses, derated by ``Factors.eff_link``.

Over NCCL links (``LinkSpec.nccl``) the latency and bandwidth are NCCL's own tuning model's
(NVIDIA/nccl ``src/graph/tuning.cc``, at commit b6475625, the Ring algorithm), which NCCL uses to
pick a protocol per call: for each of LL, LL128 and Simple a base latency, a latency per hop (step)
by link kind, and the fraction of the bus bandwidth the protocol carries (LL sends 4 bytes of data
in 8 with a flag, and NCCL counts 1/4 of the bus bandwidth for all-reduce, 1/3 for others; LL128 120
bytes in 128: 0.92; Simple all of it). The time is the fastest protocol's, so a small message costs
the LL latency (8 ranks on NVLink: 6.6 + 14 x 0.6 = 15 us; nccl-tests measured 12.5 us for an 8-byte
all-reduce on 8 NVLink H20s, deepseek-ai/DeepEP#303) and a large one approaches the bus bandwidth (8
H100s: 357 GB/s bus bandwidth at 1 GiB, where NCCL's maintainer gives ~370 GB/s for the ring on
NVLink 4's 450, NVIDIA/nccl-tests#212).

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
    volume, steps = _ring(kind, size)
    if link.nccl in NCCL_HOP_US:
        return nccl_time(kind, volume * nbytes, steps, link.nccl, bw)
    return volume * nbytes / bw + steps * link.latency


NCCL_BASE_US = (6.6, 14.0, 8.4)
"""NCCL's base latency of a Ring collective, us, for its LL, LL128 and Simple protocols"""
NCCL_HOP_US = {"nvlink": (0.6, 1.9, 3.4), "pci": (1.0, 2.5, 5.7), "net": (2.7, 4.0, 14.0)}
"""NCCL's latency per ring step, us, by link kind and protocol (LL, LL128, Simple)"""
NCCL_LL128_BW = 0.92
"""the fraction of the bus bandwidth LL128 carries (120 data bytes in 128)"""


def nccl_time(kind: str, wire_bytes: float, steps: int, hw: str, bw: float) -> float:
    """Seconds for a collective moving ``wire_bytes`` per rank in ``steps`` ring steps over an NCCL
    link of kind ``hw`` at bus bandwidth ``bw``: NCCL's tuning model, the fastest protocol."""
    ll = 1 / 4 if kind == "all_reduce" or hw == "net" else 1 / 3
    protocols = zip(NCCL_BASE_US, NCCL_HOP_US[hw], (ll, NCCL_LL128_BW, 1.0), strict=True)
    return min((base + steps * hop) * 1e-6 + wire_bytes / (bw * frac)
               for base, hop, frac in protocols)


def _ring(kind: str, p: int) -> tuple[float, int]:
    """(bytes on the wire per byte of the tensor, latency steps) of ``kind`` over ``p`` ranks."""
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
    return volume, steps
