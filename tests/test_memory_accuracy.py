"""The cost model against what runs (issue 21): per-rank memory, term by term, on the Hugging Face families people
bring (tests/memcells.py).

* saved activations: what autograd really saves in a CPU training forward (every ``grad_fn``'s saved tensors,
  each storage once) against the profile's prediction, per family (p = 0 dropout, rotary cos/sin, grouped-query
  K/V, the CPU flash kernel's output layout, the math kernel SDPA falls back to with dropout);
* named terms against closed forms (DDP's gradient buckets);
* whole steps: the plan's exported script run as one rank of a fake process group inside PyTorch's memory tracker
  (``autopar_nb.verify.measure``), component by component.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from batched import Batched, selected
from memcells import CELLS
from runtime_cases import has_transformers

import autopar_nb as ap
from autopar_nb.cost import activation_bytes, profile
from autopar_nb.runtime.train import switch_off_kv_cache
from autopar_nb.source import ModelSource

pytestmark = pytest.mark.skipif(not has_transformers(), reason="transformers not installed")

SMALL = {"hidden": 64, "layers": 2, "seq": 32, "batch": 2}
"""sizes of the single-process checks (seconds each)"""
EXACT = 0.01
"""saved activations: the prediction follows autograd op by op, so it must match to 1 %"""
NOT_YET: dict[tuple[str, str], str] = {
    ("Mixtral", "autocast_lowp"): "-1.1 %: the router's int64 top-k and index positions (8224 B, no kernels_ext "
                                  "'saves' for index/topk; -0.85 % in the other precisions too) and rotary cos/sin "
                                  "costed float32 (HF casts them to the hidden states' dtype: bf16 here)",
}
"""(family, precision) whose saved activations are not within EXACT yet, and why"""


def autograd_saved_bytes(model: nn.Module, args: tuple, kwargs: dict, *, autocast: bool = False) -> int:
    """Bytes of every storage some ``grad_fn`` of one training forward keeps (parameters and buffers excluded; under
    CPU bf16 ``autocast`` also the 16-bit copies of parameters it caches, a term of their own)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*args, **kwargs)
    root = out.loss if getattr(out, "loss", None) is not None else out.logits if hasattr(out, "logits") else out
    seen: dict[int, int] = {}
    stack, visited = [root.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        for attr in dir(fn):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(fn, attr)
            except RuntimeError:  # freed or not a tensor
                continue
            for t in value if isinstance(value, tuple | list) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in own and \
                        not _parameter_copy(t):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [f for f, _ in fn.next_functions]
    return sum(seen.values())


def _parameter_copy(t: torch.Tensor) -> bool:
    """A (view of a) copy autocast made of a parameter: its grad_fn chain is views, then a ``_to_copy`` of a leaf."""
    fn = t.grad_fn
    while fn is not None and fn.name() in ("TBackward0", "ViewBackward0", "PermuteBackward0", "TransposeBackward0",
                                           "ExpandBackward0", "UnsqueezeBackward0"):
        fn = fn.next_functions[0][0]
    return fn is not None and fn.name() == "ToCopyBackward0" and fn.next_functions[0][0] is not None and \
        fn.next_functions[0][0].name() == "torch::autograd::AccumulateGrad"


def predicted_saved_bytes(src: ModelSource, precision: str = "fp32") -> float:
    meta, example, _ = src.build(device="meta")
    prof = profile(ap.capture(meta, example), device_kind="cpu")
    return sum(activation_bytes(lp, tp=1, sp=False, recompute="none", scale=1.0, precision=precision)
               for lp in prof.layers)


@pytest.mark.parametrize("precision", ["fp32", "autocast", "autocast_lowp"])
@pytest.mark.parametrize("family", list(CELLS))
def test_saved_activations_match_autograd(family, precision):
    """fp32, CPU bf16 autocast, and autocast over bf16 parameters (what FSDP2's MixedPrecisionPolicy runs under
    ZeRO 2/3: its parameters cast, buffers left float32): the dtypes torch's autocast lists and type promotion give
    each saved tensor (cost/autocast.py, with the casts a float32 capture records as no-ops: an RMSNorm's
    ``.to(input_dtype)``, ``.to(weight.dtype)``, a module's ``.to(hidden_states.dtype)``), the copies autocast hands
    each lower-precision op, the math attention kernel's float32."""
    src = ModelSource(CELLS[family](**SMALL))
    ns = src.run()
    model, example = ns["model"], ns["example_inputs"]
    model.train()
    switch_off_kv_cache(model)  # as the script trains it (and capture traces it)
    if precision == "autocast_lowp":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    args, kwargs = ((), example) if isinstance(example, dict) else (tuple(example), {})
    measured = autograd_saved_bytes(model, args, kwargs, autocast=precision != "fp32")
    predicted = predicted_saved_bytes(src, precision)
    if (family, precision) in NOT_YET:
        assert predicted != pytest.approx(measured, rel=EXACT), f"{family} now matches: drop it from NOT_YET"
        pytest.xfail(NOT_YET[family, precision])
    assert predicted == pytest.approx(measured, rel=EXACT), (family, predicted, measured)


class _Dropouts(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(64, 64), nn.Dropout(p), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.drop(self.a(x)))


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_dropout_saves_a_noise_tensor_only_when_it_drops(p):
    model = _Dropouts(p).train()
    x = torch.randn(8, 64)
    measured = autograd_saved_bytes(model, (x,), {})
    prof = profile(ap.capture(model, (x,)), device_kind="cpu")
    predicted = sum(activation_bytes(lp, tp=1, sp=False, recompute="none", scale=1.0)
                    for lp in prof.layers)
    # x (input of a) and the input of b; with p > 0 also the noise (CPU): a's output is then not saved by b
    want = 8 * 64 * 4 * (2 if p == 0 else 3)
    assert measured == want
    assert predicted == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("family", ["GPT-2", "ViT"])
def test_autocast_weight_copies_are_the_linear_and_conv_parameters(family):
    """Autocast caches a 16-bit copy of every parameter a lower-precision op reads (Linear, HF Conv1D and convolution
    weights and biases; a tied head's table once), not embeddings or norms: counted from the modules, and from the
    casts of parameters a CPU autocast forward makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    src = ModelSource(CELLS[family](**SMALL))
    model = src.run()["model"].train()
    meta, example, _ = src.build(device="meta")
    prof = profile(ap.capture(meta, example), device_kind="cpu")
    predicted = sum(lp.cast_split + lp.cast_rep for lp in prof.layers)
    linear = {p.data_ptr(): p.numel() for m in model.modules() if type(m).__name__ in ("Linear", "Conv1D", "Conv2d")
              for p in m.parameters(recurse=False)}
    params = {p.data_ptr() for p in model.parameters()}
    cast: dict[int, int] = {}

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in params:
                cast[args[0].data_ptr()] = args[0].numel()
            return func(*args, **(kwargs or {}))

    ns = src.run()
    example = ns["example_inputs"]
    args, kwargs = ((), example) if isinstance(example, dict) else (tuple(example), {})
    with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
        model(*args, **kwargs)
    assert predicted == sum(linear.values()) == sum(cast.values())


def _tracked_forward_bytes(model, args, kwargs, **op_lists) -> float:
    """Activations (and loss-labelled tensors) alive at the end of one CPU bf16 autocast forward under the plan's op
    lists (runtime/amp.py's OpPrecision), by PyTorch's memory tracker: what autograd saves, including what
    OpPrecision's WithoutAutocast holds (its ctx, invisible to the grad_fn walk), plus the output."""
    from autopar_nb.runtime.amp import OpPrecision
    from autopar_nb.verify.labels import Tracker, components

    tracker = Tracker()
    tracker.phase = "train"
    with tracker:
        tracker.track_external(model)
        with torch.autocast("cpu", dtype=torch.bfloat16), OpPrecision("cpu", torch.bfloat16, **op_lists):
            out = model(*args, **kwargs)
            c = components(tracker.get_tracker_snapshot("current")[torch.device("cpu")])
    del out
    return c["activations"] + c["loss"]


@pytest.mark.parametrize("family,op_lists", [
    ("LLaMA", {"fp32_ops": ["silu"]}), ("LLaMA", {"fp32_ops": ["mul", "rsqrt"]}),
    ("ViT", {"low_precision_ops": ["layer_norm", "add"]}),
    ("ViT", {"fp32_ops": ["gelu"], "low_precision_ops": ["matmul"]})])
def test_plan_op_lists_move_saved_bytes_as_they_run(family, op_lists):
    """precision.fp32_ops / low_precision_ops change what a bf16 autocast forward saves (float32 copies of 16-bit
    inputs and WithoutAutocast's held inputs and output; 16-bit copies for low-precision ops): the change the cost
    model predicts equals the change the tracker measures, to 1 %."""
    src = ModelSource(CELLS[family](**SMALL))
    model = src.run()["model"].train()
    example = src.run()["example_inputs"]
    args, kwargs = ((), example) if isinstance(example, dict) else (tuple(example), {})
    meta, ex, _ = src.build(device="meta")
    graph = ap.capture(meta, ex)

    def predicted(**lists):
        prof = profile(graph, device_kind="cpu", **lists)
        return sum(activation_bytes(lp, tp=1, sp=False, recompute="none", scale=1.0, precision="autocast")
                   for lp in prof.layers)

    measured = _tracked_forward_bytes(model, args, kwargs, **op_lists) - _tracked_forward_bytes(model, args, kwargs)
    assert abs(measured) > 8 * 1024, "the lists should move the saved bytes"
    assert predicted(**op_lists) - predicted() == pytest.approx(measured, rel=EXACT)


@pytest.mark.parametrize("family", ["ViT", "LLaMA", "BERT"])
def test_selective_recompute_keeps_what_the_runtime_keeps(family):
    """runtime/ac.py's selective recompute on the blocks: the checkpoint's inputs and the outputs of every other
    weight matmul and of the attention kernel, measured with the tracker at the end of a forward, against the
    profile's ``selective`` terms (the other layers as without recompute) plus the model's output (the tracker sees
    it too), to 5 %; then
    the backward runs (a Hugging Face decoder's key/value cache made it fail: the script switches it off first,
    runtime/train.switch_off_kv_cache)."""
    from autopar_nb.runtime.ac import apply_ac
    from autopar_nb.verify.labels import Tracker, components

    src = ModelSource(CELLS[family](**SMALL))
    ns = src.run()
    model, example = ns["model"].train(), ns["example_inputs"]
    switch_off_kv_cache(model)  # as the script does before it applies the plan
    args, kwargs = ((), example) if isinstance(example, dict) else (tuple(example), {})
    meta, ex, _ = src.build(device="meta")
    graph = ap.capture(meta, ex)
    blocks = [lay.path for lay in graph.layers if graph.block_of(lay.path)]
    predicted = sum(activation_bytes(lp, tp=1, sp=False, recompute="selective" if lp.path in blocks else "none",
                                     scale=1.0) for lp in profile(graph, device_kind="cpu").layers)
    apply_ac(model, {path: "selective" for path in blocks})
    tracker = Tracker()
    tracker.phase = "train"
    with tracker:
        tracker.track_external(model)
        # the batch made inside the tracker, as a training step loads it: the ops that keep it (ViT's patch
        # convolution keeps its pixels) are charged for it
        args, kwargs = tuple(a.clone() for a in args), {k: v.clone() for k, v in kwargs.items()}
        out = model(*args, **kwargs)
        c = components(tracker.get_tracker_snapshot("current")[torch.device("cpu")])
    root = out.loss if getattr(out, "loss", None) is not None else out.logits
    output = root.untyped_storage().nbytes()
    measured = c["activations"] + c["loss"]
    none = predicted_saved_bytes(src) + output
    assert measured < 0.8 * none  # it did recompute
    assert predicted + output == pytest.approx(measured, rel=WITHIN)
    root.float().sum().backward()


def test_ddp_bucket_is_the_parameters_in_fp32():
    from autopar_nb.cost.estimate import Evaluator
    from autopar_nb.cost.peak import ddp_bucket_bytes
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.cost.setting import LayerChoice, Setting

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    graph = ap.capture(model, (torch.randn(8, 64),))
    numel = sum(p.numel() for p in model.parameters())
    ev = Evaluator(profile_of(graph, "cpu"), ap.Cluster.preset("cpu", 1, 2))
    choices = [LayerChoice() for _ in graph.layers]
    single = ev.evaluate(Setting(mb_samples=8), choices).memory_by_rank[0]
    ddp = ev.evaluate(Setting(dp=2, mb_samples=8), choices).memory_by_rank[0]
    assert ddp_bucket_bytes(Setting(dp=2), numel) == 4 * numel
    assert ddp.total - ddp.margin - (single.total - single.margin) == pytest.approx(4 * numel)
    for no_buckets in (Setting(dp=2, zero_stage=2), Setting(dp=2, tp=2), Setting()):
        assert ddp_bucket_bytes(no_buckets, numel) == 0


WHOLE = {"hidden": 128, "layers": 2, "seq": 128, "batch": 4}
"""sizes of the whole-step checks: large enough that fixed overheads (rotary tables, the loss scalar) stay below
1 % of the peak, small enough for a CPU step in well under a second"""
WITHIN = 0.05
"""issue 21's bound: per-rank peak, and each component, within 5 % of the tracker's"""


RECOMPUTED = {"hidden": 256, "layers": 4, "seq": 128, "batch": 8}
"""sizes where a recomputed layer's backward, not the loss or the optimizer step, is the peak (hidden 256: a
layer's saved tensors outweigh the logits)"""


BENCH = {"hidden": 256, "layers": 4, "seq": 256, "batch": 8}
"""bench/memory.py's sizes (its matrix in BENCHMARKS.md)"""


def _planned(family: str, fix: dict, size: dict = WHOLE) -> tuple:
    """``family``'s cell at ``size`` planned with ``fix`` (one micro-batch, fp32, no recompute unless fixed): its
    source, plan and rank 0's predicted memory."""
    from autopar_nb.cost import estimate

    src = ModelSource(CELLS[family](**size))
    meta, example, _ = src.build(device="meta")
    graph = ap.capture(meta, example)
    world = fix.get("dp", 1) * fix.get("tp", 1) * fix.get("pp", 1)
    cluster = ap.Cluster.preset("cpu", 1, world)
    plan = ap.plan(graph, cluster, global_batch=size["batch"] * fix.get("dp", 1),
                   fix={"micro_batches": 1, "amp": "none", "recompute": "none", **fix})
    return src, plan, estimate(graph, cluster, plan).memory_by_rank[0]


def _predicted_and_measured(family: str, fix: dict, size: dict = WHOLE) -> tuple:
    from autopar_nb.verify.measure import measure

    src, plan, mb = _planned(family, fix, size)
    (got,) = measure(src, plan, ranks=(0,))
    print("peak at", got["where"])
    return mb, got["peak"], got["where"]


WHOLE_CASES = {
    "Qwen2-single": ("Qwen2", {"dp": 1, "tp": 1, "pp": 1}),
    "Qwen2-tp2-sp-bf16": ("Qwen2", {"dp": 1, "tp": 2, "pp": 1, "amp": "bf16"}),
    "LLaMA-zero3-bf16": ("LLaMA", {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3, "amp": "bf16"}),
    "LLaMA-selective": ("LLaMA", {"dp": 1, "tp": 1, "pp": 1, "recompute": "selective"}),
    "GPT-2-ddp-bf16": ("GPT-2", {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "amp": "bf16"}),
    "GPT-2-tp2-sp": ("GPT-2", {"dp": 1, "tp": 2, "pp": 1, "sequence_parallel": True}),
    "ViT-zero3": ("ViT", {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3}),
    "LLaMA-full": ("LLaMA", {"dp": 1, "tp": 1, "pp": 1, "recompute": "full"}, RECOMPUTED),
    "LLaMA-tp2-sp-full": ("LLaMA", {"dp": 1, "tp": 2, "pp": 1, "recompute": "full"}, RECOMPUTED),
    "BERT-bf16-full": ("BERT", {"dp": 1, "tp": 1, "pp": 1, "amp": "bf16", "recompute": "full"}, RECOMPUTED),
    "BERT-bf16-selective": ("BERT", {"dp": 1, "tp": 1, "pp": 1, "amp": "bf16", "recompute": "selective"},
                            RECOMPUTED),
    "T5-tp2-bf16-full": ("T5", {"dp": 1, "tp": 2, "pp": 1, "amp": "bf16", "recompute": "full"}, RECOMPUTED),
    "GPT-2-zero1-accum-full": ("GPT-2", {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1, "micro_batches": 4,
                                         "recompute": "full"}, RECOMPUTED),
}
"""whole-step cases: sequence-parallel norms and the vocab-parallel loss (tp2), autocast's copies and DDP's buckets,
FSDP's units and Adam's sharded states, autocast over FSDP's 16-bit parameters (ZeRO-3 bf16), a decoder's
selective recompute (its key/value cache off), full recompute's backward peak at the first layer (the others'
gradients alive; the largest op's consumers' saved output freed) alone and under TP with sequence parallelism (the
first block's whole, replicated input kept by the checkpoint), and an encoder's full recompute under bf16 autocast
(its peak the end of the recomputed CPU math attention, with its float32 copies and 16-bit outputs) and its
selective recompute (the same moment, less the kept outputs the recompute has taken from its cache: -6.3 % when
costed as the layer's backward), and an
encoder-decoder's full recompute, whose decoder blocks' checkpoints all keep the one encoder output and position
biases (``LayerProfile.shared_inputs``: +5.2 % when counted per block), and sequence parallelism that ends before
the final norm (Hugging Face GPT-2's view(-1, T, C) after ln_f: ln_f gathers the sequence and runs whole), and
ZeRO-1's gradient accumulation with full recompute (FSDP's root unit called once per micro-batch, which
FSDPMemTracker refuses unless its statistics restart at each call)"""
FAST = ("Qwen2-single", "Qwen2-tp2-sp-bf16", "LLaMA-zero3-bf16", "LLaMA-selective")
"""the cases run under ``-m "not slow"`` (~8 s each on an idle core, a child process each); the others are
marked slow"""


def _measure_whole(cases: list[str]) -> dict:
    """case -> (rank 0's predicted memory, its measurement): :data:`WHOLE_CASES`, one ``measure_many`` call."""
    from autopar_nb.verify.measure import measure_many

    planned = {case: _planned(*WHOLE_CASES[case]) for case in cases}
    got = measure_many([(src, plan, (0,)) for src, plan, _ in planned.values()])
    return {case: (mb, m) for (case, (_, _, mb)), m in zip(planned.items(), got, strict=True)}


@pytest.fixture(scope="module")
def whole(request):
    """The whole-step cases this session runs, measured 4 at a time on first use (:class:`batched.Batched`)."""
    return Batched([c["case"] for c in selected(request, test_whole_step_memory_matches_the_tracker)], _measure_whole)


@pytest.mark.multiprocess  # measure() runs the script in a child process
@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in WHOLE_CASES])
def test_whole_step_memory_matches_the_tracker(case, whole):
    """The exported script's own step under the tracker (``verify.measure``) against the cost model, component
    by component (``verify.moments.GROUPS``: parameters, gradients, optimizer states, saved activations with the
    loss, autocast's weight copies, DDP/FSDP/pipeline buffers, backward and step temporaries), each within 5 % of
    the measured total, and the total within 5 %. The recompute cases must peak in a recomputed layer's backward."""
    from autopar_nb.verify.moments import GROUPS, measured_groups, predicted_groups

    mb, measured = whole[case]
    assert not isinstance(measured, Exception), measured
    (got_rank0,) = measured
    print("measured", json.dumps(got_rank0, sort_keys=True))
    m, where = got_rank0["peak"], got_rank0["where"]
    if case.endswith(("-full", "-selective")) and case != "LLaMA-selective":
        assert where.startswith(("train/backward", "train/recompute")) and "_checkpoint_wrapped_module" in where, where
    p, got = predicted_groups(mb), measured_groups(m)
    for g in GROUPS:
        assert p[g] == pytest.approx(got[g], abs=WITHIN * m["total"] + 1024), (g, p, got)
    assert mb.total - mb.margin == pytest.approx(m["total"], rel=WITHIN), (mb, m)


