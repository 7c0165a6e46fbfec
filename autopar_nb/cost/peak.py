"""The moments of a rank's step its peak memory can be at, and the bytes alive at each: every
layer's forward, backward (at each of its ops) and recompute, the loss, the optimizer step; the peak
is the largest.

Each term is named (:data:`~autopar_nb.plan.MEMORY_TERMS`) so that a measured peak can be compared
with the prediction component by component, at the same moment."""

from __future__ import annotations

from typing import NamedTuple

from ..plan import ITEMSIZE, MEMORY_TERMS, MemoryBreakdown
from .memory import SENDS_HELD, accumulating_op, in_flight, model_states, state_bytes, with_margin
from .moment import PeakMoment, fsdp_buffers
from .schedule import MULTI_STAGE
from .setting import LayerChoice, Setting
from .staged import StagedRank
from .terms import RankSums

SHARED_PEAKS = 16384
"""about how many per-rank peaks an evaluator keeps (:func:`rank_peaks`; one plan() of the 1T GPT on
3072 GPUs weighs ~8000)"""


def rank_peaks(ev, s: Setting, choices: list[LayerChoice], sums: RankSums) -> list[MemoryBreakdown]:
    """:meth:`RankMemory.peak` of every pipeline rank of ``s`` with ``choices`` (``sums`` their
    ``Evaluator.sum_layers``), each made once per evaluator for the ranks alike in what they read. A
    rank's sums read every layer's stage, TP, FSDP and compile choice (the tensors crossing its
    cuts, the tied parameters' readers, the TP-split head's loss) but only its own layers'
    recompute, so candidates that differ only in another rank's recompute (the search adds recompute
    rank by rank, then costs the candidate again) share its peak. The breakdowns returned are
    shared: read them, never change them."""
    shared = ev.__dict__.setdefault("_rank_peaks", {})
    if len(shared) >= SHARED_PEAKS // max(s.pp, 1):
        shared.clear()
    cache = shared.setdefault((s, tuple((c.stage, c.tp, c.fsdp, c.compile) for c in choices)), {})
    recompute: list[list[str]] = [[] for _ in range(s.pp)]
    for c in choices:
        recompute[s.rank_of(c.stage)].append(c.recompute)
    memory, out = None, []
    for r, own in enumerate(recompute):
        key = (r, tuple(own))
        hit = cache.get(key)
        if hit is None:
            memory = memory or RankMemory(ev.prof, ev.f, s, sums, seq_ratio=ev.seq_ratio)
            hit = cache[key] = memory.peak(r)
        out.append(hit)
    return out


