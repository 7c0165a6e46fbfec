"""The main job (`make demo`): the quickstart flow end to end, headless, on this machine.

    python -m autopar_nb.demo [--out runs/demo]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

QUICKSTART_CELL = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class MyModel(nn.Module):
    """The seed's MLP: Linear(1024, 1024) -> ReLU -> Linear(1024, 512)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(1024, 1024)
        self.linear2 = nn.Linear(1024, 512)

    def forward(self, x):
        return self.linear2(F.relu(self.linear1(x)))


model = MyModel()
example_inputs = (torch.randn(32, 1024),)
'''


def step(title: str):
    print(f"\n== {title} " + "=" * max(0, 100 - len(title)), flush=True)
    return time.perf_counter()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo",
                        help="where the exported script and plan are written")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    from IPython.core.interactiveshell import InteractiveShell

    t = step("1. capture + plan: %%autoparallel on the quickstart cell (model built on the meta "
             "device)")
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    ap = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 32", QUICKSTART_CELL)
    print(ap.summary())
    print(ap.plan.explain())
    done(t)

    t = step("2. verify: the plan on 2 processes (gloo) against a single-process reference, 5 "
             "steps")
    report = ap.verify(steps=5, nproc=2)
    print(report)
    done(t)
    if not report.ok:
        raise SystemExit("verification failed: the parallel run does not match the reference")

    t = step("3. launch: the exported script on 2 local processes through torch's elastic launcher")
    run = ap.launch(nproc=2, steps=10, run_dir=str(out / "run"))
    status = run.wait(timeout=300)
    print(run.metrics)
    print(f"status: {status}; logs and the script in {out / 'run'}")
    done(t)
    if status != "finished":
        raise SystemExit(f"the launched run {status}: {run.message}")

    t = step("4. export: a plain torchrun script and the plan as JSON")
    exported = ap.export(str(out / "train_quickstart.py"))
    done(t)

    t = step("5. run the exported script with torchrun (2 processes, 5 steps)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(exported.script.resolve()), "--steps", "5"]
    print("$", " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun", 1))
    proc = subprocess.run(cmd, cwd=out, text=True, capture_output=True, timeout=300)
    print(proc.stdout.strip())
    if proc.returncode:
        print(proc.stderr[-3000:])
        raise SystemExit(f"torchrun exited with {proc.returncode}")
    done(t)
    print(f"\nScript: {exported.script}\nPlan:   {exported.plan_json}")


def done(t0: float) -> None:
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
