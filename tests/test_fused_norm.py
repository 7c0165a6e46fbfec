"""The fused RMSNorm as a plan choice (``plan.fused_norm``): runtime/fused_norm.py finds the RMSNorm modules of the
models people bring by what they compute and runs kernels_ext's op in them (same loss and gradients as the eager
norms, same state dict, also inside compiled blocks: marked slow); the cost model's fused graph (cost/norm.py)
against autograd's saved tensors and against closed forms; the planner fuses the norms to fit, and on CUDA for
speed; the plan field, the fix key, the exported script (ruff-clean), and verify on 2 gloo processes with ZeRO-3,
with TP + sequence parallelism (the norms run on sequence shards through kernels_ext's DTensor sharding rules) and
with 2 pipeline stages."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from families import FAMILIES
from memcells import CELLS
from runtime_cases import has_transformers
from test_compile import lm_source
from test_memory_accuracy import _parameter_copy, autograd_saved_bytes

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost import activation_bytes, profile
from autopar_nb.cost import norm as cost_norm
from autopar_nb.cost.estimate import estimate
from autopar_nb.export import render_script
from autopar_nb.plan import Plan, PlanError, normalize_fix
from autopar_nb.runtime.data import default_loss
from autopar_nb.runtime.fused_norm import apply_fused_norm, rms_norm_eps
from autopar_nb.runtime.train import switch_off_kv_cache
from autopar_nb.source import ModelSource
from autopar_nb.units import fmt_time

pytestmark = pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
ROOT = Path(__file__).resolve().parents[1]
SMALL = {"hidden": 64, "layers": 2, "seq": 32, "batch": 2}
ZOO_LLAMA = """\
import torch
from autopar_nb import zoo

