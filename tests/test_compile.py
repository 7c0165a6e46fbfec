"""Compile: runtime/compile.py for real with Inductor's C++ backend on CPU (tiny models, compiled once: Inductor
compiles are slow on a few cores, so those tests are marked slow), and compile as a plan choice: the planner's
``fix compile=True``, its cost factor and calibration, the exported script and verify."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.calibration import factors_from
from autopar_nb.export import render_script
from autopar_nb.plan import Plan, PlanError
from autopar_nb.runtime.compile import apply_compile
from autopar_nb.source import ModelSource
from autopar_nb.verify import verify


@pytest.mark.slow
def test_blocks_compile_in_place_and_match_eager():
    torch.manual_seed(0)
    cfg = zoo.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    eager, compiled = zoo.Llama(cfg), zoo.Llama(cfg)
    compiled.load_state_dict(eager.state_dict())
    names = list(compiled.state_dict())
    assert apply_compile(compiled, "layers.*") == ["layers.0", "layers.1"]
    assert list(compiled.state_dict()) == names, "parameter names unchanged (no _orig_mod. prefix)"
    assert apply_compile(compiled, "no_such.*") == []
    tokens = torch.randint(0, 64, (2, 8))
    losses = []
    for model in (eager, compiled):
        out = model(tokens)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append((out, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=1e-4, atol=1e-5)
    for name, g in losses[0][1].items():
        torch.testing.assert_close(losses[1][1][name], g, rtol=1e-4, atol=1e-5)
    # really compiled: Dynamo produced a graph for the blocks
    assert compiled.layers[0]._compiled_call_impl is not None


# ---- compile as a plan choice: planner, plan file, calibration, script, verify -------------------------------------
LM_CELL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LM(nn.Module):
    def __init__(self, vocab=VOCAB, d=DIM, n=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


model = LM()
example_inputs = (torch.randint(0, VOCAB, (BATCH, SEQ)),)
"""


def lm_source(vocab: int = 64, dim: int = 32, batch: int = 4, seq: int = 16) -> ModelSource:
    """A 2-block language model whose head is a bias-free Linear (the default loss is next-token cross-entropy)."""
    return ModelSource(LM_CELL.replace("VOCAB", str(vocab)).replace("DIM", str(dim)).replace("BATCH", str(batch))
                       .replace("SEQ", str(seq)))


def _plan(src: ModelSource, cluster, **kwargs):
    model, inputs, _ = src.build(device="meta")
    return ap.plan(ap.capture(model, *inputs), cluster, **kwargs)


def test_fix_compile_compiles_the_blocks_and_predicts_a_faster_step():
    cluster = ap.Cluster.preset("h100-80gb", 1, 2)
    eager = _plan(lm_source(), cluster, fix={"dp": 2})
    compiled = _plan(lm_source(), cluster, fix={"dp": 2, "compile": True})
    assert [lp.path for lp in compiled.layers if lp.compile] == ["layers.0", "layers.1"]
    assert not any(lp.compile for lp in eager.layers), "eager unless fixed: the factor is a guess until calibrated"
    assert compiled.cost.step_time_s < eager.cost.step_time_s
    assert compiled.cost.compute_s < eager.cost.compute_s
    assert "compile" in compiled.summary() and "compile" not in eager.summary()
    assert "Compiled with torch.compile (fix compile=True): 2 layer(s)" in compiled.explain()
    assert "Eager (not compiled): fix compile=True would compile 2 layer(s)" in eager.explain()
    assert Plan.from_json(compiled.to_json()).layers[1].compile is True
    assert [c.path for c in eager.diff(compiled)] == ["layers[layers.0].compile", "layers[layers.1].compile"]
    with pytest.raises(PlanError, match=r"pp=2 with fix compile=True"):
        _plan(lm_source(), cluster, fix={"pp": 2, "compile": True})
    with pytest.raises(PlanError, match=r"fix\['compile'\]='yes' is not supported"):
        _plan(lm_source(), cluster, fix={"compile": "yes"})


