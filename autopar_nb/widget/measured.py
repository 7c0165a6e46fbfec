"""Measured beside predicted in the planner widget, as plain data.

Once a launched run of the plan shown has measured something, the memory bars and the step time
carry the measured figure and its ratio to the prediction it compares with
(``autopar_nb.launch.compare``: on CPU each rank's peak RSS above its RSS before its model was built
against the predicted training state, without the allocator margin; on GPUs CUDA's peak allocated
against the same, and the allocator's peak reserve against the whole prediction, whose margin covers
its fragmentation). Only what the run measured is shown: per rank its peak (on GPUs its reserve) and
what it held between steps (against the parameters and optimizer state the plan keeps there), the
median step time as a whole (a launched run times its steps, not their parts). ``verify`` measures
neither memory nor step time.
"""

from __future__ import annotations

from typing import Any

from ..launch import watch
from ..launch.report import PEAK_LABELS

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
    measured = [leg for leg in legs if leg.first_step_time is not None
                and same_plan(plan, leg.plan)]
    return max(measured, key=lambda leg: leg.started, default=None)


def bar_ranks(plan: Any) -> list[list[int]]:
    """The global ranks behind each memory bar of :func:`autopar_nb.widget.panels.memory_panel` (one
    breakdown per pipeline rank stands for its dp x tp ranks)."""
    from .panels import memory_groups

    mesh, mem = plan.mesh, plan.cost.memory_by_rank
    world = mesh.world_size
    per_pp = len(mem) == mesh.pp and len(mem) != world
    groups = memory_groups(mem)
    if not per_pp:
        return groups
    width = max(1, mesh.dp * mesh.tp)
    return [[r for r in range(world) if r // width in g] for g in groups]


def measured_panel(plan: Any, runs: list) -> dict[str, Any]:
    """``{}`` until a run of ``plan`` reported a step; then ``{"run": {id, status, steps, device,
    basis, note}, "bars": [{ranks, measured, predicted, ratio, off}] (one per memory bar; ``off``: a
    prediction error by the run's event rule, ``launch.watch.prediction_off``), "components":
    {"peak", "between steps", on GPUs "reserved"} (figures of the bar with the highest
    measured/predicted ratio, with its rank), "time": {measured, predicted, ratio, compared, note},
    "peaks": [[rank, bytes]] (each rank's measured peak, for the memory timeline), "peak_label":
    what those peaks are}``."""
    run = run_of(plan, runs)
    if run is None or getattr(plan, "cost", None) is None or not plan.cost.memory_by_rank:
        return {}
    m = run.measured()
    ranks_seen = m["by_rank"]

    def worse(r):
        return ranks_seen[r]["peak"]["ratio"] or 0.0

    bars = []
    for ranks in bar_ranks(plan):
        seen = [r for r in ranks if r in ranks_seen and ranks_seen[r]["peak"]["measured"]]
        worst = max(seen, key=worse, default=None)
        f = ranks_seen[worst]["peak"] if worst is not None else {"measured": None,
                                                                 "predicted": None, "ratio": None}
        bars.append({"ranks": ranks, "rank": worst, **f})
    top = max((b for b in bars if b["ratio"]), key=lambda b: b["ratio"], default=None)
    components = {} if top is None else {"rank": top["rank"], **ranks_seen[top["rank"]]}
    # each figure flagged ("off") by the rule the run's prediction_error events follow, not by any
    # ratio above 1: a CPU rank's RSS holds what torch allocates on first use beyond the plan's
    # tensors, and an uncalibrated CPU speed is not judged; the throughput and MFU follow from the
    # step time, so they share its judgement
    judge = watch.settings_for(run.comparison())
    for f in [*bars, *(v for v in components.values() if isinstance(v, dict))]:
        f["off"] = watch.prediction_off("memory", f["measured"], f["predicted"], judge)
    time = {**m["time"],
            "off": watch.prediction_off("step_time", m["time"]["measured"], m["time"]["predicted"]
                                        if m["time"]["compared"] else None, judge)}
    throughput = {**m["throughput"], "off": time["off"]} if m["throughput"] else {}
    if "mfu" in throughput:
        throughput["mfu"] = {**throughput["mfu"], "off": time["off"]}
    return {"run": {"id": run.run_id[:8], "status": run.status,
                    "steps": run.summary().get("steps", 0), "device": m["device"],
                    "basis": m["basis"], "note": "a launched run measures each rank's peak and "
                                                 "what it held between steps, not each "
                            "component (bench/memory.py measures those with torch's memory "
                            "tracker)"},
            "bars": bars, "components": components, "time": time, "throughput": throughput,
            "peaks": [[r, f["peak"]["measured"]] for r, f in sorted(ranks_seen.items())
                      if f["peak"]["measured"]],
            "peak_label": PEAK_LABELS[getattr(run, "backend", "gloo") == "nccl"]}
