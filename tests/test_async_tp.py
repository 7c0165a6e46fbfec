"""Async tensor parallelism as a plan choice (``plan.async_tp``): Inductor's micro-pipelined TP on CUDA symmetric
memory, costed as the TP all-gathers and reduce-scatters hidden behind the matmuls (cost/async_tp.py), chosen by the
planner on CUDA presets with compiled blocks and tp > 1, refused with its reason elsewhere, and applied by the
exported script before the blocks are compiled. No CUDA here: the runtime path is checked as text only."""

from __future__ import annotations

import dataclasses

import pytest
from IPython.core.error import UsageError
from runtime_cases import LLAMA_CELL, llama_tp, make_plan, source
from test_magic import SEED_CELL

from autopar_nb.cost.async_tp import async_tp_exposed
from autopar_nb.export.values import script_values
from autopar_nb.plan import Plan, PlanError, normalize_fix


def _plan(graph, preset: str = "h100-80gb", **fix):
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster

    cluster = Cluster.preset(preset, gpus_per_node=2 if preset == "cpu" else 8)
    return ap.plan(graph, cluster, **({} if preset == "cpu" else {"global_batch": 8}), fix=fix)


def test_only_all_gathers_and_reduce_scatters_hide_behind_the_matmuls():
    comm = {"all_gather": 3.0, "reduce_scatter": 2.0, "all_reduce": 1.0}
    assert async_tp_exposed(comm, overlap=0.0, matmul_s=0.0) == 6.0, "no matmul time: as without async TP"
    assert async_tp_exposed(comm, overlap=0.0, matmul_s=4.0) == 2.0, "hidden up to the matmuls' time"
    assert async_tp_exposed(comm, overlap=0.0, matmul_s=10.0) == 1.0, "the all-reduce is not pipelined"


def test_the_planner_takes_async_tp_on_h100_with_compile_and_tp(llama_8b):
    plan = _plan(llama_8b, compile=True, tp=4)
    assert plan.async_tp and "async-tp" in plan.summary()
    line = next(ln for ln in plan.explanation if ln.startswith("Async TP chosen"))
    assert "micro-pipelined TP over symmetric memory" in line and "of TP collectives hidden" in line
    assert line in plan.explain().splitlines()
    assert Plan.from_json(plan.to_json()).async_tp
    auto = _plan(llama_8b, compile=True, float8="none")
    assert auto.async_tp and auto.mesh.tp == 4, "the search ranks the splits with async TP (tp=2 without it)"
    assert any(a.async_tp for a in auto.alternatives)
    fixed = _plan(llama_8b, compile=True, tp=4, async_tp=True)
    assert fixed.async_tp and any(ln.startswith("Async TP (fix async_tp)") for ln in fixed.explanation)
    assert fixed.cost.step_time_s == pytest.approx(plan.cost.step_time_s)


@pytest.mark.parametrize("preset, fix, why", [
    ("h100-80gb", {"compile": False, "tp": 8}, "needs torch.compile"),
    ("h100-80gb", {"compile": True, "tp": 1}, "needs tp > 1"),
    ("cpu", {"tp": 2}, "symmetric memory needs CUDA"),
])
def test_where_async_tp_cannot_run_the_planner_says_why(llama_8b, small_llama, preset, fix, why):
    graph = small_llama if preset == "cpu" else llama_8b
    plan = _plan(graph, preset, **fix)
    assert not plan.async_tp
    assert any(ln.startswith("Async TP not offered: it " + why) for ln in plan.explanation), plan.explanation
    with pytest.raises(PlanError, match="fix async_tp=true: async TP " + why):
        _plan(graph, preset, async_tp=True, **fix)


def test_the_plan_refuses_async_tp_without_tp_or_compile():
    assert normalize_fix({"async_tp": True}) == {"async_tp": True}
    plan = make_plan(source(LLAMA_CELL), tp=2, tp_styles=llama_tp(), sp=True, amp="bf16")
    with pytest.raises(PlanError, match="0 compiled layers, tp=2"):
        dataclasses.replace(plan, async_tp=True)
    with pytest.raises(PlanError, match="cluster 'cpu'"):
        dataclasses.replace(plan, async_tp=True, cluster={"preset": "cpu", "nodes": 1, "gpus_per_node": 2},
                            layers=[dataclasses.replace(lp, compile=True) for lp in plan.layers])


def test_the_script_turns_async_tp_on_before_compiling(tmp_path):
    from autopar_nb.export import export

    src = source(LLAMA_CELL)
    plan = make_plan(src, tp=2, tp_styles=llama_tp(), amp="bf16")
    plan = dataclasses.replace(plan, async_tp=True, layers=[dataclasses.replace(lp, compile=lp.path.startswith(
        "layers.")) for lp in plan.layers])
    assert script_values(src, plan).async_tp
    text = export(src, plan, tmp_path / "train.py", quiet=True, single_file=True).script.read_text()
    compile(text, "train.py", "exec")
    assert "def apply_async_tp(tp_mesh: DeviceMesh)" in text and "_micro_pipeline_tp = True" in text
    assert text.index('apply_async_tp(mesh["tp"])') < text.index("apply_compile(part, COMPILE)")
    plain = export(src, dataclasses.replace(plan, async_tp=False), tmp_path / "plain.py", quiet=True,
                   single_file=True).script.read_text()
    assert "async_tp" not in plain


def test_fix_async_tp_on_cpu_is_one_clear_line(ip):
    with pytest.raises(UsageError, match="symmetric memory needs CUDA") as err:
        ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --fix async_tp=true", SEED_CELL)
    assert "\n" not in str(err.value)


def test_the_comm_breakdown_sums_to_the_exposed_time_with_async_tp(llama_8b):
    plan = _plan(llama_8b, compile=True, tp=4, async_tp=True)
    off = _plan(llama_8b, compile=True, tp=4, async_tp=False)
    c, o = plan.cost, off.cost
    assert sum(c.comm_exposed_by_kind.values()) == pytest.approx(c.comm_exposed_s)
    assert c.comm_by_kind == pytest.approx(o.comm_by_kind), "the same collectives run"
    hidden = o.comm_exposed_s - c.comm_exposed_s
    assert hidden > 0 and o.step_time_s - c.step_time_s == pytest.approx(hidden)
    assert c.comm_exposed_by_kind["all_gather"] < o.comm_exposed_by_kind["all_gather"]
