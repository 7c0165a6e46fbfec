"""Data parallelism's collectives in a step: the gradient all-reduce of DDP (ZeRO 0/1) or FSDP's reduce-scatters and
all-gathers (ZeRO 2/3), as many as the runtime issues, and the part of them the backward does not hide.

How many FSDP issues follows how it is driven. Gradient accumulation (``runtime/train.py``'s ``set_grad_sync``)
reduce-scatters every micro-batch. A pipeline stage (torch's ``PipelineStage``) runs every micro-batch's backward
without gradient sync or resharding and reduce-scatters once, after its last backward (``perform_reduce_grad``):
nothing is left to hide that one behind. Its ZeRO-3 units are gathered by a forward, resharded after it, and
gathered again by the next backward, which leaves them gathered for a forward that follows (``unshard`` of a
gathered group does nothing): one all-gather per micro-batch and one more for the first forward.
"""

from __future__ import annotations

from ..plan import ITEMSIZE
from .comm import collective_time, link_for
from .setting import Setting
from .terms import CommTime, RankSums


def data_parallel_comm(s: Setting, sums: RankSums, bottleneck: int, comm: CommTime, *, cluster, factors) -> float:
    """The data-parallel collectives of a step over the dp * cp ranks that hold the same parameters, overlapped
    with backward up to a factor (``overlap_dp``, ``overlap_fsdp``). Adds them to ``comm``; returns the exposed
    seconds."""
    if s.replicas <= 1:
        return 0.0
    f, m = factors, s.micro_batches
    p_item = s.compute_item  # parameters gathered in the compute dtype
    g_item = ITEMSIZE["float32"]  # gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy.reduce_dtype / DDP)
    r = max(range(s.pp), key=lambda j: sums.params[j])  # the pipeline rank with the most parameters reduces last
    # expert parallelism: the experts' share is reduced among the dp / ep ranks that hold the same experts
    # (every ep-th data-parallel rank), the rest over all dp ranks
    groups = [(sums.params[r] - sums.experts[r], s.replicas, link_for(cluster, size=s.replicas, stride=s.tp))]
    if sums.experts[r]:
        edp = s.dp // s.ep
        groups.append((sums.experts[r], edp, link_for(cluster, size=edp, stride=s.tp * s.ep)))

    def ct(kind: str, per_param: float) -> float:
        return sum(collective_time(kind, n * per_param, size, link, f.eff_link) for n, size, link in groups)

    if s.zero_stage <= 1:
        ar = ct("all_reduce", g_item)
        ag = ct("all_gather", 4) if s.zero_stage == 1 else 0.0  # ZeroRedundancyOptimizer broadcast
        window = sums.fwdbwd[bottleneck] * 2 / 3  # gradients of the last micro-batch's backward (no_sync)
        kinds = {"all_reduce": (ar, ar - min(f.overlap_dp * ar, window)), "all_gather": (ag, ag)}
    else:
        pipelined = s.pp > 1
        rs = (1 if pipelined else m) * ct("reduce_scatter", g_item)
        gathers = 1 if s.held_zero_stage == 2 else m + 1 if pipelined else 2 * m
        ag = gathers * ct("all_gather", p_item)
        ov = f.overlap_fsdp if s.held_zero_stage == 3 else f.overlap_dp
        hidden = rs * (0 if pipelined else 1) + ag
        exposed = hidden - min(ov * hidden, m * sums.fwdbwd[bottleneck])
        share = exposed / hidden if hidden else 0.0
        kinds = {"reduce_scatter": (rs, rs * share if not pipelined else rs), "all_gather": (ag, ag * share)}
    total = 0.0
    for kind, (t, exposed) in kinds.items():
        if t:
            comm.by_kind[kind] = comm.by_kind.get(kind, 0.0) + t
        if exposed:
            comm.exposed_by_kind[kind] = comm.exposed_by_kind.get(kind, 0.0) + exposed
        total += exposed
    return total
