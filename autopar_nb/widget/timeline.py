"""The memory timeline of one step (:mod:`autopar_nb.planner.timeline`) as plain data for the
planner widget's chart (``static/timeline.js``): every pipeline rank's moments, the peak rank chosen
by default. What a launched run measured is drawn from the ``measured`` trait
(:func:`.measured.measured_panel`'s ``peaks``): a launched run measures one peak per rank, not a
curve, so it is a horizontal line on the same axes. A step measured under torch's memory tracker
(``Session.memory_timeline(measure=True)``) is a curve over the same moments."""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from ..planner.timeline import memory_timelines


def timeline_panel(graph, plan: Plan | None, cluster, *,
                   measured: dict | None = None) -> dict[str, Any]:
    """``{}`` without a plan's cost; else ``{"ranks": [{rank, labels, bytes, terms, peak, margin,
    global_ranks}], "default": the pipeline rank with the largest peak, "basis": what the bytes
    are}`` (``terms``: per moment its largest components as [label, bytes]; ``global_ranks``: the
    ranks of the pipeline stage, whose measured peaks compare with it); ``{"error": why}`` when the
    cost model cannot give the moments. ``measured``: pipeline rank -> a
    :class:`~autopar_nb.planner.timeline.MemoryTimeline` of this plan with its measured curve
    (``Session.memory_timeline(measure=True)``), which that rank's entry carries as ``measured``
    (bytes or None per moment) and ``measured_basis``."""
    if plan is None or plan.cost is None or not plan.cost.memory_by_rank:
        return {}
    try:
        lines = memory_timelines(plan, graph, cluster=cluster)
    except ValueError as e:
        return {"error": str(e)}
    width = max(1, plan.mesh.world_size // max(1, len(lines)))
    ranks = [{
        "rank": tl.rank, "labels": [m.label for m in tl], "bytes": [m.bytes for m in tl],
        "terms": [[list(t) for t in m.terms] for m in tl], "peak": tl.peak, "margin": tl.margin,
        "global_ranks": list(range(tl.rank * width, (tl.rank + 1) * width))
    } for tl in lines]
    for r, tl in (measured or {}).items():
        if tl.measured is not None and [m.label for m in tl] == ranks[r]["labels"]:
            ranks[r] |= {"measured": list(tl.measured), "measured_basis": tl.measured_basis}
    return {"ranks": ranks, "default": max(range(len(lines)), key=lambda r: lines[r].peak_bytes),
            "basis": "predicted tensors (no allocator margin)"}
