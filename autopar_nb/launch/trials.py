"""``tournament()``: does the planner pick the fastest plan? Run the chosen plan and its next best
alternatives for a few steps each on local processes, measure them, and calibrate the cost model
from all of them at once.

Each trial is an ordinary :func:`~autopar_nb.launch.launcher.launch` of the plan's exported script
(the warm pool, the same script ``ap.export`` writes), stopped once its step times are stable; a
plan the cost model predicts does not fit is not run. The measured step times are fitted by scaling
the predicted step's components apart (:func:`autopar_nb.calibration.fit_components`), the factors
that follow are saved for the cluster preset (the next plan of this machine uses them, and its
explanation says so) and every plan is costed again with them.

>>> t = ap.tournament(k=4, steps=20)  # in a notebook: ap is the %%autoparallel session
>>> t  # the table: predicted vs measured, ranks, Kendall's tau, the winner
>>> plan = t.adopt()                  # the measured fastest plan becomes the session's plan
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import calibration
from ..cost import estimate
from ..cost.factors import factors_for
from ..export import export
from ..planner import remembered_plan
from ..units import fmt_bytes
from .compare import same_family
from .launcher import launch
from .standings import Entry, TournamentResult, kendall_tau, stable, steady_time

CV = 0.05
"""a trial stops once its steady step times vary by less than this (stdev / mean)"""
MIN_STEPS = 5
"""steady steps (after warm-up) a trial runs at least before it may stop early"""
WARMUP = 2
"""steps left out of a trial's figures: the first ones pay one-off costs (first collectives,
allocator growth)"""


def machine_mismatch(cluster: Any) -> str:
    """Why this machine cannot rank plans made for ``cluster`` ("" when it can): the trials run
    here, so a plan made for GPUs this machine does not have would be measured on other devices than
    it was costed for."""
    preset = getattr(cluster, "name", "") or ""
    if preset in ("", "cpu"):
        return ""
    import torch

    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    if here and same_family(preset, here):
        return ""
    return (f"the plans were made for {preset} GPUs and this machine has {here or 'no GPU'}: its "
            "trials would measure other devices than the plans were costed for. Run it on a "
            f"machine with {preset} GPUs, or plan for this one (%%autoparallel --gpu cpu) to rank "
            "plans here")


def tournament(target: Any, k: int = 4, steps: int = 20, *, warmup: int = WARMUP, cv: float = CV,
               min_steps: int = MIN_STEPS, memory_limit_bytes: float | None = None,
               calibrate: bool = True, save: bool = True, warm: bool = True,
               timeout_s: float = 300.0, run_root: str | None = None, source: Any = None,
               graph: Any = None, cluster: Any = None,
               progress: Callable[[list[Entry]], None] | None = None,
               stop: threading.Event | None = None) -> TournamentResult:
    """Run the chosen plan and its ``k`` best alternatives for up to ``steps`` steps each on local
    processes (one after the other, each at its plan's world size, through the warm pool), and
    compare what they measure with what the cost model predicted.

    Args:
        target: a Session (``ap`` in a notebook), or a Plan with ``source``, ``graph`` and
            ``cluster`` given.
        k: alternatives run besides the chosen plan (``plan.alternatives``; re-planned with more
            when it holds fewer).
        steps: the most steps a trial runs; it stops earlier once ``min_steps`` steps after
            ``warmup`` have a coefficient of variation below ``cv``.
        memory_limit_bytes: a plan whose predicted peak per rank (margin included) exceeds this
            is skipped, not run (default: the cluster's memory per rank).
        calibrate: fit the cost model to the measured step times and cost every plan again with
            the fit.
        save: store the fitted factors for the cluster's preset (``autopar_nb.calibration``),
            which the next plan on this machine uses (the session's next plan as well); only a
            CPU preset is calibrated by CPU processes.
        timeout_s: the longest a trial may take before it is stopped and counted as failed.
        run_root: where the trials' run directories go (default: a new temporary directory).
        progress: called with the entries when the list of plans is known and whenever one of
            them changes status (``running``, then ``measured``/``failed``/``skipped``/
            ``stopped``), from the thread the tournament runs in.
        stop: once set (from another thread: :meth:`TournamentJob.stop`), the running trial's
            workers are ended and no further plan is run; the result keeps the plans measured so
            far (``stopped`` is True) and no calibration is saved from it. An interrupt
            (KeyboardInterrupt) ends the running trial's workers too, then propagates.

    Returns a :class:`~autopar_nb.launch.standings.TournamentResult`: its table (displayed in a
    notebook), ``tau``/``tau_calibrated``, ``winner``, ``margin`` and ``adopt()``.
    """
    t0 = time.perf_counter()
    session = target if hasattr(target, "current_plan") else None
    plan = session.current_plan() if session is not None else target
    source, graph, cluster = _model_of(session, source, graph, cluster)
    why = machine_mismatch(cluster)
    if why:
        raise ValueError(f"tournament() refused: {why}")
    plans = contenders(plan, k, graph=graph, cluster=cluster, session=session)
    limit = memory_limit_bytes or rank_memory(cluster)
    root = Path(run_root or tempfile.mkdtemp(prefix="autopar-tournament-"))
    entries = [entry_of(p, plan) for p in plans]
    stop = stop or threading.Event()
    run_all(entries, source, limit=limit, root=root, stop=stop,
            tell=progress or (lambda _entries: None), steps=steps, warmup=warmup, cv=cv,
            min_steps=min_steps, warm=warm, timeout_s=timeout_s)
    stopped = stop.is_set()
    measured = [e for e in entries if e.status == "measured"]
    tau = kendall_tau([e.predicted_s for e in measured], [e.measured_s for e in measured]) \
        if len(measured) > 1 else None
    scales, factors, tau_c = {}, {}, None
    preset = getattr(cluster, "name", "") or ""
    if calibrate and measured:
        scales, factors, tau_c = _calibrated(measured, graph, cluster, session,
                                             save=save and not stopped)
    return TournamentResult(entries=entries, tau=tau, tau_calibrated=tau_c, scales=scales,
                            factors=factors, preset=preset, nproc=plan.mesh.world_size,
                            wall_s=time.perf_counter() - t0, session=session, stopped=stopped)


def _model_of(session: Any, source: Any, graph: Any, cluster: Any) -> tuple[Any, Any, Any]:
    """The model's source, graph and cluster: those given, else the session's (ValueError when one
    is missing)."""
    source = source or getattr(session, "source", None)
    graph = graph or getattr(session, "graph", None)
    cluster = cluster or getattr(session, "cluster", None)
    if source is None or graph is None or cluster is None:
        raise ValueError("tournament() needs the model's source, graph and cluster: pass the "
                         "session (ap), or a plan with source=, graph= and cluster=")
    return source, graph, cluster


def _calibrated(measured: list[Entry], graph: Any, cluster: Any, session: Any, *,
                save: bool) -> tuple[dict[str, float], dict[str, float], float | None]:
    """Fit the cost model to the ``measured`` trials and cost them again with the fit: (the
    components' scales, the factors, Kendall's tau of the calibrated predictions; None under two
    trials). ``save``: store the factors for a CPU preset, and give them to ``session``'s
    cluster."""
    scales, factors = fit(measured, cluster)
    recost(measured, graph, cluster, factors)
    tau_c = None
    if len(measured) > 1:
        tau_c = kendall_tau([e.calibrated_s for e in measured],
                            [e.measured_s for e in measured])
    preset = getattr(cluster, "name", "") or ""
    # a stopped tournament's few points are shown fitted but not kept (save is False): the next
    # plan would trust them. CPU processes measure the CPU preset only (Run.calibrate's rule)
    if save and preset == "cpu":
        calibration.store(preset, factors,
                          {"runs": len(measured), "tournament": True, "scales": scales,
                           "measured_step_times_s": [e.measured_s for e in measured],
                           "predicted_step_times_s": [e.predicted_s for e in measured]})
        # its next plan too: the cluster it plans on took the old factors at its start
        if session is not None:
            session.cluster = dataclasses.replace(cluster, calibration={**(cluster.calibration
                                                                           or {}), **factors})
    return scales, factors, tau_c


def run_all(entries: list[Entry], source: Any, *, limit: float, root: Path, stop: threading.Event,
            tell: Callable[[list[Entry]], None], **options: Any) -> None:
    """Run each entry's trial in turn (``options``: :func:`trial`'s), skipping a plan predicted to
    need more than ``limit`` bytes per rank; once ``stop`` is set, the plans not run yet are marked
    stopped."""
    tell(entries)
    for i, e in enumerate(entries):
        if stop.is_set():
            e.status, e.reason = "stopped", "not run: the tournament was stopped"
            continue
        need = predicted_need(e.plan)
        if limit and need > limit:
            e.status, e.reason = "skipped", (f"predicted {fmt_bytes(need)} per rank > "
                                             f"{fmt_bytes(limit)}")
            tell(entries)
            continue
        e.status = "running"
        tell(entries)
        trial(e, source, run_dir=root / f"plan{i}", stop=stop, **options)
        tell(entries)


def contenders(plan: Any, k: int, *, graph: Any, cluster: Any, session: Any = None) -> list[Any]:
    """The chosen plan and its ``k`` best alternatives: ``plan.alternatives``, or, when it holds
    fewer and a session gives the constraints, the planner's next best with ``top_k = k + 1`` (the
    chosen plan's equal left out)."""
    alts = list(plan.alternatives[:k])
    if len(alts) < k and session is not None:
        more = remembered_plan(graph, cluster, global_batch=session.batch,
                               per_rank_batch=session.per_rank_batch, seq_len=graph.seq_len,
                               fix=session.fix, overrides=session.overrides, top_k=k + 1,
                               default_loss=session.source.loss_fn_var is None)
        pool = [more, *more.alternatives]
        alts += [p for p in pool if plan.diff(p) and all(a.diff(p) for a in alts)][:k - len(alts)]
    return [plan, *alts]


def entry_of(p: Any, chosen: Any) -> Entry:
    """An Entry for plan ``p`` with its predictions, labelled by its summary and what differs from
    ``chosen``."""
    label = p.summary().split(" | ")[0]
    if p is not chosen:
        changes = chosen.diff(p)
        # the same summary: say what sets it apart
        if changes and label == chosen.summary().split(" | ")[0]:
            label += f" ({changes[0].path.rsplit('.', 1)[-1]}: {changes[0].new}" + (
                f", +{len(changes) - 1}" if len(changes) > 1 else "") + ")"
    c = p.cost
    peak = max((float(m.total - m.margin) for m in c.memory_by_rank),
               default=float(c.peak_memory_bytes))
    return Entry(plan=p, label=label, predicted_s=float(c.step_time_s), predicted_peak=peak)


def rank_memory(cluster: Any) -> float:
    """The bytes a rank of ``cluster`` may hold: its per-rank limit, else its device's memory."""
    return float(getattr(cluster, "rank_memory", None) or cluster.device.memory_bytes)


def predicted_need(p: Any) -> float:
    """The most bytes a rank of ``p`` is predicted to hold, allocator margin included."""
    return max((float(m.total) for m in p.cost.memory_by_rank),
               default=float(p.cost.peak_memory_bytes))


def trial(e: Entry, source: Any, *, steps: int, warmup: int, cv: float, min_steps: int, warm: bool,
          timeout_s: float, run_dir: Path, stop: threading.Event | None = None) -> None:
    """Launch ``e.plan``'s exported script, stop it once its steps are stable (or ``stop`` is set),
    and fill ``e`` with what it measured."""
    p, t0 = e.plan, time.perf_counter()
    run = launch(lambda path: export(source, p, path, quiet=True), p.mesh.world_size, steps, plan=p,
                 warm=warm, run_dir=run_dir)
    try:
        watch_trial(e, run, t0, warmup=warmup, cv=cv, min_steps=min_steps, timeout_s=timeout_s,
                    stop=stop)
    # an interrupt of the kernel: the run's workers would otherwise train on beside it
    except BaseException:
        run.stop("the tournament was interrupted")
        raise
    times = step_times(run.metrics)
    e.steps, e.wall_s = len(times), time.perf_counter() - t0
    if stop is not None and stop.is_set() and run.status != "finished" and not e.stopped_early:
        e.status, e.reason = "stopped", f"stopped after {len(times)} steps"
        return
    if run.status != "finished" and not (e.stopped_early and times):
        e.status, e.reason = "failed", f"{run.status}: {run.message}"
        return
    e.measured_s = steady_time(times, warmup=warmup)
    peaks = {r: f["peak"]["measured"] for r, f in run.measured()["by_rank"].items()
             if f["peak"]["measured"]}
    e.peak_by_rank = peaks
    e.measured_peak = max(peaks.values(), default=None)
    e.status = "measured"
    if e.stopped_early:
        e.reason = f"stable after {len(times)} steps"


def watch_trial(e: Entry, run: Any, t0: float, *, warmup: int, cv: float, min_steps: int,
                timeout_s: float, stop: threading.Event | None) -> None:
    """Wait for ``run`` to end, stopping it once its step times are stable, it ran past
    ``timeout_s`` or ``stop`` is set."""
    while not run.done:
        run.wait(0.2)
        times = step_times(run.metrics)
        if stop is not None and stop.is_set():
            run.stop("the tournament was stopped")
        elif stable(times, warmup=warmup, min_steps=min_steps, cv=cv) and not run.done:
            e.stopped_early = True
            run.stop("its step times are stable")
        elif time.perf_counter() - t0 > timeout_s:
            run.stop(f"trial longer than {timeout_s:.0f} s")


def step_times(rows: list[dict]) -> list[float]:
    """Each step's time as its slowest rank took it (the latest attempt's steps), in step order."""
    attempt = max((r.get("attempt", 0) for r in rows), default=0)
    by_step: dict[int, float] = {}
    for r in rows:
        if r.get("attempt", 0) == attempt and r.get("step_time_s") is not None:
            by_step[r["step"]] = max(by_step.get(r["step"], 0.0), float(r["step_time_s"]))
    return [by_step[s] for s in sorted(by_step)]


def fit(measured: list[Entry], cluster: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The component scales fitted to the measured entries, and the cost-model factors that apply
    them to the factors ``cluster``'s plans were made with."""
    scales = calibration.fit_components([calibration.components(e.plan.cost) for e in measured],
                                        [e.measured_s for e in measured])
    current = dataclasses.asdict(factors_for(cluster))
    return scales, calibration.factors_from_scales(scales, current=current)


def recost(entries: list[Entry], graph: Any, cluster: Any, factors: dict[str, float]) -> None:
    """Each entry's ``calibrated_s``: its plan costed again by the cost model with ``factors`` in
    force."""
    calibrated = dataclasses.replace(cluster,
                                     calibration={**(cluster.calibration or {}), **factors})
    for e in entries:
        e.calibrated_s = float(estimate(graph, calibrated, e.plan).step_time_s)
