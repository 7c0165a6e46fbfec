"""Float8 training as a plan choice (``plan.precision.float8``): runtime/float8.py converts the Linear layers torchao
can take (dimensions multiples of 16, the output head kept in bf16) with torchao's emulation on CPU; the plan field,
its fix key and JSON; the exported script; and verify on 2 gloo processes (FSDP ZeRO-3 with the tensorwise recipe,
TP with the rowwise one) against the bf16 single-process run, within torchao's tolerance."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn as nn
from runtime_cases import LLAMA_CELL, has_transformers, llama_tp, make_plan, script_namespace, source

from autopar_nb.export import export
from autopar_nb.export.values import script_values
from autopar_nb.plan import Plan, PlanError, PrecisionPlan, normalize_fix
from autopar_nb.runtime.float8 import float8_linears, output_head
from autopar_nb.verify.report import FLOAT8_RTOL, LOW_PRECISION_RTOL, default_rtol

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao not installed (make setup installs it: pip install --no-deps "
                                          "torchao==0.18.0)")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.attn = nn.MultiheadAttention(32, 4, bias=False, batch_first=True)  # out_proj: a Linear subclass
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)  # 24: not a multiple of 16
        self.down = nn.Linear(24, 32)
        self.head = nn.Linear(32, 64, bias=False)


def test_the_linears_float8_takes():
    net = Net()
    assert output_head(net) == "head"
    assert float8_linears(net) == ["up"], "odd dims, a Linear subclass and the output head stay in bf16"
    assert float8_linears(net, keep=()) == ["up", "head"]


def _float8_plan(recipe: str = "tensorwise", **kwargs) -> tuple:
    src = source(LLAMA_CELL)
    plan = make_plan(src, amp="bf16", **kwargs)
    return src, dataclasses.replace(plan, precision=dataclasses.replace(plan.precision, float8=recipe))


def test_plan_field_fix_key_and_json():
    assert normalize_fix({"float8": "rowwise"}) == {"float8": "rowwise"}
    with pytest.raises(PlanError, match="tensorwise"):
        normalize_fix({"float8": "blockwise"})
    with pytest.raises(PlanError, match="needs precision.amp='bf16'"):
        PrecisionPlan(amp="none", float8="tensorwise")
    _, plan = _float8_plan("rowwise", dp=2, zero=3)
    back = Plan.from_json(plan.to_json())
    assert back.precision.float8 == "rowwise" and "float8=rowwise" in back.summary()
    assert default_rtol(plan) == FLOAT8_RTOL and default_rtol(make_plan(source(LLAMA_CELL), amp="bf16")) == \
        LOW_PRECISION_RTOL


def test_the_script_converts_before_tp_and_fsdp(tmp_path):
    src, plan = _float8_plan("tensorwise", dp=2, tp=1, zero=3)
    v = script_values(src, plan)
    assert v.float8 == "tensorwise" and "output" not in v.float8_linears and len(v.float8_linears) == 14
    script = export(src, plan, tmp_path / "train.py", quiet=True, single_file=True).script
    text = script.read_text()
    assert 'FLOAT8 = "tensorwise"' in text and "from torchao.float8 import convert_to_float8_training" in text
    assert text.index("apply_float8(part, FLOAT8, device=device, fsdp=True)") < text.index("apply_fsdp(part")
    with pytest.raises(PlanError, match="float8 runs with pp=1 only"):
        _float8_plan(pp=2, stages={"layers.1": 1}, micro_batches=2)


@needs_torchao
def test_the_script_runs_torchaos_float8_linear(tmp_path):
    src, plan = _float8_plan("tensorwise")
    ns = script_namespace(src, plan, tmp_path)
    model = ns["model"]
    ns["apply_float8"](model, "tensorwise", device="cpu", fsdp=False)
    kinds = {p: type(m).__name__ for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds["output"] == "Linear" and kinds["layers.0.attention.wq"] == "Float8Linear"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (2, 16))).float().sum().backward()
    assert model.layers[0].attention.wq.weight.grad is not None


@needs_torchao
@pytest.mark.multiprocess
def test_float8_on_two_gloo_processes_matches_the_bf16_run():
    """FSDP ZeRO-3 (tensorwise; gloo has no float8 dtype, so the weights gather in bf16 here) and TP (rowwise, the
    regular TP styles as torchtitan uses them for that recipe) against the single-process bf16 run: losses within
    4.4e-4 and gradients within 2.5e-2 of the largest when this was written, inside torchao's 10 %."""
    from autopar_nb.verify import verify_many

    cases = [_float8_plan("tensorwise", dp=2, zero=3, param_dtype="bfloat16"),
             _float8_plan("rowwise", tp=2, tp_styles=llama_tp())]
    reports = verify_many(cases, steps=3, nproc=2, warm=False)
    for report in reports:
        assert report.ok, str(report)
        assert report.rtol == FLOAT8_RTOL
        assert report.max_loss_rel < 5e-3, "the losses stay much closer than the tolerance"


