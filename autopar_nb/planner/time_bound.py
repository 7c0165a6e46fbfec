"""A lower bound on a multi-stage candidate's step time that counts the recompute the search must
add to it (:meth:`.search.Search._cost`, :func:`.recompute.choose_recompute`) when a rank's memory
floor is over the limit.

Why it holds. Every variant the search costs of the candidate (fused loss and norms) starts from its
choices and only adds recompute (none, then selective, then full), and the step time is at least the
slowest rank's layer times (compute, recompute, exposed TP comm) times (micro-batches + bubble)
(``Search._time_floor``). On a rank whose floor (:func:`.floor.rank_floors`, a floor of every
variant) is over the limit, the first pass of ``choose_recompute`` sees the rank over the limit by
at least ``floor - limit`` and converts layers until the bytes they shed, ``(act[before] -
act[after]) x in_flight`` each, cover that shortfall over ``1 + margin_fraction`` (or every free
layer is converted). Each layer sheds its bytes at a rate (bytes per second of recompute) of one of
its options, so the seconds added are at least the fractional knapsack of the rank's layers, each
holding its most bytes at its best rate, filled to the shortfall: what this module adds to that
rank's time.

Only multi-stage schedules (their stages are fixed: memory does not move layers between them) under
automatic recompute are bounded this way; any other candidate gets its bound without recompute."""

from __future__ import annotations

import math

from ..cost.floor import rank_floors, variants
from ..cost.memory import in_flight
from ..cost.schedule import MULTI_STAGE, ZERO_BUBBLE
from ..cost.setting import LayerChoice, Setting
from ..cost.time import bubble_fraction

RANKS_TRIED = 2
"""ranks weighed per candidate, slowest first: the bound needs one rank past the bar, and the floors
cost"""


def applies(search, s: Setting) -> bool:
    """Whether the search adds recompute to ``s`` without moving its stages."""
    return (s.pp > 1 and s.schedule in MULTI_STAGE and s.schedule not in ZERO_BUBBLE
            and "recompute" not in search.cons.fix)


def recompute_time_floor(search, s: Setting, choices: list[LayerChoice], bar: float) -> float:
    """A lower bound on the step time of every variant the search costs of ``s`` with ``choices``
    (module docstring), where :func:`applies`; it weighs the slowest ranks until one puts the bound
    at or past ``bar`` (then no variant can be faster than ``bar``), at most :data:`RANKS_TRIED`."""
    ev = search.ev
    idle = bubble_fraction(s.schedule, pp=s.pp, micro_batches=s.micro_batches,
                           virtual_stages=s.virtual_stages, factors=ev.f)
    scale = (s.micro_batches + idle) * (1 - 1e-4)
    per_variant = [_rank_times(search, v, choices) for v in variants(ev, s)]
    slowest = [max(t) for t, _ in per_variant]
    out = min(slowest) * scale
    order = sorted(range(s.pp), key=lambda r: -max(t[r] for t, _ in per_variant))[:RANKS_TRIED]
    added = [[0.0] * s.pp for _ in per_variant]
    for r, floor in rank_floors(ev, s, choices, ranks=order):
        need = (floor - search.limit) / (1 + ev.f.margin_fraction)
        if need <= 0:
            continue
        for k, (_, items) in enumerate(per_variant):
            added[k][r] = _least_seconds(items[r], need)
        out = min(max(sl, (t[r] + a[r]))
                  for (t, _), a, sl in zip(per_variant, added, slowest, strict=True)) * scale
        if out >= bar:
            break
    return out


def _rank_times(search, s: Setting, choices: list[LayerChoice]):
    """Per rank of ``s``: its layers' time per micro-batch as they are chosen, and (bytes, bytes per
    second) of each free layer's most shed bytes and best rate over the recompute
    ``choose_recompute`` may turn on."""
    ev = search.ev
    times = [0.0] * s.pp
    items: list[list[tuple[float, float]]] = [[] for _ in range(s.pp)]
    flights: dict[int, float] = {}
    for i, cnt, ch in ev.runs(choices):
        r = s.rank_of(ch.stage)
        lt = ev.choice_terms(i, s, ch)
        times[r] += cnt * lt.time_s(ch.recompute)
        free = sum(j not in search.rec_pinned for j in range(i, i + cnt))
        if ch.recompute == "full" or not free:
            continue
        if r not in flights:
            flights[r] = in_flight(s.schedule, pp=s.pp, stage=r, micro_batches=s.micro_batches,
                                   virtual_stages=s.virtual_stages)
        most = rate = 0.0
        for opt in ("selective", "full") if ch.recompute == "none" else ("full",):
            shed = (lt.act[ch.recompute] - lt.act[opt]) * flights[r]
            extra = lt.recompute_s(opt) - lt.recompute_s(ch.recompute)
            if shed > 0:
                most, rate = max(most, shed), max(rate, shed / extra if extra > 0 else math.inf)
        if most > 0:
            items[r] += [(most, rate)] * free
    return times, items


def _least_seconds(items: list[tuple[float, float]], need: float) -> float:
    """The fractional knapsack: the fewest seconds that shed ``need`` bytes (or all ``items`` hold)
    taking the best rates first."""
    out = 0.0
    for most, rate in sorted(items, key=lambda it: -it[1]):
        if need <= 0 or rate == math.inf:
            need -= most
            continue
        take = min(most, need)
        out += take / rate
        need -= take
    return out

