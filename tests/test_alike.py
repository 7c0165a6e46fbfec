"""Own moments shared between stages alike (cost/alike.py): the same weights as weighing each stage afresh, shared
only between stages holding the same kind of block, and the same evaluations and plans as without the sharing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost import alike, floor, peak, staged
from autopar_nb.cost.estimate import Evaluator
from autopar_nb.cost.loss import fused_head
from autopar_nb.cost.profile import profile_of
from autopar_nb.cost.setting import LayerChoice, Setting
from autopar_nb.cost.staged import StagedRank

GiB = 2**30


@pytest.fixture(scope="module")
def two_kinds():
    """A DeepSeek-shaped decoder of two block kinds: six layers with a dense feed-forward, then ten with experts."""
    cfg = zoo.MoEConfig(vocab_size=32000, dim=1024, n_layers=16, n_heads=8, n_kv_heads=8, ffn_dim=2816,
                        n_dense_layers=6, n_routed_experts=8, n_shared_experts=0, top_k=2, moe_ffn_dim=1408)
    with torch.device("meta"):
        model = zoo.MoETransformer(cfg)
    return ap.capture(model, torch.randint(0, 32000, (1, 2048)))


STAGED = [  # (dp, tp, pp, zero, micro-batches, schedule, chunks per rank, amp)
    (2, 1, 2, 2, 8, "interleaved_1f1b", 4, "bf16"),
    (1, 2, 2, 3, 8, "interleaved_1f1b", 4, "none"),
    (2, 1, 2, 3, 6, "looped_bfs", 4, "bf16"),
    (2, 1, 2, 2, 8, "interleaved_zero_bubble", 4, "bf16"),
    (2, 1, 2, 0, 8, "zbv_zero_bubble", 2, "none"),
]


def _candidate(n: int, dp, tp, pp, zero, m, schedule, v, amp) -> tuple[Setting, list[LayerChoice]]:
    s = Setting(dp, tp, pp, zero, amp, m, 1.0, schedule, v, False, "adam", 1)
    stages = pp * v
    return s, [LayerChoice(min(i * stages // n, stages - 1), True, "none", True, False) for i in range(n)]


def _fresh(monkeypatch):
    """The module's shared weights emptied."""
    monkeypatch.setattr(alike, "_ids", {})
    monkeypatch.setattr(alike, "_own", {})


@pytest.mark.parametrize("setting", STAGED, ids=[f"{x[5]}-v{x[6]}-z{x[3]}-{x[7]}" for x in STAGED])
def test_shared_own_weights_are_the_weights_afresh(two_kinds, setting, monkeypatch):
    """Every state of every rank gets the very weight its own moments have weighed afresh, under three recompute
    patterns with the loss fused and not; stages of different block kinds never share, and stages alike do (the
    dense stages after the first, the expert stages before the last)."""
    _fresh(monkeypatch)
    prof = profile_of(two_kinds, "cuda")
    ev = Evaluator(prof, ap.Cluster.preset("h100-80gb", 1, 8), head=fused_head(two_kinds)[0])
    s, choices = _candidate(len(prof.layers), *setting)
    kind = {i: lp.path if not lp.path.startswith("layers.") else "moe" if int(lp.path[7:]) >= 6 else "dense"
            for i, lp in enumerate(prof.layers)}
    for mode, fused in (("none", False), ("selective", True), ("full", False)):
        s = dataclasses.replace(s, fused_loss=fused)
        for i, c in enumerate(choices):
            c.recompute = mode if i % 2 else "none"
        memory = peak.RankMemory(prof, ev.f, s, ev.sum_layers(s, choices))
        held: dict[int, list] = {}  # a stage id -> the kinds of the layers of each stage given it
        for r in range(s.pp):
            rank = StagedRank(memory, r, memory._states(r))
            for h in rank.states:
                assert alike.own_weight(rank, h) == rank.own_afresh(h), (mode, r, h)
                if h.kind == "B":
                    assert alike.shared(rank, h, floor._own_backward) == floor._own_backward(rank, h), (mode, r, h)
            for k, sid in rank.alike.items():
                held.setdefault(sid, []).append([kind[e[3]] for e in rank.layers[k]])
        assert all(all(x == ks[0] for x in ks) for ks in held.values()), held  # one kind of stage an id
        if s.virtual_stages == 4:  # stages 3, 4 and 6 hold two expert blocks each
            assert any(len(ks) > 1 for ks in held.values()), held


def test_evaluations_and_plans_are_those_weighed_afresh(two_kinds, monkeypatch):
    """Whole evaluations (every rank's breakdown) and chosen plans are the same with each own weight made afresh, and
    every rank's memory floor within rounding (the rest's bytes added to the shared figure, not to each moment)."""
    prof = profile_of(two_kinds, "cuda")
    cases = [(s, c) for s, c in (_candidate(len(prof.layers), *x) for x in STAGED)]
    c = ap.Cluster.preset("a100-80gb", 1, 8)
    tight = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=6 * GiB))
    kw = {"global_batch": 32, "fix": {"schedule": "interleaved_1f1b"}}

    def weigh():
        ev = Evaluator(prof, ap.Cluster.preset("h100-80gb", 1, 8), head=fused_head(two_kinds)[0])
        costs = [ev.evaluate(s, choices) for s, choices in cases]
        floors = [f for s, choices in cases for _, f in floor.rank_floors(ev, s, choices)]
        return [[dataclasses.asdict(m) for m in cost.memory_by_rank] for cost in costs], \
            ap.plan(two_kinds, tight, **kw).to_json(), floors

    _fresh(monkeypatch)
    peaks, plan, floors = weigh()
    assert sum(f > 0 for f in floors) >= 6
    monkeypatch.setattr(staged, "own_weight", lambda rank, h: rank.own_afresh(h))
    monkeypatch.setattr(floor, "shared", lambda rank, h, weigh: weigh(rank, h))
    afresh = weigh()
    assert afresh[:2] == (peaks, plan)
    assert afresh[2] == pytest.approx(floors, rel=1e-12)