def test_plan_refuses_compile_with_pipeline_stages():
    plan = _plan(lm_source(), ap.Cluster.preset("cpu", 1, 2), fix={"pp": 2})
    d = plan.to_dict()
    d["layers"][1]["compile"] = True
    with pytest.raises(PlanError, match="compiled, but mesh.pp=2"):
        Plan.from_dict(d)
    d["layers"][1]["compile"] = "true"
    with pytest.raises(PlanError, match=r"layers\['layers.0'\].compile must be true or false"):
        Plan.from_dict(d)


def test_compile_factor_is_calibrated_by_compiled_runs_after_an_eager_one():
    current = {"eff_matmul": 0.7, "eff_hbm": 0.75, "op_overhead_s": 2e-6, "compile_memory_bound": 0.5}
    measured = {"step_time_s": 0.012, "predicted_step_time_s": 0.010}
    only, record = factors_from(measured, current=current, compiled=True, eager_calibrated=True)
    assert only == {"compile_memory_bound": pytest.approx(0.6)} and record["compiled"]
    uniform, _ = factors_from(measured, current=current, compiled=True, eager_calibrated=False)
    assert "compile_memory_bound" not in uniform and uniform["eff_matmul"] == pytest.approx(0.7 / 1.2)
    far, _ = factors_from({"step_time_s": 1.0, "predicted_step_time_s": 0.01}, current=current, compiled=True,
                          eager_calibrated=True)
    assert far["compile_memory_bound"] == 1.5  # clamped
    # the factor reaches the cost model under its name
    cluster = ap.Cluster.preset("h100-80gb", 1, 2)
    slow = dataclasses.replace(cluster, calibration={"compile_memory_bound": 1.0})
    fix = {"dp": 2, "compile": True}
    assert _plan(lm_source(), slow, fix=fix).cost.step_time_s == pytest.approx(
        _plan(lm_source(), cluster, fix={"dp": 2}).cost.step_time_s)


def test_the_planner_compiles_once_a_compiled_run_measured_a_gain():
    """Without a measured factor the planner stays eager (the default factor is a guess); once a compiled run on the
    preset calibrated ``compile_memory_bound`` below 1 it compiles the repeated blocks by itself (pp=1 only); a
    measured factor >= 1 (no gain) or fix compile=False keeps it eager."""
    cluster = ap.Cluster.preset("h100-80gb", 1, 2)
    measured = dataclasses.replace(cluster, calibration={"compile_memory_bound": 0.3})
    chosen = _plan(lm_source(), measured, fix={"dp": 2})
    assert [lp.path for lp in chosen.layers if lp.compile] == ["layers.0", "layers.1"]
    assert "Compiled with torch.compile (chosen: a compiled run measured the factor)" in chosen.explain()
    assert not any(lp.compile for lp in _plan(lm_source(), cluster, fix={"dp": 2}).layers)
    no_gain = dataclasses.replace(cluster, calibration={"compile_memory_bound": 1.2})
    assert not any(lp.compile for lp in _plan(lm_source(), no_gain, fix={"dp": 2}).layers)
    assert not any(lp.compile for lp in _plan(lm_source(), measured, fix={"dp": 2, "compile": False}).layers)
    staged = _plan(lm_source(), measured, fix={"pp": 2})
    assert staged.mesh.pp == 2 and not any(lp.compile for lp in staged.layers)


def test_script_compiles_blocks_after_checkpointing_and_before_fsdp():
    src = lm_source()
    plan = _plan(src, ap.Cluster.preset("h100-80gb", 1, 2),
                 fix={"dp": 2, "zero_stage": 3, "recompute": "full", "compile": True})
    text = render_script(src, plan)
    assert 'COMPILE = ["layers.*"]' in text
    body = text[text.index("def parallelize("):]
    assert body.index("apply_ac(part, RECOMPUTE)") < body.index("apply_compile(part, COMPILE)") < body.index(
        "apply_fsdp(")
    assert "def apply_compile(" in text and "# autopar_nb/runtime/compile.py" in text
    assert "apply_compile" not in render_script(src, _plan(src, ap.Cluster.preset("h100-80gb", 1, 2),
                                                           fix={"dp": 2}))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_verify_compiled_plan_on_two_gloo_processes():
    src = lm_source()
    plan = _plan(src, ap.Cluster.preset("cpu", 1, 2), fix={"dp": 2, "compile": True})
    assert any(lp.compile for lp in plan.layers)
    report = verify(src, plan, steps=2, nproc=2)
    assert report.ok, report
