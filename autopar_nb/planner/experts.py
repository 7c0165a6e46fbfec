"""What the planner assumes about routing under expert parallelism (``mesh.moe_capacity``): it
cannot know where a router will send the tokens, so it costs every rank's experts for the rows of
the busiest one, a published capacity bound times those of balanced routing, and says so."""

from __future__ import annotations

import dataclasses

from ..plan.vocab import MOE_CAPACITY
from ..units import fmt_bytes


def moe_capacity_lines(best, ev, cons) -> list[str]:
    """One line for an expert-parallel plan: the rows its experts are costed for and where that
    bound comes from, and the peak memory balanced routing would give the same split."""
    s = best.setting
    if s.ep == 1:
        return []
    balanced = ev.evaluate(dataclasses.replace(s, moe_capacity=1.0), best.choices)
    why = ("fix moe_capacity" if "moe_capacity" in cons.fix else
           f"the default, Switch Transformer's capacity factor {MOE_CAPACITY:g}; a dropless "
           "router has no capacity, so it is an allowance for the busiest rank")
    return [f"Routing under expert parallelism: each rank's experts are costed for "
            f"{s.moe_capacity:g}x the rows balanced routing sends them ({why}; "
            f"--fix moe_capacity=... changes it): peak {fmt_bytes(best.cost.peak_memory_bytes)}, "
            f"{fmt_bytes(balanced.peak_memory_bytes)} under balanced routing."]
