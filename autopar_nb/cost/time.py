"""Step-time pieces: compute by op class, memory-bound ops by bytes, pipeline bubble, optimizer
step.

Compute-bound ops (matmul, conv, attention) take FLOPs / (peak FLOP/s x efficiency of their class);
every other op is memory-bound and takes bytes moved / (HBM bandwidth x efficiency); each non-view
op adds a launch overhead. In a block compiled with ``torch.compile`` both of those memory-bound
terms are scaled by the factor ``compile_memory_bound`` (Inductor fuses them; matmuls keep their
time). Backward moves about twice the bytes of forward. Under autocast each op is costed at the
dtype it runs in there (:mod:`.autocast`, the plan's ``precision.fp32_ops`` / ``low_precision_ops``
applied), and the copies autocast makes are memory-bound ops of their own. All factors come from
:mod:`autopar_nb.cost.factors`.
"""

from __future__ import annotations

from .efficiency import gemm_penalty
from .flash import attention_efficiency
from .float8 import float8_time
from .offload import cpu_optimizer_time
from .profile import AmpTime, LayerProfile

COMPUTE_CLASSES = ("matmul", "conv", "attention")

MFU_BASIS = ("6N + 12LHQT per token: 3 x the forward's matmul and attention FLOPs, recompute not "
             "counted")
"""the model FLOPs MFU counts (:func:`model_flops`), as the widget, ``plan.explain()`` and
``bench/published.py`` label it"""


def pass_flops(lp: LayerProfile, *, scale: float, quad_scale: float) -> tuple[float, float]:
    """(forward, backward) FLOPs of one micro-batch through the layer as they run (hardware FLOPs,
    recompute aside): every op's, the attention scores' scaled with the sequence squared
    (``quad_scale``)."""
    def total(split: dict, rep: dict, other: float) -> float:
        return sum(
            (split.get(c, 0.0) + rep.get(c, 0.0)) * (quad_scale if c == "attention" else scale)
            for c in {*split, *rep}) + other * scale
    return total(lp.flops_split, lp.flops_rep, lp.flops_other), total(lp.bwd_split, lp.bwd_rep,
                                                                      lp.bwd_other)


def model_flops(lp: LayerProfile, *, scale: float, quad_scale: float) -> float:
    """The model FLOPs of one micro-batch through the layer, as MFU counts them: 3 x its forward's
    matmul, convolution and attention FLOPs (a forward and a backward of twice its work: PaLM,
    Chowdhery et al. 2022, App. B, whose 6N + 12LHQT per token this is for a transformer, N the
    weights its matmuls multiply: not an input embedding's, a lookup; torchtitan's
    ``get_num_flop_per_token`` counts the same but for the norms' scales, 0.01 % of a 7B). Not
    counted: norms, activations and residuals (llm-foundry's benchmarks leave them out too), and
    what a backward runs again: recompute and the attention kernel's second QK^T (torch's FLOP
    counter gives SDPA's backward 2.5 x its forward; those are hardware FLOPs).
    ``scale``/``quad_scale``: as :func:`layer_compute_time` (attention scores scale with the
    sequence squared)."""
    return 3 * sum((lp.flops_split.get(cls, 0.0) + lp.flops_rep.get(cls, 0.0))
                   * (quad_scale if cls == "attention" else scale) for cls in COMPUTE_CLASSES)


def layer_compute_time(lp: LayerProfile, *, tp: int, sp: bool, precision: str, scale: float,
                       quad_scale: float, device, factors, compiled: bool = False,
                       low_dtype: str = "bfloat16", float8: bool = False,
                       f8_weight_cast: bool = True) -> tuple[float, float, float]:
    """(forward, backward, selective-recompute extra) seconds of one micro-batch through the layer
    on one rank.

    ``tp`` divides the ops inside TP regions (and the ops outside them under sequence parallel);
    ``precision``: one of :data:`~.profile.PRECISIONS` (under autocast each op at the dtype it runs
    in there, the plan's op lists applied: :func:`amp_compute_time`; ``low_dtype``: autocast's,
    "bfloat16" or "float16"); ``scale`` and ``quad_scale`` scale the captured batch's work to the
    micro-batch (linear and attention-score terms); ``compiled``: the layer runs under
    ``torch.compile``; ``float8``: its Linears as float8 training runs them
    (:func:`.float8.float8_time`, under autocast only; ``f8_weight_cast`` False: FSDP casts their
    weights)."""
    if precision != "fp32":
        fwd, bwd, sel = amp_compute_time(lp, lp.time_amp[precision], tp=tp, sp=sp, scale=scale,
                                         quad_scale=quad_scale, device=device, factors=factors,
                                         compiled=compiled, low_dtype=low_dtype)
        f8 = float8_time(lp, tp=tp, scale=scale, device=device, factors=factors, compiled=compiled,
                         low_dtype=low_dtype, weight_cast=f8_weight_cast) if float8 else (0.0, 0.0)
        return fwd + f8[0], bwd + f8[1], sel
    peak = device.flops("float32")
    fwd = bwd = 0.0
    for cls in COMPUTE_CLASSES:
        eff = factors.efficiency(cls, False)
        s = quad_scale if cls == "attention" else scale
        fwd += (lp.flops_split.get(cls, 0.0) / tp + lp.flops_rep.get(cls, 0.0)) * s / (peak * eff)
        bwd += (lp.bwd_split.get(cls, 0.0) / tp + lp.bwd_rep.get(cls, 0.0)) * s / (peak * eff)
    hbm = device.hbm_bandwidth * factors.eff_hbm
    fwd, bwd = _shaped(lp, fwd, bwd, tp=tp, scale=scale, device=device,
                       rate=peak * factors.efficiency("matmul", False), hbm=hbm, itemsize=4)
    mem = (lp.mem_split / tp + lp.mem_rep / (tp if sp else 1)) * scale / hbm
    fwd, bwd, sel = _memory_bound(lp, fwd, bwd, (mem, 2 * mem), (lp.n_ops, 2 * lp.n_ops), tp=tp,
                                  hbm=hbm, factors=factors, compiled=compiled)
    return fwd, bwd, sel + _matmuls_again(lp, tp, scale, peak * factors.efficiency("matmul", False))


