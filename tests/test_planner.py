"""The planner: TP styles from dataflow, constraints and overrides, errors, properties."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.plan import Plan, PlanError

GiB = 2**30


def capture(model_fn, inputs):
    with torch.device("meta"):
        model = model_fn()
    return ap.capture(model, inputs)


@pytest.fixture(scope="module")
def gpt():
    cfg = zoo.GPTConfig(n_layer=4, n_head=8, n_embd=512, vocab_size=8192, block_size=256)
    return capture(lambda: zoo.GPT(cfg), torch.randint(0, 8192, (8, 256)))


@pytest.fixture(scope="module")
def llama():
    cfg = zoo.LlamaConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1024)
    return capture(lambda: zoo.Llama(cfg), torch.randint(0, 4096, (8, 256)))


@pytest.fixture(scope="module")
def seed():
    return capture(zoo.SeedMLP, torch.randn(32, 1024))


def h100(nodes=1, gpus=8, memory=None, **calibration):
    c = ap.Cluster.preset("h100-80gb", nodes, gpus)
    if calibration:
        c = dataclasses.replace(c, calibration=calibration)
    if memory is not None:
        c = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_bytes=memory))
    return c


def test_seed_mlp_plan_has_cost_alternatives_explanation(seed):
    p = ap.plan(seed, h100(1, 2))
    assert p.mesh.world_size == 2
    c = p.cost
    assert c.step_time_s > 0 and c.peak_memory_bytes > 0 and c.memory_by_rank
    assert c.step_time_s >= c.compute_s > 0
    assert c.model_tflops_per_gpu > 0 and c.hardware_tflops_per_gpu >= c.model_tflops_per_gpu
    assert c.tokens_per_s is None and c.samples_per_s > 0
    times = [p.cost.step_time_s] + [a.cost.step_time_s for a in p.alternatives]
    assert times == sorted(times) and len(p.alternatives) <= 4
    text = p.explain()
    assert "Chosen:" in text and "Peak memory" in text
    mb = max(c.memory_by_rank, key=lambda m: m.total)
    assert sum(mb.terms.values()) == pytest.approx(mb.activations + mb.buffers)
    # its named terms, largest first (ZeRO 2's peak here is the optimizer step: every gradient and a foreach
    # temporary of their size; in a backward the units after the layer have resharded their parameters)
    names = [k.replace("_", " ") for k, _ in sorted(mb.terms.items(), key=lambda kv: -kv[1])]
    assert names and f"Activations and buffers there: {names[0]}" in text and all(n in text for n in names)
    assert "fsdp unsharded params" not in names and "optimizer step temporaries" in names
    again = Plan.from_json(p.to_json())
    assert again.diff(p) == [] and again.cost.step_time_s == p.cost.step_time_s
    assert len(again.alternatives) == len(p.alternatives)


def test_gpt_tp_styles_from_dataflow(gpt):
    p = ap.plan(gpt, h100(), global_batch=8, fix={"tp": 2, "pp": 1})
    tp = p.tp_plan
    # fused QKV: c_attn(x).split(C, dim=2) cuts the sharded dim into q, k, v of 8 heads each: split part by part
    assert tp["h.0.attn.c_attn"] == "colwise" and tp["h.0.attn.c_proj"] == "rowwise"
    assert p.tp_parts == {f"h.{i}.attn.c_attn": [8, 8, 8] for i in range(4)}
    assert p.layer("h.1").tp_parts == {"h.1.attn.c_attn": [8, 8, 8]}
    assert "Fused projections split part by part" in p.explain() and "h.*.attn.c_attn [8, 8, 8]" in p.explain()
    assert tp["h.3.mlp.c_fc"] == "colwise" and tp["h.3.mlp.c_proj"] == "rowwise"
    assert tp["wte"] == "rowwise" and tp["lm_head"] == "colwise" and p.loss_parallel
    # wpe is looked up with arange(T) positions: replicated; wte(idx) + wpe(pos) is added before the blocks, where
    # the activations are whole, and the first block cuts the sum along the sequence
    assert "wpe" not in tp and p.layer("h.2").sequence_parallel and tp["h.0.ln_1"] == "sequence_parallel"
    assert p.layer("wpe").sequence_parallel is False and not p.layer("wpe").tp


def test_tp_fused_projection_split_part_by_part():
    """A Linear whose colwise output is cut along the sharded dim into pieces that make up the whole is split part by
    part (parts in features when no view splits them into heads); chunk along another dim is a plain colwise split;
    pieces that leave part of the output unused refuse the split, even on an override."""
    import torch.nn as nn

    from autopar_nb.cost.profile import profile

    class Fused(nn.Module):
        def __init__(self, cut: str):
            super().__init__()
            self.cut = cut
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16 if cut == "rows" else 8, 8)

        def forward(self, x):
            y = self.up(x)
            if self.cut == "slice":  # half of the output never used
                return self.down(y[..., :8])
            a, b = y.chunk(2, dim=0 if self.cut == "rows" else -1)
            return self.down(a * b)

    for cut, style, parts in (("features", "colwise", (8, 8)), ("rows", "colwise", None), ("slice", None, None)):
        g = ap.capture(Fused(cut).to("meta"), (torch.randn(4, 8, device="meta"),))
        prof = profile(g)
        lp = prof.layers[0]
        assert lp.tp.get("up") == style, (cut, lp.tp)
        assert (lp.parts["up"].counts if "up" in lp.parts else None) == parts and not lp.repeatable
        if cut == "features":
            assert lp.layout("up", 2) == "packed" and lp.layout("up", 16) == ""
            p = ap.plan(g, h100(1, 2), fix={"tp": 2})
            assert p.tp_parts == {"up": [8, 8]} and "up [8, 8]" in p.explain()
        if cut == "slice":
            assert "do not make up its 16 outputs" in prof.tp_refused["up"]
            with pytest.raises(PlanError, match="do not make up its 16 outputs"):
                ap.plan(g, h100(1, 2), fix={"tp": 2}, overrides={"up": {"tp": "colwise"}})


def test_llama_tp_styles_gqa(llama):
    p = ap.plan(llama, h100(), global_batch=8, fix={"tp": 4, "pp": 1})
    tp = p.tp_plan
    for m in ("wq", "wk", "wv"):
        assert tp[f"layers.1.attention.{m}"] == "colwise"
    assert tp["layers.1.attention.wo"] == "rowwise"
    assert tp["layers.1.feed_forward.w1"] == tp["layers.1.feed_forward.w3"] == "colwise"
    assert tp["layers.1.feed_forward.w2"] == "rowwise"
    assert tp["tok_embeddings"] == "rowwise" and tp["output"] == "colwise" and p.loss_parallel


def test_seed_mlp_tp_pairs_across_layers(seed):
    p = ap.plan(seed, h100(1, 2), fix={"tp": 2})
    assert p.tp_plan == {"linear1": "colwise", "linear2": "rowwise"} and not p.loss_parallel


def test_tp_must_divide_heads(llama):
    # 8 query heads, 4 kv heads: tp=8 splits the query heads and repeats the key/value projections
    p = ap.plan(llama, h100(), global_batch=8, fix={"tp": 8})
    assert p.layer("layers.1").tp_parts == {"layers.1.attention.wk": [4], "layers.1.attention.wv": [4]}
    assert p.tp_plan["layers.1.attention.wk"] == "colwise" and "Key/value projections repeated" in p.explain()
    assert ap.plan(llama, h100(), global_batch=8, fix={"tp": 4}).tp_parts == {}  # 4 kv heads split: no parts
    # 6 heads: tp=4 splits neither the query heads nor (6 % 4, 4 % 6) the key/value heads
    six = capture(lambda: zoo.Llama(zoo.LlamaConfig(vocab_size=4096, dim=384, n_layers=2, n_heads=6, n_kv_heads=6,
                                                    ffn_dim=1024)), torch.randint(0, 4096, (8, 256)))
    with pytest.raises(PlanError, match="tp=4 does not divide the head count 6"):
        ap.plan(six, h100(), global_batch=8, fix={"tp": 4})
    assert ap.plan(six, h100(), global_batch=8).mesh.tp in (1, 2)


def test_unknown_override_and_fix_raise(gpt):
    with pytest.raises(PlanError, match="names no layer"):
        ap.plan(gpt, h100(), global_batch=8, overrides={"blocks.*": {"recompute": "full"}})
    with pytest.raises(PlanError, match="unknown fix key"):
        ap.plan(gpt, h100(), global_batch=8, fix={"tensor_parallel": 2})
    with pytest.raises(PlanError, match="whole layers"):
        ap.plan(gpt, h100(), global_batch=8, overrides={"h.0.mlp": {"stage": 1}})
    with pytest.raises(PlanError, match="Linear pair"):
        ap.plan(gpt, h100(), global_batch=8, overrides={"ln_f": {"tp": "colwise-rowwise"}})


def test_infeasible_fix_says_by_how_much(gpt):
    tiny = h100(memory=0.5 * GiB)
    # (DDP's gradient buckets, 80.6 MiB = the parameters in fp32, counted since issue 21)
    with pytest.raises(PlanError, match=r"needs 1\.50 GiB on pipeline rank 0, 10[12]\d MiB over the memory limit") as e:
        ap.plan(gpt, tiny, global_batch=8, fix={"dp": 8, "tp": 1, "pp": 1, "zero_stage": 0, "recompute": "none"})
    assert "fix" in str(e.value)


def test_overrides_are_honoured(gpt):
    overrides = {"h.3": {"stage": 1}, "h.0": {"recompute": "full"}, "h.*.mlp": {"tp": "colwise-rowwise"},
                 "wte": {"tp": "vocab"}, "h.1": {"fsdp": False}}
    p = ap.plan(gpt, h100(), global_batch=8, overrides=overrides)
    for plan in [p, *p.alternatives]:
        assert plan.layer("h.3").stage == 1 and "stage" in plan.layer("h.3").pinned
        assert plan.layer("h.0").recompute == "full" and "recompute" in plan.layer("h.0").pinned
        assert plan.layer("h.1").fsdp is False
        assert plan.mesh.tp > 1  # a TP style was asked for
        assert plan.tp_plan["h.2.mlp.c_fc"] == "colwise" and plan.tp_plan["h.2.mlp.c_proj"] == "rowwise"
        assert plan.tp_plan["wte"] == "rowwise"
        stages = [plan.layer(f"h.{i}").stage for i in range(4)]
        assert stages == sorted(stages)
    assert "Override honoured: h.3" in p.explain()


def test_replicate_override_turns_tp_off_for_a_layer(gpt):
    p = ap.plan(gpt, h100(), global_batch=8, fix={"tp": 2, "pp": 1}, overrides={"lm_head": {"tp": "replicate"}})
    assert p.tp_plan.get("lm_head", "replicate") == "replicate" and not p.loss_parallel
    assert p.tp_plan["h.0.mlp.c_fc"] == "colwise"


def test_tighter_memory_moves_towards_sharding_or_recompute():
    # activations matter here (small vocabulary, longer sequence); accumulation is pinned off, so the levers left
    # are ZeRO stage, TP x PP and recompute
    cfg = zoo.GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=512, block_size=512)
    gpt = capture(lambda: zoo.GPT(cfg), torch.randint(0, 512, (8, 512)))
    fix = {"micro_batches": 1}
    loose = ap.plan(gpt, h100(margin_fixed_bytes=0), global_batch=64, fix=fix)

    def level(p):
        rec = sum({"none": 0, "selective": 1, "full": 2}[lp.recompute] for lp in p.layers)
        return p.mesh.zero_stage, p.mesh.tp * p.mesh.pp, rec

    prev, steps = loose, 0
    while True:
        limit = 0.8 * prev.cost.peak_memory_bytes
        try:
            tight = ap.plan(gpt, h100(memory=limit, margin_fixed_bytes=0), global_batch=64, fix=fix)
        except PlanError as e:
            assert "over the memory limit" in str(e)
            break
        assert tight.cost.peak_memory_bytes <= limit < prev.cost.peak_memory_bytes
        a, b = level(prev), level(tight)
        assert any(y > x for x, y in zip(a, b, strict=True)), (prev.summary(), tight.summary())
        prev, steps = tight, steps + 1
    assert steps >= 3  # the search had room to move before nothing fitted


def test_more_gpus_never_raise_per_rank_params(gpt):
    prev = None
    for nodes in (1, 2, 4):
        p = ap.plan(gpt, h100(nodes), global_batch=32, fix={"tp": 1, "pp": 1, "zero_stage": 3})
        mb = p.cost.memory_by_rank[0]
        states = mb.params + mb.optimizer
        if prev is not None:
            assert states <= prev
        prev = states


def test_llama_7b_fits_on_8_h100():
    cfg = zoo.LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008)
    graph = capture(lambda: zoo.Llama(cfg), torch.randint(0, 32000, (1, 4096)))
    c = h100()
    p = ap.plan(graph, c, global_batch=8)
    assert p.cost.peak_memory_bytes <= c.device.memory_bytes
    assert 6.5e9 < graph.num_params < 7e9
    assert p.cost.tokens_per_s == pytest.approx(8 * 4096 / p.cost.step_time_s)
    assert 0.2 < p.cost.mfu < 0.75, p.explain()


def test_llama_7b_mfu_is_in_the_measured_range_on_8_h100():
    """02_llm.ipynb's LLaMA-2 7B, 64 x 4096 tokens on 8 H100s (SXM): the plan fits without recompute, and its MFU
    (6N + 12LHQT) is within 10 % of the 46.4 % llm-foundry measured for a 7B without recompute on 8 H100 80GB
    (scripts/train/benchmarking/README.md, "H100 80GB BF16", bench/mfu.py); pinned to full recompute, inside the
    33-43 % published runs of its class measure with recompute (llm-foundry's 7B at seq 4096: 40.4 %)."""
    cfg = zoo.LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008)
    graph = capture(lambda: zoo.Llama(cfg), torch.randint(0, 32000, (1, 4096)))
    eager = {"compile": False, "float8": "none"}  # as llm-foundry's runs: bf16, not compiled (compile pays here)
    p = ap.plan(graph, h100(), global_batch=64, fix=eager)
    assert {lp.recompute for lp in p.layers} == {"none"}
    assert 0.464 * 0.9 <= p.cost.mfu <= 0.464 * 1.1, p.explain()
    full = ap.plan(graph, h100(), global_batch=64, fix={"dp": 8, "zero_stage": 3, "recompute": "full", **eager})
    assert 0.33 <= full.cost.mfu <= 0.43, full.explain()


