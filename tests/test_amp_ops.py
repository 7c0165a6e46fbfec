"""The plan's AMP op lists (issue 18 point 3, seed §4.3 custom white/black lists): ops kept in float32 and ops run in
low precision beyond autocast's own lists, checked in the plan, applied by runtime/amp.py's OpPrecision, written into
the exported script and verified against the single-process reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from runtime_cases import make_plan

from autopar_nb.export import render_script
from autopar_nb.notebook.cell import parse_fix
from autopar_nb.plan import Plan, PlanError, PrecisionPlan, normalize_fix
from autopar_nb.runtime.amp import OpPrecision, step_context
from autopar_nb.source import ModelSource
from autopar_nb.units import fmt_time

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


@pytest.mark.multiprocess
def test_verify_applies_the_lists_on_every_rank():
    """bf16 autocast with every matmul kept in float32: the parallel runs (DDP, TP with DTensor weights) equal the
    single-process reference to float32's tolerance, which they would not if either side ignored the list."""
    from autopar_nb.verify import FP32_RTOL, verify_many

    src, plans = amp_plans()
    for name, report in zip(plans, verify_many([(src, p) for p in plans.values()], steps=3, nproc=2,
                                               rtol=FP32_RTOL), strict=True):
        assert report.ok, f"{name}\n{report}"


# ---- the step-time model follows the lists (cost/time.py amp_compute_time) ----------------------------------------
def _layer_times(model, x, cluster, **lists):
    """(profile, {precision: (forward, backward) per layer}) of ``model`` captured on ``x`` under ``lists``."""
    import autopar_nb as ap
    from autopar_nb.cost import factors_for, profile
    from autopar_nb.cost.time import layer_compute_time

    prof = profile(ap.capture(model, x), **lists)
    kw = dict(tp=1, sp=False, scale=1.0, quad_scale=1.0, device=cluster.device, factors=factors_for(cluster))
    return prof, {p: [layer_compute_time(lp, precision=p, **kw)[:2] for lp in prof.layers]
                  for p in ("fp32", "autocast")}


def _matmul(split, rep) -> float:
    return split.get("matmul", 0.0) + rep.get("matmul", 0.0)


def test_matmuls_kept_in_fp32_cost_the_fp32_rate():
    """A Linear-only model under bf16 autocast on an H100 (bf16 peak 13x fp32's): with ``fp32_ops=["linear"]``
    each layer costs exactly its float32 time (FLOPs at the fp32 peak and efficiency, no copies: its inputs stay
    float32); without the list the matmuls run at the bf16 rate and the first layer pays autocast's copy of the
    float32 input (read 4 bytes, write 2, one kernel; the model's input needs no gradient: no backward copy)."""
    import autopar_nb as ap
    from autopar_nb.cost import factors_for

    model, x = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 128)), torch.randn(64, 256)
    c = ap.Cluster.preset("h100-80gb")
    # without an SM count: these 64-token GEMMs' tile and wave quantisation (cost/efficiency.py) is left out here
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, name="h100-no-sm-count"))
    f, dev = factors_for(c), c.device
    prof, kept = _layer_times(model, x, c, fp32_ops=["linear"])
    assert kept["autocast"] == kept["fp32"]
    over = f.op_overhead_s
    for lp, (fwd, bwd) in zip(prof.layers, kept["autocast"], strict=True):
        rate = dev.flops("float32") * f.eff_fp32_matmul
        assert fwd == pytest.approx(_matmul(lp.flops_split, lp.flops_rep) / rate + lp.n_ops * over, rel=1e-12)
        assert bwd == pytest.approx(_matmul(lp.bwd_split, lp.bwd_rep) / rate + 2 * lp.n_ops * over, rel=1e-12)
    prof, free = _layer_times(model, x, c)
    copy = x.numel() * (4 + 2) / (dev.hbm_bandwidth * f.eff_hbm) + over
    for i, (lp, (fwd, bwd)) in enumerate(zip(prof.layers, free["autocast"], strict=True)):
        rate = dev.flops("bfloat16") * f.eff_matmul
        first = i == 0
        assert fwd == pytest.approx(_matmul(lp.flops_split, lp.flops_rep) / rate + lp.n_ops * over + first * copy)
        assert bwd == pytest.approx(_matmul(lp.bwd_split, lp.bwd_rep) / rate + (2 * lp.n_ops + first) * over)


class AddThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 32)

    def forward(self, x):
        return self.lin(x + 1.0)


def test_an_add_moved_to_low_precision_moves_half_its_bytes():
    """``x + 1.0`` before a Linear: under plain bf16 autocast the add reads and writes float32 (8 bytes an element)
    and the Linear copies its float32 result to bf16; with ``low_precision_ops=["elementwise_add"]`` the add moves
    exactly half those bytes, the copy moves to the add's input, and the Linear reads bf16 as it is."""
    import autopar_nb as ap

    x = torch.randn(128, 64)
    n = x.numel()
    c = ap.Cluster.preset("h100-80gb")
    (plain, _), (low, _) = (_layer_times(AddThenLinear(), x, c, **lists)
                            for lists in ({}, {"low_precision_ops": ["elementwise_add"]}))
    a, b = plain.layers[0].time_amp["autocast"], low.layers[0].time_amp["autocast"]
    assert plain.layers[0].mem_rep == n * 8 and a.mem_rep == n * 8  # autocast leaves the add in float32
    assert b.mem_rep == n * 4  # half
    assert a.cast_rep == b.cast_rep == n * (4 + 2) and a.casts == b.casts == 1
    assert not any(b.fp32_rep.values()) and not any(b.fp32_split.values())  # the Linear: bf16 rate either way


def test_the_plan_estimate_follows_the_lists():
    """What the planner and the widget show: ``estimate`` of the same plan is slower with the matmuls kept in float32
    (and the compute equals the fp32 plan's for a Linear-only model), and the planner's own cost matches it."""
    import autopar_nb as ap
    from autopar_nb.cost.estimate import estimate

    with torch.device("meta"):
        model, x = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096)), torch.randn(8192, 4096)
    graph = ap.capture(model, x)
    c = ap.Cluster.preset("h100-80gb")
    plan = ap.plan(graph, c, fix={"amp": "bf16", "fp32_ops": ["linear"], "dp": 1})
    kept = estimate(graph, c, plan)
    assert kept.step_time_s == pytest.approx(plan.cost.step_time_s)
    plan.precision = PrecisionPlan(amp="bf16")
    free = estimate(graph, c, plan)
    plan.precision = PrecisionPlan(amp="none")
    fp32 = estimate(graph, c, plan)
    assert kept.compute_s == pytest.approx(fp32.compute_s) and free.compute_s < kept.compute_s / 2
    # the explanation says what the lists cost: the same setting with autocast's own lists
    (line,) = [x for x in plan.explanation if x.startswith("Op lists")]
    assert line.startswith("Op lists (kept in float32: linear (2 ops)): ") and "with autocast's own lists" in line
    assert f"{fmt_time(kept.step_time_s)}/step" in line and f"against {fmt_time(free.step_time_s)}" in line
