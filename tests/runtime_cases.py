"""Model cells and hand-built plans shared by the runtime, verify and export tests (the planner is not used)."""

from __future__ import annotations

import torch

from autopar_nb.capture import capture
from autopar_nb.plan import BatchPlan, LayerPlan, MeshPlan, OptimizerPlan, PipelinePlan, Plan, PrecisionPlan
from autopar_nb.source import ModelSource

GPT_CELL = """\
import torch
from autopar_nb.zoo import GPT, GPTConfig

model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
example_inputs = (torch.randint(0, 64, (4, 16)),)
"""

LLAMA_CELL = """\
import torch
from autopar_nb.zoo import Llama, LlamaConfig

model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
example_inputs = (torch.randint(0, 64, (4, 16)),)
"""

RECSYS_CELL = """\
import torch
import torch.nn.functional as F
from autopar_nb.zoo import RecSys

model = RecSys(table_sizes=(400, 200, 64), dim=16, dense_in=8)
example_inputs = (torch.randn(8, 8), torch.randint(0, 64, (8, 3)))


def make_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    dense = torch.randn(8, 8, generator=g)
    sparse = torch.stack([torch.randint(0, n, (8,), generator=g) for n in (400, 200, 64)], dim=1)
    return dense, sparse, torch.rand(8, 1, generator=g)


def loss_fn(model, batch):
    dense, sparse, label = batch
    return F.binary_cross_entropy_with_logits(model(dense, sparse), label)
"""

RESNET_CELL = """\
import torch
from autopar_nb.zoo import ResNet

model = ResNet(widths=(8, 8, 16), blocks_per_stage=1, num_classes=10)
example_inputs = (torch.randn(4, 3, 16, 16),)
"""

HF_LLAMA_CELL = """\
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
model = LlamaForCausalLM(config)
example_inputs = (torch.randint(0, 128, (4, 16)),)


def loss_fn(model, batch):
    (tokens,) = batch
    logits = model(tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
"""

HF_GPT2_CELL = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel

model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                   eos_token_id=0))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""

HF_BERT_CELL = """\
import torch
from transformers import BertConfig, BertForMaskedLM

model = BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""


def hf_llama_tp(n_layers: int = 2) -> dict[str, str]:
    """Hugging Face Llama: attention and MLP projections split Megatron-style, vocab-parallel embedding and head."""
    out = {"model.embed_tokens": "rowwise", "lm_head": "colwise"}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.self_attn.q_proj": "colwise", f"{p}.self_attn.k_proj": "colwise",
                f"{p}.self_attn.v_proj": "colwise", f"{p}.self_attn.o_proj": "rowwise", f"{p}.mlp.gate_proj": "colwise",
                f"{p}.mlp.up_proj": "colwise", f"{p}.mlp.down_proj": "rowwise"}
    return out


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def source(cell: str) -> ModelSource:
    """A ModelSource for ``cell``, naming loss_fn/make_batch when the cell defines them."""
    has = "def loss_fn" in cell
    return ModelSource(cell, loss_fn_var="loss_fn" if has else None,
                       make_batch_var="make_batch" if "def make_batch" in cell else None)


def make_plan(src: ModelSource, *, dp=1, tp=1, pp=1, zero=0, tp_styles=None, sp=False, stages=None,
              recompute=None, schedule="1f1b", virtual_stages=1, micro_batches=1, amp="none", param_dtype="float32",
              sync_batchnorm=False, loss_parallel=False, lr=1e-3) -> Plan:
    """One LayerPlan per captured layer. ``tp_styles``: module path (fnmatch-free, exact) -> style;
    ``stages``: layer path -> stage; ``recompute``: layer path -> mode."""
    model, inputs, ns = src.build(device="meta")
    graph = capture(model, src.model_inputs(ns, inputs))
    tp_styles, stages, recompute = tp_styles or {}, stages or {}, recompute or {}
    layers, stage = [], 0
    for layer in graph.layers:
        stage = stages.get(layer.path, stage)
        styles = {m: s for m, s in tp_styles.items() if m == layer.path or m.startswith(layer.path + ".")}
        layers.append(LayerPlan(path=layer.path, stage=stage, tp=styles, sequence_parallel=sp,
                                recompute=recompute.get(layer.path, "none")))
    return Plan(mesh=MeshPlan(dp=dp, tp=tp, pp=pp, zero_stage=zero),
                batch=BatchPlan(global_batch=1, micro_batches=micro_batches),
                pipeline=PipelinePlan(schedule=schedule, virtual_stages=virtual_stages),
                precision=PrecisionPlan(amp=amp, param_dtype=param_dtype),
                optimizer=OptimizerPlan(name="adamw", lr=lr, weight_decay=0.01),
                layers=layers, sync_batchnorm=sync_batchnorm, loss_parallel=loss_parallel,
                model={"name": type(model).__name__})


def gpt_mlp_tp(n_layer: int = 2) -> dict[str, str]:
    """GPT blocks' MLPs split Megatron-style (the fused qkv projection cannot be split column-wise)."""
    out = {}
    for i in range(n_layer):
        out[f"h.{i}.mlp.c_fc"] = "colwise"
        out[f"h.{i}.mlp.c_proj"] = "rowwise"
    return out


