"""StarCoder-15B (GPTBigCode, multi-query attention with a fused ``c_attn``) planned at tp=8 on 8 H100s: the chosen
step time and peak, and how ``explain()`` lays out ``c_attn``, at two sequence lengths.

Run: .venv/bin/python bench/starcoder_tp.py      (captured on the meta device: no weights; about 35 s a length)
Gives the GPTBigCode figures of BENCHMARKS.md's "## Models people bring".
"""

from __future__ import annotations

import time

import torch
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

import autopar_nb as ap

# StarCoder's published shape (bigcode/starcoder config.json): 15.5 B parameters, 48 query heads, one key/value head
CONFIG = dict(vocab_size=49152, n_positions=8192, n_embd=6144, n_layer=40, n_head=48, n_inner=24576)


def main() -> None:
    with torch.device("meta"):
        model = GPTBigCodeForCausalLM(GPTBigCodeConfig(**CONFIG))
    for seq in (2048, 8192):
        t0 = time.time()
        graph = ap.capture(model, (torch.randint(0, CONFIG["vocab_size"], (1, seq), device="meta"),))
        plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", gpus_per_node=8), fix={"tp": 8, "pp": 1})
        c = plan.cost
        print(f"T={seq}: {c.step_time_s * 1e3:.0f} ms/step, peak {c.peak_memory_bytes / 2**30:.1f} GiB, "
              f"c_attn parts {plan.tp_parts.get('transformer.h.1.attn.c_attn')} ({time.time() - t0:.0f} s)")
        print("  " + next(x for x in plan.explanation if "c_attn" in x and x.startswith("Fused")))


if __name__ == "__main__":
    main()
