"""Rendezvous time and step time of 4 processes as one node (1x4) and as two nodes of 2 (2x2), the nodes being network
namespaces joined by a veth pair (tests/netns.py; root only).

- rendezvous: from starting torchrun (on both nodes at once) until every rank has joined the process group and
  passed a barrier (``bench/multinode.py`` runs itself as the worker: ``--probe``), and the part of that spent in
  ``init_process_group`` + the barrier (the rest: interpreter and torch imports, the agents' rendezvous);
- step time: the exported script of a small LM (d=256, 4 blocks, batch 8 x 128 tokens per rank) under each plan,
  median of the per-step times (metrics stream, rank 0) after 3 warm-up steps.

    sudo .venv/bin/python bench/multinode.py [--rounds 3] [--steps 15]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PORT = 29400


def probe() -> None:
    """Worker side of the rendezvous measure: one JSON line per rank with its timestamps."""
    t_import = time.time()
    import torch.distributed as dist

    t0 = time.time()
    dist.init_process_group("gloo")
    dist.barrier()
    t1 = time.time()
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"import_start": t_import, "init_start": t0, "joined": t1}, f)
    dist.destroy_process_group()


CELL = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LM(nn.Module):
    def __init__(self, vocab=512, d=256, n_layer=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


model = LM()
example_inputs = (torch.randint(0, 512, (8, 128)),)
'''


def plans():
    from runtime_cases import make_plan

    from autopar_nb.source import ModelSource

    src = ModelSource(CELL)
    tp = {"embed": "rowwise", "head": "colwise"}
    for i in range(4):
        tp |= {f"blocks.{i}.up": "colwise", f"blocks.{i}.down": "rowwise"}
    return src, {"FSDP dp=4": make_plan(src, dp=4, zero=3),
                 "TP2 x FSDP dp=2": make_plan(src, dp=2, tp=2, zero=3, tp_styles=tp)}


def launch(nodes, layout: str, argv_tail: list[str], env: dict, cwd: Path, timeout: float = 600) -> list[str]:
    """torchrun as ``layout`` ("1x4": one node; "2x2": both) with the documented commands; returns the outputs."""
    base = [sys.executable, "-m", "torch.distributed.run"]
    if layout == "1x4":
        runs = [(nodes[0], base + ["--nproc-per-node", "4", *argv_tail])]
    else:
        runs = [(node, base + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"{nodes[0].addr}:{PORT}", "--rdzv-id", "bench",
                               "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", node.addr, *argv_tail])
                for i, node in enumerate(nodes)]
    procs = [node.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
             for node, argv in runs]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{layout} failed:\n{out[-4000:]}")
        outs.append(out)
    return outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        return probe()
    from netns import MetricsSink, two_nodes, unavailable

    from autopar_nb.export import export

    why = unavailable()
    if why:
        raise SystemExit(why)
    src, cases = plans()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    rdzv = {"1x4": [], "2x2": []}
    steps = {(name, lay): [] for name in cases for lay in rdzv}
    with tempfile.TemporaryDirectory(prefix="autopar-bench-mn-") as tmp, two_nodes() as nodes:
        tmp = Path(tmp)
        scripts = {name: export(src, plan, tmp / f"train_{i}.py", steps=args.steps, quiet=True).script
                   for i, (name, plan) in enumerate(cases.items())}
        for r in range(args.rounds):
            for lay in ("1x4", "2x2") if r % 2 == 0 else ("2x2", "1x4"):  # alternate the order
                probe_dir = tmp / f"probe_{r}_{lay}"
                probe_dir.mkdir()
                t0 = time.time()
                launch(nodes, lay, [str(Path(__file__).resolve()), "--probe"], env | {"PROBE_DIR": str(probe_dir)},
                       tmp)
                ranks = [json.loads(f.read_text()) for f in probe_dir.glob("rank*.json")]
                assert len(ranks) == 4
                rdzv[lay].append((max(x["joined"] for x in ranks) - t0,
                                  max(x["joined"] for x in ranks) - min(x["init_start"] for x in ranks)))
                for name, script in scripts.items():
                    sink = MetricsSink(nodes[0], nodes[0].addr)
                    try:
                        launch(nodes, lay, [str(script)], env | {"AUTOPAR_METRICS": sink.address,
                                                                 "AUTOPAR_TOKEN": "t"}, tmp)
                    finally:
                        sink.close()
                    times = [s["step_time_s"] for s in sink.steps(0)][3:]
                    steps[(name, lay)].append(statistics.median(times))
                print(f"round {r} {lay}: rendezvous {rdzv[lay][-1][0]:.2f} s; steps "
                      + ", ".join(f"{n} {steps[(n, lay)][-1] * 1e3:.1f} ms" for n in cases), flush=True)
    print(f"\n{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {__import__('torch').__version__}, {time.strftime('%Y-%m-%d')}, {args.rounds} rounds\n")
    print("| layout | launch -> all 4 ranks joined (median) | init_process_group + barrier (median) | "
          + " | ".join(f"{n}: step (median of rounds)" for n in cases) + " |")
    print("|---|---|---|" + "---|" * len(cases))
    for lay in ("1x4", "2x2"):
        total = statistics.median(x[0] for x in rdzv[lay])
        init = statistics.median(x[1] for x in rdzv[lay])
        print(f"| {lay} | {total:.2f} s | {init * 1e3:.0f} ms | "
              + " | ".join(f"{statistics.median(steps[(n, lay)]) * 1e3:.1f} ms" for n in cases) + " |")
    print("\nall rounds:", {lay: [f"{a:.2f}/{b * 1e3:.0f}ms" for a, b in v] for lay, v in rdzv.items()},
          {f"{n} {lay}": [f"{x * 1e3:.1f}" for x in v] for (n, lay), v in steps.items()})


if __name__ == "__main__":
    main()
