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
   2-process NCCL run with SyncBatchNorm (with one GPU: recorded as not run, and why);
5. CPU offload (``--fix offload=cpu``, check 7): verify on CUDA with pinned host shards, then step time and device
   peak against the planner's host-copy and CPU-optimizer prediction;
6. Float8 (``--fix float8=tensorwise``, check 8) beside bf16 on the compiled 1B: tokens/s of each against the
   planner's step times, and the two loss curves step by step within verify's float8 tolerance (10 %). The
   workers import torchao: an offline GPU host needs its wheel (``make setup`` installs it).

Every check but the last pins Float8 off (``float8=none``), and the memory check compile off: on an FP8 GPU the
planner takes both by itself for the 1B, and each table names what it times.

The scaling check (``--only 6``; it runs second, right after check 1) measures what the cost
model's GPU efficiency factors are fitted from: LLaMA at three sizes that fit one GPU, bf16, one
micro-batch of 4 x 2048 tokens, each through the exported script:

    row  size  widths                              recompute  compile  H200 estimate
    1    1B    LLaMA-3.2 1B (dim 2048, 16 layers)  none       eager    ~3 s (check 1's run reused)
    2    1B                                        full       eager    ~3 s (check 1's run reused)
    3    3B    LLaMA-3.2 3B (dim 3072, 28 layers)  none       eager    ~35 s
    4    0.5B  dim 1024, 24 layers, ffn 4096       none       eager    ~30 s
    5    3B                                        full       eager    ~35 s
    6    0.5B                                      full       eager    ~30 s
    7    1B                                        none       compile  ~50 s (reused by the
                                                                       throughput check)

A row's estimate: planning (~3 s) + a launch (~25 s: worker start, model on the device, first step)
+ 8 steps at up to 1.5 x the planner's step time (H200: 91 / 179 / 450 ms without recompute for
0.5B / 1B / 3B, 115 / 223 / 570 ms with full) + Inductor's ~25 s for the compiled row. The check:
~3 minutes, ~2.5 net of the launch it saves the throughput check. The H200 run of checks 1-5 took
336 s, the wheels' install included, so the default run is ~7.5-8 minutes by this estimate, within
the 480 s budget; a row whose estimate exceeds what is left of ``--budget-s`` is recorded as
skipped, as are the throughput variants after it.

Memory: the 3B keeps 54 GiB of float32 weights, gradients and Adam moments; the planner predicts
89 GiB (+ 5.5 GiB margin) without recompute at 4 x 2048, and 67 GiB (+ 4.4) with full recompute (the
optimizer step's peak). A row the planner does not fit on the device runs at half the batch (again,
down to 1): on an 80 GB H100 (74.5 GiB usable) the 3B without recompute runs at 2 x 2048 (68 GiB +
4.4), with full recompute at 4 x 2048; on an H200 every row runs at 4 x 2048. The row and the JSON
say the batch run.

Per row: the planner's step time (``plan.cost.step_time_s``) with its compute, exposed comm and
optimizer parts vs the measured median step (the first step, compile included, left out); its peak
before the allocator margin vs ``max_memory_allocated``, with ``max_memory_reserved`` and the reserve
over the allocated peak; tokens/s, MFU, and the factors ``run.calibrate(save=False)`` fits from the run.
Under the table, the compile start-up that ``compile_s_per_op`` prices: the compiled 1B's first
step over its median, less the eager 1B's (Inductor's caches off for the compiled row), beside the
planner's start-up figure and the s/op that would have predicted it.
``bench/gpu_check.json`` (``--json``; ``--copy-to`` copies it) holds each row's raw numbers for an
offline fit: the shape, the plan's whole predicted cost (its compile start-up included) and rank 0's
memory terms, the factors the prediction was made with, every step's time, the measured peaks; and
under ``"compile"`` the compile start-up records.

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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
BUDGET_S = 480.0
"""the whole check's time budget (issue 16: <= 8 minutes)"""

LLAMA_CELL = """
import torch
from autopar_nb import zoo
cfg = zoo.LlamaConfig(vocab_size={vocab}, dim={dim}, n_layers={layers}, n_heads={heads},
                      n_kv_heads={kv_heads}, ffn_dim={ffn})
model = zoo.Llama(cfg)
example_inputs = (torch.randint(0, {vocab}, ({batch}, {seq})),)
"""


