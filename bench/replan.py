"""Re-planning benchmark (issue 14): time from the triggering sample to training resumed under the new plan.

    .venv/bin/python bench/replan.py [--rounds 3]
    .venv/bin/python bench/replan.py --part rss [--steps 30]

Each round launches, on 2 CPU processes (gloo, warm pool), a plan whose ranks hold more than the per-rank limit
allows: the activations-heavy MLP of ``tests/test_replan.py`` (4 x Linear(16, 4096) + GELU + Linear(4096, 16), batch
2048), a limit of 1.6x the plan's predicted peak (``Cluster.preset("cpu", memory_gb=...)``), ``memory_threshold``
0.6, ``ckpt_every=1``, ``replan="auto"``. For the first re-plan of the round it prints, in seconds:

* ``to stop``: from the triggering sample (the monitor's tick whose memory crossed the threshold) to the run stopped
  (the run goes on to its next checkpoint, then every worker ends);
* ``to plan``: calibrating and re-planning (the new plan's diff and reason recorded);
* ``to resume``: from there to the new plan's first step (export, launch through the warm pool, the ranks building
  the model, loading the DCP checkpoint, the first step);
* ``total``: the triggering sample to the first step of the new plan (the ``resume`` event's
  ``seconds_from_trigger``).

and, per round, how many re-plans the launch needed before a plan stayed under the threshold, each leg's peak RSS
above its baseline as a share of the limit, and the first re-plan's reason (the calibration it made).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autopar_nb.capture import capture
from autopar_nb.hardware import Cluster
from autopar_nb.notebook.session import Session
from autopar_nb.source import ModelSource

CELL = """\
import torch, torch.nn as nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 4096), nn.GELU(), nn.Linear(4096, 16)) for _ in range(4)])
example_inputs = (torch.randn(2048, 16),)
"""
STEPS = 6


def one_round(work: Path) -> dict:
    """One launch that re-plans: the first re-plan's figures."""
    src = ModelSource(CELL)
    model, inputs, _ = src.build(device="meta")
    graph = capture(model, inputs)
    free = Session(graph, Cluster.preset("cpu", gpus_per_node=2), src).replan()
    limit = 1.6 * free.cost.peak_memory_bytes
    ap = Session(graph, Cluster.preset("cpu", gpus_per_node=2, memory_gb=limit / 2**30), src)
    ap.replan()
    run = ap.launch(2, STEPS, replan="auto", memory_threshold=0.6, ckpt_dir=str(work / "ckpt"), ckpt_every=1,
                    run_dir=str(work / "run"), hang_timeout_s=300)
    status = run.wait(600)
    legs = run.legs()
    if len(legs) < 2:
        raise SystemExit(f"no re-plan happened ({status}: {run.message})")
    first, nxt = legs[0], legs[1]
    ev = next(e for e in first.events if e["kind"] == "replan")
    resume = next(e for e in nxt.events if e["kind"] == "resume")
    resumed_at = nxt.started + nxt.first_step_time - first.started
    shares = []
    for leg in legs:
        peaks = {r: v["peak"] for r, v in leg.rss_figures().items()}
        shares.append(max(peaks.values(), default=0.0) / limit)
    return {"status": status, "replans": len(legs) - 1, "reason": ev["reason"], "shares": shares,
            "to_stop": ev["stopped_t"] - ev["trigger_t"], "to_plan": ev["t"] - ev["stopped_t"],
            "to_resume": resumed_at - ev["t"], "to_launch": nxt.started - first.started - ev["t"],
            "launch_to_step": nxt.first_step_time, "first_launch_to_step": first.first_step_time,
            "total": resume["seconds_from_trigger"]}


RECORDER = """\
# runs an exported script and prints, per step report, its VmHWM and VmRSS above RSS_BEFORE_MODEL (MiB)
import importlib.util, json, os, sys

path = sys.argv[1]
spec = importlib.util.spec_from_file_location("train_mod", path)
mod = importlib.util.module_from_spec(spec)
sys.argv = [path] + sys.argv[2:]
spec.loader.exec_module(mod)
log, send = [], mod.Metrics.send


def status():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024 - mod.RSS_BEFORE_MODEL
    return out


def recording(self, rec):
    if "step" in rec:
        log.append({"step": rec["step"], "dt": rec["step_time_s"], **status()})
    return send(self, rec)


mod.Metrics.send = recording
mod.main(sys.argv[1:])
print("RECORD", os.environ["RANK"], json.dumps(log), flush=True)
"""


