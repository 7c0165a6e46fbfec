"""Capture time and peak RSS for GPT/LLaMA shapes on the meta device.

Run: .venv/bin/python bench/capture.py        (each case in a fresh interpreter, so RSS is its own)
Writes the "## Capture" section of BENCHMARKS.md.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

CASES = {
    "GPT-2 124M (12 x 768, seq 1024)": ("GPT", "GPTConfig(n_layer=12, n_head=12, n_embd=768)", "50257", 1024),
    "GPT 1.3B (24 x 2048, seq 2048)": ("GPT", "GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048)",
                                       "50257", 2048),
    "LLaMA-3 8B (32 x 4096, GQA 32/8, FFN 14336, vocab 128256, seq 8192)": ("Llama", "LLAMA3_8B", "128256", 8192),
    "LLaMA 70B (80 x 8192, GQA 64/8, FFN 28672, seq 8192)": ("Llama", "LLAMA_70B", "128256", 8192),
}

CHILD = """
import json, resource, sys, time
import torch
import autopar_nb as ap
from autopar_nb.zoo import GPT, GPTConfig, Llama, LLAMA3_8B, LLAMA_70B
cls, cfg, vocab, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with torch.device("meta"):
    model = eval(f"{cls}({cfg})")
    x = torch.randint(0, vocab, (1, seq))
times = []
for _ in range(3):
    t0 = time.perf_counter()
    g = ap.capture(model, (x,))
    times.append(time.perf_counter() - t0)
print(json.dumps({"params": g.num_params, "nodes": len(g.nodes), "layers": len(g.layers),
                  "tflop": g.step_flops / 1e12, "first_s": times[0], "best_s": min(times),
                  "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def main() -> None:
    rows = []
    for name, (cls, cfg, vocab, seq) in CASES.items():
        out = subprocess.run([sys.executable, "-c", CHILD, cls, cfg, vocab, str(seq)], capture_output=True,
                             text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((name, r))
        print(f"{name:<72} {r['params'] / 1e9:7.2f} B params {r['nodes']:5d} ops  first {r['first_s']:.2f} s  "
              f"best {r['best_s']:.2f} s  peak RSS {r['rss_gib']:.2f} GiB")
    table = ["| model | params | ops | capture, first call | capture, best of 3 | peak RSS |",
             "|---|---|---|---|---|---|"]
    table += [f"| {n} | {r['params'] / 1e9:.2f} B | {r['nodes']} | {r['first_s']:.2f} s | {r['best_s']:.2f} s | "
              f"{r['rss_gib']:.2f} GiB |" for n, r in rows]
    section = "\n".join([
        "## Capture",
        "",
        f"`.venv/bin/python bench/capture.py` — {datetime.date.today()}, {platform.machine()} CPU container with "
        "2 cores / 24 GiB, torch " + _torch_version() + ". Each model on the meta device, batch 1, traced with "
        "torch.export in a fresh interpreter (RSS includes the interpreter and torch: ~0.4 GiB). Goal: the 8B "
        "shape captures in ≤ 2 s.",
        "",
        *table,
        "",
    ])
    write_section("Capture", section)


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
