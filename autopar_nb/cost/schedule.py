"""The order in which torch's multi-stage pipeline schedules run a rank's actions, and what the rank
holds at each: the micro-batches in flight per local stage, those between an input-gradient and a
weight-gradient pass, and which stages have gradients (:func:`rank_states`).

The orders mirror ``torch.distributed.pipelining.schedules`` (torch 2.13): ``_get_1f1b_rank_ops``
for interleaved 1F1B and interleaved zero bubble, ``ScheduleLoopedBFS`` and
``ScheduleZBVZeroBubble._calculate_single_rank_operations``. ``_PipelineScheduleRuntime`` runs a
rank's actions in that order (a receive blocks until the peer's send), so what a rank holds depends
on its own order only. Pure Python: the planner costs schedules without torch."""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from itertools import chain
from typing import NamedTuple

import numpy as np

_chain = chain.from_iterable

MULTI_STAGE = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
"""schedules that run several stages per rank (``_PipelineScheduleRuntime``)"""
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble")
"""schedules that split a backward into an input-gradient and a weight-gradient pass"""


class Action(NamedTuple):
    """One compute action of a rank: its local stage (0 = the earliest of the rank's stages), "F"
    (forward), "B" (full backward), "I" (input-gradient pass) or "W" (weight-gradient pass), and the
    micro-batch."""

    local: int
    kind: str
    mb: int


class Held(NamedTuple):
    """What a rank holds while one action runs (the running micro-batch not counted)."""

    local: int
    """the local stage running"""
    kind: str
    """"F", "B" (a full backward; a first stage's weight pass, which runs the whole backward),
    "I", "W" or "R" (the stage's gradient reduction after its last backward, ``REDUCE_GRAD``)"""
    full: tuple[int, ...]
    """per local stage: micro-batches whose forward ran and whose backward has not begun (all their
    saved activations alive)"""
    waiting: tuple[int, ...]
    """per local stage: micro-batches between their input-gradient and weight-gradient passes
    (``stage_backward_input`` retains the whole graph and the gradients the weight pass starts
    from)"""
    forwarded: tuple[int, ...]
    """per local stage: forwards run so far"""
    backwarded: tuple[int, ...]
    """per local stage: backwards (or input passes) run so far: the input gradients a stage sent
    and a lower stage of the rank has not yet received back are still referenced by their sends
    (``runtime/pp.py``'s ``Sends``)"""
    grads: tuple[int, ...]
    """per local stage: 0 before its first backward, 1 once its gradients exist, 2 after its
    reduction (FSDP's reduce-scatter has sharded them)"""
    backward_last: tuple[bool, ...]
    """per local stage: its last action was a backward (FSDP keeps its units unsharded from a
    backward to the next forward)"""
    weight_passed: tuple[bool, ...]
    """per local stage: a weight pass ran since its last input pass or reduction (the gradients it
    wrote are on the parameters as it left them: FSDP takes them into its own accumulation only
    in the stage's next input pass, whose backward hooks it runs, or in the reduction)"""
    later: bool
    """the running micro-batch is not the stage's first"""


def rank_actions(schedule: str, *, pp: int, rank: int, micro_batches: int,
                 virtual_stages: int) -> list[Action]:
    """The compute actions of ``rank`` in the order torch's ``schedule`` runs them (bubbles
    dropped)."""
    if schedule == "zbv_zero_bubble":
        return _zbv(pp, rank, micro_batches)
    if schedule == "looped_bfs":
        m, v = micro_batches, virtual_stages
        return ([Action(k, "F", b) for k in range(v) for b in range(m)]
                + [Action(k, "B", b) for k in reversed(range(v)) for b in reversed(range(m))])
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        return _interleaved(pp, rank, micro_batches, virtual_stages,
                            zero_bubble=schedule == "interleaved_zero_bubble")
    raise ValueError(f"{schedule!r} runs one stage per rank")


