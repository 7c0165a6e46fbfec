"""The planner widget's lever rows (``plan.levers``, shown under the Alternatives): each lever
flipped alone on the plan, what it does to speed and memory ("+Float8: 1.14x faster, same memory";
compile's start-up beside its gain over the steps planned), and the ``fix`` that takes it."""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from ..planner.lever_costs import lever_trade

FIX_VALUES = {"compile": (True, False), "float8": ("tensorwise", "none"), "async_tp": (True, False),
              "offload": ("cpu", "none"), "recompute": ("full", "none"),
              "fused_loss": (True, False), "fused_norm": (True, False)}
"""lever -> its fix value (on, off)"""


def lever_rows(plan: Plan | None) -> list[dict[str, Any]]:
    """One row per lever of ``plan``: its name and sign, what it trades, the variant's step time and
    peak, whether it fits, and the ``ap.replan(fix=...)`` that takes it."""
    if plan is None or plan.cost is None:
        return []
    rows = []
    for lv in plan.levers:
        head, _, trade = (lever_trade(lv, plan.cost.step_time_s,
                                      plan.cost.peak_memory_bytes).partition(": "))
        fix = {lv.name: FIX_VALUES[lv.name][1 if lv.on else 0]}
        rows.append({"lever": lv.name, "label": head, "trade": trade, "step_s": lv.step_time_s,
                     "peak_bytes": lv.peak_memory_bytes, "fits": lv.fits,
                     "fix": f"ap.replan(fix={fix!r})"})
    return rows