model = zoo.Llama(zoo.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
example_inputs = (torch.randint(0, 64, (4, 16)),)
"""


def _graph(src: ModelSource):
    model, inputs, _ = src.build(device="meta")
    return ap.capture(model, *inputs)


def _randomise_norms(model):
    """Norm weights away from their init of ones, so that a wrong weight use would show."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if rms_norm_eps(m) is not None:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))


# ---- the runtime: which modules, same numbers ------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "count"), [("LLaMA", 5), ("Qwen2", 5), ("T5", 12), ("GPT-2", 0), ("Gemma", 0)])
def test_rms_norms_are_found_by_what_they_compute(family, count):
    """HF's LlamaRMSNorm, Qwen2RMSNorm and T5LayerNorm are RMSNorms (2 per block + the final one; T5: 2 encoder and
    3 decoder blocks of 2 layers + 2 final); GPT-2's LayerNorm (a bias) and Gemma's x * (1 + weight) are not."""
    model = ModelSource(FAMILIES[family]).run(seed=0)["model"]
    if count == 0:
        with pytest.raises(ValueError, match="has no RMSNorm module.*fix fused_norm=False"):
            apply_fused_norm(model)
        return
    names = list(model.state_dict())
    paths = apply_fused_norm(model)
    assert len(paths) == count and list(model.state_dict()) == names
    assert apply_fused_norm(model) == paths, "applying twice changes nothing"


@pytest.mark.parametrize("family", ["LLaMA", "Qwen2", "T5"])
@pytest.mark.parametrize("amp", [False, True])
def test_fused_norms_give_the_eager_loss_and_gradients(family, amp):
    ns = ModelSource(FAMILIES[family]).run(seed=0)
    model, example = ns["model"], ns["example_inputs"]
    _randomise_norms(model)
    fused = copy.deepcopy(model)
    apply_fused_norm(fused)
    batch = example if isinstance(example, dict) else tuple(example)
    results = []
    for m in (model, fused):
        torch.manual_seed(1)  # the same dropout masks (T5 drops by default)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = m(**batch).loss if isinstance(batch, dict) else default_loss(m, batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    tol = dict(rtol=2e-2, atol=2e-2) if amp else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, **tol, msg=name)


@pytest.mark.slow
def test_fused_norms_inside_compiled_blocks_match_eager():
    """The norms fused, then each block compiled (runtime/compile.py, Inductor's C++ backend): Dynamo traces the
    replaced forward and the custom op (its fake implementation), and the numbers are the eager model's."""
    from autopar_nb.runtime.compile import apply_compile

    ns = ModelSource(FAMILIES["LLaMA"]).run(seed=0)
    model, (ids,) = ns["model"], ns["example_inputs"]
    _randomise_norms(model)
    fused = copy.deepcopy(model)
    apply_fused_norm(fused)
    assert apply_compile(fused, "model.layers.*") == ["model.layers.0", "model.layers.1"]
    results = []
    for m in (model, fused):
        loss = default_loss(m, (ids,))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert fused.model.layers[0]._compiled_call_impl is not None


# ---- the cost model: the fused graph against autograd and closed forms ----------------------------------------------
def hooked_saved_bytes(model, args: tuple, kwargs: dict, *, autocast: bool = False) -> int:
    """Bytes of every storage autograd packs for backward in one training forward (``saved_tensors_hooks``: also
    what a custom op's ``ctx.save_for_backward`` keeps, which its Python grad_fn does not show as ``_saved_*``),
    parameters, buffers and autocast's parameter copies excluded, each storage once."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own and not _parameter_copy(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(*args, **kwargs)
    return sum(seen.values())


@pytest.mark.parametrize("family, precision", [(f, p) for f in ("LLaMA", "Qwen2", "T5", "Mixtral")
                                               for p in ("fp32", "autocast")] +
                         [("LLaMA", "autocast_lowp"), ("Qwen2", "autocast_lowp")])
def test_fused_graph_saves_what_autograd_saves(family, precision):
    """The fused graph's profile against autograd's saved tensors of the model with its norms fused, to 1 % (as
    test_memory_accuracy holds the eager models), and below the eager model's by the normalised inputs. Under
    autocast over 16-bit parameters (FSDP's, ``autocast_lowp``) the fused op keeps its rstd in float32, where
    ATen's CPU norms would keep 16-bit statistics (T5's and Mixtral's eager norms there: test_memory_accuracy's
    NOT_YET)."""
    src = ModelSource(CELLS[family](**SMALL))
    ns = src.run()
    model, example = ns["model"], ns["example_inputs"]
    switch_off_kv_cache(model)  # as the script trains it (and capture traces it)
    if precision == "autocast_lowp":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    args, kwargs = ((), example) if isinstance(example, dict) else (tuple(example), {})
    amp = precision != "fp32"
    eager = hooked_saved_bytes(model.train(), args, kwargs, autocast=amp)
    assert eager == pytest.approx(autograd_saved_bytes(model, args, kwargs, autocast=amp), abs=64)
    apply_fused_norm(model)
    measured = hooked_saved_bytes(model, args, kwargs, autocast=amp)
    meta, inputs, _ = src.build(device="meta")
    fused_graph = cost_norm.fuse_norms(ap.capture(meta, inputs), "cpu")
    predicted = sum(activation_bytes(lp, tp=1, sp=False, recompute="none", scale=1.0, precision=precision)
                    for lp in profile(fused_graph, device_kind="cpu").layers)
    assert predicted == pytest.approx(measured, rel=0.01), (predicted, measured)
    assert measured < eager


def test_fused_norm_memory_and_time_are_the_closed_forms():
    """Per norm of N tokens x H: the normalised input (N H 4 bytes) is no longer saved; on the CPU the op's body runs
    the chain's kernels (bytes and op count unchanged); on CUDA one kernel moves 4 (2 NH + H + N) bytes instead of
    the chain's 4 (7 NH + 6 N + H) (its two float32-to-float32 casts move nothing) and 7 ops fewer run."""
    src = ModelSource(FAMILIES["LLaMA"])  # hidden 32, batch 4 x seq 16
    graph = _graph(src)
    n, h = 4 * 16, 32
    assert cost_norm.fused_norm_modules(graph) == ["model.layers.0.input_layernorm",
                                                   "model.layers.0.post_attention_layernorm",
                                                   "model.layers.1.input_layernorm",
                                                   "model.layers.1.post_attention_layernorm", "model.norm"]
    norms = {"model.layers.0": 2, "model.layers.1": 2, "model.norm": 1}

    def saved(lp, precision="fp32"):
        return sum(s.nbytes for s in lp.saved_at(precision))

    for kind in ("cpu", "cuda"):
        eager, fused = profile(graph, device_kind=kind), cost_norm.fused_norm_profile(graph, kind)
        assert cost_norm.one_kernel(kind) == (kind == "cuda")
        for a, b in zip(eager.layers, fused.layers, strict=True):
            k = norms.get(a.path, 0)
            for precision in ("fp32", "autocast", "autocast_lowp"):
                assert saved(a, precision) - saved(b, precision) == k * cost_norm.saved_per_norm(n, h)
            if kind == "cuda":
                assert a.mem_rep - b.mem_rep == k * (cost_norm.chain_bytes(n, h) - cost_norm.fused_bytes(n, h))
                assert a.n_ops - b.n_ops == 7 * k
            else:
                assert (a.mem_rep, a.n_ops) == (b.mem_rep, b.n_ops)
            assert (a.tp, a.norms, a.flops_split, a.params_rep) == (b.tp, b.norms, b.flops_split, b.params_rep)
    assert cost_norm.fuse_norms(_graph(ModelSource(FAMILIES["GPT-2"])), "cuda") is None
    assert cost_norm.fused_norm_modules(_graph(ModelSource(FAMILIES["Gemma"]))) == [], "x * (1 + weight)"


# ---- the planner's choice --------------------------------------------------------------------------------------------
def _cluster(name="cpu", gpus=2, memory=None):
    c = ap.Cluster.preset(name, 1, gpus)
    return c if memory is None else dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=memory))


