"""The fused output head + loss: runtime/fused_loss.py (kernels_ext's chunked op against the unfused default loss:
same loss and gradients, same parameter names), and plan.fused_loss as the planner's choice: cost/loss.py's head
and memory terms against a closed form, a plan that fits only fused, the plan field and fix key, the exported script
(ruff-clean) and verify of a fused ZeRO-3 plan on 2 gloo processes. Under pipelining (the head on the last stage,
which ends at its input): the last stage's peak memory measured (the profiler's allocation events, which see inside
the fused op), against the unfused stage's and the cost model's; its 2-process runs are in test_pp_families.py."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_compile import LM_CELL, lm_source

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost import factors_for
from autopar_nb.cost.loss import fused_head
from autopar_nb.export import render_script
from autopar_nb.plan import Plan, PlanError, normalize_fix
from autopar_nb.runtime.data import default_loss
from autopar_nb.runtime.fused_loss import LinearCrossEntropyHead, apply_fused_loss, fused_default_loss
from autopar_nb.source import ModelSource


@pytest.mark.parametrize("causal", [True, False])
def test_fused_head_and_loss_equal_the_default_loss(causal):
    ns = lm_source(vocab=300, dim=16).run(seed=0)
    model, (ids,) = ns["model"], ns["example_inputs"]
    fused = copy.deepcopy(model)
    names = list(fused.state_dict())
    head = apply_fused_loss(fused, "head")
    assert isinstance(fused.head, LinearCrossEntropyHead) and head is fused.head
    assert list(fused.state_dict()) == names, "the same weight Parameter under the same name"
    results = []
    for m, fn in ((model, default_loss), (fused, fused_default_loss)):
        loss = fn(m, (ids,), causal=causal)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6)
    assert head.target is None and fused(ids).shape == (*ids.shape, 300), "outside the loss: logits, as before"


def test_apply_fused_loss_refuses_what_is_not_a_bias_free_linear():
    model = lm_source().run(seed=0)["model"]
    with pytest.raises(ValueError, match="bias-free nn.Linear.*with a bias"):
        apply_fused_loss(model, "layers.0.up")
    with pytest.raises(ValueError, match="found LayerNorm"):
        apply_fused_loss(model, "norm")
    with pytest.raises(ValueError, match="needs a model whose head apply_fused_loss replaced"):
        fused_default_loss(model, (torch.zeros(2, 4, dtype=torch.long),))


# ---- the planner's half: plan.fused_loss ----------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _graph(src):
    model, inputs, _ = src.build(device="meta")
    return ap.capture(model, *inputs)


def _cluster(name="h100-80gb", gpus=1, memory=None):
    c = ap.Cluster.preset(name, 1, gpus)
    return c if memory is None else dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=memory))


def test_fused_head_is_the_bias_free_linear_whose_logits_are_the_output():
    head, why = fused_head(_graph(lm_source(vocab=300, dim=16, batch=2, seq=8)))
    assert why == "" and (head.module, head.layer, head.hidden, head.vocab, head.tokens) == ("head", 4, 16, 300, 16)
    small = LM_CELL.replace("VOCAB", "64").replace("DIM", "32").replace("BATCH", "2").replace("SEQ", "8")
    biased = ModelSource(small.replace("bias=False", "bias=True"))
    assert fused_head(_graph(biased)) == (None, "the output head head is not a bias-free nn.Linear")
    scaled = ModelSource(small.replace("return self.head(self.norm(x))", "return self.head(self.norm(x)) * 2"))
    assert "is not the model's output (the model transforms its logits)" in fused_head(_graph(scaled))[1]
    mlp = ap.capture(zoo.SeedMLP(), torch.randn(4, 1024))
    assert "not token ids" in fused_head(mlp)[1]


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_fused_memory_is_the_closed_form(amp):
    """One GPU, no recompute: both peaks are the loss's backward (unfused: fp32 log-softmax saved, its gradient and
    the logits' gradient, and under AMP the 16-bit logits that autocast casts to fp32 for the loss, as
    cost/autocast.py counts them; fused: one fp32 log-sum-exp per token, three fp32 chunk x vocab buffers (+ a
    16-bit one under AMP), the weight's gradient in fp32 (+ its cast), the hidden's gradient), so the peaks differ
    by exactly the difference of those, times the allocator margin."""
    n, h, v, chunk = 4 * 256, 32, 4096, 256  # tokens, hidden, vocab, kernels_ext.default_chunk(1024, 32, 4096)
    graph = _graph(lm_source(vocab=v, dim=h, batch=4, seq=256))
    fix = {"dp": 1, "recompute": "none", "amp": amp}
    unfused = ap.plan(graph, _cluster(), fix=fix | {"fused_loss": False})
    fused = ap.plan(graph, _cluster(), fix=fix | {"fused_loss": True})
    assert (unfused.fused_loss, fused.fused_loss) == ("", "head")
    p, half = (2, 2) if amp == "bf16" else (4, 0)
    unfused_loss = n * v * (4 + 4 + p + half)  # under autocast the 16-bit logits are held beside their fp32 copy
    fused_loss = n * 4 + chunk * v * (3 * 4 + half) + v * h * (4 + half) + n * h * p
    assert fused_loss < unfused_loss / 2
    margin = 1 + factors_for(_cluster()).margin_fraction
    assert unfused.cost.peak_memory_bytes - fused.cost.peak_memory_bytes == pytest.approx(
        (unfused_loss - fused_loss) * margin, rel=1e-9)
    # time: the head's matmul once more (2 N H V FLOPs), the rest unchanged
    assert fused.cost.hardware_tflops_per_gpu * fused.cost.step_time_s == pytest.approx(
        unfused.cost.hardware_tflops_per_gpu * unfused.cost.step_time_s + 2 * n * h * v / 1e12, rel=1e-9)
    # the GPU's part (at this size the host's issue time decides the step, the same for both: cost/cpu.py)
    assert fused.cost.compute_s > unfused.cost.compute_s and fused.cost.step_time_s >= unfused.cost.step_time_s


@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_vocab_parallel_fused_memory_and_time_are_the_closed_form(amp):
    """tp=2: the unfused head is vocab-parallel with torch's loss_parallel (the fp32 log-softmax of a rank's logits
    shard saved and three fp32 temporaries of it, as the cost model counts it from MemTracker); the fused one keeps
    one fp32 log-sum-exp per token, and its chunk buffers and weight gradient cover a rank's V / 2 rows. The logits
    computed again in backward: 2 N H V / 2 FLOPs per rank."""
    n, h, v, chunk = 4 * 256, 32, 4096, 256
    graph = _graph(lm_source(vocab=v, dim=h, batch=4, seq=256))
    fix = {"dp": 1, "tp": 2, "recompute": "none", "amp": amp}
    unfused = ap.plan(graph, _cluster(gpus=2), fix=fix | {"fused_loss": False})
    fused = ap.plan(graph, _cluster(gpus=2), fix=fix | {"fused_loss": True})
    assert (unfused.loss_parallel, fused.loss_parallel, fused.fused_loss) == (True, False, "head")
    p, half, rows = (2, 2, v // 2) if amp == "bf16" else (4, 0, v // 2)
    unfused_loss = n * v * 4 * 4 / 2
    fused_loss = n * 4 + chunk * rows * (3 * 4 + half) + rows * h * (4 + half) + n * h * p
    margin = 1 + factors_for(_cluster()).margin_fraction
    assert unfused.cost.peak_memory_bytes - fused.cost.peak_memory_bytes == pytest.approx(
        (unfused_loss - fused_loss) * margin, rel=1e-9)
    assert fused.cost.hardware_tflops_per_gpu * fused.cost.step_time_s == pytest.approx(
        unfused.cost.hardware_tflops_per_gpu * unfused.cost.step_time_s + 2 * n * h * v / 2 / 1e12, rel=1e-9)


def test_planner_fuses_the_loss_to_fit_a_plan_that_does_not_fit_unfused():
    graph = _graph(lm_source(vocab=4096, dim=32, batch=4, seq=256))
    fix = {"dp": 2, "zero_stage": 3, "recompute": "none", "micro_batches": 1}
    peaks = [ap.plan(graph, _cluster("cpu", 2), fix=fix | {"fused_loss": f}).cost.peak_memory_bytes
             for f in (False, True)]
    assert peaks[1] < 0.75 * peaks[0]
    limit = (peaks[0] + peaks[1]) / 2 * 2  # the cpu preset divides the host's memory among its 2 ranks
    with pytest.raises(PlanError, match="nothing fits"):
        ap.plan(graph, _cluster("cpu", 2, limit), fix=fix | {"fused_loss": False})
    plan = ap.plan(graph, _cluster("cpu", 2, limit), fix=fix)
    assert plan.fused_loss == "head" and plan.cost.peak_memory_bytes <= limit / 2
    assert "fused-loss" in plan.summary()
    text = plan.explain()
    assert "Output head head fused with the loss (chosen, kernels_ext.linear_cross_entropy)" in text
    assert "unfused, this split needs" in text and "over the limit" in text
    # with room to spare the planner keeps the unfused loss (one head matmul less)
    assert ap.plan(graph, _cluster("cpu", 2), fix=fix).fused_loss == ""
    # a cell with its own loss_fn is never fused
    with pytest.raises(PlanError, match="nothing fits"):
        ap.plan(graph, _cluster("cpu", 2, limit), fix=fix, default_loss=False)


def test_fused_loss_field_and_fix_key():
    graph = _graph(lm_source())
    plan = ap.plan(graph, _cluster("h100-80gb", 2), fix={"dp": 2, "fused_loss": True})
    assert Plan.from_json(plan.to_json()).fused_loss == "head"
    assert [str(c) for c in plan.diff(ap.plan(graph, _cluster("h100-80gb", 2), fix={"dp": 2}))] == [
        "fused_loss: 'head' -> ''"]
    d = plan.to_dict()
    for bad, match in (({"fused_loss": "no such"}, "fused_loss='no such' is not a module path"),
                       ({"fused_loss": True}, "fused_loss must be a string"),
                       ({"loss_parallel": True}, "fused_loss='head' with loss_parallel=true")):
        with pytest.raises(PlanError, match=match):
            Plan.from_dict(d | bad)
    assert Plan.from_dict(d | {"mesh": d["mesh"] | {"dp": 1, "tp": 2}}).fused_loss == "head", "vocab-parallel"
    piped = d | {"batch": d["batch"] | {"micro_batches": 2}}
    assert Plan.from_dict(piped | {"mesh": d["mesh"] | {"dp": 1, "pp": 2}}).fused_loss == "head", "on the last stage"
    with pytest.raises(PlanError, match="with mesh.pp=2 and mesh.tp=2: the fused head runs on the last pipeline"):
        Plan.from_dict(piped | {"mesh": d["mesh"] | {"dp": 1, "pp": 2, "tp": 2}})
    assert normalize_fix({"fused_loss": True}) == {"fused_loss": True}
    with pytest.raises(PlanError, match=r"fix\['fused_loss'\]='yes' is not supported"):
        normalize_fix({"fused_loss": "yes"})
    assert ap.plan(graph, _cluster("h100-80gb", 2), fix={"pp": 2, "dp": 1, "fused_loss": True}).fused_loss == "head"
    with pytest.raises(PlanError, match=r"pp=2 x tp=2 with fix fused_loss=True: the fused head \+ loss runs on the"):
        ap.plan(graph, _cluster("h100-80gb", 4), fix={"pp": 2, "tp": 2, "dp": 1, "fused_loss": True})
    with pytest.raises(PlanError, match="cannot be fused: the cell defines its own loss_fn"):
        ap.plan(graph, _cluster("h100-80gb", 2), fix={"fused_loss": True}, default_loss=False)
    mlp = ap.capture(zoo.SeedMLP(), torch.randn(4, 1024))
    with pytest.raises(PlanError, match="cannot be fused: the first input is not token ids"):
        ap.plan(mlp, _cluster("h100-80gb", 2), fix={"fused_loss": True})


def test_script_fuses_the_head_first_and_passes_ruff(tmp_path):
    src = lm_source()
    plan = ap.plan(_graph(src), _cluster("h100-80gb", 2),
                   fix={"dp": 2, "zero_stage": 3, "recompute": "full", "fused_loss": True})
    text = render_script(src, plan)
    assert 'FUSED_LOSS = "head"' in text and "loss = functools.partial(fused_default_loss, causal=CAUSAL)" in text
    body = text[text.index("def parallelize("):]
    assert body.index("apply_fused_loss(part, FUSED_LOSS)") < body.index("apply_ac(") < body.index("apply_fsdp(")
    assert "class LinearCrossEntropyHead" in text and "# autopar_nb/runtime/fused_loss.py" in text
    path = tmp_path / "train_fused.py"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unfused = render_script(src, ap.plan(_graph(src), _cluster("h100-80gb", 2), fix={"dp": 2}))
    # nothing of the fused head (the word itself may name other fused kernels: the offloaded optimizer's Adam)
    assert not any(w in unfused for w in ("FUSED_LOSS", "fused_default_loss", "LinearCrossEntropyHead", "fused_loss"))
    own = ModelSource(src.code + "\n\ndef loss_fn(model, batch):\n    return model(*batch).float().mean()\n",
                                loss_fn_var="loss_fn")
    with pytest.raises(PlanError, match="the cell defines its own loss_fn"):
        render_script(own, plan)


def _two_process_cases() -> dict:
    """name -> (source, plan) of the fused-head plans on 2 processes: ZeRO-3, and tp=2 with sequence parallelism on
    the test LM (301 words: 151 + 150 rows) and on LLaMA (where transformers is installed)."""
    from families import FAMILIES
    from runtime_cases import has_transformers

    cases = {}
    src = lm_source(vocab=300, dim=16)
    cases["zero3"] = (src, ap.plan(_graph(src), _cluster("cpu", 2), fix={"dp": 2, "zero_stage": 3, "fused_loss": True}))
    for family in ("lm", "LLaMA") if has_transformers() else ("lm",):
        src = lm_source(vocab=301, dim=16) if family == "lm" else ModelSource(FAMILIES[family])
        cases[family] = (src, ap.plan(_graph(src), _cluster("cpu", 2), fix={"dp": 1, "tp": 2, "fused_loss": True}))
    return cases


@pytest.fixture(scope="module")
def verified() -> dict:
    """name -> (source, plan, report) of :func:`_two_process_cases`: one launch of 2 processes, 3 steps each."""
    from autopar_nb.verify import verify_many

    cases = _two_process_cases()
    reports = verify_many(list(cases.values()), steps=3, nproc=2)
    return {name: (*case, report) for (name, case), report in zip(cases.items(), reports, strict=True)}


@pytest.mark.multiprocess
def test_verify_fused_zero3_plan_on_two_gloo_processes(verified):
    _, plan, report = verified["zero3"]
    assert plan.fused_loss == "head" and plan.mesh.zero_stage == 3
    assert report.ok, report


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["lm", "LLaMA"])
def test_verify_vocab_parallel_fused_plan_on_two_gloo_processes(verified, family):
    """tp=2 with sequence parallelism: the fused head's weight split on the vocabulary (301 words: 151 + 150 rows),
    its input gathered from the sequence shards, the loss vocab-parallel; against the unfused model in one process."""
    if family not in verified:
        pytest.skip("transformers not installed")
    src, plan, report = verified[family]
    assert plan.fused_loss and plan.mesh.tp == 2 and not plan.loss_parallel
    assert any(lp.sequence_parallel for lp in plan.layers)
    text = render_script(src, plan)
    body = text[text.index("def parallelize("):]
    assert body.index("apply_fused_loss(") < body.index("apply_tp(") < body.index("shard_fused_head(part, FUSED_LOSS")
    assert report.ok, report


# ---- under pipelining: the head on the last stage -------------------------------------------------------------------
def _peak_allocated(fn) -> int:
    """Peak bytes allocated above the start while ``fn()`` runs: the profiler's allocation events (``[memory]``,
    every CPU allocation and free, also those inside a custom op's kernel, which a dispatch-mode tracker such as
    MemTracker does not see)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _last_stage_step(model, boundaries: list[str], batch: tuple, *, fused: bool) -> dict:
    """The pipeline's last stage as the runtime builds it (``split_model``, with the fused head as its loss head, a
    ``StageLoss``): its forward from the previous stages' outputs, the loss and backward, the last two profiled;
    returns the loss, the head weight's and the stage input's gradients, and the peak bytes."""
    from autopar_nb.runtime.pp import StageLoss
    from autopar_nb.runtime.pp_split import split_model

    model = copy.deepcopy(model)
    if fused:
        apply_fused_loss(model, "lm_head")
    stages, _ = split_model(model, boundaries=boundaries, microbatch=(batch, {}),
                            loss_head="lm_head" if fused else "")
    stage_loss = StageLoss(fused_default_loss if fused else default_loss)
    stage_loss.learn(stages[-1])
    stage_loss.micro = [batch]
    out = stages[0](*batch)
    for stage in stages[1:-1]:
        out = stage(*out)
    received = [t.detach().requires_grad_(t.is_floating_point()) for t in out]  # the receive buffers
    got = {}

    def step():
        loss = stage_loss(stages[-1](*received), 0)
        loss.backward()
        got["loss"] = loss.detach()

    got["peak"] = _peak_allocated(step)
    got["head_grad"], got["input_grad"] = stages[-1].get_parameter("lm_head.weight").grad, received[0].grad
    return got


