import dataclasses

import pytest
import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost.estimate import Evaluator
from autopar_nb.cost.layer_sums import EARLY, LATE, RunRows, fused_head
from autopar_nb.cost.terms import RankSums

GiB = 2**30


def _graph(model_fn, vocab):
    with torch.device("meta"):
        model = model_fn()
    return ap.capture(model, torch.randint(0, vocab, (1, 1024)))


def _scalar(ev, s, choices) -> dict:
    """The sums :class:`RunRows` makes, as the loop added them run by run before they were arrays (``+=`` in the
    order it meets the runs, the fused head's recompute after its run's time and before its run's FLOPs)."""
    out = {name: [0.0] * s.pp for name in (*EARLY, *LATE)}
    out["model_flops"], out["hw_flops"] = 0.0, 0.0
    for i, cnt, ch in ev.runs(choices):
        r, lt, rec = s.rank_of(ch.stage), ev.choice_terms(i, s, ch), ch.recompute
        out["fwdbwd"][r] += cnt * (lt.fwd + lt.bwd)
        out["rec"][r] += cnt * lt.recompute_s(rec)
        if lt.tp_comm:
            out["tpc"][r] += cnt * lt.tp_exposed
        if s.fused_loss and i <= ev.head.layer < i + cnt:
            rows = RunRows()
            fused_head(ev, s, RankSums.zeros(s.pp), rows, r, rec, lt, tp=s.tp if ch.tp else 1)
            [(_, _, (_, head_rec, head_tpc))], [(_, _, (*_, head_hw))] = rows.early, rows.late
            out["rec"][r] += head_rec
            out["tpc"][r] += head_tpc
            out["hw_flops"] += head_hw
        out["layers"][r] += cnt
        out["full_recompute"][r] += cnt if rec == "full" else 0
        for name, per_layer in (("tp_step", lt.tp_step), ("casts", lt.cast_local),
                                ("f8_weights", lt.f8_weights_local), ("tensors", lt.tensors),
                                ("whole_grads", lt.whole_grads)):
            out[name][r] += cnt * per_layer
        out["cpu_ops"][r] += cnt * lt.cpu_s("eager ops", rec)
        out["cpu_tp"][r] += cnt * lt.cpu_s("tensor parallel", rec)
        if not ch.fsdp:
            out["nofsdp"][r] += cnt * lt.params_local
        out["model_flops"] += cnt * lt.model_flops
        out["hw_flops"] += cnt * (lt.flops + lt.recompute_flops(rec))
    return out


@pytest.mark.parametrize("case", ["gpt", "llama-interleaved", "moe"])
def test_run_rows_sum_to_the_scalar_sums(monkeypatch, case):
    """Every candidate a plan() costs: the per rank sums made as arrays (``np.add.at``) are those the scalar loop
    made, within 1e-12 (GPT's tied head, a pipelined interleaved LLaMA with the fused loss, a MoE), and Python
    floats as they were."""
    gpt = zoo.GPTConfig(n_layer=4, n_head=8, n_embd=512, vocab_size=8192, block_size=1024)
    llama = zoo.LlamaConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=1408)
    moe = zoo.MoEConfig(vocab_size=8192, dim=256, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=704,
                        n_routed_experts=4, n_shared_experts=0, top_k=2, moe_ffn_dim=704)
    graph, kw = {"gpt": (_graph(lambda: zoo.GPT(gpt), 8192), {}),
                 "llama-interleaved": (_graph(lambda: zoo.Llama(llama), 8192),
                                       {"fix": {"schedule": "interleaved_1f1b"}}),
                 "moe": (_graph(lambda: zoo.MoETransformer(moe), 8192), {})}[case]
    cluster = ap.Cluster.preset("h100-80gb", 1, 8)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=2 * GiB))
    seen, evaluate = [], Evaluator.evaluate

    def recorded(ev, s, choices):
        seen.append((ev, s, [dataclasses.replace(c) for c in choices]))
        return evaluate(ev, s, choices)

    monkeypatch.setattr(Evaluator, "evaluate", recorded)
    try:
        ap.plan(graph, cluster, global_batch=32, **kw)
    except ap.PlanError:
        pass  # the candidates costed on the way are what is compared
    fresh = Evaluator.sum_layers.__wrapped__
    assert seen
    for ev, s, choices in seen:
        sums, want = fresh(ev, s, choices), _scalar(ev, s, choices)
        for name, value in want.items():
            got = getattr(sums, name)
            assert got == pytest.approx(value, rel=1e-12, abs=0), (name, s)
            assert all(type(x) is float for x in (got if isinstance(got, list) else [got])), name
    if case == "llama-interleaved":
        assert any(s.fused_loss and s.pp > 1 for _, s, _ in seen)


def test_a_cut_is_sharded_inside_the_sp_region_from_the_first_block():
    """``pipeline.cut_sharded`` against its definition at every cut of a 4-layer GPT under SP, TP on everywhere:
    both sides are blocks, or TP layers past the first block that SP covers (the first block found once per
    evaluator, ``Evaluator.first_block``)."""
    from autopar_nb.cost.pipeline import cut_sharded
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.cost.setting import LayerChoice, Setting

    graph = _graph(lambda: zoo.GPT(zoo.GPTConfig(n_layer=4, n_head=8, n_embd=512, vocab_size=8192)), 8192)
    ev = Evaluator(profile_of(graph, "cuda"), ap.Cluster.preset("h100-80gb", 1, 8))
    assert ev.first_block == min(ev.blocks) > 0
    s = Setting(tp=2, sp=True)
    choices = [LayerChoice(tp=True) for _ in graph.layers]

    def inside(i):
        return i in ev.blocks or (i > min(ev.blocks) and ev.prof.sp_covers(i))

    want = [inside(k - 1) and inside(k) for k in range(1, len(choices))]
    assert [cut_sharded(ev, s, choices, k) for k in range(1, len(choices))] == want
    assert any(want) and not all(want)