def test_planner_fuses_the_norms_to_fit_a_plan_that_does_not_fit_eager():
    src = ModelSource(CELLS["LLaMA"](hidden=64, layers=2, seq=256, batch=4))
    graph = _graph(src)
    fix = {"dp": 2, "zero_stage": 3, "recompute": "none", "micro_batches": 1, "fused_loss": False}
    peaks = [ap.plan(graph, _cluster(), fix=fix | {"fused_norm": f}).cost.peak_memory_bytes for f in (False, True)]
    assert peaks[1] < peaks[0]
    limit = (peaks[0] + peaks[1]) / 2 * 2  # the cpu preset divides the host's memory among its 2 ranks
    with pytest.raises(PlanError, match="nothing fits"):
        ap.plan(graph, _cluster(memory=limit), fix=fix | {"fused_norm": False})
    plan = ap.plan(graph, _cluster(memory=limit), fix=fix)
    assert plan.fused_norm and plan.cost.peak_memory_bytes <= limit / 2 and "fused-norm" in plan.summary()
    assert "RMSNorms fused (chosen;" in plan.explain() and "over the limit" in plan.explain()
    # with room to spare on the CPU the eager norms stay (the op runs the same kernels there)
    assert not ap.plan(graph, _cluster(), fix=fix).fused_norm


def test_on_cuda_the_planner_fuses_the_norms_for_speed():
    graph = _graph(ModelSource(FAMILIES["LLaMA"]))
    fused = ap.plan(graph, _cluster("h100-80gb", 2), fix={"dp": 2})
    eager = ap.plan(graph, _cluster("h100-80gb", 2), fix={"dp": 2, "fused_norm": False})
    assert fused.fused_norm and not eager.fused_norm and fused.cost.step_time_s < eager.cost.step_time_s
    assert "RMSNorms fused (chosen;" in fused.explain() and "eager, this split needs" in fused.explain()


def test_fused_norm_field_and_fix_key():
    graph = _graph(ModelSource(FAMILIES["LLaMA"]))
    plan = ap.plan(graph, _cluster(), fix={"dp": 2, "fused_norm": True})
    assert plan.fused_norm and Plan.from_json(plan.to_json()).fused_norm is True
    assert [str(c) for c in plan.diff(ap.plan(graph, _cluster(), fix={"dp": 2}))] == ["fused_norm: True -> False"]
    with pytest.raises(PlanError, match="fused_norm must be"):
        Plan.from_dict(plan.to_dict() | {"fused_norm": "yes"})
    assert normalize_fix({"fused_norm": True}) == {"fused_norm": True}
    with pytest.raises(PlanError, match=r"fix\['fused_norm'\]='yes' is not supported"):
        normalize_fix({"fused_norm": "yes"})
    with pytest.raises(PlanError, match="fix fused_norm=True, but the model has no RMSNorm module"):
        ap.plan(_graph(lm_source()), _cluster(), fix={"fused_norm": True})
    # estimate() costs a plan as the planner did
    assert estimate(graph, _cluster(), plan).peak_memory_bytes == pytest.approx(plan.cost.peak_memory_bytes)


def test_script_fuses_the_norms_first_and_passes_ruff(tmp_path):
    src = ModelSource(FAMILIES["LLaMA"])
    plan = ap.plan(_graph(src), _cluster(), fix={"dp": 1, "tp": 2, "fused_norm": True})
    text = render_script(src, plan)
    body = text[text.index("def parallelize("):]
    assert body.index("apply_fused_norm(model)") < body.index("apply_tp(")
    assert "def apply_fused_norm(" in text and "# autopar_nb/runtime/fused_norm.py" in text
    assert "# plan.fused_norm: kernels_ext's fused RMSNorm in 5 modules (model.layers.0.input_layernorm, ...)" in text
    path = tmp_path / "train_fused_norm.py"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"), str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fused_norm" not in render_script(src, ap.plan(_graph(src), _cluster(), fix={"dp": 2}))
    with pytest.raises(PlanError, match="has no RMSNorm module"):
        gpt2 = ModelSource(FAMILIES["GPT-2"])
        render_script(gpt2, dataclasses.replace(ap.plan(_graph(gpt2), _cluster(), fix={"dp": 2}), fused_norm=True))


