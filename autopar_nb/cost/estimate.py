"""Tie memory, communication and time into a :class:`~autopar_nb.plan.Cost` for one set of choices.

:class:`Evaluator` holds the graph's profile and caches per-layer terms by (repeated-block representative, TP on,
sequence parallel, AMP, micro-batch size), so evaluating a candidate is arithmetic over the layer chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import RECOMPUTE, Cost, MemoryBreakdown
from .comm import collective_time, link_for
from .factors import Factors, factors_for
from .memory import activation_bytes, in_flight, model_states, state_bytes, with_margin
from .profile import GraphProfile
from .time import bubble_fraction, layer_compute_time, optimizer_time


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


@dataclass
class LayerChoice:
    """Per-layer choices of a candidate plan."""

    stage: int = 0
    tp: bool = True
    """apply the layer's TP styles (False: replicate it on every TP rank)"""
    recompute: str = "none"
    fsdp: bool = True


@dataclass
class LayerTerms:
    """One layer's per-micro-batch costs on one rank for a given (TP, SP, AMP, micro-batch size)."""

    fwd: float
    bwd: float
    sel: float
    act: dict[str, float]
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


class Evaluator:
    """Costs candidate plans of one profiled graph on one cluster (see the module docstring)."""

    def __init__(self, prof: GraphProfile, cluster, *, factors: Factors | None = None, seq_ratio: float = 1.0,
                 megatron_sp: bool = False):
        self.prof, self.cluster = prof, cluster
        self.f = factors or factors_for(cluster)
        self.seq_ratio, self.megatron_sp = seq_ratio, megatron_sp
        self._cache: dict[tuple, LayerTerms] = {}

    # ---- per layer ----------------------------------------------------------------------------------------------
    def terms(self, i: int, *, tp: int, sp: bool, half: bool, mb_samples: float) -> LayerTerms:
        """Per-layer terms, cached by the layer's repeated-block representative."""
        key = (self.prof.rep[i], tp, sp, half, mb_samples)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        lp = self.prof.layers[self.prof.rep[i]]
        scale = mb_samples / self.prof.batch * self.seq_ratio
        qscale = mb_samples / self.prof.batch * self.seq_ratio ** 2
        fwd, bwd, sel = layer_compute_time(lp, tp=tp, sp=sp, half=half, scale=scale, quad_scale=qscale,
                                           device=self.cluster.device, factors=self.f)
        act = {r: activation_bytes(lp, tp=tp, sp=sp, recompute=r, half=half, scale=scale, quad_scale=qscale,
                                   megatron_sp=self.megatron_sp) for r in RECOMPUTE}
        comm: dict[str, float] = {}
        if tp > 1:
            link = link_for(self.cluster, size=tp, stride=1)
            for c in lp.comms:
                nbytes = (c.half_bytes if half else c.nbytes) * scale
                kinds = ("reduce_scatter", "all_gather") if sp else ("all_reduce",)
                for k in kinds:
                    comm[k] = comm.get(k, 0.0) + collective_time(k, nbytes, tp, link, self.f.eff_link)
        out = (lp.output_half if half else lp.output_bytes) * scale / (tp if sp else 1)
        work = lp.largest_out * scale * (0.5 if half else 1.0) / (tp if tp > 1 else 1)
        fwd_fl = (sum(lp.flops_split.values()) + sum(lp.flops_rep.values()) + lp.flops_other) * scale
        bwd_fl = (sum(lp.bwd_split.values()) + sum(lp.bwd_rep.values()) + lp.bwd_other) * scale
        t = LayerTerms(fwd, bwd, sel, act, lp.params_split / tp + lp.params_rep, comm, out, work,
                       fwd_fl + bwd_fl, fwd_fl, lp.quad_flops * qscale, lp.largest_param / (tp if lp.tp else 1))
        self._cache[key] = t
        return t

    # ---- a whole candidate --------------------------------------------------------------------------------------
    def runs(self, choices: list[LayerChoice]) -> list[tuple[int, int, LayerChoice]]:
        """Consecutive layers with the same block representative and choices, as (first index, count, choice)."""
        rep = self.prof.rep
        out: list[list] = []
        prev = None
        for i, ch in enumerate(choices):
            key = (rep[i], ch.stage, ch.tp, ch.recompute, ch.fsdp)
            if key == prev:
                out[-1][1] += 1
            else:
                out.append([i, 1, ch])
                prev = key
        return [tuple(r) for r in out]

    def evaluate(self, s: Setting, choices: list[LayerChoice]) -> Cost:
        """The predicted :class:`Cost` of one step (memory_by_rank: one entry per pipeline rank)."""
        f, dev, prof = self.f, self.cluster.device, self.prof
        half = s.amp != "none"
        pp = s.pp
        # per pipeline rank accumulators
        fwdbwd = [0.0] * pp
        rec = [0.0] * pp
        tpc = [0.0] * pp
        acts = [0.0] * pp
        params = [0.0] * pp
        work = [0.0] * pp
        unit_top = [(0.0, 0.0) for _ in range(pp)]
        block_unit = [0.0] * pp
        largest = [0.0] * pp
        head_tp = False
        nofsdp = [0.0] * pp
        p2p = [0.0] * pp
        tp_kind = [{} for _ in range(pp)]
        model_flops = 0.0
        hw_flops = 0.0
        runs = self.runs(choices)
        for k, (i, cnt, ch) in enumerate(runs):
            r = ch.stage % pp
            t = s.tp if ch.tp else 1
            lt = self.terms(i, tp=t, sp=s.sp and ch.tp, half=half, mb_samples=s.mb_samples)
            fwdbwd[r] += cnt * (lt.fwd + lt.bwd)
            extra = lt.fwd if ch.recompute == "full" else lt.sel if ch.recompute == "selective" else 0.0
            rec[r] += cnt * extra
            if lt.tp_comm:
                tpc[r] += cnt * sum(lt.tp_comm.values()) * (1 - f.overlap_tp)
                kinds = tp_kind[r]
                for kk, v in lt.tp_comm.items():
                    kinds[kk] = kinds.get(kk, 0.0) + cnt * v
            acts[r] += cnt * lt.act[ch.recompute]
            wb = lt.act["none"] + lt.work_bytes if ch.recompute == "full" else lt.work_bytes
            if wb > work[r]:
                work[r] = wb
            params[r] += cnt * lt.params_local
            if cnt > 1 or prof.rep[i] != i:
                block_unit[r] = max(block_unit[r], lt.params_local)
            largest[r] = max(largest[r], lt.largest_param)
            u1, u2 = unit_top[r]
            if lt.params_local > u1:
                unit_top[r] = (lt.params_local, max(u1, u2) if cnt == 1 else lt.params_local)
            elif lt.params_local > u2:
                unit_top[r] = (u1, lt.params_local)
            if ch.tp and t > 1 and prof.layers[i].vocab and not prof.layers[i].norms and i == len(choices) - cnt:
                head_tp = True
            if not ch.fsdp:
                nofsdp[r] += cnt * lt.params_local
            if k + 1 < len(runs) and runs[k + 1][2].stage != ch.stage:
                p2p[r] = max(p2p[r], lt.out_bytes)
            model_flops += cnt * lt.flops
            hw_flops += cnt * (lt.flops + (lt.fwd_flops if ch.recompute == "full" else
                                           lt.quad_flops if ch.recompute == "selective" else 0.0))

        m = s.micro_batches
        per_mb = [fwdbwd[r] + rec[r] + tpc[r] for r in range(s.pp)]
        bottleneck = max(range(s.pp), key=lambda r: per_mb[r])
        T = per_mb[bottleneck]
        by_kind = {kk: v * m for kk, v in tp_kind[bottleneck].items()}
        bubble = bubble_fraction(s.schedule, pp=s.pp, micro_batches=m, virtual_stages=s.virtual_stages,
                                 factors=f) * T
        # pipeline point-to-point: fill/drain on the critical path, the rest mostly hidden
        pp_link = link_for(self.cluster, size=s.pp, stride=s.tp * s.dp)
        p2p_t = max((collective_time("send_recv", b, 2, pp_link, f.eff_link) for b in p2p), default=0.0)
        p2p_total = 2 * m * p2p_t * s.virtual_stages if s.pp > 1 else 0.0
        p2p_exposed = (2 * (s.pp - 1) * p2p_t + (1 - f.overlap_pp) * p2p_total) if s.pp > 1 else 0.0
        if p2p_total:
            by_kind["send_recv"] = p2p_total

        # data parallel
        dp_link = link_for(self.cluster, size=s.dp, stride=s.tp)
        p_item = 2 if half else 4
        g_item = 4  # gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy.reduce_dtype / DDP default)
        P = max(params)  # the pipeline rank with the most parameters reduces last
        dp_total = dp_exposed = 0.0
        dp_exposed_kind: dict[str, float] = {}
        if s.dp > 1:
            ct = lambda k, b: collective_time(k, b, s.dp, dp_link, f.eff_link)
            if s.zero_stage <= 1:
                ar = ct("all_reduce", P * g_item)
                by_kind["all_reduce"] = by_kind.get("all_reduce", 0.0) + ar
                ag = ct("all_gather", P * 4) if s.zero_stage == 1 else 0.0  # ZeroRedundancyOptimizer broadcast
                if ag:
                    by_kind["all_gather"] = by_kind.get("all_gather", 0.0) + ag
                window = fwdbwd[bottleneck] * 2 / 3  # gradients of the last micro-batch's backward (no_sync)
                dp_total = ar + ag
                dp_exposed = ar - min(f.overlap_dp * ar, window) + ag
                dp_exposed_kind = {"all_reduce": ar - min(f.overlap_dp * ar, window), "all_gather": ag}
            else:
                rs = m * ct("reduce_scatter", P * g_item)
                n_ag = 1 if s.zero_stage == 2 else 2 * m
                ag = n_ag * ct("all_gather", P * p_item)
                by_kind["reduce_scatter"] = by_kind.get("reduce_scatter", 0.0) + rs
                by_kind["all_gather"] = by_kind.get("all_gather", 0.0) + ag
                window = m * fwdbwd[bottleneck]
                ov = f.overlap_fsdp if s.zero_stage == 3 else f.overlap_dp
                dp_total = rs + ag
                dp_exposed = dp_total - min(ov * dp_total, window)
                dp_exposed_kind = {"reduce_scatter": dp_exposed * rs / dp_total,
                                   "all_gather": dp_exposed * ag / dp_total}
        opt_params = P / s.dp if s.zero_stage >= 1 else P
        opt_t = optimizer_time(opt_params, dev, f)

        compute = m * (fwdbwd[bottleneck] + rec[bottleneck])
        tp_exposed = m * tpc[bottleneck]
        exposed_kind = {kk: v * m * (1 - f.overlap_tp) for kk, v in tp_kind[bottleneck].items()}
        if p2p_exposed:
            exposed_kind["send_recv"] = p2p_exposed
        for kk, v in dp_exposed_kind.items():
            if v:
                exposed_kind[kk] = exposed_kind.get(kk, 0.0) + v
        step = compute + tp_exposed + bubble + p2p_exposed + dp_exposed + opt_t

        # memory per pipeline rank, at its peak. Two candidate moments: the start of backward (every saved activation
        # alive, the loss's gradients, FSDP's gathered units; gradients exist only if micro-batches accumulate them,
        # since zero_grad(set_to_none=True) frees them each step) and the optimizer step (all gradients, plus a
        # foreach temporary of their size).
        sb = state_bytes(s.optimizer)
        mem: list[MemoryBreakdown] = []
        accumulating = m > 1 or s.pp > 1
        cuda = prof.device_kind == "cuda"
        for r in range(s.pp):
            pb, gb, ob = model_states(params[r], dp=s.dp, zero_stage=s.zero_stage, states=sb)
            held = 0.0  # buffers alive the whole forward/backward
            gather = 0.0  # FSDP: the unit being computed (params + its unsharded grads) and the prefetched next one
            if s.zero_stage == 2:
                pb = params[r] * sb.param / s.dp
                held += params[r] * p_item  # reshard_after_forward=False keeps unsharded params fwd -> bwd
            elif s.zero_stage == 3:
                u1, _ = unit_top[r]
                gather = u1 * (p_item + g_item) + block_unit[r] * p_item
                held += nofsdp[r] * p_item
            elif half:
                held += params[r] * 2  # autocast caches 16-bit copies of the weights for the step
            flight = in_flight(s.schedule, pp=s.pp, stage=r, micro_batches=m, virtual_stages=s.virtual_stages)
            act = flight * acts[r]
            p2p_buf = 2 * p2p[r] if s.pp > 1 else 0.0
            grads_bwd = gb if accumulating else 0.0
            # moment 1: a layer's backward (its working set and FSDP's gathered units)
            temp = work[r] + gather
            act_at, temp_at = act, temp
            if r == s.pp - 1 and prof.output_numel:
                # moment 2 (last rank): the loss's backward: log-softmax output (fp32) saved, its gradient and
                # the logits' gradient alive; FSDP units are resharded then
                lp_div = s.tp if (prof.loss_parallel and s.tp > 1 and head_tp) else 1
                out_numel = prof.output_numel * (s.mb_samples / prof.batch) * self.seq_ratio
                loss_saved = out_numel * 4 / lp_div
                # gradients of the log-softmax and of the logits; torch's loss_parallel backward still holds
                # temporaries of the full (unsharded) logits' size (measured with MemTracker, torch 2.13: the same
                # bytes at tp=2 and tp=4)
                loss_temp = out_numel * (4 + p_item)
                if act + loss_saved + loss_temp >= act + temp:
                    act_at, temp_at = act + loss_saved, loss_temp
            at_backward = pb + ob + grads_bwd + act_at + held + temp_at + p2p_buf
            # moment 3: the optimizer step: every gradient and foreach temporaries (CUDA: a list the size of the
            # gradients; CPU: one parameter at a time)
            step_temp = gb if cuda else largest[r] * g_item
            at_step = pb + ob + gb + step_temp + held * (s.zero_stage != 2 and not half)
            if at_backward >= at_step:
                mbd = MemoryBreakdown(pb, grads_bwd, ob, act_at, held + temp_at + p2p_buf)
            else:
                mbd = MemoryBreakdown(pb, gb, ob, 0.0, at_step - pb - gb - ob)
            mbd.margin = with_margin(max(at_backward, at_step), f)
            mem.append(mbd)
        peak = max(x.total for x in mem)

        world = s.dp * s.tp * s.pp
        samples = s.dp * m * s.mb_samples
        # FLOPs summed over the chain are those of one micro-batch for one model replica; scale to the step
        step_model_flops = model_flops * m * s.dp
        step_hw_flops = hw_flops * m * s.dp
        peak_flops = dev.flops("bfloat16" if half else "float32")
        cost = Cost(
            step_time_s=step, compute_s=compute, comm_exposed_s=tp_exposed + p2p_exposed + dp_exposed,
            comm_total_s=sum(by_kind.values()), comm_by_kind=by_kind, comm_exposed_by_kind=exposed_kind,
            bubble_s=bubble, optimizer_s=opt_t,
            memory_by_rank=mem, peak_memory_bytes=peak,
            model_tflops_per_gpu=step_model_flops / world / step / 1e12,
            hardware_tflops_per_gpu=step_hw_flops / world / step / 1e12,
            mfu=step_model_flops / world / step / peak_flops,
            tokens_per_s=samples * prof.seq_len * self.seq_ratio / step if prof.seq_len else None,
            samples_per_s=samples / step,
        )
        return cost