def llama_tp(n_layers: int = 2, *, sp: bool = False, head: bool = True, embedding: bool = True) -> dict[str, str]:
    out = {"tok_embeddings": "rowwise"} if embedding else {}
    for i in range(n_layers):
        p = f"layers.{i}"
        out |= {f"{p}.attention.wq": "colwise", f"{p}.attention.wk": "colwise", f"{p}.attention.wv": "colwise",
                f"{p}.attention.wo": "rowwise", f"{p}.feed_forward.w1": "colwise", f"{p}.feed_forward.w3": "colwise",
                f"{p}.feed_forward.w2": "rowwise"}
        if sp:
            out |= {f"{p}.attention_norm": "sequence_parallel", f"{p}.ffn_norm": "sequence_parallel"}
    if sp:
        out["norm"] = "sequence_parallel"
    if head:
        out["output"] = "colwise"
    return out


__all__ = ["GPT_CELL", "HF_BERT_CELL", "HF_GPT2_CELL", "HF_LLAMA_CELL", "LLAMA_CELL", "RECSYS_CELL", "RESNET_CELL",
           "TIED_CELL", "TYPED_CELL", "script_namespace",
           "gpt_mlp_tp", "has_transformers", "hf_llama_tp", "llama_tp", "make_plan", "source", "torch"]


TIED_CELL = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln_2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (m(h).view(b, t, -1, h.shape[-1] // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.ln_2(x))))


class TiedGPT(nn.Module):
    def __init__(self, vocab=96, d=32, layers=2, heads=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


model = TiedGPT()
example_inputs = (torch.randint(0, 96, (4, 16)),)
"""
"""a GPT whose output head shares the embedding's weight (what GPT-2, Gemma, BERT and T5 do)"""


def script_namespace(src: ModelSource, plan: Plan, tmp_path, **export_kwargs) -> dict:
    """The plan's exported script in its one-file form, imported (its cell has run; ``main`` has not): its
    ``model``, ``parallelize`` and runtime functions."""
    import runpy

    from autopar_nb.export import export

    script = export(src, plan, tmp_path / "train_under_test.py", quiet=True, single_file=True,
                    **export_kwargs).script
    return runpy.run_path(str(script), run_name="under_test")


# ---- TP layouts: fused projections, Conv1D, heads beside attention, repeated key/value heads (test_tp_layouts) ----
HF_PHI3_CELL = """\
import torch
from transformers import Phi3Config, Phi3ForCausalLM

model = Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads={kv}, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=0, eos_token_id=0))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""

HF_T5_CELL = """\
import torch
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                            decoder_start_token_id=0))
example_inputs = {"input_ids": torch.randint(0, 128, (4, 16)), "decoder_input_ids": torch.randint(0, 128, (4, 16))}


def loss_fn(model, batch):
    logits = model(**batch).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["decoder_input_ids"].roll(-1, 1).flatten())
