"""The one prepared GPU check (issue 16): run it once on a machine with a CUDA GPU; it writes the "## GPU" section of
BENCHMARKS.md in at most ~8 minutes.

    make gpu-check                     # = .venv/bin/python bench/gpu_check.py
    .venv/bin/python bench/gpu_check.py --plumbing    # the CPU path on any host (what the test runs)

Every figure comes from the exported script, launched by ``ap.launch`` (what users run; no hand-written training
loop here). On a GPU host, each check is one function below; a failing check is recorded as FAILED with its error
and the others still run; checks past the time budget are recorded as skipped. This process never initialises CUDA
(the workers do), so exclusive-process GPUs work:

1. the exported script of a 1B-class LLaMA in bf16 on one GPU (``--gpu auto``), for recompute none / selective /
   full: CUDA's peak memory vs the planner's prediction, step time vs prediction, NVML samples arriving;
2. ``run.calibrate()`` on the first run, re-plan, run again: the step-time error after;
3. tokens/s and MFU of that script: eager, ``torch.compile`` per block (``--fix compile=true``), the fused linear +
   cross-entropy head (``fused_loss=true``, kernels_ext's op; Liger's Triton kernel when installed), the fused
   RMSNorm (``fused_norm=true``: Liger's kernel when installed, else torch's fused one), both, and compile with
   both;
4. fp16 with GradScaler, verify on CUDA (one rank vs the reference on the same device), and with >= 2 GPUs a
   2-process NCCL run with SyncBatchNorm (with one GPU: recorded as not run, and why).

On a host without a CUDA GPU (or with ``--plumbing``) it says so and runs the same check functions at toy size on
CPU processes (the LLaMA cell shrunk, ``--gpu cpu``, fp32; compile and fp16 left to the GPU: Inductor on two cores
takes minutes and CPUs have no fp16 loss scaling), renders the section into a temporary copy of BENCHMARKS.md, and
exits 0 — so a broken check shows on a CPU host before a GPU is lent.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
BUDGET_S = 480.0
"""the whole check's time budget (issue 16: <= 8 minutes)"""

LLAMA_1B_CELL = """
import torch
from autopar_nb import zoo
cfg = zoo.LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192)
model = zoo.Llama(cfg)
example_inputs = (torch.randint(0, 128256, (4, 2048)),)
"""
"""LLaMA-3.2 1B's shape (1.24 B parameters), 4 x 2048 tokens per step"""

TINY_LLAMA_CELL = LLAMA_1B_CELL.replace("128256", "512").replace("dim=2048, n_layers=16", "dim=64, n_layers=2") \
    .replace("n_heads=32, n_kv_heads=8, ffn_dim=8192", "n_heads=4, n_kv_heads=2, ffn_dim=128").replace("2048)", "32)")
"""the same cell at toy size: the plumbing check"""

BATCHNORM_CELL = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                      nn.Linear(16 * 16 * 16, 10))
example_inputs = (torch.randn(8, 3, 16, 16),)
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """What the checks run on: the 1B LLaMA on one GPU, or the same cell at toy size on CPU processes."""

    cell: str
    gpu: str
    """the magic's --gpu"""
    dtype: str
    """the magic's --dtype"""
    layers_dim_seq: tuple[int, int, int]
    """for the attention FLOPs of the MFU estimate"""
    embedding_params: int
    """the input embedding's parameters (vocab x dim), left out of the MFU estimate's 6 x parameters: a lookup does
    no matmul (torchtitan counts it so)"""
    steps: int
    cuda: bool


GPU = Target(LLAMA_1B_CELL, "auto", "bf16", (16, 2048, 2048), 128256 * 2048, 8, True)
CPU = Target(TINY_LLAMA_CELL, "cpu", "fp32", (2, 64, 32), 512 * 64, 4, False)