def test_seq_len_scales_tokens_and_memory(gpt):
    fix = {"dp": 8, "zero_stage": 3, "micro_batches": 1}
    base = ap.plan(gpt, h100(), global_batch=64, fix=fix)
    longer = ap.plan(gpt, h100(), global_batch=64, seq_len=512, fix=fix)
    assert longer.batch.seq_len == 512
    assert longer.cost.tokens_per_s == pytest.approx(64 * 512 / longer.cost.step_time_s)
    # the GPU's work grows with the sequence; at these few milliseconds both steps are the host's time issuing
    # the same ops (cost/cpu.py), which the sequence does not change
    assert longer.cost.compute_s > base.cost.compute_s
    assert longer.cost.step_time_s >= base.cost.step_time_s
    assert longer.cost.memory_by_rank[0].activations > 1.9 * base.cost.memory_by_rank[0].activations
    with pytest.raises(PlanError, match="not token sequences"):
        ap.plan(capture(zoo.SeedMLP, torch.randn(32, 1024)), h100(1, 2), seq_len=128)


def _brute_force(times, n_stages, glued=()):
    import itertools

    best = float("inf")
    for cuts in itertools.combinations([i for i in range(1, len(times)) if i not in glued], n_stages - 1):
        bounds = (0, *cuts, len(times))
        best = min(best, max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)))
    return best


