"""Tie memory, communication and time into a :class:`~autopar_nb.plan.Cost` for one set of choices.

:class:`Evaluator` holds the graph's profile and caches per-layer terms by (repeated-block representative, TP on,
sequence parallel, AMP, micro-batch size), so evaluating a candidate is arithmetic over the layer chain.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from ..plan import DTYPE_NAMES, ITEMSIZE, MEMORY_TERMS, RECOMPUTE, Cost, MemoryBreakdown, stage_rank
from .comm import collective_time, link_for
from .factors import Factors, factors_for
from .loss import FusedHead
from .memory import (
    SENDS_HELD,
    activation_bytes,
    forward_peak,
    in_flight,
    model_states,
    op_moments,
    peak_op,
    state_bytes,
    with_margin,
)
from .profile import GraphProfile, precision_of
from .time import bubble_fraction, layer_compute_time, optimizer_time, weight_cast_time


@dataclass(frozen=True)
class Setting:
    """Global choices of a candidate plan (plain values)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    amp: str = "none"
    micro_batches: int = 1
    """micro-batches per step on each data-parallel rank"""
    mb_samples: float = 1.0
    """samples per micro-batch"""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sp: bool = False
    """sequence parallel (TP > 1 on a sequence model)"""
    optimizer: str = "adam"
    ep: int = 1
    """expert parallelism: the experts modules split over ``ep`` of the dp ranks (1: experts whole everywhere)"""
    fused_loss: bool = False
    """the output head and the default loss run as one fused, chunked op (``Evaluator.head``; :mod:`.loss`)"""
    cp: int = 1
    """context parallelism: every sequence split over ``cp`` ranks (ring attention; ``runtime/cp.py``)"""
    fused_norm: bool = False
    """the RMSNorm modules run kernels_ext's fused RMSNorm (``Evaluator.norm_prof``; :mod:`.norm`)"""

    @property
    def replicas(self) -> int:
        """ranks holding the same parameters, which average gradients: dp * cp (``mesh["dp_cp"]``)"""
        return self.dp * self.cp

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage`` under this schedule (:func:`~autopar_nb.plan.stage_rank`)."""
        return stage_rank(stage, self.pp, self.pp * self.virtual_stages, self.schedule)


@dataclass
class LayerChoice:
    """Per-layer choices of a candidate plan."""

    stage: int = 0
    tp: bool = True
    """apply the layer's TP styles (False: replicate it on every TP rank)"""
    recompute: str = "none"
    fsdp: bool = True
    compile: bool = False
    """run the layer under ``torch.compile`` (its memory-bound time scaled by ``Factors.compile_memory_bound``)"""


@dataclass
class LayerTerms:
    """One layer's per-micro-batch costs on one rank for a given (TP, SP, AMP, micro-batch size)."""

    fwd: float
    bwd: float
    sel: float
    """seconds selective recompute adds in backward (the attention scores again)"""
    act: dict[str, float]
    """saved activation bytes by recompute mode"""
    params_local: float
    tp_comm: dict[str, float] = field(default_factory=dict)
    """seconds per micro-batch (forward + backward) by collective kind"""
    out_bytes: float = 0.0
    work_bytes: float = 0.0
    flops: float = 0.0
    """forward + backward FLOPs of one micro-batch (global, not per rank: model FLOPs)"""
    fwd_flops: float = 0.0
    quad_flops: float = 0.0
    largest_param: float = 0.0
    """numel of the layer's largest local parameter"""
    tp_exposed: float = 0.0
    """seconds of the TP collectives not hidden behind compute: sum(tp_comm) x (1 - overlap_tp), plus expert
    parallelism's all-to-alls (in tp_comm too), which the tokens wait for"""
    experts_local: float = 0.0
    """numel of the layer's expert parameters on one rank under expert parallelism (ep > 1; else 0: they count as
    any other parameter)"""
    a2a_fwd: float = 0.0
    """seconds of the forward all-to-alls of expert parallelism (full recompute runs them again)"""
    tp_step: float = 0.0
    """seconds of TP collectives run once per step, not per micro-batch: the all-reduce of the weight gradients of
    key/value projections TP repeats (``LayerProfile.at_tp``)"""
    freed: float = 0.0
    """saved bytes of this layer already freed at its backward peak (:func:`.memory.peak_op`), with
    ``work_bytes`` the gradients held then"""
    later_params: float = 0.0
    """local parameters (numel) of this layer whose gradients exist at its backward peak (read by later ops)"""
    op_deltas: tuple[tuple[int, float, float, float], ...] = ()
    """per op of the layer whose backward runs: (its graph index, its working set, the saved bytes still alive and
    the local parameters whose gradients do not exist yet there, each less the peak op's): the layer's moment at
    that op (:meth:`Evaluator.rank_moments` with ``per_op``)"""
    cast_local: float = 0.0
    """numel of the layer's local parameters autocast keeps a 16-bit copy of during forward and backward (0 unless
    the precision is "autocast")"""
    forward: dict[str, float] = field(default_factory=dict)
    """recompute ("none", "full", "selective") -> bytes the layer holds at its forward's largest moment ("none"), or
    a recomputed layer beyond what it keeps at its recompute's (:func:`.memory.forward_peak`)"""

    def recompute_s(self, recompute: str) -> float:
        """Seconds recompute adds in backward: the whole forward again (full, with its all-to-alls) or the attention
        scores (selective)."""
        return self.fwd + self.a2a_fwd if recompute == "full" else self.sel if recompute == "selective" else 0.0

    def recompute_flops(self, recompute: str) -> float:
        """FLOPs recompute adds (hardware FLOPs, not model FLOPs)."""
        return self.fwd_flops if recompute == "full" else self.quad_flops if recompute == "selective" else 0.0

    def time_s(self, recompute: str) -> float:
        """The layer's time for one micro-batch on one rank: forward + backward + recompute + exposed TP comm.
        The one per-layer time formula: stage balancing uses it, and a pipeline rank's time is its sum."""
        return self.fwd + self.bwd + self.recompute_s(recompute) + self.tp_exposed


