"""Runtime pieces that need no process group (TP style rules, pipeline placement, batches, recompute, meta init),
and the exported script's ``parallelize`` under a fake process group."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from families import FAMILIES
from runtime_cases import (
    GPT_CELL,
    HF_BERT_CELL,
    HF_DEEPSEEK_V3_CELL,
    HF_FALCON_CELL,
    HF_GEMMA_CELL,
    HF_GPT2_CELL,
    HF_LLAMA_CELL,
    HF_PHI3_CELL,
    LLAMA_CELL,
    RECSYS_CELL,
    gpt_mlp_tp,
    has_transformers,
    llama_tp,
    make_plan,
    script_namespace,
    source,
)

from autopar_nb.planner.styles import tp_styles
from autopar_nb.runtime.ac import apply_ac
from autopar_nb.runtime.data import concat_batches, model_call, split_batch
from autopar_nb.runtime.init import canonical_name, materialize
from autopar_nb.runtime.pp import stage_boundaries, stage_ids


def test_tp_styles_gpt_mlp_and_head():
    model, _, _ = source(GPT_CELL).build(device="meta")
    styles = tp_styles(model, gpt_mlp_tp() | {"lm_head": "colwise", "wte": "rowwise"})
    assert styles["h.0.mlp.c_fc"].source() == "ColwiseParallel(input_layouts=Replicate())"
    assert styles["h.0.mlp.c_proj"].source() == "RowwiseParallel()"
    # no rowwise Linear beside lm_head: it is an output head, its logits are gathered
    assert styles["lm_head"].source() == "ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())"
    assert styles["wte"].source() == "RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())"
    assert list(styles)[0] == "wte"  # model order


def test_tp_styles_sequence_parallel_llama():
    src = source(LLAMA_CELL)
    model, _, _ = src.build(device="meta")
    plan = make_plan(src, tp=2, tp_styles=llama_tp(sp=True), sp=True, loss_parallel=True)
    styles = tp_styles(model, plan.tp_plan, sp_layers=[lp.path for lp in plan.layers],
                       layers=[lp.path for lp in plan.layers], loss_parallel=True)
    # embeddings stay replicated; the first block cuts the sequence (locally), the blocks keep it cut
    assert styles["tok_embeddings"].source() == "RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())"
    assert styles["layers.0"].source().startswith("PrepareFirstInput(input_layouts=(Replicate(),), "
                                         "desired_input_layouts=(Shard(1),)")
    assert "layers.1" not in styles
    assert styles["layers.0.attention_norm"].source() == "SequenceParallel(use_local_output=True)"
    # the block holding the colwise Linears gathers the sequence once; the Linears themselves take replicated input
    assert styles["layers.0.attention"].source().startswith("PrepareFirstInput(input_layouts=(Shard(1),)")
    assert styles["layers.0.attention.wq"].source() == "ColwiseParallel()"
    assert styles["layers.0.attention.wo"].source() == "RowwiseParallel(output_layouts=Shard(1))"
    assert styles["layers.1.feed_forward.w3"].source() == "ColwiseParallel()"  # registered after w2, still not a head
    assert styles["output"].source() == ("ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), "
                                "use_local_output=False)")
    for style in styles.values():
        assert type(style.build()).__name__ == style.class_name  # every style builds its ParallelStyle


def test_tp_styles_sequence_parallel_region():
    """The region: blocks and final norm sequence-parallel, the head outside it takes the sequence shards; a gap in
    the region is an error that says which layers."""
    src = source(LLAMA_CELL)
    model, _, _ = src.build(device="meta")
    layers = ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    tp = llama_tp(sp=True)
    styles = tp_styles(model, tp, sp_layers=["layers.0", "layers.1"], layers=layers)  # "norm" counts by its style
    assert styles["output"].source() == "ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())"
    no_head = tp_styles(model, llama_tp(sp=True, head=False), sp_layers=[], layers=layers)
    assert no_head["output"].source().startswith("PrepareFirstInput(input_layouts=(Shard(1),)")  # gathered back
    gap = {k: v for k, v in tp.items() if not (k.startswith("layers.1.") and v == "sequence_parallel")}
    with pytest.raises(NotImplementedError, match="layers.1 between layers.0 and norm"):
        tp_styles(model, gap, sp_layers=["layers.0", "norm"], layers=layers)
    # a norm left whole inside the region would sum the gradient of one rank's tokens only
    unsplit_norm = {k: v for k, v in tp.items() if k != "layers.0.ffn_norm"}
    with pytest.raises(NotImplementedError, match="layers.0.ffn_norm .RMSNorm. has parameters and no TP style"):
        tp_styles(model, unsplit_norm, sp_layers=["layers.0", "layers.1"], layers=layers)


def test_tp_styles_errors_say_what_to_do():
    model = nn.Sequential(nn.EmbeddingBag(10, 4), nn.Conv1d(4, 4, 1))
    with pytest.raises(NotImplementedError, match="EmbeddingBag"):
        tp_styles(model, {"0": "rowwise"})
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        tp_styles(model, {"1": "colwise"})
    with pytest.raises(ValueError, match="does not have"):
        tp_styles(model, {"2": "colwise"})


def test_pipeline_placement():
    assert stage_ids(1, 2, 2, "1f1b") == [1]
    assert stage_ids(1, 2, 4, "interleaved_1f1b") == [1, 3]
    assert stage_ids(0, 2, 4, "zbv_zero_bubble") == [0, 3]
    assert stage_boundaries([["wte", "h.0"], ["h.1", "lm_head"]]) == ["h.1"]
    with pytest.raises(ValueError, match="stage 1 has no layers"):
        stage_boundaries([["a"], []])


def test_pipeline_cut_before_a_layer_that_reads_a_model_input_passes_it_through():
    """RecSys reads its sparse ids again after the tables: a cut before tables.0 gives stage 1 a model input, which
    stage 0 passes on (runtime/pp.chain_stages; the schedules send a stage only the previous stage's outputs); a cut
    before the top MLP runs with static shapes from the trace."""
    from autopar_nb.runtime.pp_split import boundary_values, split_model

    model, (dense, sparse), _ = source(RECSYS_CELL).build()
    stages, whole = split_model(model, boundaries=["tables.0"], microbatch=((dense, sparse), {}))
    (ins0, outs0), (ins1, outs1) = boundary_values(whole, stages, ((dense, sparse), {}))
    assert [t.shape for t in outs0] == [t.shape for t in ins1]
    assert all(t.is_meta for t in (*ins0, *outs0, *ins1, *outs1))  # shapes only: nothing kept for the run
    assert any(t.dtype == sparse.dtype and t.shape == sparse.shape for t in ins1)
    assert any(torch.equal(t, sparse) for t in stages[0](dense, sparse))  # stage 0 passes the model input on
    model, _, _ = source(RECSYS_CELL).build()  # pipeline() marks the cut points on the model it traces: a fresh one
    stages, whole = split_model(model, boundaries=["top.0"], microbatch=((dense, sparse), {}))
    (ins0, outs0), (ins1, outs1) = boundary_values(whole, stages, ((dense, sparse), {}))
    assert [t.shape for t in outs0] == [t.shape for t in ins1] and outs0[0].is_contiguous()
    assert outs1[0].shape == (8, 1)


def test_split_batch_and_model_call():
    batch = (torch.arange(8).view(4, 2), {"y": torch.arange(4)})
    parts = split_batch(batch, 2)
    assert parts[1][0].tolist() == [[4, 5], [6, 7]] and parts[1][1]["y"].tolist() == [2, 3]
    assert torch.equal(concat_batches(parts)[0], batch[0])

    def loss_fn(model, b):
        x, extra = b
        return model(x * 2, scale=extra["y"]).sum()

    args, kwargs = model_call(loss_fn, batch)
    assert torch.equal(args[0], batch[0] * 2) and set(kwargs) == {"scale"}


def test_recompute_wrappers_keep_gradients():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 4))
    wrapped = copy.deepcopy(ref)
    apply_ac(wrapped, recompute={"0": "full", "2": "selective"})
    assert type(wrapped[0]).__name__ == "CheckpointWrapper" and type(wrapped[2]).__name__ == "CheckpointWrapper"
    x = torch.randn(5, 8)
    ref(x).pow(2).sum().backward()
    wrapped(x).pow(2).sum().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), wrapped.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7), n
    with pytest.raises(ValueError, match="choose"):
        apply_ac(wrapped, recompute={"1": "most"})


class NormNoReset(nn.Module):
    """Like Hugging Face's LlamaRMSNorm: parameters set in __init__, no reset_parameters()."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


HF = pytest.mark.skipif(not has_transformers(), reason="transformers not installed")


MIXTRAL_CELL = FAMILIES["Mixtral"]  # experts allocated with torch.empty in __init__, initialised by post_init only


@pytest.mark.parametrize("cell", [GPT_CELL, LLAMA_CELL, pytest.param(HF_LLAMA_CELL, marks=HF),
                                  pytest.param(HF_GPT2_CELL, marks=HF), pytest.param(HF_BERT_CELL, marks=HF),
                                  pytest.param(MIXTRAL_CELL, marks=HF)])
def test_meta_init_equals_real_init(cell):
    """Models the user did not write included: Hugging Face's post_init (RMSNorm without reset_parameters, rotary
    buffers, GPT-2's Conv1D and its scaled c_proj re-init) is replayed, not only reset_parameters()."""
    src = source(cell)
    real, _, _ = src.build(seed=3)
    meta, _, _ = src.build(device="meta", seed=3)
    part = copy.deepcopy(meta)
    materialize([part], meta, device="cpu", seed=3)
    want = dict(real.named_parameters()) | dict(real.named_buffers())
    got = {canonical_name(n): t for n, t in [*part.named_parameters(), *part.named_buffers()]}
    assert set(want) == set(got)
    for n, a in want.items():
        assert torch.equal(a, got[n]), n


# a pipeline cut of each: the first layer of the second half (the rest of the model on either side)
PIPELINED_CELLS = {"LLaMA": "model.layers.1", "GPT-2": "transformer.h.1", "ViT": "vit.layers.1",
                   "Mixtral": "model.layers.1"}


@HF
@pytest.mark.parametrize("name", list(PIPELINED_CELLS))
def test_meta_init_of_pipeline_stages_equals_real_init(name):
    """A model built on meta, cut into pipeline stages and each stage materialised alone (as a rank holding it does)
    has the real model's weights and buffers (LLaMA's rotary inv_freq computed; GPT-2's lm_head, a copy of wte on
    the last stage, with wte's values) and the traced pipeline computes the real model's output. Before, the stages
    were traced on meta and held the meta program: LLaMA's position ids made on meta, ViT's trace failed (real
    pixels, meta convolution), Mixtral's histc took the int branch CPU lacks (runtime/pp_split.py weights_on)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_flatten

    from autopar_nb.randomness import RandomOff
    from autopar_nb.runtime.data import default_loss
    from autopar_nb.runtime.pp_split import boundary_values, split_model
    from autopar_nb.runtime.train import switch_off_kv_cache

    src = source(FAMILIES[name])
    real, inputs, _ = src.build(seed=3)  # real inputs: the cell's, as the script's example batch is
    meta, _, _ = src.build(device="meta", seed=3)
    for m in (real, meta):
        switch_off_kv_cache(m)  # as the script does before the trace
    skeleton = copy.deepcopy(meta)
    example = model_call(default_loss, split_batch(inputs, 2)[0])
    stages, whole = split_model(meta, boundaries=[PIPELINED_CELLS[name]], microbatch=example)
    shapes = boundary_values(whole, stages, example)
    held = [t for stage in stages for t in (*stage.parameters(), *stage.buffers())]
    assert all(t.is_meta and not isinstance(t, FakeTensor) for t in held)  # nothing allocated, no stand-in left
    assert all(t.is_meta for ins, outs in shapes for t in (*ins, *outs) if isinstance(t, torch.Tensor))
    want = dict(real.named_parameters(remove_duplicate=False)) | dict(real.named_buffers(remove_duplicate=False))
    for i, stage in enumerate(stages):
        materialize([stage], skeleton, device="cpu", seed=3)
        for n, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
            assert torch.equal(t, want[canonical_name(n)]), (i, n)
    with RandomOff():  # dropout on: the traced stages' aten dropout is switched off as the eager model's F.dropout
        got = tree_flatten(whole(*example[0], **example[1]))[0]
        ref = [t for t in tree_flatten(real(*example[0], **example[1]))[0] if isinstance(t, torch.Tensor)]
    assert [t.shape for t in got] == [t.shape for t in ref]
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_meta_init_module_without_reset_parameters():
    def build():
        return nn.Sequential(nn.Linear(4, 4), NormNoReset(4), nn.Linear(4, 2))

    torch.manual_seed(1)
    real = build()
    with torch.device("meta"):
        meta = build()
    part = copy.deepcopy(meta)
    materialize([part], meta, device="cpu", seed=1)
    for a, b in zip(real.parameters(), part.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def fake_world_of_two():
    """A fake process group of 2 ranks in this process: collectives are recorded, not run."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sp", [False, True])
