"""DDP or FSDP for a model that fits: the planner's choice and what each costs, as the cost model gives them. For
each case, the planner's plan (nothing fixed), then DDP (ZeRO 0) and ZeRO-2 pinned, at the micro-batches the
planner takes for each and at one micro-batch (whether it fits). The h100-80gb preset, bf16 left to the planner.

    .venv/bin/python bench/ddp_choice.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar_nb as ap  # noqa: E402
from autopar_nb import zoo  # noqa: E402
from autopar_nb.plan import PlanError  # noqa: E402

CASES = [
    ("GPT-2 124M", lambda: zoo.GPT(zoo.GPTConfig()), 50257, 1024, 8),
    ("LLaMA-shaped 1.5B (dim 2048, 16 layers, vocab 128256)",
     lambda: zoo.Llama(zoo.LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192)), 128256,
     2048, 8),
]
"""(what, model, vocabulary, sequence length, sequences per GPU)"""
GPUS = (2, 8)


def line(what: str, graph, cluster, batch: int, fix: dict) -> str:
    try:
        plan = ap.plan(graph, cluster, global_batch=batch, fix=fix)
    except PlanError as e:
        return f"| {what} | {fix or 'planner'} | refused: {str(e).splitlines()[0][:90]} |"
    return f"| {what} | {fix or 'planner'} | {plan.summary()} |"


def main() -> None:
    print("| case | fixed | plan |\n|---|---|---|")
    t0 = time.time()
    for what, build, vocab, seq, per_gpu in CASES:
        with torch.device("meta"):
            model = build()
        graph = ap.capture(model, (torch.randint(0, vocab, (per_gpu, seq), device="meta"),))
        for gpus in GPUS:
            cluster = ap.Cluster.preset("h100-80gb", 1, gpus)
            name = f"{what}, {gpus} GPUs, {per_gpu} x {seq} tokens per GPU"
            for fix in ({}, {"zero_stage": 0, "dp": gpus}, {"zero_stage": 2, "dp": gpus},
                        {"zero_stage": 0, "dp": gpus, "micro_batches": 1}):
                print(line(name, graph, cluster, per_gpu * gpus, fix), flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
