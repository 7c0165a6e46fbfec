"""Cost panels as plain data for the front end: per-rank memory bars against the device limit, the
step time split into compute / exposed communication / pipeline bubble / optimizer / waiting for the
CPU, and throughput (MFU, tokens/s)."""

from __future__ import annotations

from typing import Any

from ..cost.time import MFU_BASIS
from ..hardware import Cluster
from ..plan import Plan

MEMORY_PARTS = [("params", "parameters", "#4c78a8"), ("grads", "gradients", "#72b7b2"),
                ("optimizer", "optimizer states", "#f58518"),
                ("activations", "activations", "#e45756"),
                ("buffers", "comm buffers", "#b279a2"), ("margin", "margin", "#bab0ac")]
TIME_PARTS = [("compute_s", "compute", "#4c78a8"), ("comm_exposed_s", "exposed comm", "#e45756"),
              ("bubble_s", "pipeline bubble", "#bab0ac"), ("optimizer_s", "optimizer", "#f58518"),
              ("cpu_wait_s", "waiting for the CPU", "#9d755d")]
MAX_BARS = 16
"""more ranks than this are grouped: consecutive ranks with the same breakdown share one bar"""


def memory_panel(plan: Plan | None, cluster: Cluster) -> dict[str, Any]:
    """``{"limit": bytes, "parts": [{key, label, color}], "bars": [{label, ranks, total, over,
    <part>: bytes}], "peak": bytes, "over": bool}``; bars are per rank (or per pipeline rank when
    the planner gives one breakdown per pipeline rank), grouped when there are more than
    MAX_BARS."""
    limit = float(cluster.rank_memory_bytes)
    parts = [{"key": k, "label": lab, "color": c} for k, lab, c in MEMORY_PARTS]
    if plan is None or plan.cost is None or not plan.cost.memory_by_rank:
        return {"limit": limit, "parts": parts, "bars": [], "peak": 0.0, "over": False}
    mem = plan.cost.memory_by_rank
    world = plan.mesh.world_size
    # the planner may give one breakdown per pipeline rank (every dp x tp rank of it is alike)
    # instead of per rank
    per_pp = len(mem) == plan.mesh.pp and len(mem) != world
    groups = memory_groups(mem)
    bars = []
    for g in groups:
        m = mem[g[0]]
        if per_pp and plan.mesh.pp == 1:
            label = f"each of {world} ranks"
        elif per_pp:
            label = f"pp rank {g[0]}" if len(g) == 1 else f"pp ranks {g[0]}–{g[-1]}"
            label += f" (× {world // plan.mesh.pp})"
        else:
            label = f"rank {g[0]}" if len(g) == 1 else f"ranks {g[0]}–{g[-1]}"
        bars.append({"label": label, "ranks": g, "total": m.total, "over": m.total > limit,
                     **{k: float(getattr(m, k)) for k, _, _ in MEMORY_PARTS}})
    peak = max(m.total for m in mem)
    return {"limit": limit, "parts": parts, "bars": bars, "peak": peak, "over": peak > limit}


def memory_groups(mem: list) -> list[list[int]]:
    """The breakdowns (indices into ``memory_by_rank``) behind each memory bar: one each, or
    consecutive alike ones together when there are more than MAX_BARS."""
    groups: list[list[int]] = []
    for r, m in enumerate(mem):
        if len(mem) > MAX_BARS and groups and _same(mem[groups[-1][0]], m):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def memory_components(plan: Plan | None, cluster: Cluster) -> dict[str, Any]:
    """The named components of the peak rank's predicted memory with their sources
    (``planner.explain``'s :func:`~autopar_nb.planner.explain.memory_components`): ``{"rank",
    "rows": [{key, label, bytes, source}]}``."""
    if plan is None or plan.cost is None or not plan.cost.memory_by_rank:
        return {"rank": None, "rows": []}
    from ..planner.explain import _margin_source
    from ..planner.explain import memory_components as rows_of

    mem = plan.cost.memory_by_rank
    peak = max(range(len(mem)), key=lambda r: mem[r].total)
    return {"rank": peak, "rows": rows_of(mem[peak], _margin_source(cluster))}


def _same(a, b) -> bool:
    return all(abs(getattr(a, k) - getattr(b, k)) <= 1e-6 * max(1.0, getattr(a, k))
               for k, _, _ in MEMORY_PARTS)


def time_panel(plan: Plan | None) -> dict[str, Any]:
    """``{"total": s, "parts": [{key, label, color, s}], "mfu", "mfu_basis" (the model FLOPs it
    counts), "model_tflops", "hardware_tflops", "tokens_per_s", "samples_per_s", "comm_by_kind":
    {kind: s}}`` for one optimizer step."""
    if plan is None or plan.cost is None:
        return {"total": 0.0, "parts": [], "mfu": 0.0}
    c = plan.cost
    parts = [{"key": k.removesuffix("_s"), "label": lab, "color": col, "s": float(getattr(c, k))}
             for k, lab, col in TIME_PARTS]
    return {"total": float(c.step_time_s), "parts": parts, "mfu": float(c.mfu),
            "mfu_basis": MFU_BASIS, "model_tflops": float(c.model_tflops_per_gpu),
            "hardware_tflops": float(c.hardware_tflops_per_gpu), "tokens_per_s": c.tokens_per_s,
            "samples_per_s": float(c.samples_per_s), "comm_total": float(c.comm_total_s),
            "comm_by_kind": {k: float(v) for k, v in c.comm_by_kind.items()}}
