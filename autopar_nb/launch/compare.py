"""What a run may honestly be compared with: the plan's predictions only where they describe the
device it runs on.

A plan made for ``h100-80gb`` and run on CPU processes (gloo) says nothing about CPU step times, so
times are not compared; its memory per rank is, as the training state (parameters, gradients,
optimizer states, activations and buffers, without the CUDA allocator's margin) against each rank's
RSS above what the process held before it built its model. On GPUs the plan's whole prediction
(margin included) is compared with CUDA's figures and NVML's.
"""

from __future__ import annotations

from typing import Any

from .. import calibration
from ..units import fmt_bytes

RSS_SLACK_BYTES = 128 * 2**20
"""what a CPU rank's RSS above its baseline holds beyond the training state it measures, which the
plan does not predict: torch's allocations on first use (kernels' workspaces, the autograd engine,
gloo's buffers: ~57 MiB held between steps), and freed blocks the C library's heap keeps while no
limit makes it return them. Measured: the seed MLP on 2 gloo processes (21 MiB predicted a rank)
held 100-133 MiB above its baseline (2026-12-06, 2-core machine), an event on every run at 64 MiB"""


def plan_device(plan: Any) -> str:
    """The cluster preset the plan was made for ("h100-80gb", "cpu", ...), "" when unknown."""
    return str((getattr(plan, "cluster", None) or {}).get("preset") or "")


def same_family(preset: str, gpu_name: str) -> bool:
    """Whether an NVML device name ("NVIDIA H100 80GB HBM3") is the preset's GPU ("h100-80gb")."""
    family = preset.split("-")[0].lower()
    return bool(family) and family in gpu_name.lower().replace(" ", "")


def predicted_memory(plan: Any, rank: int, *, model_state: bool) -> float | None:
    """The plan's predicted peak bytes for ``rank`` (its pipeline stage's figure when the planner
    gave one breakdown per pipeline rank; mesh order (pp, dp, tp), TP innermost); ``model_state``
    leaves out the allocator margin."""
    m = predicted_breakdown(plan, rank)
    if m is None:
        return None
    return float(m.total - m.margin) if model_state else float(m.total)


def predicted_breakdown(plan: Any, rank: int):
    """The plan's :class:`~autopar_nb.plan.MemoryBreakdown` for ``rank`` (see
    :func:`predicted_memory`), or None."""
    cost, mesh = getattr(plan, "cost", None), getattr(plan, "mesh", None)
    mem = list(getattr(cost, "memory_by_rank", None) or [])
    if not mem:
        return None
    world = getattr(mesh, "world_size", len(mem)) if mesh is not None else len(mem)
    if len(mem) == world:
        index = rank
    elif mesh is not None and len(mem) == mesh.pp:
        index = rank // max(1, mesh.dp * mesh.tp)
    else:
        index = rank if rank < len(mem) else None
    if index is None or index >= len(mem):
        return None
    return mem[index]


SPEED_FACTORS = ("eff_matmul", "eff_conv", "eff_attention", "eff_fp32_matmul", "eff_hbm",
                 "op_overhead_s")
"""calibration factors that correct a device's speed (``autopar_nb.calibration``): a ``cpu`` plan's
step time is the estimate of ``hardware.cpu_device`` (cores x 2.5 GHz x AVX2 FMA) until one of them
was measured"""


def speed_calibrated(preset: str) -> bool:
    """Whether a run measured the speed of ``preset``'s devices (stored calibration factors)."""
    return any(k in SPEED_FACTORS for k in calibration.load(preset))


