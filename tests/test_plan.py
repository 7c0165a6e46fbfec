import copy
import json

import pytest

from autopar_nb.plan import (
    SCHEMA_VERSION,
    BatchPlan,
    Cost,
    LayerPlan,
    MemoryBreakdown,
    MeshPlan,
    OptimizerPlan,
    PipelinePlan,
    Plan,
    PlanError,
    PrecisionPlan,
    layer_of,
    normalize_fix,
    within,
)


def _plan(**kw) -> Plan:
    layers = [LayerPlan("wte", stage=0, tp={"wte": "rowwise"}),
              LayerPlan("h.0", stage=0, tp={"h.0.attn.c_attn": "colwise", "h.0.attn.c_proj": "rowwise"},
                        recompute="selective"),
              LayerPlan("h.1", stage=1, recompute="full", pinned=["recompute"]),
              LayerPlan("lm_head", stage=1, tp={"lm_head": "colwise"})]
    kw.setdefault("batch", BatchPlan(global_batch=4, micro_batches=2))  # 1F1B: a micro-batch per stage at least
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


def test_diff_serialises_nothing_it_ignores(monkeypatch):
    """A diff reads the decisions only: it does not serialise the plans (their cost, explanation, alternatives and
    levers), which on a LLaMA-7B plan with its 4 alternatives took 35-66 ms a diff on the shared 2-core machine,
    against 2-16 ms field by field (the widget diffs the plan each edit replaces); what it finds is the same."""
    a = _plan(explanation=["tp=2 fits the heads"], alternatives=[_plan()])
    b = Plan.from_json(a.to_json())
    b.mesh.zero_stage = 1
    b.fused_norm = True
    b.cluster = {**b.cluster, "nodes": 2}
    b.alternatives[0].mesh.zero_stage = 1  # ignored, as the cost is
    expected = {"mesh.zero_stage": (3, 1), "fused_norm": (False, True), "cluster.nodes": (1, 2)}

    def refuse(self):
        raise AssertionError("diff serialised a plan")

    monkeypatch.setattr(Plan, "to_dict", refuse)
    assert {c.path: (c.old, c.new) for c in a.diff(b)} == expected


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


def test_the_summary_says_gradient_accumulation():
    """A plan that needs 2 micro-batches to fit says so in its one line, as the runner-up lines do: DDP with
    accumulation beside ZeRO-2 without it are not the same step, and the line is where a user compares them."""
    layers = [LayerPlan("fc", tp={})]
    ddp = Plan(mesh=MeshPlan(dp=2, zero_stage=0), layers=layers, batch=BatchPlan(global_batch=8, micro_batches=2))
    assert ddp.summary().startswith("dp=2 tp=1 pp=1 zero=0 accum x2"), ddp.summary()
    one = Plan(mesh=MeshPlan(dp=2, zero_stage=2), layers=layers, batch=BatchPlan(global_batch=8, micro_batches=1))
    assert "accum" not in one.summary()
    assert "1f1b x2" in _plan().summary() and "accum" not in _plan().summary()  # a pipeline's micro-batches


def _plan_dict() -> dict:
    cost = Cost(step_time_s=0.5, memory_by_rank=[MemoryBreakdown(params=1e9)] * 2)
    return _plan(cost=cost, alternatives=[_plan()]).to_dict()


def test_from_dict_leaves_its_argument_alone():
    d = _plan_dict()
    before = copy.deepcopy(d)
    Plan.from_dict(d)
    assert d == before  # the cost's memory_by_rank and "total" keys, the sections, the layers: all still there


def _set(d: dict, path: str, value) -> dict:
    """A copy of the plan dict ``d`` with the dotted ``path`` (list indices as numbers) set to ``value``."""
    d = copy.deepcopy(d)
    *head, last = path.split(".")
    node = d
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return d