# ---- hardware, cost and planner ---------------------------------------------------------------------------------
def test_fp8_rates_are_the_datasheets_and_describe_stays_bf16():
    from autopar_nb.cost.float8 import FP8
    from autopar_nb.hardware import PRESETS, Cluster

    with_fp8 = {name for name, (dev, _, _) in PRESETS.items() if dev.supports(FP8)}
    assert with_fp8 == {"h100-80gb", "h200", "h100-pcie", "h100-nvl", "gh200", "h20", "l4", "l40s"}
    h100 = Cluster.preset("h100-80gb")
    assert h100.device.flops(FP8) == pytest.approx(1979e12) and "bfloat16" in h100.describe()
    assert not Cluster.preset("cpu").device.supports(FP8) and not Cluster.preset("a100-80gb").device.supports(FP8)


def test_float8_time_saves_on_fp8_gpus_with_compiled_casts(llama_8b):
    from autopar_nb.cost import profile
    from autopar_nb.cost.factors import factors_for
    from autopar_nb.cost.float8 import float8_time
    from autopar_nb.cost.profile.float8 import float8_head
    from autopar_nb.hardware import Cluster

    prof = profile(llama_8b, device_kind="cuda")
    block = prof.layers[1]
    assert float8_head(llama_8b) == "output" and block.f8_flops_split + block.f8_flops_rep > 0
    assert prof.layers[-1].f8_flops_rep == prof.layers[-1].f8_flops_split == 0, "the head stays in bf16"
    h100 = Cluster.preset("h100-80gb", gpus_per_node=8)
    kw = dict(tp=1, scale=1.0, device=h100.device, factors=factors_for(h100))
    compiled, eager = float8_time(block, compiled=True, **kw), float8_time(block, compiled=False, **kw)
    assert compiled[0] < 0 and compiled[1] < 0, "FP8 matmuls at twice bf16's rate save more than fused casts cost"
    assert eager[0] > compiled[0] and eager[1] > compiled[1], "eager casts move five times the bytes"


def test_fsdp_gathers_tensorwise_float8_weights_in_one_byte(llama_8b):
    """torchao's tensorwise recipe casts each FSDP weight shard to float8 before the all-gather (torchtitan's
    enable_fsdp_float8_all_gather): LLaMA 3 8B's blocks, nearly all of its 8.0B parameters, gather at 1 byte where
    bf16 gathers 2; the rowwise recipe gathers in bf16 (its all-gather costs what bf16's does)."""
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster

    h100 = Cluster.preset("h100-80gb", gpus_per_node=8)
    fix = {"dp": 8, "zero_stage": 3, "compile": True, "amp": "bf16", "async_tp": False}
    gather = {f8: ap.plan(llama_8b, h100, global_batch=8, fix={**fix, "float8": f8}).cost.comm_by_kind["all_gather"]
              for f8 in ("none", "rowwise", "tensorwise")}
    assert gather["rowwise"] == pytest.approx(gather["none"])
    assert 0.5 * gather["none"] < gather["tensorwise"] < 0.6 * gather["none"], gather  # 1.05B embedding/head: bf16
    from autopar_nb.cost.float8 import gathered_item

    cpu = Cluster.preset("cpu", gpus_per_node=2)  # gloo has no float8: the runtime gathers bf16 there
    assert gathered_item(10.0, 8.0, p_item=2, recipe="tensorwise", cluster=cpu) == 2
    assert gathered_item(10.0, 8.0, p_item=2, recipe="tensorwise", cluster=h100) == pytest.approx(1.2)


