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
    assert not any(lp.compile for lp in eager.layers), "eager: its compile would not pay for its gain"
    assert compiled.cost.step_time_s < eager.cost.step_time_s
    assert compiled.cost.compute_s < eager.cost.compute_s
    assert "compile" in compiled.summary() and "compile" not in eager.summary()
    assert "Compiled with torch.compile (fix compile=True): 2 layer(s)" in compiled.explain()
    assert "fix compile=True would compile 2 layer(s); compile: +" in eager.explain()
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


def test_the_planner_compiles_where_it_pays_over_the_steps_planned():
    """Compile is chosen where its predicted gain per step, times the steps planned (``plan(steps=...)``, else
    torchtitan's default 10,000), exceeds Inductor's compile at start-up; the explanation says both. The tiny LM saves
    microseconds per step, so only a very long run pays for its compile; fix compile=False and pp=2 stay eager."""
    cluster = ap.Cluster.preset("h100-80gb", 1, 2)
    eager = _plan(lm_source(), cluster, fix={"dp": 2})
    assert not any(lp.compile for lp in eager.layers)
    line = next(x for x in eager.explanation if x.startswith("Eager"))
    assert "it would not pay within the 10,000 steps planned" in line and "s start-up, −" in line, line
    long = _plan(lm_source(), cluster, fix={"dp": 2}, steps=10**9)
    assert [lp.path for lp in long.layers if lp.compile] == ["layers.0", "layers.1"]
    line = next(x for x in long.explanation if x.startswith("Compiled"))
    assert "chosen: it pays within the 1,000,000,000 steps planned" in line and "pays after" in line, line
    after = int(line.split("pays after ")[1].split(" steps")[0].replace(",", ""))
    assert not any(lp.compile for lp in _plan(lm_source(), cluster, fix={"dp": 2}, steps=after - 1).layers)
    assert [lp.path for lp in _plan(lm_source(), cluster, fix={"dp": 2}, steps=after + 1).layers if lp.compile] == [
        "layers.0", "layers.1"]
    assert not any(lp.compile for lp in _plan(lm_source(), cluster, fix={"dp": 2, "compile": False},
                                              steps=10**9).layers)
    staged = _plan(lm_source(), cluster, fix={"pp": 2}, steps=10**9)
    assert staged.mesh.pp == 2 and not any(lp.compile for lp in staged.layers)
    with pytest.raises(PlanError, match="steps must be a positive integer"):
        _plan(lm_source(), cluster, steps=0)


def test_on_the_cpu_preset_compile_waits_for_a_compiled_run():
    """On the cpu preset no default gain of compile is known (compiled CPU runs on the shared host measured from
    faster to 4x slower than eager with the load): however long the run, the planner stays eager until a compiled
    run has calibrated compile_memory_bound, and says so; fix compile=True compiles."""
    cpu = ap.Cluster.preset("cpu", 1, 2)
    eager = _plan(lm_source(), cpu, fix={"dp": 2}, steps=10**9)
    assert not any(lp.compile for lp in eager.layers)
    line = next(x for x in eager.explanation if x.startswith("Eager"))
    assert "compile is taken once a compiled run has calibrated it" in line, line
    assert any(lp.compile for lp in _plan(lm_source(), cpu, fix={"dp": 2, "compile": True}).layers)
    calibrated = dataclasses.replace(cpu, calibration={"compile_memory_bound": 0.05})
    assert any(lp.compile for lp in _plan(lm_source(), calibrated, fix={"dp": 2}, steps=10**9).layers)


def test_compile_start_up_is_one_compile_per_repeated_block():
    """The runtime compiles each block on its own and Dynamo reuses the graph for the block's other members: the
    start-up does not grow with depth; it is the block's ops times the measured seconds per op."""
    from autopar_nb.cost.compile import compile_startup_s, compiled_graphs
    from autopar_nb.cost.factors import factors_for
    from autopar_nb.cost.profile import profile_of

    f = factors_for(ap.Cluster.preset("h200", 1, 1))
    starts = []
    for n in (2, 6):
        model, inputs, _ = ModelSource(lm_source().code.replace("n=2", f"n={n}")).build(device="meta")
        graph = ap.capture(model, *inputs)
        prof = profile_of(graph, "cuda")
        blocks = [graph.block_of(lay.path) is not None for lay in graph.layers]
        assert sum(blocks) == n and compiled_graphs(graph, blocks) == [blocks.index(True)]
        starts.append(compile_startup_s(graph, prof, blocks, f))
        every = compile_startup_s(graph, prof, [True] * len(blocks), f)
        assert every == pytest.approx(sum(lp.n_ops for i, lp in enumerate(prof.layers) if not blocks[i] or
                                          i == blocks.index(True)) * f.compile_s_per_op)
    assert starts[0] == starts[1] > 0


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