def test_tp_collectives_are_megatrons(fake_world_of_two, sp, tmp_path):
    """One forward of a 2-layer Llama with TP: Megatron's collectives, counted as they run (tests/collectives.py).

    Without SP: an all-reduce per row-parallel output (vocab-parallel embedding + wo + w2 per layer = 5) and one
    all-gather of the logits. With SP: the blocks' all-reduces become reduce-scatters (4), the embedding's stays
    (its output is replicated), and each block gathers its sequence shards once per sub-block (2 per layer) plus the
    head's input and its logits."""
    from collectives import CollectiveCounts

    src = source(LLAMA_CELL)
    plan = make_plan(src, tp=2, tp_styles=llama_tp(sp=sp), sp=sp)
    script = script_namespace(src, plan, tmp_path)  # the exported script, imported: its model and parallelize()
    assert [lp.sequence_parallel for lp in plan.layers] == [sp] * 5
    mesh = script["build_mesh"]("cpu", 1, 1, 2)
    (model,) = script["parallelize"](script["model"], mesh, "cpu")
    with CollectiveCounts() as comm:
        logits = model(*script["example_inputs"])
    counts = dict(comm.counts)
    if sp:
        assert counts == {"all_reduce": 1, "reduce_scatter_tensor": 4, "all_gather_into_tensor": 6}
    else:
        assert counts == {"all_reduce": 5, "all_gather_into_tensor": 1}
    assert logits.shape == (4, 16, 64)