@dataclasses.dataclass(frozen=True)
class Shape:
    """A LLaMA shape (zoo ``Llama``: untied head) and the batch x sequence it trains on."""

    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    batch: int = 4
    seq: int = 2048

    def cell(self) -> str:
        return LLAMA_CELL.format(**dataclasses.asdict(self))

    @property
    def layers_dim_seq(self) -> tuple[int, int, int]:
        return self.layers, self.dim, self.seq

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim


LLAMA_1B = Shape("1B", dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192)
"""LLaMA-3.2 1B's shape (1.24 B parameters; 1.50 B here with the head untied), 4 x 2048 tokens"""
LLAMA_05B = Shape("0.5B", dim=1024, layers=24, heads=16, kv_heads=8, ffn=4096)
"""a 0.5B-class LLaMA (0.51 B parameters counted as LLaMA-3.2 counts its 1B, 0.64 B built): 1B's
vocabulary and head size, half its width, more layers"""
LLAMA_3B = Shape("3B", dim=3072, layers=28, heads=24, kv_heads=8, ffn=8192)
"""LLaMA-3.2 3B's widths (3.61 B parameters built)"""
TINY = Shape("tiny", dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, seq=32)
"""the 1B cell at toy size: the plumbing check"""
TINY_SMALL = dataclasses.replace(TINY, name="tiny-32", dim=32, ffn=64)
"""a second toy size for the plumbing path's scaling rows"""

LLAMA_1B_CELL = LLAMA_1B.cell()
TINY_LLAMA_CELL = TINY.cell()

BATCHNORM_CELL = """
import torch, torch.nn as nn
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                      nn.Linear(16 * 16 * 16, 10))
example_inputs = (torch.randn(8, 3, 16, 16),)
"""


class ScalingRow(NamedTuple):
    """One row of the scaling check: a shape, its recompute mode, compiled blocks or eager."""

    shape: Shape
    recompute: str
    compile: bool


GPU_SCALING = (ScalingRow(LLAMA_1B, "none", False), ScalingRow(LLAMA_1B, "full", False),
               ScalingRow(LLAMA_3B, "none", False), ScalingRow(LLAMA_05B, "none", False),
               ScalingRow(LLAMA_3B, "full", False), ScalingRow(LLAMA_05B, "full", False),
               ScalingRow(LLAMA_1B, "none", True))
"""eager without recompute at each size first (the efficiency factors' three points), then full
recompute (its recompute term), then one compiled size: the 1B, whose run the throughput check's
compiled variant reuses. The 1B eager rows reuse the memory check's runs (the same plans)."""
CPU_SCALING = (ScalingRow(TINY, "none", False), ScalingRow(TINY, "full", False),
               ScalingRow(TINY_SMALL, "none", False), ScalingRow(TINY_SMALL, "full", False),
               ScalingRow(TINY, "none", True))
"""the plumbing path's: two launches (the tiny rows reuse the memory check's), the compiled row not
run"""


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
    scaling: tuple[ScalingRow, ...] = ()
    """the scaling check's rows, most valuable first (a row past the budget is skipped)"""


GPU = Target(LLAMA_1B_CELL, "auto", "bf16", LLAMA_1B.layers_dim_seq, LLAMA_1B.embedding_params, 8,
             True, GPU_SCALING)
CPU = Target(TINY_LLAMA_CELL, "cpu", "fp32", TINY.layers_dim_seq, TINY.embedding_params, 4, False,
             CPU_SCALING)


class Checker:
    """One GPU check run: the target, the magic's shell, the deadline, the rows of the section, and what a rerun
    narrows (the memory check's recompute ``modes``, the throughput check's ``variants`` by number)."""

    def __init__(self, budget_s: float, target: Target = GPU, *, modes: tuple[str, ...] | None = None,
                 variants: set[int] | None = None, alloc_conf: str = "",
                 scaling_rows: set[int] | None = None, json_path: Path | None = None):
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
        self.runs: list[tuple[str, object, object, dict]] = []
        """(label, session, run, summary) of every launch so far: a later check whose plan is the
        same reuses the run instead of launching it again (:func:`same_plan_run`)"""
        self.scaling_rows = scaling_rows
        """the scaling check's rows to run, by number (None: all)"""
        self.json_path = json_path
        """where the scaling check writes its rows' raw numbers (None: nowhere)"""

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

