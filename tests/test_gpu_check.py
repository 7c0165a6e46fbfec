"""bench/gpu_check.py's CPU path, run for real: it says there is no GPU, runs every check function at toy size on CPU
processes (the exported script launched, calibrated, verified; 2 gloo processes with SyncBatchNorm), leaves
BENCHMARKS.md as it was, and exits 0 (``--plumbing`` forces that path on a GPU host too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_check_plumbing_on_a_cpu_host():
    before = (ROOT / "BENCHMARKS.md").read_text()
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--plumbing"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no CUDA GPU here" in out.stdout and "plumbing ok: 5 checks ran on CPU" in out.stdout, out.stdout[-3000:]
    assert "FAILED" not in out.stdout and "| eager |" in out.stdout and "verify fp32 on CPU: ok=True" in out.stdout
    assert "| eager |" in out.stdout.split("the recompute=none run above: the same plan")[0]  # one launch saved
    assert (ROOT / "BENCHMARKS.md").read_text() == before