class Checker:
    """One GPU check run: the target, the magic's shell, the deadline, the rows of the section, and what a rerun
    narrows (the memory check's recompute ``modes``, the throughput check's ``variants`` by number)."""

    def __init__(self, budget_s: float, target: Target = GPU, *, modes: tuple[str, ...] | None = None,
                 variants: set[int] | None = None, alloc_conf: str = ""):
        from IPython.core.interactiveshell import InteractiveShell

        self.target = target
        self.deadline = time.monotonic() + budget_s
        self.ip = InteractiveShell.instance()
        self.ip.run_line_magic("load_ext", "autopar_nb")
        self.rows: list[tuple[str, str]] = []
        self.modes = modes or ("none", "selective", "full")
        self.variants = variants
        self.first_run = None  # (session, run, summary) of the memory check's first run: calibrate and eager reuse it
        self.alloc_conf = alloc_conf
        """``PYTORCH_CUDA_ALLOC_CONF`` for every launched run ("" = the allocator's defaults): the caching
        allocator's fragmentation under another setting, e.g. ``expandable_segments:True``"""

    def session(self, line: str, cell: str | None = None):
        """The magic on ``cell`` (default: the target's) for the target's device and dtype, plus ``line``."""
        t = self.target
        return self.ip.run_cell_magic("autoparallel", f"--gpu {t.gpu} --dtype {t.dtype} {line}", cell or t.cell)

    def left(self, at_most: float) -> float:
        """Seconds a launch may wait: what is left of the budget plus a minute's grace, at most ``at_most``."""
        return max(10.0, min(at_most, self.deadline - time.monotonic() + 60.0))

    def run(self, title: str, fn) -> None:
        """Run one check, recording its text, FAILED with the error, or skipped when out of time."""
        if time.monotonic() > self.deadline:
            self.rows.append((title, "skipped: the time budget was spent"))
            return
        t0 = time.monotonic()
        try:
            text = fn(self)
        except Exception as e:  # one broken check must not hide the others' figures
            text = f"FAILED: {type(e).__name__}: {str(e)[:400]}"
        self.rows.append((title, f"{text} ({time.monotonic() - t0:.0f} s)"))
        print(f"[{title}] {self.rows[-1][1]}", flush=True)