def setting_of(plan) -> tuple[Setting, list[LayerChoice]]:
    """The (Setting, per-layer choices) a :class:`~autopar_nb.plan.Plan` stands for."""
    m = plan.mesh
    mb = plan.batch.global_batch / (m.dp * plan.batch.micro_batches)
    tp_on = [any(st in ("colwise", "rowwise") for st in lp.tp.values()) for lp in plan.layers]
    sp = any(lp.sequence_parallel for lp in plan.layers)
    s = Setting(m.dp, m.tp, m.pp, m.zero_stage, plan.precision.amp, plan.batch.micro_batches, mb,
                plan.pipeline.schedule, plan.pipeline.virtual_stages, sp, plan.optimizer.name)
    choices = [LayerChoice(lp.stage, on, lp.recompute, lp.fsdp) for lp, on in zip(plan.layers, tp_on, strict=True)]
    return s, choices


def estimate(graph, cluster, plan, *, factors: Factors | None = None) -> Cost:
    """Cost of an existing plan (e.g. one a user edited) on ``cluster``: the planner's own model, no search."""
    from .profile import profile_of

    prof = profile_of(graph, "cpu" if cluster.name == "cpu" else "cuda")
    if [lp.path for lp in plan.layers] != [lay.path for lay in graph.layers]:
        raise ValueError("the plan's layers do not match the graph's; re-plan for this model")
    seq_ratio = plan.batch.seq_len / graph.seq_len if plan.batch.seq_len and graph.seq_len else 1.0
    s, choices = setting_of(plan)
    return Evaluator(prof, cluster, factors=factors, seq_ratio=seq_ratio).evaluate(s, choices)
