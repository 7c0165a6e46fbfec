"""Planning time of ``autopar_nb.plan`` (capture excluded): the seed's MLP on 2 GPUs, LLaMA-3 8B on 64 x H100,
LLaMA 70B on 256 x H100, a 1T GPT (128 layers, hidden 25600, 160 heads, seq 2048) on 3072 x A100-80GB, and how the
time grows with layers and GPU count.

    .venv/bin/python bench/plan.py            # prints a markdown table
    PYTHONPATH=. .venv/bin/python bench/plan.py --only "GPT 1T"    # the cases whose name contains it
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

import autopar_nb as ap
from autopar_nb import zoo

warnings.filterwarnings("ignore")


def gpt(n_layer, n_embd, n_head, seq, vocab=51200):
    cfg = zoo.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with torch.device("meta"):
        return zoo.GPT(cfg), torch.randint(0, vocab, (1, seq))


def llama(cfg, seq):
    with torch.device("meta"):
        return zoo.Llama(cfg), torch.randint(0, cfg.vocab_size, (1, seq))


def timed(graph, cluster, repeats=5, **kw):
    """Median seconds of ``repeats`` plan() calls (the first call, which profiles the graph, is reported apart)."""
    t0 = time.perf_counter()
    p = ap.plan(graph, cluster, **kw)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ap.plan(graph, cluster, **kw)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), p


def _cell(p) -> str:
    return p.summary().replace(" | ", "; ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="the cases whose name contains this (the GPU-count rows: '8B, ')")
    only = parser.parse_args().only
    rows = []

    def case(name, model_inputs, cluster, **kw):
        if only and only not in name:
            return None
        model, inputs = model_inputs
        t0 = time.perf_counter()
        g = ap.capture(model, inputs)
        cap = time.perf_counter() - t0
        first, med, p = timed(g, cluster, **kw)
        rows.append((name, f"{cluster.world_size}", f"{cap:.2f}", f"{first:.3f}", f"{med:.3f}", _cell(p)))
        print(f"{name}: first {first:.3f} s, median {med:.3f} s -> {p.summary()}", file=sys.stderr)
        return g

    with torch.device("meta"):
        seed = zoo.SeedMLP()
    case("seed MLP", (seed, torch.randn(32, 1024)), ap.Cluster.preset("h100-80gb", 1, 2))
    case("LLaMA-3 8B, seq 8192", llama(zoo.LLAMA3_8B, 8192), ap.Cluster.preset("h100-80gb", 8, 8), global_batch=256)
    case("LLaMA 70B, seq 4096", llama(zoo.LLAMA_70B, 4096), ap.Cluster.preset("h100-80gb", 32, 8),
         global_batch=512)
    case("GPT 1T (128 x 25600, 160 heads), seq 2048", gpt(128, 25600, 160, 2048),
         ap.Cluster.preset("a100-80gb", 384, 8), global_batch=1536)
    # scaling with layers (GPT, hidden 4096, 32 heads, 64 x H100) and with GPU count (8B LLaMA)
    for n_layer in (8, 32, 128):
        case(f"GPT {n_layer} layers x 4096", gpt(n_layer, 4096, 32, 2048), ap.Cluster.preset("h100-80gb", 8, 8),
             global_batch=512)
    with torch.device("meta"):
        m8 = zoo.Llama(zoo.LLAMA3_8B)
    g8 = ap.capture(m8, torch.randint(0, 128256, (1, 8192))) if not only or only in "LLaMA-3 8B, " else None
    for nodes in (1, 4, 16, 64, 256) if g8 is not None else ():
        c = ap.Cluster.preset("h100-80gb", nodes, 8)
        first, med, p = timed(g8, c, global_batch=2048)
        rows.append((f"LLaMA-3 8B, {nodes * 8} GPUs", f"{nodes * 8}", "-", f"{first:.3f}", f"{med:.3f}", _cell(p)))
        print(f"8B on {nodes * 8}: {med:.3f} s -> {p.summary()}", file=sys.stderr)

    print("| case | GPUs | capture s | plan s (first) | plan s (median of 5) | chosen plan |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
