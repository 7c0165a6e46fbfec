import json

import pytest

from autopar_nb.plan import SCHEMA_VERSION, Cost, LayerPlan, MemoryBreakdown, MeshPlan, PipelinePlan, Plan, PlanError


def _plan(**kw) -> Plan:
    layers = [LayerPlan("wte", stage=0, tp={"wte": "rowwise"}),
              LayerPlan("h.0", stage=0, tp={"h.0.attn.c_attn": "colwise", "h.0.attn.c_proj": "rowwise"},
                        recompute="selective"),
              LayerPlan("h.1", stage=1, recompute="full", pinned=["recompute"]),
              LayerPlan("lm_head", stage=1, tp={"lm_head": "colwise"})]
    return Plan(mesh=MeshPlan(dp=2, tp=2, pp=2, zero_stage=3), pipeline=PipelinePlan("1f1b"), layers=layers,
                cluster={"preset": "h100-80gb", "nodes": 1, "gpus_per_node": 8}, loss_parallel=True, **kw)


def test_json_round_trip_with_cost_and_alternatives():
    cost = Cost(step_time_s=0.5, comm_by_kind={"all_reduce": 0.1},
                memory_by_rank=[MemoryBreakdown(params=1e9, activations=2e9)] * 2, peak_memory_bytes=3e9)
    p = _plan(cost=cost, explanation=["tp=2 fits the heads"], alternatives=[_plan()])
    text = p.to_json()
    d = json.loads(text)
    assert d["schema_version"] == SCHEMA_VERSION
    assert d["cost"]["memory_by_rank"][0]["total"] == 3e9
    q = Plan.from_json(text)
    assert q == p
    assert q.alternatives[0].mesh == p.mesh
    assert q.cost.memory_by_rank[0].total == 3e9


def test_diff_lists_what_changed():
    a = _plan()
    b = Plan.from_json(a.to_json())
    b.mesh.zero_stage = 1
    b.layer("h.1").stage = 0
    b.layer("h.0").tp["h.0.attn.c_attn"] = "replicate"
    b.precision.amp = "bf16"
    changes = {c.path: (c.old, c.new) for c in a.diff(b)}
    assert changes == {
        "mesh.zero_stage": (3, 1),
        "layers[h.1].stage": (1, 0),
        "layers[h.0].tp.h.0.attn.c_attn": ("colwise", "replicate"),
        "precision.amp": ("none", "bf16"),
    }
    assert a.diff(a) == []
    assert "mesh.zero_stage: 3 -> 1" in [str(c) for c in a.diff(b)]


def test_validation_prints_the_arithmetic():
    with pytest.raises(PlanError, match=r"dp\(1\) \* tp\(3\) \* pp\(2\) = 6 != world_size\(8\)"):
        Plan(mesh=MeshPlan(dp=1, tp=3, pp=2), cluster={"nodes": 1, "gpus_per_node": 8})
    with pytest.raises(PlanError, match="zero_stage=4"):
        MeshPlan(zero_stage=4)
    with pytest.raises(PlanError, match="recompute='some'"):
        LayerPlan("x", recompute="some")
    with pytest.raises(PlanError, match="'diagonal'"):
        LayerPlan("x", tp={"x": "diagonal"})
    with pytest.raises(PlanError, match="stage 2, but the plan has 2 stage"):
        Plan(mesh=MeshPlan(pp=2), layers=[LayerPlan("x", stage=2)])
    with pytest.raises(PlanError, match="schema_version"):
        Plan.from_dict({"schema_version": 99})


def test_helpers():
    p = _plan()
    assert p.tp_plan == {"wte": "rowwise", "h.0.attn.c_attn": "colwise", "h.0.attn.c_proj": "rowwise",
                         "lm_head": "colwise"}
    assert p.stage_layers() == [["wte", "h.0"], ["h.1", "lm_head"]]
    assert "dp=2 tp=2 pp=2 zero=3" in p.summary()
    with pytest.raises(KeyError, match="layers are: wte, h.0"):
        p.layer("nope")
