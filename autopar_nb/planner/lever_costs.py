"""Each speed or memory lever flipped alone on the chosen plan and costed (``plan.levers``):
compile, float8, async TP, CPU offload, recompute, the fused loss and the fused RMSNorms, wherever
the plan could take the other choice. The widget lists them beside the alternatives, and
``explain()`` in one line: "+float8: 1.14x faster, same memory"."""

from __future__ import annotations

import dataclasses

from ..plan import Lever
from .async_tp import with_async_tp
from .candidate import Candidate
from .compile import compile_terms, startup_s, with_compile
from .constraints import async_tp_refusal
from .float8 import float8_flipped, float8_refusal

NAMES = {"compile": "compile", "float8": "Float8", "async_tp": "async TP", "offload": "CPU offload",
         "recompute": "recompute", "fused_loss": "fused loss", "fused_norm": "fused RMSNorm"}
"""a lever's name in words"""


def _with(cand: Candidate, ev, *, choices=None, **setting) -> Candidate:
    s = dataclasses.replace(cand.setting, **setting)
    choices = choices or [dataclasses.replace(c) for c in cand.choices]
    return Candidate(s, choices, ev.evaluate(s, choices), cand.limit)


def variants(best: Candidate, ev, cluster,
             compilable: list[bool]) -> list[tuple[str, bool, Candidate]]:
    """(lever, on in ``best``, ``best`` with it flipped) for each lever ``best`` could take either
    way."""
    s, out = best.setting, []
    if s.pp == 1 and any(compilable):
        on = any(c.compile for c in best.choices)
        out.append(("compile", on, with_compile(best, ev, compilable, not on)))
    if s.float8 != "none" or not float8_refusal(cluster.device, s.amp, s.pp):
        out.append(("float8", s.float8 != "none", float8_flipped(best, ev)))
    compiled = any(c.compile for c in best.choices)
    if s.async_tp or not async_tp_refusal(cluster, compiled=compiled, tp=s.tp, pp=s.pp):
        out.append(("async_tp", s.async_tp, with_async_tp(best, ev, not s.async_tp)))
    if s.offload != "none" or (cluster.name != "cpu" and s.zero_stage >= 2 and s.pp == 1):
        out.append(("offload", s.offload != "none",
                    _with(best, ev, offload="none" if s.offload != "none" else "cpu")))
    rec = any(c.recompute != "none" for c in best.choices)
    flipped = [dataclasses.replace(c, recompute="none" if rec else "full" if can else c.recompute)
               # compilable: the blocks, else every layer
               for c, can in zip(best.choices, compilable, strict=True)]
    out.append(("recompute", rec, _with(best, ev, choices=flipped)))
    if s.fused_loss or (ev.head is not None and s.cp == 1 and not (s.pp > 1 and s.tp > 1)):
        out.append(("fused_loss", s.fused_loss, _with(best, ev, fused_loss=not s.fused_loss)))
    if s.fused_norm or ev.norm_prof is not None:
        out.append(("fused_norm", s.fused_norm, _with(best, ev, fused_norm=not s.fused_norm)))
    return out


def levers(best: Candidate, ev, cluster, graph, compilable: list[bool], steps: int) -> list[Lever]:
    """``plan.levers``: each of :func:`variants` as a :class:`~autopar_nb.plan.Lever`; compile's
    with its start-up and the ``steps`` it is weighed over."""
    out = []
    for name, on, var in variants(best, ev, cluster, compilable):
        start = startup_s(best if on else var, ev, graph) if name == "compile" else 0.0
        out.append(Lever(name, on, var.cost.step_time_s, var.cost.peak_memory_bytes, var.fits,
                         start, steps if name == "compile" else 0))
    return out


def set_levers(chosen, best: Candidate, ev, cluster, graph, compilable: list[bool],
               steps: int) -> list[str]:
    """Fill ``chosen.levers`` (the plan made from ``best``) with :func:`levers`; its ``explain()``
    line."""
    chosen.levers = levers(best, ev, cluster, graph, compilable, steps)
    return lever_lines(chosen)


def lever_trade(lever: Lever, step_s: float, peak: float) -> str:
    """"+Float8: 1.14x faster, −3% memory": the lever flipped on a plan of ``step_s`` and ``peak``,
    in words; compile's with its start-up against its gain over the steps planned."""
    sign = "−" if lever.on else "+"
    speed = step_s / lever.step_time_s if lever.step_time_s > 0 else 1.0
    pace = ("same speed" if abs(speed - 1) < 0.005 else f"{speed:.2f}x faster" if speed > 1 else
            f"{1 / speed:.2f}x slower")
    d = lever.peak_memory_bytes / peak - 1 if peak > 0 else 0.0
    memory = "same memory" if abs(d) < 0.005 else (f"{'+' if d > 0 else '−'}{abs(d) * 100:.0f}% "
                                                   "memory")
    text = (f"{sign}{NAMES[lever.name]}: {pace}, "
            f"{memory}") + ("" if lever.fits else " (does not fit)")
    if lever.name == "compile":
        gain = (lever.step_time_s - step_s) if lever.on else (step_s - lever.step_time_s)
        text += f"; compile: {compile_terms(lever.startup_s, gain)} ({lever.steps:,} planned)"
    return text


def lever_lines(plan) -> list[str]:
    """One line for ``explain()``: every lever of ``plan.levers`` flipped alone against the plan."""
    if not plan.levers or plan.cost is None:
        return []
    c = plan.cost
    return ["Levers, each flipped alone on this plan: "
            + "; ".join(lever_trade(lv, c.step_time_s, c.peak_memory_bytes) for lv in plan.levers)
            + "."]