def test_the_overhead_bench_steps_zero1_over_fsdp2_shards_as_the_runtime_does(fake_world_of_two):
    """bench/overhead.py times the optimizer step per tensor of what the product runs: ZeRO-1 is FSDP2
    (``apply_fsdp`` without resharding after forward), not torch's ZeroRedundancyOptimizer over whole
    parameters: every parameter the step sees is a DTensor shard, and a forward leaves the layers gathered."""
    import sys

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from overhead import BATCH, WIDTH, optimizer_model

    mesh = init_device_mesh("cpu", (2,))
    model = optimizer_model("zero1", 3, mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model(torch.randn(BATCH, WIDTH))
    assert not any(isinstance(p, DTensor) for p in model[1].parameters())  # unsharded until backward


HELD_CELLS = {"GPT-2": HF_GPT2_CELL, "zoo GPT": GPT_CELL, "Falcon": HF_FALCON_CELL, "DeepSeek-V3": HF_DEEPSEEK_V3_CELL,
              "Gemma": HF_GEMMA_CELL, "Phi-3 GQA": HF_PHI3_CELL.format(kv=2), "Qwen3": FAMILIES["Qwen3"],
              "GPTBigCode": FAMILIES["GPTBigCode"]}
"""TP layouts whose ranks hold more than 1/tp of a projection: GPT-2's Conv1D ``c_attn`` split part by part (its bias
whole), Falcon's fused multi-query ``query_key_value`` repeated (whole), GPTBigCode's multi-query ``c_attn`` split as
one block (parts of different widths), DeepSeek-V3's MLA (the low-rank down
projections and ``kv_a_proj_with_mqa`` whole), Gemma's single key/value head repeated, Phi-3's GQA ``qkv_proj`` split
as one block, Qwen3's per-head q/k norms (whole)"""


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_a_tp_rank_holds_the_parameter_bytes_the_planner_counts(tmp_path):
    """Under tp=2 the planner's parameter bytes on rank 0 are what the exported ``parallelize()`` leaves there
    (local shards of DTensors, whole tensors elsewhere), byte for byte."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar_nb as ap

    planned = {}
    for name, cell in HELD_CELLS.items():  # planned before the fake group exists (the layout run makes its own)
        src = source(cell)
        model, inputs, _ = src.build(device="meta")
        planned[name] = src, ap.plan(ap.capture(model, inputs), ap.Cluster.preset("cpu", gpus_per_node=2),
                                     fix={"tp": 2, "dp": 1})
    assert {"shared", "per_head"} <= {style for _, plan in planned.values() for style in plan.tp_plan.values()}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        held = {}
        for name, (src, plan) in planned.items():
            script = script_namespace(src, plan, tmp_path)
            (model,) = script["parallelize"](script["model"], script["build_mesh"]("cpu", 1, 1, 2), "cpu")
            local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
            held[name] = sum(t.numel() * t.element_size() for t in local)
    finally:
        dist.destroy_process_group()
    assert held == {name: plan.cost.memory_by_rank[0].params for name, (_, plan) in planned.items()}


def test_gradient_accumulation_all_reduces_once_per_step():
    """The cost model counts one DDP all-reduce per step however many micro-batches accumulate (no_sync before the
    last); the runtime's accumulate() does the same: DDP's comm hook is called once for 4 micro-batches."""
    import functools

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar_nb.runtime.amp import step_context
    from autopar_nb.runtime.train import accumulate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        calls = []

        def count(state, bucket):
            calls.append(bucket.index())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
        model.register_comm_hook(None, count)
        loss = functools.partial(lambda m, b: m(*b).pow(2).mean())
        accumulate(model, (torch.randn(8, 4),), micro_batches=4, loss_fn=loss,
                   context=functools.partial(step_context, "cpu"))
        assert calls == [0]  # one bucket, all-reduced once
        accumulate(model, (torch.randn(8, 4),), micro_batches=1, loss_fn=loss,
                   context=functools.partial(step_context, "cpu"))
        assert calls == [0, 0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("zero, per_unit", [(1, 1), (2, 4)])
def test_zero1_reduce_scatters_once_per_step(fake_world_of_two, monkeypatch, zero, per_unit):
    """ZeRO-1 is FSDP2 driven as Megatron's distributed optimizer: accumulate() keeps 4 micro-batches' gradients
    unsharded and reduce-scatters each unit once, in the last backward; ZeRO-2 reduce-scatters every micro-batch
    (what cost/dp_comm.py's fsdp_counts counts)."""
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from autopar_nb.runtime.amp import step_context
    from autopar_nb.runtime.train import accumulate

    calls = []
    made = dist.reduce_scatter_single
    monkeypatch.setattr(dist, "reduce_scatter_single", lambda *a, **k: calls.append(1) or made(*a, **k))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    fully_shard(model[0], reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    accumulate(model, (torch.randn(8, 4),), micro_batches=4, loss_fn=lambda m, b: m(*b).pow(2).mean(),
               context=functools.partial(step_context, "cpu"), zero_stage=zero)
    assert len(calls) == 2 * per_unit  # two units: model[0] and the root
    assert all(p.grad is not None and p.grad.to_local().numel() <= 8 for p in model.parameters())  # sharded


class _Stop(Exception):
    pass


def test_the_data_wait_summary_reduces_on_the_ranks_device(monkeypatch):
    """NCCL reduces no CPU tensor: the data-wait summary at the end of training is made on the training device (an
    H200 run failed there, after its last step). "meta" stands in for CUDA."""
    import torch.distributed as dist

    from autopar_nb.runtime.train import data_summary

    seen = []

    def all_reduce(t, *args, **kwargs):
        seen.append(t.device.type)
        raise _Stop

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(_Stop):
        data_summary(1.0, 10.0, loader=False, metrics=None, device="meta")
    assert seen == ["meta"]


def test_a_tensor_two_stages_of_a_rank_hold_is_stepped_once():
    """A weight tied across pipeline stages of one rank (T5's shared embedding, read by the encoder's first stage and
    the decoder's) is one tensor in two parts: the optimizer steps it once, and the gradient norm counts it once."""
    from autopar_nb.runtime.optim import build_optimizer, clip_grad_norm, parameters_of

    emb = nn.Embedding(8, 4)
    parts = [nn.ModuleDict({"emb": emb, "fc": nn.Linear(4, 4)}), nn.ModuleDict({"emb": emb})]
    params = parameters_of(parts)
    assert len(params) == 3 and params[0] is emb.weight
    emb.weight.grad = torch.ones_like(emb.weight)
    before = emb.weight.detach().clone()
    optimizer = build_optimizer(params, "adam", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    assert clip_grad_norm(params, 1e9).item() == pytest.approx(32 ** 0.5)
    optimizer.step()
    assert torch.allclose(before - emb.weight.detach(), torch.full_like(before, 1e-3), atol=1e-6)  # lr: one step


@pytest.mark.parametrize("dt, shown", [(40.4e-6, "40.4 µs"), (0.0123, "12.3 ms"), (29.0567, "29.1 s")])
def test_the_step_line_scales_its_unit_to_the_time(monkeypatch, capsys, dt, shown):
    """The exported script's per-step line says a step's time in the unit its size calls for, as the widget and the
    run summary do (it said "0.0 ms" for a 40 µs step and "29056.7 ms" for a 29 s one)."""
    import torch.distributed as dist

    from autopar_nb.runtime.train import report

    sent = []
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    report(3, 1.5, dt, None, metrics=type("M", (), {"send": staticmethod(sent.append)}), device="cpu", dp=1,
           tokens=False)
    assert capsys.readouterr().out == f"step 3 | loss 1.5 | {shown}\n"
    assert sent[0]["step_time_s"] == dt


def test_the_runtimes_formatter_is_the_packages():
    """One formatter: the runtime (copied into exported scripts, so it cannot import the package) holds it, and
    autopar_nb.units hands out that very function; parse_time reads back what it writes."""
    from autopar_nb import units
    from autopar_nb.runtime import units as runtime_units

    assert units.fmt_time is runtime_units.fmt_time and units.fmt_bytes is runtime_units.fmt_bytes
    for s in (40.4e-6, 0.0123, 1.5, 3e-9):
        assert units.parse_time(units.fmt_time(s)) == pytest.approx(s, rel=5e-3)


def test_a_failing_rank_ends_its_traceback_with_one_line_at_the_users_line(tmp_path, monkeypatch):
    """An exported script run by hand under torchrun: the failing rank's traceback (and the one torchrun's report
    quotes) ends with one line naming the user's file and line and the first real cause, not torch's frames or the
    runtime's (issue 40 item 3)."""
    import importlib.util

    import autopar_nb.runtime.metrics as metrics

    user = tmp_path / "train.py"
    user.write_text("import torch.nn.functional as F\n\n\ndef loss_fn(x, y):\n    return F.cross_entropy(x, y)\n")
    spec = importlib.util.spec_from_file_location("users_train", user)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(metrics, "init_distributed", lambda: "cpu")  # no process group needed to fail
    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 1)
    with pytest.raises(ValueError) as info, metrics.distributed():
        module.loss_fn(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))
    assert info.value.__notes__ == ["rank 1 failed at train.py line 5 in loss_fn (`return F.cross_entropy(x, y)`): "
                                    "ValueError: Expected input batch_size (4) to match target batch_size (5)."]


def test_a_keyword_input_of_the_batch_times_the_heads_is_cut_to_the_ranks_heads_of_every_row(fake_world_of_two):
    """Bloom's ALiBi (batch x heads, 1, T), named (0, heads): rank 0 of 2 gets heads 0-1 of each of the 3 batch rows
    (the batch read from the size, not the capture's), and what the module's forward sees is that block."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar_nb.runtime.heads import shard_head_tables

    class Attention(torch.nn.Module):
        def forward(self, x, *, alibi):
            return alibi

    model = torch.nn.Sequential()
    model.add_module("attn", Attention())
    shard_head_tables(model, init_device_mesh("cpu", (2,)), {"attn": {"alibi": (0, 4)}})
    alibi = torch.arange(3 * 4 * 5, dtype=torch.float32).view(3 * 4, 1, 5)
    got = model.attn(torch.zeros(3, 5, 8), alibi=alibi)
    assert torch.equal(got, alibi.view(3, 4, 1, 5)[:, :2].reshape(3 * 2, 1, 5))
