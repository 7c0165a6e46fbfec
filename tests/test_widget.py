"""The planner widget's Python side: traits after construction, edits -> re-plan through the real planner
(Session.override / Session.replan / Session.adopt), invalid edits keep the plan and say why, undo/redo, calls made in
code reflected, the graph view (auto view that fits the panel legibly, folding and its differences, groups, columns,
no stray nodes, colours checked for colour-blind readers), the sharding board (lanes the planner can run, refusals,
many layers in one re-plan), readable change lists and alternatives, and speed (printed, not asserted)."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autopar_nb import Cluster, capture
from autopar_nb.notebook.session import Session
from autopar_nb.plan import PlanError
from autopar_nb.source import ModelSource
from autopar_nb.units import fmt_bytes, fmt_count, fmt_time
from autopar_nb.widget import PlannerWidget, choices, differences, editor, options
from autopar_nb.widget.layout import (
    CHANGED_COLOR,
    DEFAULT_VIEWPORT,
    LEGIBLE_SCALE,
    SPLITS,
    auto_view,
    dot_binary,
    fit_ratio,
    layout,
    render_svg,
    svg_boxes,
    svg_size,
)
from autopar_nb.zoo import GPT, GPTConfig, Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from widget_models import RESNET34

TINY_GPT = GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, block_size=256)
GPT12 = GPTConfig(n_layer=12, n_embd=128, n_head=4, vocab_size=4096, block_size=128)
TINY_LLAMA = LlamaConfig(vocab_size=4096, dim=256, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=512)


def _graph(model_fn, inputs_fn):
    with torch.device("meta"):
        return capture(model_fn(), inputs_fn())


@pytest.fixture(scope="module")
def seed_graph():
    return _graph(lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)),
                  lambda: (torch.randn(32, 1024),))


@pytest.fixture(scope="module")
def gpt_graph():
    return _graph(lambda: GPT(TINY_GPT), lambda: (torch.randint(0, 8192, (8, 256)),))


@pytest.fixture(scope="module")
def gpt12_graph():
    return _graph(lambda: GPT(GPT12), lambda: (torch.randint(0, 4096, (8, 128)),))


@pytest.fixture(scope="module")
def llama_graph():
    return _graph(lambda: Llama(TINY_LLAMA), lambda: (torch.randint(0, 4096, (4, 128)),))


@pytest.fixture(scope="module")
def resnet_graph():
    ns: dict = {}
    with torch.device("meta"):
        exec(RESNET34, ns)
        return capture(ns["model"], ns["example_inputs"])


def _session(graph, gpus=2, **kw) -> Session:
    return Session(graph, Cluster.preset("h100-80gb", gpus_per_node=gpus), ModelSource("# test"), **kw)


def test_traits_after_construction(seed_graph):
    s = _session(seed_graph)
    w = s.widget()
    assert s.plan is not None, "the widget makes the first plan when there is none"
    assert w is s.widget(), "the widget is cached"
    assert w.svg.startswith("<svg") and 'id="op-linear"' in w.svg.replace("&#45;", "-")
    assert sorted(w.nodes) == ["in-args_0", "op-linear", "op-linear_1", "op-relu", "out-output"]
    info = w.nodes["op-linear"]
    assert info["op"] == "aten.linear.default" and info["layer"] == "0" and info["flops"] > 0
    assert info["out_shapes"] == ["32×1024"] and info["param_bytes"] == (1024 * 1024 + 1024) * 4
    assert [r["path"] for r in w.layers] == ["0", "1", "2"]
    row = w.layers[0]
    assert row["strategy"] == "auto" and [c["value"] for c in row["choices"]] == [
        "auto", "replicate", "fsdp", "colwise", "rowwise"], "one Linear: column or row split (the planner says so)"
    assert [c["value"] for c in w.layers[1]["choices"]] == ["auto", "replicate"], "ReLU has nothing to split"
    # a tiny MLP on 2 GPUs: two data-parallel replicas, no pipeline; the cost model gives one breakdown per pipeline
    # rank, so the memory panel shows one bar that stands for both ranks
    assert (s.plan.mesh.dp, s.plan.mesh.tp, s.plan.mesh.pp) == (2, 1, 1)
    (mem,) = s.plan.cost.memory_by_rank
    bars = w.memory["bars"]
    assert [(b["label"], b["ranks"]) for b in bars] == [("each of 2 ranks", [0])]
    assert bars[0]["total"] == mem.total and bars[0]["params"] == mem.params and not bars[0]["over"]
    assert w.memory["limit"] == s.cluster.device.memory_bytes and w.memory["peak"] == mem.total
    assert {p["key"] for p in w.time["parts"]} == {"compute", "comm_exposed", "bubble", "optimizer",
                                                    "cpu_wait"}
    assert 0 < w.time["mfu"] < 1
    values = w.controls["values"]
    assert w.controls["world_size"] == 2 and w.controls["fixed"] == {}
    assert (values["dp"], values["tp"], values["pp"], values["zero_stage"]) == (
        s.plan.mesh.dp, s.plan.mesh.tp, s.plan.mesh.pp, s.plan.mesh.zero_stage)
    keys = [entry["key"] for entry in w.legend]
    assert [k for k in keys if k != "tp-pair"] == list(SPLITS), "every split, and 'no parameters' for the ReLU"
    assert {e["strategy"] for e in w.legend if e["strategy"]} == {
        "replicate", "fsdp", "colwise", "rowwise", "colwise-rowwise", "sequence_parallel", "vocab"}
    # the header: units chosen per value (a 40 µs step is not "0.0 ms", 1 GiB peak not "0.00 GiB")
    assert w.summary.startswith(s.plan.summary().split(" | ")[0]) and "µs/step" in w.summary, w.summary
    assert w.explanation
    assert w.stages == [{"index": 0, "layers": ["0", "1", "2"], "rank": 0, "chunk": 0, "label": "stage 0"}]
    assert w.alternatives and all("trade" in a and a["members"] for a in w.alternatives)
    assert w.messages == [] and not w.can_undo and not w.can_redo  # a fresh plan: nothing to undo
    assert w.actions == ["verify", "export", "launch", "tournament"], "a Session has all four"
    assert w.view["auto"] and w.view["scale"] >= 1, w.view
    static = Path(__file__).resolve().parent.parent / "autopar_nb" / "static"
    assert (static / "planner.js").exists() and (static / "planner.css").exists() and PlannerWidget._esm


def test_session_displays_the_widget(seed_graph):
    s = _session(seed_graph)
    bundle = s._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == s.widget().model_id
    assert data["text/plain"].startswith("<autopar_nb.Session")


def test_strategy_edit_replans(seed_graph):
    s = _session(seed_graph)
    w = s.widget()
    rev = w.revision
    w.handle({"kind": "strategy", "layer": "0", "value": "colwise"})
    assert s.overrides == {"0": {"tp": "colwise"}}
    assert s.plan.layer("0").tp.get("0") == "colwise" and s.plan.mesh.tp == 2
    assert w.revision > rev
    row = w.layers[0]
    assert row["strategy"] == "colwise" and "tp" in row["pinned"]
    text = w.messages[0]["text"]
    assert w.messages[0]["level"] == "info" and "ap.override('0', tp='colwise')" in text
    # the planner had to raise tp for it: a layer edit never changes a global choice silently
    assert "also changed" in text and "tp 1 → 2" in text, text
    assert "0" in w.changed and any("mesh.tp" in c for c in w.changes)
    assert any(g["text"].startswith("tp: 1 → 2") for g in w.change_groups), w.change_groups
    assert w.timings["replan_ms"] is not None and w.timings["replan_ms"] < 5000
    # the split shows in the graph: the first Linear is TP column, the edge after the row-wise one an all-reduce
    assert w.nodes["op-linear"]["split"] == "tp-colwise"
    assert "all-reduce" in w.svg.replace("&#45;", "-")
    # back to auto un-pins
    w.handle({"kind": "strategy", "layer": "0", "value": "auto"})
    assert "0" not in s.overrides and w.layers[0]["strategy"] == "auto"


def test_invalid_edit_keeps_plan_and_says_why(seed_graph):
    s = _session(seed_graph)
    w = s.widget()
    plan, fix, overrides, undo_depth = s.plan, dict(s.fix), dict(s.overrides), len(s._undo)
    summary, controls, rev = w.summary, w.controls, w.revision
    w.handle({"kind": "global", "key": "tp", "value": "3"})
    assert s.plan is plan and s.fix == fix and s.overrides == overrides and len(s._undo) == undo_depth
    msg = w.messages[0]
    assert msg["level"] == "error" and "tp" in msg["text"] and "previous plan is kept" in msg["text"]
    # every control keeps the plan in force (the front end redraws them from these traits on an error message)
    assert w.summary == summary and w.controls == controls and w.revision == rev
    w.handle({"kind": "strategy", "layer": "0", "value": "no-such-style"})
    assert s.plan is plan and w.messages[0]["level"] == "error" and "no-such-style" in w.messages[0]["text"]
    w.handle({"kind": "no-such-message"})
    assert w.messages[0]["level"] == "error"


def test_infeasible_edit_reports_memory(gpt_graph):
    unfused = {"fused_loss": False}  # else the planner fuses the loss and the greedy plan fits after all
    big = _session(gpt_graph, global_batch=256)
    auto = big.replan(fix=unfused).cost.peak_memory_bytes
    greedy = {"zero_stage": 0, "dp": 2, "micro_batches": 1, "recompute": "none", "amp": "none"}
    heavy = big.replan(fix={**unfused, **greedy}).cost.peak_memory_bytes
    assert heavy > auto
    s = _session(gpt_graph, global_batch=256)
    s.cluster = dataclasses.replace(s.cluster, device=dataclasses.replace(s.cluster.device,
                                                                          memory_bytes=(auto + heavy) / 2))
    s.replan(fix=unfused)
    w = s.widget()
    plan = s.plan
    assert plan.cost.peak_memory_bytes <= (auto + heavy) / 2
    for key, value in greedy.items():
        before = s.plan
        w.handle({"kind": "global", "key": key, "value": str(value)})
        if w.messages[0]["level"] == "error":
            break
    else:
        pytest.fail(f"every greedy choice was accepted: {s.fix}")
    # the step that no longer fits: the message says by how much memory, the last valid plan stays
    assert "GiB" in w.messages[0]["text"], w.messages
    assert s.plan is before and s.plan is not None
    assert s.plan.cost.peak_memory_bytes <= s.cluster.device.memory_bytes


def test_undo_redo(seed_graph):
    s = _session(seed_graph)
    w = s.widget()
    first = s.plan
    w.handle({"kind": "strategy", "layer": "2", "value": "rowwise"})
    second = s.plan
    assert second is not first and w.can_undo
    w.handle({"kind": "undo"})
    assert s.plan is first and s.overrides == {} and w.can_redo and w.layers[2]["strategy"] == "auto"
    w.handle({"kind": "redo"})
    assert s.plan is second and w.layers[2]["strategy"] == "rowwise"
    w.handle({"kind": "undo"})
    assert s.plan is first and not w.can_undo  # the widget's own first plan: nothing before it
    w.handle({"kind": "undo"})  # nothing left: an inline message, no exception, the plan kept
    assert w.messages[0]["level"] == "error" and "nothing to undo" in w.messages[0]["text"]
    assert s.plan is first and w.layers and w.summary != "no plan yet: call ap.replan()"


def test_a_fresh_plan_has_nothing_to_undo(seed_graph):
    """Issue 42, point 1: undo on a fresh plan used to restore the state before it, no plan at all (the widget
    went blank and Export re-planned silently). The first plan is where the history starts."""
    s = _session(seed_graph)
    w = s.widget()
    first, revision = s.plan, w.revision
    assert first is not None and not w.can_undo and not w.can_redo
    w.handle({"kind": "undo"})  # a stale front end may still send it: refused inline, nothing changes
    assert s.plan is first and not w.can_undo and not w.can_redo and w.layers and w.stages
    assert w.messages[0]["level"] == "error" and "nothing to undo" in w.messages[0]["text"]
    assert w.run_defaults["nproc"] >= 1  # the processes field keeps its value
    with pytest.raises(IndexError, match="nothing to undo"):
        s.undo()
    s.replan(fix={"zero_stage": 3})  # an edit: now there is one step to undo, back to the first plan
    assert w.can_undo and w.revision > revision
    s.undo()
    assert s.plan is first and not w.can_undo and w.can_redo


def test_code_side_calls_are_reflected(seed_graph):
    s = _session(seed_graph)
    w = s.widget()
    rev = w.revision
    s.override("0", tp="colwise")  # as in another notebook cell
    assert w.revision > rev and w.layers[0]["strategy"] == "colwise" and w.summary == differences.plan_summary(
        s.plan, s.cluster)
    s.undo()
    assert w.layers[0]["strategy"] == "auto"
    s.replan(fix={"zero_stage": 3})
    assert w.controls["fixed"] == {"zero_stage": 3} and w.controls["values"]["zero_stage"] == 3
    w.close()
    assert s._observers == [] and s.widget() is not w


def test_a_plan_changed_from_code_clears_what_the_widget_said(seed_graph):
    """Issue 42, point 9: "0: strategy TP column: re-planned" (or an error) stayed at the top of the widget after
    another cell changed the plan, describing a plan no longer shown. A change from code clears the messages; an
    edit in the widget still says what it did, and a refused one why."""
    s = _session(seed_graph)
    w = s.widget()
    w.handle({"kind": "strategy", "layer": "0", "value": "colwise"})
    assert w.messages and "strategy TP column" in w.messages[0]["text"]
    s.undo()  # as in another notebook cell
    assert w.messages == []
    w.handle({"kind": "strategy", "layer": "0", "value": "no-such-split"})
    assert w.messages[0]["level"] == "error"
    s.replan(fix={"zero_stage": 3})
    assert w.messages == []
    w.handle({"kind": "global", "key": "zero_stage", "value": 1})
    assert w.messages[0]["level"] == "info" and "re-planned" in w.messages[0]["text"], w.messages


def test_the_replan_time_is_said_in_the_unit_its_size_calls_for(seed_graph):
    """Issue 42, units everywhere: a widget edit's message said "re-planned in 0 ms" for a sub-millisecond re-plan
    (whole milliseconds always); it now says the time as every other figure does (fmt_time)."""
    w = _session(seed_graph).widget()
    w.handle({"kind": "global", "key": "zero_stage", "value": 1})
    took = fmt_time(w.timings["replan_ms"] / 1e3)
    assert f"re-planned in {took} (" in w.messages[0]["text"], (took, w.messages)


def test_pipeline_drag_keeps_the_lanes(gpt_graph):
    """A drag between pipeline lanes pins the layers' stages and keeps the lanes (pp, virtual stages, schedule fixed
    when they were the planner's), says so, and one undo restores both; each lane names its pipeline rank."""
    s = _session(gpt_graph, gpus=4, global_batch=32, fix={"pp": 2, "tp": 1})
    w = s.widget()
    paths = [lp.path for lp in s.plan.layers]
    lanes = s.plan.mesh.pp * s.plan.pipeline.virtual_stages
    # interleaved 1F1B on 2 ranks: 4 lanes, each naming its rank and model chunk
    assert (s.plan.pipeline.schedule, lanes) == ("interleaved_1f1b", 4)
    assert [lane["label"] for lane in w.stages] == ["stage 0 · pp rank 0 · chunk 0", "stage 1 · pp rank 1 · chunk 0",
                                                   "stage 2 · pp rank 0 · chunk 1", "stage 3 · pp rank 1 · chunk 1"]
    # h.3 to stage 0 leaves two layers for three stages: the lanes cannot stay, and the message says what changed
    plan_before = s.plan
    w.handle({"kind": "stage", "layer": "h.3", "stage": 0})
    text = w.messages[0]["text"]
    assert "also changed" in text and "schedule interleaved_1f1b → 1f1b" in text and "undo restores" in text, text
    w.handle({"kind": "undo"})
    assert s.plan is plan_before
    # h.2 to stage 1 fits the lanes: they are kept (fixed), said, and one undo restores plan and choices
    fix_before = dict(s.fix)
    w.handle({"kind": "stage", "layer": "h.2", "stage": 1})
    assert s.plan.layer("h.2").stage == 1 and len(w.stages) == 4, w.messages
    assert s.fix == {**fix_before, "virtual_stages": 2, "schedule": "interleaved_1f1b"}, s.fix
    assert "lanes are kept" in w.messages[0]["text"], w.messages
    w.handle({"kind": "undo"})
    assert s.fix == fix_before and s.plan is plan_before
    s.replan(fix={**s.fix, "schedule": "1f1b"})
    lanes = s.plan.mesh.pp * s.plan.pipeline.virtual_stages
    assert [lane["index"] for lane in w.stages] == list(range(lanes)) and lanes >= 2
    assert [p for lane in w.stages for p in lane["layers"]] == paths, "every layer once, in model order"
    assert all("pp rank" in lane["label"] for lane in w.stages)
    assert s.plan.layer("h.3").stage > 0
    fix_before, plan_before = dict(s.fix), s.plan
    w.handle({"kind": "stage", "layer": "h.3", "stage": 0})
    assert s.plan.layer("h.3").stage == 0 and s.overrides["h.3"] == {"stage": 0}
    assert len(w.stages) == lanes, "the lanes stay"
    assert (s.plan.pipeline.schedule, s.plan.pipeline.virtual_stages) == (
        plan_before.pipeline.schedule, plan_before.pipeline.virtual_stages)
    added = {k: v for k, v in s.fix.items() if k not in fix_before}
    if added:
        assert "lanes are kept" in w.messages[0]["text"], w.messages
    stages = [lp.stage for lp in s.plan.layers]
    assert stages == sorted(stages), "stages stay contiguous"
    assert "h.3" in w.stages[0]["layers"] and "h.3" in w.changed
    w.handle({"kind": "undo"})
    assert s.fix == fix_before and s.plan is plan_before, "one undo restores the plan and the global choices"
    w.handle({"kind": "redo"})
    # the boundary in front of the last stage moves so that h.2 starts it
    last = len(w.stages) - 1
    w.handle({"kind": "boundary", "stage": last, "layer": "h.2"})
    assert w.messages[0]["level"] == "info", w.messages
    assert s.plan.layer("h.2").stage == last and s.plan.layer("h.1").stage < last
    # a stage that does not exist: inline error, nothing lost
    plan = s.plan
    w.handle({"kind": "stage", "layer": "h.0", "stage": 99})
    assert s.plan is plan and w.messages[0]["level"] == "error"