def _interleaved(pp: int, rank: int, m: int, v: int, *, zero_bubble: bool) -> list[Action]:
    """``_get_1f1b_rank_ops`` with ``_get_warmup_ops``: a warm-up of (v - 1) micro-batches per round
    plus 2 (1 with zero bubble) per hop from the last rank, then one forward and one backward in
    turn; chunks of a round's micro-batches go to one local stage (forwards in ascending, backwards
    in descending stage order). With zero bubble each backward is an input pass, and from the
    rank-th steady step on the oldest pending weight pass follows it."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    steady = m * v - warmup
    counts: dict[tuple[str, int], int] = defaultdict(int)  # (kind, local stage) -> actions so far
    out: list[Action] = []
    pending: list[int] = []  # local stages of the input passes whose weight pass is still to run

    def add(kind: str, local: int) -> None:
        out.append(Action(local, kind, counts[kind, local]))
        counts[kind, local] += 1

    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            add("F", (op // per_round) % v)
        if op < warmup:
            continue
        local = v - 1 - ((op - warmup) // per_round) % v
        add("I" if zero_bubble else "B", local)
        pending.append(local)
        if zero_bubble and op - warmup >= rank:
            add("W", pending.pop(0))
    while zero_bubble and pending:
        add("W", pending.pop(0))
    return out


def _zbv(pp: int, rank: int, m: int) -> list[Action]:
    """``ScheduleZBVZeroBubble``: local stage 0 is stage ``rank``, 1 is stage 2 pp - 1 - rank (a V).
    Warm-up forwards of stage 0, then of both in turn; each stage-1 forward followed by its input
    and weight passes; a steady phase of (F, I, W) on each stage in turn; a cool-down of input
    passes first and weight passes last. It plans max(2 pp - 1, m) micro-batches and drops those
    past m."""
    n = max(2 * pp - 1, m)
    out: list[Action] = []
    f = [0, 0]
    b = [0, 0]

    def add(local: int, kind: str, counter: list[int]) -> None:
        out.append(Action(local, kind, counter[local]))
        counter[local] += 1

    for _ in range(2 * (pp - rank) - 1):
        add(0, "F", f)
    for _ in range(rank):
        add(1, "F", f)
        add(0, "F", f)
    for _ in range(pp - rank):
        add(1, "F", f)
        out += [Action(1, "I", b[1]), Action(1, "W", b[1])]
        b[1] += 1
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            add(0, "F", f)
        out += [Action(0, "I", b[0]), Action(0, "W", b[0])]
        b[0] += 1
        add(1, "F", f)
        out += [Action(1, "I", b[1]), Action(1, "W", b[1])]
        b[1] += 1
    w = list(b)
    for _ in range(rank):
        add(0, "I", b)
        add(1, "I", b)
    for _ in range(pp - rank):
        add(0, "I", b)
        add(0, "W", w)
    while w[1] < b[1]:
        add(1, "W", w)
    while w[0] < b[0]:
        add(0, "W", w)
    return [a for a in out if a.mb < m]


@lru_cache(maxsize=4096)
def rank_states(schedule: str, *, pp: int, rank: int, micro_batches: int,
                virtual_stages: int) -> tuple[Held, ...]:
    """What ``rank`` holds at each of its actions (:class:`Held`), those another holds more than
    left out. Rank 0's local stage 0 is the model's first stage: its input pass does nothing
    (``PipelineStage.backward_one_chunk`` skips it: no input needs a gradient) and its weight pass
    runs the whole backward (``backward_weight_one_chunk``), a "B" here. A stage's gradients are
    reduced right after its last backward (``_add_reduce_grad``). Walked as arrays
    (:func:`_walk_rows`, the same states as :class:`_Walk`), their :func:`state_arrays` made on the
    way."""
    v = 2 if schedule == "zbv_zero_bubble" else virtual_stages
    actions = rank_actions(schedule, pp=pp, rank=rank, micro_batches=micro_batches,
                           virtual_stages=v)
    if max(a.mb for a in actions) < micro_batches:
        rows = _walk_rows(actions, v=v, first_rank=rank == 0, last_mb=micro_batches - 1)
    # micro-batches past the last (orders torch refuses: m not a multiple of pp) are not counts' to
    # follow
    else:
        walk = _Walk(v)
        for a in actions:
            walk.run(a, first=rank == 0 and a.local == 0, last_mb=micro_batches - 1)
        rows = _rows_of(walk.out)
    rows = _undominated(rows, v)
    states = _held(rows, v)
    _remember(states, _arrays_of(rows, v))
    return states


_KINDS = "FBIWR"
"""a row's kind code (:func:`_walk_rows`): the index of its :attr:`Held.kind` here"""


