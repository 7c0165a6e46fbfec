"""Recompute choice per pipeline rank: turn on selective, then full recompute where it saves the
most activation bytes per second of extra compute, until the rank fits in memory (greedy; exact per
layer, heuristic overall)."""

from __future__ import annotations

from ..cost.estimate import Evaluator
from ..cost.memory import in_flight
from ..cost.setting import LayerChoice, Setting
from ..plan import Cost


def choose_recompute(ev: Evaluator, s: Setting, choices: list[LayerChoice], cost: Cost,
                     limit: float, free: list[bool]) -> bool:
    """Turn on recompute (selective, then full) in the free layers of each pipeline rank over
    ``limit``, most bytes saved per second of recompute first, until the rank fits. Returns True
    when something changed. Works on runs of identical layers, converting as many layers of a run as
    the shortfall needs."""
    f = ev.f
    changed = False
    runs_of: dict[int, list] = {}  # pipeline rank -> its runs, in chain order
    for run in ev.runs(choices):
        runs_of.setdefault(s.rank_of(run[2].stage), []).append(run)
    for r, mb in enumerate(cost.memory_by_rank):
        if mb.total <= limit:
            continue
        # bytes to shed from the subtotal (the margin is a fraction of it plus a constant)
        need = (mb.total - limit) / (1 + f.margin_fraction)
        flight = in_flight(s.schedule, pp=s.pp, stage=r, micro_batches=s.micro_batches,
                           virtual_stages=s.virtual_stages)
        options = []
        for first, cnt, ch in runs_of.get(r, ()):
            # a run of identical layers may mix free layers and layers whose recompute the user
            # pinned
            if ch.recompute == "full" or not any(free[first:first + cnt]):
                continue
            lt = ev.choice_terms(first, s, ch)
            # (the runtime refuses selective recompute around an experts module that FSDP shards for
            # EP)
            fsdp_experts = s.ep > 1 and s.zero_stage >= 1 and ev.prof.layers[first].experts
            for opt in ("full", ) if fsdp_experts or ch.recompute == "selective" else ("selective",
                                                                                       "full"):
                saved = (lt.act[ch.recompute] - lt.act[opt]) * flight  # from where the run is now
                extra = lt.recompute_s(opt) - lt.recompute_s(ch.recompute)
                if saved > 0:
                    options.append((saved / max(extra, 1e-12), first, cnt, opt, lt))
        options.sort(key=lambda o: -o[0])
        extra_work = False
        for _, first, cnt, opt, lt in options:
            if need <= 0:
                break
            # the run's free layers not yet at this level (some may have taken a lighter one in this
            # pass), the last layers of the run first: their activations live longest
            for j in reversed(range(first, first + cnt)):
                now = choices[j].recompute
                gain = (lt.act[now] - lt.act[opt]) * flight
                if need <= 0 or not free[j] or gain <= 0:
                    continue
                # the recomputed layer's activations live during its backward
                if opt == "full" and not extra_work:
                    extra_work = True
                    need += lt.act["none"]
                choices[j].recompute = opt
                need -= gain
                changed = True
    return changed
