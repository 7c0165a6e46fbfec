"""Per-rank memory: the cost model's prediction against PyTorch's memory tracker on the Hugging Face families people
bring (issue 21), component by component.

Each case: the family's cell at hidden 256, 4 layers, seq 256, batch 8 (tests/memcells.py), planned with the case's
fixed choices, exported, and its script's own ``main`` run for 2 steps as one rank of a fake process group inside
the tracker (``autopar_nb.measure``; real small tensors on CPU). The prediction is the cost model's per-rank
total before its allocator margin.

    .venv/bin/python bench/memory.py [FAMILY,...] [--plans single,ddp,...] [--write]

``--write`` replaces the "## Per-rank memory against the tracker" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

SIZE = {"hidden": 256, "layers": 4, "seq": 256, "batch": 8}
PLANS = {
    "single": {"dp": 1, "tp": 1, "pp": 1},
    "ddp": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 0},
    "zero1": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 1},
    "zero2": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2},
    "zero3": {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3},
    "tp": {"dp": 1, "tp": 2, "pp": 1},
    "pp": {"dp": 1, "tp": 1, "pp": 2, "micro_batches": 2, "schedule": "1f1b"},
}
"""plan name -> the planner's fixed choices (fp32, no recompute unless --amp / --recompute)"""
PREDICTED = ("params", "grads", "optimizer", "activations", "buffers")
MiB = 2**20


def case(family: str, plan_name: str, *, amp: str = "none", recompute: str = "none") -> list[dict]:
    """Predicted and measured components of every rank that differs (each pipeline stage; rank 0 otherwise)."""
    from memcells import CELLS

    import autopar_nb as ap
    from autopar_nb.cost import estimate
    from autopar_nb.measure import measure
    from autopar_nb.source import ModelSource

    src = ModelSource(CELLS[family](**SIZE))
    meta, example, _ = src.build(device="meta")
    graph = ap.capture(meta, example)
    fix = dict(PLANS[plan_name])
    world = fix["dp"] * fix["tp"] * fix["pp"]
    cluster = ap.Cluster.preset("cpu", 1, world)
    plan = ap.plan(graph, cluster, global_batch=SIZE["batch"] * fix["dp"],
                   fix={"micro_batches": 1, **fix, "amp": amp, "recompute": recompute})
    cost = estimate(graph, cluster, plan)
    ranks = tuple(range(fix["pp"])) if fix["pp"] > 1 else (0,)
    # rank r of a (pp, dp, tp) mesh is pipeline stage r // (dp * tp)
    measured = measure(src, plan, ranks=tuple(r * fix["dp"] * fix["tp"] for r in ranks))
    rows = []
    for stage, m in zip(ranks, measured, strict=True):
        mb = cost.memory_by_rank[stage]
        pred = {k: getattr(mb, k) for k in PREDICTED}
        rows.append({"family": family, "plan": plan_name, "amp": amp, "recompute": recompute, "stage": stage,
                     "predicted": pred, "predicted_total": mb.total - mb.margin, "measured": m["peak"],
                     "where": m["where"]})
    return rows


def error(row: dict) -> float:
    return row["predicted_total"] / row["measured"]["total"] - 1


def markdown(rows: list[dict]) -> str:
    """One line per case: each predicted component beside the measured ones it stands for."""
    head = ("| family | plan | rank | params p/m | grads p/m | optimizer p/m | activations p/m (+loss) | "
            "buffers + temporaries p/m | total p/m (MiB) | error | peak at |")
    out = [head, "|---" * 11 + "|"]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        buf_m = m["buffers"] + m["backward"] + m["step"] + m.get("casts", 0.0)
        cells = [f"{p[k] / MiB:.2f} / {m[k] / MiB:.2f}" for k in ("params", "grads", "optimizer")] + [
                 f"{p['activations'] / MiB:.1f} / {m['activations'] / MiB:.1f} (+{m['loss'] / MiB:.1f})",
                 f"{p['buffers'] / MiB:.1f} / {buf_m / MiB:.1f}",
                 f"{r['predicted_total'] / MiB:.1f} / {m['total'] / MiB:.1f}"]
        out.append(f"| {r['family']} | {r['plan']} | {r['stage']} | " + " | ".join(cells)
                   + f" | {error(r):+.1%} | {r['where']} |")
    return "\n".join(out)


def main() -> None:
    from memcells import CELLS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="?", default=",".join(CELLS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--amp", default="none")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows, failed = [], []
    t0 = time.time()
    for family in args.families.split(","):
        for plan_name in args.plans.split(","):
            try:
                got = case(family, plan_name, amp=args.amp, recompute=args.recompute)
            except Exception as e:  # a plan the planner refuses, or a run that fails: reported, not hidden
                failed.append(f"{family} / {plan_name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
                print("FAILED", failed[-1], flush=True)
                continue
            rows += got
            for r in got:
                print(f"{family:9s} {plan_name:7s} rank {r['stage']}: predicted {r['predicted_total'] / MiB:7.1f} "
                      f"measured {r['measured']['total'] / MiB:7.1f} MiB  {error(r):+.1%}  ({r['where']})", flush=True)
    table = markdown(rows)
    within = sum(abs(error(r)) <= 0.05 for r in rows)
    summary = f"{within} of {len(rows)} within 5 %" + (f"; {len(failed)} not measured" if failed else "")
    print(table, "\n", summary, f"({time.time() - t0:.0f} s)", sep="\n")
    if args.write:
        import torch
        from capture import write_section
        cmd = " ".join(["bench/memory.py", *sys.argv[1:]]).replace(" --write", "")
        body = (f"## Per-rank memory against the tracker\n\n`.venv/bin/python {cmd}` — {datetime.date.today()}, "
                f"{platform.machine()} CPU container, torch {torch.__version__}. Sizes {SIZE}, fp32 Adam unless "
                f"noted (amp={args.amp}, recompute={args.recompute}); predicted (p) = the cost model's per-rank "
                "total before its allocator margin, measured (m) = MemTracker/FSDPMemTracker peak of the 2nd step of "
                "the exported script's own main under a fake process group (autopar_nb/measure.py). "
                f"{summary}.\n\n{table}\n"
                + ("".join(f"\n- not measured: {f}" for f in failed)) + "\n")
        write_section("Per-rank memory against the tracker", body, ROOT / "BENCHMARKS.md")


if __name__ == "__main__":
    main()