def test_lane_labels_name_rank_and_chunk():
    """Interleaved 1F1B with 2 virtual stages on pp=2: four lanes, stage s on pipeline rank s % 2 as chunk s // 2
    (runtime/pp.py's stage_ids), and a V schedule folds back."""
    from autopar_nb.runtime.pp import stage_ids

    for pp, v, sched in ((2, 2, "interleaved_1f1b"), (4, 2, "interleaved_1f1b"), (2, 2, "zbv_zero_bubble"),
                         (3, 1, "1f1b")):
        ranks = editor.stage_ranks(pp, v, sched)
        for r in range(pp):
            assert sorted(s for s, (rank, _) in enumerate(ranks) if rank == r) == sorted(
                stage_ids(r, pp, pp * v, sched)), (pp, v, sched)
    assert editor.stage_ranks(2, 2, "interleaved_1f1b") == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_global_controls_cluster_and_adopt(seed_graph):
    from autopar_nb.plan import FIX_KEYS

    s = _session(seed_graph)
    w = s.widget()
    # one vocabulary: the controls (and their labels, which the front end shows) are fix keys with options
    assert set(choices.GLOBAL_KEYS) <= set(FIX_KEYS) and list(w.controls["labels"]) == list(choices.GLOBAL_KEYS)
    assert set(w.controls["options"]) == set(choices.GLOBAL_KEYS) and w.view["legible"] == LEGIBLE_SCALE
    w.handle({"kind": "global", "key": "zero_stage", "value": "3"})
    assert s.fix == {"zero_stage": 3} and s.plan.mesh.zero_stage == 3
    w.handle({"kind": "global", "key": "zero_stage", "value": "auto"})
    assert "zero_stage" not in s.fix
    w.handle({"kind": "cluster", "preset": "a100-80gb", "nodes": 1, "gpus_per_node": 4})
    assert s.cluster.world_size == 4 and s.cluster.name == "a100-80gb" and w.controls["world_size"] == 4
    assert s.plan.mesh.world_size == 4


def test_adopt_is_a_starting_point(seed_graph):
    """Adopt makes the alternative the plan without pinning anything; the plan it replaces joins the alternatives
    (the panel stays); one undo goes back."""
    s = _session(seed_graph, gpus=4)
    w = s.widget()
    first = s.plan
    alt = first.alternatives[0]
    fix, overrides = dict(s.fix), dict(s.overrides)
    w.handle({"kind": "adopt", "index": 0})
    assert w.messages[0]["level"] == "info" and "ap.adopt(0)" in w.messages[0]["text"], w.messages
    assert s.fix == fix and s.overrides == overrides, "nothing pinned"
    assert s.plan.mesh == alt.mesh and s.plan.batch == alt.batch and s.plan.cost == alt.cost
    assert w.alternatives, "the Alternatives panel stays"
    assert any(a.summary() == first.summary() for a in s.plan.alternatives), "the planner's choice is an alternative"
    assert "Adopted an alternative" in s.plan.explanation[0]
    w.handle({"kind": "undo"})
    assert s.plan is first
    with pytest.raises(IndexError):
        s.adopt(99)


def test_alternatives_grouped_and_say_what_they_trade(seed_graph):
    """Alternatives that differ only in micro-batches are one row; each row says what differs from the plan and what
    it trades (time vs memory)."""
    s = _session(seed_graph)
    w = s.widget()
    plan = s.plan
    rows = w.alternatives
    assert sum(len(r["members"]) for r in rows) == len(plan.alternatives)
    keys = [tuple((k, v) for k, v in differences.global_choices(a).items() if k != "micro_batches")
            for a in plan.alternatives]
    assert len(rows) == len(set(keys)), "one row per shape, micro-batch variants inside it"
    for r in rows:
        assert r["differs"] and "% time" in r["trade"] or "same time" in r["trade"], r
        assert "memory" in r["trade"]
        assert not any("None" in d for d in r["differs"]), r["differs"]  # "pp 1 → 2 (1f1b)", not "schedule None → …"
    piped = _session(seed_graph, fix={"zero_stage": 3}).widget().alternatives
    # the tiny MLP is CPU-bound: at ZeRO-3 the plan itself is pipelined (no FSDP hooks at dp=1), its alternatives not
    assert any(d in ("pp 1 → 2 (1f1b)", "pp 2 → 1 (1f1b)") for r in piped for d in r["differs"]), piped
    assert not any("None" in d for r in piped for d in r["differs"]), piped
    # ZeRO-1 over one micro-batch runs ZeRO-2's FSDP2 calls: not offered beside it (it was DDP + a sharded optimizer,
    # the same time as DDP here, where the host's issue time decides)
    assert all(a.mesh.zero_stage != 1 or a.batch.micro_batches > 1 for a in plan.alternatives)
    alt = next(a for a in plan.alternatives if a.cost.step_time_s != plan.cost.step_time_s)
    d = alt.cost.step_time_s / plan.cost.step_time_s - 1
    assert f"{abs(d) * 100:.0f}% time" in differences.trade(plan, alt)


def test_option_refusals_come_from_the_planner(gpt_graph):
    """Dropdowns offer only what the planner can plan with the other choices: pp=4 with tp=8 on 8 GPUs, ZeRO with
    dp=1 and an interleaved schedule's virtual stages on 1f1b are disabled with the planner's reason."""
    s = _session(gpt_graph, gpus=8, global_batch=32)
    refused = options.option_refusals(gpt_graph, s.cluster, {"tp": 4}, {}, 32)
    assert "4" in refused["pp"] and "8" in refused["pp"] and "2" not in refused["pp"], refused["pp"]
    assert "8" in refused["dp"] and "2" not in refused["dp"]
    one = options.option_refusals(gpt_graph, s.cluster, {"tp": 4, "pp": 2}, {}, 32)
    assert set(one["zero_stage"]) == {"1", "2", "3"} and "dp=1" in one["zero_stage"]["3"], one["zero_stage"]
    assert "3" in one["tp"] or "3" not in [str(o) for o in choices.global_options(s.cluster)["tp"]]
    sched = options.option_refusals(gpt_graph, s.cluster, {"pp": 2, "schedule": "1f1b"}, {}, 32)
    assert "2" in sched["virtual_stages"] and "one stage per rank" in sched["virtual_stages"]["2"]
    w = s.widget()
    assert w.controls["disabled"] == options.option_refusals(gpt_graph, s.cluster, s.fix, s.overrides, 32)
    # what is disabled really fails, what is offered plans
    for key, value in (("pp", 4), ("pp", 2)):
        trial = {"tp": 4, key: value}
        try:
            s.replan(fix=trial)
            ok = True
        except PlanError:
            ok = False
        assert ok == (str(value) not in refused[key]), (key, value)


def test_sequence_parallel_is_offered_only_where_the_sequence_divides_by_tp():
    """A sequence of 15 tokens cannot be shared by 2 TP ranks: the control refuses SP=True (and, with SP fixed, tp=2)
    with the planner's reason, as the planner refuses that fix; a sequence of 16 is offered both."""
    odd = _graph(lambda: Llama(TINY_LLAMA), lambda: (torch.randint(0, 4096, (8, 15)),))
    s = _session(odd, gpus=2, global_batch=8)
    refused = options.option_refusals(odd, s.cluster, {}, {}, 8)
    assert "seq_len 15 does not divide by tp=2" in refused["sequence_parallel"]["True"], refused
    with_sp = options.option_refusals(odd, s.cluster, {"sequence_parallel": True}, {}, 8)
    assert "seq_len 15 does not divide by tp=2" in with_sp["tp"]["2"], with_sp
    with pytest.raises(PlanError, match="does not divide by tp=2"):
        s.replan(fix={"tp": 2, "sequence_parallel": True})
    even = _graph(lambda: Llama(TINY_LLAMA), lambda: (torch.randint(0, 4096, (8, 16)),))
    offered = options.option_refusals(even, s.cluster, {"sequence_parallel": True}, {}, 8)
    assert "True" not in offered.get("sequence_parallel", {}) and "2" not in offered.get("tp", {}), offered


def test_change_list_is_grouped_for_a_reader(llama_graph):
    s = _session(llama_graph, gpus=4, global_batch=16)
    w = s.widget()
    w.handle({"kind": "global", "key": "tp", "value": "4"})
    assert w.messages[0]["level"] == "info", w.messages
    raw, groups = w.changes, w.change_groups
    assert len(raw) > 60 and len(groups) <= 12, (len(raw), groups)
    assert groups[0]["text"].startswith("dp: ") or any(g["text"].startswith("tp: 1 → 4") for g in groups)
    colwise = next(g for g in groups if "replicate → colwise" in g["text"])
    assert "9 layers (layers.0–7, output)" in colwise["text"] and "(wq, wk, wv, w1, w3…)" in colwise["text"], colwise
    assert sum(g["count"] for g in groups) == len(raw), "every raw change is in one group"
    # every layer changed: no outlines in the graph (they would mark everything)
    assert w.view["outlined"] is False and "Δ" not in w.svg