@dataclass
class RankSums:
    """Per pipeline rank (index r), sums over its layers for one micro-batch, and the chain's FLOPs."""

    fwdbwd: list[float]
    """forward + backward seconds"""
    rec: list[float]
    """recompute seconds"""
    tpc: list[float]
    """exposed TP collective seconds"""
    tp_kind: list[dict[str, float]]
    """TP collective seconds (before overlap) by kind"""
    acts: list[float]
    """saved activation bytes"""
    params: list[float]
    """local parameters (numel)"""
    work: list[float]
    """the largest working set of one layer's backward (bytes)"""
    units: list[list[FsdpUnit]]
    """the FSDP units (``fully_shard`` groups) in forward order, as ``export.values.fsdp_units`` makes them"""
    largest: list[float]
    """the largest local parameter (numel)"""
    nofsdp: list[float]
    """parameters folded into the root FSDP unit (numel)"""
    p2p: list[float]
    """bytes a rank sends to the next stage (the largest of its cuts, one micro-batch)"""
    experts: list[float] = field(default_factory=list)
    """local expert parameters under expert parallelism (numel; part of ``params``)"""
    head_tp: bool = False
    """the output head is TP-split (loss_parallel can apply)"""
    model_flops: float = 0.0
    hw_flops: float = 0.0
    tp_step: list[float] = field(default_factory=list)
    """seconds of TP collectives run once per step (``LayerTerms.tp_step``)"""
    casts: list[float] = field(default_factory=list)
    """local parameters (numel) autocast keeps 16-bit copies of (``LayerTerms.cast_local``)"""
    pipe: list[dict[str, float]] = field(default_factory=list)
    """per rank, one micro-batch's bytes of the tensors crossing its pipeline cuts (:meth:`Evaluator.pipeline_sums`):
    ``recv`` (received into a buffer per micro-batch), ``recv_saved`` (the part of them its layers' saved activations
    count already), ``kept`` (its own outputs, kept until their backward, that its layers do not save),
    ``grad_recv`` (the gradients sent back to it) and ``grad_sent`` (the gradients of its inputs it sends back)"""
    bwd_layers: list[list[tuple[float, float, float, int, str]]] = field(default_factory=list)
    """per run of layers, the moments its backward holds the most (:func:`moment_layers`), and its forward: (saved
    activation bytes still alive, working set bytes, local parameters (numel) whose backward has not run yet, the
    layer's index, "backward", "recompute" or "forward": its backward's largest op, its recompute's largest forward
    moment, or, not recomputed, the run's last layer's forward's largest).
    Backward runs from the last layer to the first, freeing each layer's saved tensors and leaving its gradients:
    at layer l the saved tensors of later layers are gone and their gradients exist; a recomputed layer holds what
    its recompute re-created"""

    @classmethod
    def zeros(cls, pp: int) -> RankSums:
        z = [0.0] * pp
        return cls(list(z), list(z), list(z), [{} for _ in range(pp)], list(z), list(z), list(z),
                   [[] for _ in range(pp)], list(z), list(z), list(z), list(z), tp_step=list(z), casts=list(z),
                   bwd_layers=[[] for _ in range(pp)],
                   pipe=[dict.fromkeys(("recv", "recv_saved", "kept", "grad_recv", "grad_sent"), 0.0)
                         for _ in range(pp)])

    def per_micro_batch(self, r: int) -> float:
        """Rank ``r``'s time for one micro-batch: the sum of its layers' :meth:`LayerTerms.time_s`."""
        return self.fwdbwd[r] + self.rec[r] + self.tpc[r]


@dataclass
class CommTime:
    """Collective seconds of one step: before overlap by kind, and the part on the critical path."""

    by_kind: dict[str, float] = field(default_factory=dict)
    exposed_by_kind: dict[str, float] = field(default_factory=dict)
    exposed: float = 0.0