def comparison(plan: Any, *, backend: str, nproc: int, gpu_name: str = "",
               calibrated: bool | None = None) -> dict:
    """``{"plan_device", "run_device", "compare_time", "memory_basis", "predicted_memory": [bytes or
    None per rank], "predicted_step_time_s", "memory_limit_bytes" (the per-rank limit the plan was
    made with, or None), "enforce_limit" (a CPU run: the launch stops a rank above it),
    "other_device" (the plan's device when it is not the run's: its predictions are for that device,
    so a gap is no prediction error), "judge_time" (whether a step time far from the prediction is a
    prediction error: not for a CPU plan whose speed no run has calibrated, ``calibrated``, default:
    :func:`speed_calibrated`), "memory_slack_bytes" (what the memory measure holds beyond the
    training state, :data:`RSS_SLACK_BYTES` on CPU), "notes": [str]}`` for a run of ``plan`` on
    ``nproc`` local processes."""
    device = plan_device(plan)
    cpu = backend != "nccl"
    run_device = f"{nproc} CPU process{'es' if nproc > 1 else ''} (gloo)" if cpu else \
        f"{nproc} GPU{'s' if nproc > 1 else ''}" + (f" ({gpu_name})" if gpu_name else "")
    cost = getattr(plan, "cost", None)
    limit = (getattr(plan, "cluster", None) or {}).get("memory_limit_bytes")
    out: dict[str, Any] = {"plan_device": device, "run_device": run_device, "compare_time": False,
                           "memory_basis": "rss_above_baseline" if cpu else "cuda",
                           "predicted_memory": [None] * nproc, "predicted_step_time_s": None,
                           "memory_limit_bytes": float(limit) if limit else None,
                           "enforce_limit": bool(limit) and cpu, "other_device": "",
                           "judge_time": False,
                           "memory_slack_bytes": RSS_SLACK_BYTES if cpu else 0.0, "notes": []}
    scaled_from = (getattr(plan, "cluster", None) or {}).get("scaled_from")
    # Session.plan_for: more or fewer data-parallel replicas
    if scaled_from and scaled_from != nproc:
        out["notes"].append(f"The plan was made for {scaled_from} processes; this run scales it to "
                            f"{nproc} (data " "parallelism only)"
                            + (f", its predictions re-estimated for {nproc}." if cost else "."))
    if limit and cpu:
        out["notes"].append(f"Memory limit {fmt_bytes(limit)} per rank (the plan's): a rank whose "
                            "RSS above its baseline exceeds it is stopped, as an out-of-memory "
                            "would.")
    if cost is None:
        if plan is not None:
            out["notes"].append("the plan has no cost: nothing to compare")
        return out
    out["predicted_memory"] = [predicted_memory(plan, r, model_state=cpu) for r in range(nproc)]
    if cpu and device not in ("", "cpu"):
        out["notes"].append(
            f"The plan was made for {device}; this run uses {run_device}. Step times are not "
            "compared (another device); memory per rank is: the training state the plan predicts "
            "(parameters, gradients, optimizer states, activations, buffers; no allocator margin) "
            "against each rank's RSS above what it held before building its model, which also "
            "counts what torch allocates on first use (tens of MiB).")
        out["other_device"] = device
    elif not cpu and device and device != "cpu" and gpu_name and not same_family(device, gpu_name):
        out["notes"].append(f"The plan was made for {device}; this run uses {gpu_name}: step times "
                            "are not compared.")
        out["other_device"] = device
    elif not cpu and device == "cpu":
        out["notes"].append("The plan was made for CPU processes; this run uses GPUs: step times "
                            "are not compared.")
        out["other_device"] = device
    else:
        out["compare_time"] = bool(cost.step_time_s)
        if cpu:
            out["notes"].append("Memory per rank: the training state the plan predicts (no "
                                "allocator margin) against each rank's RSS above what it held "
                                "before building its model, which also counts what torch allocates "
                                "on first use (tens of MiB).")
    if out["compare_time"]:
        out["predicted_step_time_s"] = float(cost.step_time_s)
        out["judge_time"] = device != "cpu" or (speed_calibrated(device) if calibrated is None
                                                else calibrated)
        if not out["judge_time"]:
            out["notes"].append("Step times are shown beside the plan's, not judged: its CPU speed "
                                "is an estimate (cores x 2.5 GHz x AVX2) until a run calibrates it "
                                "(run.calibrate()).")
    if out["other_device"]:
        out["notes"].append(f"The prediction is for {device}, not this run's device: no "
                            "prediction-error events.")
    return out