"""

HF_GEMMA_CELL = """\
import torch
from transformers import GemmaConfig, GemmaForCausalLM

model = GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                     max_position_embeddings=64, pad_token_id=0, bos_token_id=0, eos_token_id=0))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""

# multi-query attention in one fused query_key_value (4 query heads, then one key and one value head), FalconLinear
# (an nn.Linear whose forward is input @ weight.T), attention and MLP in parallel, the MLP's output added to in place;
# dropout off (verify keeps the random streams of both runs apart)
HF_FALCON_CELL = """\
import torch
from transformers import FalconConfig, FalconForCausalLM

model = FalconForCausalLM(FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       hidden_dropout=0.0, attention_dropout=0.0))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""

HF_GEMMA2_CELL = """\
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

model = Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""
"""Gemma 2: the logits soft-capped (divided, tanh, multiplied) between the output head and the model's output"""

HF_BLOOM_CELL = """\
import torch
from transformers import BloomConfig, BloomForCausalLM

model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""
"""Bloom: the ALiBi bias of every head, (batch x heads, 1, T), built by the model and added in each attention's
baddbmm"""

HF_MPT_CELL = """\
import torch
from transformers import MptConfig, MptForCausalLM

model = MptForCausalLM(MptConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=8, max_seq_len=64))
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""
"""MPT: the ALiBi bias of every head, (heads, 1, T), made once by the model and handed to each attention as
``position_bias`` (8 heads: a batch of 4 cannot be mistaken for them)"""

HF_DEEPSEEK_V3_CELL = """\
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

config = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                          num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                          kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                          max_position_embeddings=64)
model = DeepseekV3ForCausalLM(config)
example_inputs = (torch.randint(0, 128, (4, 16)),)
"""
"""DeepSeek-V3: MLA attention (low-rank q_a_proj / kv_a_proj_with_mqa with their norms, head-carrying q_b_proj /
kv_b_proj, a rope key of one head written into every head's key with expand and copy_), a dense first layer, then
routed and shared experts"""


def with_parts(plan: Plan, parts: dict[str, list[int]]) -> Plan:
    """``plan`` with ``LayerPlan.tp_parts`` filled from ``parts`` (module path -> heads per part), re-checked."""
    import dataclasses

    from autopar_nb.plan import layer_of

    paths = [lp.path for lp in plan.layers]
    plan.layers = [dataclasses.replace(lp, tp_parts={m: p for m, p in parts.items() if layer_of(m, paths) == lp.path})
                   for lp in plan.layers]
    return plan


def zoo_gpt_tp(n_layer: int = 2, heads: int = 4) -> tuple[dict[str, str], dict[str, list[int]]]:
    """nanoGPT-style zoo GPT: the fused [q|k|v] c_attn split part by part, Megatron MLP (styles, parts)."""
    styles, parts = gpt_mlp_tp(n_layer), {}
    for i in range(n_layer):
        styles |= {f"h.{i}.attn.c_attn": "colwise", f"h.{i}.attn.c_proj": "rowwise"}
        parts[f"h.{i}.attn.c_attn"] = [heads] * 3
    return styles, parts


def hf_gpt2_tp(n_layer: int = 2, heads: int = 4) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Hugging Face GPT-2: Conv1D c_attn (fused [q|k|v]), c_proj, c_fc, c_proj (styles, parts)."""
    styles, parts = {}, {}
    for i in range(n_layer):
        p = f"transformer.h.{i}"
        styles |= {f"{p}.attn.c_attn": "colwise", f"{p}.attn.c_proj": "rowwise", f"{p}.mlp.c_fc": "colwise",
                   f"{p}.mlp.c_proj": "rowwise"}
        parts[f"{p}.attn.c_attn"] = [heads] * 3
    return styles, parts


def hf_phi3_tp(n_layer: int = 2, *, heads: int = 4, kv_heads: int = 2, ffn: int = 64
               ) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Phi-3: fused qkv_proj ([q|k|v] in heads) and gate_up_proj ([gate|up] in features) (styles, parts)."""
    styles, parts = {}, {}
    for i in range(n_layer):
        p = f"model.layers.{i}"
        styles |= {f"{p}.self_attn.qkv_proj": "colwise", f"{p}.self_attn.o_proj": "rowwise",
                   f"{p}.mlp.gate_up_proj": "colwise", f"{p}.mlp.down_proj": "rowwise"}
        parts |= {f"{p}.self_attn.qkv_proj": [heads, kv_heads, kv_heads], f"{p}.mlp.gate_up_proj": [ffn, ffn]}
    return styles, parts


