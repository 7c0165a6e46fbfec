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


def _cluster():
    return ap.Cluster.preset("cpu", gpus_per_node=2)


def test_a_pin_across_a_glued_layer_is_refused_with_the_layer_and_the_reason(llama, phi):
    """LLaMA's rotary table reads only positions, so nothing orders a stage starting there after the embedding's;
    Phi's rotary table, after a parameterless dropout, alike. Pinned with the embedding before on stage 0 (or alone:
    the first layer is on stage 0), the planner says so instead of finding no candidate; a pin at the next layer a
    stage may start at plans."""
    graph = llama[1]
    for overrides in ({"model.rotary_emb": {"stage": 1}},
                      {"model.embed_tokens": {"stage": 0}, "model.rotary_emb": {"stage": 1}}):
        with pytest.raises(PlanError) as e:
            ap.plan(graph, _cluster(), fix=CPU2, overrides=overrides)
        assert str(e.value) == (
            "stage 1 cannot start at model.rotary_emb: it reads nothing model.embed_tokens computed, so nothing "
            "orders its stage after the one before; start it at model.layers.0, or keep model.rotary_emb on stage 0 "
            "with model.embed_tokens"), e.value
    p = ap.plan(graph, _cluster(), fix=CPU2, overrides={"model.layers.0": {"stage": 1}})
    assert [lp.stage for lp in p.layers] == [0, 0, 1, 1, 1, 1]
    with pytest.raises(PlanError, match=r"stage 1 cannot start at model\.rotary_emb: it reads nothing "
                                        r"model\.embed_dropout computed.*; start it at model\.layers\.0"):
        ap.plan(phi[1], _cluster(), fix=CPU2, overrides={"model.rotary_emb": {"stage": 1}})
    with pytest.raises(PlanError, match=r"stage 1 cannot start at model\.embed_dropout: it holds no parameters"):
        ap.plan(phi[1], _cluster(), fix=CPU2, overrides={"model.embed_dropout": {"stage": 1}})


def test_session_override_is_refused_and_keeps_the_plan(llama):
    s = Session(llama[1], _cluster(), llama[0], fix=dict(CPU2))
    plan = s.replan()
    with pytest.raises(PlanError, match=r"cannot start at model\.rotary_emb.*start it at model\.layers\.0"):
        s.override("model.rotary_emb", stage=1)
    assert s.plan is plan and s.overrides == {}


def test_widget_lane_drop_and_boundary_are_refused_near_the_lane(llama):
    """A layer dropped on another lane, and a lane's boundary dropped on a layer, go through the same rules: the
    widget keeps its plan and pins and shows the planner's message as the error of that edit (the front end puts a
    message beside the section its edit came from)."""
    s = Session(llama[1], _cluster(), llama[0], fix=dict(CPU2))
    s.replan(overrides={"model.layers.1": {"stage": 1}})
    w = s.widget()
    plan, overrides = s.plan, dict(s.overrides)
    assert [lp.stage for lp in plan.layers] == [0, 0, 0, 1, 1, 1]
    for msg in ({"kind": "stage", "layer": "model.rotary_emb", "stage": 1},
                {"kind": "boundary", "stage": 1, "layer": "model.rotary_emb"}):
        w.handle(msg)
        assert s.plan is plan and s.overrides == overrides, msg
        (m,) = w.messages
        assert m["level"] == "error" and "stage 1 cannot start at model.rotary_emb: it reads nothing " \
            "model.embed_tokens computed" in m["text"] and "start it at model.layers.0" in m["text"], m
    w.handle({"kind": "boundary", "stage": 1, "layer": "model.layers.0"})
    assert w.messages[0]["level"] == "info" and [lp.stage for lp in s.plan.layers] == [0, 0, 1, 1, 1, 1]


def test_a_plan_edited_by_hand_is_refused_before_export(llama, tmp_path):
    """A plan whose stages were set by hand (a Plan dict, an edited plan JSON) is checked by the planner's rules
    before a script is written; a plan without a pipeline has nothing to check. A 3-stage cut as below, stage 1 the
    rotary table alone, ran unchecked on 3 gloo processes until rank 1 built its optimizer ("optimizer got an empty
    parameter list"); the 2-stage one ran (its stage 1 reads the hidden states through model.layers.0), refused by
    the same rule as the planner's pins."""
    source, graph = llama
    plan = ap.plan(graph, _cluster(), fix=CPU2)
    script_values(source, plan)  # the planner's stages pass
    d = plan.to_dict()
    d["layers"] = [{**lp, "stage": int(i >= 1)} for i, lp in enumerate(d["layers"])]
    edited = ap.Plan.from_dict(d)
    with pytest.raises(PlanError, match=r"stage 1 cannot start at model\.rotary_emb: .*start it at "
                                        r"model\.layers\.0.*plan\.layers\[\*\]\.stage"):
        ap.export(source, edited, tmp_path / "train.py", quiet=True)
    assert not (tmp_path / "train.py").exists()
    d3 = {**d, "mesh": {**d["mesh"], "pp": 3}, "cluster": {**d["cluster"], "gpus_per_node": 3},
          "pipeline": {**d["pipeline"], "schedule": "gpipe"}}
    d3["layers"] = [{**lp, "stage": min(i, 2)} for i, lp in enumerate(d["layers"])]
    with pytest.raises(PlanError, match=r"stage 1 cannot start at model\.rotary_emb: .*start it at model\.layers\.0"):
        script_values(source, ap.Plan.from_dict(d3))
    one = dataclasses.replace(edited, mesh=dataclasses.replace(edited.mesh, pp=1, dp=2),
                              layers=[dataclasses.replace(lp, stage=0) for lp in edited.layers])
    script_values(source, one)  # no pipeline: nothing to check
