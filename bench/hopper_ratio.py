"""The Hopper factors' one ratio, re-derived: the measured H200 step (BENCHMARKS.md "GPU": LLaMA-3.2 1B's
shape, bf16 eager, recompute none, 179.1 ms) over what the default factors predict for the same plan, applied to
each default speed alike, as ``run.calibrate()`` does with one step time.

    .venv/bin/python bench/hopper_ratio.py
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check
from IPython.core.interactiveshell import InteractiveShell

from autopar_nb.cost import estimate
from autopar_nb.cost import factors as F

MEASURED_S = 0.1791
"""the H200 run's median step, recompute none (BENCHMARKS.md "GPU")"""
SPEEDS = ("eff_matmul", "eff_attention", "flash_speed", "eff_hbm", "eff_fp32_matmul")


def main() -> None:
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "autopar_nb")
    ap = ip.run_cell_magic("autoparallel", "--gpu h200 --dtype bf16 --gpus 1 "
                           "--fix recompute=none,compile=false,float8=none,dp=1", gpu_check.LLAMA_1B.cell())
    plan = ap.current_plan()

    def step(**factors) -> float:
        return estimate(ap.graph, ap.cluster, plan, factors=dataclasses.replace(F.DEFAULT, **factors)).step_time_s

    ratio = step() / MEASURED_S
    scaled = {k: round(getattr(F.DEFAULT, k) * ratio, 3) for k in SPEEDS}
    print(f"defaults predict {step() * 1e3:.1f} ms of the measured {MEASURED_S * 1e3:.1f}: ratio {ratio:.3f}")
    print(f"scaled: {scaled} -> {step(**scaled) * 1e3:.1f} ms")
    now = F.ARCH_FACTORS["hopper"]
    print(f"ARCH_FACTORS['hopper'] now: {now} -> {step(**now) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
