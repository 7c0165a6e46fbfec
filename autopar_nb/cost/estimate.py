"""Tie memory, communication and time into a :class:`~autopar_nb.plan.Cost` for one set of choices.

:class:`Evaluator` holds the graph's profile and caches per-layer terms by (repeated-block
representative, TP on, sequence parallel, AMP, micro-batch size), so evaluating a candidate is
arithmetic over the layer chain.
"""

from __future__ import annotations

from ..plan import DTYPE_NAMES, Cost
from . import layer_sums
from .async_tp import hide_pipelined
from .cpu import issue_time
from .dp_comm import data_parallel_comm
from .factors import Factors, factors_for
from .float8 import gathered_in_float8
from .loss import FusedHead
from .peak import RankMemory, rank_peaks
from .per_layer import layer_terms
from .pipeline import pipeline_comm
from .profile import GraphProfile, precision_of
from .setting import LayerChoice, Setting, setting_of
from .terms import CommTime, LayerTerms, RankSums, shared_sums
from .time import bubble_fraction, optimizer_time, weight_cast_time


class Evaluator:
    """Costs candidate plans of one profiled graph on one cluster (see the module docstring)."""

    def __init__(self, prof: GraphProfile, cluster, *, factors: Factors | None = None,
                 seq_ratio: float = 1.0, megatron_sp: bool = False, head: FusedHead | None = None,
                 norm_prof: GraphProfile | None = None):
        self.prof, self.cluster = prof, cluster
        self.head = head
        """the output head a ``Setting.fused_loss`` candidate fuses with the loss
        (:func:`.loss.fused_head`)"""
        self.norm_prof = norm_prof
        """the profile of the graph with its RMSNorms fused, which a ``Setting.fused_norm``
        candidate's layers cost (:func:`.norm.fuse_norms`); None when the model has none"""
        self.f = factors or factors_for(cluster)
        self.seq_ratio, self.megatron_sp = seq_ratio, megatron_sp
        self._cache: dict[tuple, LayerTerms] = {}
        shared = {r for j, r in enumerate(prof.rep) if r != j}
        self.blocks = {j for j, r in enumerate(prof.rep) if r in shared}
        """layers of repeated blocks (their outputs are sequence-sharded under sequence
        parallelism)"""
        self.first_block = min(self.blocks, default=-1)
        """the first of :attr:`blocks` (-1: none), where the sequence-parallel region starts (read
        at every pipeline cut of every candidate: found once)"""

    # ---- per layer -------------------------------------------------------------------------------
    terms = layer_terms  # (per_layer.py: its terms, cached by the repeated-block representative)

    def choice_terms(self, i: int, s: Setting, ch: LayerChoice) -> LayerTerms:
        """:meth:`terms` of layer ``i`` under the candidate's setting and the layer's choice (TP on
        or off)."""
        # layers past sp_last run whole: the first gathers, TP on or off
        gather = s.sp and i == self.prof.sp_gather
        return self.terms(i, tp=s.tp if ch.tp or gather else 1,
                          sp=s.sp and ch.tp and self.prof.sp_covers(i), gather=gather,
                          precision=precision_of(s.amp, s.zero_stage), mb_samples=s.mb_samples,
                          ep=s.ep, compiled=ch.compile, cp=s.cp, amp=s.amp, fused_norm=s.fused_norm,
                          float8=s.float8 != "none", async_tp=s.async_tp,
                          f8_gathered=gathered_in_float8(s, self.cluster), routed=s.routed_rows(ch))

    # ---- a whole candidate -----------------------------------------------------------------------
    def runs(self, choices: list[LayerChoice]) -> list[tuple[int, int, LayerChoice]]:
        """Consecutive layers with the same block representative and choices, as (first index,
        count, choice)."""
        rep, prev = self.prof.rep, None
        out: list[list] = []
        for i, ch in enumerate(choices):
            key = (rep[i], ch.stage, ch.tp, ch.recompute, ch.fsdp, ch.compile, ch.routed)
            if key == prev:
                out[-1][1] += 1
            else:
                out.append([i, 1, ch])
                prev = key
        return [tuple(r) for r in out]

    def evaluate(self, s: Setting, choices: list[LayerChoice]) -> Cost:
        """The predicted :class:`Cost` of one step (memory_by_rank: one entry per pipeline rank).

        Step time = micro-batches x the slowest pipeline rank's (compute + recompute + exposed TP
        comm), plus the pipeline bubble and exposed point-to-point time, the exposed data-parallel
        collectives and the optimizer step; and the time the GPU waits for the host where issuing
        the step takes the CPU longer (:func:`.cpu.issue_time`: forward and backward against the
        GPU's, the optimizer step against its own)."""
        f, m = self.f, s.micro_batches
        sums = self.sum_layers(s, choices)
        bottleneck = max(range(s.pp), key=sums.per_micro_batch)
        idle = bubble_fraction(s.schedule, pp=s.pp, micro_batches=m,
                               virtual_stages=s.virtual_stages, factors=f)
        bubble = idle * sums.per_micro_batch(bottleneck)
        comm = CommTime(by_kind={kk: v * m for kk, v in sums.tp_kind[bottleneck].items()},
                        exposed_by_kind={kk: v * m * (1 if kk == "all_to_all" else 1 - f.overlap_tp)
                                         for kk, v in sums.tp_kind[bottleneck].items()})
        tp_exposed = m * sums.tpc[bottleneck]
        # repeated key/value weight gradients, all-reduced at the step, not overlapped
        tp_step = max(sums.tp_step)
        if tp_step:
            tp_exposed += tp_step
            for d in (comm.by_kind, comm.exposed_by_kind):
                d["all_reduce"] = d.get("all_reduce", 0.0) + tp_step
        # what async TP hides comes off the pipelined kinds, as the layers' tp_exposed counts it
        if s.async_tp:
            hide_pipelined(comm.exposed_by_kind, total=tp_exposed)
        p2p_exposed = pipeline_comm(self, s, sums, comm)
        dp_exposed = data_parallel_comm(s, sums, bottleneck, comm, cluster=self.cluster, factors=f)
        opt_params = max(sums.params) if s.zero_stage < 1 else max(
            (p - x) / s.replicas + x / (s.dp // s.ep)
            for p, x in zip(sums.params, sums.experts, strict=True))
        opt_t = optimizer_time(opt_params, self.cluster, f, host=s.offload != "none")
        compute = m * (sums.fwdbwd[bottleneck] + sums.rec[bottleneck]) + weight_cast_time(
            sums.casts[bottleneck], micro_batches=m, regions=1 if s.pp > 1 else m,
            device=self.cluster.device,
            factors=f)  # one autocast region per micro-batch, or around the whole pipeline schedule
        gpu = compute + tp_exposed + bubble + p2p_exposed + dp_exposed
        # the host issues forward and backward while the GPU runs them, waits for the loss (the
        # step's synchronisation), then issues the optimizer step: each phase takes the longer
        cpu, cpu_opt, cpu_parts = issue_time(s, sums, idle, f)
        step = max(gpu, cpu) + max(opt_t, cpu_opt)
        mem = rank_peaks(self, s, choices, sums)
        cost = Cost(
            step_time_s=step, compute_s=compute,
            comm_exposed_s=tp_exposed + p2p_exposed + dp_exposed,
            comm_total_s=sum(comm.by_kind.values()), comm_by_kind=comm.by_kind,
            comm_exposed_by_kind=comm.exposed_by_kind, bubble_s=bubble, optimizer_s=opt_t,
            cpu_s=cpu + cpu_opt, cpu_wait_s=max(cpu - gpu, 0.0) + max(cpu_opt - opt_t, 0.0),
            cpu_by_part=cpu_parts,
            memory_by_rank=mem, peak_memory_bytes=max(x.total for x in mem),
        )
        self._throughput(s, sums, cost)
        return cost

    sum_layers = shared_sums(layer_sums.sum_layers)

    def rank_moments(self, s: Setting, choices: list[LayerChoice], *, per_op: bool = False,
                     action: bool = False) -> list[list[tuple]]:
        """Per pipeline rank, every moment :meth:`evaluate` weighs for the rank's peak: (phase —
        "forward", "backward", "recompute", "loss" or "step" —, the layer's index in a layer's
        phase, else None, the bytes then, each with the margin of the rank's peak), what a measured
        peak's components compare with. ``per_op``: each tuple ends with the op (graph index) a
        layer's backward is at, None at its largest, and :attr:`PeakMoment.later` (every other op is
        added); ``action``: then its action and micro-batch."""
        memory = RankMemory(self.prof, self.f, s, self.sum_layers(s, choices),
                            seq_ratio=self.seq_ratio)
        out, tail = [], ("op", "later") * per_op + ("action", "micro_batch") * action
        for r in range(s.pp):
            pb, ob, moments = memory.moments(r, per_op=per_op)
            top = max(mo.weight for mo in moments if mo.op is None)
            out.append([(mo.phase, mo.layer, memory.breakdown(r, pb, ob, mo, margin_of=top),
                         *(getattr(mo, k) for k in tail)) for mo in moments])
        return out

    def _throughput(self, s: Setting, sums: RankSums, cost: Cost) -> None:
        """Fill ``cost``'s FLOP rates, MFU and samples/tokens per second from its step time."""
        world = s.dp * s.tp * s.pp * s.cp
        step = cost.step_time_s
        samples = s.dp * s.micro_batches * s.mb_samples
        # FLOPs summed over the chain are those of one micro-batch for one model replica; scale to
        # the step a cp rank: 1/cp of the replica's
        step_model_flops = sums.model_flops * s.micro_batches * s.replicas
        step_hw_flops = sums.hw_flops * s.micro_batches * s.replicas
        peak_flops = self.cluster.device.flops(DTYPE_NAMES[s.amp] if s.amp != "none" else "float32")
        cost.model_tflops_per_gpu = step_model_flops / world / step / 1e12
        cost.hardware_tflops_per_gpu = step_hw_flops / world / step / 1e12
        cost.mfu = step_model_flops / world / step / peak_flops
        cost.tokens_per_s = (samples * self.prof.seq_len * self.seq_ratio / step
                             if self.prof.seq_len else None)
        cost.samples_per_s = samples / step


def estimate(graph, cluster, plan, *, factors: Factors | None = None, routed=None) -> Cost:
    """Cost of an existing plan (e.g. one a user edited) on ``cluster``: the planner's own model, no
    search (``routed``: a rank's measured routing, :func:`.setting.setting_of`)."""
    ev, s, choices = _evaluator_of(graph, cluster, plan, factors, routed)
    return ev.evaluate(s, choices)


def peak_moments(graph, cluster, plan, *, factors: Factors | None = None, per_op: bool = False,
                 action: bool = False, routed=None) -> list[list[tuple]]:
    """Per pipeline rank of ``plan``, every moment its predicted peak memory is chosen from
    (:meth:`Evaluator.rank_moments`, with ``per_op`` each layer's backward at each of its ops too,
    with ``action`` a multi-stage rank's action and micro-batch): what a measured peak's components
    compare with; ``routed``: as :func:`estimate`'s."""
    ev, s, choices = _evaluator_of(graph, cluster, plan, factors, routed)
    return ev.rank_moments(s, choices, per_op=per_op, action=action)


def _evaluator_of(graph, cluster, plan, factors: Factors | None,
                  routed=None) -> tuple[Evaluator, Setting, list[LayerChoice]]:
    from .loss import fused_head
    from .norm import fused_norm_profile
    from .profile import profile_of

    prof = profile_of(graph, "cpu" if cluster.name == "cpu" else "cuda",
                      fp32_ops=plan.precision.fp32_ops,
                      low_precision_ops=plan.precision.low_precision_ops)
    norm_prof = fused_norm_profile(
        graph, prof.device_kind, fp32_ops=plan.precision.fp32_ops,
        low_precision_ops=plan.precision.low_precision_ops) if plan.fused_norm else None
    if plan.fused_norm and norm_prof is None:
        raise ValueError("plan.fused_norm is set, but this model has no RMSNorm module; re-plan "
                         "for this model")
    if [lp.path for lp in plan.layers] != [lay.path for lay in graph.layers]:
        raise ValueError("the plan's layers do not match the graph's; re-plan for this model")
    seq_ratio = plan.batch.seq_len / graph.seq_len if plan.batch.seq_len and graph.seq_len else 1.0
    s, choices = setting_of(plan, routed)
    head = None
    if plan.fused_loss:
        head, why = fused_head(graph)
        if head is None or head.module != plan.fused_loss:
            raise ValueError(f"plan.fused_loss={plan.fused_loss!r} does not name this model's "
                             f"output head: {why or f'the head is {head.module}'}; re-plan for "
                             "this model")
    ev = Evaluator(prof, cluster, factors=factors, seq_ratio=seq_ratio, head=head,
                   norm_prof=norm_prof)
    return ev, s, choices
