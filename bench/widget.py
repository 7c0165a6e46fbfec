"""The planner widget's kernel side for a drag on the sharding board: a LLaMA-7B-sized graph (32 layers, hidden 4096,
FFN 11008, seq 4096) on 8 x H100, two layers dropped on a lane at a time, as the front end sends it
(``{"kind": "shard", "layers": [...], "value": ...}``). Prints, per drop, the whole ``PlannerWidget.handle`` time, the
planner's re-plan and the widget's refresh (graph layout with graphviz, board, table, option refusals), and medians.
The browser's figure (drop -> re-rendered widget) is ``tests/test_browser.py::test_board_latency_llama7b``.

    .venv/bin/python bench/widget.py [--drops 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from autopar_nb import Cluster, capture
from autopar_nb.notebook.session import Session
from autopar_nb.source import ModelSource
from autopar_nb.zoo import Llama, LlamaConfig

warnings.filterwarnings("ignore")
LLAMA_7B = LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008)


def main() -> None:
    """Time ``--drops`` board drops after one warm-up; print one line per drop and the medians."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--drops", type=int, default=9)
    args = ap.parse_args()
    with torch.device("meta"):
        graph = capture(Llama(LLAMA_7B), (torch.randint(0, 32000, (1, 4096)),))
    session = Session(graph, Cluster.preset("h100-80gb", gpus_per_node=8), ModelSource("# bench"), global_batch=64)
    w = session.widget()
    w.viewport = {"width": 560, "height": 620}  # the graph panel at 1400 x 1000, as the browser reports it
    rows = []
    for i in range(args.drops + 1):
        lane = ("fsdp", "replicate")[i % 2]
        t0 = time.perf_counter()
        w.handle({"kind": "shard", "layers": [f"layers.{i % 16}", f"layers.{16 + i % 16}"], "value": lane})
        total = (time.perf_counter() - t0) * 1e3
        assert w.messages[0]["level"] == "info", w.messages
        if i:  # the first drop warms caches (the planner's profile, pattern matching)
            rows.append((total, w.timings["replan_ms"], w.timings["refresh_ms"], w.timings["layout_ms"]))
            print(f"drop {i}: handle {total:.0f} ms = re-plan {rows[-1][1]:.0f} ms + refresh {rows[-1][2]:.0f} ms "
                  f"(layout {rows[-1][3]:.0f} ms)")
    med = [statistics.median(c) for c in zip(*rows, strict=True)]
    print(f"median of {len(rows)}: handle {med[0]:.0f} ms, re-plan {med[1]:.0f} ms, refresh {med[2]:.0f} ms, "
          f"layout {med[3]:.0f} ms")


if __name__ == "__main__":
    main()