def test_units():
    assert fmt_bytes(512) == "512 B" and fmt_bytes(8 * 1024) == "8.00 KiB" and fmt_bytes(1.5 * 2**20) == "1.50 MiB"
    assert fmt_bytes(1.02 * 2**30) == "1.02 GiB" and fmt_bytes(None) == "–"
    assert fmt_time(40.4e-6) == "40.4 µs" and fmt_time(0.0123) == "12.3 ms" and fmt_time(1.5) == "1.50 s"
    assert fmt_time(0) == "0 s" and fmt_count(1.51e6) == "1.51M" and fmt_count(75e3, " params") == "75.0k params"


def test_palette_is_readable_for_colour_blind_readers():
    """Split fills stay apart for normal vision and deuteranopia (Machado et al. 2009, severity 1), black text reads
    on each, and the changed marker (near-black) is distinct from every fill by lightness."""
    deutan = [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]]

    def lin(c):
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    def rgb(hexa):
        return [lin(int(hexa[i:i + 2], 16)) for i in (1, 3, 5)]

    def lab(r):
        x = 0.4124 * r[0] + 0.3576 * r[1] + 0.1805 * r[2]
        y = 0.2126 * r[0] + 0.7152 * r[1] + 0.0722 * r[2]
        z = 0.0193 * r[0] + 0.1192 * r[1] + 0.9505 * r[2]
        f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x / 0.95047, y, z / 1.08883)]
        return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])

    def seen(hexa, m=None):
        r = rgb(hexa)
        if m is not None:
            r = [min(1.0, max(0.0, sum(m[i][j] * r[j] for j in range(3)))) for i in range(3)]
        return lab(r)

    def contrast(a, b):
        la, lb = sorted(0.2126 * x[0] + 0.7152 * x[1] + 0.0722 * x[2] for x in (rgb(a), rgb(b)))
        return (lb + 0.05) / (la + 0.05)

    fills = {k: c for k, (_, c) in SPLITS.items()}
    for m in (None, deutan):
        worst = min(math.dist(seen(a, m), seen(b, m)) for a, b in itertools.combinations(fills.values(), 2))
        assert worst >= 12, (m is not None, worst)
    for k, c in fills.items():
        assert contrast(c, "#111111") >= 8, k
        assert contrast(c, CHANGED_COLOR) >= 8, k


def test_auto_view_fits_each_model_legibly(seed_graph, gpt_graph, llama_graph, resnet_graph):
    """The first view adapts depth, folding and columns so that the whole graph fits the default panel with every
    label >= 9 px (fit scale >= LEGIBLE_SCALE): the seed MLP in full, a GPT and a LLaMA with their blocks folded, a
    ResNet with its stages collapsed into groups. (The browser test measures the same on screen, GPT-2, LLaMA-70B and
    ResNet-50 included.)"""
    for graph, gpus in ((seed_graph, 2), (gpt_graph, 8), (llama_graph, 8), (resnet_graph, 8)):
        s = _session(graph, gpus=gpus)
        view, lay, svg, report = auto_view(graph, s.plan, viewport=DEFAULT_VIEWPORT)
        assert report["scale"] >= 1, (graph.model_type, report)
        assert fit_ratio(*svg_size(svg), DEFAULT_VIEWPORT) >= 1
        w, h = svg_size(svg)
        assert w * 4 / 3 * LEGIBLE_SCALE <= DEFAULT_VIEWPORT[0] and h * 4 / 3 * LEGIBLE_SCALE <= DEFAULT_VIEWPORT[1]
    assert len(lay.elements) < len(resnet_graph.layers), "the ResNet is folded or grouped"
    # a smaller panel gets a coarser view, never an illegible one
    for size in ((400, 300), (1600, 900)):
        view, lay, svg, report = auto_view(gpt_graph, _session(gpt_graph).plan, viewport=size)
        assert report["scale"] >= 1 or (view.depth == 0 and not view.breaks), (size, report)


def test_no_stray_scalar_nodes(resnet_graph):
    """BatchNorm's num_batches_tracked += 1 (an add_ that reads no tensor and that nothing reads) is not drawn."""
    lay = layout(resnet_graph, None, depth=9)
    updates = [n.name for n in resnet_graph.nodes if n.op.startswith("aten.add_") and not n.inputs]
    assert updates, "the model has the buffer updates this test is about"
    assert not any(f"op-{u}" in lay.nodes for u in updates)
    svg = render_svg(lay.dot)
    assert "add_\\n" not in lay.dot and "add_<" not in svg


def test_groups_expand_and_keep_depth(resnet_graph, gpt12_graph):
    s = _session(resnet_graph, gpus=8)
    w = s.widget()
    w.viewport = {"width": 560, "height": 620}  # as the front end reports its panel: the view is chosen again
    assert w.view["groups"] == ["layer1", "layer2", "layer3", "layer4"], w.view
    group = next(k for k, v in w.nodes.items() if v["kind"] == "group" and v["group"] == "layer3")
    assert len(w.nodes[group]["layers"]) == 6 and w.nodes[group]["types"]
    w.handle({"kind": "expand_group", "group": "layer3"})
    assert "layer3" not in w.view["groups"] and not w.view["auto"]
    assert any(v.get("layer") == "layer3.0" for v in w.nodes.values())
    w.handle({"kind": "auto_view"})
    assert w.view["auto"] and "layer3" in w.view["groups"]
    # expanding a folded block keeps the depth the user chose; a tall result gets columns
    g = _session(gpt12_graph, gpus=2).widget()
    g.handle({"kind": "depth", "value": 2})
    assert g.depth == 2
    g.handle({"kind": "expand", "block": "h"})
    assert g.depth == 2 and g.expanded == ["h"] and g.view["columns"] >= 2, g.view
    g.handle({"kind": "collapse", "block": "h"})
    assert g.depth == 2 and "h × 12" in g.svg


def test_folds_never_hide_a_difference(gpt_graph):
    """A folded block whose members differ says so in its label ("3 TP col → row, 1 FSDP unit"), its nodes show
    both splits, and it expands to show which."""
    s = _session(gpt_graph, gpus=4, global_batch=32, fix={"tp": 2, "zero_stage": 3, "pp": 1})
    w = s.widget()
    w.handle({"kind": "shard", "layers": ["h.2"], "value": "fsdp"})
    assert w.messages[0]["level"] == "info", w.messages
    assert set(s.plan.layer("h.2").tp.values()) == {"replicate"} and s.plan.layer("h.1").tp
    (cid, c), = [(k, c) for k, c in w.clusters.items() if c["block"] == "h"]
    assert c["differs"] == "3 TP col → row, 1 FSDP unit  ·  1 pinned", c
    assert "3 TP col → row, 1 FSDP unit" in w.svg.replace("&#45;", "-").replace("&#160;", " ").replace(
        "&#8594;", "→")
    mixed = [n for n in w.nodes.values() if n.get("layer") == "h.0" and len(n.get("splits", [])) > 1]
    assert mixed and all("on 1 of 4" in n["members"] for n in mixed), mixed
    w.handle({"kind": "expand", "block": "h"})
    assert w.nodes[next(k for k, n in w.nodes.items() if n.get("layer") == "h.2" and n["kind"] != "input")]


def test_sharding_board(gpt_graph):
    """Lanes are the splits the planner can run for this model's layers; each layer a chip in its lane; the lanes a
    chip cannot take carry the planner's reason; global choices that forbid a lane say so."""
    s = _session(gpt_graph, gpus=4, global_batch=32)
    w = s.widget()
    b = w.board
    lanes = [lane["value"] for lane in b["lanes"]]
    assert lanes[:3] == ["replicate", "fsdp", "colwise-rowwise"] and "vocab" in lanes, lanes
    assert [c["path"] for c in b["chips"]] == [lay.path for lay in gpt_graph.layers if lay.num_params]
    chips = {c["path"]: c for c in b["chips"]}
    assert {c["lane"] for c in b["chips"]} <= set(lanes)
    assert chips["h.1"]["kind"] == "h.0" and chips["h.1"]["block"] == "h", "block members share their refusals"
    refused = b["refused"]
    assert "vocab" in refused["h.0"] and "Embedding" in refused["h.0"]["vocab"], refused["h.0"]
    assert "colwise-rowwise" in refused["wte"] and "Linear pair" in refused["wte"]["colwise-rowwise"]
    assert "colwise-rowwise" not in refused["h.0"]
    # fix tp=1: every TP lane refused for every chip, with the reason
    w.handle({"kind": "global", "key": "tp", "value": "1"})
    tp_lanes = [v for v in editor.TP_LANES if v not in refused["h.0"]]
    assert tp_lanes and all("tp is fixed to 1" in w.board["refused"]["h.0"][v] for v in tp_lanes)
    # ZeRO-0 (DDP): no own FSDP unit (ZeRO-1 is FSDP2 too)
    w.handle({"kind": "global", "key": "zero_stage", "value": "0"})
    assert "needs ZeRO 1-3" in w.board["refused"]["h.0"]["fsdp"]


def test_shard_many_layers_is_one_replan_and_one_undo(gpt12_graph):
    s = _session(gpt12_graph, gpus=4, global_batch=32, fix={"zero_stage": 3})
    w = s.widget()
    calls = []
    orig = s.replan

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    s.replan = counting
    undo = len(s._undo)
    layers = [f"h.{i}" for i in range(1, 11)]
    w.handle({"kind": "shard", "layers": layers, "value": "colwise-rowwise"})
    msg = w.messages[0]
    assert msg["level"] == "info", msg
    assert len(calls) == 1 and len(s._undo) == undo + 1, "one re-plan, one undo step"
    assert all(editor.current_strategy(s.plan.layer(p), s.plan) == "colwise-rowwise" for p in layers)
    assert "ap.replan(overrides={**ap.overrides, 'h.[1-9]': {'tp': 'colwise-rowwise'}, 'h.10': " in msg["text"], msg
    chips = {c["path"]: c for c in w.board["chips"]}
    assert all(chips[p]["lane"] == "colwise-rowwise" and chips[p]["pinned"] for p in layers)
    # un-pin two of them: the glob is split so that the others stay pinned
    w.handle({"kind": "shard", "layers": ["h.3", "h.4"], "value": "auto"})
    pinned = {p for p in (lay.path for lay in gpt12_graph.layers) if "tp" in editor.pinned_entry(s.overrides, p)}
    assert pinned == set(layers) - {"h.3", "h.4"}, s.overrides
    # one chip dragged: the Python call it equals
    w.handle({"kind": "shard", "layers": ["h.11"], "value": "fsdp"})
    assert "ap.override('h.11', tp='replicate', fsdp=True)" in w.messages[0]["text"]
    # a drop the planner refuses leaves everything as it was
    plan, overrides = s.plan, dict(s.overrides)
    w.handle({"kind": "shard", "layers": ["wte"], "value": "colwise-rowwise"})
    assert w.messages[0]["level"] == "error" and s.plan is plan and s.overrides == overrides
    # recompute for several layers: one re-plan
    w.handle({"kind": "recompute", "layers": layers, "value": "full"})
    assert all(s.plan.layer(p).recompute == "full" for p in layers)


def test_layer_globs_name_exactly_the_layers(gpt12_graph):
    paths = [lay.path for lay in gpt12_graph.layers]
    for want in (["h.3"], [f"h.{i}" for i in range(12)], [f"h.{i}" for i in range(10, 12)], ["h.1", "h.5", "h.7"],
                 [f"h.{i}" for i in range(2, 9)], ["wte", "h.0", "ln_f"]):
        globs = editor.layer_globs(gpt12_graph, want)
        named = {p for p in paths for g in globs if fnmatch.fnmatchcase(p, g)}
        assert named == set(want), (want, globs)
    assert editor.layer_globs(gpt12_graph, [f"h.{i}" for i in range(12)]) == ["h.*"]
    assert editor.layer_globs(gpt12_graph, [f"h.{i}" for i in range(10, 12)]) == ["h.1[0-1]"]


def test_graph_targets_and_pattern_drops(gpt_graph):
    """A graph node or cluster dropped on a legend swatch (or picked in its right-click menu) takes that split, with
    the same rules: module patterns for nodes (every member's module in a folded block), layers for clusters."""
    s = _session(gpt_graph, gpus=4, global_batch=32)
    w = s.widget()
    w.handle({"kind": "depth", "value": 1})
    mlp = next(n for n in w.nodes.values() if n.get("module") == "h.0.mlp")
    assert mlp["target"]["pattern"] == "h.*.mlp" and "colwise-rowwise" not in mlp["refused"]
    assert "fsdp" in mlp["refused"] and "whole layers" in mlp["refused"]["fsdp"]
    (c,) = [c for c in w.clusters.values() if c["block"] == "h"]
    assert c["layers"] == ["h.0", "h.1", "h.2", "h.3"] and "vocab" in c["refused"]
    w.handle({"kind": "shard", "pattern": "h.*.mlp", "value": "colwise-rowwise"})
    assert w.messages[0]["level"] == "info", w.messages
    assert "ap.override('h.*.mlp', tp='colwise-rowwise')" in w.messages[0]["text"]
    assert s.plan.mesh.tp > 1 and s.plan.layer("h.3").tp.get("h.3.mlp.c_fc") == "colwise"
    plan = s.plan
    w.handle({"kind": "shard", "pattern": "h.*.mlp", "value": "fsdp"})
    assert w.messages[0]["level"] == "error" and s.plan is plan


def test_dot_binary_is_found_without_path(monkeypatch):
    exe = dot_binary()
    assert Path(exe).is_file()
    monkeypatch.setenv("PATH", "/nonexistent")
    assert Path(dot_binary()).is_file()
    assert render_svg("digraph { a -> b }").startswith("<svg")


