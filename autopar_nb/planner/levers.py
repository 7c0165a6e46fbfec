"""What the speed levers (float8, async TP) share: a lever is tried on the best plan and taken only
where it pays."""

from __future__ import annotations

import dataclasses

from ..units import fmt_bytes
from .candidate import Candidate

CLOSE_TIME = 0.01
"""step times this close are not told apart where memory can decide: the time model is further off
than that from measured runs (BENCHMARKS "Published large runs on paper": rows within 10 %)"""
TIGHT_MEMORY = 0.95
"""a plan predicted above this share of a rank's memory is tight: per-rank memory is predicted
within 5 % of real processes (BENCHMARKS "Compositions: per-rank memory"), so it may not fit"""


def tight(cand: Candidate) -> bool:
    """Whether ``cand`` fits with less headroom than the memory prediction's error."""
    return cand.cost.peak_memory_bytes > TIGHT_MEMORY * cand.limit


def roomier(fastest: Candidate, others, time_of=None) -> Candidate:
    """``fastest``, or where it is tight, the fastest of ``others`` that fits with headroom and
    takes at most ``CLOSE_TIME`` more (``time_of``: a candidate's time, default its step time): a
    gain below what the time model resolves does not spend the last of the memory."""
    time_of = time_of or (lambda c: c.cost.step_time_s)
    if not (fastest.fits and tight(fastest)):
        return fastest
    bound = time_of(fastest) * (1 + CLOSE_TIME)
    room = [c for c in others if c.fits and not tight(c) and time_of(c) <= bound]
    chosen = min(room, key=time_of, default=fastest)
    if chosen is not fastest:
        chosen.roomier_than = fastest
    return chosen


def headroom_lines(best: Candidate) -> list[str]:
    """Why ``best`` was chosen over a faster plan that is tight in memory (:func:`roomier`)."""
    fast = best.roomier_than
    if fast is None:
        return []
    gain = 1 - fast.cost.step_time_s / best.cost.step_time_s
    return [f"Headroom: a plan {gain:.1%} faster needs {fmt_bytes(fast.cost.peak_memory_bytes)} "
            f"of the {fmt_bytes(fast.limit)} a rank has (over {TIGHT_MEMORY:.0%}: per-rank memory "
            f"is predicted within {1 - TIGHT_MEMORY:.0%} of real runs, so it may not fit); this "
            f"plan leaves {1 - best.cost.peak_memory_bytes / best.limit:.0%} free."]


def take_if_faster(best: Candidate, trial: Candidate) -> tuple[Candidate, Candidate]:
    """(chosen, the other): ``trial``, the lever's variant of ``best``, where it fits and is faster
    (carrying the variants ``best`` was costed with, for the explanation) unless that is
    :func:`roomier` than it, else ``best``."""
    if (trial.fits and trial.cost.step_time_s < best.cost.step_time_s
            and roomier(trial, [best]) is trial):
        trial.other, trial.norm_other, trial.origin = best.other, best.norm_other, best.origin
        return trial, best
    return best, trial


def levered_variant(cand: Candidate, with_levers, run_s) -> tuple:
    """``with_levers(cand)`` (a levered candidate first), or ``with_levers`` of one of ``cand``'s
    fused-loss / fused-RMSNorm variants (``cand.other``, ``cand.norm_other``) where that one fits
    and takes less time over the run (``run_s``: the steps planned and compile's start-up, as
    compile is chosen). The search chooses between them before compile, Float8 and async TP are set,
    and those change what each costs (compile makes the recompute an unfused loss needs cheaper: a
    1.5B LLaMA shape under DDP on 8 H100s took the fused loss at 322 ms/step where the unfused one
    with selective recompute fits at 319), so the choice is made levered, and :func:`roomier`
    (that unfused one fits at 74.4 of 74.5 GiB, the fused one at 59.6)."""
    tried = [with_levers(cand), *(with_levers(v) for v in _fused_variants(cand))]
    best = tried[0]
    for trial in tried[1:]:
        if trial[0].fits and (not best[0].fits or run_s(trial[0]) < run_s(best[0])):
            best = trial
    chosen = roomier(best[0], [t[0] for t in tried], run_s)
    return next(t for t in tried if t[0] is chosen)


def _fused_variants(cand: Candidate) -> list[Candidate]:
    """``cand``'s fused-loss and fused-RMSNorm variants that fit, each with ``cand``'s origin and,
    as the other choice of what it flips (what explain() costs it against, on the plan as chosen),
    ``cand``; of the RMSNorms where the loss flipped, itself with the other norms (explain() costs
    it)."""
    out = []
    for variant in (cand.other, cand.norm_other):
        if variant is None or not variant.fits:
            continue
        s, v = cand.setting, variant.setting
        other = cand if v.fused_loss != s.fused_loss else cand.other
        out.append(dataclasses.replace(variant, other=other, norm_other=_norm_other(cand, variant),
                                       origin=cand.origin))
    return out


def _norm_other(cand: Candidate, variant: Candidate) -> Candidate | None:
    """The other RMSNorm choice of ``variant``: ``cand`` where the variant flipped the norms; else
    the variant's own, or, where the search costed the other norms of ``cand`` only, the variant
    with them (its cost is made again on the plan as chosen where explain() tells it)."""
    if variant.setting.fused_norm != cand.setting.fused_norm:
        return cand
    if variant.norm_other is not None or cand.norm_other is None:
        return variant.norm_other
    return dataclasses.replace(
        variant, setting=dataclasses.replace(variant.setting,
                                             fused_norm=not variant.setting.fused_norm))