def _walk_rows(actions: list[Action], *, v: int, first_rank: bool, last_mb: int) -> np.ndarray:
    """:class:`_Walk`'s states, one row each: local stage, kind code (:data:`_KINDS`), then per
    local stage ``full``, ``waiting``, ``forwarded``, ``backwarded``, ``grads``, ``backward_last``,
    ``weight_passed`` side by side, and ``later``. Each field after each action is a running count,
    or the value the stage's last action of some kinds set (:func:`_last_set`); a state is noted
    before its forward, after its backward's counts (an input pass's micro-batch not yet waiting)
    with the flags before it, and a reduction after the last micro-batch's backward with the stage's
    gradients not yet sharded."""
    code = {k: i for i, k in enumerate(_KINDS)}
    loc, kind, mb = (np.fromiter(_chain((a.local, code[a.kind], a.mb) for a in actions),
                                 dtype=np.intp).reshape(-1, 3).T)
    on = loc[:, None] == np.arange(v)
    fwd, bwd, inp, wgt = (np.cumsum(on & mask[:, None], axis=0)
                          for mask in (kind == 0, (kind == 1) | (kind == 2), kind == 2, kind == 3))
    first, last = first_rank & (loc == 0), mb == last_mb
    grads = _last_set(on & ((kind == 1) | (kind == 3))[:, None], np.where(last, 2, 1))
    backward_last = _last_set(on, kind != 0)
    passed = _last_set(on & (kind != 0)[:, None], (kind == 3) & ~first & ~last)
    # [action, field, stage]
    after = np.stack((fwd - bwd, inp - wgt, fwd, bwd, grads, backward_last, passed), axis=1)
    before = np.concatenate((np.zeros_like(after[:1]), after[:-1]))
    counts = np.where((kind == 0)[:, None, None], before[:, :4], after[:, :4])
    counts[kind == 2, 1] = before[kind == 2, 1]
    main = _rows(loc, np.where(first & (kind == 3), 1, kind), counts, before[:, 4:], mb > 0)
    reduced = np.flatnonzero(((kind == 1) | (kind == 3)) & last)
    flags = after[reduced, 4:].copy()
    flags[np.arange(len(reduced)), 0, loc[reduced]] = 1  # sharded right after the reduction's state
    red = _rows(loc[reduced], np.full(len(reduced), 4), after[reduced, :4], flags,
                np.ones(len(reduced), bool))
    at = np.concatenate((2 * np.flatnonzero(~(first & (kind == 2))), 2 * reduced + 1))
    return np.concatenate((main[~(first & (kind == 2))], red))[np.argsort(at, kind="stable")]


