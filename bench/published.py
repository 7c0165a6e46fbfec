"""Published large training runs reproduced on paper: each run's model captured on the meta
device, planned with the published layout pinned, costed on the cluster preset of its hardware,
and the prediction set beside the published throughput (and per-GPU memory where published).

Every published figure below comes from the text of its source, quoted beside its row
(:data:`SOURCES`, ``Row.where``). What a source does not publish (micro-batches, virtual stages,
sequence parallelism...) is left to the planner and shown as its choice. A layout the planner
refuses keeps the refusal as its result. Float8 training and asynchronous TP are plan choices,
pinned off unless the source says its run used them (``Row.fix``): a row that did is planned
with them (torchtitan's float8 recipe of the time: tensorwise scaling); a row needing one where
the product refuses it (with pipelining) is costed without it, marked excluded, and left out of
the summary.

Throughput is compared in the unit the source publishes. Where that unit is FLOP/s the
predicted step time is turned into TFLOP/s with the source's own FLOP count, so that no
FLOP-counting convention enters the comparison: Megatron-LM's eq. (3) (recomputation included),
and PaLM's 6N + 12LHQT per token for Llama 3 (whose MFU cites PaLM; the widget's MFU counts the
same: ``cost.model_tflops_per_gpu``). torchtitan and NVIDIA's
DGX Cloud recipes publish tokens/s (per GPU; NVIDIA's over the job, divided here by its GPUs).
Error = predicted / published - 1: positive = the model predicts a faster run than measured.
Memory: the predicted per-rank peak with its allocator margin against torchtitan's max reserved
(``reserved_bytes.all.peak``).

A published run whose pinned layout does not fit its card under our runtime is still costed:
planned on a card just large enough for the planner's most frugal candidate (the need its
refusal names), costed on the real cluster, and marked "does not fit".

    .venv/bin/python bench/published.py            # prints the table (about 5 min, captures)
    .venv/bin/python bench/published.py --write    # and replaces its section of BENCHMARKS.md
    .venv/bin/python bench/published.py --only torchtitan,llama3    # some sources' rows
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autopar_nb, not an editable install's
sys.path.insert(0, str(ROOT / "bench"))

import autopar_nb as ap  # noqa: E402
from autopar_nb import zoo  # noqa: E402
from autopar_nb.cost.estimate import estimate  # noqa: E402
from autopar_nb.cost.time import MFU_BASIS  # noqa: E402

warnings.filterwarnings("ignore")

SECTION = "Published large runs on paper"
GiB = 2**30
TT = "https://github.com/pytorch/torchtitan/blob/"
DGXC = ("https://github.com/NVIDIA/dgxc-benchmarking/blob/"
        "35a9aecc8d5b17d99d80f52f38c75ade0dbab7ae/")

SOURCES = {
    "megatron": "Narayanan et al., *Efficient Large-Scale Language Model Training on GPU Clusters "
                "Using Megatron-LM*, SC21, https://arxiv.org/abs/2104.04473 — §5.1 Table 1 "
                "(A100-80GB on Selene: NVLink + 8 x HDR 200 Gb/s per node, §5), eq. (3) for the "
                "FLOPs per iteration",
    "llama3": "Llama Team, AI @ Meta, *The Llama 3 Herd of Models*, "
              "https://arxiv.org/abs/2407.21783 — §3.3.2 Table 4 and its text (H100 80GB HBM3, "
              "700 W, RoCE 400 Gb/s per GPU: §3.3.1)",
    "torchtitan": "pytorch/torchtitan's performance pages (Grand Teton hosts: 8 x H100 with "
                  "NVLink, 400 Gb/s RDMA per GPU; 64 x A100 80GB for the Apr 2024 rows) — Dec "
                  "2024: " + TT + "820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/"
                  "llama3_h100_202412_torchtitan.md; Aug 2024: " + TT
                  + "3faaa1a0dee68ce028400e3dafd1735d152cb4f8/docs/performance.md; Apr 2024: " + TT
                  + "1ea476e9f24be439eda358aa864f45c1c37a8a88/docs/performance.md; configs: "
                  "train_configs/*.toml at those commits and at 9dec370 (the Dec 2024 page's)",
    "dgxc": "NVIDIA DGX Cloud benchmarking recipes v24.11.1 (NeMo 24.09 / 24.11 on DGX H100) — "
            + DGXC + "llama3.1/README_8b.md, README_70b.md, README_405b.md, "
            "nemo_megatron/README_175b.md, and the recipes' yaml beside them",
}
"""source key -> citation (document, where it describes its hardware, URL)"""


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    """:data:`SOURCES` key"""
    where: str
    """the table the row's figures come from"""
    model: str
    """:data:`MODELS` key"""
    preset: str
    gpus: int
    layout: dict
    """the published layout as planner fix keys: dp, tp, pp, cp, zero_stage, schedule, ..."""
    global_batch: int
    """sequences per optimizer step"""
    seq: int
    recompute: str
    metric: str
    """tflops_eq3 (Megatron-LM eq. 3), tflops_palm (6N + 12LHQT per token), tokens (per GPU)"""
    published: float
    memory_gib: float | None = None
    """published per-GPU memory, GiB"""
    card_gb: float | None = None
    """card memory in GB (1e9 bytes) where it is not the preset's"""
    extra: dict = field(default_factory=dict)
    """other published choices as fix keys (compile, fused_norm, fused_loss, sequence_parallel)"""
    excluded: str = ""
    """why the row is left out of the summary (it needs something the product does not run)"""
    notes: str = ""
    hbm_tbs: float | None = None
    """the card's HBM bandwidth in TB/s where the source states one other than the preset's"""

    @property
    def fix(self) -> dict:
        """The row's pins: float8 and async TP off unless the row says it ran them (every source states its
        precision and what it overlapped), so the planner never adds either to a run that had neither."""
        return {**self.layout, "recompute": self.recompute, "amp": "bf16", "float8": "none",
                "async_tp": False, **self.extra}

    @property
    def product(self) -> int:
        """GPUs the layout uses: dp x tp x pp x cp (ep splits dp ranks' experts: no factor)"""
        lay = self.layout
        return lay.get("dp", 1) * lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1)


# --- models ---------------------------------------------------------------------------------
# Llama 3 shapes: torchtitan torchtitan/models/llama/__init__.py (8B, 70B @1ea476e9f; 405B
# @3faaa1a0d: dim 16384, 126 layers, 128 heads, 8 KV heads, ffn_dim_multiplier 1.2, multiple_of
# 4096 -> FFN 53248), vocabulary 128256 (tiktoken's base + num_reserved_special_tokens 256,
# torchtitan/datasets/tokenizer/tiktoken.py). Llama 2 13B: meta-llama/Llama-2-13b-hf config.json
# (5120 x 40 layers, 40 heads = 40 KV heads, FFN 13824, vocab 32000); 70B: torchtitan's llama2
# "70B" (8192 x 80, 64/8 heads, 1.3 x, multiple_of 4096 -> 28672), the same 32000 tokens. NeMo's
# 405B (dgxc llama3.1/llama3.1_405b.yaml): num_query_groups 16. GPT: Megatron-LM Table 1's
# (heads, hidden, layers), V = 51200, s = 2048 (§5.1), 4h GeLU MLP; zoo.GPT unties the output
# head (Megatron ties it: one more V x h matrix on the last stage, no FLOPs).
LLAMA3_405B = zoo.LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128,
                              n_kv_heads=8, ffn_dim=53248)