def test_stage_partition_is_optimal():
    import random

    from autopar_nb.planner.stages import partition, partition_runs

    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(3, 11)
        k = rng.randint(2, min(5, n))
        # chains like real models: an embedding, identical blocks, a head
        block = rng.uniform(1, 3)
        times = [rng.uniform(0.1, 4)] + [block] * (n - 2) + [rng.uniform(0.1, 6)]
        want = _brute_force(times, k)

        def bottleneck(assign, times=times, k=k):
            assert sorted(set(assign)) == list(range(k)) and assign == sorted(assign)
            return max(sum(t for t, s in zip(times, assign, strict=True) if s == st) for st in range(k))

        assert bottleneck(partition(times, k, {})) == pytest.approx(want, rel=1e-3)
        runs = [(times[0], 1), (block, n - 2), (times[-1], 1)] if n > 2 else [(t, 1) for t in times]
        assert bottleneck(partition_runs(runs, k)) == pytest.approx(want, rel=1e-3)
        # pinning the last layer to the last stage: the dynamic programme honours it and stays optimal
        pinned = partition(times, k, {n - 1: k - 1})
        assert pinned[-1] == k - 1 and bottleneck(pinned) == pytest.approx(want, rel=1e-3)


def test_stage_partition_never_starts_a_stage_at_a_glued_layer():
    """A rotary table after the embedding (layer 1) and a few other layers no stage may start at: the partitions
    (per layer, in runs, with a pin) keep each with the layer before and stay optimal among the cuts left; more
    stages than units: None."""
    import random

    from autopar_nb.planner.stages import partition, partition_runs

    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(4, 11)
        glued = {1} | {i for i in range(2, n) if rng.random() < 0.2}
        units = n - len(glued)
        k = rng.randint(2, min(5, units))
        block = rng.uniform(1, 3)
        times = [rng.uniform(0.1, 4), 0.01] + [block] * (n - 3) + [rng.uniform(0.1, 6)]
        want = _brute_force(times, k, glued)

        def bottleneck(assign, times=times, k=k, glued=glued):
            assert sorted(set(assign)) == list(range(k)) and assign == sorted(assign)
            assert all(assign[i] == assign[i - 1] for i in glued), (assign, glued)
            return max(sum(t for t, s in zip(times, assign, strict=True) if s == st) for st in range(k))

        assert bottleneck(partition(times, k, {}, glued)) == pytest.approx(want, rel=1e-3)
        runs = [(times[0], 1), (times[1], 1), (block, n - 3), (times[-1], 1)]
        assert bottleneck(partition_runs(runs, k, glued)) == pytest.approx(want, rel=1e-3)
        pinned = partition(times, k, {n - 1: k - 1}, glued)
        assert pinned[-1] == k - 1 and bottleneck(pinned) == pytest.approx(want, rel=1e-3)
        assert partition(times, units + 1, {}, glued) is None and partition_runs(runs, units + 1, glued) is None
    assert partition([1.0] * 4, 2, {0: 0, 1: 1}, {1}) is None  # pins that would start a stage at a glued layer


