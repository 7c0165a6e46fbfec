"""The host's side of a step: how long the CPU takes to issue it, which the step cannot go below.

Eager PyTorch issues kernels asynchronously: while the GPU runs one, Python and the dispatcher
prepare the next. A step therefore takes about max(GPU time, CPU issue time), in two phases, since
the training loop synchronises once a step (``runtime/train.py``: the loss's all-reduce and
``.item()`` after the last backward): the forward and backward of every micro-batch, then clipping
and the optimizer step. At large steps the GPU takes far longer and nothing changes; at microsecond
steps (a tiny model, a small batch) the CPU decides, and what it spends depends on the layout:
FSDP2's hooks per unit, DDP's per step, TP's DTensor dispatch per styled module.

The CPU time is counted from what the evaluator knows, each count times a factor that
``bench/overhead.py`` measured (:mod:`.factors`, ``cpu_*``): eager ops per layer
(``LayerProfile.n_ops`` and autocast's copies; a recomputed forward's again; a compiled block's
scaled as its kernels are), TP's styled modules, FSDP units (``RankSums.units`` and the root), DDP,
the pipeline schedule per micro-batch and stage, the loss's and the numerics guard's all-reduces,
and the optimizer step over the rank's parameter tensors. Not counted (a lower bound there): context
and expert parallelism's collectives, autocast's copies of the weights, data loading.
"""

from __future__ import annotations

from .setting import Setting
from .terms import RankSums

PARTS = ("eager ops", "tensor parallel", "FSDP", "DDP", "pipeline", "collectives", "optimizer")
"""the parts of :func:`issue_time`'s breakdown (``Cost.cpu_by_part``)"""


def layer_cpu(n_ops: float, *, styled: int, compiled: bool,
              factors) -> dict[str, tuple[float, float]]:
    """{"eager ops", "tensor parallel"} -> (forward, backward) CPU seconds to issue one micro-batch
    through a layer of ``n_ops`` eager ops and ``styled`` modules TP splits (DTensor's dispatch and
    redistribution). A compiled block's ops are scaled by ``compile_memory_bound``, as their launch
    overhead is in :mod:`.time` (Inductor fuses them into fewer kernels)."""
    f = factors
    ops = n_ops * (f.compile_memory_bound if compiled else 1.0)
    return {"eager ops": (ops * f.cpu_op_s, ops * f.cpu_op_bwd_s),
            "tensor parallel": (styled * f.cpu_tp_module_s, styled * f.cpu_tp_module_bwd_s)}


def issue_time(s: Setting, sums: RankSums, bubble: float,
               factors) -> tuple[float, float, dict[str, float]]:
    """(forward + backward, optimizer step, breakdown by :data:`PARTS`) CPU seconds of one step on
    the busiest pipeline rank. ``bubble``: the pipeline's idle time in micro-batches
    (``time.bubble_fraction``): a stage the CPU holds up makes the others wait as a GPU-bound one
    does."""
    f, m = factors, s.micro_batches
    best: dict[str, float] = {}
    for r in range(s.pp):
        per_mb = {"eager ops": sums.cpu_ops[r], "tensor parallel": sums.cpu_tp[r],
                  **_data_parallel(s, sums, r, f),
                  "pipeline": s.virtual_stages * f.cpu_pp_microbatch_s if s.pp > 1 else 0.0}
        parts = {k: v * (m + bubble) for k, v in per_mb.items()}
        if sum(parts.values()) > sum(best.values()):
            best = parts
    # once a step each: the loss's all-reduce and the numerics guard's flags (runtime/guard.py),
    # both a few bytes
    best["collectives"] = 2 * f.cpu_collective_s
    main = sum(best.values())
    best["optimizer"] = _optimizer(s, max(sums.tensors), f)
    return main, best["optimizer"], best


def _data_parallel(s: Setting, sums: RankSums, r: int, f) -> dict[str, float]:
    """Seconds per micro-batch that data parallelism's wrapper adds on pipeline rank ``r``: FSDP2's
    hooks on every unit and the root (ZeRO 1-3; ZeRO-3 gathers each unit again in backward; beside
    TP, FSDP2's ``replicate`` has the same hooks), or DDP's, per micro-batch and per parameter
    tensor."""
    if s.replicas <= 1:
        return {}
    if s.zero_stage >= 1 or s.tp > 1:
        unit = f.cpu_fsdp_unit_s + (f.cpu_fsdp_reshard_s if s.zero_stage == 3 else 0.0)
        return {"FSDP": (len(sums.units[r]) + 1) * unit}
    return {"DDP": f.cpu_ddp_s + sums.tensors[r] * f.cpu_ddp_param_s}


def _optimizer(s: Setting, tensors: float, f) -> float:
    """Seconds to clip the gradients and step the optimizer over ``tensors`` parameter tensors.
    FSDP2's and TP's parameters are DTensors: each multi-tensor op goes through DTensor's dispatch,
    which handles every tensor of the list in Python."""
    dtensor = (s.replicas > 1 and s.zero_stage >= 1) or s.tp > 1
    each = f.cpu_optimizer_dtensor_s if dtensor else f.cpu_optimizer_param_s
    return f.cpu_optimizer_step_s + tensors * each
