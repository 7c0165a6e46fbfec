"""A lower bound on a candidate's peak memory (:func:`memory_floor`), cheap enough to weigh before
the full evaluation (:meth:`.estimate.Evaluator.evaluate`): the planner costs in full only the
candidates it cannot prove too large.

It holds whatever the search does to the candidate after it: recompute chosen per layer, the output
head fused with the loss or not, RMSNorms fused or not, and, for a schedule with one stage per rank,
layers moved between stages by memory (``Search._memory_partition``). So it counts only bytes none
of these change: model states, and the moments every step has whose bytes depend on the parameters
per rank and the tensors crossing the pipeline cuts, not on saved activations:

* the optimizer step (:meth:`.peak.RankMemory._step_moment`): every gradient and the foreach
  temporaries, beside the parameters and optimizer states;
* a pipelined FSDP stage's reduction (ZeRO 2/3 under pipelining): its gradients unsharded in float32
  and its parameters gathered;
* on a rank of a multi-stage schedule, that reduction at each of its stages' reductions
  (:func:`.schedule.rank_states`' "R" states): the other stages' gradients (unsharded in float32
  until their own reduction) and units, and every micro-batch's buffers then in flight, sent or
  still referenced by their sends, less the saved activations (which recompute changes);
* on such a rank, its running stage's layer backwards at the "B" states with the most micro-batches'
  saved activations in flight (one per state of its stages' gradients): the same, less the running
  micro-batch's saved bytes and working set, with each other micro-batch's least saved bytes
  (:func:`least_activations`: its stages' layers under full recompute, over the fused loss and norm
  variants) and, for a rank with k of its layers under full recompute, the others' least additions,
  with the allocator margin that share implies (:func:`.memory.with_margin`): the least over k.

With one stage per rank the rank holding the most parameters holds at least the average, whatever
the stages: the first two are linear in a rank's parameters, so they are weighed at the average. A
multi-stage schedule's stages are not moved by memory: its ranks are weighed as the candidate's
stages place them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from .alike import shared
from .memory import with_margin
from .peak import RankMemory
from .saved import run_saved
from .schedule import MULTI_STAGE, Held, rank_states, state_arrays
from .setting import LayerChoice, Setting
from .staged import StagedRank, _Around
from .terms import RankSums, StageSums


def memory_floor(ev, s: Setting, choices: list[LayerChoice], *, limit: float = math.inf) -> float:
    """Bytes the fullest pipeline rank of ``s`` with ``choices`` (or any variant the search makes of
    it: see the module docstring) holds at its peak at least, its allocator margin included. Once a
    part of it exceeds ``limit`` that part is returned: still a floor, and all a caller asking "can
    it fit in ``limit``?" needs (the rank-by-rank weighing of a multi-stage schedule is most of the
    cost)."""
    # CPU offload keeps the states it weighs in host memory, and steps there
    if s.offload != "none":
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
    if st.pipelined and s.pp > 1 and s.schedule not in MULTI_STAGE:
        moments.append(memory._reduce_moment(0, st))
    floor = max(memory.breakdown(0, st.pb, st.ob, mo, margin_of=mo.weight).total for mo in moments)
    if s.pp > 1 and s.schedule in MULTI_STAGE and floor <= limit:
        floor = max(floor, _staged_floor(ev, s, choices, low_margin, limit))
    return floor


def loss_fusable(ev, s: Setting) -> bool:
    """Whether the search may cost ``s`` with the output head fused with the loss
    (``Search.fused_variant``): the model's head can be, with cp = 1, and not with both pp > 1 and
    tp > 1 (what the runtime runs)."""
    return ev.head is not None and s.cp == 1 and not (s.pp > 1 and s.tp > 1)


def variants(ev, s: Setting) -> list[Setting]:
    """``s`` and the fused loss and norm variants the search may cost of it
    (``Search.fused_variant``, ``Search.norm_variant``)."""
    out = [s]
    if not s.fused_loss and loss_fusable(ev, s):
        out.append(dataclasses.replace(s, fused_loss=True))
    if not s.fused_norm and ev.norm_prof is not None:
        out += [dataclasses.replace(v, fused_norm=True) for v in out]
    return out


class LeastActivations(NamedTuple):
    """One micro-batch's saved bytes at their least on each rank of a multi-stage schedule, whatever
    recompute and fused variant the search picks (:func:`least_activations`)."""

    stage_acts: list[list[float]]
    """per rank, per local stage: its layers' saved bytes under full recompute"""
    savings: list[list[tuple[int, float]]]
    """per rank, per layer: (its local stage, the least bytes it adds when not under full
    recompute), which can be negative"""


