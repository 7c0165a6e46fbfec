"""Planner and runtime agree: every plan the planner proposes on the ``cpu`` preset runs, and runs right.

For each zoo model (GPT with nanoGPT's fused QKV and learned positions, Llama, the seed MLP, ResNet with BatchNorm,
RecSys) the planner is asked for a plan under several fixes (tp=2; dp=2 with ZeRO 0/2/3; pp=2; and dp=2 x tp=2 on
4 processes), and every plan goes through :func:`autopar_nb.verify.verify_many` against a single-process reference.
All 2-process plans share one launch of processes, the 4-process ones a second (spawning costs seconds).
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import GPT_CELL, LLAMA_CELL, RECSYS_CELL, RESNET_CELL

import autopar_nb as ap
from autopar_nb.plan import PlanError
from autopar_nb.source import ModelSource
from autopar_nb.verify import verify_many

MLP_CELL = """\
import torch
from autopar_nb.zoo import SeedMLP

model = SeedMLP(d_in=32, d_hidden=64, d_out=16)
example_inputs = (torch.randn(8, 32),)
"""

MODELS = {"gpt": GPT_CELL, "llama": LLAMA_CELL, "mlp": MLP_CELL, "resnet": RESNET_CELL, "recsys": RECSYS_CELL}
FIXES = {
    "tp2": {"tp": 2},
    "dp2_zero0": {"dp": 2, "zero_stage": 0},
    "dp2_zero2": {"dp": 2, "zero_stage": 2},
    "dp2_zero3": {"dp": 2, "zero_stage": 3},
    "pp2": {"pp": 2},
}
FOUR = {("llama", "dp2_tp2"): {"dp": 2, "tp": 2}, ("gpt", "pp2"): {"pp": 2}}
# plans the planner must refuse on these models, and why
REFUSED = {("resnet", "tp2"): "no Linear/Embedding that TP can split",
           ("recsys", "pp2"): "non-contiguous view made in layer"}  # sparse[:, i] crosses a stage boundary
STEPS = 3


def _plan(name: str, fix: dict, nproc: int):
    src = ModelSource(MODELS[name])
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=nproc), global_batch=graph.batch_size, fix=fix)
    return src, plan


@pytest.fixture(scope="module")
def reports():
    torch.set_num_threads(1)
    out = {}
    for nproc, cases in ((2, {(m, f): fix for m in MODELS for f, fix in FIXES.items()
                              if (m, f) not in REFUSED}), (4, FOUR)):
        planned = {key: _plan(key[0], fix, nproc) for key, fix in cases.items()}
        out.update(zip(planned, zip(planned.values(), verify_many(list(planned.values()), steps=STEPS),
                                    strict=True), strict=True))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("key", [*((m, f) for m in MODELS for f in FIXES if (m, f) not in REFUSED), *FOUR],
                         ids=lambda k: "-".join(k))
def test_planned_plan_runs(reports, key):
    (_, plan), report = reports[key]
    print(plan.summary())
    print(report)
    assert report.ok, f"{plan.summary()}: {report}"
    assert len(report.steps) == STEPS
    fix = FIXES.get(key[1]) or FOUR[key]
    for k, v in fix.items():
        assert getattr(plan.mesh, k) == v


@pytest.mark.multiprocess
def test_planned_plans_are_runnable_shapes(reports):
    """The plans under test exercise what they should: fused QKV kept replicated, no SP with learned positions,
    no ZeRO-1 for dp x tp, CPU SyncBatchNorm for ResNet under dp."""
    (_, gpt), _ = reports[("gpt", "tp2")]
    assert "h.0.attn.c_attn" not in gpt.tp_plan and "wpe" not in gpt.tp_plan
    assert gpt.tp_plan["h.0.mlp.c_fc"] == "colwise" and not any(lp.sequence_parallel for lp in gpt.layers)
    (_, llama), _ = reports[("llama", "tp2")]
    assert llama.tp_plan["layers.0.attention.wq"] == "colwise" and llama.layer("layers.0").sequence_parallel
    (_, dp_tp), _ = reports[("llama", "dp2_tp2")]
    assert dp_tp.mesh.zero_stage != 1  # ZeroRedundancyOptimizer takes no DTensors
    (_, resnet), report = reports[("resnet", "dp2_zero0")]
    assert resnet.sync_batchnorm
    # CPUSyncBatchNorm matches single-process BatchNorm over the global batch
    assert report.max_loss_rel <= 1e-5 and report.max_grad_rel <= 1e-5


@pytest.mark.parametrize("key", list(REFUSED), ids=lambda k: "-".join(k))
def test_planner_refuses_what_cannot_run(key):
    with pytest.raises(PlanError, match=REFUSED[key]):
        _plan(key[0], FIXES[key[1]], 2)


@pytest.mark.multiprocess
def test_exported_script_syncs_batchnorm_on_cpu(reports, tmp_path):
    """The exported script of the planned ResNet dp=2 plan (sync_batchnorm on CPU) trains like verify's run."""
    from test_export import MetricsServer, losses_of, torchrun

    from autopar_nb.export import export

    (src, plan), report = reports[("resnet", "dp2_zero0")]
    script = export(src, plan, tmp_path / "train_resnet.py", steps=STEPS, quiet=True).script
    text = script.read_text()
    assert "apply_sync_batchnorm(net" in text and "class CPUSyncBatchNorm" in text
    server = MetricsServer()
    torchrun(script, server=server)
    assert losses_of(server) == pytest.approx(report.losses, rel=1e-6, abs=0)
