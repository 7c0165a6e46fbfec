"""What the speed levers (float8, async TP) share: a lever is tried on the best plan and taken only
where it pays."""

from __future__ import annotations

import dataclasses

from .search import Candidate


def take_if_faster(best: Candidate, trial: Candidate) -> tuple[Candidate, Candidate]:
    """(chosen, the other): ``trial``, the lever's variant of ``best``, where it fits and is faster
    (carrying the variants ``best`` was costed with, for the explanation), else ``best``."""
    if trial.fits and trial.cost.step_time_s < best.cost.step_time_s:
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
    with selective recompute fits at 319), so the choice is made levered."""
    best = with_levers(cand)
    for variant in _fused_variants(cand):
        trial = with_levers(variant)
        if trial[0].fits and (not best[0].fits or run_s(trial[0]) < run_s(best[0])):
            best = trial
    return best


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
