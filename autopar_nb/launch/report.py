"""What a run measured beside what its plan predicted: the figures behind ``Run.rss_figures``,
``Run.measured`` and ``Run.explain``, read from the run's rows and samples (see
:mod:`autopar_nb.launch.compare` for which of the plan's predictions a run compares with).
"""

from __future__ import annotations

from typing import Any

from ..calibration import persistent_bytes
from ..units import fmt_bytes, fmt_time
from . import compare, watch

PEAK_LABELS = {False: "measured peak (RSS above baseline)", True: "measured peak (CUDA allocated)"}
"""what a launched run's peak per rank is, on CPU processes and on GPUs: one label wherever the
figure is shown"""
PREDICTED_LABEL = "predicted tensors (no margin)"
"""what each rank's peak is compared with (the plan's training state, without the allocator
margin)"""


def rss_figures(run: Any) -> dict[int, dict[str, float]]:
    """``run.rss_figures()``: each CPU rank's peak and floor RSS above its baseline; {} on GPUs."""
    if run.backend == "nccl":
        return {}
    with run._lock:
        base = {r: s.baseline for r, s in run._ranks.items() if s.baseline}
        rows = [r for r in run._rows if r.get("rss") and r["rank"] in base]
    peaks = {r: v for r, v in held_peaks(run.samples).items() if r in base}
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        r, held = row["rank"], max(0.0, float(row["rss"]) - base[row["rank"]])
        peak = max(held, float(row.get("rss_peak") or 0.0) - base[r])
        fig = out.setdefault(r, {"peak": peaks.get(r, 0.0), "floor": held})
        fig["floor"], fig["peak"] = min(fig["floor"], held), max(fig["peak"], peak)
    return out


def peak_figures(run: Any) -> dict[int, dict]:
    """rank -> ``{"measured", "predicted", "ratio"}``: each rank's peak (:data:`PEAK_LABELS`)
    against the prediction it compares with (:data:`PREDICTED_LABEL`), for the ranks that reported
    one. The one figure the widget, the dashboard's rank table, its summary and :func:`explain`
    show."""
    return _peak_figures(run, _memory(run)[0])


def _peak_figures(run: Any, peaks: dict[int, float]) -> dict[int, dict]:
    return {r: _figure(peaks[r], compare.predicted_memory(run.plan, r, model_state=True))
            for r in sorted(peaks)}


def measured(run: Any) -> dict[str, Any]:
    """``run.measured()``: its memory and step time beside the plan's, on the basis they compare."""
    c = run.comparison()
    cpu = c["memory_basis"] == "rss_above_baseline"
    raw, floors = _memory(run)
    peaks = _peak_figures(run, raw)
    reserved = {} if cpu else run.summary().get("reserved_by_rank") or {}
    by_rank = {}
    for r in sorted(set(peaks) | set(floors)):
        mb = compare.predicted_breakdown(run.plan, r)
        by_rank[r] = {"peak": peaks.get(r)
                      or _figure(None, compare.predicted_memory(run.plan, r, model_state=True)),
                      "between steps": _figure(floors.get(r),
                                               persistent_bytes(mb) if mb is not None else None)}
        if reserved.get(r):
            by_rank[r]["reserved"] = _figure(
                reserved[r], compare.predicted_memory(run.plan, r, model_state=False))
    cost = getattr(run.plan, "cost", None)
    predicted_t = float(cost.step_time_s) if cost is not None and cost.step_time_s else None
    compared = bool(c["compare_time"])
    time_fig = {**_figure(run.summary().get("step_time_s"), predicted_t if compared else None),
                "predicted": predicted_t, "compared": compared,
                "note": "" if compared else (f"not compared: the plan was made for "
                                             f"{c['plan_device'] or 'another device'}, the run "
                                             f"used {c['run_device']}")}
    basis = ("peak RSS above each rank's RSS before its model was built, against the predicted "
             "training state (no allocator margin)" if cpu
             else "CUDA's peak allocated, against the predicted tensors (no allocator margin); the "
                  "allocator's peak reserve against the whole prediction, whose margin covers its "
                  "fragmentation")
    return {"basis": basis, "device": c["run_device"], "by_rank": by_rank, "time": time_fig,
            "throughput": _throughput(run, cost, time_fig)}


