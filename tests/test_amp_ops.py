"""The plan's AMP op lists (issue 18 point 3, seed §4.3 custom white/black lists): ops kept in float32 and ops run in
low precision beyond autocast's own lists, checked in the plan, applied by runtime/amp.py's OpPrecision, written into
the exported script and verified against the single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from runtime_cases import make_plan

from autopar_nb.cell import parse_fix
from autopar_nb.export import render_script
from autopar_nb.plan import Plan, PlanError, PrecisionPlan, normalize_fix
from autopar_nb.runtime.amp import OpPrecision, step_context
from autopar_nb.source import ModelSource

MLP_CELL = """\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
example_inputs = (torch.randn(8, 16),)
"""


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(8, 16)


def test_fp32_ops_run_in_float32_under_autocast():
    model, x = mlp()
    exact = model(x)
    with step_context("cpu", amp_dtype=torch.bfloat16):
        low = model(x)
    with step_context("cpu", amp_dtype=torch.bfloat16, op_lists=lambda: OpPrecision("cpu", torch.bfloat16,
                                                                                 fp32_ops=["linear"])):
        kept = model(x)
    assert low.dtype == torch.bfloat16 and (low.float() - exact).abs().max() > 1e-4  # autocast's own: bf16 matmuls
    assert kept.dtype == torch.float32 and torch.equal(kept, exact)
    kept.sum().backward()
    assert model[0].weight.grad.dtype == torch.float32


def test_low_precision_ops_by_torch_and_paddle_names():
    x = torch.randn(4, 8)
    with step_context("cpu", amp_dtype=torch.bfloat16):
        assert (x + x).dtype == torch.float32  # autocast leaves adds alone
        assert F.softmax(x, -1).dtype == torch.float32  # and softmax (on CPU: in its input's dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16), OpPrecision("cpu", torch.bfloat16,
                                                                   low_precision_ops=["elementwise_add", "softmax"]):
        assert (x + x).dtype == torch.bfloat16 and torch.add(x, x).dtype == torch.bfloat16
        assert F.softmax(x, -1).dtype == x.softmax(-1).dtype == torch.bfloat16
        assert (x * x).dtype == torch.float32  # not named


def test_plan_checks_the_lists():
    p = PrecisionPlan(amp="bf16", fp32_ops=["softmax", "layer_norm"], low_precision_ops=["matmul", "elementwise_add"])
    with pytest.raises(PlanError, match=r"precision.fp32_ops\[...\]='softmx' is not supported; choose one of"):
        PrecisionPlan(amp="bf16", fp32_ops=["softmx"])
    with pytest.raises(PlanError, match="needs mixed precision"):
        PrecisionPlan(fp32_ops=["softmax"])
    with pytest.raises(PlanError, match="both name softmax"):
        PrecisionPlan(amp="fp16", fp32_ops=["softmax"], low_precision_ops=["softmax"])
    with pytest.raises(PlanError, match="must be a list of op names"):
        PrecisionPlan(amp="bf16", fp32_ops="softmax")
    src = ModelSource(MLP_CELL)
    plan = make_plan(src, dp=2, amp="bf16")
    plan.precision = p
    assert Plan.from_json(plan.to_json()).precision == p
    assert normalize_fix(parse_fix("amp=bf16,fp32_ops=softmax+layer_norm")) == {
        "amp": "bf16", "fp32_ops": ["softmax", "layer_norm"]}
    with pytest.raises(PlanError, match=r"fix\['low_precision_ops'\]\[...\]='mat' is not supported"):
        normalize_fix({"low_precision_ops": ["mat"]})


def test_planner_takes_the_lists_from_fix():
    import autopar_nb as ap

    src = ModelSource(MLP_CELL)
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), fix={"amp": "bf16", "fp32_ops": ["linear"]})
    assert plan.precision.fp32_ops == ["linear"]
    with pytest.raises(PlanError, match="needs mixed precision"):
        ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), fix={"amp": "none", "fp32_ops": ["linear"]})


def amp_plans():
    src = ModelSource(MLP_CELL)
    out = {}
    for name, kw in {"dp2": {"dp": 2}, "tp2": {"tp": 2, "tp_styles": {"0": "colwise", "2": "rowwise"}}}.items():
        plan = make_plan(src, amp="bf16", **kw)
        plan.precision = PrecisionPlan(amp="bf16", fp32_ops=["linear"], low_precision_ops=["relu"])
        out[name] = plan
    return src, out


def test_script_carries_the_lists():
    src, plans = amp_plans()
    text = render_script(src, plans["dp2"])
    assert 'FP32_OPS = ["linear"]  # plan.precision.fp32_ops' in text
    assert 'LOW_PRECISION_OPS = ["relu"]' in text
    assert ("op_lists = functools.partial(OpPrecision, device, AMP_DTYPE, fp32_ops=FP32_OPS, "
            "low_precision_ops=LOW_PRECISION_OPS)") in " ".join(text.split())
    assert "op_lists=op_lists" in text and "class OpPrecision(TorchFunctionMode)" in text
    assert "class OpPrecision" not in render_script(src, make_plan(src, dp=2, amp="bf16"))  # only with lists


def test_verify_applies_the_lists_on_every_rank():
    """bf16 autocast with every matmul kept in float32: the parallel runs (DDP, TP with DTensor weights) equal the
    single-process reference to float32's tolerance, which they would not if either side ignored the list."""
    from autopar_nb.verify import FP32_RTOL, verify_many

    src, plans = amp_plans()
    for name, report in zip(plans, verify_many([(src, p) for p in plans.values()], steps=3, nproc=2,
                                               rtol=FP32_RTOL), strict=True):
        assert report.ok, f"{name}\n{report}"
