"""Where some test fixtures' set-up time goes: each fixture's own steps (capture and plan, ``verify_many``) timed one
by one in one process, as the fixture runs them; nothing the tests check changes.

    PYTHONPATH=. .venv/bin/python bench/suite_setup.py --part PART

PART, one of:

* ``plans_run``: tests/test_plans_run.py's ``reports``;
* ``tp_layouts``: tests/test_tp_layouts.py's ``reports`` (what ``test_layout_matches_single_process[zoo_gpt_fused_qkv]``
  pays as set-up), with the import of the test module (it builds ``CASES``);
* ``references``: the single-process reference of each tp_layouts case (``script_values`` and ``reference``);
* ``second_verify``: tp_layouts' four-rank ``verify_many`` three times: first (it starts a standby), right after
  (the pool's refill), and after that standby is ready;
* ``staged_timeline``: tests/test_timeline.py's ``staged_measured`` fixture's measuring calls (looped BFS).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]


def timed(label: str, fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    print(f"{label}: {time.monotonic() - t0:.1f} s", flush=True)
    return out


def plans_run() -> None:
    import test_plans_run as t
    import torch

    from autopar_nb.verify import verify_many

    torch.set_num_threads(1)
    two = {(m, f): fix for m in t.MODELS for f, fix in t.FIXES.items() if (m, f) not in t.REFUSED}
    for nproc, cases in ((2, two | {(m, "tp2"): t.FIXES["tp2"] for m in t.HF_MODELS}), (4, t.FOUR)):
        planned = {key: timed(f"plan {key}", t._plan, key[0], fix, nproc) for key, fix in cases.items()}
        timed(f"{nproc} ranks: verify_many of {len(planned)}", verify_many, list(planned.values()), steps=t.STEPS)


def tp_layouts() -> None:
    t = timed("import of tests/test_tp_layouts.py", __import__, "test_tp_layouts")
    from autopar_nb.verify import verify_many

    for cases, tp in ((t.CASES, t.TP), (t.FOUR, 4)):
        plans = {name: (src, timed(f"plan {name}", t._plan, src, styles, parts, tp))
                 for name, (src, styles, parts) in cases.items()}
        meta = [name.endswith("_meta_init") for name in plans]
        timed(f"tp {tp}: verify_many of {len(plans)}", verify_many, list(plans.values()), steps=t.STEPS,
              meta_init=meta)


def references() -> None:
    import test_tp_layouts as t
    import torch

    from autopar_nb.export.values import script_values
    from autopar_nb.verify.reference_run import reference

    torch.set_num_threads(1)
    for cases, tp in ((t.CASES, t.TP), (t.FOUR, 4)):
        for name, (src, styles, parts) in cases.items():
            plan = t._plan(src, styles, parts, tp)
            v = timed(f"{name}: script_values", script_values, src, plan, seed=0,
                      meta_init=name.endswith("_meta_init"))
            timed(f"{name}: reference", reference, src, plan, steps=t.STEPS, seed=0, values=v)


def second_verify() -> None:
    import test_tp_layouts as t
    from launch import settle

    from autopar_nb.verify import verify_many

    plans = [(src, t._plan(src, styles, parts, 4)) for src, styles, parts in t.FOUR.values()]
    timed("four-rank verify_many, first (starts a standby)", verify_many, plans, steps=t.STEPS)
    timed("four-rank verify_many, right after (waits for the refill)", verify_many, plans, steps=t.STEPS)
    settle()
    timed("four-rank verify_many, after the standby is ready", verify_many, plans, steps=t.STEPS)


def staged_timeline() -> None:
    import test_timeline as t

    import autopar_nb as ap
    from autopar_nb.notebook.session import Session
    from autopar_nb.source import ModelSource

    src = ModelSource(t.MEASURED_CELL)
    meta, example, _ = src.build(device="meta")
    graph = ap.capture(meta, example)
    s = Session(graph, ap.Cluster.preset("cpu", 1, 2), src)
    s.replan(fix={**t.STAGED, "schedule": "looped_bfs"})
    s.widget()
    timed("staged_measured's rank 0 (measures both ranks)", s.memory_timeline, rank=0, measure=True)
    timed("staged_measured's rank 1 (kept)", s.memory_timeline, rank=1, measure=True)


def main() -> None:
    parts = {"plans_run": plans_run, "tp_layouts": tp_layouts, "references": references,
             "second_verify": second_verify, "staged_timeline": staged_timeline}
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=sorted(parts), required=True)
    parts[p.parse_args().part]()


if __name__ == "__main__":
    main()
