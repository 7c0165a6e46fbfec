"""Tie memory, communication and time into a :class:`~autopar_nb.plan.Cost` for one set of choices.

:class:`Evaluator` holds the graph's profile and caches per-layer terms by (repeated-block
representative, TP on, sequence parallel, AMP, micro-batch size), so evaluating a candidate is
arithmetic over the layer chain.
"""

from __future__ import annotations

from collections import defaultdict

from ..plan import DTYPE_NAMES, ITEMSIZE, RECOMPUTE, Cost
from .async_tp import async_tp_exposed, hide_pipelined, tp_matmul_time
from .comm import collective_time, link_for
from .cpu import issue_time, layer_cpu
from .dp_comm import data_parallel_comm
from .factors import Factors, factors_for
from .float8 import float8_weights_local, gathered_in_float8
from .loss import FusedHead, gathered_logits
from .memory import activation_bytes, forward_peak, input_pass, op_deltas, op_moments, peak_op
from .peak import RankMemory, moment_layers, rank_peaks
from .profile import GraphProfile, precision_of
from .saved import run_saved
from .schedule import MULTI_STAGE, ZERO_BUBBLE
from .setting import LayerChoice, Setting, setting_of
from .terms import CommTime, FsdpUnit, InputLayer, LayerTerms, RankSums, StageSums, shared_sums
from .time import (
    bubble_fraction,
    layer_compute_time,
    model_flops,
    optimizer_time,
    pass_flops,
    weight_cast_time,
)


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

    # ---- per layer -------------------------------------------------------------------------------
    def terms(self, i: int, *, tp: int, sp: bool, precision: str, mb_samples: float, ep: int = 1,
              compiled: bool = False, cp: int = 1, amp: str = "bf16", fused_norm: bool = False,
              float8: bool = False, async_tp: bool = False, gather: bool = False,
              f8_gathered: bool = False, routed: float = 1.0) -> LayerTerms:
        """Per-layer terms, cached by the layer's repeated-block representative. ``precision``: one
        of :data:`~.profile.PRECISIONS` (:func:`~.profile.precision_of`); ``amp``: autocast's dtype
        there ("bf16", "fp16": its peak FLOP/s). With context parallelism (``cp``) a rank holds 1/cp
        of every sequence: its compute and activations are divided by cp (with torch's load
        balancing, causal attention's work too), and each attention layer all-gathers the keys and
        values in forward and again in backward, and passes their float32 gradients round the ring
        cp times (``_templated_ring_attention_backward``); the gathered keys and values are one more
        working buffer. ``fused_norm``: as the fused-norm graph profiles it (:attr:`norm_prof`);
        ``float8``: :mod:`.float8`; ``async_tp``: :mod:`.async_tp`; ``gather``: the layer gathers
        SP's shards at its input (``prof.sp_gather``); ``f8_gathered``: FSDP gathers the float8
        weights cast (:func:`.float8.gathered_in_float8`); ``routed``: see ``at_routing``."""
        fused_norm = fused_norm and self.norm_prof is not None
        key = (self.prof.rep[i], tp, sp, precision, mb_samples, ep, compiled, cp, amp, fused_norm,
               float8, async_tp, gather, f8_gathered, routed)
        half = precision != "fp32"
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        prof = self.norm_prof if fused_norm else self.prof
        lp = prof.layers[self.prof.rep[i]].at_tp(tp).at_routing(routed)  # (at_tp: repeated k/v)
        scale = mb_samples / self.prof.batch * self.seq_ratio / cp
        qscale = mb_samples / self.prof.batch * self.seq_ratio ** 2 / cp
        low = DTYPE_NAMES[amp] if amp != "none" else "bfloat16"
        fwd, bwd, sel = layer_compute_time(lp, tp=tp, sp=sp, precision=precision, scale=scale,
                                           quad_scale=qscale, device=self.cluster.device,
                                           factors=self.f, compiled=compiled, low_dtype=low,
                                           float8=float8, f8_weight_cast=not f8_gathered)
        act = {r: activation_bytes(lp, tp=tp, sp=sp, recompute=r, precision=precision, scale=scale,
                                   quad_scale=qscale, megatron_sp=self.megatron_sp)
               for r in RECOMPUTE}
        comm: dict[str, float] = {}
        step_s = 0.0  # once per step, not per micro-batch
        if tp > 1:
            link = link_for(self.cluster, size=tp, stride=1)
            for c in [*lp.comms, *self.prof.sp_gather_comms] if gather else lp.comms:
                if c.phase == "step":
                    step_s += collective_time(c.kind, c.nbytes, tp, link, self.f.eff_link)
                    continue
                nbytes = (c.half_bytes if half else c.nbytes) * scale
                # sequence parallel turns an all-reduce into a reduce-scatter and an all-gather
                kinds = (("reduce_scatter", "all_gather") if sp and c.kind == "all_reduce"
                         else (c.kind,))
                for k in kinds:
                    comm[k] = comm.get(k, 0.0) + collective_time(k, nbytes, tp, link,
                                                                 self.f.eff_link)
        out = (lp.output_amp[precision] if half else lp.output_bytes) * scale / (tp if sp else 1)
        moments = op_moments(lp, tp=tp, sp=sp, scale=scale, precision=precision, quad_scale=qscale,
                             megatron_sp=self.megatron_sp)
        if cp > 1 and lp.kv_bytes:
            ring = self._ring(lp, comm, cp=cp, tp=tp, half=half, scale=scale)
            moments = [(op, w + ring if op in lp.attention_ops else w, fr, lat)
                       for op, w, fr, lat in moments]
            # the ring merges the output's chunks with torch.cat: transposing it back to (B, T,
            # heads, hd) is a copy, which the output projection saves beside what the ring's
            # backward keeps (not the last cp rank's, whose last merge keeps the kernel's layout:
            # the first rank's is what counts)
            act["none"] += (lp.q_half if half else lp.q_bytes) * scale / tp
        work, freed, later = peak_op(moments)
        fwd_fl, bwd_fl = pass_flops(lp, scale=scale, quad_scale=qscale)
        experts = lp.params_experts / ep if ep > 1 and lp.experts else 0.0
        mm = tp_matmul_time(lp, tp=tp, scale=scale, device=self.cluster.device, factors=self.f,
                            low_dtype=low)
        exposed = async_tp_exposed(comm, overlap=self.f.overlap_tp,
                                   matmul_s=mm if async_tp and tp > 1 else 0.0)
        a2a_fwd, a2a = (self._all_to_alls(lp, ep=ep, tp=tp, half=half, scale=scale) if experts
                        else (0.0, 0.0))
        local = lp.params_split / tp + lp.params_rep - (lp.params_experts - experts if experts
                                                        else 0)
        t = LayerTerms(fwd, bwd, sel, act, local, comm, out, work, fwd_fl + bwd_fl, fwd_fl,
                       lp.quad_flops * qscale + (lp.sel_split + lp.sel_rep) * scale,
                       lp.largest_param / (tp if lp.tp else 1), exposed + a2a,
                       experts, a2a_fwd)
        comm.update({"all_to_all": a2a} if a2a else {})
        t.tp_step, t.freed, t.later_params = step_s, freed, later
        t.op_deltas = op_deltas(moments, (work, freed, later), local)
        t.forward = {
            rec: forward_peak(lp, tp=tp, sp=sp, scale=scale, precision=precision, quad_scale=qscale,
                              megatron_sp=self.megatron_sp, recompute=rec)
            for rec in RECOMPUTE
        }
        t.cast_local = lp.cast_split / tp + lp.cast_rep if precision == "autocast" else 0.0
        t.whole_grads = lp.embedding_params * (1 - 1 / tp)
        t.f8_weights_local = float8_weights_local(lp, tp) if float8 else 0.0
        t.weight_grads, t.input_work, t.input_ops = input_pass(lp, tp=tp, sp=sp, scale=scale,
                                                               precision=precision,
                                                               quad_scale=qscale,
                                                               megatron_sp=self.megatron_sp)
        styled = len(lp.tp) + (len(lp.norms) if sp else 0) if tp > 1 else 0
        t.cpu = layer_cpu(lp.n_ops + (lp.time_amp[precision].casts if half else 0), styled=styled,
                          compiled=compiled, factors=self.f)
        t.tensors, t.model_flops = lp.param_tensors, model_flops(lp, scale=scale, quad_scale=qscale)
        self._cache[key] = t
        return t

    def _ring(self, lp, comm: dict[str, float], *, cp: int, tp: int, half: bool,
              scale: float) -> float:
        """Context parallelism's collectives of one layer and micro-batch added to ``comm`` (see
        :meth:`terms`; the cp ranks are consecutive at stride tp); returns the bytes the ring's
        backward holds at the attention op (``_templated_ring_attention_backward``, torch 2.13): the
        gathered keys and values, the all-gather's input (this rank's, concatenated), float32
        accumulators of dQ, dK and dV (``zeros_like``), and the float32 dK, dV it sends round the
        ring and the ones it receives; of its 1/tp of the heads under TP."""
        link = link_for(self.cluster, size=cp, stride=tp)
        item = 2 if half else lp.kv_bytes / (lp.kv_half / 2)
        kv, q = lp.kv_half / 2 * scale / tp, lp.q_half / 2 * scale / tp  # this rank's elements
        whole = kv * item * cp  # this micro-batch's keys and values
        held = whole + kv * item + (q + kv) * 4 + 2 * kv * 4
        comm["all_gather"] = comm.get("all_gather", 0.0) + 2 * collective_time("all_gather", whole,
                                                                               cp, link,
                                                                               self.f.eff_link)
        grads = kv * ITEMSIZE["float32"]  # this rank's dK, dV, accumulated in float32
        comm["send_recv"] = comm.get("send_recv", 0.0) + cp * collective_time("send_recv", grads,
                                                                              cp, link,
                                                                             self.f.eff_link)
        return held

    def _all_to_alls(self, lp, *, ep: int, tp: int, half: bool,
                     scale: float) -> tuple[float, float]:
        """(forward, forward + backward) seconds of expert parallelism's all-to-alls in one layer
        and micro-batch (``runtime/ep.py``: 5 per experts module and step, counted on real runs):
        the per-expert token counts (E integers), the token rows out to the experts and back in
        forward, the same two in backward. The ep ranks are consecutive data-parallel ranks (stride
        tp). Balanced routing: every rank sends and receives the average; a skewed router makes the
        busiest rank's share the time, which this does not model."""
        link = link_for(self.cluster, size=ep, stride=tp)
        rows = (lp.dispatch_half if half else lp.dispatch_bytes) * scale / len(lp.experts)
        one = collective_time("all_to_all", rows, ep, link, self.f.eff_link)
        counts = sum(collective_time("all_to_all", 8 * e, ep, link, self.f.eff_link)
                     for e in lp.experts.values())
        n = len(lp.experts)
        return counts + 2 * n * one, counts + 4 * n * one

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
        p2p_exposed = self._pipeline_comm(s, sums, comm)
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

    @shared_sums
    def sum_layers(self, s: Setting, choices: list[LayerChoice]) -> RankSums:
        """One pass over the layer chain (runs of identical layers at once): per pipeline rank
        sums."""
        prof, pp = self.prof, s.pp
        sums = RankSums.zeros(pp)
        runs = self.runs(choices)
        # the shared inputs a rank's checkpoints keep already
        kept: list[set[str]] = [set() for _ in range(pp)]
        rank_of = s.rank_of
        tied = self._tied_gradients(s, choices)
        for i, cnt, ch in runs:
            r = rank_of(ch.stage)
            lt = self.choice_terms(i, s, ch)
            sums.fwdbwd[r] += cnt * (lt.fwd + lt.bwd)  # time
            sums.rec[r] += cnt * lt.recompute_s(ch.recompute)
            if lt.tp_comm:
                sums.tpc[r] += cnt * lt.tp_exposed
                kinds = sums.tp_kind[r]
                for kk, v in lt.tp_comm.items():
                    kinds[kk] = kinds.get(kk, 0.0) + cnt * v
            # memory
            acts_before = sums.acts[r]
            saved, whole, held = run_saved(self, s, i, cnt, ch, lt, kept[r])
            sums.acts[r] += saved
            # a recomputed layer's backward first runs its forward again: what the plain forward
            # saves and the recompute did not keep is alive again beside the working set
            again = max(lt.act["none"] - lt.act[ch.recompute], 0.0)
            # each op's moment holds the gradients accumulating for what later ops read (profile's
            # _accumulating_gradients): the residual stream's, whose skip the block's last add reads
            wb, freed, ops = lt.work_bytes + again, lt.freed, lt.op_deltas
            if s.fused_loss and i <= self.head.layer < i + cnt:
                wb, again, freed, ops = self._fused_head(s, sums, r, ch.recompute, lt,
                                                         tp=s.tp if ch.tp else 1), \
                    0.0, 0.0, ()
            if wb > sums.work[r]:
                sums.work[r] = wb
            # the fused LSE
            head_saved = sums.acts[r] - acts_before - whole - cnt * lt.act[ch.recompute] + held[-1]
            # a layer's peak is its largest op's backward: the output that op's consumers saved is
            # freed by then (memory.peak_op), the layer's own gradients are still to come. Its last
            # layer runs backward first; by its first, the gradients of the others exist (the peak
            # there when a layer's gradients outweigh what it saves: full recompute, measured on
            # LLaMA)
            for j in moment_layers(cnt):
                sums.bwd_layers[r].append((acts_before + whole
                                           + (j + 1) * lt.act[ch.recompute] - held[j] + head_saved
                                           + again - freed, wb - again + tied.get(i + j, 0.0),
                                           sums.params[r]
                                           + (j + 1) * lt.params_local - lt.later_params, i + j,
                                           "backward", ops))
                replayed = max(lt.forward[ch.recompute], again) if ch.recompute != "none" else 0.0
                if replayed:
                    # its recompute, before its backward, beside the gradient of its output: at its
                    # end, every tensor it saves again re-made, or where an op's forward holds more
                    # (lt.forward), what it has recomputed by then (measured: BERT's math attention
                    # under bf16 autocast)
                    sums.bwd_layers[r].append((acts_before + whole
                                               + (j + 1) * lt.act[ch.recompute] - held[j]
                                               + head_saved + replayed,
                                               lt.out_bytes + tied.get(i + j, 0.0), sums.params[r]
                                               + (j + 1) * lt.params_local, i + j, "recompute", ()))
            head = (ch.tp and s.tp > 1 and prof.layers[i].vocab and not prof.layers[i].norms
                    and i == len(choices) - cnt)
            if ch.recompute == "none" and not head_saved:
                # the run's last layer's forward: every earlier layer's saved tensors, and its own
                # forward's largest moment (the storages alive then; no gradient exists yet in a
                # step's first forward)
                gather = gathered_logits(s, prof, self.seq_ratio) if head else 0.0
                sums.bwd_layers[r].append((acts_before + whole + (cnt - 1) * lt.act["none"],
                                           lt.forward["none"] + gather, 0.0, i + cnt - 1, "forward",
                                           ()))
            sums.layers[r] += cnt
            sums.full_recompute[r] += cnt if ch.recompute == "full" else 0
            sums.experts_upto[r].update({i + j: sums.experts[r] + (j + 1) * lt.experts_local
                                         for j in range(cnt)})
            sums.experts[r] += cnt * lt.experts_local
            for name, per_layer in (("params", lt.params_local), ("tp_step", lt.tp_step),
                                    ("casts", lt.cast_local), ("f8_weights", lt.f8_weights_local),
                                    ("tensors", lt.tensors), ("whole_grads", lt.whole_grads)):
                getattr(sums, name)[r] += cnt * per_layer
            sums.cpu_ops[r] += cnt * lt.cpu_s("eager ops", ch.recompute)
            sums.cpu_tp[r] += cnt * lt.cpu_s("tensor parallel", ch.recompute)
            sums.largest[r] = max(sums.largest[r], lt.largest_param)
            if ch.fsdp:
                self._add_units(sums.units[r], i, cnt, lt.params_local)
            else:
                sums.nofsdp[r] += cnt * lt.params_local
            sums.head_tp = sums.head_tp or bool(head)  # the head (last run) split by TP
            sums.model_flops += cnt * lt.model_flops
            sums.hw_flops += cnt * (lt.flops + lt.recompute_flops(ch.recompute))
            if pp > 1 and s.schedule in MULTI_STAGE:
                self._stage_sums(s, sums, r, i, cnt, ch.stage, lt)
        if pp > 1:
            self.pipeline_sums(s, choices, sums)
        return sums

    def _stage_sums(self, s: Setting, sums: RankSums, r: int, i: int, cnt: int, stage: int,
                    lt: LayerTerms) -> None:
        """After the run of layers ``i`` .. ``i + cnt - 1`` on rank ``r`` is summed: its stage's
        :class:`.terms.StageSums` (a rank of a multi-stage schedule holds its stages' micro-batches
        apart: :mod:`.schedule`) and, under a zero-bubble schedule, the run's input-pass moments."""
        held = sums.stages[r]
        if not held or held[-1].stage != stage:
            last = held[-1] if held else StageSums(-1, 0.0, 0.0)
            held.append(StageSums(stage, last.acts_start + last.acts,
                                  last.params_start + last.params))
        st = held[-1]
        for j in range(cnt):
            sums.local[i + j] = len(held) - 1
        if s.schedule in ZERO_BUBBLE:
            for j in moment_layers(cnt):
                sums.input_layers[r].append(InputLayer(i + j, lt.input_work, lt.input_ops,
                                                       st.weight_grads + (j + 1) * lt.weight_grads))
        st.weight_grads, st.whole_grads = (st.weight_grads + cnt * lt.weight_grads,
                                           st.whole_grads + cnt * lt.whole_grads)
        st.acts, st.params = sums.acts[r] - st.acts_start, sums.params[r] - st.params_start

    def pipeline_sums(self, s: Setting, choices: list[LayerChoice], sums: RankSums) -> None:
        """Fill ``sums.pipe`` and ``sums.p2p`` from the tensors crossing each cut
        (:attr:`GraphProfile.crossings`), as the runtime's pipeline stages (``runtime/pp.py``'s
        ``LeanStage``) hold them: the receiving stage a buffer per micro-batch in flight for every
        one (its layers' saved activations point into it), the sending stage its own outputs until
        each micro-batch's backward (the last stage: the model's output, or with the fused head its
        input, which the fused op holds anyway), and a buffer for each gradient coming back to the
        micro-batch in backward. A stage holding a layer that reads a parameter another stage owns
        (a head tied to the embeddings) holds its own copy: in its parameters."""
        prof = self.prof
        precision = precision_of(s.amp, s.zero_stage)
        scale = s.mb_samples / prof.batch * self.seq_ratio / s.cp
        stage = [ch.stage for ch in choices]
        rank_of = s.rank_of
        for k in range(1, len(choices)):
            a, b = stage[k - 1], stage[k]
            if a == b:
                continue
            sp_div = s.tp if self._cut_sharded(s, choices, k) else 1
            sent, send, recv = 0.0, sums.pipe[rank_of(a)], sums.pipe[rank_of(b)]
            for c in prof.crossings[k]:
                nbytes = c.nbytes[precision] * scale / sp_div
                sent += nbytes
                recv["recv"] += nbytes
                if c.saved_in is not None and stage[c.saved_in] == b:
                    recv["recv_saved"] += nbytes
                if c.made >= 0 and stage[c.made] == a and (c.saved_in is None
                                                           or stage[c.saved_in] != a):
                    send["kept"] += nbytes
                if c.grad:
                    send["grad_recv"] += nbytes
                    recv["grad_sent"] += nbytes
            # between two stages of one rank nothing is sent (see _stage_cuts)
            if rank_of(a) != rank_of(b):
                sums.p2p.append((rank_of(a), rank_of(b), sent))
        by_stage = {st.stage: st for held in sums.stages for st in held}
        if by_stage:
            self._stage_cuts(s, choices, by_stage)
        last = len(choices) - 1
        # fused: the stage returns the head's input, which the
        if not (s.fused_loss and self.head.layer == last):
            # fused op saves (in the head layer's activations): no logits kept as the stage's output
            out = self.choice_terms(last, s, choices[last]).out_bytes
            sums.pipe[rank_of(stage[last])]["kept"] += out
            if by_stage:
                by_stage[stage[last]].pipe["kept"] += out
        copies = {(stage[i], name): numel / (s.tp if split and choices[i].tp else 1)
                  for i, lp in enumerate(prof.layers)
                  for name, (numel, split, owner) in lp.borrowed.items()
                  # a tied parameter's copy on each other stage (runtime/pp_split.py)
                  if stage[owner] != stage[i]}
        for (st, _), numel in copies.items():
            sums.params[rank_of(st)] += numel
            if by_stage:
                by_stage[st].params += numel

    def _cut_sharded(self, s: Setting, choices: list[LayerChoice], k: int) -> bool:
        """Whether a pipeline cut before layer ``k`` sends sequence shards: both sides lie in the
        sequence-parallel region (``planner.styles``' ``_sp_region``), which starts at the first
        block (an embedding before it outputs replicated activations) and takes the TP layers after
        the blocks that SP covers (the final norm and the head read the shards: a
        ``SequenceParallel`` norm, a head with ``input_layouts=Shard(1)``)."""
        if not s.sp or not self.blocks:
            return False
        first = min(self.blocks)

        def inside(i: int) -> bool:
            return i in self.blocks or (i > first and choices[i].tp and self.prof.sp_covers(i))
        return inside(k - 1) and inside(k)

    def _stage_cuts(self, s: Setting, choices: list[LayerChoice],
                    by_stage: dict[int, StageSums]) -> None:
        """:attr:`.terms.StageSums.pipe` of each stage of a multi-stage schedule, as
        :meth:`pipeline_sums` counts a rank's. Between two stages of one rank (the V's turn) nothing
        is sent: torch's ``set_local_fwd_input`` hands the next stage the output itself (which the
        first keeps, and which the second's layers may save: counted once) and
        ``set_local_bwd_input`` the input's gradient itself, as the first stage's gradient
        buffer."""
        precision = precision_of(s.amp, s.zero_stage)
        scale = s.mb_samples / self.prof.batch * self.seq_ratio / s.cp
        stage = [ch.stage for ch in choices]
        for k in range(1, len(choices)):
            a, b = stage[k - 1], stage[k]
            if a == b:
                continue
            local = s.rank_of(a) == s.rank_of(b)
            by_stage[a].sends, by_stage[a].turn = not local, local
            send, recv = by_stage[a].pipe, by_stage[b].pipe
            sp_div = s.tp if self._cut_sharded(s, choices, k) else 1
            for c in self.prof.crossings[k]:
                nbytes = c.nbytes[precision] * scale / sp_div
                recv["recv"] += 0.0 if local else nbytes
                if c.saved_in is not None and stage[c.saved_in] == b:
                    recv["recv_saved"] += nbytes
                mine = c.made >= 0 and stage[c.made] == a
                if mine and (c.saved_in is None or stage[c.saved_in] != a):
                    send["kept"] += nbytes
                if c.grad:
                    send["grad_recv"] += nbytes
                    recv["grad_sent"] += 0.0 if local else nbytes

    def _add_units(self, units: list[FsdpUnit], i: int, cnt: int, numel: float) -> None:
        """Append layers ``i`` .. ``i + cnt - 1`` (``numel`` local parameters each) to ``units`` as
        the runtime groups them (``export.values.fsdp_units``): each layer with parameters its own
        unit, except the last layer joining a final norm just before it (torchtitan's ``[norm,
        output]``)."""
        if not numel:
            return
        layers = self.prof.layers
        tail = len(layers) - 2
        if (i == tail + 1 and units and units[-1].first == tail
            and layers[tail].path in layers[tail].norms):
            units[-1] = FsdpUnit(tail, i, units[-1].numel + numel)
            return
        units += [FsdpUnit(i + j, i + j, numel) for j in range(cnt)]

    def _tied_gradients(self, s: Setting, choices: list[LayerChoice]) -> dict[int, float]:
        """Per layer, the bytes of tied parameters' gradients pending during its backward: a
        parameter two layers of a rank read (a head tied to the embeddings, T5's decoder embedding)
        gets its later reader's gradient first, which autograd holds, to add the earlier reader's
        to, from the later layer's backward to the earlier one's (the tracker's census: BERT's
        decoder weight gradient, a float32 temporary through the whole encoder backward). The
        parameter's dtype: float32, or FSDP's 16-bit unsharded parameter (ZeRO 1-3)."""
        item = s.compute_item if s.zero_stage >= 1 else ITEMSIZE["float32"]
        # (parameter, rank) -> its layers there
        readers: dict[tuple[str, int], list[int]] = defaultdict(list)
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

    def _fused_head(self, s: Setting, sums: RankSums, r: int, recompute: str, lt: LayerTerms, *,
                    tp: int = 1) -> float:
        """The fused head + loss on rank ``r`` (:mod:`.loss`): adds the log-sum-exp it saves, the
        logits' recompute (time and hardware FLOPs) to ``sums``; returns the head layer's backward
        working set, the fused op's temporaries in place of the logits' gradient. Split on the
        vocabulary over ``tp`` ranks, a rank computes its rows' logits (FLOPs and chunk buffers /
        tp) and the forward's all-reduces of the log-sum-exp terms
        (:meth:`.loss.FusedHead.tp_forward_bytes`) are added; the hidden states' gradient is
        all-reduced as the colwise head's input gradient is (counted with the layer's TP
        collectives)."""
        half = s.amp != "none"
        tokens = self.head.tokens * s.mb_samples / self.prof.batch * self.seq_ratio
        flops = self.head.recompute_flops(tokens) / tp
        sums.rec[r] += flops / (self.cluster.device.flops(DTYPE_NAMES[s.amp] if half else "float32")
                                * self.f.efficiency("matmul", half))
        sums.hw_flops += flops * tp  # every rank's share: the step's hardware FLOPs
        sums.acts[r] += self.head.saved_bytes(tokens)
        if tp > 1:
            link = link_for(self.cluster, size=tp, stride=1)
            t = collective_time("all_reduce", self.head.tp_forward_bytes(tokens), tp, link,
                                self.f.eff_link)
            sums.tpc[r] += t * (1 - self.f.overlap_tp)
            sums.tp_kind[r]["all_reduce"] = sums.tp_kind[r].get("all_reduce", 0.0) + t
        return self.head.temp_bytes(tokens, half=half, tp=tp) + (lt.act["none"]
                                                                 if recompute == "full" else 0.0)

    def _pipeline_comm(self, s: Setting, sums: RankSums, comm: CommTime) -> float:
        """Point-to-point sends between stages: fill/drain on the critical path, the rest mostly
        hidden (and slowing the compute it hides behind), and each micro-batch's wait for the other
        stage's process where the preset has one (``Factors.pp_handoff_s``). Adds to ``comm``;
        returns the exposed seconds.

        Each cut costs its own bytes: the cut after an embedding carries its replicated output,
        those between blocks under SP a shard (:meth:`_cut_sharded`), so pricing every send at the
        largest cut would overcharge the rest by up to the TP degree. A rank's share is the sends it
        issues (links are full duplex: what it receives travels the other way at the same time): its
        activations over its outgoing cuts and the gradients over its incoming ones; the busiest
        rank's sum counts. Fill and drain pass the first ``pp - 1`` cuts once each way."""
        if s.pp <= 1:
            return 0.0
        f = self.f
        pp_link = link_for(self.cluster, size=s.pp, stride=s.tp * s.replicas)
        hops = [(a, b, collective_time("send_recv", nbytes, 2, pp_link, f.eff_link))
                for a, b, nbytes in sums.p2p]
        # per rank, one micro-batch: its activations forward, the gradients of its inputs back
        sends = [0.0] * s.pp
        for a, b, t in hops:
            sends[a] += t
            sends[b] += t
        total = s.micro_batches * max(sends)
        # the first micro-batch's way out, the last one's way back
        fill = 2 * sum(t for _, _, t in hops[:s.pp - 1])
        # never hidden; no stage-count factor: see Factors
        wait = s.micro_batches * s.virtual_stages * f.pp_handoff_s
        return comm.record("send_recv", total + wait, fill + (1 - f.overlap_pp) * total + wait,
                           f.overlap_contention)

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
