"""Data parallelism's collectives in a step: the gradient all-reduce of DDP (ZeRO 0) or FSDP's
reduce-scatters and all-gathers (ZeRO 1-3), as many as the runtime issues, and the part of them the
backward does not hide.

How many FSDP issues follows how it is driven. Gradient accumulation (``runtime/train.py``'s
``set_grad_sync``) reduce-scatters every micro-batch under ZeRO 2 and 3, and once, in the last
micro-batch's backward, under ZeRO-1 (Megatron's distributed optimizer), whose parameters stay
gathered from the first forward. A pipeline stage (torch's ``PipelineStage``) runs every
micro-batch's backward without gradient sync or resharding and reduce-scatters once, after its last
backward (``perform_reduce_grad``): nothing is left to hide that one behind. Its ZeRO-3 units are
gathered by a forward, resharded after it, and gathered again by the next backward, which leaves
them gathered for a forward that follows (``unshard`` of a gathered group does nothing): one
all-gather per micro-batch and one more for the first forward.
"""

from __future__ import annotations

from ..plan import ITEMSIZE
from .comm import collective_time, link_for
from .float8 import gathered_in_float8, gathered_item, shard_cast_time
from .offload import host_of, offload_copy_time
from .setting import Setting
from .terms import CommTime, RankSums


def data_parallel_comm(s: Setting, sums: RankSums, bottleneck: int, comm: CommTime, *, cluster,
                       factors) -> float:
    """The data-parallel collectives of a step over the dp * cp ranks that hold the same parameters,
    overlapped with backward up to a factor (``overlap_dp``, ``overlap_fsdp``), the hidden part
    slowing the compute beside it (``overlap_contention``), with FSDP's copies into and out of its
    collectives' buffers (:func:`fsdp_copies`). Adds them to ``comm``, and CPU offload's host copies
    (:func:`offload_comm`); returns the exposed seconds."""
    if s.replicas <= 1:
        return offload_comm(s, sums, comm, cluster=cluster, factors=factors)
    f, m = factors, s.micro_batches
    p_item = s.compute_item  # parameters gathered in the compute dtype
    # gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy.reduce_dtype / DDP)
    g_item = ITEMSIZE["float32"]
    # the pipeline rank with the most parameters reduces last
    r = max(range(s.pp), key=lambda j: sums.params[j])
    # expert parallelism: the experts' share is reduced among the dp / ep ranks that hold the same
    # experts (every ep-th data-parallel rank), the rest over all dp ranks
    groups = [(sums.params[r] - sums.experts[r], s.replicas,
               link_for(cluster, size=s.replicas, stride=s.tp))]
    if sums.experts[r]:
        edp = s.dp // s.ep
        groups.append((sums.experts[r], edp, link_for(cluster, size=edp, stride=s.tp * s.ep)))

    def ct(kind: str, per_param: float, dense_item: float | None = None) -> float:
        """``kind``'s seconds over the groups at ``per_param`` bytes (``dense_item`` for the
        non-expert one)."""
        return sum(
            collective_time(kind,
                            n * (dense_item if j == 0 and dense_item is not None else per_param),
                            size, link, f.eff_link) for j, (n, size, link) in enumerate(groups))

    if s.zero_stage == 0:
        ar = ct("all_reduce", g_item)
        # gradients of the last micro-batch's backward (no_sync)
        window = sums.fwdbwd[bottleneck] * 2 / 3
        kinds = {"all_reduce": (ar, ar - min(f.overlap_dp * ar, window))}
    else:
        pipelined = s.pp > 1
        gathers, n_rs = fsdp_counts(s)
        rs = n_rs * ct("reduce_scatter", g_item)
        ag_item = gathered_item(groups[0][0], sums.f8_weights[r], p_item=p_item, recipe=s.float8,
                                cluster=cluster)
        ag = gathers * ct("all_gather", p_item, ag_item)
        ov = f.overlap_fsdp if s.held_zero_stage == 3 else f.overlap_dp
        hidden = rs * (0 if pipelined else 1) + ag
        # ZeRO-1 gathers in the first forward and reduce-scatters in the last backward: one
        # micro-batch's time
        window = (1 if s.zero_stage == 1 else m) * sums.fwdbwd[bottleneck]
        exposed = hidden - min(ov * hidden, window)
        share = exposed / hidden if hidden else 0.0
        rs_share = share if not pipelined else 1.0
        copy_out, copy_in = fsdp_copies(sums.params[r], gathers, n_rs, p_item, g_item,
                                        cluster.device, f, ag_item=ag_item)
        # float8 weights: each all-gather's input is the shard cast in fsdp_pre_all_gather, on the
        # all-gather's copy-in stream, hidden as the all-gather is
        cast = gathers * shard_cast_time(sums.f8_weights[r] / s.replicas, cluster.device, f) \
            if gathered_in_float8(s, cluster) else 0.0
        kinds = {"reduce_scatter": (rs, rs * rs_share), "all_gather": (ag, ag * share),
                 "fsdp copies": (copy_out + copy_in, copy_out + copy_in * rs_share),
                 "float8 casts": (cast, cast * share)}
    return sum(comm.record(kind, t, exposed, f.overlap_contention)
               for kind, (t, exposed) in kinds.items() if t) + \
        offload_comm(s, sums, comm, cluster=cluster, factors=f)


