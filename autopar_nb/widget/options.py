"""Which global options the widget's controls offer: each option asked of the planner's own checks
with the other choices fixed (constraint parsing, the mesh enumeration with its runtime
restrictions, the micro-batch, schedule and sequence-parallel rules), so that a control never offers
what the planner would refuse.
"""

from __future__ import annotations

from typing import Any

from ..cost.profile import profile_of
from ..graph import ModelGraph
from ..hardware import Cluster
from ..plan import PlanError
from ..planner.constraints import parse, sequence_parallel
from ..planner.search import Search
from .choices import GLOBAL_NAMES, global_options


def option_refusals(graph: ModelGraph, cluster: Cluster, fix: dict[str, Any],
                    overrides: dict[str, dict[str, Any]],
                    global_batch: int) -> dict[str, dict[str, str]]:
    """{key: {option: reason}} for the global options the planner cannot plan with the other fixed
    choices: asked of the planner's own checks (constraint parsing, the mesh enumeration with its
    runtime restrictions, micro-batch, schedule and sequence-parallel rules), without costing, so
    memory is not judged here."""
    prof = profile_of(graph, "cpu" if cluster.name == "cpu" else "cuda")
    out: dict[str, dict[str, str]] = {}
    for key, options in global_options(cluster).items():
        for opt in options:
            if fix.get(key) == opt:
                continue
            trial = {**fix, key: opt}
            why = ""
            try:
                cons = parse(graph, prof, trial, overrides)
                search = Search(graph, prof, cluster, cons, None, global_batch=global_batch)
                meshes = search.meshes()
                why = _option_rule(key, opt, meshes, search, trial, prof)
            except PlanError as e:
                why = str(e)
            if why:
                out.setdefault(key, {})[str(opt)] = why
    return out


def _option_rule(key: str, opt, meshes, search, fix, prof) -> str:
    """The rules beyond the mesh enumeration that decide whether the planner can use ``opt`` (the
    planner's own methods where it has them)."""
    if key == "zero_stage" and opt > 0 and all(dp == 1 for dp, _, _, _ in meshes):
        return f"ZeRO-{opt} shards over data-parallel ranks, and every mesh left has dp=1"
    if key in ("schedule", "virtual_stages") and all(pp == 1 for _, _, pp, _ in meshes):
        return f"{GLOBAL_NAMES[key]} applies to pipelines: every mesh left has pp=1"
    if key == "virtual_stages" and opt > 1 and fix.get("schedule") in ("gpipe", "1f1b"):
        return f"{fix['schedule']} runs one stage per rank: choose an interleaved schedule first"
    if key == "virtual_stages" and opt > 1 and all(pp * opt > search.n for _, _, pp, _ in meshes
                                                   if pp > 1):
        return f"{opt} virtual stages per rank need more layers than the model's {search.n}"
    if key == "sequence_parallel" and opt is True:
        if prof.sp_blocker:
            return f"sequence parallelism cannot apply to this model: {prof.sp_blocker}"
        if all(t == 1 for _, t, _, _ in meshes):
            return "sequence parallelism runs with tensor parallelism: every mesh left has tp=1"
        return _sp_refusal(fix, prof, {t for _, t, _, _ in meshes}, search)
    if key == "tp" and fix.get("sequence_parallel") is True and opt > 1:
        return _sp_refusal(fix, prof, {opt}, search)
    if key == "micro_batches":
        ok = False
        for dp, _, pp, _ in meshes:
            try:
                search.micro_batch_sizes(search.global_batch // dp, pp)
                ok = True
                break
            except PlanError as e:
                last = str(e)
        if not ok:
            return last
    return ""


def _sp_refusal(fix: dict[str, Any], prof, tps: set[int], search) -> str:
    """The planner's reason (``planner.constraints.sequence_parallel``) why ``fix``'s sequence
    parallelism runs on none of the TP degrees ``tps`` (a sequence the ranks cannot share evenly);
    "" where one of them takes it."""
    ratio = search.ev.seq_ratio if search.ev is not None else 1.0
    refusals = [sequence_parallel(fix, prof, t, seq_ratio=ratio)[1] for t in sorted(tps) if t > 1]
    return refusals[0] if refusals and all(refusals) else ""