@pytest.mark.parametrize("path, value, match", [
    ("mesh.dp", True, r"mesh\.dp must be an integer, got True \(bool\)"),
    ("mesh.tp", "2", r"mesh\.tp must be an integer, got '2' \(str\)"),
    ("mesh.zero_stage", True, r"mesh\.zero_stage=True is not supported"),
    ("mesh.zero_stage", 1.0, r"mesh\.zero_stage=1\.0 is not supported"),
    ("batch.global_batch", 8.0, r"batch\.global_batch must be an integer"),
    ("batch.seq_len", "1024", r"batch\.seq_len must be an integer"),
    ("pipeline.virtual_stages", False, r"pipeline\.virtual_stages must be an integer"),
    ("precision.growth_interval", "__import__('os')", r"precision\.growth_interval must be an integer"),
    ("precision.growth_interval", 2000.0, r"precision\.growth_interval must be an integer"),
    ("precision.init_loss_scale", "65536", r"precision\.init_loss_scale must be a number"),
    ("precision.init_loss_scale", float("nan"), r"precision\.init_loss_scale must be finite"),
    ("precision.dynamic_loss_scale", "yes", r"precision\.dynamic_loss_scale must be true or false"),
    ("precision.param_dtype", "torch.float32; import os", r"precision\.param_dtype="),
    ("optimizer.lr", "1e-3", r"optimizer\.lr must be a number"),
    ("optimizer.lr", True, r"optimizer\.lr must be a number"),
    ("optimizer.weight_decay", None, r"optimizer\.weight_decay must be a number"),
    ("optimizer.betas", [0.9], r"optimizer\.betas must be two numbers"),
    ("optimizer.betas", [0.9, "0.99"], r"optimizer\.betas\[1\] must be a number"),
    ("optimizer.betas", "0.9,0.99", r"optimizer\.betas must be two numbers"),
    ("optimizer.betas", [0.9, 1.5], r"optimizer\.betas\[1\] must be in \[0\.0, 1\.0\)"),
    ("layers.0.stage", "0", r"layers\['wte'\]\.stage must be an integer"),
    ("layers.0.fsdp", 1, r"layers\['wte'\]\.fsdp must be true or false"),
    ("layers.0.sequence_parallel", "false", r"layers\['wte'\]\.sequence_parallel must be true or false"),
    ("layers.0.pinned", "recompute", r"layers\['wte'\]\.pinned must be a list"),
    ("layers.0.pinned", ["everything"], r"layers\['wte'\]\.pinned entry='everything' is not supported"),
    ("layers.0.tp", [], r"layers\['wte'\]\.tp must be a dict"),
    ("layers.0.path", 3, r"layer path must be a string"),
    ("layers.1.path", "wte", r"layer 'wte' appears twice"),
    ("layers.0.tp", {"wte weight": "rowwise"}, r"tp key='wte weight' is not a module path"),
    ("layers.0.tp", {"wte.*": "rowwise"}, r"tp key='wte\.\*' is not a module path"),
    ("layers.0.tp", {"": "rowwise"}, r"tp key='' is not a module path"),  # the root module: only in the root layer
    ("layers.0.sharding", "x", r"unknown field\(s\) in layers\[0\]: 'sharding'"),
    ("mesh.hp", 2, r"unknown field\(s\) in mesh: 'hp'; mesh has dp, tp, pp, zero_stage, ep, cp"),
    ("precision.loss_scale", 1.0, r"unknown field\(s\) in precision: 'loss_scale'"),
    ("cost.memory_by_rank.0.weights", 1.0, r"unknown field\(s\) in cost\.memory_by_rank\[0\]: 'weights'"),
    ("cost.step_time_s", "fast", r"cost\.step_time_s must be a number"),
    ("cost.flops", 1.0, r"unknown field\(s\) in cost: 'flops'"),
    ("mesh", [2, 2, 2], r"mesh must be a JSON object"),
    ("layers", {"wte": {}}, r"layers must be a list"),
    ("sync_batchnorm", "true", r"sync_batchnorm must be true or false"),
    ("explanation", "why", r"explanation must be a list"),
    ("cluster.nodes", "1", r"cluster\.nodes must be an integer"),
    ("model.name", ["GPT"], r"model\.name must be a string"),
    ("alternatives.0.mesh.pp", "2", r"alternatives\[0\]: mesh\.pp must be an integer"),
    ("mesh.ep", 0, r"mesh\.ep must be >= 1"),
    ("mesh.dp", 10**30, r"mesh\.dp must be <= 1048576, got 10{30}"),  # absurd degrees from a file (issue 46)
    ("pipeline.virtual_stages", 2**10 + 1, r"pipeline\.virtual_stages must be <= 1024, got 1025"),
    ("mesh.tp", 2**20, r"mesh world size dp\(2\) \* tp\(1048576\) \* pp\(2\) must be <= 1048576, got 4194304"),
    ("batch.micro_batches", 2**16 + 1, r"batch\.micro_batches must be <= 65536"),
    ("batch.global_batch", 10**30, r"batch\.global_batch must be <= 16777216"),
    ("batch.seq_len", 2**24 + 1, r"batch\.seq_len must be <= 16777216"),
    ("cluster.nodes", 2**20 + 1, r"cluster\.nodes must be <= 1048576"),
    ("cluster.memory_limit_bytes", 2**63, r"cluster\.memory_limit_bytes must be <= 9223372036854775807"),
    ("model.num_params", 10**30, r"model\.num_params must be <= 9223372036854775807"),
    ("optimizer.warmup_steps", 2**64, r"optimizer\.warmup_steps must be <= 9223372036854775807"),
    ("layers.0.stage", 2**64, r"layers\['wte'\]\.stage must be <= 9223372036854775807"),
    ("mesh.ep", 3, r"mesh\.ep\(3\) must divide mesh\.dp\(2\).*dp\(2\) % ep\(3\) = 2"),
    ("mesh.ep", 2, r"mesh\.ep=2 but experts is empty"),
    ("experts", "h.*.experts", r"experts must be a list"),
    ("experts", ["h.*.experts; import os"], r"experts\[0\]='h\.\*\.experts; import os' is not a module path"),
])
def test_from_dict_names_the_bad_field(path, value, match):
    d = _set(_plan_dict(), path, value)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(d)


