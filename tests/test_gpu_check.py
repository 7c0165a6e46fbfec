"""bench/gpu_check.py's CPU path, run for real: it says there is no GPU, runs every check function
at toy size on CPU processes (the exported script launched, calibrated, verified; 2 gloo processes
with SyncBatchNorm; the scaling check's rows at two toy sizes), leaves BENCHMARKS.md as it was, and
exits 0 (``--plumbing`` forces that path on a GPU host too). The scaling check's batch fallback and
budget skip, which a CPU host never reaches, run on stubs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpu_check_plumbing_on_a_cpu_host(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_text()
    rows_json = tmp_path / "rows.json"
    command = [sys.executable, "bench/gpu_check.py", "--plumbing", "--json", str(rows_json)]
    # seven checks: CPU offload's (a verify and a launch) alone takes ~3 min at load 20
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    text = out.stdout
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no CUDA GPU here" in text and "plumbing ok: 8 checks ran on CPU" in text, text[-3000:]
    assert "| tensorwise |" in text and "losses over 4 steps within 10% of bf16's" in text
    assert "FAILED" not in text and "| eager |" in text and "verify fp32 on CPU: ok=True" in text
    # one launch saved: the throughput check's eager variant is the memory check's first run
    assert "| eager |" in text.split("the recompute=none run above: the same plan")[0]
    assert gpu_check.SCALING_HEAD in text
    assert (ROOT / "BENCHMARKS.md").read_text() == before
    rows = json.loads(rows_json.read_text())["rows"]
    assert [(r["size"], r["recompute"], r["compile"]) for r in rows] == [
        (row.shape.name, row.recompute, row.compile) for row in gpu_check.CPU_SCALING]
    assert [r["status"].split(" ")[0].rstrip(":") for r in rows] == [
        "reused", "reused", "launched", "launched", "not"]  # the compiled row: not run on CPU
    for r in rows[:4]:  # what a fit of the efficiency factors reads
        p, m = r["predicted"], r["measured"]
        assert p["step_time_s"] > 0 and p["compute_s"] > 0 and p["optimizer_s"] > 0
        assert "comm_exposed_s" in p
        assert p["peak_before_margin_bytes"] > 0 and p["memory"]["margin"] > 0
        assert m["step_time_s"] > 0 and len(m["step_times_s"]) == 4
        assert m["peak_allocated_bytes"] > 0
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] and r["calibrated_factors"]["eff_matmul"] > 0
        assert r["factors_in_force"]["eff_matmul"] > 0 and r["shape"]["batch"] == 4
        assert m["first_step_s"] == m["step_times_s"][0] and p["compile_startup_s"] > 0
    assert json.loads(rows_json.read_text())["compile"] == [] and "Compile start-up: not measured" in text


class Refusing:
    """The magic's part the scaling check calls, fitting only batches of at most ``fits``."""

    def __init__(self, fits: int, error: str = "nothing fits in 74.5 GiB per GPU"):
        self.fits, self.error, self.batches = fits, error, []

    def session(self, line: str, cell: str):
        batch = int(cell.split("torch.randint(0, 128256, (")[1].split(",")[0])
        self.batches.append(batch)
        if batch > self.fits:
            raise RuntimeError(f"%%autoparallel: {self.error} with fix {line!r}")
        return f"session at {batch}"


def test_a_shape_that_does_not_fit_runs_at_half_the_batch():
    c = Refusing(fits=2)
    ap, shape = gpu_check.fitting_session(c, gpu_check.LLAMA_3B, "recompute=none")
    assert (ap, shape.batch, shape.seq, c.batches) == ("session at 2", 2, 2048, [4, 2])
    with pytest.raises(RuntimeError, match="nothing fits"):
        gpu_check.fitting_session(Refusing(fits=0), gpu_check.LLAMA_3B, "recompute=none")
    with pytest.raises(RuntimeError, match="bad cell"):  # only "does not fit" earns a smaller batch
        gpu_check.fitting_session(Refusing(fits=2, error="bad cell"), gpu_check.LLAMA_3B,
                                  "recompute=none")


def test_a_row_past_the_budget_is_skipped_and_says_so():
    plan = SimpleNamespace(cost=SimpleNamespace(step_time_s=0.5))  # 8 steps: 6 s at 1.5 x
    c = SimpleNamespace(deadline=time.monotonic() + 40.0, target=gpu_check.GPU)
    assert gpu_check.budget_verdict(c, plan, compiled=False) is None  # 25 + 6 s
    assert gpu_check.budget_verdict(c, plan, compiled=True).startswith("skipped: needs ~56 s, ")
    row = {"size": "3B", "recompute": "full", "compile": False, "status": "skipped: x"}
    line = gpu_check.scaling_line(row)
    assert line.count(" | ") == gpu_check.SCALING_HEAD.count(" | ")
    assert line.endswith("| skipped: x |")


def scaling_row(compile: bool, first: float, median: float, *, batch: int = 4) -> dict:
    """A measured row of the scaling check as scaling_record writes it, the fields compile_startup reads."""
    fix = gpu_check.scaling_fix(gpu_check.ScalingRow(gpu_check.LLAMA_1B, "none", compile))
    shape = {**dataclasses.asdict(gpu_check.LLAMA_1B), "batch": batch}
    return {"size": "1B", "recompute": "none", "compile": compile, "fix": fix, "shape": shape,
            "predicted": {"compile_startup_s": 20.0}, "factors_in_force": {"compile_s_per_op": 1.25},
            "measured": {"first_step_s": first, "step_time_s": median}}


