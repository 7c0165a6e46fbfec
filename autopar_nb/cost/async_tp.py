"""Asynchronous tensor parallelism (``plan.async_tp``, ``runtime/async_tp.py``) as the cost model
sees it: Inductor's micro-pipelined TP (``torch._inductor.config._micro_pipeline_tp`` with symmetric
memory on the TP group) splits each all-gather followed by a matmul, and each matmul followed by a
reduce-scatter, into chunks, so the collective of one chunk runs while the matmul of another
computes. A layer's TP all-gathers and reduce-scatters are then hidden up to the time of the matmuls
they feed or follow; all-reduces (TP without sequence parallelism) are not pipelined.

The gain it models, measured by others: PyTorch's "Introducing Async Tensor Parallelism in PyTorch"
(dev-discuss, 2024) and torchtitan's async TP docs report +6 % tokens/s end to end on a LLaMA 70B
FSDP x TP run on H100s.
"""

from __future__ import annotations

PIPELINED = ("all_gather", "reduce_scatter")
"""the TP collectives Inductor's micro-pipeline pass fuses with the matmul beside them
(``fused_all_gather_matmul``, ``fused_matmul_reduce_scatter``)"""


def async_tp_exposed(comm: dict[str, float], *, overlap: float, matmul_s: float) -> float:
    """Seconds of a layer's TP collectives (``comm``: kind -> seconds of one micro-batch) left
    exposed with async TP: the all-gathers and reduce-scatters beyond ``matmul_s`` (the layer's
    TP-split matmuls, forward and backward), plus the others as without it (``overlap``: the share
    any TP collective hides anyway); ``matmul_s`` = 0 gives the exposed time without async TP."""
    piped = sum(comm.get(k, 0.0) for k in PIPELINED) * (1 - overlap)
    rest = sum(t for k, t in comm.items() if k not in PIPELINED) * (1 - overlap)
    # matmul_s=0: every collective exposed as without async TP
    return max(0.0, piped - matmul_s) + rest


def hide_pipelined(exposed: dict[str, float], *, total: float) -> None:
    """Scale the all-gathers and reduce-scatters of ``exposed`` (kind -> exposed seconds of the TP
    collectives in a step) down so that it sums to ``total``, the exposed TP time with async TP: the
    time it hides is theirs."""
    piped = sum(exposed.get(k, 0.0) for k in PIPELINED)
    if piped > 0:
        keep = min(1.0, max(0.0, 1 - (sum(exposed.values()) - total) / piped))
        for k in PIPELINED:
            if k in exposed:
                exposed[k] *= keep


def tp_matmul_time(lp, *, tp: int, scale: float, device, factors, low_dtype: str) -> float:
    """Seconds of one micro-batch's TP-split matmuls of the layer ``lp`` on one rank, forward and
    backward: the work async TP can hide its collectives behind."""
    flops = (sum(lp.flops_split.values()) + sum(lp.bwd_split.values())) * scale / tp
    return flops / (device.flops(low_dtype) * factors.efficiency("matmul", True))