def test_fixed_mesh_and_stage_pins_are_checked(gpt):
    with pytest.raises(PlanError, match=r"dp\(2\) \* tp\(2\) \* pp\(1\) = 4 != world_size\(8\)"):
        ap.plan(gpt, h100(), global_batch=8, fix={"dp": 2, "tp": 2, "pp": 1})
    with pytest.raises(PlanError, match="gives 2 stage"):
        ap.plan(gpt, h100(), global_batch=8, fix={"pp": 2}, overrides={"h.3": {"stage": 3}})
    with pytest.raises(PlanError, match="out of order"):
        ap.plan(gpt, h100(), global_batch=8, overrides={"h.1": {"stage": 2}, "h.3": {"stage": 1}})


def test_tp_reverts_where_a_shard_cannot_go():
    import torch.nn as nn

    # Linear -> LayerNorm: the norm needs the whole feature dim, so the first Linear stays replicated; the last
    # Linear is a 10-way classifier (fewer outputs than inputs): not worth a vocab-parallel head either
    graph = capture(lambda: nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 512), nn.ReLU(),
                                          nn.Linear(512, 10)), torch.randn(32, 64))
    p = ap.plan(graph, h100(1, 2), fix={"tp": 2})
    assert p.tp_plan.get("0", "replicate") == "replicate"
    assert p.tp_plan["2"] == "colwise" and p.tp_plan["4"] == "rowwise" and not p.loss_parallel
    resnet = capture(zoo.ResNet, torch.randn(8, 3, 32, 32))
    with pytest.raises(PlanError, match="no Linear/Embedding that TP can split"):
        ap.plan(resnet, h100(1, 2), fix={"tp": 2})


