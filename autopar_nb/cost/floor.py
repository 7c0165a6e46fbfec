"""A lower bound on a candidate's peak memory (:func:`memory_floor`), cheap enough to weigh before the
full evaluation (:meth:`.estimate.Evaluator.evaluate`): the planner costs in full only the candidates
it cannot prove too large.

It holds whatever the search does to the candidate after it: recompute chosen per layer, the output
head fused with the loss or not, RMSNorms fused or not, and, for a schedule with one stage per rank,
layers moved between stages by memory (``Search._memory_partition``). So it counts only bytes none of
these change: model states, and the moments every step has whose bytes depend on the parameters
per rank and the tensors crossing the pipeline cuts, not on saved activations:

* the optimizer step (:meth:`.peak.RankMemory._step_moment`): every gradient and the foreach
  temporaries, beside the parameters and optimizer states;
* a pipelined FSDP stage's reduction (ZeRO 2/3 under pipelining): its gradients unsharded in float32
  and its parameters gathered;
* on a rank of a multi-stage schedule, that reduction at each of its stages' reductions
  (:func:`.schedule.rank_states`' "R" states): the other stages' gradients (unsharded in float32
  until their own reduction) and units, and every micro-batch's buffers then in flight, sent or
  still referenced by their sends, less the saved activations (which recompute changes).

With one stage per rank the rank holding the most parameters holds at least the average, whatever
the stages: the first two are linear in a rank's parameters, so they are weighed at the average. A
multi-stage schedule's stages are not moved by memory: its ranks are weighed as the candidate's
stages place them.
"""

from __future__ import annotations

import dataclasses
import math

from .peak import RankMemory
from .schedule import MULTI_STAGE, rank_states
from .setting import LayerChoice, Setting
from .staged import StagedRank, _Around
from .terms import RankSums


def memory_floor(ev, s: Setting, choices: list[LayerChoice], *, limit: float = math.inf) -> float:
    """Bytes the fullest pipeline rank of ``s`` with ``choices`` (or any variant the search makes of it:
    see the module docstring) holds at its peak at least, its allocator margin included. Once a part of it
    exceeds ``limit`` that part is returned: still a floor, and all a caller asking "can it fit in ``limit``?"
    needs (the rank-by-rank weighing of a multi-stage schedule is most of the cost)."""
    if s.offload != "none":  # CPU offload keeps the states it weighs in host memory, and steps there
        return 0.0
    params = experts = 0.0
    for i, cnt, ch in ev.runs(choices):
        lt = ev.choice_terms(i, s, ch)
        params += cnt * lt.params_local
        experts += cnt * lt.experts_local
    avg = RankSums.zeros(1)
    avg.params[0], avg.experts[0] = params / s.pp, experts / s.pp
    f = ev.f
    low_margin = f.margin_full_recompute < f.margin_fraction  # the margin's fraction at its least
    avg.layers[0] = avg.full_recompute[0] = 1.0 if low_margin else 0.0
    memory = RankMemory(ev.prof, f, s, avg, seq_ratio=ev.seq_ratio)
    st = memory._states(0)
    moments = [memory._step_moment(0, st)]
    if st.pipelined and s.schedule not in MULTI_STAGE:
        moments.append(memory._reduce_moment(0, st))
    floor = max(memory.breakdown(0, st.pb, st.ob, mo, margin_of=mo.weight).total for mo in moments)
    if st.pipelined and s.schedule in MULTI_STAGE and floor <= limit:
        floor = max(floor, _staged_floor(ev, s, choices, low_margin, limit))
    return floor


def _staged_floor(ev, s: Setting, choices: list[LayerChoice], low_margin: bool, limit: float) -> float:
    """The fullest rank's heaviest stage reduction (:meth:`.staged.StagedRank._reduce` at each "R" state of
    :func:`.schedule.rank_states`), as the full evaluation weighs it, without the terms recompute or fused norms
    change: the micro-batches' saved activations and kept weight-pass gradients, autocast's weight copies."""
    sums = ev.sum_layers(s, choices)  # shared: changed on a copy
    sums = dataclasses.replace(sums, full_recompute=[n if low_margin else 0.0 for n in sums.layers])
    memory = RankMemory(ev.prof, ev.f, s, sums, seq_ratio=ev.seq_ratio)
    out = 0.0
    for r in range(s.pp):
        st = memory._states(r)
        st = st._replace(held={k: v for k, v in st.held.items() if k != "autocast_weight_copies"})
        states = tuple(h for h in rank_states(s.schedule, pp=s.pp, rank=r, micro_batches=s.micro_batches,
                                              virtual_stages=s.virtual_stages) if h.kind == "R")
        rank = StagedRank(memory, r, st, states=states)
        for h in states:
            mo = rank._reduce(h, _without_activations(rank._around(h)))
            out = max(out, memory.breakdown(r, st.pb, st.ob, mo, margin_of=mo.weight).total)
        if out > limit:
            break
    return out


def _without_activations(around: _Around) -> _Around:
    """``around`` less what recompute (saved activations) and the weight pass's hooked gradients (a layer's
    choices) change, where they add bytes: what is left is a floor."""
    drop = {k: v for k, v in around.terms.items() if k in ("saved_activations", "weight_pass_gradients") and v > 0}
    terms = {k: v for k, v in around.terms.items() if k not in drop}
    return _Around(terms, around.grads, around.total - sum(drop.values()))
