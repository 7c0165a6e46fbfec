"""Planning time of ``autopar_nb.plan`` (capture excluded): the seed's MLP on 2 GPUs, LLaMA-3 8B on 64 x H100,
LLaMA 70B on 256 x H100, a 1T GPT (128 layers, hidden 25600, 160 heads, seq 2048) and Hugging Face's LLaMA-3 405B
(``LlamaForCausalLM``, 126 layers, seq 8192, batch 2048 x 8192 tokens as Llama 3 trained it) on 3072 x A100-80GB,
and how the time grows with layers and GPU count.

    .venv/bin/python bench/plan.py            # prints a markdown table
    PYTHONPATH=. .venv/bin/python bench/plan.py --only "GPT 1T"    # the cases whose name contains it
    PYTHONPATH=. .venv/bin/python bench/plan.py --only "GPT 1T" --census    # and where a later plan()'s time goes
    PYTHONPATH=. .venv/bin/python bench/plan.py --only "405B" --cpu    # plan() in CPU seconds (a shared machine)

``--census`` runs one more ``plan()`` of each case with counters around the search's stages (by schedule and chunks
per rank: candidate settings weighed, set aside by the memory floor, costed in full in the search loop or afterwards
for the explanation, fitting) and prints them with the CPU seconds of each stage.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
import warnings

import torch

import autopar_nb as ap
from autopar_nb import zoo
from autopar_nb.cost.estimate import Evaluator
from autopar_nb.planner import search

warnings.filterwarnings("ignore")


def gpt(n_layer, n_embd, n_head, seq, vocab=51200):
    cfg = zoo.GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with torch.device("meta"):
        return zoo.GPT(cfg), torch.randint(0, vocab, (1, seq))


def llama(cfg, seq):
    with torch.device("meta"):
        return zoo.Llama(cfg), torch.randint(0, cfg.vocab_size, (1, seq))


def hf_llama(hidden, ffn, layers, heads, seq, vocab=128256):
    """transformers' ``LlamaForCausalLM`` with 8 KV heads (Llama 3's), on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=8, max_position_embeddings=seq)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg), torch.randint(0, vocab, (1, seq))


CLOCK = time.perf_counter
"""what plan() is timed by: wall seconds, or with ``--cpu`` this process's CPU seconds (``time.process_time``,
which other processes' load on a shared machine inflates far less)"""


def timed(graph, cluster, repeats=5, **kw):
    """Median seconds of ``repeats`` plan() calls (the first call, which profiles the graph, is reported apart)."""
    t0 = CLOCK()
    p = ap.plan(graph, cluster, **kw)
    first = CLOCK() - t0
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        ap.plan(graph, cluster, **kw)
        times.append(CLOCK() - t0)
    return first, statistics.median(times), p


