"""The MFU the widget shows for notebooks/02_llm.ipynb's LLaMA-2 7B on 8 H100s, taken apart, and set
beside published MFU of its class measured on 8 H100 80GB (SXM, HBM3: the h100-80gb preset).

1. The 02_llm plan (``--batch 64``, seq 4096) and the same model pinned to other layouts: what moves
   its MFU (recompute, ZeRO stage and pipeline, the HBM bandwidth of torchtitan's 2.4 TB/s cards).
   Each line: the step's decomposition by ``autopar_nb.cost.estimate`` and the MFU the widget shows.
2. MosaicML llm-foundry's benchmark table (scripts/train/benchmarking/README.md @061f2c7, "H100
   80GB BF16"; FSDP FULL_SHARD, amp_bf16, flash attention; MFU = (6N + 12LHQT) x tokens/s over
   989 TFLOP/s, its "MFU" section), each row pinned to its model, sequence, micro-batch, gradient
   accumulation, global batch and activation checkpointing (full where "True"); beside them
   02_llm's 70B plan (64 GPUs). MPT has GPT's
   shape (LayerNorm, 4h GELU MLP, tied embeddings, no biases, ALiBi): captured as zoo.GPT without
   biases, vocabulary 50368. Its model FLOPs per token are the product's (``MFU_BASIS``). A row
   whose pinned layout does not fit under our runtime is planned on a larger card (as
   ``bench/published.py`` does) and costed on the real one.

    .venv/bin/python bench/mfu.py
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar_nb as ap  # noqa: E402
from autopar_nb import zoo  # noqa: E402
from autopar_nb.cost.estimate import estimate  # noqa: E402
from autopar_nb.cost.time import MFU_BASIS  # noqa: E402

LLAMA2_7B = zoo.LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008)
"""02_llm.ipynb's cell"""
EAGER = {"compile": False, "float8": "none"}
"""llm-foundry's runs, the class compared below: bf16, not compiled"""
LAYOUTS = [
    ("02_llm as planned", None, None),
    ("02_llm's plan at 2.4 TB/s HBM (torchtitan's cards)", None, 2.4e12),
    ("02_llm planned eager bf16 (compile off, float8 none)", EAGER, None),
    ("dp8 ZeRO-2, no recompute, eager bf16", {"dp": 8, "zero_stage": 2, "recompute": "none", **EAGER}, None),
    ("dp8 ZeRO-3, no recompute, eager bf16", {"dp": 8, "zero_stage": 3, "recompute": "none", **EAGER}, None),
    ("dp8 ZeRO-3, selective recompute, eager bf16 (torchtitan's 8B)",
     {"dp": 8, "zero_stage": 3, "recompute": "selective", **EAGER}, None),
    ("dp8 ZeRO-3, full recompute, eager bf16", {"dp": 8, "zero_stage": 3, "recompute": "full", **EAGER}, None),
]
"""(what, fix, HBM bytes/s in place of the preset's) for 02_llm's 7B, batch 64, seq 4096"""

# llm-foundry "H100 80GB BF16": (model, hidden, layers, heads, seq, GPUs, micro-batch, grad accum, global batch,
# activation checkpointing, published MFU %)
FOUNDRY = [
    ("7b", 4096, 32, 32, 2048, 8, 6, 1, 48, False, 46.44),
    ("7b", 4096, 32, 32, 4096, 8, 16, 2, 256, True, 40.42),
    ("13b", 5120, 40, 40, 2048, 8, 2, 1, 16, False, 39.79),
    ("3b", 2560, 32, 20, 4096, 8, 5, 6, 240, False, 42.31),
    ("1b", 2048, 24, 16, 2048, 8, 14, 1, 112, False, 41.82),
    ("30b", 7168, 48, 56, 2048, 8, 3, 21, 504, True, 38.11),
    ("70b", 8192, 80, 64, 2048, 64, 8, 4, 2048, True, 42.57),
]
FOUNDRY_VOCAB = 50368


def h100(hbm: float | None = None, memory_gb: float | None = None, gpus: int = 8) -> ap.Cluster:
    cluster = ap.Cluster.preset("h100-80gb", gpus // 8, 8, memory_gb=memory_gb)
    if hbm is None:
        return cluster
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, hbm_bandwidth=hbm))


