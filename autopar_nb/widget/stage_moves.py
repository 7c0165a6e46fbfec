"""What a pipeline-stage edit moved besides the layer the user dragged, in words for the widget's
message."""

from __future__ import annotations


def other_stage_moves(paths, old, plan, moved, dragged) -> str:
    """What else changed stage besides the layer dragged, and why: the layers between it and its new
    stage move with it (stages are contiguous runs of layers), and the planner re-balances the
    layers nobody pinned."""
    pinned = {p for p, _ in moved}
    now = {lp.path: lp.stage for lp in plan.layers}
    along = [f"{p} → stage {now.get(p, n)}" for p, n in moved if p != dragged]
    rebalanced = [f"{p} {o} → {now[p]}" for p, o in zip(paths, old, strict=True)
                  if p not in pinned and p in now and now[p] != o]
    text = ""
    if along:
        text += (f" Also moved with it, so each stage stays one run of layers: {', '.join(along)} "
                 "(pinned).")
    if rebalanced:
        text += (f" The planner also moved {', '.join(rebalanced)} (stage), to balance the stages' "
                 "work: those layers were not pinned; pin one with ap.override(layer, stage=N).")
    return text