def test_layout_speed_gpt2():
    """GPT-2 (12 layers, 124M + head): layout ≤ 1 s and re-plan ≤ 0.5 s are the targets; measured and printed."""
    g = _graph(lambda: GPT(GPTConfig()), lambda: (torch.randint(0, 50257, (8, 1024)),))
    s = Session(g, Cluster.preset("h100-80gb", gpus_per_node=8), ModelSource("# test"), global_batch=64)
    t0 = time.perf_counter()
    w = s.widget()
    t1 = time.perf_counter()
    lay_t = time.perf_counter()
    lay = layout(g, s.plan)
    svg = render_svg(lay.dot)
    lay_t = time.perf_counter() - lay_t
    exp_t = time.perf_counter()
    render_svg(layout(g, s.plan, expanded={"h"}).dot)
    exp_t = time.perf_counter() - exp_t
    t2 = time.perf_counter()
    w.handle({"kind": "shard", "layers": [f"h.{i}" for i in range(4, 12)], "value": "colwise-rowwise"})
    t3 = time.perf_counter()
    assert w.messages[0]["level"] == "info", w.messages
    print(f"\nGPT-2 {len(g.nodes)} ops: widget (first plan + auto view) {1e3 * (t1 - t0):.0f} ms; full-depth "
          f"layout+SVG {1e3 * lay_t:.0f} ms ({len(lay.nodes)} nodes, {len(svg) // 1024} KiB); expanded layout+SVG "
          f"{1e3 * exp_t:.0f} ms; 8-layer shard edit {1e3 * (t3 - t2):.0f} ms (re-plan {w.timings['replan_ms']:.0f}"
          f" ms + refresh {w.timings['refresh_ms']:.0f} ms)")


def test_layout_without_plan_and_unknown_layers(seed_graph):
    lay = layout(seed_graph, None)
    assert lay.nodes["op-linear"]["split"] == "replicated" and lay.nodes["op-relu"]["split"] == "activation"
    with pytest.raises(PlanError):
        _session(seed_graph).replan(fix={"tp": 3})


def test_export_button_writes_the_script(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = ip.run_cell_magic("autoparallel", "--gpus 2 --gpu h100-80gb --batch 32",
                          "import torch, torch.nn as nn\n"
                          "model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))\n"
                          "example_inputs = (torch.randn(32, 64),)\n")
    w = s.widget()
    assert "export" in w.actions
    w.handle({"kind": "action", "name": "export"})
    msg = w.messages[0]
    assert msg["level"] == "info" and "train.py" in msg["text"] and "torchrun --nproc-per-node 2" in msg["detail"]
    assert (tmp_path / "train.py").exists() and w.last_result is not None


def test_layer_table_says_how_projections_with_parts_split(gpt_graph):
    """The layer table names the TP layouts beyond an even cut: nanoGPT's fused c_attn split part by part; a
    key/value projection with fewer heads than tp repeated; parts of different widths gathered."""
    from autopar_nb.plan import LayerPlan
    from autopar_nb.widget.editor import layout_note

    s = _session(gpt_graph)
    s.replan(fix={"tp": 2})
    w = s.widget()
    row = next(r for r in w.layers if r["path"] == "h.1")
    assert row["auto_label"] == "TP col → row + SP · c_attn split part by part", row
    layer = dataclasses.replace(gpt_graph.layer("h.1"), modules={"a.q": "Linear", "a.k": "Linear", "a.qkv": "Linear"})
    lp = LayerPlan("h.1", tp={"a.k": "colwise", "a.qkv": "colwise"}, tp_parts={"a.k": [1], "a.qkv": [4, 2, 2]})
    assert layout_note(layer, lp, 2) == " · k repeated · qkv gathered"



def test_recsys_notebook_says_what_the_widget_shows():
    """04_recsys's prose names the splits the widget shows for its model (issue 12 point 8): the tables vocab-parallel
    and, on 8 GPUs all in one TP group, the dense MLPs as TP column -> row pairs (not data parallel)."""
    import nbformat

    nb = nbformat.read(Path(__file__).resolve().parent.parent / "notebooks" / "04_recsys.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.source.startswith("%%autoparallel --gpus 8 --gpu l4"))
    ns: dict = {}
    with torch.device("meta"):
        exec(cell.split("\n", 1)[1], ns)
        graph = capture(ns["model"], ns["example_inputs"])
    s = Session(graph, Cluster.preset("l4", gpus_per_node=8), ModelSource("# test"), global_batch=4096)
    lanes = {c["path"]: c["lane"] for c in s.widget().board["chips"]}
    prose = nb.cells[0].source.replace("\n", " ")
    assert {lanes[p] for p in lanes if p.startswith("tables")} == {"vocab"} and "vocab-parallel" in prose
    dense = {lanes[p] for p in lanes if p.startswith(("bottom", "top"))}
    if dense & {"colwise", "rowwise", "colwise-rowwise"}:
        assert "column → row" in prose and "dense part data parallel" not in prose, (dense, prose)
    else:
        assert "data parallel" in prose, (dense, prose)


def test_precision_editor_edits_the_op_lists():
    """The precision editor (issue 18 point 3): adding an op to a list re-plans at once with
    ``fix["fp32_ops"]`` / ``fix["low_precision_ops"]``, the plan and its predicted time and memory follow (matmuls kept
    in float32 run at the fp32 rate and save float32 inputs), a name the other list holds moves, bad input gives one
    clear message and keeps every trait, removing the last op drops the key, undo restores, and without autocast the
    editor is off and says why."""
    graph = _graph(lambda: nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)),
                   lambda: (torch.randn(8192, 4096),))  # compute-bound: the matmuls' rate shows in the step time
    s = _session(graph)
    w = s.widget()
    p = w.precision
    assert p["amp"] == "bf16" and p["lists"] == {"fp32_ops": [], "low_precision_ops": []} and not p["disabled"]
    assert {"softmax", "layer_norm", "matmul", "elementwise_add"} <= set(p["choices"])
    time0, peak0 = w.time["total"], w.memory["peak"]
    w.handle({"kind": "precision", "list": "fp32_ops", "op": "linear", "action": "add"})
    assert w.messages[0]["level"] == "info" and "ap.replan(fix=" in w.messages[0]["text"], w.messages
    assert s.fix["fp32_ops"] == ["linear"] and s.plan.precision.fp32_ops == ["linear"]
    assert w.precision["lists"]["fp32_ops"] == ["linear"] and w.precision["reach"] == {"linear": 2}
    assert w.time["total"] > time0 and w.memory["peak"] > peak0  # fp32 matmuls: slower, float32 inputs saved
    w.handle({"kind": "precision", "list": "low_precision_ops", "op": " elementwise_add ", "action": "add"})
    assert s.plan.precision.low_precision_ops == ["elementwise_add"]
    assert w.precision["reach"] == {"linear": 2, "elementwise_add": 0}  # the MLP has no add: allowed, shown
    w.handle({"kind": "precision", "list": "low_precision_ops", "op": "linear", "action": "add"})
    assert "left the list to keep in float32" in w.messages[0]["text"]
    assert s.plan.precision.fp32_ops == [] and s.plan.precision.low_precision_ops == ["elementwise_add", "linear"]
    assert "fp32_ops" not in s.fix
    plan, fix, traits = s.plan, dict(s.fix), (w.precision, w.time, w.memory, w.revision)
    for bad, why in [({"op": "softmx"}, "'softmx' is not an op name the precision lists take; did you mean softmax"),
                     ({"op": "linear"}, "linear is already in the list to run in low precision"),
                     ({"op": ""}, "type an op name"),
                     ({"op": "relu", "action": "remove"}, "relu is not in the list"),
                     ({"list": "white_list"}, "'white_list' is not an op list")]:
        w.handle({"kind": "precision", "list": "low_precision_ops", "action": "add", **bad})
        (msg,) = w.messages
        assert msg["level"] == "error" and why in msg["text"] and "previous plan is kept" in msg["text"], msg
        assert s.plan is plan and s.fix == fix and (w.precision, w.time, w.memory, w.revision) == traits
    for op in ("elementwise_add", "linear"):
        w.handle({"kind": "precision", "list": "low_precision_ops", "op": op, "action": "remove"})
    assert "low_precision_ops" not in s.fix and s.plan.precision.low_precision_ops == []
    assert w.time["total"] == pytest.approx(time0) and w.memory["peak"] == pytest.approx(peak0)
    w.handle({"kind": "undo"})
    assert s.fix["low_precision_ops"] == ["linear"]
    # without autocast the lists cannot apply: the editor is off, an add says what to do
    w.handle({"kind": "undo"})
    w.handle({"kind": "global", "key": "amp", "value": "none"})
    assert "needs mixed precision" in w.messages[0]["text"] and s.fix.get("amp") is None  # lists still set: refused
    s.replan(fix={"amp": "none"})
    assert w.precision["disabled"].startswith("the op lists apply under autocast")
    w.handle({"kind": "precision", "list": "fp32_ops", "op": "softmax", "action": "add"})
    assert w.messages[0]["level"] == "error" and "choose AMP bf16 or fp16" in w.messages[0]["text"]
    assert "fp32_ops" not in s.fix


PRECISION_PAGE = """async ([esm, css, state, theme]) => {
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const style = document.createElement("style");
  style.textContent = css;
  document.head.append(style);
  const wrap = document.createElement("div");
  for (const [k, v] of Object.entries(theme)) wrap.style.setProperty(k, v);
  document.body.append(wrap);
  const el = document.createElement("div");
  wrap.append(el);
  const sent = [];
  const model = {get: (k) => state[k], set: (k, v) => { state[k] = v; }, save_changes: () => {}, on: () => {},
                 off: () => {}, send: (m) => sent.push(m)};
  mod.default.render({model, el});
  await new Promise((r) => setTimeout(r, 100));
  const row = (list) => el.querySelector(`.ap-oplist[data-list=${list}]`);
  const input = row("low_precision_ops").querySelector("input");
  input.value = "softmax";
  input.dispatchEvent(new KeyboardEvent("keydown", {key: "Enter", bubbles: true}));
  row("fp32_ops").querySelector(".ap-opchip[data-op=linear] .ap-opchip-x").click();
  const chip = row("fp32_ops").querySelector(".ap-opchip[data-op=linear]");
  const cs = getComputedStyle(chip), rs = getComputedStyle(el.querySelector(".ap-root"));
  return {sent, chips: [...el.querySelectorAll(".ap-opchip")].map((c) => c.dataset.op),
          none: [...el.querySelectorAll(".ap-opchip-none")].map((c) => c.dataset.op),
          disabled: [...el.querySelectorAll(".ap-oplist input, .ap-op-add")].map((x) => x.disabled),
          options: el.querySelectorAll(".ap-precision datalist option").length,
          off: (el.querySelector(".ap-precision-off") || {}).textContent || "",
          fg: cs.color, bg: cs.backgroundColor, page: rs.backgroundColor};
}"""
DARK = {"--jp-layout-color1": "#111111", "--jp-layout-color2": "#1e1e1e", "--jp-ui-font-color1": "#e6e6e6",
        "--jp-ui-font-color0": "#ffffff", "--jp-ui-font-color2": "#aaaaaa", "--jp-border-color1": "#555555",
        "--jp-input-background": "#222222", "--jp-brand-color1": "#5b9bff"}


def _rgb(css: str) -> tuple[float, float, float]:
    """An rgb()/rgba()/color(srgb ...) value as (r, g, b) in 0..1."""
    nums = [float(x) for x in re.findall(r"[\d.]+", css)]
    return tuple(x / 255 for x in nums[:3]) if css.startswith("rgb") else tuple(nums[:3])


def _contrast(a: str, b: str) -> float:
    def lum(c):
        lin = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in _rgb(c)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.browser
def test_precision_editor_in_chromium(seed_graph):
    """The precision editor's front end (planner.js renderPrecision) in a blank chromium page, light and dark
    themes: one chip per listed op (dashed when no op of the model has the name), typing a name + Enter sends an
    "add" message, a chip's × sends "remove", the chip's text is legible on its fill (contrast >= 4.5), and without
    autocast the inputs are disabled with the reason shown."""
    import test_browser

    test_browser._require_chromium()
    s = _session(seed_graph)
    s.replan(fix={"fp32_ops": ["linear"], "low_precision_ops": ["elementwise_add"]})
    w = s.widget()
    state = json.loads(json.dumps(w.get_state(), default=str))
    for theme in ({}, DARK):
        seen, errors = test_browser.evaluate_in_blank_page(PRECISION_PAGE, [w._esm, w._css, state, theme])
        assert not errors, errors
        assert seen["sent"] == [{"kind": "precision", "list": "low_precision_ops", "op": "softmax", "action": "add"},
                                {"kind": "precision", "list": "fp32_ops", "op": "linear", "action": "remove"}]
        assert seen["chips"] == ["linear", "elementwise_add"] and seen["none"] == ["elementwise_add"]
        assert not any(seen["disabled"]) and seen["options"] == len(w.precision["choices"]) and not seen["off"]
        assert _contrast(seen["fg"], seen["bg"]) >= 4.5, (theme, seen)
    dark_page = _rgb(seen["page"])
    assert sum(dark_page) < 0.5, "the dark theme's variables reach the widget"
    off = {**state, "precision": {**w.precision, "disabled": "the op lists apply under autocast: choose AMP"}}
    seen, errors = test_browser.evaluate_in_blank_page(PRECISION_PAGE, [w._esm, w._css, off, {}])
    assert not errors and all(seen["disabled"]) and seen["off"].startswith("the op lists apply under autocast")


# ---- measured beside predicted (issue 14 point 4, issue 21 point 6) -------------------------------------------------
MIB = 2**20


