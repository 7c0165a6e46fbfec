"""CPU figures of compile vs eager (issue 16): the training step time of a small LLaMA (autopar_nb.zoo) with its
blocks compiled by ``runtime/compile.py``'s ``apply_compile(model, "layers.*")`` (Inductor's C++ backend) against
the same model eager, and what the first, compiling steps cost.

Each variant runs in a fresh interpreter (Inductor's caches off, so the compile is really done): after ``WARMUP``
steps (the compile happens in the first), ``STEPS`` timed steps of forward, next-token cross-entropy, backward and
AdamW; the median is reported.

    .venv/bin/python bench/compile.py            # print
    .venv/bin/python bench/compile.py --write    # and replace the section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "Compile vs eager, CPU (issue 16)"
CONFIG = {"vocab_size": 2048, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 704}
BATCH, SEQ, WARMUP, STEPS = 4, 256, 2, 10

CHILD = """
import json, statistics, sys, time, torch, torch.nn.functional as F
from autopar_nb import zoo
from autopar_nb.runtime.compile import apply_compile
variant, config, batch, seq, warmup, steps = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:])
torch.manual_seed(0)
model = zoo.Llama(zoo.LlamaConfig(**config))
if variant == "compiled":
    apply_compile(model, "layers.*")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, config["vocab_size"], (batch, seq))
times, losses = [], []
for step in range(warmup + steps):
    t0 = time.perf_counter()
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
print(json.dumps({"variant": variant, "first_s": sum(times[:warmup]), "median_s": statistics.median(times[warmup:]),
                  "losses": losses[:3], "threads": torch.get_num_threads()}))
"""


def measure(variant: str) -> dict:
    """One variant in a fresh interpreter (see the module docstring)."""
    out = subprocess.run([sys.executable, "-c", CHILD, variant, json.dumps(CONFIG), str(BATCH), str(SEQ),
                          str(WARMUP), str(STEPS)], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def table() -> str:
    """The markdown of both variants."""
    rows = {name: measure(name) for name in ("eager", "compiled")}
    e, c = rows["eager"], rows["compiled"]
    lines = [f"zoo.Llama {CONFIG}, batch {BATCH} x {SEQ} tokens, fp32, AdamW; {WARMUP} warm-up steps, median of "
             f"{STEPS} (torch threads: {e['threads']}):", "",
             "| variant | step (median) | first {WARMUP} steps | first losses |".replace("{WARMUP}", str(WARMUP)),
             "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['median_s'] * 1e3:.0f} ms | {r['first_s']:.1f} s | "
                     f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    lines += ["", f"Compiled / eager step time: {c['median_s'] / e['median_s']:.2f}; the compile itself costs "
              f"{c['first_s'] - e['first_s']:.0f} s more in the first steps."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from fused_kernels import machine

    body = f"## {SECTION}\n\n`.venv/bin/python bench/compile.py --write` — {machine()}.\n\n{table()}\n"
    print(body)
    if args.write:
        from capture import write_section

        write_section(SECTION, body)


if __name__ == "__main__":
    main()
