"""A norm inside each head of a split attention (Qwen3's ``q_norm`` and ``k_norm``: an RMSNorm over ``head_dim`` after
the view into heads) no longer keeps the attention whole under TP: the mean over ``head_dim`` needs no other rank's
heads, so q/k/v are split colwise and ``o_proj`` rowwise, and the norm is ``"per_head"``: its weight whole on every
rank, its input split by heads (torch's ``SequenceParallel`` on the heads dim), its gradient summed over the ranks."""

from __future__ import annotations

import copy

import pytest
from families import FAMILIES
from runtime_cases import has_transformers, source

import autopar_nb as ap

CPU2 = ap.Cluster.preset("cpu", gpus_per_node=2)
ATTN = "model.layers.1.self_attn."

pytestmark = pytest.mark.skipif(not has_transformers(), reason="transformers not installed")


def planned():
    model, inputs, _ = source(FAMILIES["Qwen3"]).build(device="meta")
    graph = ap.capture(model, inputs)
    return graph, ap.plan(graph, CPU2, fix={"tp": 2})


def test_qwen3s_attention_is_split_with_its_per_head_norms():
    from autopar_nb.export import render_script

    graph, plan = planned()
    assert {m: s for m, s in plan.tp_plan.items() if m.startswith(ATTN)} == {
        ATTN + "q_proj": "colwise", ATTN + "k_proj": "colwise", ATTN + "v_proj": "colwise", ATTN + "o_proj": "rowwise",
        ATTN + "q_norm": "per_head", ATTN + "k_norm": "per_head"}, plan.tp_plan
    assert any(line.startswith("Norms inside each head") and "model.layers.*.self_attn.k_norm" in line
               for line in plan.explanation), plan.explanation
    script = render_script(source(FAMILIES["Qwen3"]), plan)
    assert '"self_attn.q_norm": SequenceParallel(use_local_output=True, sequence_dim=-2)' in script, script
    with pytest.raises(ap.PlanError, match="comes with the attention it feeds"):
        ap.plan(graph, CPU2, fix={"tp": 2}, overrides={"model.layers.*.self_attn.q_norm": {"tp": "per_head"}})


def test_a_norm_over_the_split_features_still_keeps_them_whole():
    """A norm over every feature of a split projection (LLaMA's block norms read the whole hidden state; here the
    post-attention norm) is not "per_head": only one over the last dim of tensors split by heads is."""
    model, inputs, _ = source(FAMILIES["LLaMA"]).build(device="meta")
    plan = ap.plan(ap.capture(model, inputs), CPU2, fix={"tp": 2})
    assert "per_head" not in plan.tp_plan.values(), plan.tp_plan


@pytest.mark.multiprocess
def test_qwen3s_split_attention_trains_on_two_ranks_as_on_one():
    """tp=2 on 2 gloo processes: loss, gradients and parameters match the single-process run at rtol 1e-5. The same
    plan with the norms left plain (each rank's weight gradient from its own heads only) fails, so it is the
    "per_head" style that makes the split right."""
    from autopar_nb.verify import verify_many

    _, plan = planned()
    plain = copy.deepcopy(plan)
    for lp in plain.layers:
        for m in [m for m, style in lp.tp.items() if style == "per_head"]:
            del lp.tp[m]
    cell = source(FAMILIES["Qwen3"])
    summed, unsummed = verify_many([(cell, plan), (cell, plain)], steps=2, rtol=1e-5)
    assert summed.ok, str(summed)
    assert not unsummed.ok, str(unsummed)
