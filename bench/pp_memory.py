"""Per-rank memory of a pipelined plan (pp=2, 1F1B, 2 micro-batches, fp32, no recompute) in a REAL 2-process gloo
run, against the cost model: each rank runs the exported script's ``main`` inside measure.py's labelled MemTracker
(bench/memory.py measures under a fake process group, where the pipeline stages' start-up vote on static shapes,
sent with ``recv_object_list``, gets no data). The families of tests/memcells.py at bench/memory.py's size.

    .venv/bin/python bench/pp_memory.py [FAMILY,...]

MemTracker refuses a root module called twice in one step ("multiple iterative calls"); a pipeline stage is called
once per micro-batch, so its per-module statistics restart at each call (the tracked storages and peaks are kept).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def worker(script: str, steps: int) -> None:
    """One rank (under torchrun): the script's ``main`` inside the tracker; prints a MEASURED json line."""
    import torch
    import torch.distributed as dist

    import autopar_nb.measure as measure

    torch.set_num_threads(1)
    g = runpy.run_path(script, run_name="autopar_measure")
    dist.init_process_group("gloo")
    tracker, fsdp_tracker = measure._tracker_classes()
    plain = tracker._pre_fw_hook

    def pre_fw(self, module, inputs):  # a stage runs once per micro-batch: its module statistics start again
        if module in self.memory_tracking and not self._mod_tracker.is_bw and (
                set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}):
            del self.memory_tracking[module]
        return plain(self, module, inputs)

    tracker._pre_fw_hook = pre_fw
    measure._tracker_classes = lambda: (tracker, fsdp_tracker)
    session = measure._Session(steps)
    parallelize = g["parallelize"]

    def traced(*args, **kwargs):
        out = parallelize(*args, **kwargs)
        session.active.phase = "train"
        return out

    g["parallelize"].__globals__["parallelize"] = traced
    session.active.__enter__()
    try:
        g["main"](["--steps", str(steps)], observer=session)
    finally:
        session.active.__exit__(None, None, None)
    snap = session.active.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    print("MEASURED " + json.dumps({"rank": dist.get_rank(), "peak": measure.components(snap),
                                    "where": session.active.where}), flush=True)


def case(family: str) -> list[str]:
    """Lines: per rank, the predicted and measured total and groups (MiB)."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
    import memory
    from memcells import CELLS

    import autopar_nb as ap
    from autopar_nb.cost import estimate
    from autopar_nb.export import export
    from autopar_nb.measure import measured_groups, predicted_groups
    from autopar_nb.source import ModelSource

    src = ModelSource(CELLS[family](**memory.SIZE))
    meta, example, _ = src.build(device="meta")
    graph = ap.capture(meta, example)
    cluster = ap.Cluster.preset("cpu", 1, 2)
    plan = ap.plan(graph, cluster, global_batch=memory.SIZE["batch"],
                   fix={**memory.PLANS["pp"], "amp": "none", "recompute": "none"})
    cost = estimate(graph, cluster, plan)
    with tempfile.TemporaryDirectory() as tmp:
        script = export(src, plan, Path(tmp) / "train.py", quiet=True).script
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               __file__, "--worker", str(script), "2"], capture_output=True, text=True, env=env,
                              cwd=tmp, timeout=900)
    got = {d["rank"]: d for d in (json.loads(line[9:]) for line in proc.stdout.splitlines()
                                  if line.startswith("MEASURED "))}
    if len(got) < 2:
        return [f"{family}: not measured ({proc.stderr.strip().splitlines()[-1:] or proc.returncode})"]
    out = []
    for r in (0, 1):
        mb = cost.memory_by_rank[r]
        pred, meas = predicted_groups(mb), measured_groups(got[r]["peak"])
        p, m = mb.total - mb.margin, got[r]["peak"]["total"]
        out.append(f"| {family} | {r} | {p / MiB:.1f} / {m / MiB:.1f} | {p / m - 1:+.1%} | "
                   + " | ".join(f"{pred[k] / MiB:.1f} / {meas[k] / MiB:.1f}" for k in pred)
                   + f" | {mb.terms.get('pipeline_buffers', 0) / MiB:.1f} |")
    return out


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]))
        return
    from autopar_nb.measure import GROUPS

    families = (sys.argv[1] if len(sys.argv) > 1 else "LLaMA,Qwen2,GPT-NeoX,GPT-2,BERT,ViT,Mixtral,T5").split(",")
    print("| family | rank | total p / m (MiB) | error | " + " | ".join(f"{g} p / m" for g in GROUPS)
          + " | pipeline_buffers term |")
    print("|---" * (len(GROUPS) + 5) + "|")
    for family in families:
        for line in case(family):
            print(line, flush=True)


if __name__ == "__main__":
    main()
