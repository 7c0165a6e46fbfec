"""Where tests/test_notebooks.py's time goes: each notebook executed as the test executes it (nbclient, a fresh
kernel, CPU, in a temporary folder), each code cell's wall time from nbclient's own timestamps; the slowest cells of
each notebook printed with the notebook's whole time.

    PYTHONPATH=. .venv/bin/python bench/notebook_cells.py [--notebooks 01_quickstart,03_vision] [--top 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def cell_times(nb) -> list[tuple[float, int, str]]:
    """(seconds, cell index, its first line of code) of each executed code cell."""
    out = []
    for i, cell in enumerate(nb.cells):
        ex = cell.get("metadata", {}).get("execution", {})
        if cell.cell_type != "code" or "iopub.execute_input" not in ex:
            continue
        began = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
        ended = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
        first = next((line for line in cell.source.splitlines() if line.strip() and not line.startswith("#")), "")
        out.append(((ended - began).total_seconds(), i, first[:70]))
    return out


def run(name: str, top: int) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=True,
                       resources={"metadata": {"path": tmp}}).execute()
    print(f"{name}: {time.monotonic() - t0:.1f} s in all, 1-min load {os.getloadavg()[0]:.1f}", flush=True)
    for seconds, i, first in sorted(cell_times(nb), reverse=True)[:top]:
        print(f"   cell {i}: {seconds:.1f} s  {first}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--notebooks", default=",".join(sorted(f.stem for f in NOTEBOOKS.glob("0*.ipynb"))))
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    os.environ["MPLBACKEND"] = "Agg"  # as the test sets it
    for name in args.notebooks.split(","):
        run(name, args.top)


if __name__ == "__main__":
    main()
