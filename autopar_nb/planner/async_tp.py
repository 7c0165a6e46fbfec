"""Async tensor parallelism as the planner chooses it (``plan.async_tp``): fixed by the user, or
costed on every split with tp > 1 where it can run (CUDA, compiled blocks:
:func:`.constraints.async_tp_refusal`; the search ranks them with it, :mod:`..cost.async_tp`: the TP
all-gathers and reduce-scatters hidden behind the matmuls), else tried on the best plan and taken
when faster."""

from __future__ import annotations

import dataclasses

from ..units import fmt_time
from .candidate import Candidate
from .constraints import async_tp_refusal
from .levers import take_if_faster


def _refusal(cand: Candidate, cluster) -> str:
    s = cand.setting
    return async_tp_refusal(cluster, compiled=any(c.compile for c in cand.choices), tp=s.tp,
                            pp=s.pp)


def with_async_tp(cand: Candidate, ev, on: bool) -> Candidate:
    """``cand``'s setting and choices costed with async TP ``on`` or off."""
    s = dataclasses.replace(cand.setting, async_tp=on)
    choices = [dataclasses.replace(c) for c in cand.choices]
    return Candidate(s, choices, ev.evaluate(s, choices), cand.limit)


def async_tp_choice(best: Candidate, ev, cons, cluster) -> tuple[Candidate, Candidate | None]:
    """(the chosen candidate, the other async TP choice costed on the same setting, or None where
    async TP is not offered): taken when faster. A fixed choice stays; its synchronous twin is
    costed for the explanation."""
    # fixed, or costed on in the search: its twin without it, for the explanation
    if best.setting.async_tp:
        return best, with_async_tp(best, ev, False)
    if "async_tp" in cons.fix:
        return best, None
    if _refusal(best, cluster):
        return best, None
    return take_if_faster(best, with_async_tp(best, ev, True))


def async_tp_lines(best: Candidate, other: Candidate | None, cons, cluster) -> list[str]:
    """One line: the async TP choice, why, and the other choice's step time on the same split."""
    fixed = "async_tp" in cons.fix
    if other is None:
        why = _refusal(best, cluster)
        return [f"Async TP not offered: it {why}."] if why and not fixed else []
    on, off = (best, other) if best.setting.async_tp else (other, best)
    hidden = off.cost.comm_exposed_s - on.cost.comm_exposed_s
    step = (f"{fmt_time(on.cost.step_time_s)}/step vs {fmt_time(off.cost.step_time_s)} without "
            f"({off.cost.step_time_s / on.cost.step_time_s:.2f}x; {fmt_time(hidden)} of TP "
            "collectives hidden)")
    how = ("Inductor's micro-pipelined TP over symmetric memory overlaps TP's all-gathers and "
           "reduce-scatters with the matmuls beside them")
    if fixed:
        return [f"Async TP (fix async_tp): {how}: {step}."]
    if best.setting.async_tp:
        return [f"Async TP chosen: {how}: {step}."]
    return ["Async TP not chosen: no TP all-gather or reduce-scatter to hide behind the matmuls "
            f"({step})."]