MODELS = {
    "llama3-8b": (zoo.LLAMA3_8B, 8192),
    "llama3-70b": (zoo.LLAMA_70B, 8192),
    "llama3-405b": (LLAMA3_405B, 8192),
    "nemo-405b": (zoo.LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128,
                                  n_kv_heads=16, ffn_dim=53248), 8192),
    # dgxc README_405b.md: the 32-GPU proxy runs 7 of the 126 layers (its "Layers" row)
    "nemo-405b-7l": (zoo.LlamaConfig(vocab_size=128256, dim=16384, n_layers=7, n_heads=128,
                                     n_kv_heads=16, ffn_dim=53248), 8192),
    "llama2-13b": (zoo.LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40,
                                   n_kv_heads=40, ffn_dim=13824), 4096),
    "llama2-70b": (zoo.LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64,
                                   n_kv_heads=8, ffn_dim=28672), 4096),
    # GPT-3 175B as NeMo ran it (dgxc nemo_megatron/gpt3_175b_hydra.yaml: 96 x 12288, 96 heads,
    # FFN 49152, seq 2048; GPT-2 BPE's 50257 tokens padded to make_vocab_size_divisible_by 128)
    "gpt3-175b": (zoo.GPTConfig(vocab_size=50304, block_size=2048, n_layer=96, n_head=96,
                                n_embd=12288), 2048),
}
"""model key -> (zoo config, the sequence length it is captured at)"""


def _megatron(a: int, h: int, L: int) -> str:
    key = f"gpt-{L}x{h}"
    MODELS.setdefault(key, (zoo.GPTConfig(vocab_size=51200, block_size=2048, n_layer=L,
                                          n_head=a, n_embd=h, dropout=0.1), 2048))
    return key


