"""What the speed levers (float8, async TP) share: a lever is tried on the best plan and taken only where it pays."""

from __future__ import annotations

from .search import Candidate


def take_if_faster(best: Candidate, trial: Candidate) -> tuple[Candidate, Candidate]:
    """(chosen, the other): ``trial``, the lever's variant of ``best``, where it fits and is faster (carrying the
    variants ``best`` was costed with, for the explanation), else ``best``."""
    if trial.fits and trial.cost.step_time_s < best.cost.step_time_s:
        trial.other, trial.norm_other, trial.origin = best.other, best.norm_other, best.origin
        return trial, best
    return best, trial