def test_fsdp_casts_the_float8_weight_shard_once_per_all_gather(llama_8b):
    """With float8 all-gathers torchao casts each weight's shard in fsdp_pre_all_gather and the Linear finds its
    weight cast already (forward and backward): a block's float8 time drops the whole local weight's casts, and the
    step gains one cast of the 1/dp shard per all-gather, hidden as the all-gather is. The rowwise recipe gathers
    bf16 and still casts in the Linear (before: the whole weight cast twice per micro-batch under either)."""
    import autopar_nb as ap
    from autopar_nb.cost import Evaluator, profile
    from autopar_nb.cost.float8 import CAST_BYTES
    from autopar_nb.hardware import Cluster

    h100 = Cluster.preset("h100-80gb", gpus_per_node=8)
    ev = Evaluator(profile(llama_8b, device_kind="cuda"), h100)
    kw = dict(tp=1, sp=False, precision="autocast", mb_samples=1, compiled=True, float8=True)
    block = ev.prof.layers[1]
    hbm = h100.device.hbm_bandwidth * ev.f.eff_hbm
    cast, gathered = ev.terms(1, **kw), ev.terms(1, **kw, f8_gathered=True)
    assert cast.fwd - gathered.fwd == pytest.approx(block.f8_weights * CAST_BYTES[True] / hbm)
    assert cast.bwd - gathered.bwd == pytest.approx(block.f8_weights * CAST_BYTES[True] / hbm)
    fix = {"dp": 8, "zero_stage": 3, "compile": True, "amp": "bf16", "async_tp": False, "micro_batches": 1}
    cost = {f8: ap.plan(llama_8b, h100, global_batch=8, fix={**fix, "float8": f8}).cost
            for f8 in ("rowwise", "tensorwise")}
    assert "float8 casts" not in cost["rowwise"].comm_by_kind
    f8_weights = sum(lp.f8_weights for lp in ev.prof.layers)
    shard_casts = 2 * f8_weights / 8 * CAST_BYTES[False] / hbm  # ZeRO-3: gathered for forward and for backward
    assert cost["tensorwise"].comm_by_kind["float8 casts"] == pytest.approx(shard_casts)


def test_the_planner_takes_float8_where_it_pays_and_says_why(llama_8b):
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster

    h100 = ap.plan(llama_8b, Cluster.preset("h100-80gb", gpus_per_node=8), global_batch=8, fix={"compile": True})
    assert h100.precision.float8 == "tensorwise"
    assert any(line.startswith("Float8 (tensorwise) chosen") and "FP8 rate (1979 TFLOP/s" in line
               for line in h100.explanation)
    eager = ap.plan(llama_8b, Cluster.preset("h100-80gb", gpus_per_node=8), global_batch=8, fix={"compile": False})
    assert eager.precision.float8 == "none"
    assert any("Float8 not chosen" in line and "compile fuses them" in line for line in eager.explanation)
    a100 = ap.plan(llama_8b, Cluster.preset("a100-80gb", gpus_per_node=8), global_batch=8)
    assert a100.precision.float8 == "none" and any("Float8 not offered: the a100-80gb has no FP8 matmuls" in line
                                                   for line in a100.explanation)