def launched(ap, c: Checker, *, steps: int, env: dict | None = None, **flags):
    """Launch ``ap``'s plan on one process (cold, so no pool holds the GPU) and return (run, summary); the run may
    take what is left of the check's time (at most 240 s). ``env``: more environment for the worker."""
    env = {**({"PYTORCH_CUDA_ALLOC_CONF": c.alloc_conf} if c.alloc_conf else {}), **(env or {})} or None
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
        ap = c.session(f"--gpus 1 --fix recompute={mode},{EAGER_BF16}")
        run, s = launched(ap, c, steps=c.target.steps)
        c.first_run = c.first_run or (ap, run, s)
        c.runs.append((f"the recompute={mode} run above", ap, run, s))
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
    _, after = launched(c.session(f"--gpus 1 --fix recompute=none,{EAGER_BF16}"), c, steps=c.target.steps)
    return (f"factors {json.dumps({k: round(v, 3) for k, v in factors.items()})}; step-time error before "
            f"{pct(before['step_time_s'], before['predicted_step_time_s'])}, after "
            f"{pct(after['step_time_s'], after['predicted_step_time_s'])}")


EAGER_BF16 = "compile=false,float8=none"
"""what the memory check's runs pin: on an FP8 GPU the planner compiles the 1B and takes Float8 by itself (H200:
142 ms/step predicted against 179 eager), which would time another step than the table names and need torchao; so
pinned, each run is the scaling check's eager row of its recompute (the same plan: one launch serves both)"""
VARIANTS = {"eager": "compile=false,fused_loss=false,fused_norm=false,float8=none",
            "fused linear-cross-entropy + fused RMSNorm": "compile=false,fused_loss=true,fused_norm=true,float8=none",
            "compile per block": "compile=true,fused_loss=false,fused_norm=false,float8=none",
            "compile + fused linear-cross-entropy + fused RMSNorm":
                "compile=true,fused_loss=true,fused_norm=true,float8=none",
            "fused linear-cross-entropy": "compile=false,fused_loss=true,fused_norm=false,float8=none",
            "fused RMSNorm": "compile=false,fused_loss=false,fused_norm=true,float8=none"}
"""the exported script's variants (the plan's ``--fix``), in the order they run (the compiled ones take longest: one
past the budget is skipped); compile only on GPUs (CPU: tests/test_compile.py); Float8 pinned off (its own check)"""
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
        run, s, label = same_plan_run(c, ap.plan)
        reused = f" ({label}: the same plan)" if label else ""
        if s is None:
            run, s = launched(ap, c, steps=c.target.steps)
        tokens_per_s = tokens_per_step(ap.plan) / s["step_time_s"]
        mesh = ap.plan.summary().split(" | ")[0]  # the summary's first part: no "|" inside a table cell
        curve = run.loss_curve(0)
        losses = f"{curve[0][1]:.4f} / {curve[-1][1]:.4f}" if curve else "n/a"
        lines.append(f"| {name} | {tokens_per_s:,.0f} | {mfu(c, ap.plan, tokens_per_s):.1%} | {losses} | "
                     f"{mesh}{reused} |")
    return "\n" + "\n".join(lines)


def same_plan_run(c: Checker, plan) -> tuple:
    """(run, summary, label) of the first run launched so far whose plan decides everything as
    ``plan`` does (``Plan.diff`` empty: the planner's eager variant often is the memory check's
    recompute=none plan, its compiled one the scaling check's compiled 1B), so that one launch is
    not repeated; (None, None, None) otherwise."""
    for label, ap, run, s in c.runs:
        if not ap.plan.diff(plan):
            return run, s, label
    return None, None, None


def tokens_per_step(plan) -> int:
    return plan.batch.global_batch * (plan.batch.seq_len or 1)


def mfu(c: Checker, plan, tokens_per_s: float, shape: Shape | None = None) -> float:
    """Model FLOPs utilisation: (6 x the parameters but the input embedding's + attention, as torchtitan estimates
    it) per token, over the device's datasheet peak for the plan's precision; of ``shape`` (default:
    the target's model)."""
    from autopar_nb.hardware import Cluster

    layers, dim, seq = shape.layers_dim_seq if shape else c.target.layers_dim_seq
    embedding = shape.embedding_params if shape else c.target.embedding_params
    flops_per_token = 6 * (plan.model["num_params"] - embedding) + 12 * layers * dim * seq
    cluster = Cluster.detect() if c.target.cuda else Cluster.preset("cpu")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(plan.precision.amp, "float32")
    return flops_per_token * tokens_per_s / cluster.device.flops(dtype)