def test_from_dict_reports_a_missing_layer_path():
    d = _plan_dict()
    del d["layers"][2]["path"]
    with pytest.raises(PlanError, match=r"layers\[2\] lacks the required field\(s\) path"):
        Plan.from_dict(d)


@pytest.mark.parametrize("path", [
    'h.0"]); import os; os.system("x"); ("',
    "h.0'); import os; ('",
    "h.0\nimport os",
    "h.0\\",
    "h..0",
    ".h",
    "h.",
    "h.*",
    "h.0 ",
])
def test_hostile_layer_paths_are_plan_errors(path):
    d = _set(_plan_dict(), "layers.1.path", path)
    with pytest.raises(PlanError, match="is not a module path"):
        Plan.from_dict(d)
    with pytest.raises(PlanError, match="is not a module path"):
        LayerPlan(path)
    with pytest.raises(PlanError, match="is not a module path"):
        LayerPlan("h.0", tp={path: "colwise"})


def test_hostile_plan_json_is_a_plan_error():
    text = _plan().to_json().replace('"growth_interval": 2000', '"growth_interval": "__import__(\'os\').system(\'x\')"')
    assert "__import__" in text
    with pytest.raises(PlanError, match="growth_interval must be an integer"):
        Plan.from_json(text)


def test_plans_built_in_python_are_checked():
    with pytest.raises(PlanError, match="mesh.dp must be an integer"):
        MeshPlan(dp=True)
    with pytest.raises(PlanError, match="growth_interval must be an integer"):
        PrecisionPlan(growth_interval="100")
    with pytest.raises(PlanError, match="betas must be two numbers"):
        OptimizerPlan(betas=(0.9, 0.99, 0.999))
    with pytest.raises(PlanError, match="layers must be a list"):
        Plan(layers=LayerPlan("x"))
    with pytest.raises(PlanError, match="layers\\[1\\] must be a LayerPlan"):
        Plan(layers=[LayerPlan("x"), {"path": "y"}])
    with pytest.raises(PlanError, match="mesh must be a MeshPlan"):
        Plan(mesh={"dp": 1})
    assert OptimizerPlan(lr=1, betas=[0, 0.5]) == OptimizerPlan(lr=1.0, betas=(0.0, 0.5))