def _last_set(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[action, stage]: ``values`` at the last action up to each (itself included) where ``mask``
    holds, 0 before the first."""
    at = np.maximum.accumulate(np.where(mask, np.arange(len(mask))[:, None], -1), axis=0)
    return np.where(at >= 0, values.astype(np.intp)[at], 0)


def _rows(loc, kind, counts, flags, later) -> np.ndarray:
    """:func:`_walk_rows`' rows of these fields ([action, field, stage] for ``counts`` and
    ``flags``)."""
    n = len(loc)
    return np.concatenate((loc[:, None], kind[:, None], counts.reshape(n, -1), flags.reshape(n, -1),
                           np.asarray(later, dtype=np.intp)[:, None]), axis=1)


def _held(rows: np.ndarray, v: int) -> tuple[Held, ...]:
    """The :class:`Held` of each of :func:`_walk_rows`' rows (Python ints and bools, as
    :class:`_Walk` makes)."""
    fields = [
        list(
            map(tuple,
                rows[:, 2 + i * v:2 + (i + 1) * v].astype(bool if i >= 5 else np.intp).tolist()))
        for i in range(7)
    ]
    kinds = [_KINDS[k] for k in rows[:, 1].tolist()]
    return tuple(map(Held._make, zip(rows[:, 0].tolist(), kinds, *fields,
                                     rows[:, -1].astype(bool).tolist(), strict=True)))


class StateArrays(NamedTuple):
    """A rank's states (:func:`rank_states`) as arrays, one row a state: the counts per local stage,
    the running stage, the group of states whose running stage's moments are alike
    (``StagedRank._heaviest_states``), and per local stage its gradients' state, backward and
    weight-pass flags packed as ``grads * 4 + backward_last * 2 + weight_passed``."""

    full: np.ndarray
    waiting: np.ndarray
    forwarded: np.ndarray
    backwarded: np.ndarray
    local: np.ndarray
    groups: np.ndarray
    codes: np.ndarray
    counts: np.ndarray
    """per state, its micro-batches in flight (``full + waiting``), waiting for their weight pass,
    and input gradients its stages' sends still hold (``StagedRank._around``), per local stage, side
    by side"""
    running: np.ndarray
    """[state, local stage]: the state's running stage"""
    stage_index: np.ndarray
    """[state, local stage]: the local stage (to index a per-stage table with ``codes``)"""
    order: np.ndarray
    """the states sorted by group (stable), and where each group starts there: for
    ``np.maximum.reduceat``"""
    starts: np.ndarray


_ARRAYS: dict[int, tuple[tuple[Held, ...], StateArrays]] = {}


def state_arrays(states: tuple[Held, ...]) -> StateArrays:
    """:class:`StateArrays` of ``states`` (a :func:`rank_states` result), made once per result."""
    hit = _ARRAYS.get(id(states))
    if hit is not None and hit[0] is states:
        return hit[1]
    return _remember(states, _arrays_of(_rows_of(states), len(states[0].full)))


def _rows_of(states: list[Held] | tuple[Held, ...]) -> np.ndarray:
    """``states`` as :func:`_walk_rows`' rows."""
    return np.array([(h.local, _KINDS.index(h.kind), *h.full, *h.waiting, *h.forwarded,
                      *h.backwarded, *h.grads, *h.backward_last, *h.weight_passed, h.later)
                     for h in states], dtype=np.intp)


def _remember(states: tuple[Held, ...], arrays: StateArrays) -> StateArrays:
    if len(_ARRAYS) >= 4096:  # as many as rank_states keeps
        _ARRAYS.clear()
    _ARRAYS[id(states)] = states, arrays
    return arrays


def _arrays_of(rows: np.ndarray, v: int) -> StateArrays:
    """:class:`StateArrays` of :func:`_walk_rows`' rows."""
    full, waiting, forwarded, backwarded = (rows[:, 2 + i * v:2 + (i + 1) * v].astype(float)
                                            for i in range(4))
    grads, backward_last, passed = (rows[:, 2 + i * v:2 + (i + 1) * v] for i in range(4, 7))
    codes = grads * 4 + backward_last * 2 + passed
    local, at = rows[:, 0], np.arange(len(rows))
    key = np.stack((rows[:, 1], local, codes[at, local], rows[:, -1]), axis=1)
    group = _first_seen(key)
    # an input gradient's send holds it until a lower stage runs that backward
    sent = backwarded.copy()
    sent[:, 1:] -= backwarded[:, :-1]
    stage_index = np.broadcast_to(np.arange(v), codes.shape)
    order = np.argsort(group, kind="stable")
    return StateArrays(full, waiting, forwarded, backwarded, local, group, codes,
                       np.concatenate((full + waiting, waiting, sent), axis=1),
                       stage_index == local[:, None], stage_index, order,
                       np.flatnonzero(np.diff(group[order], prepend=-1)))


