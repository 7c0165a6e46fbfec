"""bench/gpu_check.py's CPU path, run for real: it says there is no GPU, checks its plumbing, leaves BENCHMARKS.md as
it was, and exits 0 (``--plumbing`` forces that path on a GPU host too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_plumbing_on_a_cpu_host():
    before = (ROOT / "BENCHMARKS.md").read_text()
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--plumbing"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no CUDA GPU here" in out.stdout and "plumbing ok: planned" in out.stdout
    assert (ROOT / "BENCHMARKS.md").read_text() == before