def cpu_run_of(session, tmp_path, *, peak=200 * MIB, floor=60 * MIB, step_time=0.3, steps=3, run_id="abcdef0123"):
    """A launched Run of the session's plan on 2 CPU processes, fed as its monitor would feed it: each rank's
    baseline, a tick whose VmHWM is ``peak`` above it, and ``steps`` step reports whose RSS is ``floor`` above it."""
    from autopar_nb.launch.run import Run

    run = Run(run_id=run_id, run_dir=tmp_path / run_id, script=tmp_path / "train.py", nproc=2, steps=steps,
              token="t", backend="gloo", max_restarts=0, hang_timeout_s=None, plan=session.plan)
    base = 300 * MIB
    for r in (0, 1):
        run._ranks[r].baseline = base
    run._record_tick(0, {r: {"rss": base + floor, "rss_peak": base + peak * (0.9 if r else 1.0)} for r in (0, 1)})
    run._rows += [{"rank": r, "attempt": 0, "step": s, "step_time_s": step_time * (3 if s == 0 else 1),
                   "samples_per_s": 32 / step_time, "rss": base + floor + s * MIB, "time": run.started + s}
                  for s in range(steps) for r in (0, 1)]
    run.first_step_time = 1.0
    return run


def test_the_widget_shows_what_a_run_of_the_plan_measured_beside_the_prediction(seed_graph, tmp_path):
    """Once a followed run of the plan shown reported steps, the memory bar, the components and the step time carry
    the measured figures and their ratios, on the basis the run compares with (CPU: the training state without the
    margin); a run of another plan shows nothing; the components name their sources, the margin's included."""
    from autopar_nb.launch.compare import predicted_memory

    s = Session(seed_graph, Cluster.preset("cpu", gpus_per_node=2), ModelSource("# test"))
    w = s.widget()
    assert w.measured == {}
    comp = w.components
    assert [r["key"] for r in comp["rows"]][:3] == ["params", "grads", "optimizer"] and comp["rows"][-1]["key"] == \
        "margin"
    assert all(r["source"] for r in comp["rows"]) and "the cost model's default (not calibrated)" in \
        comp["rows"][-1]["source"]
    mb = s.plan.cost.memory_by_rank[comp["rank"]]
    assert sum(r["bytes"] for r in comp["rows"]) == pytest.approx(mb.total)
    run = cpu_run_of(s, tmp_path)
    w.follow(run)
    w._on_run(run)
    m = w.measured
    state = predicted_memory(s.plan, 0, model_state=True)
    (bar,) = m["bars"]  # one breakdown for both ranks: the bar shows the worse of the two
    assert bar["ranks"] == [0, 1] and bar["rank"] == 0 and bar["measured"] == 200 * MIB
    assert bar["predicted"] == state and bar["ratio"] == pytest.approx(200 * MIB / state)
    assert m["components"]["peak"]["measured"] == 200 * MIB
    between = m["components"]["between steps"]
    assert between["measured"] == 60 * MIB and between["predicted"] == pytest.approx(mb.params + mb.optimizer)
    t = m["time"]  # a plan for CPU processes run on CPU processes: times compare; the warm-up step left out
    assert t["compared"] and t["measured"] == pytest.approx(0.3) and t["ratio"] == pytest.approx(
        0.3 / s.plan.cost.step_time_s)
    assert m["run"]["id"] == "abcdef01" and "RSS above" in m["run"]["basis"] and "2 CPU processes" in m["run"]["device"]
    tp = m["throughput"]  # samples/s as the steps reported them; MFU from the measured step time
    assert tp["unit"] == "samples/s" and tp["measured"] == pytest.approx(32 / 0.3)
    assert tp["ratio"] == pytest.approx(32 / 0.3 / s.plan.cost.samples_per_s)
    assert tp["mfu"]["measured"] == pytest.approx(s.plan.cost.mfu * s.plan.cost.step_time_s / 0.3)
    text = s.plan.explain(run)  # the same figures in words, after the plan's own explanation
    assert text.startswith(s.plan.explain()) and "Measured by run abcdef01 (starting, 2 CPU processes" in text
    assert f"Rank 0: peak 200 MiB against {fmt_bytes(state)} predicted (x{bar['ratio']:.2f}); between " \
           "steps 60.0 MiB against" in text and "Step time (median): 300 ms against" in text
    s.replan(fix={"zero_stage": 3})  # another plan: its figures are not this run's
    assert w.measured == {}
    s.undo()
    assert w.measured["bars"][0]["measured"] == 200 * MIB


def test_a_gpu_plan_run_on_cpu_shows_its_step_time_uncompared(seed_graph, tmp_path):
    s = _session(seed_graph)
    w = s.widget()
    run = cpu_run_of(s, tmp_path)
    w.follow(run)
    w._on_run(run)
    t = w.measured["time"]
    assert not t["compared"] and t["ratio"] is None and t["measured"] == pytest.approx(0.3)
    assert w.measured["throughput"] == {}  # another device: no MFU from CPU step times
    assert t["note"] == "not compared: the plan was made for h100-80gb, the run used 2 CPU processes (gloo)"


def test_a_gpu_run_shows_the_allocators_reserve_beside_the_margin(seed_graph, tmp_path):
    """On GPUs (issue 21 point 5) the peak compares CUDA's peak allocated with the predicted tensors (no margin), and
    the caching allocator's peak reserve, its fragmentation included, with the whole prediction, whose margin is
    there to cover it: in the widget's components and in ``plan.explain(run)``."""
    from autopar_nb.launch.compare import predicted_memory
    from autopar_nb.launch.run import Run
    from autopar_nb.planner.explain import fmt_bytes

    s = _session(seed_graph)
    w = s.widget()
    run = Run(run_id="0123456789", run_dir=tmp_path / "r", script=tmp_path / "train.py", nproc=2, steps=3,
              token="t", backend="nccl", max_restarts=0, hang_timeout_s=None, plan=s.plan)
    state, whole = predicted_memory(s.plan, 0, model_state=True), predicted_memory(s.plan, 0, model_state=False)
    run._rows += [{"rank": r, "attempt": 0, "step": k, "step_time_s": 0.1, "mem_allocated": 0.3 * state,
                   "mem_peak": state * (1.01 if r else 1.02), "mem_peak_reserved": state * (1.2 if k else 1.1),
                   "time": run.started + k} for k in range(3) for r in (0, 1)]
    run.first_step_time = 1.0
    w.follow(run)
    w._on_run(run)
    c = w.measured["components"]
    assert c["rank"] == 0 and c["peak"]["ratio"] == pytest.approx(1.02)  # the tensors: allocated vs no margin
    assert c["reserved"]["measured"] == pytest.approx(1.2 * state) and c["reserved"]["predicted"] == whole
    assert c["reserved"]["ratio"] == pytest.approx(1.2 * state / whole)
    text = s.plan.explain(run)
    assert f"allocator's peak reserve {fmt_bytes(1.2 * state)} against {fmt_bytes(whole)} predicted, margin " \
           f"included (x{1.2 * state / whole:.2f})" in text
    assert "CUDA's peak allocated, against the predicted tensors" in w.measured["run"]["basis"]


MEASURED_PAGE = """async ([esm, css, state, dark]) => {
  const style = document.createElement("style");
  style.textContent = css + (dark ? `body { --jp-layout-color1: #111111; --jp-layout-color2: #212121;
    --jp-layout-color3: #424242; --jp-ui-font-color0: #ffffff; --jp-ui-font-color1: rgba(255,255,255,.87);
    --jp-ui-font-color2: rgba(255,255,255,.54); --jp-border-color1: #616161; --jp-border-color2: #424242;
    --jp-brand-color1: #1976d2; --jp-error-color1: #f44336; --jp-success-color1: #4caf50;
    --jp-input-background: #212121; background: #111111; }` : "");
  document.head.append(style);
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const el = document.createElement("div");
  document.body.append(el);
  const handlers = {};
  const model = {get: (k) => state[k], set: (k, v) => { state[k] = v; }, save_changes: () => {}, send: () => {},
                 on: (ev, fn) => { (handlers[ev] = handlers[ev] || []).push(fn); }, off: () => {}};
  mod.default.render({model, el});
  await new Promise((r) => setTimeout(r, 100));
  const text = (sel) => [...el.querySelectorAll(sel)].map((e) => e.textContent);
  const before = text(".ap-bar-measured");
  state.measured = state.next_measured;  // a run measured: only the measured trait changes
  (handlers["change:measured"] || []).forEach((fn) => fn());
  await new Promise((r) => setTimeout(r, 100));
  el.querySelector(".ap-components").open = true;
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const over = (fg, bg) => fg.length === 4 ? fg.slice(0, 3).map((v, i) => v * fg[3] + bg[i] * (1 - fg[3])) : fg;
  const lum = (c) => { const [r, g, b] = c.slice(0, 3).map((v) => { v /= 255;
    return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const bg = (e) => { for (let x = e; x; x = x.parentElement) { const c = rgb(getComputedStyle(x).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3); } return [255, 255, 255]; };
  const contrast = (fg, e) => { const b = bg(e), a = lum(over(rgb(fg), b)), c = lum(b);
    return (Math.max(a, c) + 0.05) / (Math.min(a, c) + 0.05); };
  const low = [];
  for (const e of el.querySelectorAll(".ap-bar-measured, .ap-measured, .ap-ratio, .ap-measured-note, "
                                      + ".ap-components td, .ap-components th")) {
    const r = contrast(getComputedStyle(e).color, e);
    if (e.textContent.trim() && r < 4.5) low.push(`${e.className || e.tagName} "${e.textContent}": ${r.toFixed(2)}`);
  }
  const mark = el.querySelector(".ap-measured-mark");
  const markContrast = contrast(getComputedStyle(mark).borderLeftColor, mark.parentElement);
  return {before, bars: text(".ap-bar-measured"), marks: el.querySelectorAll(".ap-measured-mark").length,
          markLeft: mark.style.left, time: text(".ap-time-measured"), notes: text(".ap-measured-note"),
          rates: text(".ap-throughput-measured"), flagged: text(".ap-ratio-over, .ap-ratio-under"),
          rows: [...el.querySelectorAll(".ap-components tr")].map((tr) => [...tr.children].map((td) => td.textContent)),
          low, markContrast};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_measured_figures_render_beside_the_predicted_ones(seed_graph, tmp_path, dark):
    """planner.js in chromium with the widget's own traits (a stub model, no JupyterLab): when the measured trait
    arrives, each memory bar gets its measured value, ratio and a dashed mark, the step time its measured value
    and ratio, and the components table its measured rows; every such text reads at WCAG contrast >= 4.5 and the
    mark at >= 3, in the light theme and in JupyterLab's dark one."""
    import test_browser

    test_browser._require_chromium()
    s = Session(seed_graph, Cluster.preset("cpu", gpus_per_node=2), ModelSource("# test"))
    w = s.widget()
    state = {k: getattr(w, k) for k in w.keys if not k.startswith("_") and k not in ("layout", "panel")}
    state["panel"] = None
    run = cpu_run_of(s, tmp_path)
    w.follow(run)
    w._on_run(run)
    # a GPU run's components carry the allocator's peak reserve too (test_a_gpu_run_shows_the_allocators_reserve_...)
    reserve = {"measured": 250 * MIB, "predicted": 1000 * MIB, "ratio": 0.25}
    state["next_measured"] = {**w.measured, "components": {**w.measured["components"], "reserved": reserve}}
    state["measured"] = {}
    seen, errors = test_browser.evaluate_in_blank_page(MEASURED_PAGE, [w._esm, w._css, state, dark])
    assert not errors, errors
    m = w.measured
    assert seen["before"] == [] and seen["marks"] == 1
    b = m["bars"][0]  # the measured peak beside the prediction it is compared with (not the bar's, margin included)
    assert seen["bars"] == [f"measured peak (RSS above baseline) {fmt_bytes(200 * MIB)} ×{b['ratio']:.2f} of "
                            f"{fmt_bytes(b['predicted'])} predicted tensors (no margin), rank 0"]
    scale = max(w.memory["limit"], w.memory["peak"]) * 1.04
    assert float(seen["markLeft"].rstrip("%")) == pytest.approx(min(100, 100 * 200 * MIB / scale), abs=0.01)
    assert seen["time"] == [f"measured {fmt_time(0.3)} ×{m['time']['ratio']:.2f}"]
    assert any("run abcdef01 (" in n and "RSS above" in n for n in seen["notes"])
    tp = m["throughput"]
    assert seen["rates"] == [f"measured MFU {100 * tp['mfu']['measured']:.1f}% ×{tp['mfu']['ratio']:.2f}",
                             f"measured {fmt_count(tp['measured'])} samples/s ×{tp['ratio']:.2f}"]
    rows = {r[0]: r for r in seen["rows"]}
    assert rows["peak (rank 0)"][2] == f"{fmt_bytes(200 * MIB)} ×{m['components']['peak']['ratio']:.2f}"
    assert rows["between steps"][2].startswith(fmt_bytes(60 * MIB))
    assert rows["allocator reserve"][1:3] == [fmt_bytes(1000 * MIB), f"{fmt_bytes(250 * MIB)} ×0.25"]
    assert "default (not calibrated)" in rows["allocator margin"][3] and rows["parameters"][3].startswith("exact")
    assert not seen["low"], seen["low"]
    assert seen["markContrast"] >= 3, seen["markContrast"]


