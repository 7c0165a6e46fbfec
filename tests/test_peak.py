"""Per-rank peaks shared between candidates (cost/peak.py ``rank_peaks``): each rank's the same breakdown as weighing
it afresh, made again only for the ranks whose own layers changed, and the same plans as weighing every rank of
every candidate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost import peak
from autopar_nb.cost.estimate import Evaluator
from autopar_nb.cost.loss import fused_head
from autopar_nb.cost.profile import profile_of
from autopar_nb.cost.setting import LayerChoice, Setting
from autopar_nb.cost.staged import StagedRank

GiB = 2**30


@pytest.fixture(scope="module")
def gpt():
    cfg = zoo.GPTConfig(n_layer=8, n_head=16, n_embd=2048, vocab_size=32000, block_size=2048)
    with torch.device("meta"):
        model = zoo.GPT(cfg)
    return ap.capture(model, torch.randint(0, 32000, (1, 2048)))


SETTINGS = [  # (dp, tp, pp, zero, micro-batches, schedule, chunks per rank)
    (2, 1, 4, 2, 8, "1f1b", 1),
    (1, 2, 4, 3, 4, "1f1b", 1),
    (2, 1, 4, 0, 8, "interleaved_1f1b", 2),
    (1, 1, 2, 2, 4, "zbv_zero_bubble", 2),
]


def _candidate(n: int, dp, tp, pp, zero, m, schedule, v) -> tuple[Setting, list[LayerChoice]]:
    s = Setting(dp, tp, pp, zero, "bf16", m, 1.0, schedule, v, False, "adam", 1)
    stages = pp * v
    return s, [LayerChoice(min(i * stages // n, stages - 1), True, "none", True, False) for i in range(n)]


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"{x[5]}-pp{x[2]}-tp{x[1]}-z{x[3]}" for x in SETTINGS])
def test_shared_peaks_are_each_ranks_own(gpt, monkeypatch, setting):
    """Recompute added rank by rank: every rank's breakdown equals a fresh ``RankMemory.peak`` of that candidate
    (another evaluator, nothing shared), and a candidate that differs from the one before only in rank 0's layers
    weighs rank 0 alone again."""
    prof = profile_of(gpt, "cuda")
    cluster = ap.Cluster.preset("h100-80gb", 1, 8)
    ev = Evaluator(prof, cluster)
    s, choices = _candidate(len(prof.layers), *setting)
    weighed = []
    made = peak.RankMemory.peak
    monkeypatch.setattr(peak.RankMemory, "peak", lambda self, r: weighed.append(r) or made(self, r))
    first = [i for i, c in enumerate(choices) if s.rank_of(c.stage) == 0]
    steps = [("selective", first[-1:]), ("full", first[-1:]), ("selective", first)]
    for mode, layers in [("none", [])] + steps:
        for i in layers:
            choices[i].recompute = mode
        weighed.clear()
        got = ev.evaluate(s, choices).memory_by_rank
        assert weighed == ([0] if layers else list(range(s.pp)))
        fresh = Evaluator(prof, cluster)
        memory = peak.RankMemory(prof, fresh.f, s, fresh.sum_layers(s, choices))
        want = [memory.peak(r) for r in range(s.pp)]
        assert [dataclasses.asdict(m) for m in got] == [dataclasses.asdict(m) for m in want]


def test_shared_peaks_leave_the_plans_unchanged(gpt, monkeypatch):
    """Plans, costs, alternatives and explanations are the same as weighing every rank of every candidate afresh,
    on memory tight enough that the search adds recompute rank by rank (pipelines, interleaved ones included)."""
    cases = [(("h100-80gb", 1, 8, 4), {"global_batch": 64}),
             (("a100-80gb", 2, 8, 3), {"global_batch": 128}),
             (("a100-80gb", 1, 8, 4), {"global_batch": 32, "fix": {"schedule": "interleaved_1f1b"}})]
    for (preset, nodes, gpus, gib), kw in cases:
        c = ap.Cluster.preset(preset, nodes, gpus)
        cluster = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=gib * GiB))
        shared = ap.plan(gpt, cluster, **kw).to_json()
        monkeypatch.setattr(peak, "SHARED_PEAKS", 0)  # every candidate's ranks weighed afresh
        assert ap.plan(gpt, cluster, **kw).to_json() == shared
        monkeypatch.undo()


STAGED = [  # (dp, tp, pp, zero, micro-batches, schedule, chunks per rank, amp): ranks of over 16 states
    (2, 1, 4, 0, 8, "interleaved_1f1b", 2, "bf16"),
    (2, 1, 2, 2, 8, "interleaved_1f1b", 4, "bf16"),
    (1, 2, 4, 3, 8, "interleaved_1f1b", 2, "none"),
    (2, 1, 2, 3, 6, "looped_bfs", 2, "bf16"),
    (2, 1, 4, 2, 8, "interleaved_zero_bubble", 2, "bf16"),
    (1, 1, 2, 3, 8, "zbv_zero_bubble", 2, "bf16"),
    (2, 1, 2, 2, 8, "zbv_zero_bubble", 2, "none"),
]


@pytest.mark.parametrize("setting", STAGED, ids=[f"{x[5]}-pp{x[2]}-v{x[6]}-z{x[3]}-{x[7]}" for x in STAGED])
def test_staged_heaviest_is_the_first_heaviest_of_every_moment(gpt, setting):
    """``StagedRank.heaviest`` (what ``RankMemory.peak`` weighs on a multi-stage rank) is the very moment the first
    heaviest of ``StagedRank.moments`` is, field for field, on every rank, under each recompute, with the loss fused
    and not."""
    prof = profile_of(gpt, "cuda")
    ev = Evaluator(prof, ap.Cluster.preset("h100-80gb", 1, 8), head=fused_head(gpt)[0])
    *mesh, amp = setting
    s, choices = _candidate(len(prof.layers), *mesh)
    s = dataclasses.replace(s, amp=amp)
    weighed = 0
    for mode, fused in (("none", False), ("selective", True), ("full", False)):
        s = dataclasses.replace(s, fused_loss=fused)
        for i, c in enumerate(choices):
            c.recompute = mode if i % 3 else "none"
        memory = peak.RankMemory(prof, ev.f, s, ev.sum_layers(s, choices))
        for r in range(s.pp):
            st = memory._states(r)
            rank = StagedRank(memory, r, st)
            assert len(rank.states) > 16
            want = max(rank.moments(False), key=lambda mo: mo.weight)
            assert rank.heaviest() == want, (mode, r)
            weighed += 1
    assert weighed == 3 * s.pp



@pytest.mark.parametrize("setting", STAGED, ids=[f"{x[5]}-pp{x[2]}-v{x[6]}-z{x[3]}-{x[7]}" for x in STAGED])
def test_staged_rests_as_arrays_are_those_state_by_state(gpt, setting):
    """A multi-stage rank's rests summed as arrays over its states (what ``heaviest`` bounds its groups by and the
    memory floor weighs) are ``StagedRank._around``'s, one state at a time, but for rounding and the running stage's
    own output; each stage's idle bytes, weighed from their three parts for every code, the very floats of
    ``_idle``'s gradient bytes plus its terms."""
    prof = profile_of(gpt, "cuda")
    ev = Evaluator(prof, ap.Cluster.preset("h100-80gb", 1, 8), head=fused_head(gpt)[0])
    *mesh, amp = setting
    s, choices = _candidate(len(prof.layers), *mesh)
    s = dataclasses.replace(s, amp=amp)
    for i, c in enumerate(choices):
        c.recompute = "selective" if i % 3 else "none"
    memory = peak.RankMemory(prof, ev.f, s, ev.sum_layers(s, choices))
    for r in range(s.pp):
        rank = StagedRank(memory, r, memory._states(r))
        table = rank.idle_totals()
        for j in range(len(rank.stages)):
            for code in range(12):
                g, others = rank._idle(j, code // 4, bool(code // 2 % 2), bool(code % 2))
                assert table[j, code] == g + sum(value for _, value in others), (r, j, code)
        acts, kept = rank.rest_changed()
        for h, total, a, k in zip(rank.states, rank.rest_totals(), acts, kept, strict=True):
            around = rank._around(h)
            assert total + rank._own_output(h) == pytest.approx(around.total, rel=1e-12), (r, h)
            assert (a, k) == pytest.approx((around.terms["saved_activations"],
                                            around.terms["weight_pass_gradients"]), rel=1e-12), (r, h)

@pytest.mark.parametrize("dp, tp, pp, zero, m, unsharded", [
    (2, 2, 2, 0, 4, True),  # replicate beside TP in a pipeline stage: PipelineStage reduces once, after the last
    (2, 2, 1, 0, 4, True),  # replicate beside TP over micro-batches: set_requires_gradient_sync(False) before the last
    (2, 1, 2, 2, 4, True), (2, 1, 1, 1, 4, True),  # ZeRO-1 accumulates unsharded, reduce-scatters once per step
    (2, 1, 1, 1, 1, False), (2, 1, 1, 2, 4, False), (2, 1, 1, 0, 4, False)])
def test_which_ranks_hold_their_gradients_unsharded_until_the_step(gpt, dp, tp, pp, zero, m, unsharded):
    """A rank keeps every micro-batch's gradients unsharded (float32) until one reduction per step where FSDP2 or
    its replicate is driven so: a pipeline stage, and ZeRO-1 or replicate over several micro-batches; not ZeRO-2 (a
    reduce-scatter every micro-batch), not DDP (its buckets)."""
    s, choices = _candidate(len(profile_of(gpt, "cuda").layers), dp, tp, pp, zero, m, "1f1b", 1)
    ev = Evaluator(profile_of(gpt, "cuda"), ap.Cluster.preset("h100-80gb", 1, dp * tp * pp))
    memory = peak.RankMemory(ev.prof, ev.f, s, ev.sum_layers(s, choices))
    assert memory._states(0).pipelined == unsharded


@pytest.mark.parametrize("zero, m, kept", [(2, 4, True), (2, 3, True), (2, 2, False), (2, 1, False), (3, 4, False),
                                           (1, 4, False)])
def test_zero2_keeps_its_units_gathered_until_the_last_micro_batch(gpt, zero, m, kept):
    """ZeRO-2 accumulating over micro-batches reshards no unit before the last one's backward (runtime/train.py
    set_grad_sync), so a middle micro-batch's backward holds the units after the layer too (fsdp_kept_params): the
    parameters of every unit but those up to the layer, in the compute dtype. With 2 micro-batches the accumulated
    backward is the last one's; ZeRO-3 reshards each; ZeRO-1 keeps all of them as unsharded parameters already."""
    s, choices = _candidate(len(profile_of(gpt, "cuda").layers), 2, 1, 1, zero, m, "1f1b", 1)
    ev = Evaluator(profile_of(gpt, "cuda"), ap.Cluster.preset("h100-80gb", 1, 2))
    memory = peak.RankMemory(ev.prof, ev.f, s, ev.sum_layers(s, choices))
    units = memory.sums.units[0]
    _, _, moments = memory.moments(0)
    first = [mo for mo in moments if mo.phase == "backward" and mo.layer == units[0].last]
    assert first
    for mo in first:
        assert mo.terms.get("fsdp_kept_params", 0.0) == (sum(u.numel for u in units[1:]) * 2 if kept else 0.0)
