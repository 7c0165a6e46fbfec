"""Step-time pieces: compute by op class, memory-bound ops by bytes, pipeline bubble, optimizer step.

Compute-bound ops (matmul, conv, attention) take FLOPs / (peak FLOP/s x efficiency of their class); every other op
is memory-bound and takes bytes moved / (HBM bandwidth x efficiency); each non-view op adds a launch overhead.
In a block compiled with ``torch.compile`` both of those memory-bound terms are scaled by the factor
``compile_memory_bound`` (Inductor fuses them; matmuls keep their time).
Backward moves about twice the bytes of forward. All factors come from :mod:`autopar_nb.cost.factors`.
"""

from __future__ import annotations

from .profile import LayerProfile

COMPUTE_CLASSES = ("matmul", "conv", "attention")


def layer_compute_time(lp: LayerProfile, *, tp: int, sp: bool, half: bool, scale: float, quad_scale: float,
                       device, factors, compiled: bool = False) -> tuple[float, float, float]:
    """(forward, backward, selective-recompute extra) seconds of one micro-batch through the layer on one rank.

    ``tp`` divides the ops inside TP regions (and the ops outside them under sequence parallel); ``scale`` and
    ``quad_scale`` scale the captured batch's work to the micro-batch (linear and attention-score terms);
    ``compiled``: the layer runs under ``torch.compile``."""
    peak = device.flops("bfloat16" if half else "float32")
    fwd = bwd = 0.0
    for cls in COMPUTE_CLASSES:
        eff = factors.efficiency(cls, half)
        s = quad_scale if cls == "attention" else scale
        fwd += (lp.flops_split.get(cls, 0.0) / tp + lp.flops_rep.get(cls, 0.0)) * s / (peak * eff)
        bwd += (lp.bwd_split.get(cls, 0.0) / tp + lp.bwd_rep.get(cls, 0.0)) * s / (peak * eff)
    byte_scale = 0.5 if half else 1.0  # captured in fp32, run in 16-bit: half the bytes (approximation)
    hbm = device.hbm_bandwidth * factors.eff_hbm
    mem = (lp.mem_split / tp + lp.mem_rep / (tp if sp else 1)) * scale * byte_scale / hbm
    overhead = lp.n_ops * factors.op_overhead_s
    if compiled:
        mem, overhead = mem * factors.compile_memory_bound, overhead * factors.compile_memory_bound
    fwd += mem + overhead
    # the dense Embedding gradient (fp32, like the weights) is the table's size whatever the batch: not scaled
    emb = (lp.emb_bwd_split / tp + lp.emb_bwd_rep) / hbm
    bwd += 2 * mem + 2 * overhead + emb
    # selective recompute (runtime/ac.py) keeps matmul, convolution and attention outputs and runs the rest of the
    # forward again: the memory-bound ops
    sel = mem + overhead
    return fwd, bwd, sel


def bubble_fraction(schedule: str, *, pp: int, micro_batches: int, virtual_stages: int, factors) -> float:
    """Idle time as a multiple of one micro-batch's stage time: (pp - 1) for GPipe/1F1B (Huang et al. 2019;
    Narayanan et al. 2021), (pp - 1)/v interleaved, a calibratable fraction of that for zero-bubble schedules."""
    if pp <= 1:
        return 0.0
    base = float(pp - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return base / max(1, virtual_stages)
    if schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
        return base * factors.bubble_zero_bubble
    return base


def optimizer_time(local_params: float, device, factors) -> float:
    """A fused Adam step is memory-bound: bytes per local parameter / HBM bandwidth."""
    return local_params * factors.optimizer_bytes_per_param / (device.hbm_bandwidth * factors.eff_hbm)
