"""Stages set by hand meet the rules the planner places stages by (``cost/profile/crossings.py``:
``stage_start_refusals``): a pin through ``ap.override`` or ``plan(overrides=...)``, a drag between the widget's
pipeline lanes, and a plan whose stages were edited by hand before export are each refused with one message naming
the layer, the reason and the layer to start the stage at instead."""

from __future__ import annotations

import dataclasses

import pytest
from families import FAMILIES
from runtime_cases import has_transformers

import autopar_nb as ap
from autopar_nb.export.values import script_values
from autopar_nb.notebook.cell import run_model_cell
from autopar_nb.notebook.session import Session
from autopar_nb.plan import PlanError

pytestmark = pytest.mark.skipif(not has_transformers(), reason="needs transformers")

CPU2 = {"pp": 2, "amp": "none"}


def _model(name: str):
    source = run_model_cell(FAMILIES[name], {}).source
    model, inputs, _ = source.build(device="meta")
    return source, ap.capture(model, inputs)


@pytest.fixture(scope="module")
def llama():
    return _model("LLaMA")


@pytest.fixture(scope="module")
def phi():
    return _model("Phi")


CPU3 = {"pp": 3, "amp": "none"}
REFUSED = ("stage 1 cannot start at model.rotary_emb: it reads nothing model.embed_tokens computed, so nothing orders "
           "its stage after the one before; start it at model.layers.0, or keep model.rotary_emb on stage 0 with "
           "model.embed_tokens")


def _cluster(n: int = 2):
    return ap.Cluster.preset("cpu", gpus_per_node=n)


def test_a_pin_is_refused_where_its_stage_cannot_run_with_the_layer_and_the_reason(llama, phi):
    """A pin that starts a stage at a layer the planner's starts avoid plans where the stage as a whole runs: LLaMA's
    rotary table reads only positions, but its stage reads the hidden states through model.layers.0, which stays
    with it (verified on 2 gloo processes: test_a_cut_at_the_rotary_table_trains_like_one_process); Phi's
    parameterless embed_dropout and its rotary table alike. A pin that leaves the rotary table alone on its stage is
    refused with the layer, the reason and where to start the stage instead (a 3-stage cut so ran until rank 1
    built its optimizer: "optimizer got an empty parameter list"); before, every pin at these layers was."""
    graph = llama[1]
    for overrides in ({"model.rotary_emb": {"stage": 1}},
                      {"model.embed_tokens": {"stage": 0}, "model.rotary_emb": {"stage": 1}}):
        p = ap.plan(graph, _cluster(), fix=CPU2, overrides=overrides)
        assert [lp.stage for lp in p.layers] == [0, 1, 1, 1, 1, 1]
    p = ap.plan(graph, _cluster(3), fix=CPU3, overrides={"model.rotary_emb": {"stage": 1}})
    assert [lp.stage for lp in p.layers] == [0, 1, 1, 2, 2, 2]
    with pytest.raises(PlanError) as e:
        ap.plan(graph, _cluster(3), fix=CPU3, overrides={"model.rotary_emb": {"stage": 1},
                                                         "model.layers.0": {"stage": 2}})
    assert str(e.value) == REFUSED, e.value
    p = ap.plan(graph, _cluster(), fix=CPU2, overrides={"model.layers.0": {"stage": 1}})
    assert [lp.stage for lp in p.layers] == [0, 0, 1, 1, 1, 1]
    for layer, stages in (("model.rotary_emb", [0, 0, 1, 1, 1, 1, 1]), ("model.embed_dropout", [0, 1, 1, 1, 1, 1, 1])):
        p = ap.plan(phi[1], _cluster(), fix=CPU2, overrides={layer: {"stage": 1}})
        assert [lp.stage for lp in p.layers] == stages, layer
    with pytest.raises(PlanError, match=r"stage 1 cannot start at model\.embed_dropout: it holds no parameters"):
        ap.plan(phi[1], _cluster(3), fix=CPU3, overrides={"model.embed_dropout": {"stage": 1},
                                                          "model.rotary_emb": {"stage": 2}})


def test_session_override_is_refused_and_keeps_the_plan(llama):
    s = Session(llama[1], _cluster(3), llama[0], fix=dict(CPU3))
    s.override("model.rotary_emb", stage=1)
    plan, overrides = s.plan, dict(s.overrides)
    with pytest.raises(PlanError, match=r"cannot start at model\.rotary_emb.*start it at model\.layers\.0"):
        s.override("model.layers.0", stage=2)
    assert s.plan is plan and s.overrides == overrides


def test_widget_lane_drop_and_boundary_are_refused_near_the_lane(llama):
    """A layer dropped on another lane, and a lane's boundary dropped on a layer, go through the same rules: the
    widget keeps its plan and pins and shows the planner's message as the error of that edit (the front end puts a
    message beside the section its edit came from)."""
    s = Session(llama[1], _cluster(3), llama[0], fix=dict(CPU3))
    s.replan(overrides={"model.rotary_emb": {"stage": 1}, "model.layers.1": {"stage": 2}})
    w = s.widget()
    plan, overrides = s.plan, dict(s.overrides)
    assert [lp.stage for lp in plan.layers] == [0, 1, 1, 2, 2, 2]
    for msg in ({"kind": "stage", "layer": "model.layers.0", "stage": 2},
                {"kind": "boundary", "stage": 2, "layer": "model.layers.0"}):
        w.handle(msg)
        assert s.plan is plan and s.overrides == overrides, msg
        (m,) = w.messages
        assert m["level"] == "error" and REFUSED in m["text"], m
    w.handle({"kind": "boundary", "stage": 2, "layer": "model.norm"})
    assert w.messages[0]["level"] == "info" and [lp.stage for lp in s.plan.layers] == [0, 1, 1, 1, 2, 2]


