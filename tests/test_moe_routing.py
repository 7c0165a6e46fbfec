"""Routing under expert parallelism, two questions apart: is every term right given the routing that really
happened (the measured rows each rank's experts received, ``estimate(routed=...)``), and what the planner assumes
about routing it cannot know (``mesh.moe_capacity``: the busiest rank's rows, a published capacity factor)."""

from __future__ import annotations

import pytest
from memcells import CELLS

import autopar_nb as ap
from autopar_nb.source import ModelSource

SIZE = {"hidden": 128, "layers": 4, "seq": 128, "batch": 4}
"""test_compositions' sizes: the tiny Mixtral (4 experts, top-2) its composition cases use"""
EP_DP = {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 0, "ep": 4, "micro_batches": 1, "amp": "none", "recompute": "none"}


@pytest.fixture(scope="module")
def mixtral():
    src = ModelSource(CELLS["Mixtral"](**SIZE))
    meta, example, _ = src.build(device="meta")
    return src, ap.capture(meta, example)


def _plan(graph, fix: dict):
    cluster = ap.Cluster.preset("cpu", 1, fix["dp"])
    return cluster, ap.plan(graph, cluster, global_batch=SIZE["batch"] * fix["dp"], fix=fix)


def test_default_capacity_is_switch_transformers_and_the_busiest_rank_grows_with_it(mixtral):
    """The planner costs every rank's experts for the busiest one: moe_capacity times the rows balanced routing
    sends them, 1.25 by default (Switch Transformer's capacity factor), pinnable with fix, and said in the
    explanation. The predicted peak grows with it; without expert parallelism it changes nothing."""
    from autopar_nb.cost.setting import Setting
    from autopar_nb.plan import Plan, PlanError, normalize_fix
    from autopar_nb.plan.vocab import MOE_CAPACITY

    _, graph = mixtral
    assert MOE_CAPACITY == 1.25 and Setting().moe_capacity == MOE_CAPACITY
    _, plan = _plan(graph, EP_DP)
    assert plan.mesh.moe_capacity == MOE_CAPACITY
    assert any("capacity factor 1.25" in line for line in plan.explanation), plan.explanation
    assert Plan.from_json(plan.to_json()).mesh.moe_capacity == MOE_CAPACITY
    peaks = [_plan(graph, {**EP_DP, "moe_capacity": c})[1].cost.peak_memory_bytes for c in (1.0, 1.25, 1.5)]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    assert peaks[1] == plan.cost.peak_memory_bytes
    dense = {**EP_DP, "ep": 1}
    assert (_plan(graph, {**dense, "moe_capacity": 1.0})[1].cost.peak_memory_bytes
            == _plan(graph, {**dense, "moe_capacity": 2.0})[1].cost.peak_memory_bytes)
    with pytest.raises(PlanError, match="moe_capacity"):
        normalize_fix({"moe_capacity": 0.5})
    # --fix moe_capacity=1.5 arrives as text; a whole number as an int
    from autopar_nb.notebook.cell import parse_fix
    from autopar_nb.notebook.magic import _typed_fix

    assert normalize_fix(_typed_fix(parse_fix("ep=4,moe_capacity=1.5"))) == {"ep": 4, "moe_capacity": 1.5}
    assert normalize_fix(_typed_fix(parse_fix("moe_capacity=2"))) == {"moe_capacity": 2.0}


def test_measured_routing_is_costed_layer_by_layer(mixtral):
    """``estimate(routed=...)``: each layer's experts at its own measured rows (a rank's census, as
    verify.measure.routed_rows averages it over the step's calls), not the first of a run of identical blocks."""
    from autopar_nb.cost.estimate import estimate
    from autopar_nb.verify.measure import routed_rows

    _, graph = mixtral
    cluster, plan = _plan(graph, EP_DP)
    paths = [lay.path for lay in graph.layers]
    blocks = [p for p in paths if p.startswith("model.layers.")]
    census = [[f"DistributedDataParallel.module.{blocks[1]}.mlp.experts", 1536, 1024],
              [f"DistributedDataParallel.module.{blocks[1]}._checkpoint_wrapped_module.mlp.experts", 1536, 1024]]
    assert routed_rows(census, paths) == {blocks[1]: 1.5}

    def peak(routed):
        return estimate(graph, cluster, plan, routed=routed).memory_by_rank[0].total

    balanced = peak(dict.fromkeys(paths, 1.0))
    one = peak({**dict.fromkeys(paths, 1.0), blocks[-1]: 1.5})
    assert balanced < one < peak({**dict.fromkeys(paths, 1.0), **dict.fromkeys(blocks, 1.5)})
    assert peak({}) == balanced  # a layer the census lacks: balanced


@pytest.mark.multiprocess
def test_ep_dp_predicted_per_rank_from_its_measured_routing(mixtral):
    """EP x DP on 4 gloo processes: every rank's experts receive what the router sends them (0.6 to 1.3 times the
    balanced rows on this model), so the ranks' peaks differ; predicted with each rank's measured rows, each rank's
    total is within 5 %."""
    from autopar_nb.cost.estimate import estimate
    from autopar_nb.verify.measure import measure, routed_rows

    src, graph = mixtral
    cluster, plan = _plan(graph, EP_DP)
    paths = [lay.path for lay in graph.layers]
    got = measure(src, plan, ranks=(0, 1, 2, 3))
    errors = {}
    for m in got:
        routed = routed_rows(m["routed"], paths)
        assert len(routed) == sum(p.startswith("model.layers.") for p in paths), m["routed"]
        mb = estimate(graph, cluster, plan, routed=routed).memory_by_rank[0]
        errors[m["rank"]] = ((mb.total - mb.margin) / m["peak"]["total"] - 1, routed)
    assert all(abs(e) <= 0.05 for e, _ in errors.values()), errors
