"""Calibration: measured factors from real runs, persisted per cluster preset, fed back into the
cost model.

A finished run knows its measured step time (median of the steady-state steps) and, on CUDA, its
peak memory per rank; its plan knows the predicted ones. ``Run.calibrate()`` turns the ratios into
cost-model factors — the field names of ``autopar_nb.cost.factors.Factors``, the names
``Cluster.calibration`` takes — and stores them under the cluster's preset name in a JSON file
(``path()``: ``$AUTOPAR_CALIBRATION``, else ``$XDG_CACHE_HOME/autopar_nb/calibration.json``, else
``~/.cache/autopar_nb/calibration.json``).

Keys written (each replaces the cost model's default; starting values are the cluster's current
factors, so repeated calibrations converge instead of compounding errors):

* ``eff_matmul``, ``eff_conv``, ``eff_attention``, ``eff_fp32_matmul``, ``eff_hbm``, ``eff_link``:
  divided by ``r = measured / predicted step time`` — one uniform speed correction: the whole error
  is attributed to achieved throughput, compute and communication alike (a single run cannot tell
  them apart). Clamped to [1e-4, 4] (above 1 only where the device's peak is an estimate, as for the
  ``cpu`` preset).
* ``op_overhead_s`` and the host's ``cpu_*`` seconds (``cost/cpu.py``: the step's CPU issue time,
  its floor), and ``pp_handoff_s`` (the ``cpu`` preset's wait per pipeline handoff): multiplied by
  ``r``.
* ``compile_memory_bound`` (the share of a compiled block's memory-bound time that Inductor leaves):
  a run of a plan with compiled layers, on a preset an eager run has calibrated before, changes this
  factor alone — multiplied by ``r``, clamped to [0.05, 1.5] — since the eager factors already
  account for the rest of the step (repeated compiled runs converge: the factor stops moving when
  ``r`` = 1). A compiled run on a preset without an eager calibration makes the uniform correction
  above instead and leaves it alone.
* ``margin_fraction`` (and on CPU ``margin_fixed_bytes``), the allocator margin, so that the
  predicted peak of the worst rank equals the measured one:

  - CUDA runs (``mem_peak`` reported, :func:`margin_factors`): the caching allocator's peak reserve
    (``reserved_by_rank``: ``torch.cuda.max_memory_reserved``, the tensors' peak and the
    fragmentation around it; a summary without it falls back to the allocated peak) against the
    prediction before its margin, ``(reserved - (total - margin)) / (total - margin)``, >= 0.
    ``margin_fixed_bytes`` (the CUDA context and NCCL's buffers, outside the allocator's figures) is
    kept. The fragmentation is not a constant: on an H200 (LLaMA-3.2 1B shape, bf16, torch 2.11;
    BENCHMARKS.md "GPU") the reserve was 1.4 % over the allocated peak without recompute, 2.2 % with
    selective recompute and 30.5 % with full recompute, so a preset is calibrated by a run of the
    kind of plan it will plan.
  - CPU runs (RSS above each rank's RSS before its model was built, :func:`rss_margin_factors`): the
    fixed part is what a rank holds between steps beyond the parameters and optimizer state (the
    process group, thread stacks, the kernels' first-use pages: about 50 MiB for a 2-rank MLP), the
    fraction what its peak holds beyond that and the predicted training state (glibc's retained free
    blocks). A run under a CPU memory limit fixes glibc's mmap threshold
    (``autopar_nb.launch.run.CPU_LIMIT_ENV``) so a freed tensor's pages go back at once: with
    glibc's default (a threshold that rises to the size of the largest freed block) that MLP's peak
    RSS grew from 200 MiB at step 0 to 334-348 MiB by step 30 — a heap that no plan predicts — and
    stays at 205-211 MiB with it. Re-planning (``autopar_nb.launch.replan``) calibrates by the same
    rule.

  Without a calibration the cost model's documented default holds (``Factors.margin_fraction``: 5 %;
  ``margin_fixed_bytes``: 1 GiB per GPU, 0 on CPU); :func:`margin_text` says which one a plan uses.
* a re-plan also takes the speed factors above from the stopped run's steady steps
  (``time_factors``), when the plan's device is the run's.
* a tournament (``autopar_nb.launch.trials``) measures several plans at once and fits a scale to
  each of the step's components in the cost model's own formula (:func:`fit_components`: the
  device's time, exposed communication, the host's issue time), which one run's single ratio cannot
  do; :func:`factors_from_scales` turns them into the keys above and :func:`store` saves them with
  the number of runs, which the next plan's explanation states (:func:`speed_text`: "Step times
  calibrated on <date> from N runs").

Visible and resettable: ``show()``, ``load(preset)``, ``reset(preset)``; ``apply(cluster)`` returns
the cluster with the stored factors in ``Cluster.calibration``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from .units import fmt_bytes, fmt_time

SPEED_KEYS = ("eff_matmul", "eff_conv", "eff_attention", "flash_speed", "eff_fp32_matmul",
              "eff_hbm", "eff_link")
"""efficiencies divided by measured/predicted step time"""
OVERHEAD_KEYS = ("op_overhead_s", "cpu_op_s", "cpu_op_bwd_s", "cpu_tp_module_s",
                 "cpu_tp_module_bwd_s", "cpu_fsdp_unit_s", "cpu_fsdp_reshard_s", "cpu_ddp_s",
                 "cpu_ddp_param_s", "cpu_optimizer_step_s", "cpu_optimizer_param_s",
                 "cpu_optimizer_dtensor_s", "cpu_pp_microbatch_s", "cpu_collective_s")
"""per-op constants multiplied by measured/predicted step time: the GPU's launch gaps and the host's
seconds issuing a step (``cost/cpu.py``), so that a CPU-bound prediction moves with the measurement
as a GPU-bound one does"""
WAIT_KEYS = ("pp_handoff_s",)
"""seconds a step waits on another process (the ``cpu`` preset's pipeline handoffs), counted with
its exposed communication: multiplied by measured/predicted as the rest of the step is, by the
communication's scale in a tournament's fit"""
COMPILE_KEYS = ("compile_memory_bound",)
"""set by compiled runs once an eager run has calibrated the preset"""
COMPILE_RANGE = (0.05, 1.5)
MEMORY_KEYS = ("margin_fraction",)
"""set from a CUDA run's peak reserve"""
EFF_RANGE = (1e-4, 4.0)
HISTORY = 10
"""runs kept per preset in the file (the latest one's factors are in force)"""


def path() -> Path:
    """The calibration file."""
    if os.environ.get("AUTOPAR_CALIBRATION"):
        return Path(os.environ["AUTOPAR_CALIBRATION"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "autopar_nb" / "calibration.json"


def _read() -> dict:
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {"version": 1, "presets": {}}
    if not isinstance(data, dict) or not isinstance(data.get("presets"), dict):
        return {"version": 1, "presets": {}}
    return data


def _write(data: dict) -> None:
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, p)


def load(preset: str) -> dict[str, float]:
    """The stored factors of one preset ({} when it was never calibrated)."""
    return dict(_read()["presets"].get(preset, {}).get("factors", {}))


def reset(preset: str | None = None) -> None:
    """Forget the stored factors of ``preset`` (of every preset when None): plans go back to the
    defaults."""
    data = _read()
    if preset is None:
        data["presets"] = {}
    else:
        data["presets"].pop(preset, None)
    _write(data)


def show() -> str:
    """A printable table of every stored preset: its factors and the runs they came from."""
    data = _read()
    if not data["presets"]:
        return f"no calibration stored ({path()})"
    lines = [f"calibration file: {path()}"]
    for name, entry in sorted(data["presets"].items()):
        lines.append(f"[{name}]")
        for k, v in sorted(entry.get("factors", {}).items()):
            lines.append(f"  {k:<20} {v:.6g}")
        for h in entry.get("history", [])[-3:]:
            lines.append(f"  run {h.get('when', '?')}: measured "
                         f"{fmt_time(h.get('measured_step_time_s', 0))}/step vs predicted "
                         f"{fmt_time(h.get('predicted_step_time_s', 0))} "
                         f"(x{h.get('ratio', 0):.3g})")
    return "\n".join(lines)


def apply(cluster: Any) -> Any:
    """``cluster`` with its preset's stored factors merged into ``Cluster.calibration`` (explicit
    entries win)."""
    stored = load(_preset_of(cluster))
    return dataclasses.replace(cluster, calibration={**stored, **(cluster.calibration or {})})


def _preset_of(cluster: Any) -> str:
    for attr in ("name", "preset"):
        v = getattr(cluster, attr, None)
        if isinstance(v, str) and v:
            return v
    return ""


def _current_factors(cluster: Any) -> dict[str, float]:
    try:
        from .cost.factors import DEFAULT, factors_for
    except ImportError as e:
        raise RuntimeError("calibration needs the cost model (autopar_nb.cost.factors), which is "
                           "not installed in this checkout") from e
    if cluster is None:
        return dataclasses.asdict(DEFAULT)
    try:
        return dataclasses.asdict(factors_for(cluster))
    except (AttributeError, TypeError, ValueError):
        return {**dataclasses.asdict(DEFAULT), **(getattr(cluster, "calibration", None) or {})}


def factors_from(measured: dict, *, current: dict[str, float], compiled: bool = False,
                 eager_calibrated: bool = False,
                 full_recompute: float = 0.0) -> tuple[dict[str, float], dict]:
    """Cost-model factors that make the prediction match ``measured`` (a ``Run.summary()``),
    starting from the ``current`` factors the prediction was made with. ``compiled``: the run's plan
    compiles layers; ``eager_calibrated``: an eager run calibrated this preset before (then only
    ``compile_memory_bound`` moves); ``full_recompute``: the share of the plan's layers under full
    recompute (a majority calibrates that mode's allocator margin, :func:`cuda_margin_factors`).
    Returns (factors, record of the figures used)."""
    t_meas, t_pred = measured.get("step_time_s"), measured.get("predicted_step_time_s")
    if not t_meas or not t_pred:
        raise ValueError("calibration needs a measured step time and a predicted one: launch with "
                         "plan=<a Plan with a cost> and let at least one step finish")
    r = t_meas / t_pred
    lo, hi = COMPILE_RANGE if compiled and eager_calibrated else EFF_RANGE
    if compiled and eager_calibrated:
        out = {k: min(hi, max(lo, current[k] * r)) for k in COMPILE_KEYS if k in current}
    else:
        out = {k: min(hi, max(lo, current[k] / r)) for k in SPEED_KEYS if k in current}
        out.update({k: current[k] * r for k in OVERHEAD_KEYS + WAIT_KEYS if k in current})
    record: dict[str, Any] = {"measured_step_time_s": t_meas, "predicted_step_time_s": t_pred,
                              "ratio": r, "compiled": compiled}
    if measured.get("memory_kind") == "cuda_peak" and measured.get("predicted_memory_by_rank"):
        margin, rec = cuda_margin_factors(measured, current=current, full_recompute=full_recompute)
        out.update(margin)
        record.update(rec)
    return out, record


def cuda_margin_factors(measured: dict, *, current: dict[str, float],
                        full_recompute: float = 0.0) -> tuple[dict[str, float], dict]:
    """The allocator margin of a CUDA run (``measured``: a ``Run.summary()`` with the plan's
    predictions): what the process needs is the allocator's peak reserve (``reserved_by_rank``; the
    allocated peak where a summary lacks it) plus what lies outside the allocator (the CUDA context,
    NCCL's buffers: ``margin_fixed_bytes``, kept), so :func:`margin_factors` gets the reserve plus
    that fixed part and returns the fraction the prediction before its margin needs on top:
    ``margin_full_recompute`` for a plan with most of its layers under full recompute
    (``full_recompute``, the share), whose backward fragments the cache far more, else
    ``margin_fraction``. Returns (factors, record: the worst rank's allocated and reserved peaks and
    the predicted bytes), ({}, {}) without a rank to compare."""
    pred = measured["predicted_memory_by_rank"]
    breakdown = measured.get("predicted_breakdown_by_rank") or {}
    allocated, reserved = (measured.get("memory_by_rank") or {},
                           measured.get("reserved_by_rank") or {})
    held = {r: reserved.get(r, allocated.get(r)) for r in set(allocated) | set(reserved)}
    fixed = current.get("margin_fixed_bytes", 0.0)
    bases = {r: (pred.get(r) or 0.0) - breakdown.get(r, {}).get("margin", 0.0) for r in held}
    try:
        margin, rec = margin_factors({r: v + fixed for r, v in held.items() if v is not None},
                                     bases, current=current)
    except ValueError:
        return {}, {}
    if full_recompute > 0.5:
        margin = {"margin_full_recompute": margin["margin_fraction"]}
    r = rec["rank"]
    return margin, {"measured_peak_bytes": allocated.get(r),
                    "measured_reserved_bytes": reserved.get(r), "predicted_peak_bytes": pred.get(r),
                    "margin_rank": r}


def margin_factors(measured: dict[int, float], predicted: dict[int, float], *,
                   current: dict[str, float]) -> tuple[dict[str, float], dict]:
    """The allocator margin that makes the predicted peak equal the measured one, for the rank whose
    measured / predicted ratio is worst: ``measured`` = rank -> the bytes its process held at its
    peak, the fixed part included (NVML's figure for the process, CUDA context and all, in
    ``autopar_nb.launch.replan``; the allocator's peak reserve plus ``margin_fixed_bytes`` in
    :func:`cuda_margin_factors`), ``predicted`` = rank -> the plan's bytes for it before the margin,
    ``current`` = the factors the prediction used (its ``margin_fixed_bytes`` is kept):
    ``margin_fraction = max(0, (measured - predicted - margin_fixed_bytes) / predicted)``. Returns
    (factors, record: the rank, its measured and predicted bytes)."""
    pairs = {r: (m, predicted[r]) for r, m in measured.items() if m is not None
             and (predicted.get(r) or 0) > 0}
    if not pairs or "margin_fraction" not in current:
        raise ValueError("calibrating the memory margin needs a rank with a measured peak and a "
                         "predicted one")
    worst = max(pairs, key=lambda r: pairs[r][0] / pairs[r][1])
    m, base = pairs[worst]
    fraction = max(0.0, (m - base - current.get("margin_fixed_bytes", 0.0)) / base)
    return {"margin_fraction": fraction}, {"rank": worst, "measured_bytes": m,
                                           "predicted_bytes": base, "margin_fraction": fraction}


PERSISTENT_TERMS = ("ddp_buckets",)
"""MemoryBreakdown terms a rank keeps between steps besides its parameters and optimizer state
(DDP's flat buckets)"""


def persistent_bytes(mb: Any) -> float:
    """What the plan predicts a rank holds between two steps (after ``optimizer.zero_grad()``, which
    frees the gradients): its parameters, optimizer state and :data:`PERSISTENT_TERMS`."""
    terms = getattr(mb, "terms", None) or {}
    return float(mb.params + mb.optimizer + sum(terms.get(k, 0.0) for k in PERSISTENT_TERMS))


def rss_margin_factors(peaks: dict[int, float], floors: dict[int, float], breakdowns: dict[int, Any]
                       ) -> tuple[dict[str, float], dict]:
    """The allocator margin of CPU ranks, from their RSS above the baseline (the RSS before the
    model was built):

    * ``margin_fixed_bytes``: what a rank holds *between* steps (``floors``: the least RSS its step
      reports gave, at the end of a step) beyond the tensors the plan keeps there
      (:func:`persistent_bytes`): the process group's buffers, thread stacks, the kernels' code and
      the allocator's first-use pages, which do not scale with the plan (tens of MiB). The most any
      rank held.
    * ``margin_fraction``: what its peak (``peaks``: Linux VmHWM above the baseline) holds beyond
      that and the predicted training state (``breakdowns``: rank -> MemoryBreakdown; its total
      before its margin), as a fraction of that state: the allocator's retained free blocks. The
      worst rank's, >= 0.

    So the prediction ``state * (1 + fraction) + fixed`` equals the worst rank's peak. Returns
    (factors, record)."""
    ranks = [r for r in peaks if r in floors and r in breakdowns and breakdowns[r] is not None]
    states = {r: float(breakdowns[r].total - breakdowns[r].margin) for r in ranks}
    ranks = [r for r in ranks if states[r] > 0]
    if not ranks:
        raise ValueError("calibrating the memory margin needs a rank with a measured peak, its RSS "
                         "between steps and a predicted breakdown")
    fixed = max(max(0.0, floors[r] - persistent_bytes(breakdowns[r])) for r in ranks)
    fractions = {r: max(0.0, (peaks[r] - fixed - states[r]) / states[r]) for r in ranks}
    worst = max(ranks, key=lambda r: peaks[r] / (states[r] + fixed))
    fraction = max(fractions.values())
    return ({"margin_fraction": fraction, "margin_fixed_bytes": fixed},
            {"rank": worst, "measured_bytes": peaks[worst], "predicted_bytes": states[worst],
             "floor_bytes": floors[worst], "margin_fraction": fraction,
             "margin_fixed_bytes": fixed})


def time_factors(measured_s: float | None, predicted_s: float | None, *, current: dict[str, float],
                 compiled: bool = False,
                 eager_calibrated: bool = False) -> tuple[dict[str, float], dict]:
    """The speed factors :func:`factors_from` sets from a run's steady-state step time
    (``measured_s``) against the plan's (``predicted_s``): ({}, {}) when either is missing."""
    if not measured_s or not predicted_s:
        return {}, {}
    return factors_from({"step_time_s": measured_s, "predicted_step_time_s": predicted_s},
                        current=current, compiled=compiled, eager_calibrated=eager_calibrated)


def margin_text(factors: Any, preset: str = "") -> str:
    """Where a plan's allocator margin comes from: the calibration stored for ``preset`` (the run it
    came from), or the cost model's documented default when nothing was calibrated
    (``Factors.margin_fraction``: 5 % on top of the predicted bytes; a GPU's is pending a measured
    CUDA run)."""
    frac, fixed = getattr(factors, "margin_fraction", 0.05), getattr(factors, "margin_fixed_bytes",
                                                                     0.0)
    what = f"{frac:.0%} of the predicted bytes + {fmt_bytes(fixed)}"
    entry = _read()["presets"].get(preset, {}) if preset else {}
    if "margin_fraction" in entry.get("factors", {}):
        runs = [h for h in entry.get("history", [])
                if "margin_fraction" in (h.get("factors") or {})]
        when = f" (run of {runs[-1].get('when', '?')})" if runs else ""
        return f"{what}, calibrated for {preset}{when}"
    gpu = "" if preset in ("", "cpu") else (", not measured on this GPU yet (a CUDA run's "
                                            "run.calibrate() sets it)")
    return f"{what}, the cost model's default (not calibrated){gpu}"


def from_run(run: Any, *, cluster: Any = None, preset: str | None = None,
             save: bool = True) -> dict[str, float]:
    """Factors measured by a finished ``Run`` (see the module docstring), stored under the preset
    when ``save``."""
    if run.status != "finished":
        raise ValueError(f"the run is {run.status}: calibrate from a finished run (run.wait() "
                         "first)")
    measured = run.summary()
    cost = getattr(run.plan, "cost", None)
    if cost is not None:
        measured["predicted_breakdown_by_rank"] = {i: dataclasses.asdict(m)
                                                   for i, m in enumerate(cost.memory_by_rank)}
    name = preset or (_preset_of(cluster) if cluster is not None else "") or (
        (getattr(run.plan, "cluster", None) or {}).get("preset", ""))
    if not name:
        raise ValueError("no cluster preset to store the calibration under: pass cluster=... or "
                         "preset='h100-80gb'")
    # the factors the prediction was made with: the cluster's, or (no cluster given) the defaults
    # with what is stored for the preset, which is what a plan made on apply(cluster) used
    current = _current_factors(cluster) if cluster is not None else {**_current_factors(None),
                                                                     **load(name)}
    compiled = any(getattr(lp, "compile", False) for lp in getattr(run.plan, "layers", None) or [])
    history = _read()["presets"].get(name, {}).get("history", [])
    layers = getattr(run.plan, "layers", None) or []
    full = (sum(getattr(lp, "recompute", "none") == "full" for lp in layers) / len(layers) if layers
            else 0.0)
    factors, record = factors_from(measured, current=current, compiled=compiled,
                                   full_recompute=full,
                                   eager_calibrated=any(not h.get("compiled", False)
                                                        for h in history))
    cpu = (measured.get("memory_kind") == "rss_above_baseline" and cost is not None
           and hasattr(run, "rss_figures") and hasattr(run, "predicted_breakdowns"))
    rss = run.rss_figures() if cpu else {}
    if rss:
        try:
            margin, rec = rss_margin_factors({r: v["peak"] for r, v in rss.items()},
                                             {r: v["floor"] for r, v in rss.items()},
                                             run.predicted_breakdowns())
        except ValueError:
            margin, rec = {}, {}
        factors.update(margin)
        if rec:
            record.update(measured_peak_bytes=rec["measured_bytes"],
                          predicted_peak_bytes=rec["predicted_bytes"],
                          floor_bytes=rec["floor_bytes"])
    if save:
        data = _read()
        entry = data["presets"].setdefault(name, {"factors": {}, "history": []})
        entry["factors"] = {**entry.get("factors", {}), **factors}
        record.update(when=time.strftime("%Y-%m-%d %H:%M:%S"), run_dir=str(run.run_dir),
                      nproc=run.nproc, factors=factors)
        entry["history"] = (entry.get("history", []) + [record])[-HISTORY:]
        _write(data)
    return factors


COMPONENTS = ("device", "communication", "host")
"""what :func:`fit_components` scales apart: the device's work (compute, the pipeline bubble, the
optimizer step), exposed communication, and the host's time issuing the step (``cost/cpu.py``)"""
DEVICE_SPEED_KEYS = tuple(k for k in SPEED_KEYS if k != "eff_link")


def components(cost: Any) -> dict[str, float]:
    """A Cost's step in the terms the cost model combines (``Evaluator.evaluate``): forward and
    backward on the device (compute and bubble), its exposed communication, the optimizer step, and
    the host's issue time of each phase; ``step = max(device + communication, host) + max(optimizer,
    host_optimizer)``."""
    opt_cpu = float((cost.cpu_by_part or {}).get("optimizer", 0.0))
    return {"device": float(cost.compute_s + cost.bubble_s),
            "communication": float(cost.comm_exposed_s), "optimizer": float(cost.optimizer_s),
            "host": float(cost.cpu_s) - opt_cpu, "host_optimizer": opt_cpu}


def scaled_step(parts: dict[str, float], scales: dict[str, float]) -> float:
    """The step time of :func:`components` ``parts`` with each of :data:`COMPONENTS` scaled by
    ``scales``."""
    d, c, h = scales["device"], scales["communication"], scales["host"]
    return (max(d * parts["device"] + c * parts["communication"], h * parts["host"])
            + max(d * parts["optimizer"], h * parts["host_optimizer"]))


def fit_components(parts: list[dict[str, float]], measured: list[float]) -> dict[str, float]:
    """The scales of :data:`COMPONENTS` that make :func:`scaled_step` closest to the measured step
    times of several runs of different plans (least squares of the relative errors, so a slow plan
    does not outweigh a fast one): a fit that one run cannot give (its single ratio scales every
    plan alike and never changes their order). A component no run has keeps the median ratio
    measured / predicted, as every one does with a single run; a weak pull towards that ratio keeps
    a component the runs cannot tell apart there. Returns {component: scale}."""
    import numpy as np
    from scipy.optimize import minimize

    if not parts or len(parts) != len(measured):
        raise ValueError("fitting the cost model needs one measured step time per predicted one")
    ones = dict.fromkeys(COMPONENTS, 1.0)
    y = np.array(measured, dtype=float)
    ratio = float(np.median(y / np.array([scaled_step(p, ones) for p in parts])))
    has = {"device": any(p["device"] or p["optimizer"] for p in parts),
           "communication": any(p["communication"] for p in parts),
           "host": any(p["host"] or p["host_optimizer"] for p in parts)}
    free = [k for k in COMPONENTS if has[k]]
    if len(parts) < 2 or not free:
        return dict.fromkeys(COMPONENTS, ratio)

    def scales_of(x) -> dict[str, float]:
        return {**dict.fromkeys(COMPONENTS, ratio),
                **{k: float(np.exp(v)) for k, v in zip(free, x, strict=True)}}

    def loss(x) -> float:
        s = scales_of(x)
        err = np.array([scaled_step(p, s) for p in parts]) / y - 1
        return float(np.sum(err ** 2) + 1e-4 * np.sum((np.asarray(x) - np.log(ratio)) ** 2))

    start = np.full(len(free), np.log(ratio))
    for _ in range(3):  # restarted where it stopped: the simplex can stall on a kink of the max
        start = minimize(loss, start, method="Nelder-Mead", options={"xatol": 1e-7, "fatol": 1e-14,
                                                                     "maxiter": 4000}).x
    return scales_of(start)


def factors_from_scales(scales: dict[str, float], *, current: dict[str, float]) -> dict[str, float]:
    """The cost-model factors that scale each of :data:`COMPONENTS` as ``scales`` says, from the
    ``current`` ones: the device's efficiencies divided by its scale (clamped to ``EFF_RANGE``) and
    its per-op gap multiplied by it, the link's efficiency divided by communication's and the waits
    (``WAIT_KEYS``) multiplied by it, the host's per-op seconds (``OVERHEAD_KEYS``) multiplied by
    the host's."""
    lo, hi = EFF_RANGE
    out = {k: min(hi, max(lo, current[k] / scales["device"])) for k in DEVICE_SPEED_KEYS
           if k in current}
    if "eff_link" in current:
        out["eff_link"] = min(hi, max(lo, current["eff_link"] / scales["communication"]))
    out.update({k: current[k] * scales["communication"] for k in WAIT_KEYS if k in current})
    # op_overhead_s is the device's gap between kernels (part of its time); the other per-op seconds
    # are the host's
    out.update({k: current[k] * scales["device" if k == "op_overhead_s" else "host"]
                for k in OVERHEAD_KEYS if k in current})
    return out


def store(preset: str, factors: dict[str, float], record: dict) -> None:
    """Save ``factors`` for ``preset`` (merged over what it holds) with ``record`` in its history
    (``when`` and ``factors`` added), as ``from_run`` saves a run's."""
    data = _read()
    entry = data["presets"].setdefault(preset, {"factors": {}, "history": []})
    entry["factors"] = {**entry.get("factors", {}), **factors}
    record = {**record, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "factors": factors}
    entry["history"] = (entry.get("history", []) + [record])[-HISTORY:]
    _write(data)


def speed_text(preset: str) -> str:
    """Where a plan's step times come from when ``preset`` holds measured speed factors: "step times
    calibrated on <date> from N runs" (the latest calibration's date, N the runs it fitted: a
    tournament's plans, else 1); "" when nothing was calibrated."""
    badge = speed_badge(preset)
    if not badge:
        return ""
    return (f"Step times {badge} on this machine ({preset}; autopar_nb.calibration.show(), "
            f"reset('{preset}') to forget them).")


def speed_badge(preset: str) -> str:
    """The short form of :func:`speed_text`, "calibrated on <date> from N runs" (the planner
    widget's header); "" when ``preset`` holds no measured speed factors."""
    entry = _read()["presets"].get(preset, {}) if preset else {}
    runs = [h for h in entry.get("history", [])
            if any(k in (h.get("factors") or {}) for k in SPEED_KEYS)]
    if not runs:
        return ""
    last = runs[-1]
    n = int(last.get("runs", 1))
    return f"calibrated on {str(last.get('when', '?'))[:10]} from {n} run{'s' if n != 1 else ''}"
