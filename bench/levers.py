"""Each speed lever on notebooks/02_llm.ipynb's plans, as the planner costs it (``plan.levers``: the chosen plan with
one lever flipped alone): its LLaMA-2 7B on 8 H100s (64 x 4096 tokens) and LLaMA 70B on 64 H100s (512 x 4096),
nothing fixed, the h100-80gb preset. A lever the plan cannot take either way (Float8, async TP and compile with
pp > 1; offload below ZeRO 2) is listed with why, from ``explain()``.

    .venv/bin/python bench/levers.py
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
from autopar_nb.planner.lever_costs import NAMES, lever_trade  # noqa: E402

LLAMA2_7B = zoo.LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008)
"""02_llm.ipynb's first cell"""
CASES = [("02_llm's 7B on 8 x H100", LLAMA2_7B, 8, 64), ("02_llm's 70B on 64 x H100", zoo.LLAMA_70B, 64, 512)]
"""(what, model, GPUs, global batch of 4096-token sequences)"""


def rows(what: str, cfg, gpus: int, batch: int) -> list[str]:
    """The plan's line, then one row per lever flipped alone, then the explain() lines of the levers not offered."""
    with torch.device("meta"):
        model = zoo.Llama(cfg)
    graph = ap.capture(model, (torch.randint(0, cfg.vocab_size, (1, 4096)),))
    t0 = time.monotonic()
    plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", gpus // 8, 8), global_batch=batch)
    c = plan.cost
    out = [f"**{what}** ({time.monotonic() - t0:.0f} s to plan): {plan.summary()}", "",
           "| lever | flipped alone | its step | its peak |", "|---|---|---|---|"]
    for lv in plan.levers:
        trade = lever_trade(lv, c.step_time_s, c.peak_memory_bytes)
        out.append(f"| {NAMES[lv.name]} ({'on' if lv.on else 'off'}) | {trade} | {lv.step_time_s * 1e3:.0f} ms | "
                   f"{lv.peak_memory_bytes / 2**30:.1f} GiB |")
    shown = {lv.name for lv in plan.levers}
    out += [""] + [f"- {ln}" for ln in plan.explanation
                   if ln.startswith(("Float8 not offered", "Async TP not offered", "Not compiled"))
                   or ("offload" not in shown and ln.startswith("CPU offload"))]
    return out


def main() -> None:
    for case in CASES:
        print("\n".join(rows(*case)) + "\n", flush=True)


if __name__ == "__main__":
    main()