LAUNCH_S = 25.0
"""a launch's fixed seconds on one GPU: the worker's start, the model built on the device, the first
step's allocations and kernel choices (the H200 run's launches of the 1B took 20-30 s each)"""
COMPILE_S = 25.0
"""what Inductor adds to a launch (the layers share one compiled graph): the H200 run's two compiled
launches took about 45 s each"""
SLOWER = 1.5
"""measured over predicted step time that a row's estimate allows (the H200 run: up to 1.3)"""


def check_scaling(c: Checker) -> str:
    """Three LLaMA sizes on one GPU, recompute none and full, eager and (one size) compiled: per row
    the planner's step time (and its compute / exposed comm / optimizer parts) vs the measured
    median step, its peak before the margin vs CUDA's peak allocated and reserved, tokens/s, MFU and
    the factors ``run.calibrate()`` would fit. The raw numbers go to ``c.json_path`` after each row,
    so that the efficiency factors can be fitted from them offline and a run cut short keeps its
    rows."""
    out = {"header": header(), "steps_per_run": c.target.steps, "rows": [], "compile": []}
    for k, row in enumerate(c.target.scaling, 1):
        if c.scaling_rows is None or k in c.scaling_rows:
            out["rows"].append(scaling_record(c, row))
            print(f"  [scaling {k}] {scaling_line(out['rows'][-1])}", flush=True)
            out["compile"] = compile_startup(out["rows"])
            write_json(c.json_path, out)
    return "\n" + "\n".join([SCALING_HEAD, "|---" * SCALING_HEAD.count(" | ") + "|---|"]
                            + [scaling_line(r) for r in out["rows"]] + ["", compile_lines(out["compile"])])


COLD_COMPILE = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
"""a compiled row's worker environment: Inductor's caches off, so that its first step times a whole compile, as on
a fresh machine, on a rerun too (``bench/compile.py`` likewise)"""


def compile_startup(rows: list[dict]) -> list[dict]:
    """Inductor's start-up, measured: per compiled row with an eager twin (the same shape and batch, recompute and
    fix but compile), the compiled run's first step over its median step, less the eager twin's (the first step's
    other one-off costs: allocations, kernel choices); beside the planner's figure (``plan.levers``' compile
    start-up) and the ``compile_s_per_op`` that would have predicted the measured one (the figure is that factor
    times the compiled graphs' ops)."""
    out = []
    for r in rows:
        if not r["compile"] or "measured" not in r:
            continue
        twin = next((e for e in rows if not e["compile"] and "measured" in e and e["shape"] == r["shape"]
                     and e["fix"] == r["fix"].replace("compile=true", "compile=false")), None)
        if twin is None or None in (r["measured"]["first_step_s"], twin["measured"]["first_step_s"]):
            continue
        excess = [x["measured"]["first_step_s"] - x["measured"]["step_time_s"] for x in (r, twin)]
        predicted, per_op = r["predicted"]["compile_startup_s"], r["factors_in_force"]["compile_s_per_op"]
        measured = excess[0] - excess[1]
        out.append({"size": r["size"], "recompute": r["recompute"], "measured_s": measured,
                    "first_step_s": r["measured"]["first_step_s"], "step_time_s": r["measured"]["step_time_s"],
                    "eager_first_step_s": twin["measured"]["first_step_s"],
                    "eager_step_time_s": twin["measured"]["step_time_s"], "predicted_s": predicted,
                    "compile_s_per_op": per_op,
                    "measured_s_per_op": per_op * measured / predicted if predicted else None})
    return out


def compile_lines(records: list[dict]) -> str:
    """The compile start-up under the scaling table: one sentence per measured compiled row, or why none."""
    if not records:
        return ("Compile start-up: not measured (no compiled row ran beside its eager twin; on CPU the compiled row "
                "is not run).")
    return "\n".join(
        f"Compile start-up ({r['size']}, recompute={r['recompute']}, blocks compiled, Inductor's caches off): the "
        f"first step {r['first_step_s']:.1f} s over the median {ms(r['step_time_s'])}, less the eager twin's "
        f"{r['eager_first_step_s']:.1f} s over {ms(r['eager_step_time_s'])}: {r['measured_s']:.1f} s measured vs "
        f"{r['predicted_s']:.1f} s predicted at {r['compile_s_per_op']:g} s/op"
        + (f", so {r['measured_s_per_op']:.2f} s/op measured." if r["measured_s_per_op"] is not None else ".")
        for r in records)


