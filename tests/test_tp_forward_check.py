"""The planner runs every TP layout it offers once on stand-in tensors (``planner/forward.py``): a layout whose
forward fails on the local shards is not offered, and the explanation says why in one line naming the user's line.

The failing cells are nanoGPT's attention reading the global width (``split(C, dim=2)``, ``view(B, T, self.n_head,
C // self.n_head)``); an attention with a per-head table (an ``nn.Parameter`` bias, ALiBi slopes) runs split, its
table split with the heads.
The zoo families keep their layouts, and each layout runs once per capture.
"""

from __future__ import annotations

import pytest
import torch
from runtime_cases import (
    GPT_CELL,
    HF_BLOOM_CELL,
    HF_DEEPSEEK_V3_CELL,
    HF_FALCON_CELL,
    HF_GEMMA2_CELL,
    HF_GEMMA_CELL,
    HF_MPT_CELL,
    LLAMA_CELL,
    has_transformers,
    source,
)

import autopar_nb as ap
from autopar_nb.planner import forward
from autopar_nb.verify import verify_many

CPU2 = ap.Cluster.preset("cpu", gpus_per_node=2)

HEAD = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))
'''
TAIL = '''

class Block(nn.Module):
    def __init__(self, d, h, T):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), ATTENTION(d, h, T)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Net(nn.Module):
    def __init__(self, vocab=64, d=32, h=4, layers=2, T=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d, h, T) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


model = Net()
example_inputs = (torch.randint(0, 64, (4, 16)),)
'''
NANOGPT = HEAD + '''

class CausalSelfAttention(nn.Module):  # nanoGPT's model.py
    def __init__(self, n_embd, n_head, T):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(SPLIT, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
''' + TAIL.replace("ATTENTION", "CausalSelfAttention")
SPLIT_C = NANOGPT.replace("SPLIT", "C")
"""the global width read from the input: the split cuts 2 pieces from a rank's 3 * C / 2 features"""
SPLIT_N_EMBD = NANOGPT.replace("SPLIT", "self.n_embd")
"""nanoGPT's own line: ``self.n_embd`` is set per rank, but ``C // self.n_head`` still reads the global width"""
BIAS_TABLE = HEAD + '''

class Attention(nn.Module):  # the scores plus a learned per-head bias table
    def __init__(self, d, h, T):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.head_dim = d // h
        self.rel_bias = nn.Parameter(torch.zeros(h, T, T))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.rel_bias[:, :T, :T])
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))
''' + TAIL.replace("ATTENTION", "Attention")
TABLE_LAST = HEAD + '''
import math


class Attention(nn.Module):  # eager attention: a learned bias (T, T, heads) and ALiBi slopes (heads,)
    def __init__(self, d, h, T):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.n_head = h
        self.pos_bias = nn.Parameter(torch.randn(T, T, h) * 0.1)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, h + 1), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        pos = torch.arange(T, device=x.device)
        bias = self.pos_bias[:T, :T].permute(2, 0, 1) - self.slopes[:, None, None] * (pos[None, :] - pos[:, None]).abs()
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + bias
        y = scores.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))
