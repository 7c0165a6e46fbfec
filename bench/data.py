"""Data benchmark (issue 18): steps/s of the exported script reading a real dataset through its DataLoader vs the same
model on synthetic batches, 2 CPU processes (torchrun, gloo), and the share of step time spent waiting for data.

    .venv/bin/python bench/data.py [--steps 40] [--rounds 2]

The model: a 2-layer LLaMA (dim 64, 4 heads, byte vocabulary of 256), 8 sequences of 64 tokens per rank and step,
DDP over 2 ranks. The data: a byte-level token file (this repository's Markdown, repeated to 1 MiB) read by a
map-style ``TokenWindows`` dataset from a memory map; and the same with 2 ms of simulated latency per sample (a slow
reader or tokenizer), read by 0 and by 2 DataLoader workers per rank. Figures: median step time of steps 2..N from
rank 0's log lines, and the script's own data-wait verdict line.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CELL = '''\
import os
import time

import torch
from torch.utils.data import Dataset

from autopar_nb.zoo import Llama, LlamaConfig

SEQ = 64


class TokenWindows(Dataset):
    """Windows of SEQ byte tokens of a memory-mapped token file (AUTOPAR_TOKENS); AUTOPAR_DELAY_MS per sample."""

    def __init__(self, path):
        self.tokens = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        self.delay = float(os.environ.get("AUTOPAR_DELAY_MS", "0")) / 1e3

    def __len__(self):
        return len(self.tokens) // SEQ

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.tokens[i * SEQ:(i + 1) * SEQ].long()


model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128))
'''
DATA = CELL + ('dataset = TokenWindows(os.environ["AUTOPAR_TOKENS"])\n'
               "example_inputs = (torch.zeros(8, SEQ, dtype=torch.long),)\n")
SYNTH = CELL + "example_inputs = (torch.randint(0, 256, (8, SEQ)),)\n"


def export_script(cell: str, path: Path, steps: int) -> Path:
    import autopar_nb as ap
    from autopar_nb.notebook.cell import run_model_cell

    result = run_model_cell(cell, {})
    graph = ap.capture(result.model, result.example_inputs)
    plan = ap.plan(graph, ap.Cluster.preset("cpu", gpus_per_node=2), global_batch=16,
                   fix={"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0, "amp": "none", "micro_batches": 1})
    return ap.export(result.source, plan, path, steps=steps, quiet=True).script


def run(script: Path, steps: int, env: dict, *args: str) -> tuple[float, str]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), "--steps", str(steps), *args], capture_output=True, text=True, env=env,
                          cwd=script.parent, timeout=900)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    from autopar_nb.units import TIME_TEXT, parse_time

    times = [parse_time(t) * 1e3 for t in re.findall(rf"^step \d+ \| loss \S+ \| ({TIME_TEXT})", proc.stdout, re.M)]
    verdict = next((line for line in proc.stdout.splitlines() if line.startswith("data ")), "")
    return statistics.median(times[2:]), verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = b"".join(p.read_bytes() for p in sorted(ROOT.glob("*.md")))
        (tmp / "tokens.u8").write_bytes((text * (2**20 // len(text) + 1))[:2**20])
        os.environ["AUTOPAR_TOKENS"] = str(tmp / "tokens.u8")  # the cell reads it here too (capture, export)
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        env.pop("AUTOPAR_METRICS", None)
        data, synth = export_script(DATA, tmp / "data.py", a.steps), export_script(SYNTH, tmp / "synth.py", a.steps)
        cases = {"synthetic batches": (synth, {}, ()),
                 "dataset, 0 workers": (data, {}, ("--num-workers", "0")),
                 "dataset + 2 ms/sample, 0 workers": (data, {"AUTOPAR_DELAY_MS": "2"}, ("--num-workers", "0")),
                 "dataset + 2 ms/sample, 2 workers": (data, {"AUTOPAR_DELAY_MS": "2"}, ("--num-workers", "2"))}
        results: dict = {name: [] for name in cases}
        for _ in range(a.rounds):  # alternating, so load on the machine hits every case alike
            for name, (script, extra, args) in cases.items():
                results[name].append(run(script, a.steps, env | extra, *args))
        for name, runs in results.items():
            ms = statistics.median(r[0] for r in runs)
            print(f"{name:36s} {ms:7.1f} ms/step  {1e3 / ms:6.2f} steps/s   {runs[-1][1]}")


if __name__ == "__main__":
    main()