def least_activations(ev, s: Setting, choices: list[LayerChoice],
                      layout: RankSums) -> LeastActivations:
    """Each stage's saved bytes with every layer under full recompute, the least over
    :func:`variants`, and each layer's least addition under any other recompute: selective's bytes,
    or none's less the whole input a recomputed first sequence-parallel block keeps
    (:func:`.saved.replicated_input`). Dropping a layer's recompute also drops the inputs it shares
    with a later recomputed layer (:func:`.saved.held_inputs`): that only adds. ``layout``: the sums
    of ``s`` with ``choices`` (any variant), for each layer's local stage.

    One pass over the runs of layers for every variant at once, summed as ``Evaluator.sum_layers``
    sums a rank's saved bytes and its stages' (a running total per rank, each stage's bytes the
    total less its start), so the same floats. The variants' layer terms differ in fused norms
    alone; the fused loss only adds its head's saved bytes (the log-sum-exp), so it is never the
    least."""
    full = _under_full_recompute(choices)
    # all fuse the loss where s itself does (a fused variant the search floors)
    every = variants(ev, s)
    kinds = list({v.fused_norm: v for v in [v for v in every if not v.fused_loss]
                  or every}.values())
    totals = [[0.0] * s.pp for _ in kinds]  # per variant, per rank: the saved bytes summed so far
    # per variant, per rank: the shared inputs kept already
    kept = [[set() for _ in range(s.pp)] for _ in kinds]
    # per variant, rank: (start, acts)
    stages: list[list[list[float]]] = [[[] for _ in range(s.pp)] for _ in kinds]
    savings: list[list[tuple[int, float]]] = [[] for _ in range(s.pp)]
    for i, cnt, ch in ev.runs(full):
        r, j = s.rank_of(ch.stage), layout.local[i]
        least = math.inf
        for k, v in enumerate(kinds):
            lt = ev.choice_terms(i, v, ch)
            saved, whole, _ = run_saved(ev, v, i, cnt, ch, lt, kept[k][r])
            least = min(least, lt.act["selective"] - lt.act["full"],
                        lt.act["none"] - lt.act["full"] - whole)
            totals[k][r] += saved
            held = stages[k][r]
            if len(held) == j:  # a new local stage: it starts where the one before ends
                held.append([held[-1][0] + held[-1][1] if held else 0.0, 0.0])
            held[j][1] = totals[k][r] - held[j][0]
        savings[r] += [(j, least)] * cnt
    stage_acts = [[min(per[r][j][1] for per in stages) for j in range(len(stages[0][r]))]
                  for r in range(s.pp)]
    return LeastActivations(stage_acts, savings)


_FULL: dict[tuple, LayerChoice] = {}
"""a layer choice's fields -> a copy of it under full recompute (:func:`_under_full_recompute`;
read, never changed)"""


def _under_full_recompute(choices: list[LayerChoice]) -> list[LayerChoice]:
    """``choices`` with every layer under full recompute, one copy per distinct choice, kept from
    one candidate to the next (the floor only reads them): a copy per layer
    (``dataclasses.replace``) was a tenth of the floor's time."""
    out = []
    for c in choices:
        key = tuple(vars(c).values())
        hit = _FULL.get(key)
        if hit is None:
            if len(_FULL) >= 4096:
                _FULL.clear()
            hit = _FULL[key] = dataclasses.replace(c, recompute="full")
        out.append(hit)
    return out


def _staged_floor(ev, s: Setting, choices: list[LayerChoice], low_margin: bool,
                  limit: float) -> float:
    """The fullest rank's floor (:func:`rank_floors`), stopped at the first rank over ``limit``."""
    out = 0.0
    for _, floor in rank_floors(ev, s, choices, low_margin=low_margin, limit=limit):
        out = max(out, floor)
        if out > limit:
            break
    return out