def test_the_float8_line_and_its_lever_compare_against_the_same_plan(llama_8b):
    """LLaMA 3 8B on 8 H100: async TP is chosen after float8, so the Float8 line's bf16 twin must keep it, as the
    lever (float8 flipped alone on the final plan) does; they said 1.28x and 1.22x when the line's twin was costed
    before async TP."""
    import re

    import autopar_nb as ap
    from autopar_nb.hardware import Cluster
    from autopar_nb.units import fmt_time

    for fix in (None, {"compile": False}):  # float8 chosen (with async TP), and not chosen (eager casts)
        plan = ap.plan(llama_8b, Cluster.preset("h100-80gb", gpus_per_node=8), global_batch=8, fix=fix)
        line = next(x for x in plan.explanation if x.startswith("Float8 "))
        lever = next(lv for lv in plan.levers if lv.name == "float8")
        levers = next(x for x in plan.explanation if x.startswith("Levers, each flipped alone"))
        on, off = re.search(r"([\d.,]+ \S?s)/step vs ([\d.,]+ \S?s) in bf16", line).group(1, 2)
        ratio = float(re.search(r"in bf16 \((\S+)x\)", line).group(1))
        said = re.search(r"([−+])Float8: (\S+)x (faster|slower)", levers).groups()
        assert lever.on == (plan.precision.float8 != "none") == (said[0] == "−")
        assert fmt_time(lever.step_time_s) == (off if lever.on else on), (line, lever)
        assert fmt_time(plan.cost.step_time_s) == (on if lever.on else off)
        speed = float(said[1]) if said[2] == "faster" else 1 / float(said[1])
        assert speed == pytest.approx(1 / ratio if lever.on else ratio, rel=0.01), (line, levers)
    assert plan.precision.float8 == "none" and "Float8 not chosen" in line


def test_the_planner_never_chooses_float8_on_cpu_but_takes_the_fix():
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster

    src = source(LLAMA_CELL)
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, *inputs)
    cpu = Cluster.preset("cpu", gpus_per_node=2)
    auto = ap.plan(graph, cpu)
    assert auto.precision.float8 == "none"
    assert any(line.startswith("Float8 not offered: the cpu has no FP8 matmuls") for line in auto.explanation)
    fixed = ap.plan(graph, cpu, fix={"float8": "rowwise", "amp": "bf16"})
    assert fixed.precision.float8 == "rowwise" and fixed.mesh.pp == 1
    assert any("emulated in float32 on the cpu" in line for line in fixed.explanation)
    with pytest.raises(PlanError, match="needs amp='bf16'"):
        ap.plan(graph, cpu, fix={"float8": "rowwise", "amp": "none"})


def test_a_gpu_no_preset_names_is_refused_for_its_unknown_rate_not_for_lacking_fp8(small_llama):
    """An Ada card detected but named by no preset (compute capability 8.9: it has FP8 tensor cores) gets the
    planner's bf16/fp32 guesses: float8 is not offered because its FP8 rate is unknown, and the line says so rather
    than that the card has no FP8; an A100 (a preset without FP8) still reads "has no FP8 matmuls"."""
    import autopar_nb as ap
    from autopar_nb.hardware import Cluster, GpuInfo

    ada = Cluster.from_gpu(GpuInfo("NVIDIA RTX 6000 Ada Generation", 51.5e9, (8, 9)), 2)
    line = next(x for x in ap.plan(small_llama, ada, fix={"amp": "bf16"}).explanation if x.startswith("Float8"))
    assert line.startswith("Float8 not offered: no FP8 rate is known for the NVIDIA RTX 6000 Ada Generation (no "
                           "preset names it)") and "has no FP8" not in line, line
    a100 = ap.plan(small_llama, Cluster.preset("a100-80gb", gpus_per_node=2), fix={"amp": "bf16"})
    assert any(x.startswith("Float8 not offered: the a100-80gb has no FP8 matmuls") for x in a100.explanation)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_cost_and_runtime_keep_the_same_head_when_it_is_tied():
    """A head tied to the embedding has no parameter of its own in the graph: the cost finds it by the forward's last
    Linear, the runtime by the last one registered; both name lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import autopar_nb as ap
    from autopar_nb.cost.profile.float8 import float8_head

    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    graph = ap.capture(model, torch.randint(0, 128, (2, 16)))
    assert float8_head(graph) == output_head(model) == "lm_head" and len(float8_linears(model)) == 14