def fsdp_counts(s: Setting) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) FSDP issues per unit in a step (the module docstring): ZeRO 1
    and 2 gather once; ZeRO 3 twice per micro-batch, or, in a pipeline stage, once per micro-batch
    and once more; a pipeline stage and ZeRO-1 reduce-scatter once, otherwise every micro-batch
    does."""
    m, pipelined = s.micro_batches, s.pp > 1
    once = pipelined or s.zero_stage == 1
    return (1 if s.held_zero_stage == 2 else m + 1 if pipelined else 2 * m), (1 if once else m)


def offload_comm(s: Setting, sums: RankSums, comm: CommTime, *, cluster, factors) -> float:
    """CPU offload's copies in a step (:mod:`.offload`; none without offload or on the ``cpu``
    preset, whose device is the host): the rank's parameter shards in before each all-gather and its
    gradient shards out after each reduce-scatter, in fp32, as the kinds "host_to_device" and
    "device_to_host". FSDP2 issues them on its all-gather and reduce-scatter streams beside the
    collectives, so they hide behind compute as FSDP's all-gathers do (``overlap_fsdp``). Adds them
    to ``comm``; returns the exposed seconds."""
    if s.offload == "none" or cluster.name == "cpu":
        return 0.0
    r = max(range(s.pp), key=lambda j: sums.params[j])
    shard = (sums.params[r] - sums.experts[r]) / s.replicas + sums.experts[r] / (s.dp // s.ep)
    gathers, n_rs = fsdp_counts(s)
    h2d, d2h = offload_copy_time(shard, gathers=gathers, reduce_scatters=n_rs,
                                 p_item=ITEMSIZE["float32"], g_item=ITEMSIZE["float32"],
                                 host=host_of(cluster))
    return sum(comm.record(kind, t, t * (1 - factors.overlap_fsdp), factors.overlap_contention)
               for kind, t in (("host_to_device", h2d), ("device_to_host", d2h)))


def fsdp_copies(numel: float, gathers: int, reduce_scatters: int, p_item: int, g_item: int, device,
                factors, *, ag_item: float | None = None) -> tuple[float, float]:
    """(all-gather copy-out, reduce-scatter copy-in) seconds of FSDP2 for a rank's ``numel``
    unsharded parameters (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): after each
    all-gather, ``split_with_sizes_copy`` reads the gathered buffer and writes the unsharded
    parameters (``p_item`` bytes each way), on the compute stream; before each reduce-scatter,
    ``chunk_cat`` reads the unsharded gradients (``p_item``) and writes the reduce-scatter input in
    the reduce dtype (``g_item``), on the reduce-scatter stream. Memory-bound: bytes / HBM
    bandwidth. ``ag_item``: the bytes per parameter gathered, where float8 weights make it less than
    ``p_item`` (:func:`.float8.gathered_item`)."""
    hbm = device.hbm_bandwidth * factors.eff_hbm
    gathered = p_item if ag_item is None else ag_item
    return gathers * 2 * numel * gathered / hbm, reduce_scatters * numel * (p_item + g_item) / hbm
