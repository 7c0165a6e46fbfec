"""Measured beside predicted in the planner widget (issue 14 point 4, issue 21 point 6), as plain data.

Once a launched run of the plan shown has measured something, the memory bars and the step time carry the measured
figure and its ratio to the prediction it compares with (``autopar_nb.launch.compare``: on CPU each rank's peak RSS
above its RSS before its model was built against the predicted training state, without the allocator margin; on
GPUs CUDA's peak against the whole prediction). Only what the run measured is shown: per rank its peak and what it
held between steps (against the parameters and optimizer state the plan keeps there), the median step time as a
whole (a launched run times its steps, not their parts). ``verify`` measures neither memory nor step time.
"""

from __future__ import annotations

from typing import Any

from ..calibration import persistent_bytes
from ..launch import compare

FOLLOWED = 8
"""runs a widget keeps following (the latest ones)"""


def same_plan(a: Any, b: Any) -> bool:
    """Whether two plans make the same decisions (the cluster they were made on aside)."""
    if a is None or b is None:
        return False
    if a is b:
        return True
    return not [c for c in a.diff(b) if not c.path.startswith("cluster.")]


def run_of(plan: Any, runs: list) -> Any:
    """The latest run (or leg of a re-planned run) of ``plan`` that reported a step, else None."""
    legs = [leg for run in runs for leg in (run.legs() if hasattr(run, "legs") else [run])]
    measured = [leg for leg in legs if leg.first_step_time is not None and same_plan(plan, leg.plan)]
    return max(measured, key=lambda leg: leg.started, default=None)


def ratio(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted, None where either is unknown."""
    return measured / predicted if measured and predicted else None


def figure(measured: float | None, predicted: float | None) -> dict:
    """``{"measured", "predicted", "ratio"}``."""
    return {"measured": measured, "predicted": predicted, "ratio": ratio(measured, predicted)}


def bar_ranks(plan: Any) -> list[list[int]]:
    """The global ranks behind each memory bar of :func:`autopar_nb.widget.panels.memory_panel` (one breakdown per
    pipeline rank stands for its dp x tp ranks)."""
    from .panels import memory_groups

    mesh, mem = plan.mesh, plan.cost.memory_by_rank
    world = mesh.world_size
    per_pp = len(mem) == mesh.pp and len(mem) != world
    groups = memory_groups(mem)
    if not per_pp:
        return groups
    width = max(1, mesh.dp * mesh.tp)
    return [[r for r in range(world) if r // width in g] for g in groups]


def peaks_of(run: Any) -> tuple[dict[int, float], dict[int, float]]:
    """(rank -> peak bytes, rank -> bytes held between steps) the run measured: on CPU above each rank's baseline
    (``Run.rss_figures``); on GPUs CUDA's peak allocated and the least allocated at a step's end."""
    rss = run.rss_figures()
    if rss:
        return {r: v["peak"] for r, v in rss.items()}, {r: v["floor"] for r, v in rss.items()}
    peaks, floors = {}, {}
    for row in run.metrics:
        r = row["rank"]
        if row.get("mem_peak") is not None:
            peaks[r] = max(peaks.get(r, 0.0), float(row["mem_peak"]))
        if row.get("mem_allocated") is not None:
            floors[r] = min(floors.get(r, float("inf")), float(row["mem_allocated"]))
    return peaks, floors


def measured_panel(plan: Any, runs: list) -> dict[str, Any]:
    """``{}`` until a run of ``plan`` reported a step; then ``{"run": {id, status, steps, device, basis, note},
    "bars": [{ranks, measured, predicted, ratio}] (one per memory bar), "components": {"peak", "between steps"}
    (figures of the bar with the highest measured/predicted ratio, with its rank), "time": {measured, predicted,
    ratio, compared, note}}``."""
    run = run_of(plan, runs)
    if run is None or getattr(plan, "cost", None) is None or not plan.cost.memory_by_rank:
        return {}
    c = run.comparison()
    cpu = c["memory_basis"] == "rss_above_baseline"
    peaks, floors = peaks_of(run)
    bars = []
    for ranks in bar_ranks(plan):
        seen = [r for r in ranks if r in peaks]
        worst = max(seen, key=lambda r: ratio(peaks[r], compare.predicted_memory(plan, r, model_state=cpu)) or 0,
                    default=None)
        predicted = compare.predicted_memory(plan, worst if worst is not None else ranks[0], model_state=cpu)
        bars.append({"ranks": ranks, "rank": worst, **figure(peaks.get(worst), predicted)})
    components = {}
    top = max((b for b in bars if b["ratio"]), key=lambda b: b["ratio"], default=None)
    if top is not None:
        mb = compare.predicted_breakdown(plan, top["rank"])
        components = {"rank": top["rank"], "peak": figure(top["measured"], top["predicted"]),
                      "between steps": figure(floors.get(top["rank"]), persistent_bytes(mb))}
    s = run.summary()
    predicted_t = float(plan.cost.step_time_s) or None
    compared = bool(c["compare_time"])
    time = {**figure(s.get("step_time_s"), predicted_t if compared else None), "predicted": predicted_t,
            "compared": compared,
            "note": "" if compared else (f"not compared: the plan was made for {c['plan_device'] or 'another device'}"
                                         f", the run used {c['run_device']}")}
    basis = ("peak RSS above each rank's RSS before its model was built, against the predicted training state "
             "(no allocator margin)" if cpu else "CUDA's peak allocated, against the whole prediction")
    return {"run": {"id": run.run_id[:8], "status": run.status, "steps": s.get("steps", 0),
                    "device": c["run_device"], "basis": basis,
                    "note": "a launched run measures each rank's peak and what it held between steps, not each "
                            "component (bench/memory.py measures those with torch's memory tracker)"},
            "bars": bars, "components": components, "time": time}
