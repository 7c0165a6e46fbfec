"""Pipelining the models people bring: the planner's pp=2 plans for the Hugging Face families (default configs, tiny
sizes; ``tests/families.py``) run under torch's schedules and train like one process.

Before, the planner refused pipelining for every one of them: their attention masks (an ``expand``) and rotary cos/sin
are made once and read by every layer, labels reach the loss in the last stage, T5's encoder output reaches every
decoder block; ``runtime/pp.py`` now passes such values on through the stages between and sends contiguous copies.
Every case goes through :func:`autopar_nb.verify.verify_many` against a single-process reference, all in ONE launch of
2 gloo processes (LLaMA and GPT-2 also with the output head fused with the loss on the last stage); two exported
scripts run under ``torchrun``.

Tensor parallelism inside the stages (the layout of the largest published runs): the decoder
families at tp=2 x pp=2 in one launch of 4 processes, and with FSDP (ZeRO-3, dp=2) in fp32 and
bf16 in one launch of 8. Expert parallelism inside the stages (Mixtral, ep=2 x pp=2) in the launch of 4.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from families import FAMILIES, _torchrun
from runtime_cases import has_transformers

import autopar_nb as ap
from autopar_nb.cost import profile
from autopar_nb.notebook.cell import run_model_cell
from autopar_nb.verify import verify_many

pytestmark = pytest.mark.skipif(not has_transformers(), reason="needs transformers")

NAMES = ["LLaMA", "Qwen2", "GPT-NeoX", "GPT-2", "BERT", "T5", "ViT", "Mixtral"]
# 1F1B (one stage per rank) for every family; the multi-stage schedules (stages r and r+2, or a V) where values cross
# several cuts: LLaMA's mask and rotary cos/sin, T5's encoder output (with its gradient) and labels, ViT's labels;
# GPT-2's tied embedding and head on stages of one rank (the V). Not here: T5 under ZBV (see README, Limits)
CASES = ([(name, "1f1b") for name in NAMES] + [(name, "interleaved_1f1b") for name in ("LLaMA", "GPT-2", "T5", "ViT")]
         + [(name, "zbv_zero_bubble") for name in ("LLaMA", "GPT-2", "ViT")]
         # under bf16 autocast: the stages are traced without it (Mixtral's router casts its logits to float32, a
         # no-op while tracing: runtime/pp.py's casts_as_in_eager)
         + [(name, "1f1b", "bf16") for name in ("Mixtral", "T5")]
         # three chunks a rank: T5's shared embedding is then read by two stages of rank 0 (the encoder's first,
         # the decoder's), one tensor the optimizer must step once (it stepped it twice: parameters off by lr)
         + [("T5", "interleaved_1f1b", "v3")])
# the output head fused with the loss on the last stage (plan.fused_loss), against the unfused single process: LLaMA,
# and GPT-2 whose head is tied to the embedding on the first stage (on the same rank in the V)
FUSED_CASES = [(name, schedule, "fused") for name in ("LLaMA", "GPT-2")
               for schedule in ("1f1b", "interleaved_1f1b", "zbv_zero_bubble")]
STEPS = 2
# TP inside the stages of the Hugging Face decoders (tests/memcells.py's cells, tiny): tp=2 x pp=2
# (sequence parallel where the planner chooses it: LLaMA, Qwen2, GPT-2's blocks) on 4 processes, dp=2 x tp=2 x
# pp=2 under ZeRO-3 on 8, in fp32 and bf16 (FSDP2's mixed precision: the stages compute in bf16
# what was traced in fp32)
TP_NAMES = ["LLaMA", "Qwen2", "GPT-2", "Mixtral"]
TP_PP = {"tp": 2, "pp": 2, "micro_batches": 4, "schedule": "1f1b"}
TP_LAYOUTS = {"tp2_pp2": (4, TP_PP),
              "dp2_tp2_pp2_zero3": (8, TP_PP | {"dp": 2, "zero_stage": 3, "micro_batches": 2}),
              "tp2_pp2_zbv": (4, TP_PP | {"schedule": "zbv_zero_bubble", "virtual_stages": 2}),
              "tp2_pp2_interleaved": (4, TP_PP | {"schedule": "interleaved_1f1b", "virtual_stages": 2}),
              # four chunks a rank (8 layers): the planner tries v up to 8 where the layers allow
              "tp2_pp2_interleaved4": (4, TP_PP | {"schedule": "interleaved_1f1b", "virtual_stages": 4})}
TP_CASES = ([(name, "tp2_pp2", "none") for name in TP_NAMES]
            + [(name, "dp2_tp2_pp2_zero3", amp) for name in TP_NAMES for amp in ("none", "bf16")]
            + [("LLaMA", "tp2_pp2_zbv", "none"), ("GPT-2", "tp2_pp2_interleaved", "bf16"),
               ("LLaMA", "tp2_pp2_interleaved4", "none")])
# FSDP (ZeRO-3) stages under the schedules that split the backward into an input and a weight
# pass, 2 stages a rank (4 layers): in the launch of 4 processes above
ZB_PP = {"dp": 2, "pp": 2, "zero_stage": 3, "micro_batches": 4, "virtual_stages": 2}
LAYOUTS = TP_LAYOUTS | {"dp2_pp2_zero3_zbv": (4, ZB_PP | {"schedule": "zbv_zero_bubble"}),
                        "dp2_pp2_zero3_izb": (4, ZB_PP | {"schedule": "interleaved_zero_bubble"})}
ZB_CASES = [("LLaMA", "dp2_pp2_zero3_zbv", "none"), ("GPT-2", "dp2_pp2_zero3_zbv", "none"),
            ("LLaMA", "dp2_pp2_zero3_izb", "none")]
# expert parallelism inside the stages: each stage's experts split over its 2 data-parallel ranks (ep=2 x pp=2), in
# the launch of 4 processes above: DDP under 1F1B, ZeRO-3 in bf16 under interleaved 1F1B (2 stages a rank)
EP_PP = {"dp": 2, "ep": 2, "pp": 2, "micro_batches": 4}
LAYOUTS |= {"dp2_ep2_pp2": (4, EP_PP | {"zero_stage": 0, "schedule": "1f1b"}),
            "dp2_ep2_pp2_zero3_interleaved": (4, EP_PP | {"zero_stage": 3, "schedule": "interleaved_1f1b",
                                                          "virtual_stages": 2})}
EP_CASES = [("Mixtral", "dp2_ep2_pp2", "none"), ("Mixtral", "dp2_ep2_pp2_zero3_interleaved", "none")]
# context parallelism beside pipelining, the schedule the planner's own choice (interleaved 1F1B, several stages a
# rank on 2 layers): no stage starts at the rotary table (it reads only the positions cp hands in)
LAYOUTS |= {"cp2_pp2": (4, {"cp": 2, "pp": 2, "schedule": "interleaved_1f1b"})}  # chunks a rank: the planner's
CP_CASES = [("LLaMA", "cp2_pp2", "none")]


def _plan(name: str, schedule: str, variant: str = "", *, cells: dict[str, str] = FAMILIES):
    """The planner's pp=2 plan under ``schedule``; ``variant`` "bf16" (autocast), "fused" (the fused head) or "v3"
    (three chunks a rank)."""
    src = run_model_cell(cells[name], {}).source
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), global_batch=graph.batch_size,
                   fix={"pp": 2, "schedule": schedule, "amp": "bf16" if variant == "bf16" else "none",
                        "fused_loss": variant == "fused"} | ({"virtual_stages": 3} if variant == "v3" else {}))
    return src, plan


@pytest.fixture(scope="module")
def runs():
    planned = {case: _plan(*case) for case in CASES + FUSED_CASES}
    return dict(zip(planned, zip(planned.values(), verify_many(list(planned.values()), steps=STEPS, nproc=2),
                                 strict=True), strict=True))


def _tp_plan(name: str, layout: str, amp: str):
    """The planner's plan for family ``name`` under ``layout`` (LAYOUTS) and ``amp``: one layer a
    stage."""
    from memcells import CELLS

    nproc, fix = LAYOUTS[layout]
    layers = fix["pp"] * fix.get("virtual_stages", 1)
    src = run_model_cell(CELLS[name](hidden=64, layers=layers, seq=32, batch=8), {}).source
    model, inputs, _ = src.build(device="meta")
    plan = ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", 1, nproc), global_batch=8,
                   fix=fix | {"amp": amp})
    return src, plan


@pytest.fixture(scope="module")
def tp_runs():
    """case -> ((source, plan), report) of TP_CASES, ZB_CASES, EP_CASES and CP_CASES: one launch of 4 processes, one
    of 8, each made when a test first asks for one of its cases."""
    launched: dict[int, dict] = {}

    def run(case):
        nproc = LAYOUTS[case[1]][0]
        if nproc not in launched:
            planned = {c: _tp_plan(*c) for c in TP_CASES + ZB_CASES + EP_CASES + CP_CASES
                       if LAYOUTS[c[1]][0] == nproc}
            reports = verify_many(list(planned.values()), steps=STEPS)
            pairs = zip(planned.values(), reports, strict=True)
            launched[nproc] = dict(zip(planned, pairs, strict=True))
        return launched[nproc][case]
    return run


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: "-".join(c))
def test_tensor_parallel_stages_train_like_one_process(tp_runs, case):
    """Hugging Face decoders with TP inside their pipeline stages train like one process.

    Each failed before: a traced RMSNorm returned its input beside its result (the block's
    residual, read through a no-op float32 cast), so sequence parallelism met a list; traced
    blocks took the hidden states last, and the TP plan laid out the rotary cos in their place;
    GPT-2's traced attention split c_attn's output at its global width, and the first stage
    split the bare module naming its tied lm_head; under FSDP, GPT-2's packed c_attn bias was
    gathered out of order, Mixtral's experts cast their input to the float32 traced for the
    weights' bf16, and bf16 activations were received into float32 buffers (NaN losses, which
    verify let pass)."""
    (src, plan), report = tp_runs(case)
    print(plan.summary())
    print(report)
    name, layout, amp = case
    m, fix = plan.mesh, LAYOUTS[layout][1]
    expected = (fix.get("dp", 1), 2, 2, fix.get("zero_stage", 0))
    assert (m.dp, m.tp, m.pp, m.zero_stage) == expected
    assert plan.pipeline.schedule == fix["schedule"] and plan.precision.amp == amp
    # the last stage's loss runs on the head's vocabulary shards (torch's loss_parallel)
    assert plan.loss_parallel and not plan.fused_loss
    if name in ("LLaMA", "Qwen2"):
        assert plan.layer("model.layers.0").sequence_parallel, "the planner's choice, relied on"
    if name == "GPT-2":  # up to the blocks: ln_f gathers the sequence (its view(-1, T, C) after it is global)
        assert plan.layer("transformer.h.0").sequence_parallel and not plan.layer("transformer.ln_f").sequence_parallel
    assert report.ok, f"{plan.summary()}: {report}"
    assert len(report.steps) == STEPS
    model, _, _ = src.build(device="meta")
    whole = sum(p.numel() for p in model.parameters())
    for info in report.per_rank:
        assert 0 < info["local_numel"] < whole and info["dtensor_params"], (info, whole)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ZB_CASES, ids=lambda c: "-".join(c))
def test_fsdp_stages_under_split_backward_schedules_train_like_one_process(tp_runs, case):
    """ZeRO-3 stages under ZBV and interleaved zero bubble (dp=2 x pp=2, 2 stages a rank) train
    like one process. Before, each unit resharded after its forward, so the input pass
    (torch's ``stage_backward_input``) found the sharded parameters and hooked nothing for the
    weight pass: the last stage had no gradients after the reduction, the middle ones wrong
    ones (verify: MISMATCH, "no gradient in the parallel run for" layer 3 and the head); the
    units now stay gathered after forward, as ZeRO-2's."""
    from autopar_nb.export.values import script_values

    (src, plan), report = tp_runs(case)
    print(plan.summary())
    print(report)
    m, pl = plan.mesh, plan.pipeline
    assert (m.dp, m.tp, m.pp, m.zero_stage, pl.virtual_stages) == (2, 1, 2, 3, 2)
    assert pl.schedule == LAYOUTS[case[1]][1]["schedule"]
    assert report.ok and not report.missing, f"{plan.summary()}: {report}"
    assert len(report.steps) == STEPS
    assert sorted(s for info in report.per_rank for s in info["stages"]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert not script_values(src, plan).reshard_after_forward


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: "-".join(c))
def test_interleaved_chunks_beside_context_parallelism_train_like_one_process(tp_runs, case):
    """A Hugging Face LLaMA of 2 layers planned with cp=2 x pp=2 under interleaved 1F1B, the chunks a rank left to
    the planner (free, the schedule is 1F1B now: the cpu preset's handoffs): the rotary table stays in the
    embedding's stage, and it trains like one process. It cut a stage
    before the rotary table (3 chunks a rank, a layer each), whose stage then ran first and was called without the
    hidden states ("forward() missing 2 required positional arguments")."""
    (src, plan), report = tp_runs(case)
    print(plan.summary())
    print(report)
    stage = {lp.path: lp.stage for lp in plan.layers}
    assert (plan.mesh.cp, plan.mesh.pp) == (2, 2) and plan.pipeline.virtual_stages > 1, plan.summary()
    assert stage["model.rotary_emb"] == stage["model.embed_tokens"], stage
    assert report.ok and len(report.steps) == STEPS, f"{plan.summary()}: {report}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", EP_CASES, ids=lambda c: "-".join(c))
