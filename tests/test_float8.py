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
from runtime_cases import LLAMA_CELL, llama_tp, make_plan, script_namespace, source

from autopar_nb.check import FLOAT8_RTOL, LOW_PRECISION_RTOL, default_rtol
from autopar_nb.export import export
from autopar_nb.export.values import script_values
from autopar_nb.plan import Plan, PlanError, PrecisionPlan, normalize_fix
from autopar_nb.runtime.float8 import float8_linears, output_head

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