''' + TAIL.replace("ATTENTION", "Attention")
TABLES = {"heads_first": (BIAS_TABLE, {"rel_bias": 0}), "heads_last": (TABLE_LAST, {"pos_bias": 2, "slopes": 0})}
"""per-head tables: (heads, T, T) given to SDPA as its mask; (T, T, heads) and ALiBi slopes (heads,) added to the
scores of an eager attention"""


def line_of(cell: str, text: str) -> int:
    return next(i for i, line in enumerate(cell.splitlines(), 1) if text in line)


def planned(cell: str, **kwargs):
    model, inputs, _ = source(cell).build(device="meta")
    graph = ap.capture(model, inputs)
    return graph, ap.plan(graph, CPU2, fix={"tp": 2}, **kwargs)


def refusal(plan) -> str:
    return next(line for line in plan.explanation if line.startswith("Kept replicated under TP"))


CASES = {
    "split_global_width": (SPLIT_C, "split(C, dim=2)",
                           "c_attn's output is split with the global width 32 in the cell line {n} "
                           "(`q, k, v = self.c_attn(x).split(C, dim=2)`), but a rank holds 1/2 of it; use chunk(3) "
                           "or view(..., -1, head_dim)"),
    "view_global_width": (SPLIT_N_EMBD, "k = k.view(", "h.0.attn reshapes a split tensor with global sizes in the "
                          "cell line {n} (`k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)`)"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_layout_whose_forward_fails_is_not_offered(name):
    cell, at, why = CASES[name]
    graph, plan = planned(cell)
    assert plan.mesh.tp == 2
    assert not [m for m in plan.tp_plan if ".attn" in m], plan.tp_plan  # the attention stays whole ...
    assert {"h.0.mlp.c_fc", "h.0.mlp.c_proj", "h.1.mlp.c_fc", "h.1.mlp.c_proj"} <= set(plan.tp_plan)  # the MLP not
    expected = why.format(n=line_of(cell, at))
    assert set(graph.tp_refused) == {"h.0.attn", "h.1.attn"}  # every block, from one run of the first
    assert graph.tp_refused["h.1.attn"].startswith(expected.split(" in the cell")[0].split(" in ")[0])
    line = refusal(plan)
    assert expected in line and "\n" not in line, line
    # an override asking for it is refused with the same reason
    with pytest.raises(ap.PlanError, match="cannot be split") as e:
        ap.plan(graph, CPU2, fix={"tp": 2}, overrides={"h.*.attn": {"tp": "colwise-rowwise"}})
    assert expected in str(e.value)


@pytest.mark.parametrize("name", TABLES)
def test_a_head_indexed_table_is_split_with_its_heads(name):
    """A per-head table (an nn.Parameter or buffer with a heads dim, first or last) no longer keeps the attention
    whole: the layout with it split on that dim runs on the stand-in, and the script shards it so."""
    from autopar_nb.export import render_script
    from autopar_nb.export.values import script_values

    cell, dims = TABLES[name]
    graph, plan = planned(cell)
    assert graph.tp_refused == {}
    assert {st for m, st in plan.tp_plan.items() if m.startswith("h.1.attn.")} == {"colwise", "rowwise"}, plan.tp_plan
    assert not any(line.startswith("Kept replicated") for line in plan.explanation)
    assert script_values(source(cell), plan).head_tables == {"h.*.attn": dims}
    script = render_script(source(cell), plan)
    assert f"tables = {{'h.*.attn': {dims!r}}}" in script.replace('"', "'")
    assert 'shard_head_tables(part, mesh["tp"], tables)' in script
    # the cost model charges a rank its own heads' share of the tables, as of the split projections: only the norms,
    # the rowwise projections' biases and the bias of a projection split part by part (the fused qkv's) are whole on
    # every rank (the tables were counted whole: 1024 more each)
    assert set(graph.tp_tables) == {f"h.{i}.attn.{name}" for i in (0, 1) for name in dims}
    params = {n: p for n, p in graph.params.items() if not p.is_buffer}
    whole = sum(p.numel for n, p in params.items() if ".ln_" in n or n == "ln_f.weight" or n == "ln_f.bias"
                or (n.endswith(".bias") and plan.tp_plan.get(n.rpartition(".")[0]) == "rowwise")
                or n.endswith(".attn.qkv.bias"))
    total = sum(p.numel for p in params.values())
    assert plan.mesh.dp == 1 and plan.cost.memory_by_rank[0].params == 4 * ((total - whole) / 2 + whole)


def test_head_tables_are_costed_split_when_a_process_group_is_already_set_up():
    """In a process that already holds a process group (a user's, here a fake one) the layout runs in a forked copy
    of the process, and the script shards the head tables (export finds them itself): the cost model must count them
    split as well. They were costed whole there (2 x 1024 floats more on each rank)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cell, _ = TABLES["heads_first"]
    alone = planned(cell)[1].cost.memory_by_rank[0].params
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        graph, plan = planned(cell)
    finally:
        dist.destroy_process_group()
    assert set(graph.tp_tables) == {"h.0.attn.rel_bias", "h.1.attn.rel_bias"}
    assert plan.cost.memory_by_rank[0].params == alone


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_falcons_repeated_multi_query_projection_says_its_query_rows_stay_whole():
    """Falcon's fused query_key_value [4, 1, 1] at tp=2 is repeated: explain() says every rank holds all of it, the
    query rows too, why they are not split, and the parameter bytes that costs each rank."""
    _, plan = planned(HF_FALCON_CELL)
    assert plan.tp_parts["transformer.h.1.self_attention.query_key_value"] == [4, 1, 1], plan.tp_parts
    line = next(x for x in plan.explanation if x.startswith("Fused multi-query projections"))
    assert "transformer.h.*.self_attention.query_key_value [4, 1, 1]" in line, line
    assert "query rows (4 of 6 heads) stay whole too: one DTensor is split or whole, not both" in line, line
    # what that costs: 32 x 32 fp32 query weights per layer (no bias), half of them beyond a split, 2 layers
    assert "4.00 KiB more parameters on each rank than split query rows" in line, line


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_gptbigcodes_multi_query_c_attn_is_gathered_and_says_why():
    """GPTBigCode (StarCoder) cuts its fused multi-query c_attn by features before the query's view into heads
    (``c_attn(x).unsqueeze(1).split((self.embed_dim, self.kv_dim, self.kv_dim), dim=3)``): parts of different widths
    [32, 8, 8], split as one block and all-gathered, the attention whole on every rank, and explain() says why. (Read
    as heads [4, 1, 1] and repeated as Falcon's, the planner's own cost model put StarCoder-15B at tp=8 on 8 H100s
    at 232 ms/step and 66.7 GiB against 208 ms and 39.8 GiB gathered (T=2048): the query rows whole on every rank
    and the projection's FLOPs undivided outweigh the attention's.)"""
    from families import FAMILIES

    graph, plan = planned(FAMILIES["GPTBigCode"])
    assert graph.tp_refused == {}
    assert plan.tp_parts["transformer.h.1.attn.c_attn"] == [32, 8, 8], plan.tp_parts
    assert {plan.tp_plan[f"transformer.h.1.attn.{m}"] for m in ("c_attn", "c_proj")} == {"colwise", "rowwise"}
    line = next(x for x in plan.explanation if x.startswith("Fused projections gathered"))
    assert "transformer.h.*.attn.c_attn [32, 8, 8]" in line and "which no DTensor placement holds" in line, line


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_gemmas_scaled_embedding_and_its_tied_head_are_split():
    """Gemma's embedding is an nn.Embedding subclass whose own forward scales the lookup by sqrt(hidden), tied to the
    output head: both are split on the vocabulary (the embedding rowwise, the head colwise into loss_parallel), as
    LLaMA's are, instead of staying whole."""
    graph, plan = planned(HF_GEMMA_CELL)
    assert graph.tp_refused == {}
    assert plan.tp_plan["model.embed_tokens"] == "rowwise" and plan.tp_plan["lm_head"] == "colwise", plan.tp_plan
    assert plan.loss_parallel


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_gemma2s_soft_capped_logits_keep_the_head_vocabulary_parallel():
    """Gemma 2 soft-caps its logits (divide, tanh, multiply) between the head and the output: elementwise ops of the
    logits alone, which run on vocabulary shards as on the whole, so the head is still colwise into loss_parallel
    and the tied embedding rowwise (both were kept whole, with no reason given)."""
    graph, plan = planned(HF_GEMMA2_CELL)
    assert plan.tp_plan["model.embed_tokens"] == "rowwise" and plan.tp_plan["lm_head"] == "colwise", plan.tp_plan
    assert plan.loss_parallel
    # its float attention mask (batch, 1, T, T), with a batch as large as the heads, is not taken for a head table
    assert plan.tp_plan["model.layers.1.self_attn.q_proj"] == "colwise" and graph.tp_refused == {}
    assert any(lp.sequence_parallel for lp in plan.layers)


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_blooms_attention_is_split_with_its_alibi_cut_to_the_ranks_heads():
    """Bloom adds the ALiBi bias of every head, (batch x heads, 1, T), made by the model and passed by keyword, to its
    scores inside baddbmm: the attention is split (it was kept whole), the bias cut to the rank's heads on the way in
    (named (0, heads): the heads flattened with the batch), num_heads set per rank. Sequence parallelism starts at the
    first block: the norm of the embeddings alone before it runs on whole activations, and the script builds."""
    from autopar_nb.export import render_script
    from autopar_nb.export.values import script_values

    graph, plan = planned(HF_BLOOM_CELL)
    assert graph.tp_refused == {} and not [line for line in plan.explanation if line.startswith("Kept")]
    attn = "transformer.h.1.self_attention."
    assert plan.tp_plan[attn + "query_key_value"] == "colwise" and plan.tp_plan[attn + "dense"] == "rowwise"
    values = script_values(source(HF_BLOOM_CELL), plan)
    assert values.head_tables == {"transformer.h.*.self_attention": {"alibi": (0, 4)}}
    assert values.local_sizes == {"transformer.h.*.self_attention": {"num_heads": 2}}
    assert any(lp.sequence_parallel for lp in plan.layers)
    assert "transformer.word_embeddings_layernorm" not in plan.tp_plan, plan.tp_plan
    script = render_script(source(HF_BLOOM_CELL), plan)
    assert 'tables = {"transformer.h.*.self_attention": {"alibi": (0, 4)}}' in script


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_blooms_alibi_captured_at_batch_1_is_cut_as_one_that_grows_with_the_batch():
    """Captured at batch 1, Bloom's ALiBi is (heads, 1, T), as MPT's is: named (0, heads), not 0, so that a script
    trained at a larger batch cuts (batch x heads, 1, T) to the rank's heads of every row, not to whole rows."""
    from autopar_nb.export.values import script_values

    cell = HF_BLOOM_CELL.replace("(4, 16)", "(1, 16)")
    _, plan = planned(cell)
    assert script_values(source(cell), plan).head_tables == {"transformer.h.*.self_attention": {"alibi": (0, 4)}}


def test_a_bias_added_in_a_batched_product_goes_with_the_heads_only_when_the_runtime_can_cut_it():
    """baddbmm(bias, q, k) with q and k split by heads (flattened with the batch in dim 0): a bias made outside the
    attention with dim 0 whole is cut on the way in, one broadcast over dim 0 needs no cut; one made inside the module,
    or whose dim 0 is the batch alone, is refused with the reason."""
    from types import SimpleNamespace as Node

    from autopar_nb.cost.tp_refusals import bias_with_heads, whole_bias

    def product(bias_shape, made_in):
        bias = Node(name="bias", module_path=made_in, out_shapes=[bias_shape])
        return Node(name="scores", op="aten.baddbmm.default", module_path="h.0.attn", inputs=["bias", "q", "k"],
                    out_shapes=[(16, 16, 16)]), {"bias": bias}

    sharded = {"q": 0, "k": 0}
    for shape, made_in, fits in (((16, 1, 16), "", True), ((16, 1, 16), "model", True), ((1, 16, 16), "h.0.attn", True),
                                 ((16, 16), "h.0.attn", True),
                                 ((16, 1, 16), "h.0.attn", False), ((16, 1, 16), "h.0.attn.alibi", False),
                                 ((4, 1, 16), "model", False)):
        n, by_name = product(shape, made_in)
        assert bias_with_heads(n, sharded, by_name) is fits, (shape, made_in)
        why = whole_bias(n, sharded, by_name)
        assert (why == "") is fits, why
        assert fits or why.startswith(f"h.0.attn adds a tensor of every head (shape {'x'.join(map(str, shape))}) to "
                                      "its split scores in baddbmm that TP cannot cut to a rank's heads"), why


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_deepseek_v3s_mla_attention_is_split_with_its_shared_rope_key():
    """MLA writes one rope key, the last qk_rope_head_dim outputs of the replicated kv_a_proj_with_mqa, into every
    head's key (expand, then copy_ into a slice of new_empty). The attention is split (q_b_proj and kv_b_proj colwise,
    o_proj rowwise; it was kept whole), kv_a_proj_with_mqa stays whole as "shared" with its features [16, 8] (the
    rope key's gradient summed over the ranks), costed, explained, and the script runs SharedSliceParallel."""
    from autopar_nb.cost.profile import profile_of
    from autopar_nb.export import render_script

    graph, plan = planned(HF_DEEPSEEK_V3_CELL)
    assert graph.tp_refused == {}
    attn = "model.layers.1.self_attn."
    assert {m: s for m, s in plan.tp_plan.items() if m.startswith(attn)} == {
        attn + "q_b_proj": "colwise", attn + "kv_a_proj_with_mqa": "shared", attn + "kv_b_proj": "colwise",
        attn + "o_proj": "rowwise"}, plan.tp_plan
    assert plan.tp_parts[attn + "kv_a_proj_with_mqa"] == [16, 8]
    # the all-reduce of the rope key's gradient in backward: (4, 16, 8) fp32
    comms = [c for c in profile_of(graph, "cpu").layers[2].comms if c.phase == "bwd" and c.kind == "all_reduce"]
    assert any(c.nbytes == 4 * 16 * 8 * 4 for c in comms), comms
    assert any("model.layers.*.self_attn.kv_a_proj_with_mqa [16, 8]" in line and "all-reduced" in line
               for line in plan.explanation), plan.explanation
    script = render_script(source(HF_DEEPSEEK_V3_CELL), plan)
    assert '"model.layers.1.self_attn.kv_a_proj_with_mqa": SharedSliceParallel(start=16, stop=24)' in script
    assert "tables = " not in script  # the hidden states (batch 4, as many as the heads) are not a head table
    with pytest.raises(ap.PlanError, match="comes with the attention it feeds"):
        ap.plan(graph, CPU2, fix={"tp": 2}, overrides={"model.layers.*.self_attn.q_a_proj": {"tp": "shared"}})
    kept = ap.plan(graph, CPU2, fix={"tp": 2}, overrides={"model.layers.*.self_attn": {"tp": "colwise-rowwise"}})
    assert kept.tp_plan[attn + "kv_a_proj_with_mqa"] == "shared", kept.tp_plan
    from autopar_nb.widget.editor import layout_note

    note = layout_note(graph.layers[2], plan.layers[2], 2)
    assert "kv_a_proj_with_mqa whole, its shared piece's gradient summed" in note and "gathered" not in note, note


SHARED_TWICE = HEAD + '''