def test_expert_parallel_stages_train_like_one_process(tp_runs, case):
    """Mixtral with each stage's experts split over the stage's data-parallel ranks (ep=2 x pp=2) trains like one
    process, each rank holding half of its stage's experts. Before, the planner refused the pair, and the stages,
    traced graphs, had no experts modules for ``apply_ep`` to split (``InterpreterModule`` has no ``num_experts``):
    ``experts_in_stages`` gives them the model's own."""
    (src, plan), report = tp_runs(case)
    print(plan.summary())
    print(report)
    fix = LAYOUTS[case[1]][1]
    m = plan.mesh
    assert (m.dp, m.ep, m.tp, m.pp, m.zero_stage) == (2, 2, 1, 2, fix["zero_stage"])
    assert plan.pipeline.schedule == fix["schedule"] and plan.precision.amp == case[2]
    assert report.ok and not report.missing, f"{plan.summary()}: {report}"
    assert len(report.steps) == STEPS
    model, _, _ = src.build(device="meta")
    whole = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    firsts = report.per_rank[::2]  # data-parallel rank 0 of each pipeline rank: every stage once
    held = sum(info["local_numel"] for info in firsts)
    if m.zero_stage == 0:  # the experts halved, the rest whole
        assert held == whole - experts // 2, (report.per_rank, whole, experts)
    else:  # everything halved: the experts by ep, the rest by FSDP
        assert abs(held - whole // 2) <= 64 * len(firsts), (report.per_rank, whole)
    assert all(info["dtensor_params"] for info in report.per_rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_planned_pipeline_trains_like_one_process(runs, case):
    (src, plan), report = runs[case]
    print(plan.summary())
    print(report)
    assert plan.mesh.pp == 2 and plan.pipeline.schedule == case[1] and plan.precision.amp == (
        "bf16" if case[2:] == ("bf16",) else "none")
    assert len({lp.stage for lp in plan.layers}) == 2 * plan.pipeline.virtual_stages
    assert report.ok, f"{plan.summary()}: {report}"
    assert len(report.steps) == STEPS
    model, _, _ = src.build(device="meta")
    whole = sum(p.numel() for p in model.parameters())
    assert all(0 < info["local_numel"] < whole for info in report.per_rank), (report.per_rank, whole)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "-".join(c))
def test_pipeline_with_the_fused_head_trains_like_one_process(runs, case):
    """The last stage ends at the head's input and its loss is kernels_ext's fused linear + cross-entropy with the
    stage's own head weight; loss and gradients as the unfused model's in one process (GPT-2's tied copies summed:
    ``TiedGradients``)."""
    (src, plan), report = runs[case]
    assert plan.fused_loss == "lm_head" and plan.mesh.pp == 2 and plan.pipeline.schedule == case[1]
    assert report.ok, f"{plan.summary()}: {report}"
    assert len(report.steps) == STEPS


@pytest.mark.multiprocess
def test_exported_fused_pipeline_script_runs_under_torchrun(runs, tmp_path):
    """GPT-2 (tied head) with the fused head under ZBV, from the exported script: the head fused before the trace,
    the last stage holding it."""
    from autopar_nb.export import export, render_script

    (src, plan), _ = runs[("GPT-2", "zbv_zero_bubble", "fused")]
    text = render_script(src, plan)
    body = text[text.index("def parallelize("):]
    assert body.index("apply_fused_loss(model, FUSED_LOSS)") < body.index("loss_head=FUSED_LOSS)")
    assert _torchrun(src, plan, tmp_path / "train_gpt2_fused.py", export) == "ok"


@pytest.mark.multiprocess
def test_exported_pipeline_script_runs_under_torchrun(runs, tmp_path):
    """T5 (encoder-decoder, labels in the batch) interleaved over 2 ranks, from the exported script."""
    from autopar_nb.export import export

    (src, plan), _ = runs[("T5", "interleaved_1f1b")]
    assert _torchrun(src, plan, tmp_path / "train_t5.py", export) == "ok"


# exported scripts run one after another in ONE torchrun launch (each launch costs seconds), in one process group
RUN_SCRIPTS = """\
import gc
import os
import runpy
import sys

import torch
import torch.distributed as dist


class OwnWeightsOnly:  # after each step: no real parameter alive but those of the rank's own stages

    def after_backward(self, step, parts, loss):
        pass

    def after_step(self, step, parts):
        mine = {t.untyped_storage().data_ptr() for p in parts for t in (*p.parameters(), *p.buffers())}
        others = [tuple(o.shape) for o in gc.get_objects() if type(o) is torch.nn.Parameter and not o.is_meta
                  and o.untyped_storage().nbytes() and o.untyped_storage().data_ptr() not in mine]
        assert not others, f"rank {dist.get_rank()} holds parameters of other stages: {others}"


dist.init_process_group("gloo")  # each script's main() finds it and leaves it open
for script in sys.argv[1:]:
    if dist.get_rank() == 0:
        print(f"== {script}", flush=True)
    main = runpy.run_path(script, run_name="__one_of_several__")["main"]
    sys.modules[os.path.basename(script)[:-3] + "_runtime"].Run.observer = OwnWeightsOnly()  # train() calls it
    main(["--steps", "2"])
    gc.collect()
gc.collect()  # a gloo thread taking the GIL during shutdown aborts some exits otherwise
dist.destroy_process_group()
"""
# dropout off: the two builds leave the random stream in different states (the meta one re-seeds to initialise)
META_CELLS = FAMILIES | {"GPT-2": FAMILIES["GPT-2"].replace("n_head=4", "n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, "
                                                                     "attn_pdrop=0.0")}
# LLaMA: rotary inv_freq, position ids made on the device; a V (two stages a rank); GPT-2: wte on rank 0, its tied
# lm_head copy on rank 1; Mixtral: its expert counting branches on the device type
META_CASES = [("LLaMA", "1f1b"), ("LLaMA", "zbv_zero_bubble"), ("GPT-2", "1f1b"), ("Mixtral", "1f1b")]


@pytest.mark.multiprocess
def test_meta_init_pipeline_scripts_start_as_the_real_ones(tmp_path):
    """``export(meta_init=True)`` with pipelining: each rank builds the model on meta and initialises the stages it
    holds; the first two steps' losses equal those of the script that builds the model for real (same seed).
    Before, every such script failed (the stages were traced on meta: runtime/pp.py ``weights_on``). Each rank,
    after its first step, holds no parameter but its own stages' (before, a real-built GPT-2 kept pipeline()'s copy
    of the tied embedding on both ranks, in the traced leaves ``split_model`` replaces)."""
    from autopar_nb.export import export

    scripts = []
    for name, schedule in META_CASES:
        src, plan = _plan(name, schedule, cells=META_CELLS)
        for meta in (False, True):
            path = tmp_path / f"train_{name.replace('-', '')}_{schedule}_{'meta' if meta else 'real'}.py"
            scripts.append(export(src, plan, path, steps=2, quiet=True, meta_init=meta).script)
    (tmp_path / "run_scripts.py").write_text(RUN_SCRIPTS)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "run_scripts.py", *map(str, scripts)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    losses = {}  # script name -> its printed losses
    for chunk in proc.stdout.split("== ")[1:]:
        script, _, out = chunk.partition("\n")
        losses[os.path.basename(script)] = re.findall(r"step \d+ \| loss (\S+)", out)
    print("\n".join(f"{name}: {values}" for name, values in losses.items()))
    for real, meta in zip(scripts[::2], scripts[1::2], strict=True):
        assert len(losses[real.name]) == 2 and losses[meta.name] == losses[real.name], (meta.name, losses)


def test_planner_offers_pipelining_for_hugging_face_models():
    """Unpinned, the planner may choose pp for these models: nothing refuses pp=2 any more."""
    for name in ("LLaMA", "GPT-2", "T5"):
        src = run_model_cell(FAMILIES[name], {}).source
        model, inputs, _ = src.build(device="meta")
        assert profile(ap.capture(model, inputs), device_kind="cpu").pp_blocker == ""


ZOO_MOE_CELL = """\
import torch
from autopar_nb import zoo
model = zoo.MoETransformer(zoo.MoEConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128,
                                         n_routed_experts=4, n_shared_experts=1, top_k=2, moe_ffn_dim=32))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""


@pytest.mark.parametrize("name", ["LLaMA", "Mixtral", "GPT-2", "T5", "Phi", "zoo Llama", "zoo GPT", "zoo MoE"])
def test_no_offered_pipeline_starts_a_stage_where_the_stages_lose_their_order(name):
    """A stage starts only at a layer that reads what the layer before it computed (or the code after that layer),
    and at a layer's first call: else nothing orders its stage after the one before, and torch's split may run it
    first (a Hugging Face rotary table reads only positions, which context parallelism hands in: its stage ran before
    the embedding's, "forward() missing 2 required positional arguments"). Every pp=2 plan the planner offers (its
    own schedule, interleaved 1F1B at each chunk count it takes, their alternatives) keeps those layers with the one
    before; GPT-2's learned position embedding may start a stage (the code after it adds the token embedding). A
    stage starts at a layer with parameters of its own, so none is left without any (Phi's embed_dropout and
    rotary_emb made a stage of their own, which DDP refused to wrap)."""
    from runtime_cases import GPT_CELL, LLAMA_CELL

    from autopar_nb.plan import PlanError

    cell = {"zoo Llama": LLAMA_CELL, "zoo GPT": GPT_CELL, "zoo MoE": ZOO_MOE_CELL}.get(name) or FAMILIES[name]
    model, inputs, _ = run_model_cell(cell, {}).source.build(device="meta")
    graph = ap.capture(model, inputs)
    glued = profile(graph, device_kind="cpu").pp_glued
    paths, modules = [lay.path for lay in graph.layers], dict(model.named_modules())
    expected = {"LLaMA": {"model.rotary_emb"}, "Mixtral": {"model.rotary_emb"},
                "GPT-2": {"transformer.drop", "lm_head"},  # lm_head's weight is wte's (tied)
                "Phi": {"model.embed_dropout", "model.rotary_emb"},
                "T5": {"encoder.dropout", "decoder.dropout", "shared", "decoder.embed_tokens", "lm_head"},
                }.get(name, set())
    assert {paths[i] for i in glued} == expected, glued
    plans = []
    for fix in [{}] + [{"schedule": "interleaved_1f1b", "virtual_stages": v} for v in (2, 3, 4)]:
        try:
            plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), global_batch=graph.batch_size,
                           fix={"pp": 2, "amp": "none"} | fix)
        except PlanError as e:
            assert fix and "pipeline stages" in str(e), e  # more chunks than places a stage may start at
            continue
        plans += [plan, *plan.alternatives]
    assert any(p.pipeline.virtual_stages > 1 for p in plans)
    for plan in (p for p in plans if p.mesh.pp > 1):
        stage = [lp.stage for lp in plan.layers]
        assert all(stage[i] == stage[i - 1] for i in glued), (plan.summary(), stage)
        assert len(set(stage)) == plan.mesh.pp * plan.pipeline.virtual_stages
        held = {}  # what each stage's modules hold, tied weights included (T5's embeddings hold `shared`'s)
        for lay, lp in zip(graph.layers, plan.layers, strict=True):
            held[lp.stage] = held.get(lp.stage, 0) + sum(w.numel() for w in modules[lay.path].parameters())
        assert all(held.values()), (plan.summary(), held)


def test_stages_hold_what_tensor_parallel_styles_expect():
    """In a traced stage the TP styles meet what they meet unpipelined: LLaMA's norms are its own
    RMSNorm modules (traced, one returned its input too: the block's residual, read through a
    no-op float32 cast), its traced decoder layer and attention take the hidden states first
    (PrepareFirstInput lays out a module's first input), and GPT-2's traced attention cuts
    c_attn's output into 3 equal parts of whatever width a rank holds."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from autopar_nb.runtime.pp_graph import equal_parts
    from autopar_nb.runtime.pp_split import split_model
    from autopar_nb.runtime.train import switch_off_kv_cache

    def first_input(traced):
        return next(n for n in traced.graph.nodes if n.op == "placeholder")

    model, inputs, _ = run_model_cell(FAMILIES["LLaMA"], {}).source.build(device="cpu")
    switch_off_kv_cache(model)
    stages, _ = split_model(model, boundaries=["model.layers.1"], microbatch=(inputs, {}))
    for i, stage in enumerate(stages):
        layer = stage.get_submodule(f"model.layers.{i}")
        assert isinstance(layer.input_layernorm, LlamaRMSNorm), type(layer.input_layernorm)
        assert isinstance(layer.post_attention_layernorm, LlamaRMSNorm)
        assert [u.target for u in first_input(layer).users][0] == "input_layernorm"
        projections = {u.target for u in first_input(layer.self_attn).users}
        assert projections >= {"q_proj", "k_proj", "v_proj"}, projections
    assert isinstance(stages[1].get_submodule("model.norm"), LlamaRMSNorm)

    model, inputs, _ = run_model_cell(FAMILIES["GPT-2"], {}).source.build(device="cpu")
    switch_off_kv_cache(model)
    stages, _ = split_model(model, boundaries=["transformer.h.1"], microbatch=(inputs, {}))
    attn = stages[0].get_submodule("transformer.h.0.attn")
    assert [n.args[1:] for n in attn.graph.nodes if n.target is equal_parts] == [(3, 2)]


NANOGPT_HEADS_CELL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from autopar_nb.zoo import GPT, GPTConfig


class Attention(nn.Module):  # nanoGPT's own: the heads read from self.n_head
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn, self.c_proj = nn.Linear(cfg.n_embd, 3 * cfg.n_embd), nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
model = GPT(cfg)
for block in model.h:
    block.attn = Attention(cfg)
example_inputs = (torch.randint(0, 64, (4, 16)),)
"""


@pytest.mark.parametrize("name", ["T5", "nanoGPT"])
def test_tensor_parallel_stages_that_need_heads_per_rank_are_refused(name):
    """T5 (``zeros(1, self.n_heads, q, k)``) and nanoGPT (``view(B, T, self.n_head, -1)``) compute
    from their head counts, which a traced stage fixes at the global value: TP inside their
    stages is refused before anything runs (T5's stage failed on a shape, nanoGPT's would have
    split its heads wrong) -- by the planner, which ran the layout on the stand-in, and by export
    for a plan made without that run (a graph with no stand-in)."""
    from autopar_nb.export.values import script_values
    from autopar_nb.plan import PlanError
    from autopar_nb.source import ModelSource

    src = ModelSource(NANOGPT_HEADS_CELL) if name == "nanoGPT" else run_model_cell(FAMILIES[name], {}).source
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    cluster, fix = ap.Cluster.preset("cpu", 1, 4), {"tp": 2, "pp": 2}
    with pytest.raises(PlanError, match="heads per rank"):
        ap.plan(graph, cluster, global_batch=graph.batch_size, fix=fix)
    graph.stand_in, graph.tp_stage_refused = None, {}
    plan = ap.plan(graph, cluster, global_batch=graph.batch_size, fix=fix)
    with pytest.raises(NotImplementedError, match="heads per rank"):
        script_values(src, plan)


def test_stages_read_only_the_previous_stage():
    """T5 cut into 4 stages (values cross up to 3 cuts: the encoder output, masks, position bias, labels): each stage
    takes exactly the previous one's outputs, and run one after another they give the model's loss and logits."""
    import operator

    import torch
    from torch.utils._pytree import tree_unflatten

    from autopar_nb.runtime.pp_split import split_model
    from autopar_nb.runtime.train import switch_off_kv_cache

    model, inputs, _ = run_model_cell(FAMILIES["T5"], {}).source.build(device="cpu")
    model.eval()  # no dropout: the same numbers both ways
    switch_off_kv_cache(model)  # as the script does
    expected = model(**inputs)
    stages, whole = split_model(model, boundaries=["encoder.block.1", "decoder.block.0", "decoder.block.1"],
                                microbatch=((), inputs))
    calls = [n for n in whole.split_gm.graph.nodes if n.op == "call_module"]
    for prev, node in zip(calls, calls[1:], strict=False):
        assert all(a.target is operator.getitem and a.args == (prev, i) for i, a in enumerate(node.args))
        assert len(node.args) == len(prev.users)
    out = stages[0](**inputs)
    for stage in stages[1:]:
        out = stage(*out)
    got = tree_unflatten(list(out), stages[-1].output_spec)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)


@pytest.mark.parametrize("first", ["encoder.final_layer_norm", "decoder.block.1"])
def test_cost_model_sends_what_the_stages_receive(first):
    """The values the cost model has crossing a cut (``profile``'s ``crossings``, the pipeline buffers it costs) are
    those ``split_model`` makes the next stage take. T5's stacks call their dropout a second time after the final
    norm: that call stays where it runs, so the encoder's output is not sent beside the final norm's input."""
    from autopar_nb.runtime.pp_split import split_model
    from autopar_nb.runtime.train import switch_off_kv_cache

    src = run_model_cell(FAMILIES["T5"], {}).source
    meta, meta_inputs, _ = src.build(device="meta")
    graph = ap.capture(meta, meta_inputs)
    k = [lay.path for lay in graph.layers].index(first)
    predicted = profile(graph, device_kind="cpu").crossings[k]
    model, inputs, _ = src.build(device="cpu")
    switch_off_kv_cache(model)
    stages, _ = split_model(model, boundaries=[first], microbatch=((), inputs))
    received = [n.name for n in stages[1].graph.nodes if n.op == "placeholder" and not n.name.startswith("_")]
    assert len(predicted) == len(received), received


@pytest.mark.parametrize("name", ["ViT", "BERT"])
def test_stages_pass_no_mask_where_eager_makes_none(name):
    """Without a padding mask, Hugging Face's eager forward gives SDPA no mask at all (an encoder) and its graph under
    ``torch.export`` an all-True one, which every layer would read and the first stage would send on (``runtime/pp.py``
    masks_as_in_eager): the stages' SDPA calls take no mask, and only the hidden states (and labels) cross the cut.
    A padding mask in the batch still goes through as a mask."""
    import torch

    from autopar_nb.runtime.pp_graph import scaled_dot_product_attention
    from autopar_nb.runtime.pp_split import split_model
    from autopar_nb.runtime.train import switch_off_kv_cache

    def masks(stages):  # the traced op, called through F.scaled_dot_product_attention (attention_called_late)
        calls = [n for s in stages for m in s.modules() if hasattr(m, "graph") for n in m.graph.nodes
                 if n.op == "call_function" and n.target is scaled_dot_product_attention]
        return calls, [n for n in calls if len(n.args) > 3 and n.args[3] is not None or "attn_mask" in n.kwargs]

    model, inputs, _ = run_model_cell(FAMILIES[name], {}).source.build(device="cpu")
    switch_off_kv_cache(model)
    first = "vit.layers.1" if name == "ViT" else "bert.encoder.layer.1"
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    stages, _ = split_model(model, boundaries=[first], microbatch=(args, kwargs))
    calls, masked = masks(stages)
    assert len(calls) == 2 and not masked, [n.format_node() for n in masked]
    crossing = [n for n in stages[1].graph.nodes if n.op == "placeholder" and not str(n.target).startswith("*")]
    assert len(crossing) == 1 + ("labels" in kwargs), [n.name for n in crossing]
    if name == "BERT":  # a padding mask: the original way
        model, _, _ = run_model_cell(FAMILIES[name], {}).source.build(device="cpu")
        switch_off_kv_cache(model)
        pad = torch.ones_like(args[0])
        pad[:, -2:] = 0
        padded = {"input_ids": args[0], "attention_mask": pad}
        stages, _ = split_model(model, boundaries=[first], microbatch=((), padded))
        calls, masked = masks(stages)
        assert len(masked) == 2, [n.format_node() for n in calls]


@pytest.mark.parametrize("schedule", ["zbv_zero_bubble", "interleaved_1f1b"])
def test_cost_model_places_each_stage_on_the_rank_that_runs_it(schedule):
    """A V puts stages r and 2 pp - 1 - r on rank r (``runtime/pp.py``'s ``stage_ids``; ``plan.stage_rank``), so
    rank 0 holds the first and the last stage (the head); interleaving puts stage s on rank s % pp. Each rank's
    predicted parameters are those of the layers of its stages, tied copies included."""
    from autopar_nb.cost import estimate
    from autopar_nb.plan import stage_rank
    from autopar_nb.runtime.pp import stage_ids

    src, plan = _plan("LLaMA", schedule)
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    prof = profile(graph, device_kind="cpu")
    n = plan.mesh.pp * plan.pipeline.virtual_stages
    numel = [0, 0]
    for lp, layer in zip(prof.layers, plan.layers, strict=True):
        r = stage_rank(layer.stage, plan.mesh.pp, n, schedule)
        assert layer.stage in stage_ids(r, plan.mesh.pp, n, schedule)
        numel[r] += lp.params_split + lp.params_rep
    cost = estimate(graph, ap.Cluster.preset("cpu", gpus_per_node=2), plan)
    assert [mb.params for mb in cost.memory_by_rank] == pytest.approx([4 * x for x in numel]), (numel, schedule)


def test_the_zoo_gpt_takes_tensor_parallel_stages():
    """The zoo GPT counts its heads from the width (``view(B, T, -1, head_dim)``), so a rank's stage trace holds no
    global head count: tp x pp is planned and exported (export refused it while the attention read ``self.n_head``;
    verified against one process on 4 gloo processes when the change was made, loss rel 5.5e-8)."""
    from runtime_cases import GPT_CELL

    from autopar_nb.export.values import script_values
    from autopar_nb.source import ModelSource

    src = ModelSource(GPT_CELL)
    model, inputs, _ = src.build(device="meta")
    graph = ap.capture(model, inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", 1, 4), global_batch=graph.batch_size, fix={"tp": 2, "pp": 2})
    assert (plan.mesh.tp, plan.mesh.pp) == (2, 2)
    assert script_values(src, plan).local_sizes == {"h.*.attn": {"n_embd": 16}}