class RankMemory:
    """Memory moments of one candidate (its setting ``s`` and per-rank ``sums``) on each pipeline
    rank."""

    def __init__(self, prof, factors, s: Setting, sums: RankSums, *, seq_ratio: float = 1.0):
        self.prof, self.f, self.s, self.sums, self.seq_ratio = prof, factors, s, sums, seq_ratio

    def peak(self, r: int) -> MemoryBreakdown:
        """Bytes on pipeline rank ``r`` at its peak: the largest of its :meth:`moments`."""
        pb, ob, peak = self._heaviest(r)
        mbd = self.breakdown(r, pb, ob, peak, margin_of=peak.weight)
        if self.s.offload != "none":
            mbd.host = self._host_bytes(r)
        return mbd

    def _heaviest(self, r: int) -> tuple[float, float, PeakMoment]:
        """:meth:`moments`' parameter and optimizer-state bytes and the first of its heaviest
        moments; a rank of a multi-stage schedule without offload (which reweighs the moments)
        weighs only its heaviest states' (:meth:`.staged.StagedRank.heaviest`)."""
        if self.s.pp > 1 and self.s.schedule in MULTI_STAGE and self.s.offload == "none":
            st = self._states(r)
            staged, step = StagedRank(self, r, st).heaviest(), self._step_moment(r, st)
            return (st.pb, st.ob,
                    staged if staged is not None and staged.weight >= step.weight else step)
        pb, ob, moments = self.moments(r)
        return pb, ob, max(moments, key=lambda mo: mo.weight)

    def breakdown(self, r: int, pb: float, ob: float, mo: PeakMoment, *,
                  margin_of: float) -> MemoryBreakdown:
        """Rank ``r``'s bytes at moment ``mo``, by field and named term, with the allocator margin
        of a peak of ``margin_of`` bytes besides its states (the share of its layers under full
        recompute sets the fraction: :func:`.memory.with_margin`)."""
        terms = {k: v for k, v in mo.terms.items() if v}
        acts = sum(v for k, v in terms.items() if MEMORY_TERMS[k] == "activations")
        mbd = MemoryBreakdown(pb, mo.grads, ob, acts, sum(terms.values()) - acts, terms=terms)
        layers = self.sums.layers[r] if self.sums.layers else 0
        share = self.sums.full_recompute[r] / layers if layers else 0.0
        mbd.margin = with_margin(pb + ob + margin_of, self.f, full_recompute=share)
        return mbd

    def moments(self, r: int, per_op: bool = False) -> tuple[float, float, list[PeakMoment]]:
        """Rank ``r``'s parameter and optimizer-state bytes, and the moments of its step its peak
        can be at: each layer's forward (no gradient yet unless they accumulate over micro-batches;
        its FSDP unit's all-gather output) and backward (and its recompute's forward; every saved
        activation of the earlier layers alive, the later layers' gradients, FSDP's gathered units;
        gradients of earlier micro-batches only where they accumulate, since
        zero_grad(set_to_none=True) frees them each step), the last rank's loss backward, the
        gradients' reduction of a pipelined FSDP stage (:meth:`_reduce_moment`), and the optimizer
        step (all gradients, plus a foreach temporary of their size). ``per_op``: also each layer's
        backward at each of its ops (:attr:`~.terms.LayerTerms.op_deltas`; ``PeakMoment.op``). A
        rank of a multi-stage schedule has those of each of its actions in torch's order
        (:class:`.staged.StagedRank`)."""
        st = self._states(r)
        if self.s.pp > 1 and self.s.schedule in MULTI_STAGE:
            staged = StagedRank(self, r, st).moments(per_op)
            return self._on_device(st, [*staged, self._step_moment(r, st)])
        flights = self._flights(r, st)
        out = self._layer_moments(r, st, flights, per_op)
        out += self._loss_moments(r, st, flights)
        # (ZeRO-1 reduce-scatters unit by unit in its last backward)
        if st.pipelined and self.s.pp > 1:
            out.append(self._reduce_moment(r, st))
        out.append(self._step_moment(r, st))
        return self._on_device(st, out)

    def _on_device(self, st: _States, out: list[PeakMoment]) -> tuple[float, float,
                                                                      list[PeakMoment]]:
        """(parameter bytes, optimizer-state bytes, the moments) on the device. With CPU offload
        FSDP keeps the parameter shards, the gradient shards and the optimizer states in host memory
        (:meth:`_host_bytes`) and the step runs there: the device holds no states (``pb`` is the
        shards under ZeRO 2 and 3), only what the moments' terms name (the units gathered, ZeRO 2's
        from forward to backward; unsharded gradients before their reduction)."""
        if self.s.offload == "none":
            return st.pb, st.ob, out
        return 0.0, 0.0, [mo._replace(grads=0.0, weight=mo.weight - mo.grads) for mo in out
                          if mo.phase != "step"]

    def _host_bytes(self, r: int) -> float:
        """Bytes rank ``r`` keeps in host memory with CPU offload: its parameter and gradient shards
        (float32) and its optimizer states."""
        s, st, experts = self.s, self._states(r), self.sums.experts[r]
        item = state_bytes(s.optimizer).param
        shards = (st.params - experts) * item / s.replicas + experts * item / (s.dp // s.ep)
        return shards + st.gb + st.ob

    def _states(self, r: int) -> _States:
        """Rank ``r``'s model states and the buffers alive through its whole forward and
        backward."""
        s, sums = self.s, self.sums
        sb = state_bytes(s.optimizer)
        params, experts = sums.params[r], sums.experts[r]
        # expert parallelism: the ranks holding the same experts shard their states
        edp = s.dp // s.ep
        # ZeRO-1's FSDP2 shards gradients between steps too
        stage = max(s.zero_stage, s.held_zero_stage)
        pb, gb, ob = (a + b for a, b in zip(model_states(params - experts, dp=s.replicas,
                                                         zero_stage=stage, states=sb),
                                            model_states(experts, dp=edp, zero_stage=stage,
                                                         states=sb),
                                            strict=True))
        p_item = s.compute_item
        held: dict[str, float] = {}
        fsdp_stage = s.held_zero_stage
        if fsdp_stage == 2:  # its unsharded parameters, kept to backward: fsdp_buffers, the loss
            pb = (params - experts) * sb.param / s.replicas + experts * sb.param / edp
        elif fsdp_stage == 3:
            held["fsdp_root_params"] = sums.nofsdp[r] * p_item
        elif s.amp != "none":
            # of the weights its lower-precision ops read
            held["autocast_weight_copies"] = sums.casts[r] * 2
        held["ddp_buckets"] = ddp_bucket_bytes(s, params - experts)
        # FSDP2's replicate gathers and keeps parameters as ZeRO 2 does, its own dtype's copy
        if replicated(s):
            fsdp_stage, p_item = 2, ITEMSIZE["float32"]
        return _States(pb, gb, ob, params, p_item, held,
                       s.unsharded_accumulation and fsdp_stage >= 2, fsdp_stage,
                       replicated_experts(s) and bool(experts), sums.whole_grads[r])

    def _flights(self, r: int, st: _States) -> list[_Flight]:
        """The rank's backward moments by micro-batches in flight (:class:`_Flight`): its first
        backward when every micro-batch's forward ran before it (GPipe; 1F1B where m <= pp - r), no
        gradients yet, and the next, with fewer in flight and every gradient; otherwise the steady
        one, the earlier micro-batches' gradients accumulated, and under a pipelined ZeRO-3 stage
        also the first backward of the cool-down, right after the previous backward: one fewer in
        flight, but every unit still unsharded (:func:`fsdp_buffers`)."""
        s = self.s
        m = s.micro_batches
        flight = in_flight(s.schedule, pp=s.pp, stage=r, micro_batches=m,
                           virtual_stages=s.virtual_stages)
        regather = st.pipelined and st.fsdp_stage == 3
        if flight < m:
            cool = regather and flight >= 2
            return [_Flight(flight - 1, True, True if cool else None, forwards=True)] + (
                [_Flight(flight - 2, True, True, regathered=True)] if cool else [])
        return [_Flight(flight - 1, False, None if m == 1 else False, forwards=True)] + (
            [_Flight(flight - 2, True, True, regathered=regather)] if m > 1 else [])

    def _pipeline_terms(self, r: int, f: _Flight) -> dict[str, float]:
        """The pipeline stage's buffers at a moment of ``f`` (``runtime/pp.py``'s ``LeanStage``): a
        micro-batch's input buffers from its receive to its backward, the gradients' for its
        backward; its stage output from its forward to its backward; ``others + 1`` micro-batches
        hold theirs. Torch's one-stage-per-rank schedules keep the previous micro-batch's
        input-gradient sends referenced through the next backward (SENDS_HELD): a backward after the
        rank's first holds those gradients too."""
        s = self.s
        if s.pp == 1:
            return {}
        pipe = self.sums.pipe[r]
        sent = pipe["grad_sent"] if s.schedule in SENDS_HELD and f.accumulated else 0.0
        return {"pipeline_buffers": (f.others + 1) * pipe["recv"] + pipe["grad_recv"],
                "pipeline_outputs": (f.others + 1) * pipe["kept"], "pipeline_sent_gradients": sent}

    def _gradients(self, st: _States, f: _Flight, later_numel: float) -> tuple[float,
                                                                               dict[str, float]]:
        """(gradient bytes, named terms) alive at a moment of ``f`` where the local parameters
        ``later_numel`` have their gradients from this micro-batch's backward. A pipelined FSDP
        stage (torch's ``PipelineStage`` runs every micro-batch's backward without gradient sync or
        resharding, and reduce-scatters once after the last: ``perform_reduce_grad``) holds its
        gradients unsharded in ``reduce_dtype`` (float32) instead of sharded:
        ``fsdp_unsharded_grads``; a vocab-split embedding's whole (``whole_grads``: measured,
        GPT-2's wte on the first stage of ZeRO-3 x TP x PP, [1024, 256] on each TP rank), whose
        backward runs last."""
        numel = st.params if f.accumulated else later_numel
        if st.pipelined:
            whole = st.whole_grads if f.accumulated else 0.0
            return 0.0, {"fsdp_unsharded_grads": (numel + whole) * ITEMSIZE["float32"]}
        return (st.gb if f.accumulated else numel * (st.gb / st.params if st.params else 0.0)), {}

    def _layer_moments(self, r: int, st: _States, flights: list[_Flight],
                       per_op: bool) -> list[PeakMoment]:
        """Each layer's backward (at its largest op and, ``per_op``, at every op), recompute and
        forward moment (:attr:`~.terms.RankSums.bwd_layers`) under each flight."""
        s, sums = self.s, self.sums
        # a pipeline stage's received inputs that its layers save are its receive buffers: counted
        # there
        rs = sums.pipe[r]["recv_saved"] if s.pp > 1 else 0.0
        held_sum = sum(st.held.values())
        # (layer, forward, pipelined, regathered) -> (FSDP's buffers then, their sum)
        out, fsdp_at = [], {}
        for f in flights:
            pipe_now = self._pipeline_terms(r, f)
            shared = held_sum + sum(pipe_now.values())
            for a, w, before, layer, phase, ops in sums.bwd_layers[r]:
                forward = phase == "forward"
                if forward and not f.forwards:
                    continue
                # a pipelined stage's units are left unsharded by a backward: before its first, none
                # is
                pipelined = st.pipelined and (f.accumulated or not forward)
                kept = not forward and self._kept(st, f)
                key = layer, forward, pipelined, f.regathered, kept
                if key not in fsdp_at:
                    fb = fsdp_buffers(sums.units[r], layer, zero_stage=st.fsdp_stage,
                                      p_item=st.p_item, g_item=ITEMSIZE["float32"], forward=forward,
                                      params=st.params, pipelined=pipelined,
                                      regathered=f.regathered, kept=kept)
                    fsdp_at[key] = fb, sum(fb.values())
                fb, fb_sum = fsdp_at[key]
                rep = self._experts_replicas(r, st, f, layer, forward) if st.experts_copy else {}
                fb, fb_sum = ({**fb, **rep}, fb_sum + sum(rep.values())) if rep else (fb, fb_sum)
                work = "forward_working_set" if forward else "backward_working_set"
                item = 0 if forward else self._sum_item(st, f)
                # once every gradient exists, an op's moment differs from another's by its working
                # set, the saved bytes still alive and the gradients it makes beside the accumulated
                # ones, not by the gradients still to come that set the first backward's peak op:
                # the layer's peak is the op where those weigh most, whether or not it makes any
                # (FSDP's 16-bit gradients)
                top = (accumulating_op(ops, item) if f.accumulated and not forward
                       else (None, 0.0, 0.0, 0.0, 0.0))
                merges = f.others * sums.cp_merges[r] + sums.cp_merges_before[r].get(layer, 0.0)
                for op, dw, da, dbefore, made in (top, *(ops if per_op else ())):
                    alive = (f.others + 1) * -rs + f.others * sums.acts[r] + a + da - merges
                    later = 0.0 if forward else st.params - before - dbefore
                    grads, gterms = self._gradients(st, f, later)
                    mine = {"saved_activations": alive, "cp_merge_copies": merges, work: w + dw} | (
                        {"new_weight_gradients": made * item} if item else {}) | (
                        self.received(r, layer, phase))
                    out.append(PeakMoment(phase, layer, grads,
                                          (mine, fb, st.held, pipe_now, gterms),
                                          grads + sum(gterms.values()) + sum(mine.values()) + fb_sum
                                          + shared, op, f.later))
        return out

    def received(self, r: int, layer: int, phase: str) -> dict[str, float]:
        """The rows expert parallelism's all-to-all delivered to ``layer``'s experts, at its forward
        and its recompute (``ep_received_rows``: :attr:`~.terms.LayerTerms.ep_received`), whose
        largest moment is the local experts' forward on a Mixture-of-Experts layer. Measured
        (MemTracker, Mixtral, dp 2 x ep 2 x pp 2 under full recompute): the tracker peaks in the
        experts' recompute holding the all-to-all's output beside what the graph saves there; a
        backward does not hold it (nothing saves it)."""
        got = self.sums.ep_received[r].get(layer, 0.0) if phase != "backward" else 0.0
        return {"ep_received_rows": got} if got else {}

    def _kept(self, st: _States, f: _Flight) -> bool:
        """A backward of ``f`` keeps every FSDP unit gathered (:func:`.moment.fsdp_buffers`'
        ``kept``): ZeRO-2 accumulating over micro-batches, reduce-scattering each (not a pipelined
        stage), with earlier micro-batches' gradients and before the last micro-batch, which
        reshards. The accumulated flight stands for the micro-batches between the first and the
        last: there are some from 3 micro-batches on."""
        return (self.s.zero_stage == 2 and not st.pipelined and f.accumulated
                and self.s.micro_batches > 2)

    @staticmethod
    def _sum_item(st: _States, f: _Flight) -> int:
        """Bytes of each weight gradient a backward of ``f`` makes beside the one accumulated
        (:func:`.memory.accumulating_op`, as :mod:`.staged` counts them): where earlier
        micro-batches' gradients exist and autograd adds to them in place, on the parameters
        themselves (no FSDP: DDP's ``no_sync``, a pipeline stage) or on FSDP's unsharded ones while
        it accumulates (:attr:`_States.pipelined`). Measured with MemTracker (a GPT of hidden 128,
        1F1B over 2 gloo ranks, 4 micro-batches, fp32): each rank's later backwards 8.2 and 9.4 % of
        its peak above the model without it, within 0.4 % with it. None where FSDP reduces each
        micro-batch's gradients (it frees the unsharded one each time)."""
        if not f.accumulated or not (st.pipelined or st.fsdp_stage < 2):
            return 0
        return st.sum_item

    def _experts_replicas(self, r: int, st: _States, f: _Flight, layer: int,
                          forward: bool) -> dict[str, float]:
        """FSDP2's ``replicate`` on each experts module beside DDP (``runtime/ddp.py``
        replicate_experts; each module its own root) at a moment of ``layer``. It gathers the
        experts' parameters (float32: no mixed precision policy) in their forward and keeps them to
        the end of their backward (``replicate_gathered_experts``): those of the rank's layers up to
        ``layer`` while forwards run (a backward resharded the ones after it; a pipeline's forward
        since gathered the earlier ones again), in a pipeline's cool-down only ``layer``'s. Each
        experts module whose backward ran holds its reduction's buffers to the end of the rank's
        backward, in float32: the reduce-scatter input and the all-reduce's output, which the first
        micro-batch's gradients are views of (``replicate_reduce_buffers``; ``foreach_reduce`` keeps
        both for the next layer's reduction, measured: Mixtral, EP x PP)."""
        upto, experts = self.sums.experts_upto[r], self.sums.experts[r]
        f32 = ITEMSIZE["float32"]
        mine = upto.get(layer, 0.0)
        gathered = mine if f.forwards else mine - upto.get(layer - 1, 0.0)
        after = 0.0 if forward else experts - mine
        return {"replicate_gathered_experts": gathered * f32,
                "replicate_reduce_buffers": after * f32 * (2 if f.accumulated else 1)}

    def _loss_moments(self, r: int, st: _States, flights: list[_Flight]) -> list[PeakMoment]:
        """The last rank's loss backward under each flight: the log-softmax output (fp32) saved, its
        gradient and the logits' gradient alive; FSDP units are resharded then (ZeRO 3). None with
        the fused head, whose loss is in the head layer's working set."""
        s, sums = self.s, self.sums
        if r != s.rank_of(s.pp * s.virtual_stages - 1) or not self.loss_applies():
            return []
        rs = sums.pipe[r]["recv_saved"] if s.pp > 1 else 0.0
        out = []
        for f in flights:
            merges = (f.others + 1) * sums.cp_merges[r]
            loss = {"saved_activations": (f.others + 1) * (sums.acts[r] - rs) - merges,
                    "cp_merge_copies": merges, **self.loss_terms(st)}
            if st.fsdp_stage == 2:  # every unit's parameters still unsharded: no backward has run
                loss["fsdp_unsharded_params"] = st.params * st.p_item
            if st.experts_copy:  # so are the experts' replicas (_experts_replicas)
                loss["replicate_gathered_experts"] = sums.experts[r] * ITEMSIZE["float32"]
            grads, gterms = self._gradients(st, f, 0.0)
            pipe_now = self._pipeline_terms(r, f)
            out.append(PeakMoment("loss", None, grads, (loss, st.held, pipe_now, gterms),
                                  grads + sum(gterms.values()) + sum(loss.values())
                                  + sum(st.held.values()) + sum(pipe_now.values()), later=f.later))
        return out

    def loss_applies(self) -> bool:
        """The loss has moments of its own: the model has an output, and the head is not fused with
        the loss (whose temporaries are the head layer's working set then)."""
        return bool(self.prof.output_numel) and not self.s.fused_loss

    def loss_terms(self, st: _States) -> dict[str, float]:
        """The loss's bytes at its backward, beside the saved activations: the log-softmax output
        (fp32) it saves, and its temporaries."""
        s, prof = self.s, self.prof
        lp_div = s.tp if s.vocab_parallel_loss(capable=prof.loss_parallel,
                                               head_tp=self.sums.head_tp) else 1
        out_numel = prof.output_numel * (s.mb_samples / prof.batch) * self.seq_ratio / s.cp
        # gradients of the log-softmax and of the logits; torch's loss_parallel backward holds
        # three fp32 temporaries of the logits' shard beside the saved one (MemTracker, torch 2.13:
        # 4 x the shard's fp32 bytes at tp 2 and 4, in fp32 and under bf16 autocast). Unsplit, the
        # default loss's forward holds the logits and their flattened copy (the next-token slice is
        # not contiguous) in the compute dtype, and under autocast the float32 copy ``.float()``
        # makes (runtime/data.py default_loss)
        half = s.amp != "none"
        loss_temp = (out_numel * 4 * 3 / lp_div if lp_div > 1
                     else out_numel * (2 * st.p_item + (4 if half else 0)))
        return {"loss_saved": out_numel * 4 / lp_div, "loss_temporaries": loss_temp}

    def _reduce_moment(self, r: int, st: _States) -> PeakMoment:
        """A pipelined FSDP stage after its last backward (``PipelineStage.perform_reduce_grad``):
        every gradient still unsharded, every unit's parameters too (no backward resharded them),
        and the first group's reduce-scatter input (the root's, whose state FSDP lists first),
        flattened in ``reduce_dtype``."""
        sums = self.sums
        units = sums.units[r]
        first = sums.nofsdp[r] or (units[0].numel if units else 0.0)
        g_item = ITEMSIZE["float32"]
        terms = {"fsdp_unsharded_grads": (st.params + st.whole_grads) * g_item,
                 "fsdp_reduce_scatter": first * g_item,
                 "fsdp_unsharded_params": st.params * st.p_item,
                 "ddp_buckets": st.held["ddp_buckets"]}
        return PeakMoment("reduce", None, 0.0, (terms,), sum(terms.values()))

    def _step_moment(self, r: int, st: _States) -> PeakMoment:
        """The optimizer step: every gradient and foreach temporaries (CUDA: a list the size of the
        gradients; CPU: one parameter at a time); autocast's weight copies are gone, ZeRO 2's
        gathered parameters resharded (CPU: torch's single-tensor Adam holds two of the largest
        parameter's size at once, exp_avg_sq.sqrt() and its quotient by the bias correction;
        MemTracker, LLaMA)."""
        gb = st.gb
        temporaries = (gb if self.prof.device_kind == "cuda"
                       else 2 * self.sums.largest[r] * ITEMSIZE["float32"])
        at_opt = {"optimizer_step_temporaries": temporaries, "ddp_buckets": st.held["ddp_buckets"],
                  "fsdp_root_params": 0.0 if self.s.amp != "none"
                  else st.held.get("fsdp_root_params", 0.0)}
        return PeakMoment("step", None, gb, (at_opt,), gb + sum(at_opt.values()))


class _States(NamedTuple):
    """A rank's model states (bytes) and what stays alive through its forward and backward."""

    pb: float
    gb: float
    ob: float
    params: float
    """its local parameters (numel)"""
    p_item: int
    """bytes of a parameter in the compute dtype (FSDP's unsharded parameters)"""
    held: dict[str, float]
    """buffers alive the whole forward and backward"""
    pipelined: bool
    """an FSDP pipeline stage (torch's ``PipelineStage``), or ZeRO-1 over several micro-batches: its
    gradients and parameters held unsharded from a micro-batch's backward to the step's reduction
    (:attr:`~.setting.Setting.unsharded_accumulation`)"""
    fsdp_stage: int
    """how FSDP2 holds the parameters: the ZeRO stage, or 2 under :func:`replicated` data
    parallelism"""
    experts_copy: bool = False
    """its experts are FSDP2 replicas beside DDP (:func:`replicated_experts`)"""
    whole_grads: float = 0.0
    """numel by which its unsharded gradients outgrow its local parameters
    (``RankSums.whole_grads``)"""

    @property
    def sum_item(self) -> int:
        """Bytes of each gradient a backward makes beside the one accumulated
        (:func:`.memory.accumulating_op`): float32 where autograd adds it in place (no FSDP, or FSDP
        in float32). None under FSDP with 16-bit parameters: FSDP moves each unit's gradients into a
        float32 sum of its own after the unit's backward
        (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``to_accumulated_grad_if_needed`` and
        ``accumulate_unsharded_grad_if_needed``), so autograd finds no gradient to add to."""
        return (0 if self.fsdp_stage >= 2 and self.p_item < ITEMSIZE["float32"]
                else ITEMSIZE["float32"])


class _Flight(NamedTuple):
    """One kind of backward moment of a pipeline rank (:meth:`RankMemory._flights`)."""

    others: float
    """other micro-batches in flight, each holding all its saved activations"""
    accumulated: bool
    """the gradients of earlier micro-batches exist (all the rank's parameters have one)"""
    later: bool | None
    """a backward after the rank's first (True), its first (False); None where one moment stands for
    all"""
    regathered: bool = False
    """right after another backward of a pipelined ZeRO-3 stage: every unit still unsharded"""
    forwards: bool = False
    """forwards run among these backwards (not in a cool-down, where only backwards are left)"""


def moment_layers(cnt: int) -> list[int]:
    """Which of a run of ``cnt`` identical layers (0 = its first) a backward peak can be at: the
    saved tensors alive grow by one layer's from one to the next and the gradients shrink by one
    layer's, so the extremes, and the layers next to them, where FSDP's buffers change (a prefetch
    only after an earlier unit, a reduce-scatter only after a later one, :func:`fsdp_buffers`)."""
    return sorted({j for j in (cnt - 1, cnt - 2, 1, 0) if 0 <= j < cnt}, reverse=True)


def replicated(s: Setting) -> bool:
    """Data parallelism over TP-split parameters: FSDP2's ``replicate`` (DDP takes no DTensor),
    which gathers each unit's parameters into a buffer of their own as FSDP does over a shard group
    of one rank, and keeps them as ZeRO 2 does (``runtime/ddp.py``). ZeRO-0 only: ZeRO-1 is FSDP."""
    return s.replicas > 1 and s.zero_stage == 0 and s.tp > 1


def replicated_experts(s: Setting) -> bool:
    """Expert parallelism beside DDP (ZeRO-0, no TP): each experts module is FSDP2's ``replicate``
    over the ranks holding the same experts (``runtime/ddp.py`` replicate_experts), which gathers
    and reduces as FSDP does."""
    return s.ep > 1 and s.replicas > 1 and s.zero_stage == 0 and s.tp == 1


def ddp_bucket_bytes(s: Setting, params: float) -> float:
    """DDP's gradient buckets: flat fp32 tensors the size of the parameters it reduces, held for the
    whole run (``gradient_as_bucket_view=False``, as ``runtime/ddp.py`` builds it: the gradients are
    copied in, not views). Only where the runtime uses DDP: dp > 1, ZeRO-0, no TP (with TP it uses
    FSDP2's replicate, which has no buckets; ZeRO-1 is FSDP2)."""
    return (params * ITEMSIZE["float32"] if s.replicas > 1 and s.zero_stage == 0 and s.tp == 1
            else 0.0)


def received_rows(lp, precision: str, scale: float, experts: float) -> float:
    """Bytes of the rows expert parallelism's all-to-all delivers to a layer's local experts
    (``experts``: their parameters, 0 without ep) per micro-batch, its profile ``lp`` scaled by
    ``scale`` (the micro-batch and the rows routed to the rank): one row per (token, choice) pair in
    the hidden states' dtype, float32 but where FSDP's 16-bit parameters make them 16-bit
    (``runtime/ep.py`` sends the experts' input as it is)."""
    if not experts:
        return 0.0
    return (lp.dispatch_half if precision == "autocast_lowp" else lp.dispatch_bytes) * scale