def test_compile_start_up_is_the_compiled_first_steps_excess_over_the_eager_twins():
    """The compiled row's first step over its median (23.0 s over 162 ms), less what the eager twin's first step
    takes beyond its median (3.0 s over 179 ms: allocations, kernel choices), is Inductor's start-up: 20.0 s
    against 20.0 predicted at 1.25 s/op. A compiled row without a measured eager twin at its batch gives none."""
    eager, compiled = scaling_row(False, 3.0, 0.179), scaling_row(True, 23.0, 0.162)
    (rec,) = gpu_check.compile_startup([eager, scaling_row(False, 9.0, 0.1, batch=2), compiled])
    assert rec["measured_s"] == pytest.approx((23.0 - 0.162) - (3.0 - 0.179))
    assert rec["measured_s_per_op"] == pytest.approx(1.25 * rec["measured_s"] / 20.0)
    line = gpu_check.compile_lines([rec])
    assert line.startswith("Compile start-up (1B, recompute=none, blocks compiled, Inductor's caches off): the first "
                           "step 23.0 s over the median 162.0 ms, less the eager twin's 3.0 s over 179.0 ms: 20.0 s "
                           "measured vs 20.0 s predicted at 1.25 s/op, so 1.25 s/op measured."), line
    assert gpu_check.compile_startup([compiled, scaling_row(False, 3.0, 0.179, batch=2)]) == []
    skipped = {k: v for k, v in eager.items() if k != "measured"} | {"status": "skipped: x"}
    assert gpu_check.compile_startup([skipped, compiled]) == []
    assert gpu_check.compile_lines([]).startswith("Compile start-up: not measured")


def test_a_compiled_row_launches_with_inductors_caches_off(monkeypatch):
    """Its first step then times a whole compile on a rerun too; an eager row's environment is left alone."""
    seen = []
    monkeypatch.setattr(gpu_check, "same_plan_run", lambda c, plan: (None, None, None))
    monkeypatch.setattr(gpu_check, "budget_verdict", lambda c, plan, compiled: None)
    monkeypatch.setattr(gpu_check, "launched", lambda ap, c, *, steps, env=None: seen.append(env) or ("run", {}))
    c = SimpleNamespace(target=gpu_check.GPU, runs=[])
    for compiled in (True, False):
        gpu_check.run_of(c, SimpleNamespace(plan=None), gpu_check.ScalingRow(gpu_check.LLAMA_1B, "none", compiled))
    assert seen == [{"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}, None]


def _fix(text: str) -> dict:
    """A ``--fix`` string as the magic types it: true/false as bools, digits as ints."""
    words = (kv.split("=") for kv in text.split(","))
    return {k: {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v) for k, v in words}


@pytest.fixture(scope="module")
def llama_1b_h200():
    """The check's 1B captured on the meta device, and a planner for it on one H200 (the lent GPU)."""
    import torch

    import autopar_nb as ap
    from autopar_nb import zoo

    s = gpu_check.LLAMA_1B
    with torch.device("meta"):
        model = zoo.Llama(zoo.LlamaConfig(vocab_size=s.vocab, dim=s.dim, n_layers=s.layers, n_heads=s.heads,
                                          n_kv_heads=s.kv_heads, ffn_dim=s.ffn))
    graph = ap.capture(model, torch.randint(0, 100, (s.batch, s.seq), device="meta"))
    cluster = ap.Cluster.preset("h200", 1, 1)
    return lambda fix: ap.plan(graph, cluster, global_batch=s.batch, fix={"amp": "bf16", **_fix(fix)})


def test_each_check_times_what_it_names_on_an_fp8_gpu(llama_1b_h200):
    """On an H200 the planner compiles the 1B and takes Float8 by itself; the memory check's runs pin both off (so
    each is the scaling check's eager row: one launch for both, no torchao needed), the throughput variants and
    the scaling rows pin Float8 off, and only the Float8 check runs it, beside the scaling check's compiled row."""
    plan = llama_1b_h200
    assert plan("recompute=none").precision.float8 == "tensorwise", "the planner's own choice on an H200"
    row = gpu_check.scaling_fix(gpu_check.ScalingRow(gpu_check.LLAMA_1B, "none", False))
    memory = plan(f"recompute=none,{gpu_check.EAGER_BF16}")
    assert memory.precision.float8 == "none" and not any(lp.compile for lp in memory.layers)
    assert memory.diff(plan(row)) == []
    compiled = gpu_check.scaling_fix(gpu_check.ScalingRow(gpu_check.LLAMA_1B, "none", True))
    variant = plan(gpu_check.VARIANTS["compile per block"])
    assert variant.precision.float8 == "none" and variant.diff(plan(compiled)) == []
    assert all("float8=none" in fix for fix in gpu_check.VARIANTS.values())
    f8 = plan(compiled.replace("float8=none", "float8=tensorwise"))
    assert f8.precision.float8 == "tensorwise" and f8.cost.step_time_s < variant.cost.step_time_s


def test_the_float8_verdict_pairs_the_steps_and_holds_them_to_the_tolerance():
    bf16 = (0.162, 0.170, [(0, 11.92), (1, 11.90), (2, 11.80)])
    line = gpu_check.float8_verdict(bf16, (0.142, 0.150, [(0, 11.93), (1, 11.91), (2, 11.81)]), 0.1)
    assert line.startswith("Float8 measured 1.13x bf16's speed (predicted 1.14x); losses over 3 steps within 10% of "
                           "bf16's (largest difference 8.5e-04): 0: 11.9200 / 11.9300"), line
    far = gpu_check.float8_verdict(bf16, (0.142, 0.150, [(0, 11.92), (1, 14.0)]), 0.1)
    assert "losses over 2 steps NOT within 10%" in far
