"""Re-running the %%autoparallel magic on a cell that changed only outside the model (issue 43 item 3): the first run
captures and plans, each re-run rebuilds the cell on the meta device, finds the capture by its key
(autopar_nb/capture/cache.py) and plans again on it.

Run: .venv/bin/python bench/rerun.py        (prints seconds per run of the magic; the figures go in BENCHMARKS.md)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

CELLS = {
    "zoo LLaMA-3 8B, 8 x h100-80gb, --batch 16": (
        "--gpus 8 --gpu h100-80gb --batch 16",
        "import torch\nfrom autopar_nb.zoo import Llama, LLAMA3_8B\nmodel = Llama(LLAMA3_8B)\n"
        "example_inputs = (torch.randint(0, 128256, (1, 8192)),)\nlr = {lr}\n"),
    "zoo GPT 1T shape (128 x 25600), 3072 x a100-80gb, --batch 3072": (
        "--nodes 384 --gpus 8 --gpu a100-80gb --batch 3072",
        "import torch\nfrom autopar_nb.zoo import GPT, GPTConfig\n"
        "model = GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=128, n_head=160, n_embd=25600))\n"
        "example_inputs = (torch.randint(0, 51200, (1, 2048)),)\nlr = {lr}\n"),
}


def main() -> None:
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "autopar_nb")
    print(f"load average {os.getloadavg()[0]:.1f}")
    for name, (line, cell) in CELLS.items():
        times = []
        for i in range(4):
            t0 = time.perf_counter()
            ip.run_cell_magic("autoparallel", line, cell.format(lr=f"{i + 1}e-4"))
            times.append(time.perf_counter() - t0)
        print(f"{name}: first {times[0]:.2f} s, re-runs {', '.join(f'{t:.3f}' for t in times[1:])} s "
              f"(median {statistics.median(times[1:]):.3f} s)")


if __name__ == "__main__":
    main()
