"""The memory floor (cost/floor.py) and the planner's use of it: the same plans, costs, alternatives and explanations
as costing every candidate in full, and a floor never above a costed candidate's peak."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost.floor import memory_floor
from autopar_nb.plan import PlanError
from autopar_nb.planner import search

GiB = 2**30


def _capture(model_fn, vocab, batch, seq):
    with torch.device("meta"):
        model = model_fn()
    return ap.capture(model, torch.randint(0, vocab, (batch, seq)))


@pytest.fixture(scope="module")
def graphs():
    gpt = zoo.GPTConfig(n_layer=8, n_head=16, n_embd=2048, vocab_size=32000, block_size=2048)
    llama = zoo.LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=5632)
    moe = zoo.MoEConfig(vocab_size=32000, dim=1024, n_layers=6, n_heads=8, n_kv_heads=8, ffn_dim=2816,
                        n_routed_experts=8, n_shared_experts=0, top_k=2, moe_ffn_dim=2816)
    return {"gpt": _capture(lambda: zoo.GPT(gpt), 32000, 1, 2048),
            "llama": _capture(lambda: zoo.Llama(llama), 32000, 1, 2048),
            "mixtral": _capture(lambda: zoo.MoETransformer(moe), 32000, 1, 2048)}


def _cluster(preset, nodes, gpus, memory_gib):
    c = ap.Cluster.preset(preset, nodes, gpus)
    return dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=memory_gib * GiB))


CASES = [  # (graph, cluster, plan kwargs): memory tight enough that the floor sets candidates aside; pipelines allowed
    ("gpt", ("h100-80gb", 1, 8, 4), {"global_batch": 64}),
    ("gpt", ("a100-80gb", 2, 8, 3), {"global_batch": 128}),
    ("llama", ("h100-80gb", 2, 8, 3), {"global_batch": 256}),
    ("llama", ("h100-80gb", 4, 8, 2), {"global_batch": 512, "top_k": 3}),
    ("llama", ("a100-80gb", 1, 8, 4), {"global_batch": 32, "fix": {"schedule": "interleaved_1f1b"}}),
    ("mixtral", ("h100-80gb", 1, 8, 3), {"global_batch": 64}),
    ("mixtral", ("h100-80gb", 2, 8, 2), {"global_batch": 64}),  # nothing fits: the error names the least over
]


def _plan(graph, cluster, kw):
    try:
        return ap.plan(graph, cluster, **kw).to_json()
    except PlanError as e:
        return f"PlanError: {e}"


@pytest.mark.parametrize("name, cluster, kw", CASES, ids=[f"{c[0]}-{c[1][0]}x{c[1][1] * c[1][2]}-{c[1][3]}G"
                                                         for c in CASES])
def test_floors_leave_the_answer_unchanged(graphs, monkeypatch, name, cluster, kw):
    """Plan, cost, alternatives and explanation (or the error) are the same with the floors as costing every
    candidate in full; and no candidate costed in full peaks below its floor."""
    graph, cl = graphs[name], _cluster(*cluster)
    fast = _plan(graph, cl, kw)
    costed = []
    cost = search.Search._cost

    def checked(self, s, choices, auto):
        cand = cost(self, s, choices, auto)
        base = dataclasses.replace(s, fused_loss=False, fused_norm=False)
        costed.append((memory_floor(self.ev, base, choices), cand.cost.peak_memory_bytes, s))
        return cand

    monkeypatch.setattr(search, "FLOORS", False)
    monkeypatch.setattr(search.Search, "_cost", checked)
    full = _plan(graph, cl, kw)
    assert fast == full
    over = [(f / GiB, p / GiB, s) for f, p, s in costed if f > p * (1 + 1e-9)]
    assert not over, over[:3]
    assert costed


def test_floors_set_candidates_aside(graphs, monkeypatch):
    """The cases above exercise the floor: in each of the first three, candidates are set aside uncosted."""
    for name, cluster, kw in CASES[:3]:
        graph, cl = graphs[name], _cluster(*cluster)
        aside = []

        def floor(ev, s, choices, aside=aside, limit=cl.rank_memory_bytes):
            out = memory_floor(ev, s, choices)
            aside.append(out > limit)
            return out

        monkeypatch.setattr(search, "memory_floor", floor)
        ap.plan(graph, cl, **kw)
        assert any(aside) and not all(aside), name


def test_floor_stopped_at_the_limit_gives_the_same_answer(graphs, monkeypatch):
    """``memory_floor(..., limit=)`` stops weighing once a part exceeds the limit: the same "too large?" answer as
    the whole floor, and a value never above it (still a floor), on every candidate of the interleaved case; with a
    limit of 0 it stops before the per-rank weighing of the multi-stage candidates."""
    name, cluster, kw = CASES[4]
    graph, cl = graphs[name], _cluster(*cluster)
    seen = []

    def floor(ev, s, choices, *, limit):
        whole, stopped = memory_floor(ev, s, choices), memory_floor(ev, s, choices, limit=limit)
        at_zero = memory_floor(ev, s, choices, limit=0.0)
        seen.append((whole > limit, stopped > limit, stopped <= whole and 0.0 < at_zero <= whole, at_zero < whole))
        return stopped

    monkeypatch.setattr(search, "memory_floor", floor)
    ap.plan(graph, cl, **kw)
    assert all(a == b and le for a, b, le, _ in seen), seen
    assert any(a for a, *_ in seen) and any(cut for *_, cut in seen)


@pytest.mark.parametrize("case", [0, 4, 5], ids=["gpt", "llama-interleaved", "mixtral"])
def test_sums_alike_at_zero_stages_shared(graphs, monkeypatch, case):
    """``Evaluator.sum_layers`` is shared between ZeRO 1, 2 and 3 (``terms.shared_sums``): summed afresh, the
    candidates' sums are equal at each of them (GPT's tied head, a pipelined interleaved
    LLaMA, a Mixtral-shaped MoE)."""
    name, cluster, kw = CASES[case]
    graph, cl = graphs[name], _cluster(*cluster)
    seen = []

    def floor(ev, s, choices, *, limit):
        seen.append((ev, s, [dataclasses.replace(c) for c in choices]))
        return memory_floor(ev, s, choices, limit=limit)

    monkeypatch.setattr(search, "memory_floor", floor)
    ap.plan(graph, cl, **kw)
    fresh = type(seen[0][0]).sum_layers.__wrapped__
    for ev, s, choices in seen[::3]:
        for a, b in ((1, 2), (2, 3)):
            sa, sb = (fresh(ev, dataclasses.replace(s, zero_stage=z), choices) for z in (a, b))
            assert sa == sb, (s, a, b)
    assert {s.pp for _, s, _ in seen} != {1} or case == 5


def test_interleaved_floor_holds_every_stage_reduction(graphs, monkeypatch):
    """On a rank of an interleaved schedule the floor holds each of its stages' reductions as the full evaluation
    weighs it (the first finds the other stages' gradients unsharded and micro-batches in flight, which the rank's
    last reduction does not), less only what recompute, the weight pass and fused norms change, with the floor's
    margin: every pipelined candidate of the interleaved case."""
    from autopar_nb.cost.peak import RankMemory

    name, cluster, kw = CASES[4]
    graph, cl = graphs[name], _cluster(*cluster)
    seen = []

    def floor(ev, s, choices, *, limit):
        seen.append((ev, s, [dataclasses.replace(c) for c in choices]))
        return memory_floor(ev, s, choices, limit=limit)

    monkeypatch.setattr(search, "memory_floor", floor)
    ap.plan(graph, cl, **kw)
    drop = ("saved_activations", "weight_pass_gradients", "autocast_weight_copies")
    checked = 0
    for ev, s, choices in seen:
        if s.virtual_stages < 2 or s.zero_stage < 2:
            continue
        sums = ev.sum_layers(s, choices)
        low = ev.f.margin_full_recompute < ev.f.margin_fraction
        sums = dataclasses.replace(sums, full_recompute=[n if low else 0.0 for n in sums.layers])
        memory = RankMemory(ev.prof, ev.f, s, sums, seq_ratio=ev.seq_ratio)
        heaviest = 0.0
        for r in range(s.pp):
            pb, ob, moments = memory.moments(r)
            for mo in (mo for mo in moments if mo.phase == "reduce"):
                kept = mo._replace(parts=tuple({k: v for k, v in p.items() if k not in drop} for p in mo.parts))
                kept = kept._replace(weight=mo.grads + sum(kept.terms.values()))
                heaviest = max(heaviest, memory.breakdown(r, pb, ob, kept, margin_of=kept.weight).total)
        assert memory_floor(ev, s, choices) >= heaviest * (1 - 1e-9), (s, memory_floor(ev, s, choices), heaviest)
        checked += 1
    assert checked


@pytest.fixture(scope="module")
def small_llama():
    cfg = zoo.LlamaConfig(vocab_size=4096, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1024)
    return _capture(lambda: zoo.Llama(cfg), 4096, 1, 512)


def test_interleaved_floor_is_below_every_recompute_and_fused_variant(small_llama, monkeypatch):
    """Brute force on a short chain: for interleaved candidates (2 ranks x 2 chunks, ZeRO 0-3, one to eight
    micro-batches), the floor is at most the peak of every choice the search could make of them: each layer's
    recompute (none, selective, full), the loss fused or not, the norms fused or not, each costed in full."""
    import itertools

    cl = _cluster("h100-80gb", 1, 4, 80)
    seen = {}

    def floor(ev, s, choices, *, limit):
        if s.virtual_stages == 2 and s.tp == 1:
            seen.setdefault((s.zero_stage, s.micro_batches), (ev, s, [dataclasses.replace(c) for c in choices]))
        return memory_floor(ev, s, choices, limit=limit)

    monkeypatch.setattr(search, "memory_floor", floor)
    ap.plan(small_llama, cl, global_batch=16, fix={"schedule": "interleaved_1f1b", "pp": 2, "tp": 1})
    assert len(seen) >= 4, seen.keys()
    for ev, s, choices in seen.values():
        least = math.inf
        variants = itertools.product([False, True] if ev.head is not None else [False],
                                     [False, True] if ev.norm_prof is not None else [False])
        for (loss, norm), modes in itertools.product(list(variants),
                                                     itertools.product(("none", "selective", "full"),
                                                                       repeat=len(choices))):
            v = dataclasses.replace(s, fused_loss=loss, fused_norm=norm)
            picked = [dataclasses.replace(c, recompute=m) for c, m in zip(choices, modes, strict=True)]
            least = min(least, ev.evaluate(v, picked).peak_memory_bytes)
        assert memory_floor(ev, s, choices) <= least * (1 + 1e-9), (s, memory_floor(ev, s, choices) / GiB,
                                                                     least / GiB)


def test_backward_floor_sets_interleaved_candidates_aside(graphs, monkeypatch):
    """The floor at a backward with micro-batches in flight (their least saved bytes, the margin recompute implies)
    sets aside interleaved candidates that the stage reductions alone do not: fewer are costed in full, for the
    same plan (``test_floors_leave_the_answer_unchanged``)."""
    from autopar_nb.cost import floor as floor_module

    name, cluster, kw = CASES[2]  # interleaved candidates costed in full: 172 -> 104
    graph, cl = graphs[name], _cluster(*cluster)

    def count(backward: bool) -> tuple[int, str]:
        costed = []
        cost = search.Search._cost

        def counted(self, s, choices, auto):
            costed.append(s)
            return cost(self, s, choices, auto)

        with monkeypatch.context() as m:
            m.setattr(search.Search, "_cost", counted)
            if not backward:
                m.setattr(floor_module, "_backward_floors", lambda rank, at, rests, least: np.zeros(len(at)))
            made = _plan(graph, cl, kw)
            return len(costed), made

    (without, plan_without), (with_, plan_with) = count(False), count(True)
    assert with_ < without and plan_with == plan_without, (with_, without, plan_with[:300])


def _least_activations_summed(ev, s, choices):
    """:func:`~autopar_nb.cost.floor.least_activations` as the full evaluation's sums give it: the layers summed
    afresh (``Evaluator.sum_layers``) under full recompute once per fused variant, the least per stage."""
    from autopar_nb.cost.floor import LeastActivations, variants
    from autopar_nb.cost.saved import replicated_input

    fresh = type(ev).sum_layers.__wrapped__
    full = [dataclasses.replace(c, recompute="full") for c in choices]
    kinds = variants(ev, s)
    per = [fresh(ev, v, full) for v in kinds]
    stage_acts = [[min(sums.stages[r][j].acts for sums in per) for j in range(len(per[0].stages[r]))]
                  for r in range(s.pp)]
    savings = [[] for _ in range(s.pp)]
    for i, cnt, ch in ev.runs(full):
        least = math.inf
        for v in kinds:
            lt = ev.choice_terms(i, v, ch)
            whole = replicated_input(ev, v, i, ch, lt)
            least = min(least, lt.act["selective"] - lt.act["full"], lt.act["none"] - lt.act["full"] - whole)
        savings[s.rank_of(ch.stage)] += [(per[0].local[i], least)] * cnt
    return LeastActivations(stage_acts, savings)


def test_least_activations_as_the_layers_sum(graphs, monkeypatch):
    """The floor's least saved bytes per stage (one pass over the layers for every fused variant) are the very
    floats of the full evaluation's sums, the layers summed once per variant: every multi-stage candidate the
    search floors, the loss fused or not, norms fused or not, TP with sequence parallelism (a first block's whole
    input) or not, and with inputs the blocks share (T5's encoder output: kept once per rank)."""
    from autopar_nb.cost import floor as floor_module
    from autopar_nb.cost.profile import PRECISIONS

    name, cluster, kw = CASES[2]  # interleaved candidates with TP and sequence parallelism, and without
    graph, cl = graphs[name], _cluster(*cluster)
    least_activations, seen = floor_module.least_activations, []

    def checked(ev, s, choices, layout):
        out = least_activations(ev, s, choices, layout)
        assert out == _least_activations_summed(ev, s, choices), s
        if len(seen) % 4 == 0:  # again with every block reading the same two shared inputs
            saved = {j: ev.prof.layers[j].shared_inputs for j in ev.blocks}
            try:
                for j in ev.blocks:
                    ev.prof.layers[j].shared_inputs = {p: {"enc": 3e6, "bias": 1e5} for p in PRECISIONS}
                shared = least_activations(ev, s, choices, layout)
                assert shared == _least_activations_summed(ev, s, choices), s
                assert shared.stage_acts != out.stage_acts
            finally:
                for j, x in saved.items():
                    ev.prof.layers[j].shared_inputs = x
        variants = floor_module.variants(ev, s)
        seen.append((s.tp > 1 and s.sp, any(v.fused_loss for v in variants), any(v.fused_norm for v in variants)))
        return out

    monkeypatch.setattr(floor_module, "least_activations", checked)
    ap.plan(graph, cl, **kw)
    assert {(True, False, True), (False, True, True)} <= set(seen), set(seen)


def test_the_floor_weighs_a_setting_that_fuses_the_loss_already(graphs):
    """A multi-stage setting whose loss is fused already (a fixed fused loss, or the search's fused variant) has no
    unfused variant: the least saved bytes are its own (before: an empty list of variants, IndexError, and
    every pipelined GPT-2 and GPT-NeoX plan of tests/test_pp_families.py failed to plan)."""
    fix = {"pp": 2, "schedule": "interleaved_1f1b", "fused_loss": True}
    p = ap.plan(graphs["llama"], _cluster("a100-80gb", 1, 8, 80), global_batch=32, fix=fix)
    assert p.fused_loss and p.mesh.pp > 1, p.summary()


def test_settle_costs_no_candidate_its_bound_puts_past_the_fastest_that_fits(graphs, monkeypatch):
    """``Search._settle`` costs a set-aside candidate only while its step-time bound is below the fastest candidate
    that fits: one at or past it cannot be the explanation's faster candidate that does not fit (the same answer:
    ``test_floors_leave_the_answer_unchanged``). Before, with no such candidate found, every one was costed (here
    2 of 24 past it)."""
    name, cluster, kw = CASES[4]
    graph, cl = graphs[name], _cluster(*cluster)
    settle, seen = search.Search._settle, []

    def checked(self, out):
        bar = min((c.cost.step_time_s for c in out if isinstance(c, search.Candidate) and c.fits), default=math.inf)
        variants = self._variants

        def costed(s, choices):
            seen.append((self._time_floor(s, choices), bar))
            return variants(s, choices)

        self._variants = costed
        try:
            return settle(self, out)
        finally:
            del self._variants

    monkeypatch.setattr(search.Search, "_settle", checked)
    ap.plan(graph, cl, **kw)
    past = [(f, bar) for f, bar in seen if f >= bar]
    assert seen and not past, (len(past), len(seen))


def test_recompute_time_floor_is_below_every_variant_and_settle_skips_past_it(graphs, monkeypatch):
    """``time_bound.recompute_time_floor`` (the step time with the recompute a multi-stage candidate must add to
    come near its memory floor) is at most the step time of every variant the search costs of each set-aside
    candidate, its ranks all weighed; and ``Search._settle`` costs none whose bound is at or past the fastest
    that fits (it cannot be the explanation's faster candidate that does not fit). Before, with only the bound
    that counts no recompute, ``_settle`` costed such candidates (here all 8 multi-stage ones it costed)."""
    from autopar_nb.planner import time_bound

    name, cluster, kw = CASES[4]
    graph, cl = graphs[name], _cluster(*cluster)
    settle, checked, costed = search.Search._settle, [], []

    def spy(self, out):
        bar = min((c.cost.step_time_s for c in out if isinstance(c, search.Candidate) and c.fits), default=math.inf)
        for s, choices in [c for c in out if not isinstance(c, search.Candidate)]:
            if not time_bound.applies(self, s):
                continue
            with monkeypatch.context() as m:
                m.setattr(time_bound, "RANKS_TRIED", s.pp)
                bound = time_bound.recompute_time_floor(self, s, [dataclasses.replace(c) for c in choices], math.inf)
            cand = self._variants(s, [dataclasses.replace(c) for c in choices])
            times = [c.cost.step_time_s for c in (cand, cand.other, cand.norm_other) if c is not None]
            checked.append((bound, min(times), bar))
        variants = self._variants

        def counted(s, choices):
            if time_bound.applies(self, s):
                costed.append(time_bound.recompute_time_floor(self, s, choices, bar) >= bar)
            return variants(s, choices)

        self._variants = counted
        try:
            return settle(self, out)
        finally:
            del self._variants

    monkeypatch.setattr(search.Search, "_settle", spy)
    ap.plan(graph, cl, **kw)
    above = [(b, t) for b, t, _ in checked if b > t * (1 + 1e-9)]
    assert checked and not above, (len(above), len(checked), above[:3])
    assert any(b >= bar for b, _, bar in checked), "no candidate's bound reaches the bar: the case checks nothing"
    assert not any(costed), (sum(costed), len(costed))


def test_layers_under_full_recompute_share_one_copy_per_distinct_choice():
    """The floor reads every layer under full recompute: one copy per distinct choice (a copy per layer was a tenth
    of the floor's time), the candidate's own choices left as they were."""
    from autopar_nb.cost.floor import _under_full_recompute
    from autopar_nb.cost.setting import LayerChoice

    choices = [LayerChoice(stage=0), LayerChoice(stage=0, recompute="selective"), LayerChoice(stage=0),
               LayerChoice(stage=1, tp=False), LayerChoice(stage=1, tp=False, recompute="full")]
    full = _under_full_recompute(choices)
    assert full == [dataclasses.replace(c, recompute="full") for c in choices]
    assert full[0] is full[2] and full[0] is not full[1] and full[3] is not full[4]
    assert [c.recompute for c in choices] == ["none", "selective", "none", "none", "full"]


def _rank_floors_one_by_one(ev, s, choices):
    """``cost.floor.rank_floors`` (no limit) by its definition, one state at a time: at each of a rank's "B" states
    with the most saved bytes in flight and each "R" state, the rest of the rank as ``StagedRank._around`` weighs it,
    less what recompute and the weight pass change where they add bytes."""
    from autopar_nb.cost import floor as fl
    from autopar_nb.cost.memory import with_margin
    from autopar_nb.cost.peak import RankMemory
    from autopar_nb.cost.schedule import rank_states
    from autopar_nb.cost.staged import StagedRank, _Around

    def without(around):
        drop = {k: v for k, v in around.terms.items() if k in fl._CHANGED and v > 0}
        return _Around({k: v for k, v in around.terms.items() if k not in drop}, around.grads,
                       around.total - sum(drop.values()))

    def backward_floor(rank, h, least):
        r, memory, st = rank.r, rank.mem, rank.st
        own = fl._own_backward(rank, h)
        rest = without(rank._around(h)).total + (own if own > -math.inf else 0.0)
        n = [f + w for f, w in zip(h.full, h.waiting, strict=True)]
        stages = memory.sums.stages[r]
        acts = sum(n[j] * (a - stages[j].pipe["recv_saved"]) for j, a in enumerate(least.stage_acts[r]))
        base = st.pb + st.ob + rest + acts
        added = sorted(n[j] * d for j, d in least.savings[r])
        if not added:
            return base + with_margin(base, memory.f)
        sums = [0.0]
        for d in added:
            sums.append(sums[-1] + d)
        return min(base + x + with_margin(base + x, memory.f, full_recompute=(len(added) - k) / len(added))
                   for k, x in enumerate(sums))

    low_margin = ev.f.margin_full_recompute < ev.f.margin_fraction
    low = dataclasses.replace(s, fused_loss=True) if not s.fused_loss and fl.loss_fusable(ev, s) else s
    sums = ev.sum_layers(low, choices)
    sums = dataclasses.replace(sums, full_recompute=[n if low_margin else 0.0 for n in sums.layers])
    memory = RankMemory(ev.prof, ev.f, low, sums, seq_ratio=ev.seq_ratio)
    least = fl.least_activations(ev, s, choices, sums)
    out = []
    for r in range(s.pp):
        st = memory._states(r)
        st = st._replace(held={k: v for k, v in st.held.items() if k != "autocast_weight_copies"})
        walk = rank_states(s.schedule, pp=s.pp, rank=r, micro_batches=s.micro_batches,
                           virtual_stages=s.virtual_stages)
        rank = StagedRank(memory, r, st, states=walk)
        floors = [0.0]
        for hs in {h.grads: [] for h in walk if h.kind == "B"}.keys():
            group = [h for h in walk if h.kind == "B" and h.grads == hs]
            held = [sum((h.full[j] + h.waiting[j]) * (a - sums.stages[r][j].pipe["recv_saved"])
                        for j, a in enumerate(least.stage_acts[r])) for h in group]
            floors.append(backward_floor(rank, group[held.index(max(held))], least))
        for h in (h for h in walk if h.kind == "R" and st.pipelined):
            mo = rank._reduce(h, without(rank._around(h)))
            floors.append(memory.breakdown(r, st.pb, st.ob, mo, margin_of=mo.weight).total)
        out.append(max(floors))
    return out


@pytest.mark.parametrize("case", [2, 4])
def test_rank_floors_as_arrays_are_the_floors_state_by_state(graphs, monkeypatch, case):
    """Each rank's floor, its rests summed as arrays over the rank's states, is the floor weighed one state at a time
    (``StagedRank._around``) within rounding, on every third multi-stage candidate the search floors (interleaved 1F1B
    with TP and without, ZeRO 0-3); stopped at a limit, it is over the limit where the whole floor is (and no more
    than it), else the same (what a caller asking "can it fit?" needs)."""
    from autopar_nb.cost import floor as floor_module
    from autopar_nb.cost.staged import StagedRank

    name, cluster, kw = CASES[case]
    graph, cl = graphs[name], _cluster(*cluster)
    seen = []

    def floor(ev, s, choices, *, limit):
        if s.pp > 1 and s.schedule in floor_module.MULTI_STAGE:
            seen.append((ev, s, [dataclasses.replace(c) for c in choices], limit))
        return memory_floor(ev, s, choices, limit=limit)

    monkeypatch.setattr(search, "memory_floor", floor)
    ap.plan(graph, cl, **kw)
    assert len(seen) >= 10 and {s.zero_stage for _, s, _, _ in seen} >= {0, 2, 3}
    for ev, s, choices, limit in seen[::3]:
        want = _rank_floors_one_by_one(ev, s, choices)
        with monkeypatch.context() as m:  # no rest weighed one state at a time
            m.setattr(StagedRank, "_around", lambda *a: pytest.fail("StagedRank._around called"))
            got = [f for _, f in floor_module.rank_floors(ev, s, choices)]
        assert got == pytest.approx(want, rel=1e-12, abs=0.0), s
        stopped = floor_module._staged_floor(ev, s, choices, False, limit)
        whole = max(f for _, f in floor_module.rank_floors(ev, s, choices, low_margin=False))
        assert stopped == whole if whole <= limit else limit < stopped <= whole, (s, stopped, whole, limit)