class Evaluator:
    """Costs candidate plans of one profiled graph on one cluster (see the module docstring)."""

    def __init__(self, prof: GraphProfile, cluster, *, factors: Factors | None = None, seq_ratio: float = 1.0,
                 megatron_sp: bool = False, head: FusedHead | None = None, norm_prof: GraphProfile | None = None):
        self.prof, self.cluster = prof, cluster
        self.head = head
        """the output head a ``Setting.fused_loss`` candidate fuses with the loss (:func:`.loss.fused_head`)"""
        self.norm_prof = norm_prof
        """the profile of the graph with its RMSNorms fused, which a ``Setting.fused_norm`` candidate's layers cost
        (:func:`.norm.fuse_norms`); None when the model has none"""
        self.f = factors or factors_for(cluster)
        self.seq_ratio, self.megatron_sp = seq_ratio, megatron_sp
        self._cache: dict[tuple, LayerTerms] = {}
        shared = {r for j, r in enumerate(prof.rep) if r != j}
        self.blocks = {j for j, r in enumerate(prof.rep) if r in shared}
        """layers of repeated blocks (their outputs are sequence-sharded under sequence parallelism)"""

    # ---- per layer ----------------------------------------------------------------------------------------------
    def terms(self, i: int, *, tp: int, sp: bool, precision: str, mb_samples: float, ep: int = 1,
              compiled: bool = False, cp: int = 1, amp: str = "bf16", fused_norm: bool = False) -> LayerTerms:
        """Per-layer terms, cached by the layer's repeated-block representative. ``precision``: one of
        :data:`~.profile.PRECISIONS` (:func:`~.profile.precision_of`); ``amp``: autocast's dtype there ("bf16",
        "fp16": its peak FLOP/s). With context parallelism (``cp``) a rank
        holds 1/cp of every sequence: its compute and activations are divided by cp (with torch's load balancing,
        causal attention's work too), and each attention layer all-gathers the keys and values in forward and again
        in backward, and passes their float32 gradients round the ring cp times
        (``_templated_ring_attention_backward``); the gathered keys and values are one more working buffer.
        ``fused_norm``: the layer as the fused-norm graph profiles it (:attr:`norm_prof`)."""
        fused_norm = fused_norm and self.norm_prof is not None
        key = (self.prof.rep[i], tp, sp, precision, mb_samples, ep, compiled, cp, amp, fused_norm)
        half = precision != "fp32"
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        prof = self.norm_prof if fused_norm else self.prof
        lp = prof.layers[self.prof.rep[i]].at_tp(tp)  # key/value projections this tp repeats: whole
        scale = mb_samples / self.prof.batch * self.seq_ratio / cp
        qscale = mb_samples / self.prof.batch * self.seq_ratio ** 2 / cp
        fwd, bwd, sel = layer_compute_time(lp, tp=tp, sp=sp, precision=precision, scale=scale, quad_scale=qscale,
                                           device=self.cluster.device, factors=self.f, compiled=compiled,
                                           low_dtype=DTYPE_NAMES[amp] if amp != "none" else "bfloat16")
        act = {r: activation_bytes(lp, tp=tp, sp=sp, recompute=r, precision=precision, scale=scale,
                                   quad_scale=qscale, megatron_sp=self.megatron_sp) for r in RECOMPUTE}
        comm: dict[str, float] = {}
        step_s = 0.0  # once per step, not per micro-batch
        if tp > 1:
            link = link_for(self.cluster, size=tp, stride=1)
            for c in lp.comms:
                if c.phase == "step":
                    step_s += collective_time(c.kind, c.nbytes, tp, link, self.f.eff_link)
                    continue
                nbytes = (c.half_bytes if half else c.nbytes) * scale
                # sequence parallel turns an all-reduce into a reduce-scatter and an all-gather
                kinds = ("reduce_scatter", "all_gather") if sp and c.kind == "all_reduce" else (c.kind,)
                for k in kinds:
                    comm[k] = comm.get(k, 0.0) + collective_time(k, nbytes, tp, link, self.f.eff_link)
        out = (lp.output_amp[precision] if half else lp.output_bytes) * scale / (tp if sp else 1)
        moments = op_moments(lp, tp=tp, sp=sp, scale=scale, precision=precision, quad_scale=qscale,
                             megatron_sp=self.megatron_sp)
        work, freed, later = peak_op(moments)
        ops = tuple((op, w - work, freed - f, later - lat) for op, w, f, lat in moments)
        if cp > 1 and lp.kv_bytes:
            work += self._ring(lp, comm, cp=cp, tp=tp, half=half, scale=scale)
        fwd_fl = (sum(lp.flops_split.values()) + sum(lp.flops_rep.values()) + lp.flops_other) * scale
        bwd_fl = (sum(lp.bwd_split.values()) + sum(lp.bwd_rep.values()) + lp.bwd_other) * scale
        experts = lp.params_experts / ep if ep > 1 and lp.experts else 0.0
        a2a_fwd, a2a = self._all_to_alls(lp, ep=ep, tp=tp, half=half, scale=scale) if experts else (0.0, 0.0)
        t = LayerTerms(fwd, bwd, sel, act, lp.params_split / tp + lp.params_rep - (lp.params_experts - experts
                                                                                      if experts else 0),
                       comm, out, work, fwd_fl + bwd_fl, fwd_fl, lp.quad_flops * qscale,
                       lp.largest_param / (tp if lp.tp else 1), sum(comm.values()) * (1 - self.f.overlap_tp) + a2a,
                       experts, a2a_fwd)
        if a2a:
            comm["all_to_all"] = a2a
        t.tp_step = step_s
        t.freed, t.later_params, t.op_deltas = freed, later, ops
        t.forward = {rec: forward_peak(lp, tp=tp, sp=sp, scale=scale, precision=precision, quad_scale=qscale,
                                       megatron_sp=self.megatron_sp, recompute=rec) for rec in RECOMPUTE}
        t.cast_local = lp.cast_split / tp + lp.cast_rep if precision == "autocast" else 0.0
        self._cache[key] = t
        return t

    def _ring(self, lp, comm: dict[str, float], *, cp: int, tp: int, half: bool, scale: float) -> float:
        """Context parallelism's collectives of one layer and micro-batch added to ``comm`` (see :meth:`terms`; the
        cp ranks are consecutive at stride tp); returns the bytes of the gathered keys and values."""
        link = link_for(self.cluster, size=cp, stride=tp)
        whole = (lp.kv_half if half else lp.kv_bytes) * scale * cp  # this micro-batch's keys and values
        comm["all_gather"] = comm.get("all_gather", 0.0) + 2 * collective_time("all_gather", whole, cp, link,
                                                                               self.f.eff_link)
        grads = lp.kv_half / 2 * ITEMSIZE["float32"] * scale  # this rank's dK, dV, accumulated in float32
        comm["send_recv"] = comm.get("send_recv", 0.0) + cp * collective_time("send_recv", grads, cp, link,
                                                                             self.f.eff_link)
        return whole

    def _all_to_alls(self, lp, *, ep: int, tp: int, half: bool, scale: float) -> tuple[float, float]:
        """(forward, forward + backward) seconds of expert parallelism's all-to-alls in one layer and micro-batch
        (``runtime/ep.py``, counted in tests/test_moe.py: 5 per experts module and step): the per-expert token
        counts (E integers), the token rows out to the experts and back in forward, the same two in backward. The
        ep ranks are consecutive data-parallel ranks (stride tp). Balanced routing: every rank sends and receives
        the average; a skewed router makes the busiest rank's share the time, which this does not model."""
        link = link_for(self.cluster, size=ep, stride=tp)
        rows = (lp.dispatch_half if half else lp.dispatch_bytes) * scale / len(lp.experts)
        one = collective_time("all_to_all", rows, ep, link, self.f.eff_link)
        counts = sum(collective_time("all_to_all", 8 * e, ep, link, self.f.eff_link) for e in lp.experts.values())
        n = len(lp.experts)
        return counts + 2 * n * one, counts + 4 * n * one

    def choice_terms(self, i: int, s: Setting, ch: LayerChoice) -> LayerTerms:
        """:meth:`terms` of layer ``i`` under the candidate's setting and the layer's choice (TP on or off)."""
        return self.terms(i, tp=s.tp if ch.tp else 1, sp=s.sp and ch.tp,
                          precision=precision_of(s.amp, s.zero_stage),
                          mb_samples=s.mb_samples, ep=s.ep, compiled=ch.compile, cp=s.cp, amp=s.amp,
                          fused_norm=s.fused_norm)

    # ---- a whole candidate --------------------------------------------------------------------------------------
    def runs(self, choices: list[LayerChoice]) -> list[tuple[int, int, LayerChoice]]:
        """Consecutive layers with the same block representative and choices, as (first index, count, choice)."""
        rep = self.prof.rep
        out: list[list] = []
        prev = None
        for i, ch in enumerate(choices):
            key = (rep[i], ch.stage, ch.tp, ch.recompute, ch.fsdp, ch.compile)
            if key == prev:
                out[-1][1] += 1
            else:
                out.append([i, 1, ch])
                prev = key
        return [tuple(r) for r in out]

    def evaluate(self, s: Setting, choices: list[LayerChoice]) -> Cost:
        """The predicted :class:`Cost` of one step (memory_by_rank: one entry per pipeline rank).

        Step time = micro-batches x the slowest pipeline rank's (compute + recompute + exposed TP comm), plus the
        pipeline bubble and exposed point-to-point time, the exposed data-parallel collectives and the optimizer
        step."""
        f, m = self.f, s.micro_batches
        sums = self.sum_layers(s, choices)
        bottleneck = max(range(s.pp), key=sums.per_micro_batch)
        bubble = bubble_fraction(s.schedule, pp=s.pp, micro_batches=m, virtual_stages=s.virtual_stages,
                                 factors=f) * sums.per_micro_batch(bottleneck)
        comm = CommTime(by_kind={kk: v * m for kk, v in sums.tp_kind[bottleneck].items()},
                        exposed_by_kind={kk: v * m * (1 if kk == "all_to_all" else 1 - f.overlap_tp)
                                         for kk, v in sums.tp_kind[bottleneck].items()})
        tp_exposed = m * sums.tpc[bottleneck]
        tp_step = max(sums.tp_step)  # repeated key/value weight gradients, all-reduced at the step, not overlapped
        if tp_step:
            tp_exposed += tp_step
            for d in (comm.by_kind, comm.exposed_by_kind):
                d["all_reduce"] = d.get("all_reduce", 0.0) + tp_step
        p2p_exposed = self._pipeline_comm(s, sums, comm)
        dp_exposed = self._data_parallel_comm(s, sums, bottleneck, comm)
        opt_params = max(sums.params) if s.zero_stage < 1 else max(
            (p - x) / s.replicas + x / (s.dp // s.ep) for p, x in zip(sums.params, sums.experts, strict=True))
        opt_t = optimizer_time(opt_params, self.cluster.device, f)
        compute = m * (sums.fwdbwd[bottleneck] + sums.rec[bottleneck]) + weight_cast_time(
            sums.casts[bottleneck], micro_batches=m, regions=1 if s.pp > 1 else m, device=self.cluster.device,
            factors=f)  # one autocast region per micro-batch, or around the whole pipeline schedule
        step = compute + tp_exposed + bubble + p2p_exposed + dp_exposed + opt_t
        mem = [self._rank_memory(s, sums, r) for r in range(s.pp)]
        cost = Cost(
            step_time_s=step, compute_s=compute, comm_exposed_s=tp_exposed + p2p_exposed + dp_exposed,
            comm_total_s=sum(comm.by_kind.values()), comm_by_kind=comm.by_kind,
            comm_exposed_by_kind=comm.exposed_by_kind, bubble_s=bubble, optimizer_s=opt_t,
            memory_by_rank=mem, peak_memory_bytes=max(x.total for x in mem),
        )
        self._throughput(s, sums, cost)
        return cost

    def sum_layers(self, s: Setting, choices: list[LayerChoice]) -> RankSums:
        """One pass over the layer chain (runs of identical layers at once): per pipeline rank sums."""
        prof, pp = self.prof, s.pp
        sums = RankSums.zeros(pp)
        runs = self.runs(choices)
        kept: list[set[str]] = [set() for _ in range(pp)]  # the shared inputs a rank's checkpoints keep already
        rank_of = s.rank_of
        tied = self._tied_gradients(s, choices)
        for i, cnt, ch in runs:
            r = rank_of(ch.stage)
            lt = self.choice_terms(i, s, ch)
            # time
            sums.fwdbwd[r] += cnt * (lt.fwd + lt.bwd)
            sums.rec[r] += cnt * lt.recompute_s(ch.recompute)
            if lt.tp_comm:
                sums.tpc[r] += cnt * lt.tp_exposed
                kinds = sums.tp_kind[r]
                for kk, v in lt.tp_comm.items():
                    kinds[kk] = kinds.get(kk, 0.0) + cnt * v
            # memory
            acts_before = sums.acts[r]
            whole = self._replicated_input(s, i, ch, lt)
            held = self._held_inputs(s, i, cnt, ch, kept[r])  # held[j]: what layers i .. i + j keep twice
            sums.acts[r] += cnt * lt.act[ch.recompute] + whole - held[-1]
            # a recomputed layer's backward first runs its forward again: what the plain forward saves and the
            # recompute did not keep is alive again beside the working set
            again = max(lt.act["none"] - lt.act[ch.recompute], 0.0)
            # each op's moment holds the gradients accumulating for what later ops read (profile's
            # _accumulating_gradients): the residual stream's, whose skip the block's last add reads
            wb, freed, ops = lt.work_bytes + again, lt.freed, lt.op_deltas
            if s.fused_loss and i <= self.head.layer < i + cnt:
                wb, again, freed, ops = self._fused_head(s, sums, r, ch.recompute, lt, tp=s.tp if ch.tp else 1), \
                    0.0, 0.0, ()
            if wb > sums.work[r]:
                sums.work[r] = wb
            head_saved = sums.acts[r] - acts_before - whole - cnt * lt.act[ch.recompute] + held[-1]  # the fused LSE
            # a layer's peak is its largest op's backward: the output that op's consumers saved is freed by then
            # (memory.peak_op), the layer's own gradients are still to come. Its last layer runs
            # backward first; by its first, the gradients of the others exist (the peak there when a layer's
            # gradients outweigh what it saves: full recompute, measured on LLaMA)
            for j in moment_layers(cnt):
                sums.bwd_layers[r].append((acts_before + whole + (j + 1) * lt.act[ch.recompute] - held[j]
                                           + head_saved + again - freed, wb - again + tied.get(i + j, 0.0),
                                           sums.params[r] + (j + 1) * lt.params_local - lt.later_params, i + j,
                                           "backward", ops))
                replayed = max(lt.forward[ch.recompute], again) if ch.recompute != "none" else 0.0
                if replayed:
                    # its recompute, before its backward, beside the gradient of its output: at its end, every
                    # tensor it saves again re-made, or where an op's forward holds more (lt.forward), what it has
                    # recomputed by then (measured: BERT's math attention under bf16 autocast)
                    sums.bwd_layers[r].append((acts_before + whole + (j + 1) * lt.act[ch.recompute] - held[j]
                                               + head_saved + replayed, lt.out_bytes + tied.get(i + j, 0.0),
                                               sums.params[r] + (j + 1) * lt.params_local, i + j, "recompute",
                                               ()))
            if ch.recompute == "none" and not head_saved:
                # the run's last layer's forward: every earlier layer's saved tensors, and its own forward's largest
                # moment (the storages alive then; no gradient exists yet in a step's first forward)
                sums.bwd_layers[r].append((acts_before + whole + (cnt - 1) * lt.act["none"], lt.forward["none"],
                                           0.0, i + cnt - 1, "forward", ()))
            sums.params[r] += cnt * lt.params_local
            sums.experts[r] += cnt * lt.experts_local
            sums.tp_step[r] += cnt * lt.tp_step
            sums.casts[r] += cnt * lt.cast_local
            sums.largest[r] = max(sums.largest[r], lt.largest_param)
            if ch.fsdp:
                self._add_units(sums.units[r], i, cnt, lt.params_local)
            else:
                sums.nofsdp[r] += cnt * lt.params_local
            # the head (last run) split by TP; the activations sent to the next stage
            if ch.tp and s.tp > 1 and prof.layers[i].vocab and not prof.layers[i].norms and i == len(choices) - cnt:
                sums.head_tp = True
            sums.model_flops += cnt * lt.flops
            sums.hw_flops += cnt * (lt.flops + lt.recompute_flops(ch.recompute))
        if pp > 1:
            self.pipeline_sums(s, choices, sums)
        return sums

    def pipeline_sums(self, s: Setting, choices: list[LayerChoice], sums: RankSums) -> None:
        """Fill ``sums.pipe`` and ``sums.p2p`` from the tensors crossing each cut (:attr:`GraphProfile.crossings`),
        as the runtime's pipeline stages (``runtime/pp.py``'s ``LeanStage``) hold them: the receiving stage a buffer
        per micro-batch in flight for every one (its layers' saved activations point into it), the sending stage
        its own outputs until each micro-batch's backward (the last stage: the model's output, or with the fused
        head its input, which the fused op holds anyway), and a buffer for
        each gradient coming back to the micro-batch in backward. A stage holding a layer that reads a parameter
        another stage owns (a head tied to the embeddings) holds its own copy: in its parameters."""
        prof = self.prof
        precision = precision_of(s.amp, s.zero_stage)
        scale = s.mb_samples / prof.batch * self.seq_ratio / s.cp
        stage = [ch.stage for ch in choices]
        rank_of = s.rank_of
        for k in range(1, len(choices)):
            a, b = stage[k - 1], stage[k]
            if a == b:
                continue
            sp_div = s.tp if s.sp and k in self.blocks and k - 1 in self.blocks else 1  # sequence shards
            sent, send, recv = 0.0, sums.pipe[rank_of(a)], sums.pipe[rank_of(b)]
            for c in prof.crossings[k]:
                nbytes = c.nbytes[precision] * scale / sp_div
                sent += nbytes
                recv["recv"] += nbytes
                if c.saved_in is not None and stage[c.saved_in] == b:
                    recv["recv_saved"] += nbytes
                if c.made >= 0 and stage[c.made] == a and (c.saved_in is None or stage[c.saved_in] != a):
                    send["kept"] += nbytes
                if c.grad:
                    send["grad_recv"] += nbytes
                    recv["grad_sent"] += nbytes
            sums.p2p[rank_of(a)] = max(sums.p2p[rank_of(a)], sent)
        last = len(choices) - 1
        if not (s.fused_loss and self.head.layer == last):  # fused: the stage returns the head's input, which the
            # fused op saves (in the head layer's activations): no logits kept as the stage's output
            sums.pipe[rank_of(stage[last])]["kept"] += self.choice_terms(last, s, choices[last]).out_bytes
        copies = {(stage[i], name): numel / (s.tp if split and choices[i].tp else 1)
                  for i, lp in enumerate(prof.layers) for name, (numel, split, owner) in lp.borrowed.items()
                  if stage[owner] != stage[i]}  # a tied parameter's copy on each other stage (runtime/pp.py)
        for (st, _), numel in copies.items():
            sums.params[rank_of(st)] += numel

    def _add_units(self, units: list[FsdpUnit], i: int, cnt: int, numel: float) -> None:
        """Append layers ``i`` .. ``i + cnt - 1`` (``numel`` local parameters each) to ``units`` as the runtime
        groups them (``export.values.fsdp_units``): each layer with parameters its own unit, except the last layer
        joining a final norm just before it (torchtitan's ``[norm, output]``)."""
        if not numel:
            return
        layers = self.prof.layers
        tail = len(layers) - 2
        if i == tail + 1 and units and units[-1].first == tail and layers[tail].path in layers[tail].norms:
            units[-1] = FsdpUnit(tail, i, units[-1].numel + numel)
            return
        units += [FsdpUnit(i + j, i + j, numel) for j in range(cnt)]

    def _held_inputs(self, s: Setting, i: int, cnt: int, ch: LayerChoice, kept: set[str]) -> list[float]:
        """Per layer of the run ``i`` .. ``i + cnt - 1``, the bytes of the recomputed layers' inputs up to it that
        an earlier recomputed layer on the rank keeps already (:attr:`.profile.LayerProfile.shared_inputs`: one
        storage, held once, which ``activation_bytes`` counts per layer); adds the run's to ``kept``. Measured: T5's
        decoder blocks all keep the encoder output and the position biases (tp=2, bf16, full recompute: 11 MiB)."""
        held, total = [], 0.0
        if ch.recompute == "none":
            return [0.0] * cnt
        precision = precision_of(s.amp, s.zero_stage)
        tp = s.tp if ch.tp else 1
        per_byte = s.mb_samples / self.prof.batch * self.seq_ratio / s.cp / (tp if s.sp and ch.tp else 1)
        for lp in self.prof.layers[i:i + cnt]:
            for key, nbytes in lp.shared_inputs.get(precision, {}).items():
                if key in kept:
                    total += nbytes * per_byte
                kept.add(key)
            held.append(total)
        return held

    def _tied_gradients(self, s: Setting, choices: list[LayerChoice]) -> dict[int, float]:
        """Per layer, the bytes of tied parameters' gradients pending during its backward: a parameter two layers
        of a rank read (a head tied to the embeddings, T5's decoder embedding) gets its later reader's gradient
        first, which autograd holds, to add the earlier reader's to, from the later layer's backward to the earlier
        one's (the tracker's census: BERT's decoder weight gradient, a float32 temporary through the whole
        encoder backward). The parameter's dtype: float32, or FSDP's 16-bit unsharded parameter (ZeRO 2/3)."""
        item = ITEMSIZE[DTYPE_NAMES.get(s.amp, "float32")] if s.zero_stage >= 2 else ITEMSIZE["float32"]
        readers: dict[tuple[str, int], list[int]] = defaultdict(list)  # (parameter, rank) -> its layers there
        sizes: dict[str, tuple[int, bool]] = {}
        for i, lp in enumerate(self.prof.layers):
            for name, (numel, split, owner) in lp.borrowed.items():
                readers[name, s.rank_of(choices[owner].stage)].append(owner)
                readers[name, s.rank_of(choices[i].stage)].append(i)
                sizes[name] = numel, split
        out: dict[int, float] = defaultdict(float)
        for (name, rank), layers in readers.items():
            numel, split = sizes[name]
            first, last = min(layers), max(layers)
            for i in range(first, last):
                if s.rank_of(choices[i].stage) == rank:
                    out[i] += numel / (s.tp if split and choices[last].tp else 1) * item
        return out

    def _replicated_input(self, s: Setting, i: int, ch: LayerChoice, lt: LayerTerms) -> float:
        """Bytes a recomputed first block of a sequence-parallel run holds beyond its sequence shard: it receives
        the layer before's replicated output (an embedding's) and shards it itself (the plan's ``PrepareFirstInput``
        inside the checkpoint wrapper), so the checkpoint keeps the whole input, and the recompute its shard
        beside it (measured: LLaMA tp=2 full recompute, layer 0)."""
        first = i in self.blocks and (i == 0 or i - 1 not in self.blocks)
        if not (first and s.sp and ch.tp and ch.recompute != "none" and s.tp > 1):
            return 0.0
        return lt.act["full"] * s.tp

    def _fused_head(self, s: Setting, sums: RankSums, r: int, recompute: str, lt: LayerTerms, *, tp: int = 1
                    ) -> float:
        """The fused head + loss on rank ``r`` (:mod:`.loss`): adds the log-sum-exp it saves, the logits' recompute
        (time and hardware FLOPs) to ``sums``; returns the head layer's backward working set, the fused op's
        temporaries in place of the logits' gradient. Split on the vocabulary over ``tp`` ranks, a rank computes
        its rows' logits (FLOPs and chunk buffers / tp) and the forward's all-reduces of the log-sum-exp terms
        (:meth:`.loss.FusedHead.tp_forward_bytes`) are added; the hidden states' gradient is all-reduced as the
        colwise head's input gradient is (counted with the layer's TP collectives)."""
        half = s.amp != "none"
        tokens = self.head.tokens * s.mb_samples / self.prof.batch * self.seq_ratio
        flops = self.head.recompute_flops(tokens) / tp
        sums.rec[r] += flops / (self.cluster.device.flops(DTYPE_NAMES[s.amp] if half else "float32")
                                * self.f.efficiency("matmul", half))
        sums.hw_flops += flops * tp  # every rank's share: the step's hardware FLOPs
        sums.acts[r] += self.head.saved_bytes(tokens)
        if tp > 1:
            link = link_for(self.cluster, size=tp, stride=1)
            t = collective_time("all_reduce", self.head.tp_forward_bytes(tokens), tp, link, self.f.eff_link)
            sums.tpc[r] += t * (1 - self.f.overlap_tp)
            sums.tp_kind[r]["all_reduce"] = sums.tp_kind[r].get("all_reduce", 0.0) + t
        return self.head.temp_bytes(tokens, half=half, tp=tp) + (lt.act["none"] if recompute == "full" else 0.0)

    def _pipeline_comm(self, s: Setting, sums: RankSums, comm: CommTime) -> float:
        """Point-to-point sends between stages: fill/drain on the critical path, the rest mostly hidden. Adds to
        ``comm``; returns the exposed seconds."""
        if s.pp <= 1:
            return 0.0
        f = self.f
        pp_link = link_for(self.cluster, size=s.pp, stride=s.tp * s.replicas)
        p2p_t = max((collective_time("send_recv", b, 2, pp_link, f.eff_link) for b in sums.p2p), default=0.0)
        total = 2 * s.micro_batches * p2p_t * s.virtual_stages
        exposed = 2 * (s.pp - 1) * p2p_t + (1 - f.overlap_pp) * total
        if total:
            comm.by_kind["send_recv"] = total
        if exposed:
            comm.exposed_by_kind["send_recv"] = exposed
        return exposed

    def _data_parallel_comm(self, s: Setting, sums: RankSums, bottleneck: int, comm: CommTime) -> float:
        """Gradient all-reduce (ZeRO 0/1, once per step: no_sync on earlier micro-batches) or FSDP's reduce-scatter
        and all-gathers (ZeRO 2/3, every micro-batch), overlapped with backward up to a factor, over the dp * cp
        ranks that hold the same parameters. Adds to ``comm``; returns the exposed seconds."""
        if s.replicas <= 1:
            return 0.0
        f, m = self.f, s.micro_batches
        p_item = ITEMSIZE[DTYPE_NAMES.get(s.amp, "float32")]  # parameters gathered in the compute dtype
        g_item = ITEMSIZE["float32"]  # gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy.reduce_dtype / DDP)
        r = max(range(s.pp), key=lambda j: sums.params[j])  # the pipeline rank with the most parameters reduces last
        # expert parallelism: the experts' share is reduced among the dp / ep ranks that hold the same experts
        # (every ep-th data-parallel rank), the rest over all dp ranks
        groups = [(sums.params[r] - sums.experts[r], s.replicas, link_for(self.cluster, size=s.replicas, stride=s.tp))]
        if sums.experts[r]:
            edp = s.dp // s.ep
            groups.append((sums.experts[r], edp, link_for(self.cluster, size=edp, stride=s.tp * s.ep)))

        def ct(kind: str, per_param: float) -> float:
            return sum(collective_time(kind, n * per_param, size, link, f.eff_link) for n, size, link in groups)

        if s.zero_stage <= 1:
            ar = ct("all_reduce", g_item)
            ag = ct("all_gather", 4) if s.zero_stage == 1 else 0.0  # ZeroRedundancyOptimizer broadcast
            comm.by_kind["all_reduce"] = comm.by_kind.get("all_reduce", 0.0) + ar
            if ag:
                comm.by_kind["all_gather"] = comm.by_kind.get("all_gather", 0.0) + ag
            window = sums.fwdbwd[bottleneck] * 2 / 3  # gradients of the last micro-batch's backward (no_sync)
            exposed_kind = {"all_reduce": ar - min(f.overlap_dp * ar, window), "all_gather": ag}
            exposed = ar - min(f.overlap_dp * ar, window) + ag
        else:
            rs = m * ct("reduce_scatter", g_item)
            ag = (1 if s.zero_stage == 2 else 2 * m) * ct("all_gather", p_item)
            comm.by_kind["reduce_scatter"] = comm.by_kind.get("reduce_scatter", 0.0) + rs
            comm.by_kind["all_gather"] = comm.by_kind.get("all_gather", 0.0) + ag
            window = m * sums.fwdbwd[bottleneck]
            ov = f.overlap_fsdp if s.zero_stage == 3 else f.overlap_dp
            total = rs + ag
            exposed = total - min(ov * total, window)
            exposed_kind = {"reduce_scatter": exposed * rs / total, "all_gather": exposed * ag / total}
        for kk, v in exposed_kind.items():
            if v:
                comm.exposed_by_kind[kk] = comm.exposed_by_kind.get(kk, 0.0) + v
        return exposed

    def _rank_memory(self, s: Setting, sums: RankSums, r: int) -> MemoryBreakdown:
        """Bytes on pipeline rank ``r`` at its peak: the largest of its :meth:`_rank_moments`."""
        pb, ob, moments = self._rank_moments(s, sums, r)
        peak = max(moments, key=lambda mo: mo.weight)
        return self._breakdown(pb, ob, peak, margin_of=peak.weight)

    def _breakdown(self, pb: float, ob: float, mo: PeakMoment, *, margin_of: float) -> MemoryBreakdown:
        terms = {k: v for k, v in mo.terms.items() if v}
        acts = sum(v for k, v in terms.items() if MEMORY_TERMS[k] == "activations")
        mbd = MemoryBreakdown(pb, mo.grads, ob, acts, sum(terms.values()) - acts, terms=terms)
        mbd.margin = with_margin(pb + ob + margin_of, self.f)
        return mbd

    def _rank_moments(self, s: Setting, sums: RankSums, r: int, per_op: bool = False
                      ) -> tuple[float, float, list[PeakMoment]]:
        """Rank ``r``'s parameter and optimizer-state bytes, and the moments of its step its peak can be at: each
        layer's forward (no gradient yet unless they accumulate over micro-batches; its FSDP unit's all-gather
        output) and backward (and its recompute's forward; every saved activation of the earlier layers alive, the
        later layers' gradients, FSDP's gathered units; gradients of earlier micro-batches only where they
        accumulate, since zero_grad(set_to_none=True) frees them each step), the last rank's loss backward, and the
        optimizer step (all gradients, plus a foreach temporary of their size). ``per_op``: also each layer's
        backward at each of its ops (:attr:`LayerTerms.op_deltas`; ``PeakMoment.op``)."""
        prof, m = self.prof, s.micro_batches
        half = s.amp != "none"
        p_item = ITEMSIZE[DTYPE_NAMES.get(s.amp, "float32")]
        g_item = ITEMSIZE["float32"]
        sb = state_bytes(s.optimizer)
        params, experts = sums.params[r], sums.experts[r]
        edp = s.dp // s.ep  # expert parallelism: the ranks holding the same experts shard their states
        pb, gb, ob = (a + b for a, b in zip(model_states(params - experts, dp=s.replicas, zero_stage=s.zero_stage,
                                                         states=sb),
                                            model_states(experts, dp=edp, zero_stage=s.zero_stage, states=sb),
                                            strict=True))
        held: dict[str, float] = {}  # buffers alive the whole forward/backward
        if s.zero_stage == 2:  # its unsharded parameters, kept from forward to backward: fsdp_buffers, the loss
            pb = (params - experts) * sb.param / s.replicas + experts * sb.param / edp
        elif s.zero_stage == 3:
            held["fsdp_root_params"] = sums.nofsdp[r] * p_item
        elif half:
            held["autocast_weight_copies"] = sums.casts[r] * 2  # of the weights its lower-precision ops read
        held["ddp_buckets"] = ddp_bucket_bytes(s, params - experts)
        flight = in_flight(s.schedule, pp=s.pp, stage=r, micro_batches=m, virtual_stages=s.virtual_stages)
        pipe = sums.pipe[r]
        # runtime/pp.py's LeanStage: a micro-batch's input buffers from its receive to its backward, the gradients'
        # for its backward; its stage output from its forward to its backward. At a moment with ``others`` other
        # micro-batches in flight, ``others + 1`` hold theirs (0 bytes unpipelined)
        recv, grad_recv, kept_out = (pipe["recv"], pipe["grad_recv"], pipe["kept"]) if s.pp > 1 else (0.0, 0.0, 0.0)
        # torch's one-stage-per-rank schedules keep the previous micro-batch's input-gradient sends referenced
        # through the next backward (SENDS_HELD): a backward after the rank's first holds those gradients too
        sent_before = pipe["grad_sent"] if s.pp > 1 and s.schedule in SENDS_HELD else 0.0

        def pipeline_terms(others: float, later: bool) -> dict[str, float]:
            if s.pp == 1:
                return {}
            return {"pipeline_buffers": (others + 1) * recv + grad_recv, "pipeline_outputs": (others + 1) * kept_out,
                    "pipeline_sent_gradients": sent_before if later else 0.0}
        # the rank's backward moments, as (other micro-batches holding all their activations, gradients alive; None:
        # only those of the layers after the one in backward): its first backward when every micro-batch's forward
        # ran before it (GPipe; 1F1B where m <= pp - r), no gradients yet, and the next, with fewer in flight and
        # every gradient; otherwise the steady one, the earlier micro-batches' gradients accumulated
        flights = [(flight - 1, gb)] if flight < m else [(flight - 1, None)] + ([(flight - 2, gb)] if m > 1 else [])
        # a layer's backward (its working set and FSDP's gathered units)
        per_param = gb / params if params else 0.0  # bytes of gradient per local parameter (ZeRO 2/3: sharded)
        # (a pipeline stage's received inputs that its layers save are its receive buffers: counted there)
        rs = pipe["recv_saved"] if s.pp > 1 else 0.0
        out = []
        held_sum, fsdp_at = sum(held.values()), {}  # (layer, forward) -> (FSDP's buffers then, their sum)
        later = [None] if len(flights) == 1 else [False, True]
        for (others, g), late in zip(flights, later, strict=True):
            pipe_now = pipeline_terms(others, g is not None)
            shared = held_sum + sum(pipe_now.values())
            for a, w, before, layer, phase, ops in sums.bwd_layers[r]:
                forward = phase == "forward"
                if forward and late:  # a rank's later backward: its forwards ran before its first
                    continue
                if (layer, forward) not in fsdp_at:
                    fb = fsdp_buffers(sums.units[r], layer, zero_stage=s.zero_stage, p_item=p_item, g_item=g_item,
                                      forward=forward, params=params)
                    fsdp_at[layer, forward] = fb, sum(fb.values())
                fb, fb_sum = fsdp_at[layer, forward]
                work = "forward_working_set" if forward else "backward_working_set"
                for op, dw, da, dbefore in ((None, 0.0, 0.0, 0.0), *(ops if per_op else ())):
                    alive = (others + 1) * -rs + others * sums.acts[r] + a + da
                    grads = g if g is not None else 0.0 if forward else (params - before - dbefore) * per_param
                    out.append(PeakMoment(phase, layer, grads, ({"saved_activations": alive, work: w + dw}, fb, held,
                                                                pipe_now),
                                          grads + alive + w + dw + fb_sum + shared, op, late))
        if r == s.pp - 1 and prof.output_numel and not s.fused_loss:  # fused: in the head layer's working set
            # the last rank's loss backward: log-softmax output (fp32) saved, its gradient and the logits' gradient
            # alive; FSDP units are resharded then
            lp_div = s.tp if (prof.loss_parallel and s.tp > 1 and sums.head_tp) else 1
            out_numel = prof.output_numel * (s.mb_samples / prof.batch) * self.seq_ratio / s.cp
            loss_saved = out_numel * 4 / lp_div
            # gradients of the log-softmax and of the logits; torch's loss_parallel backward holds three fp32
            # temporaries of the logits' shard beside the saved one (measured with MemTracker, torch 2.13: 4 x the
            # shard's fp32 bytes at tp 2 and 4, in fp32 and under bf16 autocast). Unsplit, the default loss's forward
            # holds the logits and their flattened copy (the next-token slice is not contiguous) in the compute
            # dtype, and under autocast the float32 copy ``.float()`` makes (runtime/data.py default_loss)
            loss_temp = out_numel * 4 * 3 / lp_div if lp_div > 1 else out_numel * (2 * p_item + (4 if half else 0))
            for (others, g), late in zip(flights, later, strict=True):
                loss = {"saved_activations": (others + 1) * (sums.acts[r] - rs), "loss_saved": loss_saved,
                        "loss_temporaries": loss_temp}
                if s.zero_stage == 2:  # every unit's parameters still unsharded: no backward has run
                    loss["fsdp_unsharded_params"] = params * p_item
                pipe_now = pipeline_terms(others, g is not None)
                out.append(PeakMoment("loss", None, g or 0.0, (loss, held, pipe_now), (g or 0.0) + sum(
                    loss.values()) + held_sum + sum(pipe_now.values()), later=late))
        # the optimizer step: every gradient and foreach temporaries (CUDA: a list the size of the gradients; CPU:
        # one parameter at a time); autocast's weight copies are gone, ZeRO 2's gathered parameters resharded
        # (CPU: torch's single-tensor Adam holds two of the largest parameter's size at once: exp_avg_sq.sqrt() and
        # its quotient by the bias correction; measured with MemTracker, LLaMA)
        at_opt = {"optimizer_step_temporaries": gb if prof.device_kind == "cuda" else 2 * sums.largest[r] * g_item,
                  "ddp_buckets": held["ddp_buckets"],
                  "fsdp_root_params": 0.0 if half else held.get("fsdp_root_params", 0.0)}
        out.append(PeakMoment("step", None, gb, (at_opt,), gb + sum(at_opt.values())))
        return pb, ob, out

    def rank_moments(self, s: Setting, choices: list[LayerChoice], *, per_op: bool = False) -> list[list[tuple]]:
        """Per pipeline rank, every moment :meth:`evaluate` weighs for the rank's peak: (phase — "forward",
        "backward", "recompute", "loss" or "step" —, the layer's index in a layer's phase, else None, the
        bytes then, each with the margin of the rank's peak). A measured peak's components compare with the
        moment it is at (``bench/memory.py``). ``per_op``: each tuple ends with the op (graph index) a layer's
        backward is at, None at its largest, and whether it is a later micro-batch's (:attr:`PeakMoment.later`);
        every other op of the layer is added."""
        sums = self.sum_layers(s, choices)
        out = []
        for r in range(s.pp):
            pb, ob, moments = self._rank_moments(s, sums, r, per_op=per_op)
            top = max(mo.weight for mo in moments if mo.op is None)
            out.append([(mo.phase, mo.layer, self._breakdown(pb, ob, mo, margin_of=top),
                         *((mo.op, mo.later) if per_op else ())) for mo in moments])
        return out

    def _throughput(self, s: Setting, sums: RankSums, cost: Cost) -> None:
        """Fill ``cost``'s FLOP rates, MFU and samples/tokens per second from its step time."""
        world = s.dp * s.tp * s.pp * s.cp
        step = cost.step_time_s
        samples = s.dp * s.micro_batches * s.mb_samples
        # FLOPs summed over the chain are those of one micro-batch for one model replica; scale to the step
        step_model_flops = sums.model_flops * s.micro_batches * s.replicas  # a cp rank: 1/cp of the replica's
        step_hw_flops = sums.hw_flops * s.micro_batches * s.replicas
        peak_flops = self.cluster.device.flops(DTYPE_NAMES[s.amp] if s.amp != "none" else "float32")
        cost.model_tflops_per_gpu = step_model_flops / world / step / 1e12
        cost.hardware_tflops_per_gpu = step_hw_flops / world / step / 1e12
        cost.mfu = step_model_flops / world / step / peak_flops
        cost.tokens_per_s = samples * self.prof.seq_len * self.seq_ratio / step if self.prof.seq_len else None
        cost.samples_per_s = samples / step


class PeakMoment(NamedTuple):
    """One moment of a rank's step that its peak memory can be at (:meth:`Evaluator._rank_moments`)."""

    phase: str
    """one of "forward" (a layer's, not recomputed), "backward" (a layer's), "recompute" (a layer's forward run again
    in its backward), "loss", "step"."""
    layer: int | None
    """the layer whose backward or recompute it is in"""
    grads: float
    """gradient bytes alive"""
    parts: tuple[dict[str, float], ...]
    """the other bytes alive, by :data:`~autopar_nb.plan.MEMORY_TERMS` name, in the groups the moments share
    (merged by :attr:`terms` only for the moment a peak is at: the planner weighs ~10^5 moments a search)"""
    weight: float
    """all of them (what the peak is chosen by)"""
    op: int | None = None
    """in a layer's backward: at the backward of this op (its graph index), not at the layer's largest"""
    later: bool | None = None
    """a pipeline rank's backward (or loss) after its first micro-batch's (True), at its first (False); None where
    one moment stands for every micro-batch"""

    @property
    def terms(self) -> dict[str, float]:
        """The bytes alive besides the gradients, by term (saved activations at least 0)."""
        out = {k: v for part in self.parts for k, v in part.items()}
        if "saved_activations" in out:
            out["saved_activations"] = max(out["saved_activations"], 0.0)
        return out


class FsdpUnit(NamedTuple):
    """One ``fully_shard`` group of consecutive layers."""

    first: int
    last: int
    """the indices of its first and last layers"""
    numel: float
    """its local parameters"""


def moment_layers(cnt: int) -> list[int]:
    """Which of a run of ``cnt`` identical layers (0 = its first) a backward peak can be at: the saved tensors
    alive grow by one layer's from one to the next and the gradients shrink by one layer's, so the extremes, and
    the layers next to them, where FSDP's buffers change (a prefetch only after an earlier unit, a reduce-scatter
    only after a later one, :func:`fsdp_buffers`)."""
    return sorted({j for j in (cnt - 1, cnt - 2, 1, 0) if 0 <= j < cnt}, reverse=True)


def fsdp_buffers(units: list[FsdpUnit], layer: int, *, zero_stage: int, p_item: int, g_item: int,
                 params: float, forward: bool = False) -> dict[str, float]:
    """FSDP2's buffers (bytes) while ``layer`` runs its backward (measured with FSDPMemTracker under a fake group,
    LLaMA and ViT, ZeRO-3 + full recompute, bf16): ZeRO-3 gathers the layer's unit again (its unsharded
    parameters in the compute dtype) and prefetches the unit before it (the all-gather's output,
    ``fsdp_gathered_units``); under ZeRO 2 and 3 the unit after it, whose backward ran last, still holds the input
    of its gradients' reduce-scatter (``reduce_dtype``, float32: the unsharded gradients flattened), freed only
    when the next unit's reduce-scatter starts (``fsdp_reduce_scatter``). ``forward``: while it runs its forward,
    the output of its unit's all-gather (``fsdp_all_gather``, measured: ViT, ZeRO 2, bf16) beside, under ZeRO 3,
    the unit's unsharded parameters.

    ZeRO 2 (``reshard_after_forward=False``) keeps every unit's unsharded parameters from its forward to the end of
    its backward (``fsdp_unsharded_params``; ``params``: the rank's parameters, its root's included): in a forward
    all of them (the peak is the last layer's), in a layer's backward or recompute all but those of the units after
    it, whose backward resharded them (measured: Mixtral, ZeRO 2, fp32, full recompute, peaking in layer 2 of 4:
    layer 3's unit already freed, 6.8 MiB of buffers over without this)."""
    if zero_stage < 2:
        return {}
    at = bisect.bisect_right(units, layer, key=lambda u: u.first) - 1  # units are consecutive, in layer order
    unsharded = {}
    if zero_stage == 2:
        later = 0.0 if forward else sum(u.numel for u in units[at + 1:])
        unsharded = {"fsdp_unsharded_params": (params - later) * p_item}
    if at < 0 or units[at].last < layer:  # a layer of the root's (embedding, head): no unit of its own
        return unsharded
    if forward:
        gathered = {"fsdp_gathered_units": units[at].numel * p_item} if zero_stage == 3 else {}
        return {"fsdp_all_gather": units[at].numel * p_item, **gathered, **unsharded}
    out = {"fsdp_reduce_scatter": units[at + 1].numel * g_item if at + 1 < len(units) else 0.0, **unsharded}
    if zero_stage == 3:
        out["fsdp_gathered_units"] = (units[at].numel + (units[at - 1].numel if at else 0.0)) * p_item
    return out


def ddp_bucket_bytes(s: Setting, params: float) -> float:
    """DDP's gradient buckets: flat fp32 tensors the size of the parameters it reduces, held for the whole run
    (``gradient_as_bucket_view=False``, as ``runtime/ddp.py`` builds it: the gradients are copied in, not views).
    Only where the runtime uses DDP: dp > 1, ZeRO 0/1, no TP (with TP it uses FSDP2's replicate, which has no
    buckets)."""
    return params * ITEMSIZE["float32"] if s.replicas > 1 and s.zero_stage < 2 and s.tp == 1 else 0.0


def setting_of(plan) -> tuple[Setting, list[LayerChoice]]:
    """The (Setting, per-layer choices) a :class:`~autopar_nb.plan.Plan` stands for."""
    m = plan.mesh
    mb = plan.batch.global_batch / (m.dp * plan.batch.micro_batches)
    # a layer the planner put under TP: split modules, or only sequence-parallel norms (the final norm between SP
    # blocks and a vocab-parallel head): the runtime then shards its activations along the sequence
    tp_on = [any(st in ("colwise", "rowwise", "sequence_parallel") for st in lp.tp.values()) for lp in plan.layers]
    sp = any(lp.sequence_parallel for lp in plan.layers)
    s = Setting(m.dp, m.tp, m.pp, m.zero_stage, plan.precision.amp, plan.batch.micro_batches, mb,
                plan.pipeline.schedule, plan.pipeline.virtual_stages, sp, plan.optimizer.name, m.ep,
                bool(plan.fused_loss), m.cp, plan.fused_norm)
    choices = [LayerChoice(lp.stage, on, lp.recompute, lp.fsdp, lp.compile)
               for lp, on in zip(plan.layers, tp_on, strict=True)]
    return s, choices


def estimate(graph, cluster, plan, *, factors: Factors | None = None) -> Cost:
    """Cost of an existing plan (e.g. one a user edited) on ``cluster``: the planner's own model, no search."""
    ev, s, choices = _evaluator_of(graph, cluster, plan, factors)
    return ev.evaluate(s, choices)


def peak_moments(graph, cluster, plan, *, factors: Factors | None = None, per_op: bool = False) -> list[list[tuple]]:
    """Per pipeline rank of ``plan``, every moment its predicted peak memory is chosen from
    (:meth:`Evaluator.rank_moments`, with ``per_op`` each layer's backward at each of its ops too): what a measured
    peak's components compare with, at the moment it is at."""
    ev, s, choices = _evaluator_of(graph, cluster, plan, factors)
    return ev.rank_moments(s, choices, per_op=per_op)


def _evaluator_of(graph, cluster, plan, factors: Factors | None) -> tuple[Evaluator, Setting, list[LayerChoice]]:
    from .loss import fused_head
    from .norm import fused_norm_profile
    from .profile import profile_of

    prof = profile_of(graph, "cpu" if cluster.name == "cpu" else "cuda", fp32_ops=plan.precision.fp32_ops,
                      low_precision_ops=plan.precision.low_precision_ops)
    norm_prof = fused_norm_profile(graph, prof.device_kind, fp32_ops=plan.precision.fp32_ops,
                                   low_precision_ops=plan.precision.low_precision_ops) if plan.fused_norm else None
    if plan.fused_norm and norm_prof is None:
        raise ValueError("plan.fused_norm is set, but this model has no RMSNorm module; re-plan for this model")
    if [lp.path for lp in plan.layers] != [lay.path for lay in graph.layers]:
        raise ValueError("the plan's layers do not match the graph's; re-plan for this model")
    seq_ratio = plan.batch.seq_len / graph.seq_len if plan.batch.seq_len and graph.seq_len else 1.0
    s, choices = setting_of(plan)
    head = None
    if plan.fused_loss:
        head, why = fused_head(graph)
        if head is None or head.module != plan.fused_loss:
            raise ValueError(f"plan.fused_loss={plan.fused_loss!r} does not name this model's output head: "
                             f"{why or f'the head is {head.module}'}; re-plan for this model")
    ev = Evaluator(prof, cluster, factors=factors, seq_ratio=seq_ratio, head=head, norm_prof=norm_prof)
    return ev, s, choices