@pytest.mark.parametrize("head_alone", [True, False], ids=["head-alone", "layer-and-head"])
def test_pipelined_fused_head_never_holds_the_logits(head_alone):
    """LLaMA (hidden 64, vocab 8192), pp=2, a micro-batch of 8 x 256 = 2048 tokens, whose fp32 logits are 64 MiB:
    the last stage's forward, loss and backward peak below one logits tensor with the fused head (its chunks, 256
    tokens), at over 2.5 with the unfused one (logits, log-softmax and their gradients), with the same loss and
    gradients; the cost model's last rank has no logits (no stage output kept, no loss terms) and predicts the
    fused stage's activations and working set to 5 %. The planner puts the head alone on the last stage here; the
    other layout moves the last block there too."""
    from memcells import CELLS
    from runtime_cases import has_transformers

    from autopar_nb.cost import estimate
    from autopar_nb.runtime.pp import stage_boundaries
    from autopar_nb.runtime.train import switch_off_kv_cache

    if not has_transformers():
        pytest.skip("needs transformers")
    vocab, size = 8192, {"hidden": 64, "layers": 2, "seq": 256, "batch": 16}
    src = ModelSource(CELLS["LLaMA"](**size).replace("1024", str(vocab)))
    graph = _graph(src)
    cluster = ap.Cluster.preset("cpu", 1, 2)
    fix = {"pp": 2, "micro_batches": 2, "schedule": "1f1b", "amp": "none", "recompute": "none"}
    plans = {f: ap.plan(graph, cluster, global_batch=size["batch"], fix=fix | {"fused_loss": f}) for f in (False, True)}
    assert [lp.stage for lp in plans[True].layers] == [0] * 5 + [1], "the head alone on the last stage"
    if not head_alone:  # the last block, the final norm and the head on the last stage
        plans = {f: dataclasses.replace(p, layers=[dataclasses.replace(lp, stage=int(i >= 3))
                                                   for i, lp in enumerate(p.layers)]) for f, p in plans.items()}
    model, (ids,), _ = src.build(device="cpu")
    switch_off_kv_cache(model)
    model.eval()
    micro = (ids[: size["batch"] // 2],)
    boundaries = stage_boundaries(plans[True].stage_layers())
    unfused, fused = (_last_stage_step(model, boundaries, micro, fused=f) for f in (False, True))
    torch.testing.assert_close(fused["loss"], unfused["loss"], rtol=1e-5, atol=1e-6)
    for key in ("head_grad", "input_grad"):
        torch.testing.assert_close(fused[key], unfused[key], rtol=1e-4, atol=1e-7)
    logits = micro[0].numel() * vocab * 4
    print(f"last stage peak: unfused {unfused['peak'] / 2**20:.1f} MiB, fused {fused['peak'] / 2**20:.1f} MiB, "
          f"logits {logits / 2**20:.0f} MiB")
    assert fused["peak"] < 0.7 * logits < 2.5 * logits < unfused["peak"]
    last = estimate(graph, cluster, plans[True]).memory_by_rank[1].terms
    assert not {"pipeline_outputs", "loss_saved", "loss_temporaries"} & set(last), last
    predicted = last["saved_activations"] + last["backward_working_set"]
    assert predicted == pytest.approx(fused["peak"], rel=0.05), (last, fused["peak"])


def test_planner_fuses_the_loss_on_the_last_pipeline_stage_to_fit():
    """pp=2 pinned, a limit between the two peaks: the planner fuses the head on the last stage (the rank with the
    logits: its peak falls, the first stage's stays), and says why."""
    graph = _graph(lm_source(vocab=4096, dim=32, batch=4, seq=256))
    fix = {"pp": 2, "micro_batches": 2, "schedule": "1f1b", "recompute": "none"}
    plans = [ap.plan(graph, _cluster("cpu", 2), fix=fix | {"fused_loss": f}) for f in (False, True)]
    unfused, fused = ([m.total for m in p.cost.memory_by_rank] for p in plans)
    assert fused[0] == unfused[0] and fused[1] < 0.5 * unfused[1], (unfused, fused)
    assert "pipeline_outputs" not in plans[1].cost.memory_by_rank[1].terms
    limit = (max(unfused) + max(fused)) / 2 * 2  # the cpu preset divides the host's memory among its 2 ranks
    with pytest.raises(PlanError, match="nothing fits"):
        ap.plan(graph, _cluster("cpu", 2, limit), fix=fix | {"fused_loss": False})
    plan = ap.plan(graph, _cluster("cpu", 2, limit), fix=fix)
    assert plan.fused_loss == "head" and plan.mesh.pp == 2 and plan.cost.peak_memory_bytes <= limit / 2
    assert "Output head head fused with the loss (chosen" in plan.explain()
    assert ap.plan(graph, _cluster("cpu", 2), fix=fix).fused_loss == "", "with room to spare: unfused"


@pytest.mark.multiprocess
def test_verify_pipelined_fused_head_beside_data_parallelism():
    """pp=2 x dp=2 on 4 gloo processes, one launch: LLaMA under DDP (the stage wrapped, the head's weight reduced
    with the rest) and GPT-2 (tied head) under FSDP2 ZeRO-3 (the head gathered when the loss runs it, outside the
    stage's forward), each against the unfused model in one process."""
    from families import FAMILIES

    from autopar_nb.verify import verify_many

    cases = []
    for name, zero in (("LLaMA", 0), ("GPT-2", 3)):
        src = ModelSource(FAMILIES[name])
        graph = _graph(src)
        plan = ap.plan(graph, _cluster("cpu", 4), global_batch=graph.batch_size,
                       fix={"pp": 2, "dp": 2, "zero_stage": zero, "schedule": "1f1b", "fused_loss": True})
        assert plan.fused_loss == "lm_head" and (plan.mesh.pp, plan.mesh.dp, plan.mesh.zero_stage) == (2, 2, zero)
        cases.append((src, plan))
    for (_, plan), report in zip(cases, verify_many(cases, steps=2, nproc=4), strict=True):
        assert report.ok, f"{plan.summary()}: {report}"


def test_the_fused_loss_is_chosen_on_the_levered_plans():
    """The search chooses between the fused and the unfused loss before compile and Float8 are set; they make the
    recompute the unfused loss needs cheaper. A DDP plan of a 1.5B LLaMA shape on 8 H100s at one micro-batch took
    the fused loss (322 ms/step) where the unfused one with selective recompute fits at 319: the choice is made on
    the levered plans, and explain()'s loss line costs the other one on the plan as chosen. That unfused plan needs
    74.4 of the 74.5 GiB a rank has, so for a 1 % gain the fused one (59.6 GiB) is taken (levers.roomier) and
    explain() says so; pinned unfused, it is what the user gets."""
    import re

    with torch.device("meta"):
        model = zoo.Llama(zoo.LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192))
    graph = ap.capture(model, (torch.randint(0, 128256, (8, 2048), device="meta"),))
    cluster, fix = ap.Cluster.preset("h100-80gb", 1, 8), {"zero_stage": 0, "dp": 8, "micro_batches": 1}
    plan = ap.plan(graph, cluster, global_batch=64, fix=fix)
    unfused = ap.plan(graph, cluster, global_batch=64, fix={**fix, "fused_loss": False})
    assert not unfused.fused_loss and any(lp.recompute == "selective" for lp in unfused.layers), unfused.summary()
    assert 0.95 * cluster.rank_memory_bytes < unfused.cost.peak_memory_bytes <= cluster.rank_memory_bytes
    assert plan.fused_loss and plan.cost.peak_memory_bytes < 0.85 * cluster.rank_memory_bytes, plan.summary()
    assert unfused.cost.step_time_s < plan.cost.step_time_s < 1.01 * unfused.cost.step_time_s
    assert any(lp.compile for lp in unfused.layers) and unfused.precision.float8 == plan.precision.float8
    text = plan.explain()
    line = next(line for line in text.splitlines() if line.startswith("Output head output fused"))
    unfused_ms = float(re.search(r"unfused, this split needs .* and takes ([\d.]+) ms/step", line)[1])
    assert abs(unfused_ms / (unfused.cost.step_time_s * 1e3) - 1) < 0.01, line
    said = re.search(r"Headroom: a plan ([\d.]+)% faster needs 74.4 GiB", text)
    assert said and abs(float(said[1]) - 100 * (1 - unfused.cost.step_time_s / plan.cost.step_time_s)) < 0.1, text