def _first_seen(key: np.ndarray) -> np.ndarray:
    """Per row of ``key``, the number of distinct rows before its first appearance (ids in order of
    appearance; a dict of the rows as tuples: ``np.unique(axis=0)`` sorts them as bytes, several
    times slower here)."""
    ids: dict[tuple, int] = {}
    return np.fromiter((ids.setdefault(k, len(ids)) for k in map(tuple, key.tolist())),
                       dtype=np.intp, count=len(key))


class _Walk:
    """The sets :func:`rank_states` follows through a rank's actions, one at a time: what
    :func:`_walk_rows` counts as arrays, and what it falls back to where a rank's actions name
    micro-batches past the last."""

    def __init__(self, v: int):
        self.full: list[set[int]] = [set() for _ in range(v)]
        self.waiting: list[set[int]] = [set() for _ in range(v)]
        self.forwarded = [0] * v
        self.backwarded = [0] * v
        self.grads = [0] * v
        self.backward_last = [False] * v
        self.weight_passed = [False] * v
        self.out: list[Held] = []

    def note(self, local: int, kind: str, later: bool) -> None:
        self.out.append(Held(local, kind, tuple(map(len, self.full)), tuple(map(len, self.waiting)),
                             tuple(self.forwarded),
                             tuple(self.backwarded), tuple(self.grads),
                             tuple(self.backward_last), tuple(self.weight_passed), later))

    def run(self, a: Action, *, first: bool, last_mb: int) -> None:
        k = a.local
        if a.kind == "F":
            self.note(k, "F", a.mb > 0)
            self.full[k].add(a.mb)
            self.forwarded[k] += 1
            self.backward_last[k] = False
            return
        if a.kind in ("B", "I"):
            self.backwarded[k] += 1
            self.full[k].discard(a.mb)
        else:
            self.waiting[k].discard(a.mb)
        if not (first and a.kind == "I"):
            self.note(k, "B" if first and a.kind == "W" else a.kind, a.mb > 0)
        if a.kind == "I":
            self.waiting[k].add(a.mb)
        else:
            self.grads[k] = 1
        # a first stage's weight pass is a whole backward, which runs FSDP's hooks
        self.weight_passed[k] = a.kind == "W" and not first
        self.backward_last[k] = True
        if a.kind != "I" and a.mb == last_mb:
            self.weight_passed[k] = False
            self.note(k, "R", True)
            self.grads[k] = 2


def _undominated(rows: np.ndarray, v: int) -> np.ndarray:
    """:func:`_walk_rows`' ``rows`` without repeats and without those another state of the same
    stage, kind, gradients, units and ``later`` holds at least as many micro-batches as everywhere:
    by group (in the order each first appears), its states in descending order of their counts, as
    one array comparison of each state against those sorted before it in its group (the only ones
    that can cover it: a state that holds at least as many everywhere, and more somewhere, sorts
    first)."""
    counts = rows[:, 2:2 + 4 * v]
    group = _first_seen(np.concatenate((rows[:, :2], rows[:, 2 + 4 * v:]), axis=1))
    # stable: a repeat after the state it repeats, which covers it
    order = np.lexsort((*(-counts.T[::-1]), group))
    later, earlier = _earlier_pairs(group[order])
    sorted_counts = counts[order]
    covered = np.zeros(len(rows), dtype=bool)
    covered[later[(sorted_counts[earlier] >= sorted_counts[later]).all(axis=1)]] = True
    return rows[order[~covered]]


def _earlier_pairs(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (i, k) of positions of ``group`` (sorted) with k before i in i's group."""
    pos = np.arange(len(group))
    first = np.maximum.accumulate(np.where(np.diff(group, prepend=-1) != 0, pos, 0))
    before = pos - first
    offsets = np.cumsum(before) - before
    return np.repeat(pos, before), np.repeat(first - offsets, before) + np.arange(before.sum())