@contextlib.contextmanager
def _counted(owner, name, on_call):
    """``owner.name`` wrapped: ``on_call(args, result, cpu seconds)`` after each call."""
    orig = getattr(owner, name)

    def wrapped(*args, **kw):
        t0 = time.process_time()
        out = orig(*args, **kw)
        on_call(args, out, time.process_time() - t0)
        return out

    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def census(graph, cluster, **kw) -> str:
    """One ``plan()`` with counters around the search's stages: per (schedule, chunks per rank), the candidate
    settings whose memory floor was weighed, those it set aside (cannot fit), those costed in full in the search
    loop and afterwards (``Search._settle``: the explanation's faster candidate that does not fit), and those that
    fit; then the CPU seconds of each stage. Nested stages' seconds are inside their callers'."""
    rows = collections.defaultdict(collections.Counter)
    cpu = collections.Counter()
    made: list = []
    settling = [False]

    def floor(args, out, dt):
        ev, s, _ = args[:3]
        key = s.schedule, s.virtual_stages
        rows[key]["floored"] += 1
        rows[key]["set aside"] += out > search.memory_limit(cluster)
        cpu["memory floors"] += dt

    def variants(args, cand, dt):
        key = cand.setting.schedule, cand.setting.virtual_stages
        rows[key]["costed after" if settling[0] else "costed in loop"] += 1
        rows[key]["fit"] += cand.fits
        cpu["costing after (_settle)" if settling[0] else "costing in loop (_variants)"] += dt

    def evaluate(args, out, dt):
        cpu["Evaluator.evaluate"] += dt
        cpu["evaluations (count)"] += 1

    def settle_start(*args):
        settling[0] = True
        try:
            return orig_settle(*args)
        finally:
            settling[0] = False

    orig_settle = search.Search._settle
    with contextlib.ExitStack() as stack:
        stack.enter_context(_counted(search, "memory_floor", floor))
        stack.enter_context(_counted(search.Search, "_variants", variants))
        stack.enter_context(_counted(Evaluator, "evaluate", evaluate))
        stack.enter_context(_counted(search.Search, "__init__", lambda args, out, dt: made.append(args[0])))
        search.Search._settle = settle_start
        stack.callback(setattr, search.Search, "_settle", orig_settle)
        t0 = time.process_time()
        ap.plan(graph, cluster, **kw)
        total = time.process_time() - t0
    cols = ("floored", "set aside", "costed in loop", "costed after", "fit")
    lines = ["| schedule, chunks per rank | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key in sorted(rows):
        lines.append(f"| {key[0]} x{key[1]} | " + " | ".join(str(rows[key][c]) for c in cols) + " |")
    pruned = sum(s.pruned for s in made)
    lines.append(f"\nconfigurations pruned by the step-time bound: {pruned}; CPU s of plan(): {total:.3f}")
    lines += [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in cpu.items()]
    return "\n".join(lines)


def _cell(p) -> str:
    return p.summary().replace(" | ", "; ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="the cases whose name contains this (the GPU-count rows: '8B, ')")
    parser.add_argument("--census", action="store_true", help="then one more plan() of each case with counters")
    parser.add_argument("--cpu", action="store_true", help="time plan() in CPU seconds of this process, not wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu else time.perf_counter
    only = args.only
    rows = []

    def case(name, model_inputs, cluster, **kw):
        if only and only not in name:
            return None
        model, inputs = model_inputs() if callable(model_inputs) else model_inputs  # built only if asked for
        t0 = time.perf_counter()
        g = ap.capture(model, inputs)
        cap = time.perf_counter() - t0
        first, med, p = timed(g, cluster, **kw)
        rows.append((name, f"{cluster.world_size}", f"{cap:.2f}", f"{first:.3f}", f"{med:.3f}", _cell(p)))
        print(f"{name}: first {first:.3f} s, median {med:.3f} s -> {p.summary()}", file=sys.stderr)
        if args.census:
            print(f"census of a later plan() of {name}:\n{census(g, cluster, **kw)}\n", file=sys.stderr)
        return g

    with torch.device("meta"):
        seed = zoo.SeedMLP()
    case("seed MLP", (seed, torch.randn(32, 1024)), ap.Cluster.preset("h100-80gb", 1, 2))
    case("LLaMA-3 8B, seq 8192", llama(zoo.LLAMA3_8B, 8192), ap.Cluster.preset("h100-80gb", 8, 8), global_batch=256)
    case("LLaMA 70B, seq 4096", llama(zoo.LLAMA_70B, 4096), ap.Cluster.preset("h100-80gb", 32, 8),
         global_batch=512)
    case("GPT 1T (128 x 25600, 160 heads), seq 2048", gpt(128, 25600, 160, 2048),
         ap.Cluster.preset("a100-80gb", 384, 8), global_batch=1536)
    # Llama 3 (arXiv 2407.21783, Table 4): 405B at 8K sequence, 16M tokens a step
    case("Hugging Face LLaMA-3 405B (126 x 16384), seq 8192", (lambda: hf_llama(16384, 53248, 126, 128, 8192)),
         ap.Cluster.preset("a100-80gb", 384, 8), global_batch=2048)
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

    unit = "CPU s" if args.cpu else "s"
    print(f"| case | GPUs | capture s | plan {unit} (first) | plan {unit} (median of 5) | chosen plan |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