# ---- verify: the script against one process --------------------------------------------------------------------------
VERIFIED = {"zero3": ("LLaMA", {"dp": 2, "zero_stage": 3}), "tp2-sp": ("LLaMA", {"dp": 1, "tp": 2}),
            "pp2": (ZOO_LLAMA, {"dp": 1, "pp": 2})}
"""the fused-norm plans verified, each a family of tests/families.py or a cell, and the plan's fix"""


@pytest.fixture(scope="module")
def verified():
    """name -> (plan, report) of VERIFIED: all in one launch of 2 processes, 3 steps each."""
    from autopar_nb.verify import verify_many

    cases = {}
    for name, (cell, fix) in VERIFIED.items():
        src = ModelSource(FAMILIES.get(cell, cell))
        cases[name] = (src, ap.plan(_graph(src), _cluster(), fix=fix | {"fused_norm": True}))
    reports = verify_many(list(cases.values()), steps=3, nproc=2)
    return {name: (plan, report) for (name, (_, plan)), report in zip(cases.items(), reports, strict=True)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zero3", "tp2-sp"])
def test_verify_fused_norm_plans_on_two_gloo_processes(verified, name):
    """ZeRO-3 (FSDP2 gathers the norm weights) and TP with sequence parallelism (SequenceParallel hands the norms
    DTensor shards of the sequence: kernels_ext's sharding rules run the op per shard, the weight gradient a Partial
    sum), against the eager model in one process."""
    plan, report = verified[name]
    assert plan.fused_norm and (plan.mesh.tp == 1 or any(lp.sequence_parallel for lp in plan.layers))
    assert report.ok, report


@pytest.mark.multiprocess
def test_verify_fused_norm_with_pipeline_stages(verified):
    """pp=2: the norms are fused on the whole model before the pipeline's trace, which records the custom op."""
    plan, report = verified["pp2"]
    assert plan.fused_norm and plan.mesh.pp == 2
    assert report.ok, report


def test_the_reason_for_eager_norms_is_the_devices():
    """On a CUDA preset the fused RMSNorm is one kernel, so eager norms there were not chosen for speed; the CPU's
    reason (the op runs the eager kernels and only saves memory) was given for an H100 plan."""
    graph = _graph(ModelSource(ZOO_LLAMA))
    plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", 1, 2), global_batch=8)
    lines = [line for line in plan.explain().splitlines() if line.startswith("RMSNorms")]
    assert not plan.fused_norm and lines and lines[0].startswith("RMSNorms eager (not chosen: no faster on this "
                                                                 "split;"), lines


def test_the_other_norms_are_costed_with_the_levers_the_plan_took():
    """explain()'s RMSNorm line costs the other choice on the plan as chosen: the search's variant was costed before
    compile and Float8 were set, and a DDP plan of a 1.5B LLaMA shape on 8 H100s read "fused ... takes 386 ms/step"
    while its lever line, the same plan with the norms fused, said "same speed" (320 ms)."""
    with torch.device("meta"):
        model = zoo.Llama(zoo.LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192))
    graph = ap.capture(model, (torch.randint(0, 128256, (8, 2048), device="meta"),))
    plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", 1, 8), global_batch=64, fix={"zero_stage": 0, "dp": 8})
    lever = next(lv for lv in plan.levers if lv.name == "fused_norm")
    line = next(line for line in plan.explain().splitlines() if line.startswith("RMSNorms"))
    assert line.endswith(f"takes {fmt_time(lever.step_time_s)}/step."), (line, lever)


def test_the_norms_are_chosen_levered_over_the_run():
    """The fused / eager RMSNorm choice is made on the levered plans, over the run as compile is chosen: a 4-layer
    LLaMA shape on 2 H100s is faster per step with eager norms compiled (13.9 ms) than fused eager (14.7 ms), but
    compile's 20 s start-up costs more over the 10,000 steps than it saves there, so the fused norms, eager, stay;
    over 100,000 steps compile pays and takes them along (fused, compiled)."""
    cfg = zoo.LlamaConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816)
    with torch.device("meta"):
        model = zoo.Llama(cfg)
    graph = ap.capture(model, torch.randint(0, 32000, (8, 2048), device="meta"))
    cluster = ap.Cluster.preset("h100-80gb", 1, 2)
    plan = ap.plan(graph, cluster)
    assert plan.fused_norm and not any(lp.compile for lp in plan.layers), plan.summary()
    eager = ap.plan(graph, cluster, fix={"fused_norm": False, "dp": 2, "zero_stage": 2})
    assert any(lp.compile for lp in eager.layers) and eager.cost.step_time_s < plan.cost.step_time_s
    long = ap.plan(graph, cluster, steps=100_000)
    assert long.fused_norm and any(lp.compile for lp in long.layers), long.summary()
