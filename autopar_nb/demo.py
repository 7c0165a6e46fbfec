"""The main job (`make demo`): the quickstart flow end to end, headless, on this machine.

    python -m autopar_nb.demo [--out runs/demo]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

QUICKSTART_CELL = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class MyModel(nn.Module):
    """The seed's model (§3.2): Linear(1024, 1024) -> ReLU -> Linear(1024, 512)."""

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="where the exported script and plan are written")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from IPython.core.interactiveshell import InteractiveShell

    t = step("1. capture: %%autoparallel on the quickstart cell (model built on the meta device)")
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    ap = ip.run_cell_magic("autoparallel", "--gpu cpu --gpus 2 --batch 32", QUICKSTART_CELL)
    print(ap.summary())
    print(f"({time.perf_counter() - t:.2f} s)")


if __name__ == "__main__":
    main()