def _edited(plan, stages: list[int], pp: int):
    d = plan.to_dict()
    d["layers"] = [{**lp, "stage": st} for lp, st in zip(d["layers"], stages, strict=True)]
    if pp != d["mesh"]["pp"]:
        d = {**d, "mesh": {**d["mesh"], "pp": pp}, "cluster": {**d["cluster"], "gpus_per_node": pp},
             "pipeline": {**d["pipeline"], "schedule": "gpipe"}}
    return ap.Plan.from_dict(d)


def test_a_plan_edited_by_hand_is_checked_stage_by_stage_before_export(llama, tmp_path):
    """A plan whose stages were set by hand (a Plan dict, an edited plan JSON) is checked before a script is written,
    each stage as a whole. The 2-stage cut at the rotary table runs (its stage reads the hidden states through
    model.layers.0: test_a_cut_at_the_rotary_table_trains_like_one_process) and is written; it was refused, by the
    per-layer rule the planner's starts keep. A 3-stage cut, stage 1 the rotary table alone, ran unchecked on 3 gloo
    processes until rank 1 built its optimizer ("optimizer got an empty parameter list"): refused, naming the layer.
    A plan without a pipeline has nothing to check."""
    source, graph = llama
    plan = ap.plan(graph, _cluster(), fix=CPU2)
    script_values(source, plan)  # the planner's stages pass
    edited = _edited(plan, [0, 1, 1, 1, 1, 1], 2)
    ap.export(source, edited, tmp_path / "train.py", quiet=True)
    assert 'STAGE_BOUNDARIES = ["model.rotary_emb"]' in (tmp_path / "train.py").read_text()
    with pytest.raises(PlanError) as e:
        script_values(source, _edited(plan, [0, 1, 2, 2, 2, 2], 3))
    assert str(e.value) == (
        "stage 1 cannot start at model.rotary_emb: its stage (model.rotary_emb) reads nothing stage 0 computed, so "
        "nothing orders it after the one before; start it at model.layers.0, or keep model.rotary_emb on stage 0 "
        "with model.embed_tokens (plan.layers[*].stage)"), e.value
    one = dataclasses.replace(edited, mesh=dataclasses.replace(edited.mesh, pp=1, dp=2),
                              layers=[dataclasses.replace(lp, stage=0) for lp in edited.layers])
    script_values(source, one)  # no pipeline: nothing to check


def test_stages_are_judged_as_wholes(llama, phi):
    """Each stage as a whole: it must read something the stage before computed and hold parameters. Phi's stage
    may start at its parameterless embed_dropout or at its rotary table when the decoder layers are in it."""
    from autopar_nb.cost.profile.crossings import refused_stages, stage_rules

    for _, graph in (llama, phi):
        paths, rules = [lay.path for lay in graph.layers], stage_rules(graph)
        for k in range(1, len(paths)):
            assert refused_stages(paths, rules, [int(i >= k) for i in range(len(paths))]) == "", paths[k]
    paths, rules = [lay.path for lay in phi[1].layers], stage_rules(phi[1])
    assert refused_stages(paths, rules, [0, 1, 1, 2, 2, 2, 2]).startswith(
        "stage 1 cannot start at model.embed_dropout: its stage (model.embed_dropout to model.rotary_emb) holds no "
        "parameters")


def test_the_runtime_refuses_a_cut_it_cannot_run_before_building_a_stage(llama):
    """An exported script's STAGE_BOUNDARIES edited by hand reach the runtime's split unchecked (the script imports
    nothing from autopar_nb): the split itself says what is wrong, naming the layer, before any stage is built.
    The rotary table alone on a stage holds no parameters; with position_ids handed in (context parallelism's
    way), it reads nothing stage 0 computes and torch's split ordered it first (its successor was then called
    without the hidden states). The 2-stage cut at the rotary table splits, with and without position_ids."""
    import torch

    from autopar_nb.runtime.pp_split import split_model
    from autopar_nb.runtime.train import switch_off_kv_cache

    source = llama[0]
    ids = torch.randint(0, 128, (2, 16))
    for kwargs in ({}, {"position_ids": torch.arange(16).expand(2, 16)}):
        def split(boundaries, kwargs=kwargs):
            meta, _, _ = source.build(device="meta", seed=3)
            switch_off_kv_cache(meta)
            return split_model(meta, boundaries=boundaries, microbatch=((ids,), kwargs))[0]

        assert len(split(["model.rotary_emb"])) == 2
        why = (r"pipeline stage 1 starts at model\.rotary_emb but reads nothing stage 0 computes, so the split runs "
               r"it before stage 0: .*keep model\.rotary_emb on stage 0" if kwargs else
               r"pipeline stage 1 starts at model\.rotary_emb and holds no parameters, .*keep model\.rotary_emb on "
               r"stage 0")
        with pytest.raises(ValueError, match=why + r".*STAGE_BOUNDARIES"):
            split(["model.rotary_emb", "model.layers.0"])


@pytest.mark.multiprocess
def test_a_cut_at_the_rotary_table_trains_like_one_process(llama):
    """The 2-stage cut at LLaMA's rotary table, pinned (``ap.override``'s path) as set by hand, on 2 gloo processes:
    the same losses as one process."""
    from autopar_nb.verify import verify

    source, graph = llama
    plan = ap.plan(graph, _cluster(), fix=CPU2, overrides={"model.rotary_emb": {"stage": 1}})
    assert [lp.stage for lp in plan.layers] == [0, 1, 1, 1, 1, 1]
    report = verify(source, plan, steps=3, nproc=2)
    print(report)
    assert report.ok and len(report.steps) == 3, report
    assert max(abs(s.loss - s.ref_loss) for s in report.steps) <= 1e-6, report