def amp_compute_time(lp: LayerProfile, amp: AmpTime, *, tp: int, sp: bool, scale: float,
                     quad_scale: float, device, factors, compiled: bool = False,
                     low_dtype: str = "bfloat16") -> tuple[float, float, float]:
    """:func:`layer_compute_time` under autocast: a compute op kept in float32 (the plan's
    ``fp32_ops``, autocast's fp32 list: :attr:`~.profile.AmpTime.fp32_split`) at the float32 peak
    and efficiency, any other at ``low_dtype``'s; memory-bound ops by the bytes they move at their
    dtypes; each copy autocast makes of an activation input (read + write, once more in backward
    when it requires grad) costed as a memory-bound op (the parameters' copies:
    :func:`weight_cast_time`)."""
    lo, hi = device.flops(low_dtype), device.flops("float32")
    fwd = bwd = 0.0
    for cls in COMPUTE_CLASSES:
        s = quad_scale if cls == "attention" else scale
        f32 = (amp.fp32_split.get(cls, 0.0) / tp + amp.fp32_rep.get(cls, 0.0)) * s
        b32 = (amp.bwd_fp32_split.get(cls, 0.0) / tp + amp.bwd_fp32_rep.get(cls, 0.0)) * s
        low = (lp.flops_split.get(cls, 0.0) / tp + lp.flops_rep.get(cls, 0.0)) * s - f32
        blow = (lp.bwd_split.get(cls, 0.0) / tp + lp.bwd_rep.get(cls, 0.0)) * s - b32
        eff_f, eff_b = _half_efficiency(lp, cls, factors, device=device,
                                        seq_ratio=quad_scale / scale if scale else 1.0)
        rate_hi = hi * factors.efficiency(cls, False)
        fwd += low / (lo * eff_f) + f32 / rate_hi
        bwd += blow / (lo * eff_b) + b32 / rate_hi
    hbm = device.hbm_bandwidth * factors.eff_hbm
    fwd, bwd = _amp_shaped(lp, amp, fwd, bwd, tp=tp, scale=scale, device=device, hbm=hbm,
                           rates=(lo * factors.efficiency("matmul", True),
                                  hi * factors.efficiency("matmul", False)))
    rep_div = tp if sp else 1
    mem = (amp.mem_split / tp + amp.mem_rep / rep_div) * scale / hbm
    casts = (amp.cast_split / tp + amp.cast_rep / rep_div + amp.cast_whole) * scale / hbm
    cast_bwd = ((amp.cast_bwd_split / tp + amp.cast_bwd_rep / rep_div
                 + amp.cast_bwd_whole) * scale / hbm)
    ops = (lp.n_ops + amp.casts, 2 * lp.n_ops + amp.casts)
    fwd, bwd, sel = _memory_bound(lp, fwd, bwd, (mem + casts, 2 * mem + cast_bwd), ops, tp=tp,
                                  hbm=hbm, factors=factors, compiled=compiled)
    return fwd, bwd, sel + _matmuls_again(lp, tp, scale, lo * factors.efficiency("matmul", True))


def _half_efficiency(lp: LayerProfile, cls: str, factors, *, device, seq_ratio: float
                     ) -> tuple[float, float]:
    """(forward, backward) fraction of the 16-bit peak ops of class ``cls`` reach: the fused
    attention kernel's published speed for the layer's head dims, sequence (``seq_ratio`` x the
    captured one) and masks where the device has figures (:mod:`.flash`, times
    ``flash_speed``), else the class's constant efficiency."""
    eff = factors.efficiency(cls, True)
    if cls != "attention" or not lp.attentions:
        return eff, eff
    att = attention_efficiency(lp.attentions, seq_ratio=seq_ratio, device=device.name)
    if att is None:
        return eff, eff
    return att[0] * factors.flash_speed, att[1] * factors.flash_speed