def _throughput(run: Any, cost: Any, time_fig: dict) -> dict:
    """The median samples/s (or tokens/s) the steps reported against the plan's, and the MFU that
    follows from the measured step time (the plan's FLOPs per step over it), where times compare;
    else {}."""
    if cost is None or not time_fig["compared"] or not time_fig["measured"]:
        return {}
    import statistics

    tokens = run.throughput_unit == "tokens/s"
    key = "tokens_per_s" if tokens else "samples_per_s"
    with run._lock:
        values = [r[key] for r in run._rows if r.get(key)]
    predicted = cost.tokens_per_s if tokens else cost.samples_per_s
    scale = time_fig["predicted"] / time_fig["measured"]
    return {"unit": run.throughput_unit,
            **_figure(statistics.median(values) if values else None, predicted),
            "mfu": _figure(float(cost.mfu) * scale, float(cost.mfu))}


def explain(run: Any) -> str:
    """``run.explain()``: :func:`measured` in words."""
    m = run.measured()

    def fig(f, unit, what: str = "predicted") -> str:
        if not f["measured"]:
            return "not measured"
        pred = f" against {unit(f['predicted'])} {what} (x{f['ratio']:.2f})" if f["ratio"] else ""
        return f"{unit(f['measured'])}{pred}"

    lines = [f"Measured by run {run.run_id[:8]} ({run.status}, {m['device']}); memory: "
             f"{m['basis']}."]
    for r, f in m["by_rank"].items():
        reserve = ("; the allocator's peak reserve "
                   f"{fig(f['reserved'], fmt_bytes, 'predicted, margin included')}"
                   if "reserved" in f else "")
        lines.append(f"Rank {r}: peak {fig(f['peak'], fmt_bytes)}{reserve}; between steps "
                     f"{fig(f['between steps'], fmt_bytes)} (parameters and optimizer state).")
    t = m["time"]
    lines.append(f"Step time (median): {fig(t, fmt_time)}" + (f"; {t['note']}" if t["note"] else "")
                 + ".")
    lines.append("Each other component is not measured by a launched run (bench/memory.py measures "
                 "them with torch's memory tracker).")
    return "\n".join(lines)


def _memory(run: Any) -> tuple[dict[int, float], dict[int, float]]:
    """(rank -> peak bytes, rank -> bytes held between steps): on CPU above each rank's baseline
    (:func:`rss_figures`); on GPUs CUDA's peak allocated and the least allocated at a step's end."""
    rss = run.rss_figures()
    if rss:
        return {r: v["peak"] for r, v in rss.items()}, {r: v["floor"] for r, v in rss.items()}
    peaks: dict[int, float] = {}
    floors: dict[int, float] = {}
    with run._lock:
        rows = list(run._rows)
    for row in rows:
        r = row["rank"]
        if row.get("mem_peak") is not None:
            peaks[r] = max(peaks.get(r, 0.0), float(row["mem_peak"]))
        if row.get("mem_allocated") is not None:
            floors[r] = min(floors.get(r, float("inf")), float(row["mem_allocated"]))
    return peaks, floors


def held_peaks(samples: list[dict]) -> dict[int, float]:
    """rank -> the most memory it held in ``samples`` (:func:`autopar_nb.launch.watch.held`)."""
    out: dict[int, float] = {}
    for s in samples:
        held = watch.held(s)
        if held is not None:
            out[s["rank"]] = max(out.get(s["rank"], 0.0), float(held))
    return out



def _figure(measured: float | None, predicted: float | None) -> dict:
    """``{"measured", "predicted", "ratio"}`` (ratio None where either is unknown)."""
    return {"measured": measured, "predicted": predicted,
            "ratio": measured / predicted if measured and predicted else None}