@pytest.mark.multiprocess  # measure() runs the script in a child process
def test_census_names_what_the_peak_is_made_of():
    """``measure(census=N)`` (``bench/memory.py --largest N``) lists the N largest storages alive at the peak, each
    with its tracker label and the op, shape and module that made it: LLaMA's peak (in backward) holds saved
    activations of its layers; the list is largest first and sums, label by label, to no more than the tracker's
    components at that peak."""
    from autopar_nb.verify.labels import LABELS
    from autopar_nb.verify.measure import measure

    src = ModelSource(CELLS["LLaMA"](**RECOMPUTED))
    meta, example, _ = src.build(device="meta")
    plan = ap.plan(ap.capture(meta, example), ap.Cluster.preset("cpu", 1, 1), global_batch=RECOMPUTED["batch"],
                   fix={"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1, "amp": "none", "recompute": "none"})
    (got,) = measure(src, plan, ranks=(0,), census=12)
    rows = got["largest"]
    assert len(rows) == 12 and [r["MiB"] for r in rows] == sorted((r["MiB"] for r in rows), reverse=True)
    acts = [r for r in rows if r["label"] == "Activation"]
    assert all(r["op"].startswith("aten.") and r["module"].startswith("LlamaForCausalLM.") and r["side"] == "forward"
               for r in acts), acts
    assert any("model.layers." in r["module"] for r in acts), acts
    assert all(r["shape"] and r["dtype"] == "float32" for r in acts), acts
    for component, labels in LABELS.items():
        listed = sum(r["MiB"] for r in rows if r["label"] in labels) * 2**20
        assert listed <= got["peak"][component] + 1, (component, listed, got["peak"])


@pytest.mark.multiprocess  # measure() runs the script in a child process
def test_a_tied_heads_gradient_is_pending_at_the_tracked_peak():
    """GPT-2 ties its head to the token embedding. At its full-recompute peak (the first block's backward) the
    tracker holds the head's gradient of that weight, a float32 [vocab, hidden] temporary made by the head's
    backward, which autograd keeps until the embedding's backward adds its own; the cost model counts those bytes
    pending at every block's backward (``layer_sums.tied_gradients``)."""
    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.layer_sums import tied_gradients
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.verify.measure import measure

    src = ModelSource(CELLS["GPT-2"](**RECOMPUTED))
    meta, example, _ = src.build(device="meta")
    graph, cluster = ap.capture(meta, example), ap.Cluster.preset("cpu", 1, 1)
    plan = ap.plan(graph, cluster, global_batch=RECOMPUTED["batch"],
                   fix={"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1, "amp": "none", "recompute": "full"})
    (got,) = measure(src, plan, ranks=(0,), census=40)
    assert got["where"].startswith(("train/backward", "train/recompute")), got["where"]
    assert "_checkpoint_wrapped_module" in got["where"], got["where"]
    wte = graph.params["transformer.wte.weight"]
    pending = [r for r in got["largest"] if r["label"] == "Temp" and r.get("side") == "backward"
               and r["module"].endswith(".lm_head") and r["shape"] == list(wte.shape) and r["dtype"] == "float32"]
    assert len(pending) == 1, got["largest"]
    s, choices = setting_of(plan)
    tied = tied_gradients(Evaluator(profile_of(graph, "cpu"), cluster), s, choices)
    blocks = [i for i, lay in enumerate(graph.layers) if ".h." in lay.path]
    assert len(blocks) == RECOMPUTED["layers"]
    assert [tied[i] for i in blocks] == [pending[0]["MiB"] * 2**20] * len(blocks), (tied, pending)


@pytest.mark.multiprocess  # measure() runs the script in a child process
@pytest.mark.parametrize("family, fix, size", [
    ("ViT", {"zero_stage": 3, "amp": "bf16"}, RECOMPUTED),
    ("Mixtral", {"zero_stage": 2, "amp": "none"}, BENCH),
    ("Mixtral", {"zero_stage": 3, "amp": "bf16"}, BENCH)])
def test_fsdp_buffers_at_a_recomputed_layers_backward_match_the_tracker(family, fix, size):
    """Full recompute: the peak is in a middle block's recomputed backward. Under ZeRO-3 (ViT, bf16) FSDP holds that
    block's gathered parameters, the prefetched all-gather of the block before it and the float32 reduce-scatter
    input of the block after it (``fsdp_gathered_units``, ``fsdp_reduce_scatter``); under ZeRO-2 (Mixtral, fp32,
    peaking in layer 2 of 4) the unsharded parameters of every unit whose backward has not run yet
    (``fsdp_unsharded_params``: the blocks after it resharded theirs; counting all of them was 7.8 MiB over, +6.1 %
    in total) and the reduce-scatter input. The buffers the cost model predicts at that moment against the
    tracker's (All Gather, Unsharded Param, Reduce Scatter), to 5 % of themselves, and the total to 5 % (ZeRO-3's
    was -8.4 % without the reduce-scatter input). Mixtral under ZeRO-3 and bf16 peaks at its experts' last index
    op's backward, which puts the gradient into zeros out of place (``profile.moments.gradients_of``: -5.5 % without
    the second input-sized tensor)."""
    from autopar_nb.verify.moments import measured_groups, predicted_groups

    mb, m, where = _predicted_and_measured(family, {"dp": 2, "tp": 1, "pp": 1, "recompute": "full", **fix}, size)
    assert "backward" in where and "_checkpoint_wrapped_module" in where, where
    assert mb.terms.get("fsdp_reduce_scatter", 0) > 0, mb.terms
    p, got = predicted_groups(mb), measured_groups(m)
    assert p["buffers"] == pytest.approx(got["buffers"], rel=WITHIN), (p, got)
    assert mb.total - mb.margin == pytest.approx(m["total"], rel=WITHIN), (mb, m)


@pytest.mark.multiprocess  # measure() runs the script in a child process
@pytest.mark.parametrize("fix, phase", [({"dp": 2, "zero_stage": 2, "recompute": "none"}, "forward"),
                                        pytest.param({"tp": 2, "recompute": "full"}, "recompute",
                                                     marks=pytest.mark.slow)])
def test_a_peak_inside_a_layers_forward_is_its_forward_moment(fix, phase):
    """ViT under bf16 autocast at the bench's size. ZeRO 2 peaks in the last block's forward (the tracker's
    "train/forward in ...vit.layers.3"): the model's forward moment there (every earlier block's saved tensors, the
    block's own so far, the storages alive — output, operands still to be read, autocast's copies, the LayerNorm
    output the block's Python code holds —, FSDP's all-gather output, no gradient yet). TP with full recompute peaks
    inside the last block's recompute, at its MLP: the recompute moment (up to its last saver, the checkpoint's kept
    input not counted twice). Each component within 5 % of the measured total at that moment (before the forward
    moments: the ZeRO-2 row had no moment, the TP row's activations missed by 3.4 MiB)."""
    from autopar_nb.cost.estimate import peak_moments
    from autopar_nb.verify.measure import measure
    from autopar_nb.verify.moments import GROUPS, measured_groups, moment_at, predicted_groups

    src = ModelSource(CELLS["ViT"](**BENCH))
    meta, example, _ = src.build(device="meta")
    graph = ap.capture(meta, example)
    fix = {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1, "amp": "bf16"} | fix
    cluster = ap.Cluster.preset("cpu", 1, fix["dp"] * fix["tp"])
    plan = ap.plan(graph, cluster, global_batch=BENCH["batch"] * fix["dp"], fix=fix)
    moments = peak_moments(graph, cluster, plan, per_op=True)[0]
    (got,) = measure(src, plan, ranks=(0,))
    assert got["where"].startswith(f"train/{phase} in "), got["where"]
    paths = [lay.path for lay in graph.layers]
    at = moment_at(got["where"], paths, moments, {k: n.module_path for k, n in enumerate(graph.nodes)},
                   node=got.get("node"), op_names={k: n.op for k, n in enumerate(graph.nodes)})
    assert at is not None and at[0] == phase and paths[at[1]].endswith(".3"), (got["where"], at)
    p, g, m = predicted_groups(at[2]), measured_groups(got["peak"]), got["peak"]
    for group in GROUPS:
        assert p[group] == pytest.approx(g[group], abs=WITHIN * m["total"] + 1024), (group, p, g)
    if phase == "forward":
        assert at[2].grads == 0 and at[2].terms.get("fsdp_all_gather", 0) > 0, at[2]


PIPELINES = [("LLaMA", "none", "none", WHOLE), ("GPT-2", "none", "none", WHOLE), ("ViT", "bf16", "full", BENCH),
             ("BERT", "bf16", "none", BENCH)]


def _measure_pipelines(keys: list[tuple]) -> dict:
    """(family, amp, recompute) -> (graph, plan, cost, both ranks' measurements): pp=2 1F1B, 2 micro-batches."""
    from autopar_nb.cost import estimate
    from autopar_nb.verify.measure import measure_many

    planned = {}
    for family, amp, recompute, size in [c for c in PIPELINES if c[:3] in keys]:
        src = ModelSource(CELLS[family](**size))
        meta, example, _ = src.build(device="meta")
        graph = ap.capture(meta, example)
        cluster = ap.Cluster.preset("cpu", 1, 2)
        plan = ap.plan(graph, cluster, global_batch=size["batch"],
                       fix={"pp": 2, "micro_batches": 2, "schedule": "1f1b", "amp": amp, "recompute": recompute})
        planned[family, amp, recompute] = src, graph, cluster, plan, estimate(graph, cluster, plan)
    got = measure_many([(src, plan, (0, 1)) for src, _, _, plan, _ in planned.values()])
    return {key: (*rest, m) for (key, (_, *rest)), m in zip(planned.items(), got, strict=True)}


@pytest.fixture(scope="module")
def pipelines(request):
    """The pipeline cases this session runs, measured 4 at a time on first use (:class:`batched.Batched`)."""
    cases = selected(request, test_pipeline_stages_memory_matches_the_tracker)
    return Batched([(c["family"], c["amp"], c["recompute"]) for c in cases], _measure_pipelines)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family, amp, recompute, size", PIPELINES)
def test_pipeline_stages_memory_matches_the_tracker(family, amp, recompute, size, pipelines):
    """pp=2 1F1B, 2 micro-batches, on 2 real gloo processes (``measure``: a real group): every rank's components and
    total within 5 %, its parameters its own stage's only (the other stage's weights freed: ``release_stages``; GPT-2's
    last stage also holds its copy of the tied embedding), its buffers the receive buffers of the micro-batches in
    flight (``pipeline_buffers``: ``LeanStage`` empties each after its backward; torch would keep one per
    micro-batch), LLaMA's stage inputs without a materialised causal mask (``masks_as_in_eager``). The last rank's
    backward of its second micro-batch also holds the first one's input gradient, whose send torch's 1F1B keeps
    until then (``pipeline_sent_gradients``; ViT's rank 1 under full recompute was -6.3 % without it), and no rank
    keeps the batch the stages were traced on (ViT's images: the script drops it after ``parallelize``). BERT's first
    rank under bf16 autocast peaks in an attention's backward, where CPU SDPA's math kernel (dropout) holds the
    attention weights' float32 gradient (``profile.moments.math_attention_gradients``; 11.5 MiB of temporaries short
    without it)."""
    from autopar_nb.cost.estimate import peak_moments
    from autopar_nb.verify.moments import GROUPS, measured_groups, moment_at, predicted_groups

    graph, cluster, plan, cost, measured = pipelines[family, amp, recompute]
    assert not isinstance(measured, Exception), measured
    tokens = (round(size["seq"] ** 0.5) ** 2 + 1) if family == "ViT" else size["seq"]  # 4x4 patches, class token
    one_input = size["batch"] // 2 * tokens * size["hidden"] * 4  # a micro-batch of the stream stage 1 receives
    assert cost.memory_by_rank[1].terms["pipeline_sent_gradients"] == pytest.approx(one_input)
    moments, paths = peak_moments(graph, cluster, plan), [lay.path for lay in graph.layers]
    for rank, got in zip((0, 1), measured, strict=True):
        mb, m = cost.memory_by_rank[rank], got["peak"]
        p, g = predicted_groups(mb), measured_groups(m)
        # the tracker names a module by its path in the stage (measure._Session.name_within; a checkpoint-wrapped
        # layer was "CheckpointWrapper", a root of its own), and a backward peak in a layer is at a moment of the
        # model's (where the peak is varies from run to run between moments of nearly the same total)
        module = got["where"].partition(" in ")[2]
        assert not module.startswith("CheckpointWrapper"), got["where"]
        if got["where"].startswith(("train/backward in Pipe", "train/recompute in Pipe")) and "layers" in module:
            assert moment_at(got["where"], paths, moments[rank]) is not None, got["where"]
        for group in GROUPS:
            assert p[group] == pytest.approx(g[group], abs=WITHIN * m["total"] + 1024), (rank, group, p, g)
        assert mb.total - mb.margin == pytest.approx(m["total"], rel=WITHIN), (rank, mb, m)
        assert m["params"] < 0.75 * graph.param_bytes, (rank, m["params"], graph.param_bytes)
        # (GPT-2's ranks held pipeline()'s copy of the tied embedding too, until split_model freed it)
        assert mb.terms["pipeline_buffers"] == pytest.approx(g["buffers"], abs=64 * 1024), (rank, mb.terms, g)



@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # four 2-rank measurements: 10 min on a loaded 2-core host
def test_an_interleaved_ranks_memory_does_not_grow_with_its_micro_batches():
    """Interleaved 1F1B (pp=2, 2 stages a rank) on 2 real gloo processes, micro-batches of one sequence: 4 of them,
    then 16. Torch's multi-stage schedule keeps every send's work, and the output or input gradient it sends, until
    the step ends; the stages issue their sends themselves and let each go once its peer has received it
    (``runtime/pp.py`` ``Sends``): rank 0's peak is nearly the same under 16 micro-batches (it was 20 % higher),
    rank 1's grows by the input gradients of its lowest stage alone (waited for at the step's end; it grew by its
    outputs and every stage's gradients, 9 MiB). The model's prediction is within 5 % of each, by component."""
    from autopar_nb.cost import estimate
    from autopar_nb.verify.measure import measure_many
    from autopar_nb.verify.moments import GROUPS, measured_groups, predicted_groups

    planned = {}
    for m in (4, 16):
        size = BENCH | {"batch": m}
        src = ModelSource(CELLS["LLaMA"](**size))
        meta, example, _ = src.build(device="meta")
        graph = ap.capture(meta, example)
        cluster = ap.Cluster.preset("cpu", 1, 2)
        plan = ap.plan(graph, cluster, global_batch=m, fix={"pp": 2, "micro_batches": m, "virtual_stages": 2,
                                                            "schedule": "interleaved_1f1b"})
        planned[m] = src, plan, estimate(graph, cluster, plan)
    measured = measure_many([(src, plan, (0, 1)) for src, plan, _ in planned.values()])  # one forkserver for both
    peaks = {}
    for (m, (_, _, cost)), ranks in zip(planned.items(), measured, strict=True):
        assert not isinstance(ranks, Exception), ranks
        for rank, got in zip((0, 1), ranks, strict=True):
            mb, got = cost.memory_by_rank[rank], got["peak"]
            p, g = predicted_groups(mb), measured_groups(got)
            for group in GROUPS:
                assert p[group] == pytest.approx(g[group], abs=WITHIN * got["total"] + 1024), (m, rank, group, p, g)
            assert mb.total - mb.margin == pytest.approx(got["total"], rel=WITHIN), (m, rank, mb, got)
            peaks[m, rank] = got["total"]
    # measured: 46.1 -> 46.7 and 41.2 -> 44.3 MiB (torch's schedule holding its sends: 47.5 -> 57.2, 42.2 -> 51.3)
    assert peaks[16, 0] < 1.03 * peaks[4, 0], peaks
    assert peaks[16, 1] < 1.1 * peaks[4, 1], peaks

class _SharedBias(nn.Module):
    """Three blocks each taking the hidden states and one bias tensor every block reads (T5's position bias)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.bias = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_BiasedBlock(d) for _ in range(3))

    def forward(self, x):
        bias = self.bias(x)
        h = x
        for block in self.blocks:
            h = block(h, bias)
        return h.sum()


class _BiasedBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h, bias):
        return self.lin(h) + bias


@pytest.mark.parametrize("patched", [False, True])
def test_the_trackers_module_hooks_hold_no_gradients_while_measuring(patched):
    """Torch's module tracker (inside MemTracker) hooks every module's inputs with ``register_multi_grad_hook``'s
    "all" mode, which keeps each input's gradient until the module's other inputs have theirs: a block that also
    takes a tensor every block reads keeps its hidden states' gradient until the end of backward (T5's decoder under
    the tracker: one residual gradient per sub-layer alive at once, memory the script without the tracker never
    holds). ``measure`` runs the script with those hooks called at the first gradient instead: when the shared
    bias's gradient is complete, none of the blocks' input gradients is alive any more; unpatched, two are."""
    import contextlib
    import weakref

    from torch.distributed._tools.mod_tracker import ModTracker

    from autopar_nb.verify.measure import _input_hooks_holding_nothing

    model, x = _SharedBias(), torch.randn(4, 8, requires_grad=True)
    alive_at_bias: list[int] = []
    grads: list[weakref.ref] = []

    def note(g):
        grads.append(weakref.ref(g))

    with _input_hooks_holding_nothing() if patched else contextlib.nullcontext(), ModTracker():
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, args: args[0].register_hook(note) and None)
        model.bias.register_forward_hook(
            lambda m, args, out: out.register_hook(lambda g: alive_at_bias.append(sum(r() is not None
                                                                                      for r in grads))) and None)
        model(x).backward()
    assert len(grads) == 3
    # unpatched: the last two blocks' (the first block's comes after the bias's, at the end of backward)
    assert alive_at_bias == ([0] if patched else [2]), alive_at_bias


@pytest.mark.parametrize("named", [False, True])
def test_modules_wrapped_after_the_tracker_saw_their_parent_keep_their_paths(named):
    """A pipelined plan's ``parallelize`` traces the model (the tracker sees every stage) and then wraps the stages'
    layers in checkpoint wrappers: torch's ModTracker names a module it meets outside the children it listed as a
    root of its own, so a tracked peak in a recomputed layer read "CheckpointWrapper._checkpoint_wrapped_module",
    naming no layer. ``measure`` names the modules under what ``parallelize`` returned again
    (``_Session.name_within``): the peak's module is the layer's path in its stage."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from autopar_nb.verify.measure import _Session

    model, x = _SharedBias(), torch.randn(4, 8, requires_grad=True)
    session = _Session(steps=1)
    names: list[str] = []
    with session.active:
        model(x)  # the tracker lists the model's modules
        session.active.reset_mod_stats()
        model.blocks.register_module("1", checkpoint_wrapper(model.blocks[1], preserve_rng_state=False))
        if named:
            session.name_within([model])
        tracker = session.active._mod_tracker
        model.blocks[1].register_forward_pre_hook(lambda m, a: names.append(tracker.get_known_fqn(m)) and None)
        model(x).sum().backward()
    assert names == (["_SharedBias.blocks.1"] if named else ["CheckpointWrapper"]), names


def test_a_backward_op_is_placed_in_the_layer_whose_forward_made_its_node():
    """``measure`` places a backward peak by the autograd node running (``NodeSpans``): its sequence number falls
    in the span of the module whose forward made it, however the tracker's module hooks lag (under full recompute
    the tracker named layers 2-3 while the gradients put the step at layer 0). Every backward and recompute op of
    a 3-layer MLP, the middle layer checkpointed, is placed in the layer its node belongs to, in reverse order."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar_nb.verify.node_spans import NodeSpans

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), checkpoint_wrapper(nn.Sequential(nn.Linear(8, 8), nn.GELU()),
                                                             preserve_rng_state=False), nn.Linear(8, 1))
    names = {m: n for n, m in model.named_modules()}
    spans = NodeSpans(names.get)
    placed: list[str | None] = []

    class Placing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            node = torch._C._current_autograd_node()
            if node is not None and func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                hit = spans.module_of(node._sequence_nr())
                placed.append(hit and hit[0])
            return func(*args, **(kwargs or {}))

    with spans:
        loss = model(torch.randn(4, 8, requires_grad=True)).sum()
    with Placing():
        loss.backward()
    layers = [name.split(".")[0] if name else None for name in placed]
    # each Linear's backward: its input's and its weight's gradients (2 mm); layer 1's recompute first (its addmm,
    # run by the first of its nodes to need a saved tensor: the GELU's)
    assert layers == ["2", "2", "1", "1", "1", "0", "0"], placed
    assert placed[2:5] == ["1._checkpoint_wrapped_module.1"] + ["1._checkpoint_wrapped_module.0"] * 2, placed


def test_an_op_between_two_modules_is_placed_in_their_caller():
    """A node made between two child modules (LLaMA's silu x up product, which the down projection reads) is its
    caller's, not the next module's: a module's span begins after its inputs' nodes."""
    from autopar_nb.verify.node_spans import NodeSpans

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.down(self.up(x) * 2.0)

    model = nn.Sequential(Block())
    names = {m: n for n, m in model.named_modules()}
    with NodeSpans(names.get) as spans:
        out = model(torch.randn(4, 8, requires_grad=True))
        again = model(torch.randn(4, 8, requires_grad=True))  # a pipeline stage's second micro-batch
    mul = next(fn for fn, _ in out.grad_fn.next_functions if fn is not None and fn.name() == "MulBackward0")
    assert spans.module_of(mul._sequence_nr()) == ("0", 0)
    assert spans.module_of(out.grad_fn._sequence_nr()) == ("0.down", 0)
    assert spans.module_of(mul.next_functions[0][0]._sequence_nr()) == ("0.up", 0)
    assert spans.module_of(again.grad_fn._sequence_nr()) == ("0.down", 1)  # the step's second call
    spans.new_step()
    assert spans.module_of(again.grad_fn._sequence_nr()) is None


def test_a_loss_made_between_pipeline_forwards_is_no_modules():
    """A pipeline stage computes a micro-batch's loss outside its modules, then runs the next micro-batch's forward
    from a received leaf: the loss's nodes are no module's (they were placed in the next forward's first module,
    so a last stage's loss backward was compared at a layer's backward)."""
    from autopar_nb.verify.node_spans import NodeSpans

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    names = {m: n for n, m in model.named_modules()}
    with NodeSpans(names.get) as spans:
        loss = model(torch.randn(4, 8, requires_grad=True)).log_softmax(-1).sum()
        model(torch.randn(4, 8, requires_grad=True))  # the next micro-batch, from a leaf
    assert spans.module_of(loss.grad_fn.next_functions[0][0]._sequence_nr()) is None


def test_a_forward_and_a_loss_know_their_micro_batch():
    """A pipeline stage's forward runs once per micro-batch: while a module runs, ``forward_call`` says which of the
    step's calls it is (a module whose output makes no node is counted too), and a loss made outside every module
    is the micro-batch whose forward finished just before it (``call_before``), as a backward's node is."""
    from autopar_nb.verify.node_spans import NodeSpans

    model = nn.Sequential(nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8))
    names = {m: n for n, m in model.named_modules()}
    seen: list[tuple] = []
    model[0].register_forward_hook(lambda *_: seen.append((spans.forward_call("0"), spans.forward_call("1"))))
    with NodeSpans(names.get) as spans:
        assert spans.forward_call("0") is None and spans.call_before() is None
        losses = []
        for _ in range(3):  # three micro-batches, each from a received leaf, each with its loss
            losses.append(model(torch.randn(4, 8, requires_grad=True)).log_softmax(-1).sum())
            assert spans.call_before() == len(losses) - 1
    assert seen == [(0, None), (1, 0), (2, 1)]  # layer 0 runs before the Identity of its micro-batch
    for k, loss in enumerate(losses):
        assert spans.call_before(loss.grad_fn.next_functions[0][0]._sequence_nr()) == k
    spans.new_step()
    assert spans.forward_call("0") is None and spans.call_before() is None


def test_the_experts_a_pipeline_stage_holds_are_named_as_the_model_names_them():
    """A pipeline stage's experts modules are the model's own (runtime/ep.py experts_in_stages), which the tracker
    names through torch.export's wrapper: their layer is found, so their forward and recompute peaks have a moment."""
    from autopar_nb.verify.moments import layer_of

    paths = ["model.layers.0", "model.layers.1"]
    assert layer_of("Wrapper._export_root.model.layers.1.mlp.experts", paths) == 1
    assert layer_of("Pipe.split_gm.submod_pp_0.model.layers.0.mlp.gate", paths) == 0


def test_a_trackers_module_finds_its_layer_as_the_plan_does():
    """verify's layer of a tracker's module name is plan.layer_of's (the longest layer path holding it) as an index,
    the root's "" layer left out: a module outside every other layer names none."""
    from autopar_nb.plan import layer_of as plan_layer_of
    from autopar_nb.verify.moments import layer_of, path_in_layer

    paths = ["", "model.embed_tokens", "model.layers.1", "model.layers.10", "lm_head"]
    assert layer_of("LlamaForCausalLM.model.layers.10.mlp.up_proj", paths) == 3  # not model.layers.1
    assert layer_of("DistributedDataParallel.module.model.layers.1", paths) == 2
    assert layer_of("LlamaForCausalLM.model.norm", paths) is None and layer_of("LlamaForCausalLM", paths) is None
    assert path_in_layer("model.layers.10.mlp", paths) == ".mlp" and path_in_layer("model.norm", paths) == "model.norm"
    for name in ("model.layers.10.mlp", "model.layers.1", "lm_head", "model.embed_tokens.weight"):
        assert paths[layer_of(f"Llama.{name}", paths)] == plan_layer_of(name, paths)


@pytest.mark.parametrize("pp, ep, tp, zero, real", [(1, 1, 1, 0, False), (2, 1, 1, 0, True), (1, 2, 1, 0, True),
                                                    (1, 1, 2, 1, False), (1, 1, 2, 0, False), (1, 1, 1, 1, False)])
def test_plans_whose_ranks_exchange_data_are_measured_on_a_real_group(monkeypatch, tmp_path, pp, ep, tp, zero, real):
    """A fake group delivers nothing: a pipeline's stages and expert parallelism's token counts need a real one
    (under the fake group Mixtral's expert groups got 3270 to 5362 tokens from uninitialised counts, where real
    routing gave 3134 to 4533 and the model's balanced routing 4096), so ``measure`` runs those plans on real gloo
    processes, the others (ZeRO-1 beside TP too, FSDP2 like ZeRO 2) as one rank of a fake group."""
    import importlib
    from types import SimpleNamespace

    from autopar_nb.verify import measure as m

    calls = []
    exporting = importlib.import_module("autopar_nb.export")  # the module (the package's name is the function)
    monkeypatch.setattr(exporting, "export", lambda *a, **k: SimpleNamespace(script=tmp_path / "train.py"))
    monkeypatch.setattr(m, "_run_in_child", lambda specs, folder, **k: calls.extend(specs) or
                        [[{"rank": r} for r in spec["ranks"]] for spec in specs])
    plan = SimpleNamespace(mesh=SimpleNamespace(pp=pp, ep=ep, tp=tp, zero_stage=zero, world_size=2))
    assert m.measure(None, plan, ranks=(0,)) == [{"rank": 0}]
    assert [(c["real"], c["world"], c["ranks"]) for c in calls] == [(real, 2, [0])]