def test_pipeline_stages_move_for_memory():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))

    class BigTable(nn.Module):  # a large embedding (memory) that costs little time, then identical blocks
        def __init__(self, vocab=131072, d=1024, n=12):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(Block(d) for _ in range(n))
            self.head = nn.Linear(d, 8)

        def forward(self, x):
            x = self.emb(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    graph = capture(BigTable, torch.randint(0, 131072, (1, 2048)))
    fix = {"pp": 4, "dp": 1, "tp": 1, "zero_stage": 0, "micro_batches": 8, "schedule": "1f1b"}
    roomy = ap.plan(graph, h100(1, 4, memory=8e9, margin_fixed_bytes=0), global_batch=8, fix=fix)
    tight = ap.plan(graph, h100(1, 4, memory=3.0e9, margin_fixed_bytes=0), global_batch=8, fix=fix)
    first = lambda p: len(p.stage_layers()[0])
    # balanced by time, the table shares stage 0 with blocks; under 3 GB it gets the stage (nearly) to itself
    assert roomy.cost.peak_memory_bytes > 3.0e9 >= tight.cost.peak_memory_bytes
    assert first(tight) < first(roomy)


@pytest.mark.parametrize("overrides, match", [
    ({"h.0.ln_1": {"tp": "colwise"}}, "applies to nn.Linear, Hugging Face.s Conv1D or nn.Embedding"),
])
def test_overrides_the_runtime_cannot_run_are_refused(gpt, overrides, match):
    with pytest.raises(PlanError, match=match):
        ap.plan(gpt, h100(), global_batch=8, fix={"tp": 2}, overrides=overrides)


class PositionsInBlocks(torch.nn.Module):
    """Positions added inside each block, after its norm: the block's shard meets a whole-sequence table."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(64, 32), torch.nn.Embedding(16, 32)
        self.ln, self.fc, self.proj = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, idx):
        x = self.wte(idx)
        x = self.ln(x) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.head(x + self.proj(self.fc(x)))


def test_sequence_parallelism_is_refused_where_a_shard_would_run_wrong():
    """SP cuts the sequence at the first block; what the blocks then read must take a shard as it is. Refused: a
    whole-sequence table added inside a block."""
    fix = {"tp": 2, "sequence_parallel": True}
    with pytest.raises(PlanError, match="combines a sequence shard with the full-sequence tensor"):
        ap.plan(capture(PositionsInBlocks, torch.randint(0, 64, (4, 16))), h100(), global_batch=4, fix=fix)


def test_sequence_parallelism_ends_before_a_reshape_to_the_global_shape():
    """Hugging Face GPT-2's view(-1, T, C) after ln_f is a no-op on the global shape but moves tokens between rows
    on a shard (SP up to the head verifies with loss 0.03 against 4.85): SP covers the blocks, ln_f gathers the
    sequence at its input and runs whole, replicated, and the cost model prices that gather, ln_f and the head on
    whole activations, as the runtime runs them."""
    from autopar_nb.cost import Evaluator, setting_of
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.planner.styles import GATHER, tp_styles

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    graph = capture(lambda: transformers.GPT2LMHeadModel(cfg), torch.randint(0, 128, (4, 16)))
    cluster = h100()
    p = ap.plan(graph, cluster, global_batch=4, fix={"tp": 2, "sequence_parallel": True})
    assert [lp.path for lp in p.layers if lp.sequence_parallel] == ["transformer.wte", "transformer.h.0",
                                                                    "transformer.h.1"]
    assert p.tp_plan["transformer.h.1.ln_2"] == "sequence_parallel" and "transformer.ln_f" not in p.tp_plan
    assert re.search(r"ends after transformer\.h\.1 \(transformer\.ln_f gathers the whole sequence at its input "
                     r"and runs replicated\) because view_\d+ \(view in transformer\) reshapes a sequence shard",
                     p.explain()), p.explain()
    model = transformers.GPT2LMHeadModel(cfg)
    styles = tp_styles(model, p.tp_plan, sp_layers=[lp.path for lp in p.layers if lp.sequence_parallel],
                       layers=[lp.path for lp in p.layers], loss_parallel=p.loss_parallel)
    assert styles["transformer.ln_f"] == GATHER and styles["lm_head"].input_layout != 1
    ev = Evaluator(profile_of(graph, "cuda"), cluster)
    s, choices = setting_of(p)
    comm = {lay.path: ev.choice_terms(i, s, choices[i]).tp_comm for i, lay in enumerate(graph.layers)}
    # the gather: the hidden states all-gathered in forward, their gradient reduce-scattered in backward; the head
    # reads them whole, its input gradient all-reduced
    assert set(comm["transformer.ln_f"]) == {"all_gather", "reduce_scatter"}
    assert set(comm["lm_head"]) == {"all_reduce"} and set(comm["transformer.h.1"]) == {"all_gather", "reduce_scatter"}
    off = ap.plan(graph, cluster, global_batch=4, fix={"tp": 2, "sequence_parallel": False})
    s_off, ch_off = setting_of(off)
    assert not ev.choice_terms(5, s_off, ch_off[5]).tp_comm
    with pytest.raises(PlanError, match="sequence parallelism ends after transformer.h.1"):
        ap.plan(graph, cluster, global_batch=4, fix={"tp": 2},
                overrides={"transformer.ln_f": {"tp": "sequence_parallel"}})
    from autopar_nb.planner.explain import whole_notes
    from autopar_nb.widget.editor import structural_refusal

    # the widget says why: the layer table's note on ln_f, the sharding board's refused lane
    note = whole_notes(graph, p)["transformer.ln_f"]
    assert "whole sequence: sequence parallelism ends after transformer.h.1" in note
    assert "ends after transformer.h.1" in structural_refusal(graph, "transformer.ln_f", "sequence_parallel")


def test_fixes_the_runtime_cannot_run_are_refused_or_worked_around(llama):
    # dp x tp with ZeRO-1 runs (FSDP2 over the TP shards), under fp16's loss scaler too (ShardedGradScaler)
    p = ap.plan(llama, h100(1, 4), global_batch=8, fix={"dp": 2, "tp": 2, "zero_stage": 1})
    assert (p.mesh.dp, p.mesh.tp, p.mesh.zero_stage) == (2, 2, 1)
    p = ap.plan(llama, h100(1, 4), global_batch=8, fix={"dp": 2, "tp": 2, "zero_stage": 1, "amp": "fp16"})
    assert (p.mesh.zero_stage, p.precision.param_dtype) == (1, "float16")
    p = ap.plan(llama, h100(1, 4), global_batch=8, fix={"dp": 2, "tp": 2, "zero_stage": 0})  # Megatron's layout
    assert (p.mesh.dp, p.mesh.tp, p.mesh.zero_stage) == (2, 2, 0)
    # only pp fixed: tp and dp are chosen to fit (tp=4 leaves no room for pp=2 on 4 GPUs)
    p = ap.plan(llama, h100(1, 4), global_batch=8, fix={"pp": 2})
    assert p.mesh.pp == 2 and p.mesh.dp * p.mesh.tp == 2
    # the last pipeline stage's loss runs on the head's vocabulary shards, as without pipelining
    p = ap.plan(llama, h100(1, 4), global_batch=8, fix={"pp": 2, "tp": 2, "fused_loss": False})
    assert p.loss_parallel


def test_explain_says_whose_recompute_it_is(gpt):
    fixed = ap.plan(gpt, h100(), global_batch=8, fix={"recompute": "full", "tp": 1, "pp": 1})
    text = fixed.explain()
    assert "chosen to fit memory" not in text
    # the repeated blocks (not the embeddings or the head, where a wrapper saves nothing)
    assert "Recompute full is your choice (fix recompute='full'): h.0, h.1, h.2, h.3;" in text
    pinned = ap.plan(gpt, h100(), global_batch=8, overrides={"h.0": {"recompute": "selective"}})
    assert "chosen to fit memory" not in pinned.explain()
    assert "Recompute selective is your choice (override): h.0; recompute costs" in pinned.explain()


def test_recompute_fills_in_around_a_pinned_layer():
    # h.0 pinned to no recompute must not keep the planner from recomputing h.1-h.3 (the same block, one run)
    cfg = zoo.GPTConfig(n_layer=4, n_head=8, n_embd=512, vocab_size=512, block_size=512)
    gpt = capture(lambda: zoo.GPT(cfg), torch.randint(0, 512, (8, 512)))
    fix = {"tp": 1, "pp": 1, "micro_batches": 1, "zero_stage": 3}
    loose = ap.plan(gpt, h100(margin_fixed_bytes=0), global_batch=64, fix=fix)
    tight = h100(memory=0.9 * loose.cost.peak_memory_bytes, margin_fixed_bytes=0)
    p = ap.plan(gpt, tight, global_batch=64, fix=fix, overrides={"h.0": {"recompute": "none"}})
    assert p.layer("h.0").recompute == "none" and "recompute" in p.layer("h.0").pinned
    assert any(p.layer(f"h.{i}").recompute != "none" for i in (1, 2, 3)), p.summary()
    text = p.explain()
    # how many of them and which mode move with the cost model; that the pinned layer is not among them does not
    assert re.search(r"Recompute chosen to fit memory: (selective on \d, )?full on \d of the 7 layers you left to the "
                     r"planner", text), text
    assert "your choice" not in text  # h.0 is pinned to "none": nothing of the user's recomputes


@pytest.mark.parametrize("preset, amp", [("h100-80gb", "bf16"), ("a10", "bf16"), ("v100", "fp16"), ("t4", "fp16"),
                                         ("cpu", "none")])
def test_precision_only_where_the_device_has_it(seed, preset, amp):
    """bf16 needs compute capability 8.0: V100/T4 train in fp16 with loss scaling, and a fixed bf16 is refused."""
    cluster = ap.Cluster.preset(preset, 1, 2)
    assert ap.plan(seed, cluster).precision.amp == amp
    if amp == "fp16":
        with pytest.raises(PlanError, match="no bf16"):
            ap.plan(seed, cluster, fix={"amp": "bf16"})


def test_interleaving_tries_more_chunks_where_the_bubble_pays():
    """With the schedule fixed as interleaved 1F1B and the chunks per rank left open, the planner tries every
    v the layers allow (pp x v <= layers) and takes the fastest: at 4 ranks and 4 micro-batches the bubble
    (pp - 1) / v of the stage time dominates, so more chunks than the former fixed 2 pay."""
    cfg = zoo.GPTConfig(n_layer=16, n_head=8, n_embd=512, vocab_size=8192, block_size=256)
    graph = capture(lambda: zoo.GPT(cfg), torch.randint(0, 8192, (4, 256)))
    fix = {"pp": 4, "dp": 1, "tp": 1, "micro_batches": 4, "schedule": "interleaved_1f1b"}
    plan = ap.plan(graph, h100(gpus=4), global_batch=4, fix=fix)
    by_v = {v: ap.plan(graph, h100(gpus=4), global_batch=4, fix=fix | {"virtual_stages": v}).cost.step_time_s
            for v in (2, 3, 4)}
    assert plan.pipeline.virtual_stages == min(by_v, key=by_v.get) > 2, (plan.summary(), by_v)
    with pytest.raises(PlanError):  # 4 x 6 chunks > 16 layers: not a candidate, and refused when fixed
        ap.plan(graph, h100(gpus=4), global_batch=4, fix=fix | {"virtual_stages": 6})


def test_sequence_parallel_only_where_tp_divides_the_sequence():
    """Sequence parallelism gives each TP rank an equal part of every sequence: a length tp does not divide gets TP
    without it (said in the explanation), and a fixed sequence_parallel=True there is a PlanError naming both."""
    cfg = zoo.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    graph = capture(lambda: zoo.Llama(cfg), torch.randint(0, 64, (4, 33)))
    p = ap.plan(graph, h100(1, 2), fix={"tp": 2})
    assert p.mesh.tp == 2 and not any(lp.sequence_parallel for lp in p.layers)
    assert "Sequence parallel off because seq_len 33 does not divide by tp=2" in p.explain()
    assert all(lp.sequence_parallel for lp in ap.plan(graph, h100(1, 2), seq_len=34, fix={"tp": 2}).layers)
    with pytest.raises(PlanError, match=r"sequence_parallel=True, but .*seq_len 33 does not divide by tp=2"):
        ap.plan(graph, h100(1, 2), fix={"tp": 2, "sequence_parallel": True})
    with pytest.raises(PlanError, match=r"seq_len 35 does not divide by tp=2"):  # seq_len= given to plan
        ap.plan(graph, h100(1, 2), seq_len=35, fix={"tp": 2, "sp": True})



def test_plan_pauses_the_cycle_collector(gpt, monkeypatch):
    """plan()'s search runs with Python's cyclic garbage collector paused (each pass of its oldest generation walks
    every object a large graph holds: a fifth of the 1T shape's plan), and plan() leaves it as it found it."""
    import gc

    from autopar_nb.planner import search

    seen = []
    run = search.Search.run

    def watched(self, *a, **kw):
        seen.append(gc.isenabled())
        return run(self, *a, **kw)

    monkeypatch.setattr(search.Search, "run", watched)
    ap.plan(gpt, h100(2, 8), global_batch=64)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        ap.plan(gpt, h100(2, 8), global_batch=64)
        assert not gc.isenabled()
    finally:
        gc.enable()
