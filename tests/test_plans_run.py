"""Planner and runtime agree: every plan the planner proposes on the ``cpu`` preset runs, and runs right.

For each zoo model (GPT with nanoGPT's fused QKV and learned positions, Llama, the seed MLP, ResNet with BatchNorm,
RecSys) the planner is asked for a plan under several fixes (tp=2; dp=2 with ZeRO 0/2/3; pp=2; and dp=2 x tp=2, with
ZeRO-1 too, on 4 processes), and every plan goes through :func:`autopar_nb.verify.verify_many` against a
single-process reference.
Hugging Face families built from their configs with default settings join the tp=2 cases, for the TP layouts the
planner proposes beyond one even cut per projection: GPT-2's fused ``Conv1D`` c_attn split part by part, Gemma's
single key/value head repeated, Phi-3's q|k|v of different widths (GQA) gathered and its gate|up split part by part,
T5's relative position bias split by heads. All 2-process plans share one launch of processes, the 4-process ones a
second (spawning costs seconds).
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import (
    GPT_CELL,
    HF_GEMMA_CELL,
    HF_GPT2_CELL,
    HF_PHI3_CELL,
    HF_T5_CELL,
    LLAMA_CELL,
    RECSYS_CELL,
    RESNET_CELL,
    has_transformers,
    source,
)

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
FOUR = {("llama", "dp2_tp2"): {"dp": 2, "tp": 2}, ("llama", "dp2_tp2_zero1"): {"dp": 2, "tp": 2, "zero_stage": 1},
        ("gpt", "pp2"): {"pp": 2}}
# Hugging Face families (tiny sizes, default settings) -> the tp=2 layouts the planner must propose: colwise module
# (relative to the first block) -> its parts
HF_MODELS = {"hf_gpt2": HF_GPT2_CELL, "hf_gemma": HF_GEMMA_CELL, "hf_phi3_gqa": HF_PHI3_CELL.format(kv=2),
             "hf_t5": HF_T5_CELL} if has_transformers() else {}
LAYOUTS = {
    "gpt": {"h.0.attn.c_attn": [4, 4, 4]},  # nanoGPT's fused [q|k|v] Linear: split part by part
    "hf_gpt2": {"transformer.h.0.attn.c_attn": [4, 4, 4]},  # Conv1D, fused: split part by part
    "hf_gemma": {"model.layers.0.self_attn.k_proj": [1], "model.layers.0.self_attn.v_proj": [1]},  # repeated
    "hf_phi3_gqa": {"model.layers.0.self_attn.qkv_proj": [4, 2, 2],  # gathered
                    "model.layers.0.mlp.gate_up_proj": [64, 64]},  # split part by part
    "hf_t5": {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias": [4],  # split by heads
              "decoder.block.0.layer.0.SelfAttention.relative_attention_bias": [4]},
}
# plans the planner must refuse on these models, and why
REFUSED = {("resnet", "tp2"): "no Linear/Embedding that TP can split"}
# (recsys pp2 runs: its sparse[:, i] views cross the stage boundary as contiguous copies, runtime/pp_split.py)
STEPS = 3


def _plan(name: str, fix: dict, nproc: int):
    src = ModelSource(MODELS[name]) if name in MODELS else source(HF_MODELS[name])
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=nproc), global_batch=graph.batch_size, fix=fix)
    return src, plan


@pytest.fixture(scope="module")
def reports():
    torch.set_num_threads(1)
    out = {}
    for nproc, cases in ((2, {(m, f): fix for m in MODELS for f, fix in FIXES.items() if (m, f) not in REFUSED} |
                          {(m, "tp2"): FIXES["tp2"] for m in HF_MODELS}), (4, FOUR)):
        planned = {key: _plan(key[0], fix, nproc) for key, fix in cases.items()}
        out.update(zip(planned, zip(planned.values(), verify_many(list(planned.values()), steps=STEPS),
                                    strict=True), strict=True))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("key", [*((m, f) for m in MODELS for f in FIXES if (m, f) not in REFUSED), *FOUR,
                                 *((m, "tp2") for m in HF_MODELS)], ids=lambda k: "-".join(k))
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
    """The plans under test exercise what they should: fused QKV split part by part, SP beside learned positions
    (added before the blocks, cut at the first), SP on Hugging Face GPT-2's blocks only (its view(-1, T, C) after
    ln_f is sized from the global sequence: ln_f gathers it and runs whole), CPU SyncBatchNorm for ResNet under
    dp."""
    (_, gpt), _ = reports[("gpt", "tp2")]
    assert gpt.tp_plan["h.0.attn.c_attn"] == "colwise" and "wpe" not in gpt.tp_plan
    assert gpt.tp_plan["h.0.mlp.c_fc"] == "colwise" and gpt.layer("h.1").sequence_parallel
    if HF_MODELS:
        (_, hf_gpt2), _ = reports[("hf_gpt2", "tp2")]
        blocks = [lp for lp in hf_gpt2.layers if lp.path.startswith("transformer.h.")]
        assert blocks and all(lp.sequence_parallel for lp in blocks)
        assert hf_gpt2.tp_plan["transformer.h.0.ln_1"] == "sequence_parallel"
        assert not hf_gpt2.layer("transformer.ln_f").sequence_parallel and "transformer.ln_f" not in hf_gpt2.tp_plan
        assert not hf_gpt2.layer("lm_head").sequence_parallel
    (_, llama), _ = reports[("llama", "tp2")]
    assert llama.tp_plan["layers.0.attention.wq"] == "colwise" and llama.layer("layers.0").sequence_parallel
    (_, resnet), report = reports[("resnet", "dp2_zero0")]
    assert resnet.sync_batchnorm
    # CPUSyncBatchNorm matches single-process BatchNorm over the global batch
    assert report.max_loss_rel <= 1e-5 and report.max_grad_rel <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n in MODELS or n in HF_MODELS])
def test_planned_tp_layouts_run_split(reports, name):
    """The planner's own tp=2 plans use the layouts beyond one even cut (``LayerPlan.tp_parts``), they verify
    against the single-process run, and every rank really holds less than the whole model."""
    (src, plan), report = reports[(name, "tp2")]
    parts = plan.tp_parts
    assert {m: p for m, p in parts.items() if m in LAYOUTS[name]} == LAYOUTS[name], parts
    model, _, _ = src.build(device="meta")
    full = sum(p.numel() for p in model.parameters())  # each shared parameter once
    print(f"{name}: {plan.summary()}, tp_parts {dict(list(parts.items())[:2])}, local_numel "
          f"{[r['local_numel'] for r in report.per_rank]} of {full}, max grad rel {report.max_grad_rel:.1e}")
    assert report.ok, str(report)
    for info in report.per_rank:
        assert info["local_numel"] < full and info["dtensor_params"] > 0, (name, info, full)


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
    text = script.read_text() + script.with_name("train_resnet_runtime.py").read_text()  # and its runtime module
    assert "apply_sync_batchnorm(net" in text and "class CPUSyncBatchNorm" in text
    server = MetricsServer()
    torchrun(script, server=server)
    assert losses_of(server) == pytest.approx(report.losses, rel=1e-6, abs=0)