def scaling_record(c: Checker, row: ScalingRow) -> dict:
    """One row's raw numbers; ``status`` says whether it was launched, reused, skipped or failed."""
    rec: dict = {"size": row.shape.name, "recompute": row.recompute, "compile": row.compile}
    if row.compile and not c.target.cuda:
        return {**rec, "status": "not run on CPU (Inductor on two cores takes minutes)"}
    if time.monotonic() > c.deadline:
        return {**rec, "status": "skipped: the time budget was spent"}
    t0, rec["fix"] = time.monotonic(), scaling_fix(row)
    try:
        ap, shape = fitting_session(c, row.shape, rec["fix"])
        rec.update(predicted_figures(ap, shape))
        run, s, rec["status"] = run_of(c, ap, row)
        if run is not None:
            rec.update(measured_figures(c, ap.plan, shape, run, s))
    except Exception as e:  # one failed row (an out-of-memory, say) must not hide the others
        rec["status"] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def run_of(c: Checker, ap, row: ScalingRow) -> tuple:
    """(run, summary, status) of the row: an earlier run of the same plan, a launch, or (None, None,
    why not) when the row's estimate does not fit what is left of the budget."""
    run, s, label = same_plan_run(c, ap.plan)
    if run is not None:
        return run, s, f"reused: {label}"
    skipped = budget_verdict(c, ap.plan, row.compile)
    if skipped:
        return None, None, skipped
    run, s = launched(ap, c, steps=c.target.steps, env=COLD_COMPILE if row.compile else None)
    c.runs.append((f"the scaling check's {row_name(row)} run", ap, run, s))
    return run, s, "launched"


def row_name(row: ScalingRow) -> str:
    return f"{row.shape.name} recompute={row.recompute}" + (" compile" if row.compile else "")


def scaling_fix(row: ScalingRow) -> str:
    """Everything that changes the step's kernels pinned, so each row measures what it names; one
    micro-batch, so the step is the whole batch's forward and backward once."""
    return (f"recompute={row.recompute},micro_batches=1,compile={str(row.compile).lower()},"
            "fused_loss=false,fused_norm=false,float8=none")


