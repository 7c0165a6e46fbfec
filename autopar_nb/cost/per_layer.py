"""One layer's :class:`~.terms.LayerTerms` on one rank (:meth:`.estimate.Evaluator.terms`): its
compute, saved and working bytes, and its tensor, context and expert parallelism's collectives, for
one micro-batch; cached per evaluator by the layer's repeated-block representative."""

from __future__ import annotations

from ..plan import DTYPE_NAMES, ITEMSIZE, RECOMPUTE
from .async_tp import async_tp_exposed, tp_matmul_time
from .comm import collective_time, link_for
from .cpu import layer_cpu
from .float8 import float8_weights_local
from .memory import activation_bytes, forward_peak, input_pass, op_deltas, op_moments, peak_op
from .peak import received_rows
from .terms import LayerTerms
from .time import layer_compute_time, model_flops, pass_flops


def layer_terms(ev, i: int, *, tp: int, sp: bool, precision: str, mb_samples: float, ep: int = 1,
                compiled: bool = False, cp: int = 1, amp: str = "bf16", fused_norm: bool = False,
                float8: bool = False, async_tp: bool = False, gather: bool = False,
                f8_gathered: bool = False, routed: float = 1.0) -> LayerTerms:
    """Per-layer terms of evaluator ``ev``, cached by the layer's repeated-block representative.
    ``precision``: one of :data:`~.profile.PRECISIONS` (:func:`~.profile.precision_of`); ``amp``:
    autocast's dtype there ("bf16", "fp16": its peak FLOP/s). With context parallelism (``cp``) a
    rank holds 1/cp of every sequence: its compute and activations are divided by cp (with torch's
    load balancing, causal attention's work too), and each attention layer all-gathers the keys and
    values in forward and again in backward, and passes their float32 gradients round the ring cp
    times (``_templated_ring_attention_backward``); the gathered keys and values are one more
    working buffer. ``fused_norm``: as the fused-norm graph profiles it (``ev.norm_prof``);
    ``float8``: :mod:`.float8`; ``async_tp``: :mod:`.async_tp`; ``gather``: the layer gathers SP's
    shards at its input (``prof.sp_gather``); ``f8_gathered``: FSDP gathers the float8 weights cast
    (:func:`.float8.gathered_in_float8`); ``routed``: see ``at_routing``."""
    fused_norm = fused_norm and ev.norm_prof is not None
    key = (ev.prof.rep[i], tp, sp, precision, mb_samples, ep, compiled, cp, amp, fused_norm,
           float8, async_tp, gather, f8_gathered, routed)
    hit = ev._cache.get(key)
    if hit is not None:
        return hit
    half = precision != "fp32"
    prof = ev.norm_prof if fused_norm else ev.prof
    lp = prof.layers[ev.prof.rep[i]].at_tp(tp).at_routing(routed)  # (at_tp: repeated k/v)
    scale = mb_samples / ev.prof.batch * ev.seq_ratio / cp
    qscale = mb_samples / ev.prof.batch * ev.seq_ratio ** 2 / cp
    low = DTYPE_NAMES[amp] if amp != "none" else "bfloat16"
    shape = dict(tp=tp, sp=sp, precision=precision, scale=scale, quad_scale=qscale)
    fwd, bwd, sel = layer_compute_time(lp, **shape, device=ev.cluster.device, factors=ev.f,
                                       compiled=compiled, low_dtype=low, float8=float8,
                                       f8_weight_cast=not f8_gathered)
    act = {r: activation_bytes(lp, **shape, recompute=r, megatron_sp=ev.megatron_sp)
           for r in RECOMPUTE}
    comm, step_s = _tp_comm(ev, lp, tp=tp, sp=sp, half=half, scale=scale, gather=gather)
    out = (lp.output_amp[precision] if half else lp.output_bytes) * scale / (tp if sp else 1)
    moments = op_moments(lp, **shape, megatron_sp=ev.megatron_sp)
    merge = (lp.q_half if half else lp.q_bytes) * scale / tp if cp > 1 and lp.kv_bytes else 0
    if cp > 1 and lp.kv_bytes:
        ring = ring_comm(ev, lp, comm, cp=cp, tp=tp, half=half, scale=scale)
        moments = [(op, w + ring if op in lp.attention_ops else w, fr, lat)
                   for op, w, fr, lat in moments]
        # the ring merges the output's chunks with torch.cat: transposing it back to (B, T,
        # heads, hd) is a copy, which the output projection saves beside what the ring's
        # backward keeps (not the last cp rank's, whose last merge keeps the kernel's layout:
        # the first rank's is what counts)
        act["none"] += merge
    work, freed, later = peak_op(moments)
    fwd_fl, bwd_fl = pass_flops(lp, scale=scale, quad_scale=qscale)
    experts = lp.params_experts / ep if ep > 1 and lp.experts else 0.0
    mm = tp_matmul_time(lp, tp=tp, scale=scale, device=ev.cluster.device, factors=ev.f,
                        low_dtype=low)
    exposed = async_tp_exposed(comm, overlap=ev.f.overlap_tp,
                               matmul_s=mm if async_tp and tp > 1 else 0.0)
    a2a_fwd, a2a = (all_to_alls(ev, lp, ep=ep, tp=tp, half=half, scale=scale) if experts
                    else (0.0, 0.0))
    local = lp.params_split / tp + lp.params_rep - (lp.params_experts - experts if experts else 0)
    t = LayerTerms(fwd, bwd, sel, act, local, comm, out, work, fwd_fl + bwd_fl, fwd_fl,
                   lp.quad_flops * qscale + (lp.sel_split + lp.sel_rep) * scale,
                   lp.largest_param / (tp if lp.tp else 1), exposed + a2a, experts, a2a_fwd)
    comm.update({"all_to_all": a2a} if a2a else {})
    t.tp_step, t.freed, t.later_params = step_s, freed, later
    t.cp_merge, t.ep_received = merge, received_rows(lp, precision, scale * routed, experts)
    t.op_deltas = op_deltas(moments, (work, freed, later), local)
    _fill_rest(ev, t, lp, shape, float8=float8, compiled=compiled)
    ev._cache[key] = t
    return t