@pytest.mark.browser
def test_a_figure_is_flagged_only_where_the_run_would_raise_a_prediction_error(seed_graph, tmp_path, monkeypatch):
    """Issue 42, points 4-5: after every CPU run the widget showed the measured peak (RSS, which holds what torch
    allocates on first use) and the step time (an uncalibrated CPU estimate) in red at x3.9 and x7.8, and the
    dashboard its peak column in red, while the run raised no prediction_error: the run looked failed. A figure is
    now flagged by the rule of those events (launch/watch.py prediction_off), in the widget (blank-page chromium)
    and the dashboard's rows; beyond that rule it still is."""
    import test_browser

    test_browser._require_chromium()
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "none.json"))  # the defaults, whatever ran before
    s = Session(seed_graph, Cluster.preset("cpu", gpus_per_node=2), ModelSource("# test"))
    w = s.widget()
    state = {k: getattr(w, k) for k in w.keys if not k.startswith("_") and k not in ("layout", "panel")}
    state["panel"], state["measured"] = None, {}
    flagged = {}
    for peak in (100, 400):  # MiB above the baseline: within what a CPU rank holds beyond the plan, then past it
        run = cpu_run_of(s, tmp_path, peak=peak * MIB, run_id=f"run{peak:07d}")
        w.follow(run)
        w._on_run(run)
        m = w.measured
        assert m["bars"][0]["ratio"] > 1.3 and m["time"]["ratio"] > 10, m  # far above the predictions either way
        seen, errors = test_browser.evaluate_in_blank_page(MEASURED_PAGE, [w._esm, w._css,
                                                                          {**state, "next_measured": m}, False])
        assert not errors, errors
        rows = run.dashboard().ranks
        flagged[peak] = (seen["flagged"], [r["memory_off"] for r in rows], m["bars"][0]["off"], m["time"]["off"])
    assert flagged[100] == ([], [False, False], False, False), flagged  # the step time is not judged: uncalibrated
    bar, comp = m["bars"][0], m["components"]["peak"]
    assert flagged[400] == ([f"×{bar['ratio']:.2f}", f"×{comp['ratio']:.2f}"], [True, True], True, False), flagged


@pytest.mark.multiprocess
def test_a_launch_from_code_fills_the_widgets_measured_figures(tmp_path):
    """ap.launch() hands its run to the open widget: once the run finished, its measured peak per rank, what the
    ranks held between steps and the step time sit beside the plan's predictions."""
    from autopar_nb.capture import capture as capture_model

    src = ModelSource("import torch, torch.nn as nn\nmodel = nn.Sequential(nn.Linear(64, 512), nn.GELU(), "
                      "nn.Linear(512, 64))\nexample_inputs = (torch.randn(256, 64),)\n")
    model, inputs, _ = src.build(device="meta")
    s = Session(capture_model(model, inputs), Cluster.preset("cpu", gpus_per_node=2), src)
    w = s.widget()
    run = s.launch(2, 8, replan="off", run_dir=str(tmp_path / "run"), warm=False)
    assert run.wait(300) == "finished", run.message
    w._on_run(run)  # the run's last notification may have come before its end was recorded
    m = w.measured
    assert m["run"]["status"] == "finished" and m["run"]["steps"] == 8
    (bar,) = m["bars"]
    assert bar["measured"] > 0 and bar["ratio"] > 0 and bar["predicted"] == pytest.approx(
        s.plan.cost.memory_by_rank[0].total - s.plan.cost.memory_by_rank[0].margin)
    assert m["components"]["between steps"]["measured"] > 0
    # the memory timeline's measured line: each rank's peak, on the basis it compares with the predicted tensors
    assert {r for r, v in m["peaks"] if v > 0} == {0, 1} and m["peak_label"] == "measured peak (RSS above baseline)"
    assert [r["global_ranks"] for r in w.timeline["ranks"]] == [[0, 1]]
    assert m["time"]["compared"] and m["time"]["measured"] > 0 and m["throughput"]["measured"] > 0
    print(s.plan.explain(run).split("\n", 1)[0], "...", run.explain())
    # and the same run calibrates the CPU allocator margin (issue 21 point 5): its fixed part is what the ranks held
    # between steps beyond parameters, optimizer state and DDP's buckets (calibration.PERSISTENT_TERMS), so the
    # calibrated prediction meets the measured peak
    factors = run.calibrate(preset="cpu", save=False)
    held = max(f["between steps"]["measured"] for f in run.measured()["by_rank"].values())
    mb = s.plan.cost.memory_by_rank[0]
    kept = mb.params + mb.optimizer + (mb.terms or {}).get("ddp_buckets", 0.0)
    assert factors["margin_fixed_bytes"] == pytest.approx(held - kept, rel=1e-6)
    peak = max(f["peak"]["measured"] for f in run.measured()["by_rank"].values())
    state = mb.total - mb.margin
    assert state * (1 + factors["margin_fraction"]) + factors["margin_fixed_bytes"] == pytest.approx(peak, rel=1e-6)
    print("calibrated:", {k: v for k, v in factors.items() if k.startswith("margin")})


def test_python_text_scales_its_units_as_the_widget_does():
    """One figure, one way of writing it (issue 42): a plan's and a run's summary and the explanation write times and
    sizes with the widget's units, never '0.0 ms/step' or '0.01 GiB'."""
    from autopar_nb import plan, zoo
    from autopar_nb.units import fmt_delta

    graph = capture(zoo.SeedMLP(), torch.randn(32, 1024))
    p = plan(graph, Cluster.preset("h100-80gb", 1, 2))
    summary = p.summary()
    assert f"{fmt_time(p.cost.step_time_s)}/step, peak {fmt_bytes(p.cost.peak_memory_bytes)}" in summary
    assert "0.0 ms" not in summary and " 0.0" not in p.explain() and "0.00 GiB" not in summary
    assert fmt_delta(-40.4e-6) == "-40.4 µs" and fmt_delta(0.0123) == "+12.3 ms"


# ---- issue 42: what the page does, in a blank chromium page at 1400 x 1000 with JupyterLab's theme variables --------
# JupyterLab 4's own values (share/jupyter/lab/themes/@jupyterlab/theme-{light,dark}-extension/index.css)
JL_LIGHT = {"--jp-layout-color0": "#ffffff", "--jp-layout-color1": "#ffffff", "--jp-layout-color2": "#eeeeee",
            "--jp-layout-color3": "#bdbdbd", "--jp-border-color1": "#bdbdbd", "--jp-border-color2": "#e0e0e0",
            "--jp-ui-font-color0": "#000000", "--jp-ui-font-color1": "rgba(0,0,0,.87)",
            "--jp-ui-font-color2": "rgba(0,0,0,.54)", "--jp-brand-color1": "#1976d2", "--jp-error-color1": "#d32f2f",
            "--jp-success-color1": "#388e3c", "--jp-input-background": "#f5f5f5"}
JL_DARK = {"--jp-layout-color0": "#111111", "--jp-layout-color1": "#212121", "--jp-layout-color2": "#424242",
           "--jp-layout-color3": "#616161", "--jp-border-color1": "#616161", "--jp-border-color2": "#424242",
           "--jp-ui-font-color0": "#ffffff", "--jp-ui-font-color1": "rgba(255,255,255,.87)",
           "--jp-ui-font-color2": "rgba(255,255,255,.54)", "--jp-brand-color1": "#2196f3",
           "--jp-error-color1": "#f44336", "--jp-success-color1": "#4caf50", "--jp-input-background": "#424242"}

WIDGET_PAGE = """async ([esm, css, state, theme, late]) => {
  const style = document.createElement("style");
  style.textContent = css + " body { margin: 0; background: var(--jp-layout-color0); }";
  document.head.append(style);
  for (const [k, v] of Object.entries(theme)) document.body.style.setProperty(k, v);
  const mod = await import(URL.createObjectURL(new Blob([esm], {type: "text/javascript"})));
  const [above, el, below] = [0, 1, 2].map(() => document.createElement("div"));
  above.style.height = "300px";  // a cell above the widget's, and a long notebook below it: the page scrolls
  below.style.height = "2000px";
  document.body.append(above, ...(late ? [] : [el]), below);  // late: rendered first, then put in the page
  window.__sent = [];
  const handlers = {};
  const model = {get: (k) => state[k], set: (k, v) => { state[k] = v; }, save_changes: () => {},
                 send: (m) => window.__sent.push(m), off: () => {},
                 on: (ev, fn) => { (handlers[ev] = handlers[ev] || []).push(fn); }};
  // anywidget's host: a child widget (a run's dashboard, a verify's progress) renders as its reference
  const host = {getWidget: async (ref) => ({render: async (o) => { o.el.textContent = ref; }})};
  mod.default.render({model, el, host});
  if (late) { await new Promise((r) => setTimeout(r, 200)); above.after(el); }
  // the kernel's side: a trait set from Python and its change event
  window.__set = (k, v) => { state[k] = v; (handlers[`change:${k}`] || []).forEach((fn) => fn()); };
  await new Promise((r) => setTimeout(r, 200));
}"""


@contextlib.contextmanager
def widget_page(w, theme: dict, width: int | None = None, *, late: bool = False):
    """A chromium page (1400 x 1000, or ``width`` wide, no Jupyter) showing ``w``'s front end from its traits, the
    page themed with ``theme``'s JupyterLab variables; yields (page, errors). Messages the front end sends collect
    in __sent. ``late``: rendered into an element put in the page afterwards, as JupyterLab's output area does."""
    import test_browser
    from playwright.sync_api import sync_playwright

    test_browser._require_chromium()
    state = {k: getattr(w, k) for k in w.keys if not k.startswith("_") and k not in ("layout", "panel")}
    state = json.loads(json.dumps({**state, "panel": None}, default=str))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(test_browser.CHROMIUM), args=test_browser.CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={**test_browser.WINDOW, **({"width": width} if width else {})})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_content("<html><body></body></html>")
            page.evaluate(WIDGET_PAGE, [w._esm, w._css, state, theme, late])
            yield page, errors
        finally:
            browser.close()


# the memory bars' colours as drawn: the empty track, what is around it, its outline and each part's fill
MEMORY_BAR_COLOURS = """() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const bg = (e) => { for (let x = e; x; x = x.parentElement) { const c = rgb(getComputedStyle(x).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3); } return [255, 255, 255]; };
  const bar = document.querySelector(".ap-memory .ap-bar"), cs = getComputedStyle(bar);
  return {track: bg(bar), around: bg(bar.parentElement),
          outline: cs.borderTopWidth !== "0px" ? rgb(cs.borderTopColor).slice(0, 3) : null,
          parts: [...bar.querySelectorAll(".ap-seg")].map((s) => [s.style.background, s.getBoundingClientRect().width]),
          width: bar.getBoundingClientRect().width};
}"""


