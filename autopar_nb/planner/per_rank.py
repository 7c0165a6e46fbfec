"""Planning for a cell whose ``make_batch(step, rank)`` returns one data-parallel rank's samples:
each rank trains on that many whatever the plan's dp, so the global batch is ``per_rank x dp`` and
differs between meshes. Each dp the world allows is planned at its own global batch, and the plan
that trains the most samples per second wins (per sample is the only measure that compares plans of
different batches)."""

from __future__ import annotations

from ..plan import Plan, PlanError
from .degrees import divisors


def plan_per_rank(planner, graph, cluster, per_rank: int, *, fix: dict | None = None,
                  **kwargs) -> Plan:
    """``planner(graph, cluster, global_batch=per_rank * dp, fix={..., "dp": dp}, **kwargs)`` for
    each dp (the fixed one, else every divisor of the world size); the plan with the most samples
    per second, its explanation saying how its global batch came about. Raises the first dp's
    :class:`PlanError` when none plans."""
    fix = dict(fix or {})
    dps = [fix["dp"]] if "dp" in fix else divisors(cluster.world_size)
    plans, errors = [], []
    for dp in dps:
        try:
            plans.append(planner(graph, cluster, global_batch=per_rank * dp, fix={**fix, "dp": dp},
                                 **kwargs))
        except PlanError as e:
            errors.append(e)
    if not plans:
        raise errors[0]
    best = max(plans, key=lambda p: p.cost.samples_per_s)
    others = ", ".join(f"dp={p.mesh.dp}: {p.cost.samples_per_s:.4g}" for p in plans
                       if p is not best)
    best.explanation.append(
        f"Batch: make_batch returns {per_rank} samples per rank, so a step trains {per_rank} x dp "
        f"= {best.batch.global_batch} samples; each dp was planned at its own batch and this one "
        f"trains the most samples per second ({best.cost.samples_per_s:.4g}"
        + (f"; {others}" if others else "") + ").")
    return best