def test_expert_parallel_fields():
    plan = _plan(experts=["h.*.mlp.experts"])
    plan.mesh.ep = 2
    back = Plan.from_json(plan.to_json())
    assert back.mesh.ep == 2 and back.experts == ["h.*.mlp.experts"] and "ep=2" in back.summary()
    assert [str(c) for c in _plan().diff(back)] == ["mesh.ep: 1 -> 2", "experts: [] -> ['h.*.mlp.experts']"]
    assert MeshPlan(dp=8, ep=4).world_size == 8  # borrowed from the data-parallel ranks
    assert normalize_fix({"ep": 4}) == {"ep": 4}


def test_valid_module_paths():
    # the root layer of a model without children (nn.Linear as the model) and its root-module TP key
    assert LayerPlan("", tp={"": "colwise"}).tp == {"": "colwise"}
    # nn.Sequential indices, nn.ModuleDict keys with '-'
    LayerPlan("blocks.0.mlp", tp={"blocks.0.mlp.c_fc": "colwise", "blocks.0.mlp.c-proj_2": "rowwise"})


def test_layer_of_is_the_longest_prefix():
    layers = ["wte", "h.1", "h.10", "h", ""]
    assert layer_of("h.10.attn.c_attn", layers) == "h.10"
    assert layer_of("h.1", layers) == "h.1"
    assert layer_of("h.2.mlp", layers) == "h"
    assert layer_of("lm_head", layers) == ""
    assert layer_of("lm_head", ["wte", "h.1"]) is None
    assert layer_of("wte_extra", ["wte"]) is None
    assert within("h.1.attn", "h.1") and within("h.1", "h.1") and within("x", "")
    assert not within("h.10", "h.1") and not within("h", "h.1")


def test_normalize_fix():
    assert normalize_fix({"zero": 3, "mb": 4, "sp": False, "amp": "bf16"}) == {
        "zero_stage": 3, "micro_batches": 4, "sequence_parallel": False, "amp": "bf16"}
    assert normalize_fix(None) == {}
    with pytest.raises(PlanError, match="unknown fix key"):
        normalize_fix({"hp": 2})
    with pytest.raises(PlanError, match=r"fix\['tp'\] must be an integer"):
        normalize_fix({"tp": "2"})
    with pytest.raises(PlanError, match=r"fix\['sequence_parallel'\]='true' is not supported"):
        normalize_fix({"sp": "true"})
    with pytest.raises(PlanError, match=r"fix\['zero_stage'\]=True is not supported"):
        normalize_fix({"zero_stage": True})
    with pytest.raises(PlanError, match=r"fix\['dp'\] must be <= 1048576, got 10{30}"):
        normalize_fix({"dp": 10**30})
    with pytest.raises(PlanError, match=r"fix\['micro_batches'\] must be <= 65536"):
        normalize_fix({"mb": 2**16 + 1})


def test_schedules_refuse_too_few_micro_batches_at_plan_time():
    """What torch's schedules would refuse on every rank after start-up is a PlanError when the plan is built."""
    from autopar_nb.plan import LayerPlan

    def three_stages(mb, schedule="1f1b", v=1):
        return Plan(mesh=MeshPlan(pp=3), batch=BatchPlan(global_batch=12, micro_batches=mb),
                    pipeline=PipelinePlan(schedule=schedule, virtual_stages=v),
                    layers=[LayerPlan(f"h.{i}", stage=i) for i in range(3 * v)])

    with pytest.raises(PlanError, match=r"'1f1b' with mesh.pp=3 needs batch.micro_batches >= 3 .*got 2"):
        three_stages(2)
    assert three_stages(3).batch.micro_batches == 3 and three_stages(2, "gpipe").mesh.pp == 3
    with pytest.raises(PlanError, match=r"'interleaved_1f1b' with mesh.pp=3 needs .* rounds \(micro_batches // pp = "
                                        r"2\), got 7"):
        three_stages(7, "interleaved_1f1b", 2)
    assert three_stages(6, "interleaved_1f1b", 2).pipeline.virtual_stages == 2
    with pytest.raises(PlanError, match="zbv_zero_bubble' runs exactly 2 stages per rank"):
        three_stages(6, "zbv_zero_bubble", 1)