def _shaped(lp: LayerProfile, fwd: float, bwd: float, *, tp: int, scale: float, device,
            rate: float, hbm: float, itemsize: int) -> tuple[float, float]:
    """``fwd`` / ``bwd`` with what the layer's GEMMs take beyond their FLOPs at ``rate`` for their
    shapes (tile and wave quantisation, the memory bound of skinny ones:
    :func:`.efficiency.gemm_penalty`)."""
    f, b = gemm_penalty(lp.gemms, scale=scale, tp=tp, device=device.name, rate=rate, hbm=hbm,
                        itemsize=itemsize)
    return fwd + f, bwd + b


def _amp_shaped(lp: LayerProfile, amp: AmpTime, fwd: float, bwd: float, *, tp: int, scale: float,
                device, hbm: float, rates: tuple[float, float]) -> tuple[float, float]:
    """:func:`_shaped` under autocast: the GEMMs' shape costs at the 16-bit and the float32 rate
    (``rates``), weighed by the share of the layer's matmul FLOPs autocast keeps in float32 (exact
    when it keeps all or none)."""
    kept = amp.fp32_split.get("matmul", 0.0) + amp.fp32_rep.get("matmul", 0.0)
    total = lp.flops_split.get("matmul", 0.0) + lp.flops_rep.get("matmul", 0.0)
    share = min(1.0, kept / total) if total else 0.0
    (lf, lb), (hf, hb) = (_shaped(lp, 0.0, 0.0, tp=tp, scale=scale, device=device, rate=r, hbm=hbm,
                                  itemsize=size) for r, size in zip(rates, (2, 4), strict=True))
    return fwd + (1 - share) * lf + share * hf, bwd + (1 - share) * lb + share * hb


def _matmuls_again(lp: LayerProfile, tp: int, scale: float, rate: float) -> float:
    """Seconds selective recompute spends running every other weight matmul again (``rate``: FLOP/s;
    a matmul the plan keeps in float32 is costed at the 16-bit rate too)."""
    return (lp.sel_split / tp + lp.sel_rep) * scale / rate


def _memory_bound(lp: LayerProfile, fwd: float, bwd: float, mem: tuple[float, float],
                  ops: tuple[int, int], *, tp: int, hbm: float, factors,
                  compiled: bool) -> tuple[float, float, float]:
    """(forward, backward, selective extra): the compute seconds ``fwd`` / ``bwd`` with the
    memory-bound seconds ``mem`` (forward, backward) and the launch overhead of ``ops`` kernels
    (forward, backward) added, both scaled by ``compile_memory_bound`` in a compiled block, and the
    dense Embedding gradient."""
    k = factors.compile_memory_bound if compiled else 1.0
    mem_f, mem_b = mem[0] * k, mem[1] * k
    over_f, over_b = ops[0] * factors.op_overhead_s * k, ops[1] * factors.op_overhead_s * k
    # the dense Embedding gradient (fp32, like the weights) is the table's size whatever the batch:
    # not scaled
    emb = (lp.emb_bwd_split / tp + lp.emb_bwd_rep) / hbm
    # selective recompute (runtime/ac.py) runs the memory-bound ops of the forward again (and every
    # other weight matmul: _matmuls_again)
    return fwd + mem_f + over_f, bwd + mem_b + over_b + emb, mem_f + over_f


def bubble_fraction(schedule: str, *, pp: int, micro_batches: int, virtual_stages: int,
                    factors) -> float:
    """Idle time as a multiple of one micro-batch's stage time: (pp - 1) for GPipe/1F1B (Huang et
    al. 2019; Narayanan et al. 2021), (pp - 1)/v interleaved, a calibratable fraction of that for
    zero-bubble schedules."""
    if pp <= 1:
        return 0.0
    base = float(pp - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return base / max(1, virtual_stages)
    if schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
        return base * factors.bubble_zero_bubble
    return base


def weight_cast_time(numel: float, *, micro_batches: int, regions: int, device, factors) -> float:
    """Seconds a step spends on the 16-bit copies autocast makes of ``numel`` float32 parameters
    (the layers' ``cast_split`` / ``cast_rep``): each copy reads 4 bytes and writes 2 once per
    autocast region (its weight cache lives that long: ``regions`` per step, one per micro-batch, or
    one for a whole pipeline schedule), and each micro-batch's backward casts the copy's gradient
    back to float32 (2 + 4 bytes)."""
    return numel * (4 + 2) * (regions + micro_batches) / (device.hbm_bandwidth * factors.eff_hbm)


def optimizer_time(local_params: float, cluster, factors, *, host: bool = False) -> float:
    """A fused Adam step is memory-bound: bytes per local parameter / HBM bandwidth. ``host``: the
    step runs on the host's CPUs (CPU offload: :func:`.offload.cpu_optimizer_time`; on the ``cpu``
    preset the device is that CPU)."""
    if host and cluster.name != "cpu":
        return cpu_optimizer_time(local_params, cluster)
    return local_params * factors.optimizer_bytes_per_param / (cluster.device.hbm_bandwidth
                                                               * factors.eff_hbm)