class Attention(nn.Module):  # a key part of every head made by two projections: no one piece to sum
    def __init__(self, d, h, T):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(d, 2 * d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.rope_a, self.rope_b = nn.Linear(d, d // h), nn.Linear(d, d // h)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, w).transpose(1, 2) for t, w in ((self.q(x), 16), (self.k(x), 8), (self.v(x), 8)))
        shared = F.layer_norm(self.rope_a(x) + self.rope_b(x), (8,)).view(B, 1, T, 8).expand(-1, k.shape[1], -1, -1)
        key = k.new_empty(*k.shape[:-1], 16)
        key[..., :8].copy_(k)
        key[..., 8:].copy_(shared)
        y = F.scaled_dot_product_attention(q, key, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))
''' + TAIL.replace("ATTENTION", "Attention")


def test_a_key_part_shared_by_the_heads_but_no_one_piece_keeps_the_attention_whole_with_the_reason():
    """A tensor written into every head's key that is not one piece of one projection's output (here the sum of two)
    has no style to sum its gradient over the ranks: the attention stays whole, and explain(), an override and the
    widget say why in one line."""
    graph, plan = planned(SHARED_TWICE)
    assert not [m for m in plan.tp_plan if ".attn." in m], plan.tp_plan
    assert "h.0.mlp.c_fc" in plan.tp_plan  # the MLP is split
    line = refusal(plan)
    assert "h.0.attn.k" in line and "\n" not in line, line
    assert ("h.0.attn writes one tensor that all heads share into every head (4x1x16x8 from h.0.attn.rope_a, "
            "broadcast over the heads by expand into copy_: e.g. MLA's rope key); split by heads, a rank would sum its "
            "gradient over its own heads only, and it is not one piece of one projection's output") in line, line
    with pytest.raises(ap.PlanError, match="cannot be split.*MLA's rope key"):
        ap.plan(graph, CPU2, fix={"tp": 2}, overrides={"h.*.attn": {"tp": "colwise-rowwise"}})
    from autopar_nb.widget.editor import structural_refusal

    assert "MLA's rope key" in structural_refusal(graph, "h.1.attn", "colwise-rowwise")


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_mpts_alibi_input_is_split_with_the_heads():
    """MPT hands each attention the ALiBi bias of every head, (heads, 1, T), made once by the model, as the keyword
    position_bias: it is cut to the rank's heads on the way in, so the attention is split (it was kept whole: the
    bias met one rank's scores), with sequence parallelism on, and the script does the same."""
    from autopar_nb.export import render_script
    from autopar_nb.export.values import script_values

    graph, plan = planned(HF_MPT_CELL)
    assert graph.tp_refused == {}
    assert plan.tp_plan["transformer.blocks.1.attn.Wqkv"] == "colwise", plan.tp_plan
    assert plan.tp_plan["transformer.blocks.1.attn.out_proj"] == "rowwise"
    assert any(lp.sequence_parallel for lp in plan.layers)
    assert script_values(source(HF_MPT_CELL), plan).head_tables == {"transformer.blocks.*.attn": {"position_bias": 0}}
    assert 'shard_head_tables(part, mesh["tp"], tables)' in render_script(source(HF_MPT_CELL), plan)


def test_the_zoo_families_keep_their_layouts_and_each_layout_runs_once(monkeypatch):
    runs = []
    runner = forward.run_layout
    monkeypatch.setattr(forward, "run_layout", lambda stand, layout: runs.append(layout) or runner(stand, layout))
    for cell, attention in ((GPT_CELL, {"attn.c_attn", "attn.c_proj"}),
                            (LLAMA_CELL, {"attention.wq", "attention.wk", "attention.wv", "attention.wo"})):
        graph, plan = planned(cell)
        assert graph.tp_refused == {}
        split = {m.split(".", 2)[2] for m in plan.tp_plan if m.startswith(("h.0.", "layers.0."))}
        assert attention <= split, plan.tp_plan
        assert not any(line.startswith("Kept replicated") for line in plan.explanation)
        before = len(runs)
        ap.plan(graph, CPU2, fix={"tp": 2})
        ap.plan(graph, CPU2, fix={"tp": 2}, overrides={"*": {"recompute": "full"}})
        assert len(runs) == before, "a layout already run is not run again"
    assert len(runs) == 2


def test_a_model_built_with_real_weights_is_checked_on_a_meta_copy():
    model, inputs, _ = source(SPLIT_C).build()
    graph = ap.capture(model, inputs)
    plan = ap.plan(graph, CPU2, fix={"tp": 2})
    assert "c_attn's output is split with the global width 32" in refusal(plan)
    assert all(p.device.type == "cpu" and type(p) is torch.nn.Parameter for p in model.parameters())
    assert not torch.distributed.is_initialized()


HF_CELLS = {"gemma": HF_GEMMA_CELL, "gemma2": HF_GEMMA2_CELL, "mpt": HF_MPT_CELL, "bloom": HF_BLOOM_CELL}
"""Hugging Face cells trained on 2 ranks (where transformers is installed): Gemma and Gemma 2 (embedding and tied
head split on the vocabulary), MPT and Bloom (attention split with its ALiBi input: (heads, 1, T), and
(batch x heads, 1, T))"""


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """name -> (plan, report): the planner's tp=2 plans of SPLIT_C, the TABLES cells and HF_CELLS, verified on 2 gloo
    processes in one launch, 3 steps each."""
    cells = {"split_c": SPLIT_C} | {name: cell for name, (cell, _) in TABLES.items()}
    cells |= HF_CELLS if has_transformers() else {}
    cases = {name: (source(cell), planned(cell)[1]) for name, cell in cells.items()}
    reports = verify_many(list(cases.values()), steps=3)
    return {name: (plan, report) for (name, (_, plan)), report in zip(cases.items(), reports, strict=True)}


@pytest.mark.multiprocess
def test_the_offered_layout_runs_on_two_ranks(two_ranks):
    """The plan the planner offers for nanoGPT's global-width split (MLP split, attention whole) trains on 2 gloo
    processes as the single-process run does."""
    _, report = two_ranks["split_c"]
    assert report.ok, str(report)
    assert report.per_rank[0]["dtensor_params"] > 0


@pytest.mark.multiprocess
@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_deepseek_v3s_split_mla_trains_on_two_ranks_as_on_one():
    """DeepSeek-V3 with MLA split over 2 gloo processes: loss, gradients and parameters match the single-process run
    at rtol 1e-5. Without the shared style on kv_a_proj_with_mqa (the rope key's gradient left to each rank's heads)
    the same plan fails, so it is that style that makes the split right."""
    import copy

    from autopar_nb.verify import verify_many

    _, plan = planned(HF_DEEPSEEK_V3_CELL)
    unsummed = copy.deepcopy(plan)
    for lp in unsummed.layers:
        for m in [m for m, style in lp.tp.items() if style == "shared"]:
            del lp.tp[m], lp.tp_parts[m]
    cell = source(HF_DEEPSEEK_V3_CELL)
    shared, plain = verify_many([(cell, plan), (cell, unsummed)], steps=2, rtol=1e-5)
    assert shared.ok, str(shared)
    assert not plain.ok and plain.steps[0].grad_rel > 1e-4, str(plain)


@pytest.mark.multiprocess
@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
def test_deepseek_v3s_split_mla_trains_on_dp2_x_tp2_as_on_one():
    """The MLA split beside data parallelism, DDP and FSDP ZeRO-3, on 4 gloo processes (one launch): loss, gradients
    and parameters match the single-process run at rtol 1e-5."""
    from autopar_nb.verify import verify_many

    model, inputs, _ = source(HF_DEEPSEEK_V3_CELL).build(device="meta")
    graph = ap.capture(model, inputs)
    cpu4 = ap.Cluster.preset("cpu", gpus_per_node=4)
    plans = [ap.plan(graph, cpu4, fix={"tp": 2, "dp": 2, "zero_stage": zero}) for zero in (0, 3)]
    for plan in plans:
        assert plan.tp_plan["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "shared", plan.tp_plan
    for report in verify_many([(source(HF_DEEPSEEK_V3_CELL), plan) for plan in plans], steps=2, rtol=1e-5):
        assert report.ok, str(report)


@pytest.mark.multiprocess
def test_split_tables_and_gemmas_embedding_train_on_two_ranks_as_on_one(two_ranks):
    """Both per-head table cells, attention split with their tables, Gemma and Gemma 2, embedding and tied head split
    on the vocabulary, and MPT and Bloom, attention split with its ALiBi input, train on 2 gloo processes (one launch)
    as the single-process reference does."""
    for name in TABLES:
        plan = two_ranks[name][0]
        assert {"h.0.attn", "h.1.attn"} <= {m.rpartition(".")[0] for m in plan.tp_plan}, plan.tp_plan
    if has_transformers():
        gemma, gemma2, mpt, bloom = (two_ranks[name][0] for name in HF_CELLS)
        assert {"model.embed_tokens", "lm_head"} <= set(gemma.tp_plan), gemma.tp_plan
        assert {"model.embed_tokens", "lm_head"} <= set(gemma2.tp_plan) and gemma2.loss_parallel, gemma2.tp_plan
        assert "transformer.blocks.0.attn.Wqkv" in mpt.tp_plan, mpt.tp_plan
        assert "transformer.h.0.self_attention.query_key_value" in bloom.tp_plan, bloom.tp_plan
    for name in [*TABLES, *(HF_CELLS if has_transformers() else ())]:
        assert two_ranks[name][1].ok, str(two_ranks[name][1])


def test_a_layout_whose_forward_fails_is_not_offered_beside_a_users_gloo_group():
    """Planning in a process that already holds a real process group (a notebook that called init_process_group, a
    worker) runs the layout too, on a fake group of its own in a forked copy of the process: nanoGPT's split(C, dim=2)
    is refused with its reason as it is alone (it was offered unchecked), and the user's group is left as it was."""
    import torch.distributed as dist

    cell, at, why = CASES["split_global_width"]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        graph, plan = planned(cell)
        world = dist.group.WORLD
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1  # the user's group, untouched
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert world is not None
    assert not [m for m in plan.tp_plan if ".attn" in m], plan.tp_plan
    assert "h.0.mlp.c_fc" in plan.tp_plan
    assert set(graph.tp_refused) == {"h.0.attn", "h.1.attn"}
    assert why.format(n=line_of(cell, at)) in refusal(plan)


def test_a_stuck_forked_trial_is_given_up_without_hanging_the_planner(monkeypatch):
    """The forked copy that runs a layout beside a user's process group may stick (a lock another thread held at
    the fork): the planner waits a bounded time, kills the copy and goes on with the layout unchecked (before: it
    waited for the copy forever)."""
    import time

    import torch.distributed as dist

    def stuck(*_args):
        time.sleep(600)

    from autopar_nb.planner import forward_run

    monkeypatch.setattr(forward_run, "_trial", stuck)
    monkeypatch.setattr(forward_run, "FORKED_TRIAL_TIMEOUT_S", 2.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t0 = time.monotonic()
        graph, plan = planned(CASES["split_global_width"][0])
        took = time.monotonic() - t0
    finally:
        dist.destroy_process_group()
    assert graph.tp_refused == {} and plan.mesh.tp == 2  # unchecked, as when no copy can run
    assert took < 60, took


@pytest.mark.parametrize("cell", [HF_MPT_CELL, HF_BLOOM_CELL], ids=["MPT", "Bloom"])
def test_tp_beside_pipelining_is_not_offered_where_the_stages_trace_would_fix_a_head_count(cell):
    """MPT and Bloom split their attention with the ALiBi bias cut to a rank's heads and set the heads per rank
    (``set_local_sizes``), which a pipeline stage's trace cannot take: the planner neither offers TP beside
    pipelining for them (export refused the plan it had offered) nor takes tp x pp when fixed, and says why; TP
    alone and pipelining alone stay offered."""
    from autopar_nb.plan import PlanError

    model, inputs, _ = source(cell).build(device="meta")
    graph = ap.capture(model, inputs)
    cluster = ap.Cluster.preset("cpu", gpus_per_node=4)
    with pytest.raises(PlanError, match="tensor parallelism inside pipeline stages: .* reads"):
        ap.plan(graph, cluster, fix={"tp": 2, "pp": 2})
    for fix in ({"tp": 2, "pp": 1}, {"tp": 1, "pp": 2}):
        assert ap.plan(graph, cluster, fix=fix) is not None
    free = ap.plan(graph, cluster)
    meshes = [free.mesh] + [alt.mesh for alt in free.alternatives]
    assert not any(m.tp > 1 and m.pp > 1 for m in meshes)