def fitting_session(c: Checker, shape: Shape, fix: str) -> tuple:
    """(session, shape) for ``shape`` with ``fix`` on one device, the batch halved until the planner
    fits it there: the 3B without recompute is predicted at 95 GiB with the margin for 4 x 2048,
    so an 80 GB H100 runs it at 2 x 2048 (an H200 at 4 x 2048)."""
    while True:
        try:
            return c.session(f"--gpus 1 --fix {fix}", shape.cell()), shape
        except Exception as e:  # the magic's UsageError; only "does not fit" earns a smaller batch
            if "nothing fits" not in str(e) or shape.batch == 1:
                raise
        shape = dataclasses.replace(shape, batch=shape.batch // 2)


def budget_verdict(c: Checker, plan, compiled: bool) -> str | None:
    """Why the row is skipped ("skipped: ..."), or None when its estimated seconds fit what is
    left."""
    steps_s = c.target.steps * plan.cost.step_time_s * SLOWER
    need = LAUNCH_S + (COMPILE_S if compiled else 0.0) + steps_s
    left = c.deadline - time.monotonic()
    if need <= left:
        return None
    return f"skipped: needs ~{need:.0f} s, {max(0.0, left):.0f} s of the budget left"


def predicted_figures(ap, shape: Shape) -> dict:
    """The shape as run (its cell re-plans the row), the plan and the cluster it was made for, its
    whole predicted cost (rank 0's memory terms included) and the factors it was made with: what an
    offline fit re-weights."""
    from autopar_nb.cost.factors import factors_for

    cost = ap.plan.cost
    m0 = cost.memory_by_rank[0]
    predicted = {k: v for k, v in dataclasses.asdict(cost).items() if k != "memory_by_rank"}
    lever = next((lv for lv in ap.plan.levers if lv.name == "compile"), None)
    # the compiled layers' start-up, compiled or not (an eager plan's lever prices compiling it)
    predicted.update(peak_before_margin_bytes=m0.total - m0.margin, memory=dataclasses.asdict(m0),
                     compile_startup_s=lever.startup_s if lever else None)
    return {"shape": dataclasses.asdict(shape), "params": ap.plan.model["num_params"],
            "plan": ap.plan.summary().split(" | ")[0], "micro_batches": ap.plan.batch.micro_batches,
            "cluster": ap.plan.cluster, "precision": ap.plan.precision.amp,
            "predicted": predicted, "factors_in_force": dataclasses.asdict(factors_for(ap.cluster))}


def measured_figures(c: Checker, plan, shape: Shape, run, s: dict) -> dict:
    """What the run measured (rank 0), and the factors ``run.calibrate()`` fits from it (not
    saved)."""
    step = s["step_time_s"]
    tokens_per_s = tokens_per_step(plan) / step if step else None
    times = [r["step_time_s"] for r in run.metrics if r["rank"] == 0 and r.get("step_time_s")]
    measured = {"step_time_s": step, "step_times_s": times, "steps": s["steps"],
                "first_step_s": times[0] if times else None,
                "peak_allocated_bytes": s["memory_by_rank"].get(0),
                "peak_reserved_bytes": (s.get("reserved_by_rank") or {}).get(0),
                "memory_kind": s["memory_kind"], "tokens_per_s": tokens_per_s,
                "mfu": mfu(c, plan, tokens_per_s, shape) if tokens_per_s else None}
    try:
        fitted = run.calibrate(save=False)
    except (ValueError, RuntimeError) as e:
        fitted = {"error": str(e)}
    return {"measured": measured, "calibrated_factors": fitted}


SCALING_HEAD = ("| size | recompute | compile | batch x seq "
                "| predicted step (compute + exposed comm + optimizer) | measured step | error "
                "| predicted peak (before margin) | measured peak | error | peak reserved "
                "| reserve over peak | tokens/s | MFU | calibrate's matmul efficiency | run |")


def scaling_line(r: dict) -> str:
    """A row of the scaling table; a row without measurements says why in its run cell."""
    cells = [f"{r['size']}", r["recompute"], "compile" if r["compile"] else "eager"]
    if "measured" not in r:
        blanks = [""] * (SCALING_HEAD.count(" | ") - 3)
        return "| " + " | ".join(cells + blanks + [r["status"]]) + " |"
    p, m, sh = r["predicted"], r["measured"], r["shape"]
    alloc, reserved = m["peak_allocated_bytes"], m["peak_reserved_bytes"]
    pred_peak = p["peak_before_margin_bytes"]
    over = f"{reserved / alloc - 1:+.1%}" if reserved and alloc else "n/a"
    # the factor the row's matmuls ran at: tensor cores in bf16 / fp16, fp32 on the plumbing path
    eff = r["calibrated_factors"].get("eff_matmul" if r["precision"] in ("bf16", "fp16") else
                                      "eff_fp32_matmul")
    parts = f"{ms(p['compute_s'])} + {ms(p['comm_exposed_s'])} + {ms(p['optimizer_s'])}"
    cells += [f"{sh['batch']} x {sh['seq']}", f"{ms(p['step_time_s'])} ({parts})",
              ms(m["step_time_s"]), pct(m["step_time_s"], p["step_time_s"]),
              gib(pred_peak), f"{gib(alloc)} ({m['memory_kind']})", pct(alloc, pred_peak),
              gib(reserved), over, f"{m['tokens_per_s'] or 0:,.0f}", f"{m['mfu'] or 0:.1%}",
              f"{eff:.3f}" if eff else "n/a", r["status"]]
    return "| " + " | ".join(cells) + " |"


def ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds is not None else "n/a"


def gib(n: float | None) -> str:
    return f"{n / GiB:.3f} GiB" if n else "n/a"


def write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # default=str: a value of a stray type becomes text rather than losing the rows
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")


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


def check_offload(c: Checker) -> str:
    """CPU offload (``--fix offload=cpu``: FSDP2's CPUOffloadPolicy, pinned on CUDA, the optimizer fused on the
    CPU): verify one rank against the reference (host gradients' norm and full tensors reduced on the device),
    then the exported script's step time and device peak beside the planner's, which adds the host copies at the
    PCIe rate and the CPU optimizer step. On CPU the policy runs unpinned and nothing is copied."""
    ap = c.session("--gpus 1 --fix offload=cpu,amp=none", TINY_LLAMA_CELL)
    report = ap.verify(steps=3, nproc=1, warm=False)
    _, s = launched(ap, c, steps=c.target.steps)
    cost, m0 = ap.plan.cost, ap.plan.cost.memory_by_rank[0]
    copies = sum(cost.comm_by_kind.get(k, 0.0) for k in ("host_to_device", "device_to_host"))
    meas = s["memory_by_rank"].get(0)
    return (f"verify ok={report.ok} (losses within {report.max_loss_rel:.1e}); {s['status']} after {s['steps']} "
            f"steps: step {s['step_time_s'] * 1e3:.1f} ms vs {cost.step_time_s * 1e3:.1f} ms predicted "
            f"({copies * 1e3:.1f} ms of host copies, CPU optimizer {cost.optimizer_s * 1e3:.1f} ms); device peak "
            f"{gib(meas)} ({s['memory_kind']}) vs {gib(m0.total - m0.margin)} predicted, {gib(m0.host)} on the host")


def check_float8(c: Checker) -> str:
    """Float8 (torchao, tensorwise: the recipe the planner offers) beside bf16, the plan otherwise the same: on a GPU
    the compiled 1B (its bf16 run is the scaling check's compiled row, reused), on CPU the toy cell eager in bf16
    (torchao emulates the float8 matmuls). Per run the planner's step, the measured one, tokens/s; then both loss
    curves step by step, held to verify's float8 tolerance (torchao's SQNR of 20 dB: 10 %)."""
    from autopar_nb.runtime.float8 import TORCHAO_INSTALL
    from autopar_nb.verify.report import FLOAT8_RTOL

    try:
        import torchao  # noqa: F401  (the workers import it; they run in this environment)
    except ImportError:
        return f"not run: torchao is not installed here ({TORCHAO_INSTALL}; an offline host needs its wheel)"
    base = scaling_fix(ScalingRow(LLAMA_1B, "none", c.target.cuda)) + ("" if c.target.cuda else ",amp=bf16")
    lines = ["| float8 | predicted step | measured step | tokens/s | plan |", "|---|---|---|---|---|"]
    runs = {}
    for recipe in ("none", "tensorwise"):
        ap = c.session(f"--gpus 1 --fix {base.replace('float8=none', f'float8={recipe}')}")
        run, s, label = same_plan_run(c, ap.plan)
        if s is None:
            skipped = budget_verdict(c, ap.plan, c.target.cuda)
            if skipped:
                return f"float8={recipe}: {skipped}"
            run, s = launched(ap, c, steps=c.target.steps)
            c.runs.append((f"the float8={recipe} run", ap, run, s))
        runs[recipe] = (ap.plan.cost.step_time_s, s["step_time_s"], run.loss_curve(0))
        mesh = ap.plan.summary().split(" | ")[0] + (f" ({label}: the same plan)" if label else "")
        lines.append(f"| {recipe} | {ms(runs[recipe][0])} | {ms(s['step_time_s'])} | "
                     f"{tokens_per_step(ap.plan) / s['step_time_s']:,.0f} | {mesh} |")
    return "\n" + "\n".join(lines + ["", float8_verdict(runs["none"], runs["tensorwise"], FLOAT8_RTOL)])


def float8_verdict(bf16: tuple, f8: tuple, rtol: float) -> str:
    """The measured speed-up beside the predicted one, and the two loss curves (``(step, loss)`` lists) compared
    step by step against ``rtol``: one sentence and the losses."""
    (p0, m0, curve0), (p1, m1, curve1) = bf16, f8
    losses = dict(curve1)
    pairs = [(step, loss, losses[step]) for step, loss in curve0 if step in losses]
    worst = max((abs(b - a) / abs(a) for _, a, b in pairs if a), default=float("nan"))
    held = "within" if worst <= rtol else "NOT within"
    return (f"Float8 measured {m0 / m1:.2f}x bf16's speed (predicted {p0 / p1:.2f}x); losses over {len(pairs)} steps "
            f"{held} {rtol:.0%} of bf16's (largest difference {worst:.1e}): "
            + ", ".join(f"{step}: {a:.4f} / {b:.4f}" for step, a, b in pairs) + ".")


CHECKS = [("memory and step time vs the planner (LLaMA 1B, bf16, 1 GPU)", check_memory_and_time),
          ("calibrate", check_calibrate),
          ("fp16 GradScaler and verify on CUDA", check_fp16_and_verify),
          ("2 processes, SyncBatchNorm, NVML", check_two_processes),
          ("throughput of the exported script: eager / compile / compile + fused head",
           check_throughput),
          ("step time and memory at three sizes (LLaMA 0.5B / 1B / 3B, bf16, 1 GPU)",
           check_scaling),
          ("CPU offload: verify, step time and device peak (tiny LLaMA, fp32, 1 GPU)", check_offload),
          ("Float8 beside bf16: tokens/s and loss curves (LLaMA 1B, compiled, 1 GPU)", check_float8)]
"""numbered as ``--only`` names them (1-based)"""
ORDER = (1, 6, 2, 3, 4, 7, 8, 5)
"""the order they run in: the scaling rows right after the memory check (whose runs they reuse) and
before calibrate (so that their predictions use the factors a fresh machine plans with); Float8 after
the scaling rows (its bf16 run is their compiled 1B); the throughput check, the longest, last (a
variant past the budget is skipped)"""


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
    """Run the checks numbered ``only`` (1-based, in :data:`CHECKS`; default all) in :data:`ORDER`,
    calling ``after()`` after each (so a run cut off later keeps what it measured)."""
    for k in ORDER:
        if only is None or k in only:
            c.run(*CHECKS[k - 1])
            if after is not None:
                after()
    return c.rows


def plumbing(budget_s: float, only: set[int] | None = None, *, modes: tuple[str, ...] | None = None,
             alloc_conf: str = "", scaling_rows: set[int] | None = None,
             json_path: Path | None = None) -> int:
    """The CPU path: say there is no GPU, run every check at toy size on CPU processes, render the section into a
    temporary copy of BENCHMARKS.md (the scaling rows' JSON into ``json_path``, default a temporary
    file); exit 1 when a check, or a row of its table, failed or was skipped (0 otherwise)."""
    from capture import write_section

    from autopar_nb.hardware import visible_gpus

    print(f"no CUDA GPU here ({len(visible_gpus())} visible) or --plumbing: the GPU checks run at toy size on CPU")
    with tempfile.TemporaryDirectory() as tmp:
        # the calibrate check must not leave toy-run factors in the user's calibration file
        os.environ["AUTOPAR_CALIBRATION"] = str(Path(tmp) / "calibration.json")
        c = Checker(budget_s, CPU, modes=modes, alloc_conf=alloc_conf, scaling_rows=scaling_rows,
                    json_path=json_path or Path(tmp) / "gpu_check.json")
        rows = run_checks(c, only)
        copy = Path(tmp) / "BENCHMARKS.md"
        shutil.copy(ROOT / "BENCHMARKS.md", copy)
        write_section("GPU", render(header(), rows), copy)
        assert "## GPU\n" in copy.read_text()
    failed = [title for title, text in rows if text.startswith(("FAILED", "skipped"))
              or "| FAILED" in text or "| skipped" in text]
    if failed:
        print(f"plumbing FAILED: {', '.join(failed)}")
        return 1
    print(f"plumbing ok: {len(rows)} checks ran on CPU, the section rendered")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plumbing", action="store_true", help="run the CPU path even on a GPU host")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="time budget (default 480 s)")
    p.add_argument("--only", help="the checks to run, by number (1-8, comma-separated; default "
                   "all): a rerun")
    p.add_argument("--copy-to", type=Path, help="copy BENCHMARKS.md into this folder after each check")
    p.add_argument("--variants", help="the throughput check's variants to run, by number (1-6, in VARIANTS' order)")
    p.add_argument("--recompute", help="the memory check's recompute modes (default: none,selective,full)")
    p.add_argument("--rows", help="the scaling check's rows to run, by number (1-7, in "
                   "GPU_SCALING's order)")
    p.add_argument("--json", type=Path, help="where the scaling check writes its rows' raw "
                   "numbers (default: bench/gpu_check.json; in --plumbing a temporary file); "
                   "--copy-to copies it")
    p.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the launched runs, e.g. "
                   "expandable_segments:True (the allocator's fragmentation under it: --only 1 --alloc-conf ...)")
    args = p.parse_args(argv)
    only = {int(k) for k in args.only.split(",")} if args.only else None
    variants = {int(k) for k in args.variants.split(",")} if args.variants else None
    scaling_rows = {int(k) for k in args.rows.split(",")} if args.rows else None
    from autopar_nb.hardware import visible_gpus

    modes = tuple(args.recompute.split(",")) if args.recompute else None
    if args.plumbing or not visible_gpus():
        return plumbing(args.budget_s, only, modes=modes, alloc_conf=args.alloc_conf,
                        scaling_rows=scaling_rows, json_path=args.json)
    from capture import write_section

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    json_path = args.json or ROOT / "bench" / "gpu_check.json"
    head = header()
    c = Checker(args.budget_s, GPU, modes=modes, variants=variants, alloc_conf=args.alloc_conf,
                scaling_rows=scaling_rows, json_path=json_path)

    def written() -> None:
        write_section("GPU", render(head, c.rows))
        if args.copy_to:
            shutil.copy(ROOT / "BENCHMARKS.md", args.copy_to)
            if json_path.exists():
                shutil.copy(json_path, args.copy_to)

    run_checks(c, only, written)
    print("wrote the GPU section of BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