class Megatron2021Attention(zoo.CausalSelfAttention):
    """Self-attention as Megatron-LM ran it for SC21, before FlashAttention: the scores
    materialised by a batched GEMM, one fused scale + causal mask + softmax kernel reading and
    writing them in 16 bits (the rows list ``softmax`` in ``low_precision_ops``), attention
    dropout, a second batched GEMM, and dropout on the projection (Megatron-LM 2021,
    megatron/model/transformer.py ``ParallelAttention``: ``torch.baddbmm`` with alpha 1/sqrt(d),
    ``FusedScaleMaskSoftmax``, ``attention_dropout``, ``torch.bmm``; megatron/arguments.py:
    ``--attention-dropout`` and ``--hidden-dropout`` default 0.1; SC21 §4.2 names the fused
    kernels). The model is only captured on the meta device and costed, never run: the scale
    (inside the GEMM) and the mask (inside the softmax kernel) move no bytes of their own and
    are left out."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        probs = F.dropout(F.softmax(q @ k.transpose(-2, -1), -1), self.dropout, self.training)
        y = (probs @ v).transpose(1, 2).reshape(B, T, -1)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class Megatron2021GPT(zoo.GPT):
    """zoo.GPT with :class:`Megatron2021Attention` in every block."""

    def __init__(self, cfg: zoo.GPTConfig):
        super().__init__(cfg)
        for block in self.h:
            block.attn = Megatron2021Attention(cfg)


def build(key: str):
    cfg, seq = MODELS[key]
    with torch.device("meta"):
        model = (Megatron2021GPT(cfg) if key.startswith("gpt-") else
                 zoo.GPT(cfg) if isinstance(cfg, zoo.GPTConfig) else zoo.Llama(cfg))
        return model, torch.randint(0, cfg.vocab_size, (1, seq))


# --- rows -----------------------------------------------------------------------------------
ROWS: list[Row] = []

# Megatron-LM SC21 §5.1 Table 1 ("Weak-scaling throughput for GPT models ranging from 1 billion
# to 1 trillion parameters"): (parameters in billions, attention heads, hidden size, layers,
# tensor-parallel size, pipeline-parallel size, GPUs, batch size, achieved TFLOP/s per GPU).
# §5.1: "we use the interleaved pipeline schedule with the scatter/gather optimization enabled";
# eq. (3) "assumes activation recomputation" (full); "All of our results are run with mixed
# precision" (fp16 then: bf16 here, the same A100 tensor peak; our pipelining takes no fp16 loss
# scaling). Megatron-LM of 2021: DDP (ZeRO 0), no sequence parallelism (Korthikanti et al. 2022
# came after), its own vocab-parallel cross-entropy (no fused linear + loss), attention before
# FlashAttention (Megatron2021Attention: scores materialised, softmax fused in 16 bits).
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
for size, a, h, L, t, p, n, B, tflops in MEGATRON_TABLE_1:
    ROWS.append(Row(
        f"GPT {size:g}B (Megatron-LM)", "megatron", "SC21 Table 1", _megatron(a, h, L),
        "a100-80gb", n,
        {"dp": n // (t * p), "tp": t, "pp": p, "zero_stage": 0,
         **({"schedule": "interleaved_1f1b"} if p > 1 else {})},
        B, 2048, "full", "tflops_eq3", tflops,
        extra={"sequence_parallel": False, "fused_loss": False, "low_precision_ops": ["softmax"],
               "compile": False},
        notes="the paper's fp16 mixed precision run as bf16 (same peak); attention as Megatron-LM "
              "ran it in 2021 (scores materialised, fused 16-bit softmax, dropout 0.1: "
              "Megatron2021Attention); eager, no torch.compile (2021: its fusions are the "
              "softmax above); microbatch size and virtual stages not in Table 1 (the planner's)"))

# Llama 3 §3.3.2 Table 4 ("Scaling configurations and MFU for each stage of Llama 3 405B
# pre-training"):
#   GPUs | TP | CP | PP | DP | Seq. Len. | Batch size/DP | Tokens/Batch | TFLOPs/GPU | BF16 MFU
#   8,192 | 8 | 1 | 16 | 64 | 8,192 | 32 | 16M | 430 | 43%
#   16,384 | 8 | 1 | 16 | 128 | 8,192 | 16 | 16M | 400 | 41%
#   16,384 | 8 | 16 | 16 | 8 | 131,072 | 16 | 16M | 380 | 38%
# §3.3.2: FSDP "shards optimizer states and gradients, but for model shards we do not reshard
# after forward computation" (ZeRO-2); "we use an interleaved schedule" (V not published); "we
# could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing"; MFU after
# Chowdhery et al. (PaLM). Global batch = DP x batch size/DP sequences (16M tokens).
L3 = "Llama 3 Table 4"
L3_NOTE = ("V, micro-batches and the balanced first/last stages (one layer fewer each, §3.3.2) "
           "not pinnable/published: the planner's")
ROWS += [
    Row("Llama 3 405B, 8K, 8192 GPUs", "llama3", L3, "llama3-405b", "h100-80gb", 8192,
        {"dp": 64, "tp": 8, "pp": 16, "zero_stage": 2, "schedule": "interleaved_1f1b"},
        64 * 32, 8192, "none", "tflops_palm", 430, notes=L3_NOTE),
    Row("Llama 3 405B, 8K, 16384 GPUs", "llama3", L3, "llama3-405b", "h100-80gb", 16384,
        {"dp": 128, "tp": 8, "pp": 16, "zero_stage": 2, "schedule": "interleaved_1f1b"},
        128 * 16, 8192, "none", "tflops_palm", 400, notes=L3_NOTE),
    Row("Llama 3 405B, 128K, 16384 GPUs", "llama3", L3, "llama3-405b", "h100-80gb", 16384,
        {"dp": 8, "tp": 8, "pp": 16, "cp": 16, "zero_stage": 2, "schedule": "interleaved_1f1b"},
        8 * 16, 131072, "none", "tflops_palm", 380,
        notes="recompute at 128K not stated (none, as at 8K); Meta's CP all-gathers K/V"),
]

# torchtitan benchmarks/llama3_h100_202412_torchtitan.md @820504e20 (Dec 2024; the same tables in
# docs/performance.md @d4c86e375): "Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec
# peak memory bandwidth", "We used the default 500W power limit" (the preset is the 700 W SXM at
# 3.35 TB/s), memory = max reserved, TPS/GPU read at the 90th iteration. Llama 3.1 8B, seq_len
# 8192, norm_type "rmsnorm" (train_configs/llama3_8b.toml @9dec370, the page's torchtitan
# commit); bf16 FSDP2 (mixed_precision_param bfloat16): ZeRO-3. torchtitan had no gradient
# accumulation then (config_manager.py): one micro-batch per step unless pipelined, where
# pipeline_parallel_microbatches defaults to the PP degree (config_manager.py @9dec370).
TT12 = "torchtitan Dec 2024"
H96 = 96.0  # "96GB HBM2e"
TT12_HBM = 2.4  # "with 2.4 TB/sec peak memory bandwidth"
TT12_NOTE = "500 W H100s costed at the 700 W SXM preset's peak FLOP/s (their 2.4 TB/s HBM2e: the card's)"
tt_8b = {"sequence_parallel": False, "fused_loss": False, "fused_norm": False}
F8 = "tensorwise"  # torchtitan's float8 recipe then: tensorwise dynamic scaling (float8 all-gathers under FSDP)
for gpus, table, rows in (
        # Table 1: "1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global
        # batch size 16. Selective activation checkpointing." | Techniques | TPS/GPU | Memory(GiB)
        (8, "Table 1", ((False, False, 5762, 82.4), (True, False, 6667, 77.0), (True, True, 8532, 76.8))),
        # Table 3: the same on 128 GPUs, global batch size 256
        (128, "Table 3", ((False, False, 5605, 67.0), (True, False, 6514, 62.0), (True, True, 8380, 61.8)))):
    for compiled, float8, tps, mem in rows:
        ROWS.append(Row(
            f"Llama 3.1 8B FSDP{' + compile' if compiled else ''}{' + Float8' if float8 else ''}, "
            f"{gpus} GPUs", "torchtitan", f"{TT12} {table}", "llama3-8b", "h100-80gb", gpus,
            {"dp": gpus, "zero_stage": 3, "micro_batches": 1}, 2 * gpus, 8192, "selective",
            "tokens", tps, mem, H96, {**tt_8b, "compile": compiled, "float8": F8 if float8 else "none"}, "",
            TT12_NOTE, hbm_tbs=TT12_HBM))
# Table 2: "FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1.
# Full activation checkpointing." | Parallelism | Sequence Length | TPS/GPU | Memory(GiB) |
for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2),
                                (2, 4, 131072, 1071, 84.0), (1, 8, 262144, 548, 84.5)):
    ROWS.append(Row(
        f"Llama 3.1 8B FSDP {fsdp} CP {cp}, seq {seq // 1024}K, 8 GPUs", "torchtitan",
        f"{TT12} Table 2", "llama3-8b", "h100-80gb", 8,
        {"dp": fsdp, "zero_stage": 3, "micro_batches": 1, **({"cp": cp} if cp > 1 else {})},
        fsdp, seq, "full", "tokens", tps, mem, H96, {**tt_8b, "compile": True, "float8": F8},
        "", TT12_NOTE, hbm_tbs=TT12_HBM))
# Table 4: "2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs
# (FSDP 32, TP 8). Local batch size 16, global batch size 512. Full activation checkpointing."
# (torchtitan's TP splits the norms' sequence: sequence parallelism)
for label, tps, mem, async_tp in (("2D", 829, 71.9, False), ("2D + AsyncTP", 876, 67.6, True)):
    ROWS.append(Row(
        f"Llama 3.1 70B {label}, 256 GPUs", "torchtitan", f"{TT12} Table 4", "llama3-70b",
        "h100-80gb", 256, {"dp": 32, "tp": 8, "zero_stage": 3, "micro_batches": 1}, 512, 8192,
        "full", "tokens", tps, mem, H96,
        {"sequence_parallel": True, "fused_loss": False, "fused_norm": False, "compile": True, "float8": F8,
         "async_tp": async_tp}, "", TT12_NOTE, hbm_tbs=TT12_HBM))
# Table 5: "3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. Llama 3.1 405B
# model. 512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global batch size 256. Full
# activation checkpointing." | Schedule | TPS/GPU | Memory(GiB) |
# (compile left free: our pipeline stages are traced graphs, which the planner does not compile)
for sched, tps, mem in (("1f1b", 100, 82.5), ("interleaved_1f1b", 128, 72.7)):
    ROWS.append(Row(
        f"Llama 3.1 405B 3D {sched}, 512 GPUs", "torchtitan", f"{TT12} Table 5", "llama3-405b",
        "h100-80gb", 512,
        {"dp": 8, "tp": 8, "pp": 8, "zero_stage": 3, "schedule": sched, "micro_batches": 8},
        256, 8192, "full", "tokens", tps, mem, H96,
        {"sequence_parallel": True, "fused_norm": False}, "needs Float8 and async TP with pipelining (refused: pp > 1)",
        TT12_NOTE, hbm_tbs=TT12_HBM))
# Table 6: "4D parallelism (FSDP + TP + PP + CP) + torch.compile + Float8 + AsyncTP + 1F1B.
# Llama 3.1 405B model. 512 GPUs (TP 8, PP8). Local batch size 8. Full activation
# checkpointing." | Parallelism | Sequence Length | TPS/GPU | Memory(GiB) |
for fsdp, cp, seq, tps, mem in ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9),
                                (2, 4, 131072, 31, 77.1), (1, 8, 262144, 16, 84.9)):
    ROWS.append(Row(
        f"Llama 3.1 405B 4D FSDP {fsdp} CP {cp}, seq {seq // 1024}K, 512 GPUs", "torchtitan",
        f"{TT12} Table 6", "llama3-405b", "h100-80gb", 512,
        {"dp": fsdp, "tp": 8, "pp": 8, "zero_stage": 3, "schedule": "1f1b", "micro_batches": 8,
         **({"cp": cp} if cp > 1 else {})},
        8 * fsdp, seq, "full", "tokens", tps, mem, H96,
        {"sequence_parallel": True, "fused_norm": False}, "needs Float8 and async TP with pipelining (refused: pp > 1)",
        TT12_NOTE, hbm_tbs=TT12_HBM))

# torchtitan docs/performance.md @3faaa1a0d (Aug 2024), "Llama 3.1 performance numbers": "405B
# model ... on 128 H100 GPUs", "Llama 3.1 (405B) on 128 H100 (94GB memory)", 2D (FSDP2 + Tensor
# Parallel), "local batch size 2 (global batch size = local batch size 2 * number of FSDP ranks
# 16 = 32)": | 405B | 2 | full | 109 | 29.0% | None |, Float8 177, Float8 + Async TP 185 (WPS).
# TP 8, seq_len 8192, norm "rmsnorm", compile = true (train_configs/llama3_405b.toml @3faaa1a0d,
# "a preset for 128 H100 GPUs"; its [float8] enable_fsdp_float8_all_gather = true and
# [experimental] enable_async_tensor_parallel = true are the two later rows' "Optimizations", the
# first row's "None": bf16, no async TP, the toml's compile). No memory published.
TT08 = "torchtitan Aug 2024"
for label, tps, float8, async_tp in (("", 109, False, False), (" + Float8", 177, True, False),
                                    (" + Float8 + AsyncTP", 185, True, True)):
    ROWS.append(Row(
        f"Llama 3.1 405B 2D{label}, 128 GPUs", "torchtitan", f"{TT08} (405B table)",
        "llama3-405b", "h100-80gb", 128, {"dp": 16, "tp": 8, "zero_stage": 3, "micro_batches": 1},
        32, 8192, "full", "tokens", tps, card_gb=94.0,
        extra={"sequence_parallel": True, "fused_loss": False, "fused_norm": False, "compile": True,
               "async_tp": async_tp, **({"float8": F8} if float8 else {})},
        notes="lower-TDP HBM2e H100s (the page's footnote) costed as the SXM preset; compile: the "
              "toml's (the page names Float8 and Async TP as its optimizations)"))

# torchtitan docs/performance.md @1ea476e9f (Apr 2024): "Llama 3 models with FSDP2 on 64 A100
# (80GB) GPUs", "local batch size 1 (global batch size = local batch size 1 * number of FSDP
# ranks 64 = 64)": | 8B | 1 | selective op | 2973 | 58.2% |, | 70B | 1 | full | 331 | 51.7% |;
# its Llama 2 table (first at @395a52627, "We mostly use local batch size 2 (global batch size =
# local batch size 2 * number of FSDP ranks 64 = 128)"): | 13B | 2 | no | 2162 |, | 13B | 2 |
# selective op | 1904 |, | 70B | 1 | selective op | 355 |, | 70B | 2 | full | 353 | (WPS).
# "selective layer" rows left out: the layer frequency is not published. seq_len 8192 (Llama 3)
# / 4096 (Llama 2), compile = false; norm_type fused_rmsnorm for Llama 3 8B and Llama 2 13B,
# rmsnorm for the 70Bs (train_configs/*.toml @1ea476e9f, @395a52627).
TT04 = "torchtitan Apr 2024"
for model, name, seq, lbs, rec, tps, fused in (
        ("llama3-8b", "Llama 3 8B", 8192, 1, "selective", 2973, True),
        ("llama3-70b", "Llama 3 70B", 8192, 1, "full", 331, False),
        ("llama2-13b", "Llama 2 13B", 4096, 2, "none", 2162, True),
        ("llama2-13b", "Llama 2 13B", 4096, 2, "selective", 1904, True),
        ("llama2-70b", "Llama 2 70B", 4096, 1, "selective", 355, False),
        ("llama2-70b", "Llama 2 70B", 4096, 2, "full", 353, False)):
    ROWS.append(Row(
        f"{name} FSDP, local batch {lbs}, AC {rec}, 64 A100", "torchtitan",
        f"{TT04} ({name.split()[0]} {name.split()[1]} table)", model, "a100-80gb", 64,
        {"dp": 64, "zero_stage": 3, "micro_batches": 1}, 64 * lbs, seq, rec, "tokens", tps,
        extra={"compile": False, "fused_loss": False, "fused_norm": fused}))

# NVIDIA DGX Cloud recipes v24.11.1 (@35a9aec); throughput = the README's "Throughput in tokens
# per second" over the GPUs. NeMo runs the distributed optimizer (optim name
# distributed_fused_adam: ZeRO-1), Transformer Engine (fused RMSNorm), no recompute
# (activations_checkpoint_granularity: null) in every yaml below. BF16 tables: launch.sh's
# DTYPE=bf16 sets FP8_ENABLED=false. The 70B and 405B yaml set ub_tp_comm_overlap: true
# (Transformer Engine's userbuffers overlap the TP all-gathers and reduce-scatters with the GEMMs
# they feed, as torch's async TP does): planned with async TP where the planner runs it (pp 1),
# excluded where it refuses it (with pipelining), as torchtitan's async-TP rows with pipelining are.
# llama3.1/README_8b.md "Llama 3.1 8b 24.09 BF16 (TP=1, PP=1, CP=2, MBS=1, GA=32)": 8x H100
# (GBS=128) 81222 tokens/s (12.91 s/step), 128x H100 (GBS=2048) 1280704 tokens/s (13.10 s/step);
# llama3.1_8b.yaml: encoder_seq_length 8192.
NEMO_NOTE = ("Megatron's distributed optimizer keeps bf16 parameters and one fp32 gradient "
             "buffer and all-gathers bf16 parameters behind the next forward (overlap_param_sync); "
             "our ZeRO-1 (FSDP2 holding the bf16 parameters from the first forward to the last backward, "
             "float32 gradients accumulated unsharded and reduce-scattered once per step) the same states, "
             "and all-gathers bf16 parameters in the first forward. Kernels: NeMo's Transformer Engine GEMMs, "
             "cuDNN fused attention, fused RoPE and cross-entropy (the yaml's apply_rope_fusion, "
             "cross_entropy_loss_fusion), where ours are eager PyTorch's (attention at SDPA's "
             "FlashAttention-2's published H100 speed, cost/flash.py); context parallelism: TE's ring "
             "overlaps its P2P exchange with the attention chunks, torch's all-gathers K/V and passes "
             "fp32 dK/dV round the ring")
NEMO_TP_OVERLAP = "needs async TP with pipelining (NeMo's ub_tp_comm_overlap; refused: pp > 1)"
for gpus, tokens in ((8, 81222), (128, 1280704)):
    ROWS.append(Row(
        f"Llama 3.1 8B CP2 (NeMo), {gpus} GPUs", "dgxc", "dgxc README_8b.md, BF16 table",
        "llama3-8b", "h100-80gb", gpus,
        {"dp": gpus // 2, "cp": 2, "zero_stage": 1, "micro_batches": 32}, 16 * gpus, 8192,
        "none", "tokens", tokens / gpus, extra={"fused_norm": True, "fused_loss": False},
        notes=NEMO_NOTE))
# llama3.1/README_70b.md "Llama 3.1 70b 24.09 BF16 (TP=4, PP=4, CP=2, VP=5, MBS=1, GA=64)": 64x
# H100 (GBS=128) 71235 tokens/s; llama3.1_70b.yaml: sequence_parallel true.
ROWS.append(Row(
    "Llama 3.1 70B TP4 PP4 CP2 VP5 (NeMo), 64 GPUs", "dgxc", "dgxc README_70b.md, BF16 table",
    "llama3-70b", "h100-80gb", 64,
    {"dp": 2, "tp": 4, "pp": 4, "cp": 2, "zero_stage": 1, "schedule": "interleaved_1f1b",
     "virtual_stages": 5, "micro_batches": 64}, 128, 8192, "none", "tokens", 71235 / 64,
    extra={"sequence_parallel": True, "fused_norm": True}, excluded=NEMO_TP_OVERLAP, notes=NEMO_NOTE))
# llama3.1/README_405b.md "Llama 3.1 405b 24.09 BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63)":
# 32x H100 (7 layers, GBS 126, PP 1) 116632 tokens/s; 576x H100 (126 layers, GBS 252, PP 9,
# VP 7) 120022 tokens/s. llama3.1_405b.yaml: sequence_parallel true.
ROWS.append(Row(
    "Llama 3.1 405B proxy, 7 layers, TP8 CP2 (NeMo), 32 GPUs", "dgxc",
    "dgxc README_405b.md, BF16 table", "nemo-405b-7l", "h100-80gb", 32,
    {"dp": 2, "tp": 8, "cp": 2, "zero_stage": 1, "micro_batches": 63}, 126, 8192, "none",
    "tokens", 116632 / 32, extra={"sequence_parallel": True, "fused_norm": True, "async_tp": True},
    notes="NeMo's 405B: 16 query groups (its yaml). " + NEMO_NOTE))
ROWS.append(Row(
    "Llama 3.1 405B TP8 PP9 CP2 VP7 (NeMo), 576 GPUs", "dgxc", "dgxc README_405b.md, BF16 table",
    "nemo-405b", "h100-80gb", 576,
    {"dp": 4, "tp": 8, "pp": 9, "cp": 2, "zero_stage": 1, "schedule": "interleaved_1f1b",
     "virtual_stages": 7, "micro_batches": 63}, 252, 8192, "none", "tokens", 120022 / 576,
    extra={"sequence_parallel": True, "fused_norm": True}, excluded=NEMO_TP_OVERLAP,
    notes="NeMo's 405B: 16 query groups (its yaml). " + NEMO_NOTE))
# nemo_megatron/README_175b.md "NeMo Megatron 24.11 BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)":
# 128x H100 GPUs (GBS=256) 58843 tokens/s (8.91 s/step); gpt3_175b_hydra.yaml: sequence_parallel
# true.
ROWS.append(Row(
    "GPT-3 175B TP4 PP8 VP12 (NeMo), 128 GPUs", "dgxc", "dgxc README_175b.md, BF16 table",
    "gpt3-175b", "h100-80gb", 128,
    {"dp": 4, "tp": 4, "pp": 8, "zero_stage": 1, "schedule": "interleaved_1f1b",
     "virtual_stages": 12, "micro_batches": 64}, 256, 2048, "none", "tokens", 58843 / 128,
    extra={"sequence_parallel": True, "fused_loss": False}))


# What the furthest rows are made of, from the Cost breakdowns (the what-ifs are one-off
# evaluations, not in the table). Rows by their place in ROWS.
DIAGNOSED = ("2026-12-06, with Megatron-LM's 2021 attention, torchtitan's selective recompute, "
             "one reduce-scatter per pipelined step, loss_parallel on the last pipeline stage and "
             "2-8 chunks per rank tried for interleaving; 2026-12-07, float8 and async TP pinned off "
             "unless the source ran them, FSDP's float8 all-gathers in 1 byte; pipeline sends priced per "
             "cut, the float8 weight cast on FSDP's shard")
KNOWN = [
    "Megatron-LM's rows cost attention as Megatron ran it in 2021 (Megatron2021Attention: the "
    "s x s scores written by a GEMM, read and written by a fused 16-bit softmax and a dropout). "
    "Costed with the flash attention our runtime runs instead, #1 and #2 were +30 % and +20 %: "
    "attention's memory-bound traffic (a x s elements per token against 24 h^2 / t FLOPs of "
    "GEMMs) is what shrinks from hidden 2304 to 6144, not the GEMMs' efficiency. What is left "
    "at TP 8 (#4-#6, -11 to -16 %): the ops outside the split regions, which every TP rank runs "
    "whole without sequence parallelism (two layer norms, two dropouts, two residual adds), at "
    "autocast's float32 residual stream and with a cast before each Linear: 58 bytes per "
    "hidden element and token per layer (#4: 3.2 s of its 11.1 s step is memory-bound, 76 % of "
    "those bytes in these ops), "
    "where Megatron's fp16 model with its fused bias + dropout + add moves about 22.",
    "#32-#34 (torchtitan's 405B 2D): the bf16 row was planned with the planner's Float8 and async "
    "TP (unpinned), hence +40 % and its Float8 twin predicted slower than it; every row now pins "
    "both off unless its source ran them (NeMo's BF16 rows too). FSDP gathers tensorwise float8 "
    "weights in 1 byte (torchao's enable_fsdp_float8_all_gather, in the 405B toml): #33's "
    "exposed communication 5.66 -> 4.04 s. Its weight cast is then the shard's, once per "
    "all-gather (fsdp_pre_all_gather; the Linear finds the weight cast): #33 -12 -> -10 %, "
    "#34 -6 -> -3 %.",
    "#41-#42, #44 (NeMo, BF16; the planner had given them Float8 too): the 8B's compute alone "
    "is 15.62 s against the 12.91 s NeMo measured per step (17.44 s while ZeRO-1 ran autocast "
    "over float32 parameters: its weight casts every micro-batch). Then, costed at "
    "FlashAttention-3's 75 % of peak forward (Shah et al. 2024: 740 TFLOP/s) instead of the "
    "0.448 then measured here with SDPA's FlashAttention-2, #41 was -24 % (from -31 %): NeMo's "
    "kernels (Transformer Engine, cuDNN attention, fused RoPE and cross-entropy) are a runtime "
    "difference, not costed. #44 (TP 8, CP 2) has 1.49 s of torch's ring send-recv exposed "
    "(fp32 dK/dV) where TE's ring overlaps its exchange. #43 and #45 overlap their TP "
    "communication (ub_tp_comm_overlap) with pipelining: excluded, as torchtitan's async-TP "
    "rows with pipelining are.",
    "#9 (529.6B): under our runtime its most frugal candidate needs 152 GiB (rank 31: 42.8 GiB of "
    "input gradients sent back, each held until its peer has received it (runtime/pp.py's Sends), "
    "a 36.2 GiB allocator margin for full recompute); on a card just that large only v = 2 fits, and 105 "
    "layers on 35 x 2 chunks leave the busiest rank 4 layers where the mean is 3 (compute 65.0 s). "
    "v = 3, one layer per chunk, pinned: 144.6 TFLOP/s (-11 %, compute 51.2 s) but 159 GiB. The "
    "-29 % is the bench's card-sizing rule picking among layouts that all overflow 80 GB, not a "
    "cost term; the rest of v = 3's gap: DDP's all-reduce after the last backward (3.3 s exposed) "
    "and its fp32 pipeline sends (autocast's residual stream, where Megatron sends fp16 and "
    "scatters/gathers over its TP ranks).",
    "#11-#12 (Llama 3): exposed communication was 2.70 / 1.16 s. Of #11's, 0.86 s was pipeline "
    "sends (0.46) and their contention (0.40), every send priced at the largest cut: the one after"
    " the embedding, whose rowwise output our runtime keeps replicated (planner.styles: the "
    "sequence is cut inside the first block), 8 x a block's SP shard. Priced per cut it is 0.20 s "
    "and the planner takes v = 8: -11 -> -5 %. What is left, per step: TP's SP all-gathers and "
    "reduce-scatters, 4 + 4 of 268 MB per layer per micro-batch on NVLink, 1.45 / 0.73 s, on the "
    "critical path as eager torch runs them (overlap_tp = 0); the ZeRO-2 reduce-scatter, fp32 over"
    " 64 / 128 ranks on one 400 Gb/s adapter each, 0.31 / 0.32 s, exposed since torch's "
    "PipelineStage issues each stage's after its last backward (perform_reduce_grad) and FSDP's "
    "final callback makes the compute stream wait on it; its all-gather, once a step, mostly "
    "hidden. #12 (-13 %): on the card just large enough for its most frugal candidate (158 GiB) "
    "only v = 4 fits (bubble 1.38 s); pinned, v = 6 predicts -8 % (159 GiB) and v = 8 -5 % (160 "
    "GiB): the card-sizing rule, not a cost term. Meta's V, N and balanced end stages are not "
    "published or pinnable. Memory: saved activations far beyond 80 GB where Meta trained 8K "
    "sequences without recompute.",
    "Memory: our ZeRO-1 is Megatron's distributed optimizer on FSDP2 (bf16 parameters 15.0 GiB "
    "and float32 gradients 29.9 GiB whole for the 8B, #41-#42, the float32 parameters and "
    "Adam's moments over dp x cp); what is left over 80 GB is the 8K-token micro-batch's saved "
    "activations (23.1 GiB, no recompute) and the unfused loss. torchtitan's 8B (#14-#18) "
    "reserved 4-15 % more than the predicted peak with its margin (selective recompute runs "
    "torchtitan's policy: when ours kept every matmul output, 10-28 % less); the margin for "
    "selective recompute (5 % + 1 GiB) was measured (2.2 %) under the former policy, which "
    "recomputed no matmul, and the drop from 8 to 128 GPUs is 15.4 GiB published, 11.0 "
    "predicted.",
    "#26-#28 (405B, FSDP 8 x TP 8 x PP 8, full recompute; excluded, FP8 and async TP): with the "
    "last stage's loss on the vocabulary shards, as torchtitan runs it, memory is predicted "
    "+27 % (1F1B, rank 0: 30.1 GiB of FSDP's fp32 unsharded gradients held across micro-batches, "
    "6.9 GiB of them the whole embedding table's, which torch's DTensor embedding backward "
    "leaves whole (Partial) until FSDP reduces it; 26.4 GiB saved activations, 24.4 GiB "
    "allocator margin; +17 % before that term), -4 % (interleaved) and +40 % (#28, the same "
    "layout at 32K) of the published max reserved; the margin under "
    "full recompute (30.5 %) was measured on one H200 with a 1B, the largest term left "
    "unmeasured at this scale. Before, the gathered logits made these +30 % and +42 %. "
    "#27 with the planner's v = 8 (64 chunks of about two layers): +5 % memory, throughput "
    "-17 % (-35 % at v = 2).",
    "Hardware: torchtitan's H100s ran at 500 W with 2.4 TB/s HBM2e (#14-#31: costed at that "
    "bandwidth, the page's figure; at the preset's 3.35 TB/s #14-#18 were +8 to +17 %) or lower "
    "TDP (#32-#34); their FLOP/s are the 700 W SXM preset's (no published figure for the power "
    "cap).",
    "Overlap is not free: each second of communication hidden behind compute costs "
    "Factors.overlap_contention = 0.189 s (arXiv:2507.03114: 18.9 % average compute slowdown "
    "while overlapped), and FSDP2's copies into and out of its collectives' buffers move "
    "2 x 2 bytes per parameter per all-gather and 2 + 4 per reduce-scatter (cost/dp_comm.py). "
    "With them the FSDP rows move 3-6 % slower: #14-#18 come within 7 %; #11 (-7 -> -10 %) and "
    "#40 (-7 -> -11 %) leave the 10 % band.",
]


# --- prediction -----------------------------------------------------------------------------
@dataclass
class Result:
    row: Row
    plan: object = None
    cost: object = None
    refused: str = ""
    fits: bool = True
    need_gib: float | None = None
    predicted: float | None = None
    seconds: float = 0.0

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.row.published - 1

    @property
    def memory_gib(self) -> float | None:
        return None if self.cost is None else self.cost.peak_memory_bytes / GiB

    @property
    def memory_error(self) -> float | None:
        if self.cost is None or self.row.memory_gib is None:
            return None
        return self.memory_gib / self.row.memory_gib - 1

    @property
    def counted(self) -> bool:
        return not self.row.excluded and self.predicted is not None


def source_flops(row: Row, graph=None) -> float:
    """FLOPs of one optimizer step by Megatron-LM's eq. (3) (recomputation included)."""
    if row.metric != "tflops_eq3":
        raise ValueError(f"{row.metric!r}: eq. (3) counts the tflops_eq3 rows only")
    cfg, _ = MODELS[row.model]
    B, s = row.global_batch, row.seq
    L, h, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def predicted_tflops(row: Row, cost) -> float:
    """Predicted TFLOP/s per GPU as the row's source counts FLOPs: eq. (3), or PaLM's 6N + 12LHQT
    per token (App. B), which is the model FLOPs the product's MFU counts
    (``cost.model_tflops_per_gpu``: ``autopar_nb.cost.time.MFU_BASIS``)."""
    if row.metric == "tflops_palm":
        return cost.model_tflops_per_gpu
    return source_flops(row) / (row.gpus * cost.step_time_s) / 1e12