def _lum(c) -> float:
    lin = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in (v / 255 for v in c[:3])]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _ratio(a, b) -> float:
    hi, lo = sorted((_lum(a), _lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.browser
@pytest.mark.parametrize("theme", [JL_LIGHT, JL_DARK], ids=["light", "dark"])
def test_an_almost_empty_memory_bar_looks_empty(seed_graph, theme):
    """Issue 42, point 6: the bar's empty part was JupyterLab's --jp-layout-color3, the grey of the "margin" part
    (#bdbdbd against #bab0ac in the light theme), so a bar 1 % full looked full. The empty part is now the panel's
    own background inside an outline: it reads as empty, unlike every part's colour, in both themes."""
    w = _session(seed_graph).widget()  # 2 x H100 80 GiB: about 1 GiB a rank, 1.3 % full
    assert w.memory["peak"] / w.memory["limit"] < 0.02
    with widget_page(w, theme) as (page, errors):
        seen = page.evaluate(MEMORY_BAR_COLOURS)
    assert not errors, errors
    assert _ratio(seen["track"], seen["around"]) < 1.1, seen  # the empty part looks like the panel, not filled
    assert seen["outline"] and _ratio(seen["outline"], seen["around"]) >= 1.5, seen  # the bar's length still shows
    for colour, _ in seen["parts"]:
        assert _ratio([int(x) for x in re.findall(r"\d+", colour)[:3]], seen["track"]) >= 1.5, (colour, seen)
    filled = sum(width for _, width in seen["parts"])
    assert 0 < filled < 0.03 * seen["width"], seen


def test_launch_and_verify_buttons_on_another_process_count_say_so(seed_graph, monkeypatch):
    """Issue 42, point 7: Launch (or Verify) with a process count the plan was not made for runs the plan scaled to
    it (more or fewer data-parallel replicas). The Launch button used to say nothing of it (ap.launch printed its line
    from the widget's message handler, where no cell shows it). The widget's message now leads with one line: what
    was planned, what runs, what to do; the plan that runs keeps a cost for the dashboard's comparison."""
    import types

    from autopar_nb.launch import replan
    from autopar_nb.verify import job as verify_job

    launch_pkg = sys.modules["autopar_nb.launch"]  # the package: ``autopar_nb.launch`` is also the function
    started = []
    monkeypatch.setattr(launch_pkg, "launch", lambda make, nproc, steps, *, plan, **kw: started.append(plan)
                        or types.SimpleNamespace(plan=plan, nproc=nproc))
    monkeypatch.setattr(replan.Replanner, "attach", lambda self, run: None)
    monkeypatch.setattr(verify_job, "VerifyJob", lambda source, plan, **kw: started.append(plan)
                        or types.SimpleNamespace(view=lambda: None))
    s = _session(seed_graph)
    w = s.widget()
    assert s.plan.mesh.world_size == 2 and s.plan.mesh.dp == 2, s.plan.mesh
    w.run_options = {"nproc": 3, "verify_steps": 2, "launch_steps": 5}
    for name in ("launch", "verify"):
        w.handle({"kind": "action", "name": name})
        msg = w.messages[0]
        line = msg["text"].split("\n")[0]
        assert msg["level"] == "warning", msg
        assert line.startswith("The plan is for 2 processes; running it on 3: ") and "dp 2 -> 3" in line, line
        assert "nproc=2" in line and "ap.replan(cluster=Cluster.preset('h100-80gb', gpus_per_node=3))" in line, line
        assert f"ap.{name}(nproc=3" in msg["text"], msg
        assert started[-1].mesh.dp == 3 and started[-1].cost is not None and started[-1].cost.memory_by_rank
    w.run_options = {"nproc": 2, "verify_steps": 2, "launch_steps": 5}
    w.handle({"kind": "action", "name": "launch"})  # the plan's own count: nothing to say
    assert w.messages[0]["level"] == "info" and "running it on" not in w.messages[0]["text"]
    assert started[-1] is s.plan


def test_a_scaled_plan_keeps_a_cost_when_it_cannot_be_re_estimated(seed_graph, monkeypatch):
    """Issue 42, point 7: when the cost model cannot estimate the plan at the new count, the scaled plan keeps the
    plan's own figures (its line says so) rather than none: the dashboard said "the plan has no cost: nothing to
    compare"."""
    from autopar_nb import cost
    from autopar_nb.launch.compare import comparison

    s = _session(seed_graph)
    planned = s.current_plan()

    def refuse(*a, **kw):
        raise ValueError("the plan's layers do not match the graph's; re-plan for this model")

    monkeypatch.setattr(cost, "estimate", refuse)
    scaled = s.plan_for(3)
    assert scaled.mesh.dp == 3 and scaled.cost is not None
    assert scaled.cost.memory_by_rank == planned.cost.memory_by_rank  # one figure per pipeline stage: as it was
    assert scaled.cost.step_time_s == planned.cost.step_time_s
    assert "not re-estimated" in scaled.explanation[0] and "as planned for 2" in scaled.explanation[0]
    c = comparison(scaled, backend="gloo", nproc=3)
    assert not any("no cost" in n for n in c["notes"]) and all(c["predicted_memory"]), c
    # a per-rank list (mesh order pp, dp, tp) gets one figure per new rank: its stage's and TP position's
    from autopar_nb.notebook.scaling import per_rank_as_planned
    from autopar_nb.plan import Cost, MemoryBreakdown, MeshPlan

    per_rank = Cost(step_time_s=1.0, memory_by_rank=[MemoryBreakdown(params=float(r)) for r in range(8)])
    per_rank_as_planned(per_rank, MeshPlan(dp=2, tp=2, pp=2), 12)  # dp 2 -> 3
    assert [m.params for m in per_rank.memory_by_rank] == [0, 1] * 3 + [4, 5] * 3


@pytest.mark.browser
def test_clicking_a_graph_node_selects_without_scrolling_the_graph_away(seed_graph, llama_graph):
    """Issue 42, point 3: a click on a graph node selected its layer and scrolled the page (in JupyterLab, the
    notebook, ~670 px) to bring the table row into view, taking the graph off screen. The click selects, the page
    stays where it was, and the row is brought into view inside the table's own scroll box only."""
    from test_browser import WINDOW

    w = _session(seed_graph).widget()
    with widget_page(w, JL_LIGHT) as (page, errors):
        graph = page.locator(".ap-graph")
        graph.scroll_into_view_if_needed()
        node = page.locator('.ap-svg g.node[id="op-linear_1"]')
        before = page.evaluate("() => window.scrollY")
        row_top = page.locator('tr[data-layer="2"]').bounding_box()["y"]
        assert row_top > WINDOW["height"], "the row must start off screen for this test to mean much"
        node.click()
        page.wait_for_timeout(300)
        after = page.evaluate("() => window.scrollY")
        box = node.bounding_box()
        sent = page.evaluate("() => window.__sent")
        selected = page.locator('tr.ap-selected[data-layer="2"]').count()
    assert not errors, errors
    assert {"kind": "select", "layer": "2"} in sent and selected == 1, (sent, selected)
    assert after == before, f"the page scrolled {after - before} px"
    assert 0 <= box["y"] and box["y"] + box["height"] <= WINDOW["height"], box
    # a table taller than its box scrolls inside the box to show the row; the page still does not move
    with widget_page(_session(llama_graph).widget(), JL_LIGHT) as (page, errors):
        page.evaluate("() => { document.querySelector('.ap-table-wrap').style.maxHeight = '120px'; }")
        page.locator(".ap-graph").scroll_into_view_if_needed()
        before = page.evaluate("() => window.scrollY")
        page.locator(".ap-svg g.node", has_text="linear").last.click()
        page.wait_for_timeout(300)
        seen = page.evaluate("""() => { const wrap = document.querySelector('.ap-table-wrap'),
          row = wrap.querySelector('tr.ap-selected'), b = wrap.getBoundingClientRect(), r = row.getBoundingClientRect();
          return {y: window.scrollY, layer: row.dataset.layer, inside: r.top >= b.top && r.bottom <= b.bottom + 1,
                  scrolled: wrap.scrollTop, overflow: wrap.scrollHeight > wrap.clientHeight}; }""")
    assert not errors, errors
    assert seen["y"] == before and seen["layer"] == "output" and seen["overflow"], seen
    assert seen["inside"] and seen["scrolled"] > 0, seen


# where the messages sit: the element just before them, and whether the first one is on screen
MESSAGES_AT = """async () => { await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 50)));
  const m = document.querySelector('.ap-messages'), r = m.querySelector('.ap-msg').getBoundingClientRect();
  return {after: m.previousElementSibling.className, visible: r.top >= 0 && r.bottom <= innerHeight}; }"""


@pytest.mark.browser
def test_an_edits_answer_shows_beside_the_edit(seed_graph):
    """Issue 42, point 9: every message showed at the top of the widget, ~1000 px above the table, board or lane
    where the edit was made. The answer to an edit in Global choices, the sharding board, the lanes or the layer
    table now shows right below that section, on screen; one to an edit in the graph or header stays at the top."""
    w = _session(seed_graph).widget()
    said = {"level": "info", "text": "re-planned", "detail": ""}
    seen = {}
    with widget_page(w, JL_DARK) as (page, errors):
        page.locator('select.ap-strategy[data-layer="0"]').select_option("colwise")
        page.evaluate("(m) => window.__set('messages', [m])", said)
        seen["table"] = page.evaluate(MESSAGES_AT)
        page.locator('select.ap-global[data-key="zero_stage"]').select_option("3")
        page.evaluate("(m) => window.__set('messages', [{...m, level: 'error'}])", said)
        seen["controls"] = page.evaluate(MESSAGES_AT)
        page.locator(".ap-graph").scroll_into_view_if_needed()
        page.locator('.ap-svg g.node[id="op-linear_1"]').click()  # a selection: the graph's, at the top
        page.evaluate("(m) => window.__set('messages', [m])", said)
        seen["graph"] = page.evaluate(MESSAGES_AT)
        sent = [m["kind"] for m in page.evaluate("() => window.__sent")]
    assert not errors, errors
    assert sent == ["strategy", "global", "select"], sent
    assert seen["table"] == {"after": "ap-table-wrap", "visible": True}, seen
    assert seen["controls"] == {"after": "ap-controls", "visible": True}, seen
    assert seen["graph"]["after"] == "ap-header", seen


def test_verify_does_not_take_the_launch_dashboards_place(seed_graph, monkeypatch):
    """Issue 42, point 9: Verify's progress view replaced the live dashboard of a run still going (one ``panel``).
    The last Launch's dashboard and the last Verify's progress each keep a place below the planner."""
    import types

    import anywidget

    from autopar_nb.launch import replan
    from autopar_nb.verify import job as verify_job

    class View(anywidget.AnyWidget):
        _esm = "export default { render({ el }) { el.textContent = 'view'; } }"

    dashboard, progress = View(), View()
    launch_pkg = sys.modules["autopar_nb.launch"]
    monkeypatch.setattr(launch_pkg, "launch", lambda make, nproc, steps, *, plan, **kw: types.SimpleNamespace(
        plan=plan, dashboard=lambda: dashboard))
    monkeypatch.setattr(replan.Replanner, "attach", lambda self, run: None)
    monkeypatch.setattr(verify_job, "VerifyJob", lambda source, plan, **kw: types.SimpleNamespace(
        view=lambda: progress))
    w = _session(seed_graph).widget()
    w.handle({"kind": "action", "name": "launch"})
    assert w.panel is dashboard
    w.handle({"kind": "action", "name": "verify"})
    assert w.panel is dashboard and w.verify_panel is progress


@pytest.mark.browser
def test_the_dashboard_and_the_verify_view_both_show(seed_graph):
    """Issue 42, point 9, in chromium: a Verify's progress view shows below the Launch's dashboard, which stays; a
    Tournament's standings below both."""
    w = _session(seed_graph).widget()
    with widget_page(w, JL_LIGHT) as (page, errors):
        page.evaluate("() => window.__set('panel', 'anywidget:dashboard')")
        page.evaluate("() => window.__set('verify_panel', 'anywidget:verify')")
        page.evaluate("() => window.__set('tournament_panel', 'anywidget:tournament')")
        page.wait_for_timeout(200)
        shown = page.locator(".ap-run-panel").all_inner_texts()
    assert not errors, errors
    assert shown == ["anywidget:dashboard", "anywidget:verify", "anywidget:tournament"], shown


def test_a_stage_drag_says_which_other_layers_moved_and_why(gpt_graph):
    """Issue 42, point 10: dragging h.0 to stage 1 also moved h.1 to stage 2 (the planner re-balanced the stages'
    unpinned layers) and the message said nothing of it. It now names every other layer that changed stage and why:
    moved along to keep the stages contiguous (pinned), or re-balanced by the planner (not pinned)."""
    s = _session(gpt_graph, gpus=4, global_batch=32, fix={"pp": 2, "tp": 1})
    w = s.widget()
    before = {lp.path: lp.stage for lp in s.plan.layers}
    assert (before["h.0"], before["h.1"]) == (0, 1), before
    w.handle({"kind": "stage", "layer": "h.0", "stage": 1})
    after = {lp.path: lp.stage for lp in s.plan.layers}
    text = w.messages[0]["text"]
    assert after["h.0"] == 1 and after["h.1"] == 2, after
    assert "The planner also moved h.1 1 → 2 (stage)" in text and "not pinned" in text, text
    w.handle({"kind": "undo"})
    w.handle({"kind": "stage", "layer": "h.3", "stage": 1})  # h.2 comes along (pinned), ln_f is re-balanced
    text = w.messages[0]["text"]
    assert "Also moved with it, so each stage stays one run of layers: h.2 → stage 1 (pinned)" in text, text


@pytest.mark.browser
def test_dragging_a_graph_node_selects_no_text(seed_graph):
    """Issue 42, point 10: a drag that starts on a graph node (to drop it on a legend swatch) selected the text of
    every label it crossed. The graph is no text to select: the drag leaves no selection."""
    w = _session(seed_graph).widget()
    with widget_page(w, JL_LIGHT) as (page, errors):
        page.locator(".ap-graph").scroll_into_view_if_needed()
        box = page.locator('.ap-svg g.node[id="op-linear_1"]').bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x - 200, y - 150, steps=8)
        page.mouse.move(x + 150, y + 120, steps=8)
        page.mouse.up()
        selected = page.evaluate("() => window.getSelection().toString()")
    assert not errors, errors
    assert selected == "", f"the drag selected {selected!r}"


# the graph's colours as drawn: the paper, each layer box's fill, each box label's text and box, an edge's stroke
GRAPH_COLOURS = """() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number).slice(0, 3);
  const cs = (e) => getComputedStyle(e);
  const paper = rgb(cs(document.querySelector('.ap-viewport')).backgroundColor);
  const boxes = [...document.querySelectorAll('.ap-svg g.cluster > path, .ap-svg g.cluster > polygon')]
    .filter((p) => p.getAttribute('fill') !== 'none').map((p) => rgb(cs(p).fill));
  const labels = [...document.querySelectorAll('.ap-svg text.ap-clabel')].map((t) => {
    const bg = t.previousElementSibling; return [rgb(cs(t).fill), bg ? rgb(cs(bg).fill) : paper]; });
  const edges = [...document.querySelectorAll('.ap-svg g.edge path')].map((p) => rgb(cs(p).stroke));
  return {paper, boxes, labels, edges, panel: rgb(cs(document.querySelector('.ap-root')).backgroundColor)};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("theme", [JL_LIGHT, JL_DARK], ids=["light", "dark"])
@pytest.mark.parametrize("late", [False, True], ids=["in-page", "attached-after-render"])
def test_the_graph_paper_follows_the_theme(seed_graph, theme, late):
    """Issue 42, point 10: the graph canvas stayed white (a fixed light paper and pale layer boxes) in JupyterLab's
    dark theme. In the dark theme the paper and the layer boxes are dark like the panel; box labels and edges keep a
    readable contrast on them; the light theme keeps its light paper. Also when the widget is rendered before its
    element is in the page, as in JupyterLab (a notebook opened in the dark theme kept a light graph until an edit)."""
    w = _session(seed_graph).widget()
    with widget_page(w, theme, late=late) as (page, errors):
        page.wait_for_timeout(300)
        seen = page.evaluate(GRAPH_COLOURS)
    assert not errors, errors
    dark = theme is JL_DARK
    assert seen["boxes"] and seen["labels"] and seen["edges"], seen
    for area in [seen["paper"], *seen["boxes"]]:
        assert (_ratio(area, seen["panel"]) < 1.6) if dark else (_lum(area) > 0.8), (area, seen)
    for text, bg in seen["labels"]:
        assert _ratio(text, bg) >= 4.5, (text, bg, seen)
    for stroke in seen["edges"]:
        assert _ratio(stroke, seen["paper"]) >= 3, (stroke, seen)


@pytest.mark.browser
def test_a_theme_switch_redraws_the_graph_in_the_new_theme(seed_graph):
    """Issue 42, point 10: switching JupyterLab's theme (its body's data-jp-theme-* attributes and CSS variables
    change, the widget's state does not) kept the old graph colours until the next re-plan. The paper follows the
    switch, both ways, without a change to the widget's state."""
    w = _session(seed_graph).widget()
    switch = """([theme, light]) => { for (const [k, v] of Object.entries(theme)) document.body.style.setProperty(k, v);
      document.body.dataset.jpThemeLight = light; }"""
    with widget_page(w, JL_LIGHT) as (page, errors):
        before = page.evaluate(GRAPH_COLOURS)
        page.evaluate(switch, [JL_DARK, "false"])
        page.wait_for_timeout(800)
        dark = page.evaluate(GRAPH_COLOURS)
        page.evaluate(switch, [JL_LIGHT, "true"])
        page.wait_for_timeout(800)
        light = page.evaluate(GRAPH_COLOURS)
    assert not errors, errors
    assert _lum(before["paper"]) > 0.8 and _lum(light["paper"]) > 0.8, (before, light)
    assert _ratio(dark["paper"], dark["panel"]) < 1.6 and _lum(dark["paper"]) < 0.1, dark
    for text, bg in dark["labels"]:
        assert _ratio(text, bg) >= 4.5, (text, bg, dark)


@pytest.mark.browser
def test_hovering_a_module_box_shows_what_it_is(seed_graph, llama_graph):
    """Issue 42, point 10: hovering a layer's or module's box (not one of its nodes) showed nothing. It shows a
    tooltip with the module's path, type, split and memory."""
    w = _session(seed_graph).widget()
    with widget_page(w, JL_DARK) as (page, errors):
        page.locator(".ap-graph").scroll_into_view_if_needed()
        page.locator('.ap-svg text.ap-clabel[data-cluster="cl-0"]').first.hover()
        page.wait_for_timeout(100)
        tip = page.locator(".ap-tooltip")
        shown, text = tip.is_visible(), tip.inner_text()
        page.mouse.move(2, 2)
        page.wait_for_timeout(100)
        hidden = not tip.is_visible()
    assert not errors, errors
    assert shown, "no tooltip"
    for want in ("module\t0", "type\tLinear", "split\treplicated", "memory\tparams 4.00 MiB"):
        assert want in text, (want, text)
    assert hidden, "the tooltip stays after the pointer left"
    # a submodule's box inside a layer's (one module level deeper than the auto view)
    w = _session(llama_graph).widget()
    w.handle({"kind": "depth", "value": 2})
    with widget_page(w, JL_LIGHT) as (page, errors):
        page.locator(".ap-graph").scroll_into_view_if_needed()
        page.locator('.ap-svg text.ap-clabel[data-cluster="cl-layers.0.attention"]').first.hover()
        page.wait_for_timeout(100)
        text = page.locator(".ap-tooltip").inner_text()
    assert not errors, errors
    for want in ("module\tlayers.*.attention", "type\tLlamaAttention", "split\treplicated", "memory\tparams ",
                 "(each of 8 layers)", "layer\tlayers × 8"):
        assert want in text, (want, text)


@pytest.mark.browser
def test_a_drop_on_a_refused_lane_says_why_beside_the_lanes(seed_graph):
    """Issue 42, point 10: dropping a layer on a sharding lane that refuses it did nothing at all. The board's
    status line, right below the lanes, says the layer was not moved and why."""
    w = _session(seed_graph).widget()
    why = w.board["refused"]["0"]["fsdp"]
    with widget_page(w, JL_LIGHT) as (page, errors):
        lane = page.locator('.ap-slane[data-lane="fsdp"]')
        lane.scroll_into_view_if_needed()
        page.locator('.ap-schip[data-key="0"]').drag_to(lane)
        page.wait_for_timeout(200)
        status = page.locator(".ap-board-status").inner_text()
        sent = page.evaluate("() => window.__sent")
    assert not errors, errors
    assert not [m for m in sent if m.get("kind") == "shard"], sent
    assert "not moved" in status and "FSDP" in status and why in status, status


# the planner's layout as drawn: the graph column, the side column, what overlaps or spills, what clips a table
LAYOUT = """() => {
  const box = (e) => e.getBoundingClientRect();
  const q = (s) => document.querySelector(s);
  const root = box(q('.ap-root')), graph = box(q('.ap-graph')), side = q('.ap-side');
  const hit = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  const titles = [...document.querySelectorAll('.ap-side .ap-panel-title')].map(box);
  const buttons = [...document.querySelectorAll('.ap-toolbar .ap-btn, .ap-toolbar input')].map(box);
  const legend = q('.ap-legend');
  const lb = box(legend);
  const spill = [...legend.children].filter((x) => box(x).right > lb.right + 1 || box(x).left < lb.left - 1)
    .map((x) => x.textContent);
  // a table wider than what shows it: it must scroll inside its own box, not be cut by an ancestor
  const clipped = [];
  for (const t of document.querySelectorAll('.ap-root table')) {
    const tr = box(t);
    if (!tr.width) continue;
    let scrolls = null;
    for (let a = t.parentElement; a && a !== document.body && !scrolls; a = a.parentElement) {
      const cs = getComputedStyle(a);
      if (cs.overflowX === 'auto' || cs.overflowX === 'scroll') scrolls = box(a);
      else if (box(a).right < tr.right - 1 && cs.overflowX !== 'visible')
        clipped.push(t.parentElement.className + ' cut by ' + a.className);
    }
    if ((scrolls ? scrolls.right : tr.right) > root.right + 1) {
      clipped.push(t.parentElement.className + ' past the widget');
    }
  }
  const sideStyle = getComputedStyle(side);
  return {root: root.width, graph: graph.width, viewport: box(q('.ap-viewport')).width,
          overlaps: buttons.some((b) => titles.some((t) => hit(b, t))),
          toolbarOut: buttons.some((b) => b.right > graph.right + 1),
          spill, clipped, sideScrolls: side.scrollHeight > side.clientHeight + 1
            || ['auto', 'scroll'].includes(sideStyle.overflowY) && sideStyle.maxHeight !== 'none',
          pageOverflow: document.documentElement.scrollWidth > innerWidth + 1};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("width", [592, 700, 1400])
def test_the_layout_holds_in_a_narrow_notebook_column(llama_graph, width):
    """Issue 42, point 2: at 1024 px with JupyterLab's file browser open (a notebook column of about 700 px) the graph
    column shrank to 186 px with no graph, the search ↑/↓ buttons lay over the "Memory per rank" title, the legend
    spilled out, the side column scrolled on its own (and took the wheel), and tables were cut on the right. At 700
    and 1400 px: the graph keeps most of the width, nothing overlaps or spills, the side column does not scroll, and
    a table wider than its box scrolls inside it. 592 px is the widget's width in that JupyterLab window
    (test_browser's test_the_layout_holds_at_1024_px_with_the_file_browser_open)."""
    w = _session(llama_graph).widget()
    with widget_page(w, JL_LIGHT, width=width) as (page, errors):
        seen = page.evaluate(LAYOUT)
    assert not errors, errors
    assert seen["graph"] >= (0.6 if width < 900 else 0.55) * seen["root"], seen
    assert not seen["overlaps"] and not seen["toolbarOut"], seen
    assert not seen["spill"], seen
    assert not seen["sideScrolls"], seen
    assert not seen["clipped"] and not seen["pageOverflow"], seen


@pytest.mark.browser
def test_fit_at_a_narrow_width_fits_again_when_the_window_grows(llama_graph):
    """Issue 42, point 2: after "fit" in a narrow column the graph stayed at that small size when the window grew
    again. Until the user pans or zooms, a fitted graph is fitted again to the new width."""
    w = _session(llama_graph).widget()
    with widget_page(w, JL_LIGHT, width=700) as (page, errors):
        page.locator(".ap-fit").click()
        page.wait_for_timeout(150)
        narrow = page.evaluate("() => document.querySelector('.ap-svg').getBoundingClientRect().width")
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.wait_for_timeout(400)
        wide = page.evaluate("""() => ({svg: document.querySelector('.ap-svg').getBoundingClientRect().width,
          vp: document.querySelector('.ap-viewport').getBoundingClientRect().width})""")
    assert not errors, errors
    assert wide["svg"] > 1.3 * narrow or wide["svg"] > 0.8 * wide["vp"], (narrow, wide)


# every (edge, text) pair where the edge's path runs through the text's box and is painted above it
EDGES_OVER_TEXT = """() => {
  const svg = document.querySelector('.ap-svg svg');
  const texts = [...svg.querySelectorAll('g.node text, .ap-cluster-labels text')].map((t) => [t, t.getBBox()]);
  const over = [];
  let crossings = 0;
  for (const e of svg.querySelectorAll('g.edge')) {
    const p = e.querySelector('path');
    const pts = [];
    for (let s = 0, n = p.getTotalLength(); s <= n; s += 1) pts.push(p.getPointAtLength(s));
    for (const [t, b] of texts) {
      if (!pts.some((q) => q.x > b.x + 1 && q.x < b.x + b.width - 1 && q.y > b.y + 1 && q.y < b.y + b.height - 1)) {
        continue;
      }
      crossings += 1;
      if (t.compareDocumentPosition(e) & Node.DOCUMENT_POSITION_FOLLOWING) over.push([e.id, t.textContent]);
    }
  }
  return {edges: svg.querySelectorAll('g.edge').length, crossings, over};
}"""


def test_edges_into_a_cluster_end_at_its_border_rather_than_cross_its_label(resnet_graph, llama_graph):
    """Issue 42, edges through cluster labels: dot routes the edge into a cluster's first node straight through the
    label above it (ResNet-34 at depth 3: 24 label lines crossed). An edge whose end is the node under the label now
    ends at the cluster's outline (graphviz's compound/lhead, after the layout): the same node boxes, the same size,
    so the automatic view folds nothing more. Edges that run on to a deeper node (a residual's skip) stay whole."""
    from autopar_nb.widget.entries import ended_at_clusters, entries, label_crossings

    for graph, gpus in ((resnet_graph, 8), (llama_graph, 2)):
        plan = _session(graph, gpus=gpus).plan
        for depth in (0, 3):
            dot = layout(graph, plan, depth=depth).dot
            plain = render_svg(dot)
            ended = render_svg(ended_at_clusters(dot, plain))
            assert svg_size(ended) == svg_size(plain) and svg_boxes(ended) == svg_boxes(plain)
            assert label_crossings(plain) and not label_crossings(ended), (depth, label_crossings(ended))
    w = _session(resnet_graph, gpus=8).widget()
    auto = w.view
    assert auto["depth"] == 0 and auto["columns"] == 3, auto  # the automatic view shows what it did: layer1-4 folded
    w.handle({"kind": "depth", "value": 3})
    left = label_crossings(w.svg)
    print("\nResNet-34 at depth 3 in the widget: label lines crossed", len(left), sorted({t for t, _, _ in left}))
    assert not entries(w.svg) and not left, left  # was 24, then 5 (skips), with labels_moved_down 0


def test_a_skip_edge_through_a_label_moves_the_label_to_the_bottom_not_wider(resnet_graph):
    """Issue 42, edges through cluster labels, what ending edges at a border left: a residual's skip runs into the
    cluster past the node under the label, through the label (ResNet-34 at depth 3: 4 label lines of layer1 and
    layer3, counted within each cluster's outline as the label layer draws them). Those clusters' labels go to the
    bottom of their box (labelloc=b) and the edges leaving from the last rank end at the border: no label line is
    crossed, every node and cluster keeps its width (the graph's width is the same), dot makes it 8 % taller."""
    from autopar_nb.widget.entries import ended_at_clusters, label_crossings, labels_moved_down, remaining

    s = _session(resnet_graph, gpus=8)
    w = s.widget()
    w.handle({"kind": "depth", "value": 3})
    v = w._view
    dot = layout(resnet_graph, s.plan, depth=v.depth, groups=v.groups, breaks=v.breaks).dot
    plain = render_svg(dot)
    ended = render_svg(ended_at_clusters(dot, plain))
    moved = labels_moved_down(dot, plain)
    assert moved is not None and moved.count("labelloc=b") == 2, moved.count("labelloc=b")  # layer1, layer3
    below = render_svg(moved)
    after = render_svg(ended_at_clusters(moved, below))
    print("\nlabel lines crossed: plain", len(label_crossings(plain)), "ended", len(label_crossings(ended)),
          "moved and ended", len(label_crossings(after)), "size", svg_size(plain), "->", svg_size(after))
    assert remaining(plain) == len(label_crossings(ended)) == 4 and remaining(below) == 0
    assert label_crossings(after) == [] and w.svg == after
    assert svg_size(after)[0] == svg_size(plain)[0] and svg_size(after)[1] <= 1.1 * svg_size(plain)[1]
    widths = {k: b[2] - b[0] for k, b in svg_boxes(plain).items()}
    assert {k: b[2] - b[0] for k, b in svg_boxes(after).items()} == pytest.approx(widths)


@pytest.mark.browser
def test_no_edge_is_drawn_over_a_label(resnet_graph):
    """Issue 42, point 10 (edges through labels), measured where dot does route edges across labels: ResNet-34 at
    depth 3 (16 crossings, 13 of them cluster labels, before an edge into a cluster ended at its border; now 3, the
    nodes a downsample branch's edge passes). Each label is painted above every edge that crosses it: the cluster
    labels by the front end's label layer, the nodes by graphviz's own order (those edges come before the node)."""
    s = _session(resnet_graph, gpus=8)
    w = s.widget()
    w.handle({"kind": "depth", "value": 3})
    with widget_page(w, JL_LIGHT) as (page, errors):
        seen = page.evaluate(EDGES_OVER_TEXT)
    assert not errors, errors
    print("\nResNet-34 at depth 3:", seen)
    assert seen["edges"] > 50 and seen["crossings"] > 0, seen  # a layout where dot does cross labels
    assert not seen["over"], seen