def _fill_rest(ev, t: LayerTerms, lp, shape: dict, *, float8: bool, compiled: bool) -> None:
    """The terms past the layer's compute, collectives and backward peak: its forward's largest
    moments, autocast's and float8's weight copies, the gradients a vocab split outgrows, the input
    pass's split (zero-bubble schedules) and the host's time issuing it."""
    tp, sp, precision = shape["tp"], shape["sp"], shape["precision"]
    half = precision != "fp32"
    t.forward = {rec: forward_peak(lp, **shape, megatron_sp=ev.megatron_sp, recompute=rec)
                 for rec in RECOMPUTE}
    t.cast_local = lp.cast_split / tp + lp.cast_rep if precision == "autocast" else 0.0
    t.whole_grads = lp.embedding_params * (1 - 1 / tp)
    t.f8_weights_local = float8_weights_local(lp, tp) if float8 else 0.0
    t.weight_grads, t.input_work, t.input_ops = input_pass(lp, **shape,
                                                           megatron_sp=ev.megatron_sp)
    styled = len(lp.tp) + (len(lp.norms) if sp else 0) if tp > 1 else 0
    t.cpu = layer_cpu(lp.n_ops + (lp.time_amp[precision].casts if half else 0), styled=styled,
                      compiled=compiled, factors=ev.f)
    t.tensors = lp.param_tensors
    t.model_flops = model_flops(lp, scale=shape["scale"], quad_scale=shape["quad_scale"])


def _tp_comm(ev, lp, *, tp: int, sp: bool, half: bool, scale: float,
             gather: bool) -> tuple[dict[str, float], float]:
    """Seconds of the layer's TP collectives per micro-batch by kind, and those run once per step
    (the repeated key/value projections' weight gradients); ``gather``: with the gather of SP's
    shards at its input."""
    comm: dict[str, float] = {}
    step_s = 0.0
    if tp <= 1:
        return comm, step_s
    link = link_for(ev.cluster, size=tp, stride=1)
    for c in [*lp.comms, *ev.prof.sp_gather_comms] if gather else lp.comms:
        if c.phase == "step":
            step_s += collective_time(c.kind, c.nbytes, tp, link, ev.f.eff_link)
            continue
        nbytes = (c.half_bytes if half else c.nbytes) * scale
        # sequence parallel turns an all-reduce into a reduce-scatter and an all-gather
        kinds = ("reduce_scatter", "all_gather") if sp and c.kind == "all_reduce" else (c.kind,)
        for k in kinds:
            comm[k] = comm.get(k, 0.0) + collective_time(k, nbytes, tp, link, ev.f.eff_link)
    return comm, step_s


def ring_comm(ev, lp, comm: dict[str, float], *, cp: int, tp: int, half: bool,
              scale: float) -> float:
    """Context parallelism's collectives of one layer and micro-batch added to ``comm`` (see
    :func:`layer_terms`; the cp ranks are consecutive at stride tp); returns the bytes the ring's
    backward holds at the attention op (``_templated_ring_attention_backward``, torch 2.13): the
    gathered keys and values, the all-gather's input (this rank's, concatenated), float32
    accumulators of dQ, dK and dV (``zeros_like``), and the float32 dK, dV it sends round the
    ring and the ones it receives; of its 1/tp of the heads under TP."""
    link = link_for(ev.cluster, size=cp, stride=tp)
    item = 2 if half else lp.kv_bytes / (lp.kv_half / 2)
    kv, q = lp.kv_half / 2 * scale / tp, lp.q_half / 2 * scale / tp  # this rank's elements
    whole = kv * item * cp  # this micro-batch's keys and values
    held = whole + kv * item + (q + kv) * 4 + 2 * kv * 4
    comm["all_gather"] = comm.get("all_gather", 0.0) + 2 * collective_time("all_gather", whole,
                                                                           cp, link,
                                                                           ev.f.eff_link)
    grads = kv * ITEMSIZE["float32"]  # this rank's dK, dV, accumulated in float32
    comm["send_recv"] = comm.get("send_recv", 0.0) + cp * collective_time("send_recv", grads,
                                                                          cp, link,
                                                                          ev.f.eff_link)
    return held


def all_to_alls(ev, lp, *, ep: int, tp: int, half: bool, scale: float) -> tuple[float, float]:
    """(forward, forward + backward) seconds of expert parallelism's all-to-alls in one layer
    and micro-batch (``runtime/ep.py``: 5 per experts module and step, counted on real runs):
    the per-expert token counts (E integers), the token rows out to the experts and back in
    forward, the same two in backward. The ep ranks are consecutive data-parallel ranks (stride
    tp). Balanced routing: every rank sends and receives the average; a skewed router makes the
    busiest rank's share the time, which this does not model."""
    link = link_for(ev.cluster, size=ep, stride=tp)
    rows = (lp.dispatch_half if half else lp.dispatch_bytes) * scale / len(lp.experts)
    one = collective_time("all_to_all", rows, ep, link, ev.f.eff_link)
    counts = sum(collective_time("all_to_all", 8 * e, ep, link, ev.f.eff_link)
                 for e in lp.experts.values())
    n = len(lp.experts)
    return counts + 2 * n * one, counts + 4 * n * one
