"""A running stage's own heaviest moment on an empty rest (what :meth:`.staged.StagedRank.heaviest`
bounds each group of alike states by), weighed once for every stage holding the same layers with the
same sums, on whichever rank or candidate: identical blocks make most stages of a deep model alike
(the 1T GPT's 128 stages of one block on 32 ranks, each a rank's four), and a later ``plan()`` of it
weighs ~138k such moments otherwise.

The key (:func:`stage_key`) is every value those moments read, as the very floats they compute from:
the stage's saved bytes and parameters counted from its start (``a - acts_start``, ``before -
params_start``, as :meth:`.staged.StagedRank._layers` subtracts them; a forward reads no parameters'
count), its layers', FSDP units' and input passes' indices from its first, its totals and the bytes
crossing its cuts, its op deltas, and the rank's gradient bytes per parameter and FSDP state. Stages
equal in all of them weigh the same floats in the same order, so a shared weight is the very one;
stages that differ in any, by as little as rounding, get their own. The loss's stage reads the
setting's loss terms besides: it is never shared."""

from __future__ import annotations

import itertools

SHARED_STAGES = 1 << 15
"""about how many stage keys and own weights are kept (cleared past it; a later 1T plan() makes a
few thousand)"""

_ids: dict[tuple, int] = {}
"""stage key -> its id; ids are never reused (:data:`_next`), so one made before a clear matches
nothing after"""
_next = itertools.count()
_own: dict[tuple, float] = {}
"""(stage id, the figure's function, the state's kind, its stage's gradients, backward-last and
weight-passed flags) -> the figure (:func:`shared`)"""


def stage_key(rank, k: int) -> tuple:
    """Everything local stage ``k`` of ``rank`` (a :class:`.staged.StagedRank`) weighs its own
    moments by, relative to the stage's start (module docstring)."""
    x, st = rank.stages[k], rank.st
    layers, inputs, units = rank.layers[k], rank.inputs[k], rank.units[k]
    base = min((*(e[3] for e in layers), *(e.layer for e in inputs), *(u.first for u in units)),
               default=0)
    return (st.gb / st.params if st.params else 0.0, st.pipelined, st.fsdp_stage, st.p_item,
            x.stage == 0, x.acts, x.params, x.weight_grads, x.whole_grads, x.sends, x.turn,
            # a forward reads no parameters' count
            tuple(x.pipe.items()), tuple((a - x.acts_start, w, None if kind == "forward"
                                          else before - x.params_start, layer - base, kind, ops)
                                         for a, w, before, layer, kind, ops in layers),
            tuple((e.layer - base, e.work, e.ops, e.kept_upto) for e in inputs),
            tuple((u.first - base, u.last - base, u.numel) for u in units))


def own_weight(rank, h) -> float:
    """The heaviest weight of state ``h``'s own moments (its running stage's, per layer, not per op)
    with nothing else held (:meth:`.staged.StagedRank.own_afresh`), shared between stages alike;
    -inf where it has none."""
    return shared(rank, h, type(rank).own_afresh)


def shared(rank, h, weigh) -> float:
    """``weigh(rank, h)``, a figure of state ``h``'s running stage alone (what it reads of ``h``:
    the state's kind, its stage's gradients, backward-last and weight-passed flags), made once for
    the stages alike (module docstring)."""
    k = h.local
    if k == rank.loss_at:
        return weigh(rank, h)
    sid = rank.alike.get(k)
    if sid is None:
        if len(_ids) >= SHARED_STAGES:
            _ids.clear()
        sid = rank.alike[k] = _ids.setdefault(stage_key(rank, k), next(_next))
    key = sid, weigh, h.kind, h.grads[k], h.backward_last[k], h.weight_passed[k]
    hit = _own.get(key)
    if hit is None:
        if len(_own) >= SHARED_STAGES:
            _own.clear()
        hit = _own[key] = weigh(rank, h)
    return hit
