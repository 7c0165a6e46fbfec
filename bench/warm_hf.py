"""Warm launch and verify of a tiny Hugging Face LLaMA (hidden 64, 2 layers), captured and planned by the magic for
2 CPU processes: seconds from the call to the first step's metrics (launch) or to the report (verify), each after
the pool's next standby is ready. What a warm rank still imports when the script reads ``LlamaForCausalLM`` shows
here (transformers loads its modelling module on first access).

    .venv/bin/python bench/warm_hf.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from launch import settle, time_ap_launch, time_verify

CELL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
example_inputs = torch.randint(0, 256, (8, 32))
"""


def session():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    with contextlib.redirect_stdout(io.StringIO()):
        return ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 8", CELL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    ap = session()
    got = {"launch": [], "verify": []}
    for kind, timed in (("launch", time_ap_launch), ("verify", time_verify)):
        timed(ap, warm=True)  # the first call starts the standby the next ones are handed
        for _ in range(a.rounds):
            settle()
            got[kind].append(timed(ap, warm=True))
    for kind, xs in got.items():
        print(f"warm {kind}: median {statistics.median(xs):.2f} s of {', '.join(f'{x:.2f}' for x in xs)}", flush=True)


if __name__ == "__main__":
    main()