def rank_floors(ev, s: Setting, choices: list[LayerChoice], *, low_margin: bool | None = None,
                limit: float = math.inf, ranks=None):
    """(rank, floor) of each of ``ranks`` (default: every rank, in order) of a multi-stage ``s``:
    the heaviest stage reduction (:meth:`.staged.StagedRank._reduce` at each "R" state of
    :func:`.schedule.rank_states`), as the full evaluation weighs it, without the terms recompute or
    fused norms change: the micro-batches' saved activations and kept weight-pass gradients,
    autocast's weight copies; and its backward with the most saved bytes in flight
    (:func:`_backward_floors`). A rank's weighing stops once it is over ``limit`` (still a floor of
    that rank, whatever recompute and fused variant the search picks). The rests of the rank at
    those states are summed as arrays (:meth:`.staged.StagedRank.rest_totals`): the same floors
    but for rounding."""
    if low_margin is None:
        low_margin = ev.f.margin_full_recompute < ev.f.margin_fraction
    low = dataclasses.replace(s, fused_loss=True) if not s.fused_loss and loss_fusable(ev, s) else s
    # shared: changed on a copy. Fused: the last stage keeps no logits
    sums = ev.sum_layers(low, choices)
    sums = dataclasses.replace(sums, full_recompute=[n if low_margin else 0.0 for n in sums.layers])
    memory = RankMemory(ev.prof, ev.f, low, sums, seq_ratio=ev.seq_ratio)
    least = least_activations(ev, s, choices, sums)
    for r in range(s.pp) if ranks is None else ranks:
        st = memory._states(r)
        st = st._replace(held={k: v for k, v in st.held.items() if k != "autocast_weight_copies"})
        walk = rank_states(s.schedule, pp=s.pp, rank=r, micro_batches=s.micro_batches,
                           virtual_stages=s.virtual_stages)
        reduced = [i for i, h in enumerate(walk) if h.kind == "R"] if st.pipelined else []
        backward = _most_in_flight(walk, least.stage_acts[r], sums.stages[r])
        out = 0.0
        if reduced or backward:
            rank = StagedRank(memory, r, st, states=walk)
            rests = _rests(rank, [*backward, *reduced])
            for floor in _backward_floors(rank, backward, rests[:len(backward)], least).tolist():
                out = max(out, floor)
                if out > limit:
                    break
            if out <= limit and reduced:
                out = max(out, *_reduction_floors(rank, reduced, rests[len(backward):]))
        yield r, out


def _rests(rank: StagedRank, at: list[int]) -> np.ndarray:
    """The rest of ``rank`` (:meth:`.staged.StagedRank._around`'s total) at its states ``at``
    (indices of ``rank.states``), less what recompute and the weight pass's choices change
    (:data:`_CHANGED`) where they add bytes: what is left is a floor."""
    total = rank.rest_totals()[at]
    acts, kept = (x[at] for x in rank.rest_changed())
    own = np.array([rank._own_output(rank.states[i]) for i in at])
    return total + own - np.maximum(acts, 0.0) - np.maximum(kept, 0.0)


def _reduction_floors(rank: StagedRank, at: list[int], rests: np.ndarray) -> list[float]:
    """The floor of ``rank`` at each of its reductions ``at`` (indices of ``rank.states``), with
    ``rests`` (:func:`_rests`) the rest of the rank then: the stage's reduction on that rest, with
    the rank's states and margin, as ``RankMemory.breakdown`` totals them."""
    r, memory, st = rank.r, rank.mem, rank.st
    layers = memory.sums.layers[r]
    share = memory.sums.full_recompute[r] / layers if layers else 0.0
    own = np.array([rank._reduce(rank.states[i], _Around({}, 0.0, 0.0)).weight for i in at])
    x = st.pb + st.ob + rests + own
    return (x + with_margin(x, memory.f, full_recompute=share)).tolist()