def rss_part(work: Path, steps: int) -> None:
    """Why one calibration holds: the exported script of the first plan (2 ranks, cold torchrun, a checkpoint every
    step), each step's peak RSS above the baseline under glibc's default and under ``run.CPU_LIMIT_ENV``."""
    import json
    import subprocess

    from autopar_nb.export import export
    from autopar_nb.launch.compare import predicted_breakdown
    from autopar_nb.launch.run import CPU_LIMIT_ENV

    src = ModelSource(CELL)
    model, inputs, _ = src.build(device="meta")
    ap = Session(capture(model, inputs), Cluster.preset("cpu", gpus_per_node=2), src)
    plan = ap.replan()
    mb = predicted_breakdown(plan, 0)
    print(f"{plan.summary()}: predicted training state {(mb.total - mb.margin) / 2**20:.1f} MiB per rank, of which "
          f"parameters + optimizer state {(mb.params + mb.optimizer) / 2**20:.1f} MiB")
    script = export(src, plan, work / "train.py", quiet=True).script
    (work / "record.py").write_text(RECORDER)
    print("| glibc malloc | peak above baseline at step 0 / 5 / last (MiB) | RSS between steps, last (MiB) | "
          "median step time (ms) |\n|---|---|---|---|")
    for name, extra in (("default (dynamic mmap threshold)", {}), (f"{CPU_LIMIT_ENV}", CPU_LIMIT_ENV)):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              str(work / "record.py"), str(script), "--steps", str(steps), "--ckpt-dir",
                              str(work / f"ck{len(extra)}"), "--ckpt-every", "1"], env=env, cwd=work,
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("RECORD"):
                _, rank, data = line.split(" ", 2)
                log = json.loads(data)
                hwm = [e["VmHWM"] / 2**20 for e in log]
                dt = statistics.median(e["dt"] for e in log[1:]) * 1e3
                print(f"| {name}, rank {rank} | {hwm[0]:.0f} / {hwm[min(5, len(hwm) - 1)]:.0f} / {hwm[-1]:.0f} | "
                      f"{log[-1]['VmRSS'] / 2**20:.0f} | {dt:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--part", choices=("replan", "rss"), default="replan",
                   help="replan: trigger to resumed (the default); rss: each step's peak RSS of the exported script "
                        "under glibc's default and under the CPU limit's malloc settings")
    p.add_argument("--steps", type=int, default=30, help="--part rss: steps per run")
    args = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"Python {platform.python_version()}")
    if args.part == "rss":
        with tempfile.TemporaryDirectory(prefix="autopar-bench-rss-") as d:
            rss_part(Path(d), args.steps)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        return
    rows = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="autopar-bench-replan-") as d:
            r = one_round(Path(d))
        rows.append(r)
        print(f"round {i}: {r['status']}, {r['replans']} re-plan(s); first: to stop {r['to_stop']:.2f} s, to plan "
              f"{r['to_plan']:.2f} s, to resume {r['to_resume']:.2f} s (export and hand to the pool "
              f"{r['to_launch']:.2f} s, then to the first step {r['launch_to_step']:.2f} s; the first plan's launch "
              f"to its first step: {r['first_launch_to_step']:.2f} s), total {r['total']:.2f} s; "
              "each leg's peak "
              f"RSS above its baseline: {', '.join(f'{x:.0%}' for x in r['shares'])} of the limit\n  {r['reason']}")
    print("\n| figure | median s | min s | max s |\n|---|---|---|---|")
    for key in ("to_stop", "to_plan", "to_resume", "to_launch", "launch_to_step", "total"):
        v = [r[key] for r in rows]
        print(f"| {key.replace('_', ' ')} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"re-plans per round: {[r['replans'] for r in rows]}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