def hf_bert_tp(n_layer: int = 2) -> dict[str, str]:
    """BERT: q/k/v in attention.self, their rowwise partner in attention.output (a sibling module)."""
    out = {}
    for i in range(n_layer):
        p = f"bert.encoder.layer.{i}"
        out |= {f"{p}.attention.self.query": "colwise", f"{p}.attention.self.key": "colwise",
                f"{p}.attention.self.value": "colwise", f"{p}.attention.output.dense": "rowwise",
                f"{p}.intermediate.dense": "colwise", f"{p}.output.dense": "rowwise"}
    return out


def hf_t5_tp(n_layer: int = 2, heads: int = 4) -> tuple[dict[str, str], dict[str, list[int]]]:
    """T5: every attention and feed-forward split; the relative position bias (one column per head) by heads."""
    styles, parts = {}, {}
    for stack, attentions, ff in (("encoder", ["layer.0.SelfAttention"], "layer.1"),
                                  ("decoder", ["layer.0.SelfAttention", "layer.1.EncDecAttention"], "layer.2")):
        for i in range(n_layer):
            p = f"{stack}.block.{i}"
            for a in attentions:
                styles |= {f"{p}.{a}.{x}": "colwise" for x in "qkv"} | {f"{p}.{a}.o": "rowwise"}
            styles |= {f"{p}.{ff}.DenseReluDense.wi": "colwise", f"{p}.{ff}.DenseReluDense.wo": "rowwise"}
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
        styles[bias], parts[bias] = "colwise", [heads]
    return styles, parts


def hf_gqa_tp(n_layers: int = 2, *, heads: int = 4, kv_heads: int = 1) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Llama-family blocks (Gemma, Llama) with the head counts of q and k/v: k/v repeated when tp > kv_heads."""
    styles = {k: v for k, v in hf_llama_tp(n_layers).items() if k.startswith("model.layers.")}
    parts = {}
    for i in range(n_layers):
        p = f"model.layers.{i}.self_attn"
        parts |= {f"{p}.q_proj": [heads], f"{p}.k_proj": [kv_heads], f"{p}.v_proj": [kv_heads]}
    return styles, parts


def hf_falcon_tp(n_layers: int = 2, *, heads: int = 4) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Falcon's blocks: the fused multi-query query_key_value colwise with parts [heads, 1, 1] (query heads split, the
    key and value head repeated), dense rowwise, the MLP colwise/rowwise."""
    styles, parts = {}, {}
    for i in range(n_layers):
        p = f"transformer.h.{i}"
        styles |= {f"{p}.self_attention.query_key_value": "colwise", f"{p}.self_attention.dense": "rowwise",
                   f"{p}.mlp.dense_h_to_4h": "colwise", f"{p}.mlp.dense_4h_to_h": "rowwise"}
        parts[f"{p}.self_attention.query_key_value"] = [heads, 1, 1]
    return styles, parts


# token ids and BERT-style token types: the smallest table (2 rows) is not the vocabulary the head predicts (64)
TYPED_CELL = """\
import torch
import torch.nn as nn


class Typed(nn.Module):
    def __init__(self, vocab=64, dim=16):
        super().__init__()
        self.wte, self.types = nn.Embedding(vocab, dim), nn.Embedding(2, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, dim))
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids, token_type_ids):
        h = self.wte(input_ids) + self.types(token_type_ids)
        return self.lm_head(h + self.mlp(h))


model = Typed()
example_inputs = {"input_ids": torch.randint(0, 64, (4, 16)), "token_type_ids": torch.zeros(4, 16, dtype=torch.long)}
"""