def line(what: str, plan, cost, gpus: int = 8) -> str:
    c = cost
    return (f"| {what} | {plan.summary().split(' | ')[0]} | {c.step_time_s:.3f} = {c.compute_s:.3f} + "
            f"{c.comm_exposed_s:.3f} + {c.bubble_s:.3f} + {c.optimizer_s:.3f} + {c.cpu_wait_s:.3f} | "
            f"{c.tokens_per_s / gpus:,.0f} | {c.mfu:.1%} |")


def llama_7b() -> list[str]:
    with torch.device("meta"):
        model = zoo.Llama(LLAMA2_7B)
    graph = ap.capture(model, (torch.randint(0, 32000, (1, 4096)),))
    out = ["| 02_llm model and layout | plan | step s = compute + exposed comm + bubble + optimizer + CPU wait | "
           "tokens/s/GPU | MFU |", "|---|---|---|---|---|"]
    chosen = None
    for what, fix, hbm in LAYOUTS:
        plan = chosen if fix is None and chosen is not None else ap.plan(graph, h100(), global_batch=64, fix=fix)
        chosen = chosen or plan
        out.append(line(what, plan, estimate(graph, h100(hbm), plan)))
    return out


def llama_70b() -> list[str]:
    """02_llm's second cell: LLaMA 70B (zoo.LLAMA_70B), 512 x 4096 tokens on 8 x 8 H100s, as planned."""
    with torch.device("meta"):
        model = zoo.Llama(zoo.LLAMA_70B)
    graph = ap.capture(model, (torch.randint(0, zoo.LLAMA_70B.vocab_size, (1, 4096)),))
    out = []
    for what, fix in (("as planned", None), ("planned eager bf16", EAGER)):
        plan = ap.plan(graph, h100(gpus=64), global_batch=512, fix=fix)
        out.append(line(f"02_llm's 70B on 64 x H100, {what}", plan, estimate(graph, h100(gpus=64), plan), 64))
    return out


def foundry() -> list[str]:
    out = ["| llm-foundry row | plan (pinned) | step s = compute + exposed comm + bubble + optimizer + CPU wait | "
           "tokens/s/GPU | MFU predicted | MFU published | error |", "|---|---|---|---|---|---|---|"]
    for name, d, layers, heads, seq, gpus, mb, ga, gbs, ac, published in FOUNDRY:
        cfg = zoo.GPTConfig(vocab_size=FOUNDRY_VOCAB, block_size=seq, n_layer=layers, n_head=heads, n_embd=d,
                            bias=False)
        with torch.device("meta"):
            model = zoo.GPT(cfg)
        graph = ap.capture(model, (torch.randint(0, FOUNDRY_VOCAB, (1, seq)),))
        fix = {"dp": gpus, "zero_stage": 3, "recompute": "full" if ac else "none", "micro_batches": ga,
               "compile": False, "fused_loss": False, "fused_norm": False, "float8": "none",
               "offload": "none"}
        fits = ""
        try:
            plan = ap.plan(graph, h100(gpus=gpus), global_batch=gbs, fix=fix)
        except ap.PlanError:
            plan = ap.plan(graph, h100(memory_gb=400, gpus=gpus), global_batch=gbs, fix=fix)
            fits = " (does not fit 80 GB here)"
        cost = estimate(graph, h100(gpus=gpus), plan)
        what = f"MPT-{name}, {gpus} GPUs, seq {seq}, mb {mb} x {ga}, AC {'full' if ac else 'none'}{fits}"
        out.append(line(what, plan, cost, gpus) + f" {published:.1f}% | {100 * cost.mfu / published - 1:+.0%} |")
    return out


def main() -> None:
    t0, load = time.time(), os.getloadavg()[0]
    print(f"MFU = model FLOPs ({MFU_BASIS}) per GPU per second over the datasheet peak (989.4 TFLOP/s bf16)\n")
    print("\n".join(llama_7b() + llama_70b()), "", "\n".join(foundry()), sep="\n")
    print(f"\n{(time.time() - t0) / 60:.1f} min, load average {load:.1f} at the start", file=sys.stderr)


if __name__ == "__main__":
    main()