def cluster_for(row: Row, memory_gib: float | None = None):
    gpn = min(8, row.gpus)
    if memory_gib is None and row.card_gb:
        memory_gib = row.card_gb * 1e9 / GiB
    cluster = ap.Cluster.preset(row.preset, row.gpus // gpn, gpn, memory_gb=memory_gib)
    if row.hbm_tbs is None:
        return cluster
    device = dataclasses.replace(cluster.device, hbm_bandwidth=row.hbm_tbs * 1e12)
    return dataclasses.replace(cluster, device=device)


def predict(row: Row, graph) -> Result:
    t0 = time.perf_counter()
    res = Result(row)
    cluster = cluster_for(row)
    kw = dict(global_batch=row.global_batch, fix=row.fix,
              seq_len=row.seq if row.seq != graph.seq_len else None)
    try:
        plan = ap.plan(graph, cluster, **kw)
    except ap.PlanError as e:
        msg = " ".join(str(e).split())
        need = re.search(r"needs ([0-9.]+) GiB", msg)
        if not msg.startswith("nothing fits") or need is None:
            res.refused, res.seconds = msg, time.perf_counter() - t0
            return res
        # the published run fit its card, ours does not: plan on a card just large enough for the
        # planner's most frugal candidate (what it would run given that memory), cost on the real
        res.fits, res.need_gib = False, float(need.group(1))
        try:
            plan = ap.plan(graph, cluster_for(row, res.need_gib * 1.005 + 0.2), **kw)  # "307 GiB": 3 digits
        except ap.PlanError as e2:
            res.refused = "no plan on a larger card either: " + " ".join(str(e2).split())
            res.seconds = time.perf_counter() - t0
            return res
    res.plan = plan
    res.cost = cost = estimate(graph, cluster, plan)
    res.predicted = (cost.tokens_per_s / row.gpus if row.metric == "tokens" else
                     predicted_tflops(row, cost))
    res.seconds = time.perf_counter() - t0
    return res


_GRAPHS: dict[str, object] = {}


def graph_of(key: str):
    """The captured graph of a model, once per process (rows share models)."""
    if key not in _GRAPHS:
        t0 = time.perf_counter()
        _GRAPHS[key] = ap.capture(*build(key))
        print(f"  captured {key} in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    return _GRAPHS[key]


def run(rows: list[Row]) -> list[Result]:
    out = []
    for row in rows:
        res = predict(row, graph_of(row.model))
        out.append(res)
        print(f"{row.name}: {status(res)} ({res.seconds:.1f} s)", file=sys.stderr, flush=True)
    return out


# --- report ---------------------------------------------------------------------------------
def chose(res: Result) -> str:
    """What the planner chose that the row does not pin (and the pinned schedule's shape)."""
    p, fix = res.plan, res.row.fix
    if p is None:
        return ""
    bits = []
    if p.mesh.pp > 1:
        v = p.pipeline.virtual_stages
        bits.append(p.pipeline.schedule + (f" v{v}" if v > 1 else "")
                    + f", {p.batch.micro_batches} mb")
    elif "micro_batches" not in fix and p.batch.micro_batches > 1:
        bits.append(f"{p.batch.micro_batches} mb")
    if "sequence_parallel" not in fix and p.mesh.tp > 1:
        bits.append("SP" if any(lp.sequence_parallel for lp in p.layers) else "no SP")
    for key, on in (("compile", any(lp.compile for lp in p.layers)), ("float8", p.precision.float8 != "none"),
                    ("async_tp", bool(p.async_tp)),
                    ("fused_loss", bool(p.fused_loss)), ("fused_norm", p.fused_norm)):
        if key not in fix and on:
            bits.append(key.replace("_", " "))
    return ", ".join(bits)


def layout(row: Row) -> str:
    lay = row.layout
    s = " ".join(f"{k}{lay[k]}" for k in ("dp", "tp", "pp", "cp") if lay.get(k, 1) > 1) or "dp1"
    s += f" Z{lay.get('zero_stage', '?')}"
    if "schedule" in lay:
        s += " " + lay["schedule"].replace("interleaved_1f1b", "interleaved")
    if "virtual_stages" in lay:
        s += f" v{lay['virtual_stages']}"
    if "micro_batches" in lay:
        s += f" mb{lay['micro_batches']}"
    return s + f", B {row.global_batch}, s {row.seq}, AC {row.recompute}"


def breakdown(res: Result) -> str:
    """The predicted step in its terms (seconds), the largest exposed collective named."""
    c = res.cost
    if c is None:
        return ""
    kinds = sorted(c.comm_exposed_by_kind.items(), key=lambda kv: -kv[1])
    top = (f" ({kinds[0][0].replace('_', '-')} {kinds[0][1]:.2f})"
           if kinds and kinds[0][1] > 0.005 else "")
    return (f"{c.step_time_s:.2f} = {c.compute_s:.2f} + {c.comm_exposed_s:.2f}{top} + "
            f"{c.bubble_s:.2f}" + (f" + {c.optimizer_s:.2f}" if c.optimizer_s >= 0.005 else "")
            + (f" + {c.cpu_wait_s:.2f} (CPU)" if c.cpu_wait_s >= 0.005 else ""))


def memory_terms(res: Result, n: int = 3) -> str:
    """The peak rank's largest terms (GiB): what its memory is made of."""
    c = res.cost
    if c is None:
        return ""
    rank = max(range(len(c.memory_by_rank)), key=lambda r: c.memory_by_rank[r].total)
    mb = c.memory_by_rank[rank]
    parts = {"params": mb.params, "grads": mb.grads, "optimizer": mb.optimizer,
             "margin": mb.margin, **{k.replace("_", " "): v for k, v in mb.terms.items()}}
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:n]
    where = f"rank {rank}: " if len(c.memory_by_rank) > 1 else ""
    return where + ", ".join(f"{k} {v / GiB:.1f}" for k, v in top)


def verdict(res: Result) -> str:
    """counted, or why not (excluded, refused), and whether the layout fits its card."""
    row, bits = res.row, []
    if row.excluded:
        bits.append(f"excluded: {row.excluded}")
    if res.refused:
        bits.append(f"refused: {res.refused}")
    elif not res.fits:
        limit = cluster_for(row).rank_memory_bytes / GiB
        bits.append(f"does not fit: the planner's most frugal candidate needs "
                    f"{res.need_gib:.1f} of {limit:.1f} GiB")
    return "; ".join(bits) or "counted"


def status(res: Result) -> str:
    text = verdict(res)
    if res.predicted is not None:
        text += f"; {res.predicted:.0f} vs {res.row.published:g} ({res.error:+.0%})"
    return text


UNIT = {"tflops_eq3": "TFLOP/s (eq. 3)", "tflops_palm": "TFLOP/s (6N+12LHQT)",
        "tokens": "tokens/s"}


def fmt(x, spec=".0f", pct=False) -> str:
    if x is None:
        return "—"
    return f"{x:+.0%}" if pct else format(x, spec)


def markdown(results: list[Result]) -> str:
    cols = ["#", "run", "source", "GPUs", "published layout", "planner's choice", "metric / GPU",
            "published", "predicted", "error", "memory GiB published", "predicted", "error",
            "step s = compute + exposed comm + bubble (+ optimizer) (+ waiting for the CPU)",
            "peak rank's largest terms (GiB)", "status"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, r in enumerate(results, 1):
        row = r.row
        card = ", ".join(([f"{row.card_gb:g} GB"] if row.card_gb else [])
                         + ([f"{row.hbm_tbs:g} TB/s"] if row.hbm_tbs else []))
        gpus = f"{row.gpus} x {row.preset}" + (f" ({card})" if card else "")
        mem = r.memory_gib if row.memory_gib is not None else None
        cells = [str(i), row.name, row.where, gpus, layout(row), chose(r), UNIT[row.metric],
                 f"{row.published:.6g}", fmt(r.predicted), fmt(r.error, pct=True),
                 fmt(row.memory_gib, ".1f"), fmt(mem, ".1f"), fmt(r.memory_error, pct=True),
                 breakdown(r), memory_terms(r), verdict(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(results: list[Result]) -> str:
    """The rows' notes, one line per run of consecutive rows with the same note."""
    runs: list[list] = []  # [first, last, note]
    for i, r in enumerate(results, 1):
        if runs and runs[-1][2] == r.row.notes and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, r.row.notes])
    return "\n".join(f"- #{a}" + (f"–#{b}" if b > a else "") + f": {n}" for a, b, n in runs if n)


def summary(results: list[Result]) -> str:
    counted = [r for r in results if r.counted]
    errs = [abs(r.error) for r in counted]
    mems = [abs(r.memory_error) for r in counted if r.memory_error is not None]
    refused = sum(bool(r.refused) for r in results)
    excluded = sum(bool(r.row.excluded) for r in results)
    nofit = sum(not r.fits for r in counted)
    sources = len({r.row.source for r in results})

    def within(xs, lim):
        return sum(x <= lim for x in xs)

    both = sum(bool(r.refused and r.row.excluded) for r in results)
    s = (f"{len(results)} published runs from {sources} sources: {len(counted)} counted, "
         f"{excluded} excluded (Float8 / async TP with pipelining), {refused} refused by the planner"
         + (f" ({both} of them also excluded)" if both else ""))
    if errs:
        fast = sum(r.error > 0 for r in counted)
        s += (f". Throughput: {within(errs, 0.10)} of {len(counted)} within 10 % "
              f"({within(errs, 0.20)} within 20 %), median |error| {statistics.median(errs):.0%} "
              f"({fast} predicted faster than measured, {len(counted) - fast} slower)")
    if mems:
        s += (f"; per-GPU memory where published: {within(mems, 0.10)} of {len(mems)} within "
              f"10 %, median |error| {statistics.median(mems):.0%}")
    if nofit:
        s += (f"; {nofit} counted runs do not fit their card under our runtime (costed as "
              "planned on a larger one)")
    return s + "."


def tree() -> str:
    """The measured tree: this checkout's commit, marked when autopar_nb/ has uncommitted
    changes (others edit the cost model in the same checkout)."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "an unversioned copy"
    dirty = git("status", "--porcelain", "--", "autopar_nb")
    return f"commit {head}" + (" with uncommitted changes under autopar_nb/" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f'replace "## {SECTION}"')
    parser.add_argument("--tree", default="", help="what tree is measured, for the write-up "
                        "(default: this checkout's commit)")
    parser.add_argument("--only", default="",
                        help="comma-separated source keys: " + ", ".join(SOURCES))
    args = parser.parse_args()
    rows = [r for r in ROWS if not args.only or r.source in args.only.split(",")]
    t0, load0 = time.time(), os.getloadavg()[0]
    results = run(rows)
    table, summ = markdown(results), summary(results)
    print(table, "", summ, "", notes(results), sep="\n")
    if not args.write:
        return
    from capture import write_section

    skip = {"--write", "--tree", args.tree}
    cmd = shlex.join(["bench/published.py", *(a for a in sys.argv[1:] if a not in skip)])
    cites = "\n".join(f"- **{k}**: {v}" for k, v in SOURCES.items()
                      if any(r.source == k for r in rows))
    body = (
        f"## {SECTION}\n\n`.venv/bin/python {cmd}` at {args.tree or tree()} — "
        f"{datetime.date.today()}, "
        f"{platform.machine()} CPU container (2 cores, shared; load average {load0:.1f} at the "
        f"start), torch {torch.__version__}, {(time.time() - t0) / 60:.1f} min with the "
        "captures. Each published run: its model captured on the meta device at full depth, "
        "planned with the published layout pinned (`fix`), what the source does not publish "
        "left to the planner (its choice shown), costed by `autopar_nb.cost.estimate` on the "
        "preset of the published hardware. Error = predicted / published − 1 (+: predicted "
        "faster, or larger, than measured). TFLOP/s rows turn the predicted step time into the "
        "source's own FLOP count (Megatron-LM eq. 3, recomputation included; 6N + 12LHQT for "
        "Llama 3, whose MFU cites PaLM: the count of the widget's MFU, " + MFU_BASIS + "), so no "
        "FLOP-counting convention enters. Memory: "
        "predicted peak with its allocator margin against torchtitan's max reserved. Rows that "
        "used Float8 or asynchronous TP are planned with them (tensorwise float8, the recipe of the "
        "time); rows that need them with pipelining, which the planner refuses, are costed in "
        "bf16, marked excluded and left out of the summary; a refused layout keeps the "
        "planner's reason; a layout that does not fit its card under our runtime is costed as "
        "planned on a card just large enough. Sources "
        "(each row's table in its source column; the quoted text beside each row in "
        f"`bench/published.py`):\n\n{cites}\n\n**{summ}**\n\n{table}\n\nNotes by row:\n\n"
        f"{notes(results)}\n"
        + ("" if args.only else f"\nWhat the furthest rows are made of (diagnosed {DIAGNOSED}, "
           "rows numbered as in the full table):\n\n" + "\n".join(f"- {k}" for k in KNOWN)
           + "\n"))
    write_section(SECTION, body, ROOT / "BENCHMARKS.md")


if __name__ == "__main__":
    main()