_IN_FLIGHT: dict[int, tuple] = {}
"""id of a :func:`.schedule.rank_states` result -> (it, the indices of its "B" states grouped by
their stages' gradients' states, each group's micro-batches in flight per local stage as an array):
made once per result, as ``rank_states`` is"""


def _most_in_flight(walk: tuple[Held, ...], acts: list[float],
                    stages: list[StageSums]) -> list[int]:
    """Of the "B" states of ``walk`` alike in their stages' gradients (none yet, unsharded, reduced:
    what the rest of the rank holds besides the micro-batches in flight), the index of the one
    whose micro-batches in flight hold the most saved bytes (``acts`` per local stage, less the
    inputs counted in their receive buffers)."""
    hit = _IN_FLIGHT.get(id(walk))
    if hit is None or hit[0] is not walk:
        if len(_IN_FLIGHT) >= 4096:
            _IN_FLIGHT.clear()
        groups: dict[tuple, list[int]] = {}
        for i, h in enumerate(walk):
            if h.kind == "B":
                groups.setdefault(h.grads, []).append(i)
        a = state_arrays(walk)
        v = len(walk[0].full)
        hit = _IN_FLIGHT[id(walk)] = walk, [(g, a.counts[g, :v]) for g in groups.values()]
    per = np.zeros(len(walk[0].full))
    for j, x in enumerate(stages):
        per[j] = acts[j] - x.pipe["recv_saved"]
    return [g[int(np.argmax(counts @ per))] for g, counts in hit[1]]


def _backward_floors(rank: StagedRank, at: list[int], rests: np.ndarray,
                     least: LeastActivations) -> np.ndarray:
    """The bytes of ``rank`` at each of its backward states ``at`` (indices of ``rank.states``) at
    least, with its margin: its running stage's heaviest layer backward
    (:meth:`.staged.StagedRank._layers`) less the terms recompute changes (saved activations, the
    working set, weight-pass gradients), on ``rests`` (:func:`_rests`), and the micro-batches in
    flight's saved bytes with k of the rank's layers under full recompute, the rest adding their
    least (:attr:`LeastActivations.savings`, the least first), at the margin of that share; the
    least over k. The running micro-batch's saved bytes are left out. One row a state."""
    r, memory, st = rank.r, rank.mem, rank.st
    if not at:
        return np.zeros(0)
    v = len(rank.stages)
    # the rest's bytes add to each moment of the running stage alike
    own = np.array([shared(rank, rank.states[i], _own_backward) for i in at])
    rest = rests + np.where(own > -math.inf, own, 0.0)
    n = state_arrays(rank.states).counts[at, :v]  # micro-batches in flight, per local stage
    stages = memory.sums.stages[r]
    acts = np.zeros(v)
    for j, a in enumerate(least.stage_acts[r]):
        acts[j] = a - stages[j].pipe["recv_saved"]
    base = st.pb + st.ob + rest + n @ acts
    if not least.savings[r]:
        return base + with_margin(base, memory.f)
    at_stage, adds = (np.array(x) for x in zip(*least.savings[r], strict=True))
    added = np.sort(n[:, at_stage] * adds, axis=1)
    layers = added.shape[1]
    # k layers under full recompute: the other layers - k add at least the smallest of their
    # additions
    x = base[:, None] + np.concatenate((np.zeros((len(at), 1)), np.cumsum(added, axis=1)),
                                       axis=1)[:, ::-1]
    share = np.arange(layers + 1) / layers
    return np.min(x + with_margin(x, memory.f, full_recompute=share), axis=1)


def _own_backward(rank: StagedRank, h: Held) -> float:
    """The heaviest of ``rank``'s running stage's layer backwards at ``h`` with nothing else held,
    less the terms recompute changes where they add bytes (-inf where it has none):
    :func:`_backward_floors` adds the rest."""
    return max((mo.weight - sum(v for part in mo.parts
                                for k, v in part.items() if k in _CHANGED and v > 0)
                for mo in rank._layers(h, _Around({}, 0.0, 0.0), "backward", False)
                if mo.phase == "backward"), default=-math.inf)


_CHANGED = ("saved_activations", "backward_working_set", "weight_pass_gradients")
"""the terms of a moment recompute (and the weight pass's choices) change"""