def launched(ap, c: Checker, *, steps: int, **flags):
    """Launch ``ap``'s plan on one process (cold, so no pool holds the GPU) and return (run, summary); the run may
    take what is left of the check's time (at most 240 s)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": c.alloc_conf} if c.alloc_conf else None
    run = ap.launch(nproc=1, steps=steps, warm=False, env=env, **flags)
    status = run.wait(timeout=c.left(240.0))
    if status != "finished":
        run.stop()
        raise RuntimeError(f"run {status}: {run.message}")
    return run, run.summary()


def pct(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return "n/a"
    return f"{(predicted - measured) / measured:+.1%}"


GiB = 2**30


def check_memory_and_time(c: Checker) -> str:
    """Recompute none / selective / full: peak memory vs predicted (CUDA's peak allocated, beside the planner's
    figure before its allocator margin; RSS on CPU), the caching allocator's peak reserve over that peak (its
    fragmentation: what the margin must cover), step time vs predicted, device samples with NVML figures."""
    lines = ([f"Runs with `PYTORCH_CUDA_ALLOC_CONF={c.alloc_conf}`:", ""] if c.alloc_conf else []) + [
        "| recompute | predicted peak (before margin) | measured peak | error | peak reserved | reserve over "
        "peak | predicted step | measured step | error | NVML samples |", "|---" * 10 + "|"]
    c.first_run = None
    for mode in c.modes:
        ap = c.session(f"--gpus 1 --fix recompute={mode}")
        run, s = launched(ap, c, steps=c.target.steps)
        c.first_run = c.first_run or (ap, run, s)
        m0 = ap.plan.cost.memory_by_rank[0]
        meas, pred = s["memory_by_rank"].get(0), m0.total - m0.margin
        reserved = (s.get("reserved_by_rank") or {}).get(0)
        over = f"{reserved / meas - 1:+.1%}" if reserved and meas else "n/a"
        lines.append(f"| {mode} | {pred / GiB:.3f} GiB | {meas / GiB:.3f} GiB ({s['memory_kind']}) | "
                     f"{pct(meas, pred)} | {reserved / GiB if reserved else float('nan'):.3f} GiB | {over} | "
                     f"{s['predicted_step_time_s'] * 1e3:.1f} ms | {s['step_time_s'] * 1e3:.1f} ms "
                     f"| {pct(s['step_time_s'], s['predicted_step_time_s'])} | {nvml_samples(run)} |")
    return "\n" + "\n".join(lines)


def nvml_samples(run) -> int:
    """Device samples that carry NVML figures (whatever source the rank's memory figure was taken from)."""
    return sum(1 for x in run.samples if x.get("nvml_used_bytes") is not None)


def check_calibrate(c: Checker) -> str:
    """run.calibrate() on the recompute=none run, re-plan, run again: the step-time error before and after."""
    if c.first_run is None:
        raise RuntimeError("needs the memory check's recompute=none run (check 1)")
    ap, run, before = c.first_run
    factors = run.calibrate()
    _, after = launched(c.session("--gpus 1 --fix recompute=none"), c, steps=c.target.steps)
    return (f"factors {json.dumps({k: round(v, 3) for k, v in factors.items()})}; step-time error before "
            f"{pct(before['step_time_s'], before['predicted_step_time_s'])}, after "
            f"{pct(after['step_time_s'], after['predicted_step_time_s'])}")


VARIANTS = {"eager": "compile=false,fused_loss=false,fused_norm=false",
            "fused linear-cross-entropy + fused RMSNorm": "compile=false,fused_loss=true,fused_norm=true",
            "compile per block": "compile=true,fused_loss=false,fused_norm=false",
            "compile + fused linear-cross-entropy + fused RMSNorm": "compile=true,fused_loss=true,fused_norm=true",
            "fused linear-cross-entropy": "compile=false,fused_loss=true,fused_norm=false",
            "fused RMSNorm": "compile=false,fused_loss=false,fused_norm=true"}
"""the exported script's variants (the plan's ``--fix``), in the order they run (the compiled ones take longest: one
past the budget is skipped); compile only on GPUs (CPU: tests/test_compile.py)"""
CPU_VARIANTS = ("eager", "fused linear-cross-entropy + fused RMSNorm")
"""what the plumbing path runs (two toy runs: the others differ only in the plan's flags; the eager one is the
memory check's recompute=none run where the plans agree, :func:`same_plan_run`)"""


def check_throughput(c: Checker) -> str:
    """Tokens/s and MFU of the exported script, eager vs compiled blocks vs the fused head and loss, the fused
    RMSNorms, both, and compiled with both; each run's loss at its first and last step (the same seed and batches:
    a variant whose losses stray from eager's computes something else)."""
    names = [v for v in VARIANTS if c.target.cuda or v in CPU_VARIANTS]
    names = [v for k, v in enumerate(names, 1) if c.variants is None or k in c.variants]
    lines = ["| variant | tokens/s | MFU | loss at first / last step | plan |", "|---|---|---|---|---|"]
    for name in names:
        if c.left(1e9) <= 60.0:  # past the budget: the rest are not started
            lines.append(f"| {name} | skipped: the time budget was spent | | | |")
            continue
        ap = c.session(f"--gpus 1 --fix {VARIANTS[name]}")
        (run, s), reused = same_plan_run(c, ap.plan), " (the recompute=none run above: the same plan)"
        if s is None:
            (run, s), reused = launched(ap, c, steps=c.target.steps), ""
        tokens_per_s = tokens_per_step(ap.plan) / s["step_time_s"]
        mesh = ap.plan.summary().split(" | ")[0]  # the summary's first part: no "|" inside a table cell
        curve = run.loss_curve(0)
        losses = f"{curve[0][1]:.4f} / {curve[-1][1]:.4f}" if curve else "n/a"
        lines.append(f"| {name} | {tokens_per_s:,.0f} | {mfu(c, ap.plan, tokens_per_s):.1%} | {losses} | "
                     f"{mesh}{reused} |")
    return "\n" + "\n".join(lines)


def same_plan_run(c: Checker, plan) -> tuple:
    """(run, summary) of the memory check's recompute=none run where its plan decides everything as ``plan`` does
    (``Plan.diff`` empty: the planner's eager variant often is that plan), so that one launch is not repeated;
    (None, None) otherwise."""
    first = c.first_run
    if first is None or first[0].plan.diff(plan):
        return None, None
    return first[1], first[2]


def tokens_per_step(plan) -> int:
    return plan.batch.global_batch * (plan.batch.seq_len or 1)


def mfu(c: Checker, plan, tokens_per_s: float) -> float:
    """Model FLOPs utilisation: (6 x the parameters but the input embedding's + attention, as torchtitan estimates
    it) per token, over the device's datasheet peak for the plan's precision."""
    from autopar_nb.hardware import Cluster

    layers, dim, seq = c.target.layers_dim_seq
    flops_per_token = 6 * (plan.model["num_params"] - c.target.embedding_params) + 12 * layers * dim * seq
    cluster = Cluster.detect() if c.target.cuda else Cluster.preset("cpu")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(plan.precision.amp, "float32")
    return flops_per_token * tokens_per_s / cluster.device.flops(dtype)


def check_fp16_and_verify(c: Checker) -> str:
    """fp16 with GradScaler on one GPU, then verify (one rank vs the reference on the ranks' device, TF32 off)."""
    fp16 = "not run on CPU (fp16 loss scaling is a GPU path)"
    if c.target.cuda:
        _, s = launched(c.session("--gpus 1 --fix amp=fp16", TINY_LLAMA_CELL), c, steps=20)
        fp16 = f"{s['status']} after {s['steps']} steps"
    ap32 = c.session("--gpus 1 --fix amp=none", TINY_LLAMA_CELL)
    report = ap32.verify(steps=3, nproc=1, warm=False)
    where = "CUDA" if c.target.cuda else "CPU"
    return f"fp16 + GradScaler: {fp16}; verify fp32 on {where}: ok={report.ok}"


def check_two_processes(c: Checker) -> str:
    """With >= 2 GPUs: 2 processes (NCCL) training a BatchNorm model with SyncBatchNorm, NVML samples per rank
    (on CPU: 2 gloo processes with the CPU SyncBatchNorm)."""
    from autopar_nb.hardware import visible_gpus

    if c.target.cuda and len(visible_gpus()) < 2:
        return ("not run: one GPU, and the exported script refuses more local processes than GPUs (gloo on one "
                "GPU would need a script option that does not exist yet)")
    ap = c.session("--gpus 2 --fix dp=2,amp=none", BATCHNORM_CELL)
    run = ap.launch(nproc=2, steps=c.target.steps, warm=False)
    status = run.wait(timeout=c.left(240.0))
    if status != "finished":
        raise RuntimeError(f"run {status}: {run.message}")
    ranks = sorted({x["rank"] for x in run.samples if x.get("nvml_used_bytes") is not None})
    return f"{status}; sync_batchnorm={ap.plan.sync_batchnorm}; NVML samples from ranks {ranks}"


CHECKS = [("memory and step time vs the planner (LLaMA 1B, bf16, 1 GPU)", check_memory_and_time),
          ("calibrate", check_calibrate),
          ("fp16 GradScaler and verify on CUDA", check_fp16_and_verify),
          ("2 processes, SyncBatchNorm, NVML", check_two_processes),
          ("throughput of the exported script: eager / compile / compile + fused head", check_throughput)]
"""in the order they run: the compiled variants, the longest, last (one past the budget is skipped)"""


def header() -> str:
    """Device, driver, torch and date, from NVML (no CUDA here)."""
    import torch

    from autopar_nb.hardware import visible_gpus

    gpus = visible_gpus()
    driver = "unknown"
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception:
        pass
    names = ", ".join(sorted({g.name for g in gpus})) or "no GPU"
    return (f"`make gpu-check` — {datetime.date.today().isoformat()}, {len(gpus)} x {names}, driver {driver}, "
            f"torch {torch.__version__}.")


def render(head: str, rows: list[tuple[str, str]]) -> str:
    body = [f"## GPU\n\n{head}\n"]
    body += [f"**{title}**: {text}\n" for title, text in rows]
    return "\n".join(body)


def run_checks(c: Checker, only: set[int] | None = None, after=None) -> list[tuple[str, str]]:
    """Run the checks numbered ``only`` (1-based, in :data:`CHECKS`; default all), calling ``after()`` after each
    (so a run cut off later keeps what it measured)."""
    for k, (title, fn) in enumerate(CHECKS, 1):
        if only is None or k in only:
            c.run(title, fn)
            if after is not None:
                after()
    return c.rows


def plumbing(budget_s: float, only: set[int] | None = None, *, modes: tuple[str, ...] | None = None,
             alloc_conf: str = "") -> int:
    """The CPU path: say there is no GPU, run every check at toy size on CPU processes, render the section into a
    temporary copy of BENCHMARKS.md; exit 1 when a check failed (0 otherwise)."""
    from capture import write_section

    from autopar_nb.hardware import visible_gpus

    print(f"no CUDA GPU here ({len(visible_gpus())} visible) or --plumbing: the GPU checks run at toy size on CPU")
    with tempfile.TemporaryDirectory() as tmp:
        # the calibrate check must not leave toy-run factors in the user's calibration file
        os.environ["AUTOPAR_CALIBRATION"] = str(Path(tmp) / "calibration.json")
        rows = run_checks(Checker(budget_s, CPU, modes=modes, alloc_conf=alloc_conf), only)
        copy = Path(tmp) / "BENCHMARKS.md"
        shutil.copy(ROOT / "BENCHMARKS.md", copy)
        write_section("GPU", render(header(), rows), copy)
        assert "## GPU\n" in copy.read_text()
    failed = [title for title, text in rows if text.startswith(("FAILED", "skipped"))]
    if failed:
        print(f"plumbing FAILED: {', '.join(failed)}")
        return 1
    print(f"plumbing ok: {len(rows)} checks ran on CPU, the section rendered")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plumbing", action="store_true", help="run the CPU path even on a GPU host")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="time budget (default 480 s)")
    p.add_argument("--only", help="the checks to run, by number (1-5, comma-separated; default all): a rerun")
    p.add_argument("--copy-to", type=Path, help="copy BENCHMARKS.md into this folder after each check")
    p.add_argument("--variants", help="the throughput check's variants to run, by number (1-6, in VARIANTS' order)")
    p.add_argument("--recompute", help="the memory check's recompute modes (default: none,selective,full)")
    p.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the launched runs, e.g. "
                   "expandable_segments:True (the allocator's fragmentation under it: --only 1 --alloc-conf ...)")
    args = p.parse_args(argv)
    only = {int(k) for k in args.only.split(",")} if args.only else None
    variants = {int(k) for k in args.variants.split(",")} if args.variants else None
    from autopar_nb.hardware import visible_gpus

    modes = tuple(args.recompute.split(",")) if args.recompute else None
    if args.plumbing or not visible_gpus():
        return plumbing(args.budget_s, only, modes=modes, alloc_conf=args.alloc_conf)
    from capture import write_section

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    head, c = header(), Checker(args.budget_s, GPU, modes=modes, variants=variants, alloc_conf=args.alloc_conf)

    def written() -> None:
        write_section("GPU", render(head, c.rows))
        if args.copy_to:
            shutil.copy(ROOT / "BENCHMARKS.md", args.copy_to)

    run_checks(c, only, written)
    print("wrote the GPU section of BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
