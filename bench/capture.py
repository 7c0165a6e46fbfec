"""Capture time and peak RSS for GPT/LLaMA shapes on the meta device.

Run: .venv/bin/python bench/capture.py        (each case in a fresh interpreter, so RSS is its own)
Writes the "## Capture" section of BENCHMARKS.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HF_LLAMA = ("LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size={h}, intermediate_size={ff}, "
            "num_hidden_layers={L}, num_attention_heads={a}, num_key_value_heads=8, max_position_embeddings=8192))")
CASES = {
    "GPT-2 124M (12 x 768, seq 1024)": ("GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768))", "50257", 1024),
    "GPT 1.3B (24 x 2048, seq 2048)": ("GPT(GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048))",
                                       "50257", 2048),
    "LLaMA-3 8B (32 x 4096, GQA 32/8, FFN 14336, vocab 128256, seq 8192)": ("Llama(LLAMA3_8B)", "128256", 8192),
    "LLaMA 70B (80 x 8192, GQA 64/8, FFN 28672, seq 8192)": ("Llama(LLAMA_70B)", "128256", 8192),
    # Megatron-LM SC21 Table 1's 1T row (bench/published.py's gpt-128x25600)
    "GPT 1T (128 x 25600, 160 heads, vocab 51200, seq 2048)": (
        "GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=128, n_head=160, n_embd=25600))", "51200", 2048),
    "Hugging Face LLaMA-3 8B (LlamaForCausalLM, 32 layers, seq 8192)": (
        HF_LLAMA.format(h=4096, ff=14336, L=32, a=32), "128256", 8192),
    "Hugging Face LLaMA-3 70B (LlamaForCausalLM, 80 layers, seq 8192)": (
        HF_LLAMA.format(h=8192, ff=28672, L=80, a=64), "128256", 8192),
    "Hugging Face LLaMA-3 405B (LlamaForCausalLM, 126 layers, seq 8192)": (
        HF_LLAMA.format(h=16384, ff=53248, L=126, a=128), "128256", 8192),
}
"""name -> (the model, built on the meta device; the token vocabulary; the sequence length)"""

CHILD = """
import json, resource, sys, time, warnings
import torch
import autopar_nb as ap
from autopar_nb.zoo import GPT, GPTConfig, Llama, LLAMA3_8B, LLAMA_70B
expr, vocab, seq, full = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "full"
if "LlamaForCausalLM" in expr:
    from transformers import LlamaConfig, LlamaForCausalLM
with torch.device("meta"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = eval(expr)
    x = torch.randint(0, vocab, (1, seq))
times = []
for _ in range(1 if full else 3):
    t0 = time.perf_counter()
    g = ap.capture(model, (x,), copy_blocks=not full)
    times.append(time.perf_counter() - t0)
print(json.dumps({"params": g.num_params, "nodes": len(g.nodes), "layers": len(g.layers), "copied": g.copied_layers,
                  "tflop": g.step_flops / 1e12, "first_s": times[0], "best_s": min(times),
                  "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def _run(expr: str, vocab: str, seq: int, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, expr, vocab, str(seq), mode], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Each case copied (the default), and with ``--full`` also traced layer by layer (``copy_blocks=False``)."""
    full = "--full" in sys.argv
    rows = []
    for name, (expr, vocab, seq) in CASES.items():
        r = _run(expr, vocab, seq, "copy")
        r["full_s"] = _run(expr, vocab, seq, "full")["first_s"] if full else None
        rows.append((name, r))
        print(f"{name:<72} {r['params'] / 1e9:7.2f} B params {r['nodes']:5d} ops ({r['copied']} layers copied)  "
              f"first {r['first_s']:.2f} s  best {r['best_s']:.2f} s  peak RSS {r['rss_gib']:.2f} GiB"
              + (f"  full trace {r['full_s']:.2f} s" if full else ""), flush=True)
    table = ["| model | params | ops | layers copied | capture, first call | capture, best of 3 | peak RSS | "
             "full trace (every layer), first call |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| {n} | {r['params'] / 1e9:.2f} B | {r['nodes']} | {r['copied']} of {r['layers']} | "
              f"{r['first_s']:.2f} s | {r['best_s']:.2f} s | {r['rss_gib']:.2f} GiB | "
              f"{_seconds(r['full_s'])} |" for n, r in rows]
    section = "\n".join([
        "## Capture",
        "",
        f"`.venv/bin/python bench/capture.py{' --full' if full else ''}` — {datetime.date.today()}, "
        f"{platform.machine()} CPU container with 2 cores, torch " + _torch_version() + ", load average "
        f"{os.getloadavg()[0]:.1f} when it ended. Each model on the meta device, batch 1, traced with torch.export "
        "in a fresh interpreter (RSS includes the interpreter and torch: ~0.4 GiB). One member of each class of "
        "identical repeated blocks is traced and its ops copied for the others (capture/blocks.py); the last "
        "column traces every layer (`capture(..., copy_blocks=False)`, the graph is the same). Goal: the 405B "
        "and 1T shapes ≤ 2 s, the 8B ≤ 1 s, on an idle machine.",
        "",
        *table,
        "",
    ])
    write_section("Capture", section)


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def _torch_version() -> str:
    import torch

    return torch.__version__


BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def write_section(title: str, body: str, path: Path = BENCHMARKS):
    """Replace the '## title' section of BENCHMARKS.md with body (append it if absent)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEach section: the command, machine, date, figures.\n"
    head = f"## {title}\n"
    if head in text:
        start = text.index(head)
        nxt = text.find("\n## ", start + len(head))
        text = text[:start] + body.rstrip("\n") + "\n" + (text[nxt:] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


if __name__ == "__main__":
    main()
