"""Compile as the planner chooses it (``LayerPlan.compile`` on the repeated blocks): fixed by the
user, else tried on the best plan and taken where it pays over the run: its predicted gain per step
times the steps planned (``plan(steps=...)``, else :data:`HORIZON_STEPS`) exceeds Inductor's compile
at start-up (:mod:`..cost.compile`)."""

from __future__ import annotations

import dataclasses
import math

from ..cost.compile import compile_startup_s
from ..plan import PlanError
from ..units import fmt_time
from .candidate import Candidate

HORIZON_STEPS = 10_000
"""the run length compile's start-up is weighed over when the plan is given none: torchtitan's
default ``training.steps`` (``torchtitan/config/job_config.py``)"""


def horizon(steps: int | None) -> int:
    """The steps compile's start-up is weighed over: ``steps``, else :data:`HORIZON_STEPS`;
    PlanError unless a positive integer."""
    if steps is None:
        return HORIZON_STEPS
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PlanError(f"steps must be a positive integer, got {steps!r}")
    return steps


def chosen_by_itself(cluster) -> bool:
    """Whether compile may be chosen without a fix: on GPUs (the H200's measured compiled and eager
    runs set its factors), and on the ``cpu`` preset only once a compiled run has calibrated
    ``compile_memory_bound`` there: on this 2-core shared host compiled CPU runs measured anywhere
    from faster to 4x slower than eager with the load, so no default gain is known, and Inductor's
    start-up on CPU is minutes."""
    return cluster.name != "cpu" or "compile_memory_bound" in (cluster.calibration or {})


def with_compile(cand: Candidate, ev, compilable: list[bool], on: bool) -> Candidate:
    """``cand`` costed with the ``compilable`` layers compiled (``on``) or eager; eager takes async
    TP off with it (Inductor's micro-pipeline pass rewrites compiled graphs only)."""
    s = cand.setting if on else dataclasses.replace(cand.setting, async_tp=False)
    choices = [dataclasses.replace(c, compile=on if can else c.compile)
               for c, can in zip(cand.choices, compilable, strict=True)]
    return Candidate(s, choices, ev.evaluate(s, choices), cand.limit)


def startup_s(cand: Candidate, ev, graph) -> float:
    """Seconds of compile at start-up for ``cand``'s compiled layers of ``graph``."""
    return compile_startup_s(graph, ev.prof, [c.compile for c in cand.choices], ev.f)


def pays(on: Candidate, off: Candidate, ev, graph, steps: int) -> bool:
    """Whether compiling pays over ``steps``: the step time it saves, ``steps`` times, exceeds its
    start-up."""
    return (on.fits
            and (off.cost.step_time_s - on.cost.step_time_s) * steps > startup_s(on, ev, graph))


def compile_choice(best: Candidate, ev, cons, graph, compilable: list[bool],
                   steps: int) -> Candidate:
    """The chosen candidate: ``best`` compiled or eager, whichever :func:`pays` (eager where compile
    is not :func:`chosen_by_itself`); as fixed (compile, or async TP, which needs it), and eager
    with pp > 1 or no layer to compile. Chosen before float8 and async TP, whose casts cost less
    compiled and which runs compiled only."""
    if (not any(compilable) or best.setting.pp > 1 or "compile" in cons.fix
        or cons.fix.get("async_tp")):
        return best
    on, auto = (any(c.compile for i, c in enumerate(best.choices) if compilable[i]),
                chosen_by_itself(ev.cluster))
    if not auto and not on:
        return best
    other = with_compile(best, ev, compilable, not on)
    compiled, eager = (best, other) if on else (other, best)
    if (compiled if auto and pays(compiled, eager, ev, graph, steps) else eager) is best:
        return best
    other.other, other.norm_other, other.origin = best.other, best.norm_other, best.origin
    return other


def compile_terms(startup: float, gain: float) -> str:
    """"+20 s start-up, −16.9 ms/step, pays after 1,184 steps": compile's price and gain per step
    against eager."""
    step = f"−{fmt_time(gain)}/step" if gain >= 0 else f"+{fmt_time(-gain)}/step"
    return (f"+{startup:.0f} s start-up, {step}, "
            + (f"pays after {math.ceil(startup / gain):,} steps" if gain > 0 else "never pays"))


def compile_lines(best: Candidate, ev, cons, graph, compilable: list[bool],
                  steps: int) -> list[str]:
    """One line: whether the repeated blocks run under ``torch.compile``, why, and compile's
    start-up against its gain per step over the ``steps`` planned (the other choice costed on the
    chosen plan as it is, its other levers kept)."""
    if not any(compilable):
        return []
    if best.setting.pp > 1:
        return ["Not compiled: compile applies with pp=1 only (a pipeline stage is a traced "
                "graph)."]
    other = with_compile(best, ev, compilable, not any(c.compile for c in best.choices))
    on_c = any(c.compile for c in best.choices)
    on, off = (best, other) if on_c else (other, best)
    n = sum(c.compile for c in on.choices)
    terms = (
        "compile: "
        f"{compile_terms(startup_s(on, ev, graph), off.cost.step_time_s - on.cost.step_time_s)} "
        f"(compile_memory_bound={ev.f.compile_memory_bound:g})")
    if "compile" in cons.fix:
        what = "Compiled with torch.compile (fix compile=True)" if on_c else ("Eager (fix "
                                                                              "compile=False)")
        return [f"{what}: {n} layer(s), each on its own; {terms}."]
    if on_c and cons.fix.get("async_tp"):
        return [f"Compiled with torch.compile (fix async_tp=True needs it): {n} layer(s); {terms}."]
    if on_c:
        return [f"Compiled with torch.compile (chosen: it pays within the {steps:,} steps "
                f"planned): {n} layer(s), each on its own; {terms}."]
    if not chosen_by_itself(ev.cluster):
        return ["Eager (on the cpu preset compile is taken once a compiled run has calibrated it: "
                f"its gain here moves with the host's load): fix compile=True would compile {n} "
                f"layer(s); {terms}."]
    return [f"Eager (not compiled: it would not pay within the {steps:,} steps planned): fix "
            f"compile=True would compile {n} layer(s); {terms}."]
