"""The live dashboard of a Run: an anywidget whose traits the monitor thread sets (kernel side
only).

It declares state and holds no logic beyond turning ``Run`` figures into plain data:
``static/dashboard.js`` draws, with uPlot (vendored in ``static/vendor/uplot``), memory and
utilisation over time (one line per rank, the plan's prediction dashed, the device limit), loss,
throughput and step time per step (one line per rank, the predicted step time dashed where it
compares), a per-rank table with each rank's state, the first failing rank's traceback, the last log
lines, Stop and, at the end, measured vs predicted and calibration. Trait updates reach the browser
while other cells run (see ../shared/notes/browser-testing.md).

Cost: the table and status are sent at most ``PUSH_INTERVAL_S`` apart (monitor.py); the series at
most once per ``CHART_INTERVAL_S``, as float32 bytes (binary buffers, no JSON), decimated to
``series.MAX_POINTS`` per line.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import anywidget
import psutil
import traitlets

from . import compare, report, watch
from .series import float32_bytes

STATIC = Path(__file__).resolve().parent.parent / "static"
UPLOT = STATIC / "vendor" / "uplot"
SHARED_JS = (UPLOT / "uPlot.iife.min.js", STATIC / "units.js", STATIC / "kernel.js")
"""what every front end puts in front of its own file: uPlot, the units' text, the kernel's watch"""
CHART_INTERVAL_S = 1.0
"""the series (the charts' data) are sent at most this often"""
THROUGHPUT_LABEL = {"samples/s": "samples/s", "tokens/s": "tokens/s"}


def bundle(*files: Path) -> str:
    """The files' text, one after the other (uPlot's IIFE build declares ``var uPlot`` for the code
    after it)."""
    return "\n".join(f.read_text() for f in files)


class Dashboard(anywidget.AnyWidget):
    """Live view of one :class:`~autopar_nb.launch.run.Run` (``display(run)`` shows it)."""

    _esm = bundle(*SHARED_JS, STATIC / "dashboard.js")
    _css = bundle(UPLOT / "uPlot.min.css", STATIC / "dashboard.css")
    status = traitlets.Unicode("starting").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    error = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    """the first failing rank: {"rank", "error", "traceback", "time_s", "knock_on": [{"rank",
    "error", "after_s"}]}"""
    hang = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    """when the run hung: {"rank" that stopped first, "seconds", "stacks": {rank: its threads'
    stacks}}"""
    ranks = traitlets.List().tag(sync=True)
    """per rank: {"rank", "state", "step", "attempt", "memory", "memory_source", "memory_peak" and
    "memory_pred" (``report.peak_figures``: the widget's and the summary's figures),
    "memory_peak_kind" (their label), "memory_off" (the peak is a prediction error:
    ``watch.prediction_off``), "util", "throughput", "step_time", "data_wait", "power_w",
    "temperature_c", "log": [str]}"""
    info = traitlets.Dict().tag(sync=True)
    """what the charts show and what compares: labels, the plan's predictions, the limit, notes"""
    timeline = traitlets.Dict().tag(sync=True)
    """{"n", "ranks", "t": float32 bytes [n], "memory", "util": float32 bytes [ranks x n] (NaN: no
    value)}"""
    steps = traitlets.Dict().tag(sync=True)
    """{"n", "ranks", "x": float32 bytes [n], "loss", "throughput", "step_time", "data_wait": [ranks
    x n]}"""
    summary = traitlets.Dict().tag(sync=True)
    """at the end: measured vs predicted, the data-wait verdict, and what was calibrated"""
    events = traitlets.List().tag(sync=True)
    """the events of this run and of the runs before it (re-plans), in time order: {"t": seconds
    since the first launch, "kind", "rank", "reason", "leg": 0 for the first run, 1 after one
    re-plan, ...}"""
    replan = traitlets.Dict().tag(sync=True)
    """{"mode": "ask"|"auto"|"off"|None, "pending": a proposal waits for Re-plan & resume or Stop,
    "text", "busy"}"""

    def __init__(self, run, **kwargs):
        super().__init__(**kwargs)
        self._run = run
        self._total_ram = float(psutil.virtual_memory().total)
        self._sent = {"timeline": -1, "steps": -1}
        self._charts_at = 0.0
        self._info_key = None
        self._refresh_lock = threading.Lock()
        self.refresh_cpu_s = 0.0
        """CPU seconds spent in refresh() (bench/dashboard.py)"""
        self.refreshes = 0
        self.on_msg(self._on_front_end_msg)
        run.add_listener(self.refresh)
        self.refresh(run)

    def _on_front_end_msg(self, _widget, content, _buffers) -> None:
        event = content.get("event") if isinstance(content, dict) else None
        if event == "stop":
            # stopping takes a few seconds: do not hold the kernel's message loop meanwhile
            threading.Thread(target=self._run.stop, args=("Stop button",), daemon=True).start()
        elif event == "replan":
            threading.Thread(target=self._replan_quietly, daemon=True).start()
        elif event == "calibrate":
            try:
                self._run.calibrate()
            except (ValueError, RuntimeError) as e:
                self.summary = {**self.summary,
                                "calibration": {"done": False, "text": f"not calibrated: {e}"}}

    def _replan_quietly(self) -> None:
        try:
            self._run.replan()
        except Exception as e:  # shown, not raised into the kernel's message loop
            self.replan = {**self.replan, "pending": False, "busy": False,
                           "text": f"re-planning failed: {e}"}

    def follow(self, run) -> None:
        """Show ``run`` from now on: the run that continues this one after a re-plan (the events so
        far stay)."""
        with self._refresh_lock:
            self._run = run
            self._sent = {"timeline": -1, "steps": -1}
            self._info_key = None
        run._dashboard = self
        run.add_listener(self.refresh)
        self.refresh(run)

    def refresh(self, run=None) -> None:
        """Copy the run's current figures into the traits (called from the monitor thread)."""
        # a run this dashboard no longer follows (re-planned)
        if run is not None and run is not self._run:
            return
        run = run or self._run
        t0 = time.thread_time()
        with self._refresh_lock:  # the monitor thread and the constructor may both refresh
            key = (run.throughput_unit, run.gpu_name,
                   sum(st.baseline is not None for st in run._ranks.values()),
                   any("gpu_mem_total" in st.sample for st in run._ranks.values()),
                   run.status == "starting", run.done)
            info = self._info(run) if key != self._info_key else None
            self._info_key = key
            now = time.monotonic()
            charts = run.done or now - self._charts_at >= CHART_INTERVAL_S
            with run._lock:
                timeline = (self._timeline(run)
                            if charts and run.versions["timeline"] != self._sent["timeline"]
                            else None)
                steps = (self._steps(run) if charts and run.versions["steps"] != self._sent["steps"]
                         else None)
                ranks = self._ranks(run)
            if timeline is not None or steps is not None:
                self._charts_at = now
            summary = self._summary(run) if run.done else None
            with self.hold_sync():
                self.status, self.message, self.error = run.status, run.message, run.error
                self.hang = {**run.hang,
                             "stacks": {str(k): v for k, v in run.hang["stacks"].items()}} \
                    if run.hang else None
                self.ranks = ranks
                if info is not None:
                    self.info = info
                if timeline is not None:
                    self.timeline = timeline
                if steps is not None:
                    self.steps = steps
                if summary is not None:
                    self.summary = summary
                self.events, self.replan = events_of(run), replan_state(run)
        self.refreshes += 1
        self.refresh_cpu_s += time.thread_time() - t0

    # ---- plain data for the front end (_timeline, _steps, _ranks: under run._lock) ---------------
    def _info(self, run) -> dict:
        c = run.comparison()
        gpu = run.backend == "nccl"
        ranks = run.ranks()
        limit = None
        for st in ranks.values():
            limit = st.sample.get("gpu_mem_total") or limit
        based = sum(st.baseline is not None for st in ranks.values())
        plan = run.plan
        # an attached run (attached.py): its ranks are on other hosts
        away = getattr(run, "address", None)
        if away:
            c = {**c, "run_device": f"{c['run_device']} on other hosts, streaming to {away}"}
        return {
            "nproc": run.nproc, "backend": run.backend, "steps": run.steps,
            "run_id": run.run_id[:8],
            "plan": plan.summary() if hasattr(plan, "summary")
            and getattr(plan, "mesh", None) is not None else "", **c,
            "memory_label": ("GPU memory used (NVML)" if gpu else
                             "RSS above the RSS before the model was built" if based == run.nproc
                             else
                             "RSS (the script reports no RSS before its model; see Run.samples)"
                             if run.status != "starting" or based
                             else "RSS above the RSS before the model was built"),
            "util_label": "GPU utilisation (NVML, %)" if gpu else "CPU (% of one core)",
            # this host's RAM is not theirs
            "limit": limit if gpu else None if away else self._total_ram,
            "limit_label": "GPU memory" if gpu else "host RAM (shared by every rank)",
            "unit": run.throughput_unit,
        }

    def _timeline(self, run) -> dict:
        tl = run._timeline
        self._sent["timeline"] = run.versions["timeline"]
        return {"n": len(tl), "ranks": tl.nranks, "t": float32_bytes(tl.t),
                "memory": float32_bytes(*tl.cols["memory_bytes"]),
                "util": float32_bytes(*tl.cols["utilization_pct"])}

    def _steps(self, run) -> dict:
        ss = run._steps
        self._sent["steps"] = run.versions["steps"]
        out = {"n": len(ss), "ranks": ss.nranks, "x": float32_bytes(ss.x)}
        for f in ss.fields:
            out[f] = float32_bytes(*ss.cols[f])
        return out

    def _ranks(self, run) -> list[dict]:
        judge = watch.settings_for(run.comparison())
        gpu = run.backend == "nccl"
        out = []
        tl, peaks = run._timeline, report.peak_figures(run)
        for r, st in sorted(run._ranks.items()):
            last, sample = st.last, st.sample
            if r < tl.nranks and tl.t:
                mem, src = tl.cols["memory_bytes"][r][-1], tl.text["source"][r][-1]
            else:
                mem, src = math.nan, None
            # the peak run.measured() gives the widget and the summary: one figure, one label, one
            # ratio
            peak = peaks.get(r) or {"measured": None,
                                    "predicted": compare.predicted_memory(run.plan, r,
                                                                          model_state=True)}
            out.append({
                "rank": r, "state": st.state(run.status), "step": st.step,
                "attempt": max(st.attempt, 0), "memory": None if math.isnan(mem) else mem,
                "memory_source": src, "memory_peak": peak["measured"],
                "memory_peak_kind": report.PEAK_LABELS[gpu], "memory_pred": peak["predicted"],
                # flagged by the rule the run's prediction_error events follow, not by any ratio
                # above 1
                "memory_off": watch.prediction_off("memory", peak["measured"], peak["predicted"],
                                                   judge),
                "baseline": st.baseline, "util": sample.get("gpu_util", sample.get("cpu_percent")),
                "throughput": last.get("tokens_per_s", last.get("samples_per_s")),
                "step_time": last.get("step_time_s"), "data_wait": last.get("data_wait_s"),
                "power_w": sample.get("power_w"), "temperature_c": sample.get("temperature_c"),
                "log": st.log_tail,
            })
        return out

    def _summary(self, run) -> dict:
        s = run.summary()
        c = run.comparison()
        # the rank table's figures: the summary repeats them, not another measure
        peaks = report.peak_figures(run)
        out = {"steps": s.get("steps"), "step_time_s": s.get("step_time_s"),
               "predicted_step_time_s": c["predicted_step_time_s"],
               "compare_time": c["compare_time"],
               "memory_label": report.PEAK_LABELS[run.backend == "nccl"],
               "predicted_label": report.PREDICTED_LABEL,
               "memory_by_rank": {str(r): f["measured"] for r, f in peaks.items()
                                  if f["measured"] is not None},
               "predicted_memory_by_rank": {str(r): f["predicted"] for r, f in peaks.items()
                                            if f["predicted"] is not None}, "data": s.get("data")}
        out["calibration"] = _calibration_text(run, c)
        return out


def events_of(run) -> list[dict]:
    """Every event of ``run`` and of the runs it continues, in time order, timed from the first
    launch."""
    first = _first(run)
    out = []
    for leg, r in enumerate(first.legs()):
        offset = r.started - first.started
        with r._lock:
            events = list(r.events)
        out += [{"t": (e.get("t") or 0.0) + offset, "kind": e["kind"], "rank": e.get("rank"),
                 "reason": e.get("reason", ""), "leg": leg} for e in events]
    return sorted(out, key=lambda e: e["t"])


def _first(run):
    while run.continues is not None:
        run = run.continues
    return run


def replan_state(run) -> dict:
    """What the dashboard says about re-planning: a proposal waiting for an answer ("ask"), or one
    under way."""
    r = run.replanning
    p = run.replan_proposal or {}
    busy = r is not None and r.busy(run)
    pending = (r is not None and r.mode == "ask" and bool(p) and not p.get("given_up") and not busy
               and run.continued_by is None)
    return {"mode": r.mode if r is not None else None, "pending": pending, "busy": busy,
            "text": "re-planning: stopping the run, planning for less memory, resuming from the "
                    "last checkpoint" if busy else p.get("text", "")}


def _calibration_text(run, c: dict) -> dict:
    """What calibration did or would do, in words (``{"done", "can", "text"}``)."""
    from .. import calibration

    if run.calibration:
        k = run.calibration
        # the host's seconds (cost/cpu.py): one entry
        host = [n for n in k["factors"] if n.startswith("cpu_")]
        names = ", ".join([n for n in sorted(k["factors"]) if n not in host]
                          + ([f"the host's cpu_* seconds ({len(host)})"] if host else []))
        return {"done": True, "can": False,
                "text": f"calibrated for {k['preset']}: {names} (measured / predicted step time "
                        f"{k['ratio']:.2f}) stored in {k['path']}; the next plan for {k['preset']} "
                        "uses them"}
    if run.status != "finished":
        return {"done": False, "can": False,
                "text": "not calibrated: only a finished run calibrates"}
    if not c["compare_time"]:
        why = (f"the plan was made for {c['plan_device']}, this run used {c['run_device']}"
               if c["plan_device"] else "the plan has no predicted step time")
        return {"done": False, "can": False, "text": f"not calibrated: {why}"}
    preset = c["plan_device"] or "cpu"
    memory = " and the allocator margin (CUDA peak)" if run.backend == "nccl" else ""
    return {"done": False, "can": True,
            "text": "not calibrated yet: run.calibrate() (or the button) stores the speed "
                    f"factors{memory} for {preset} in {calibration.path()}"}


RULES = {
    "rtol": "loss, gradients and parameters within rtol",
    "adam": "parameters within rtol plus the Adam floor per step so far; gradients within rtol "
            "plus the previous step's parameter difference (the weights differ by that much)",
    "low precision": "loss and parameters as for fp32; gradients judged at step 0 only (bf16/fp16 "
                     "rounding changes the weights after the first update)",}
"""what each rule of ``VerifyReport.judge`` means"""


class JobView(anywidget.AnyWidget):
    """The view of a job that runs beside the kernel (Verify's, a tournament's): its thread sets the
    traits through :meth:`refresh` whenever the job changes; the front end's events ({"event":
    name}) go to :meth:`on_event`."""

    status = traitlets.Unicode("starting").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    progress = traitlets.Dict().tag(sync=True)
    rows = traitlets.List().tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)

    def __init__(self, job, **kwargs):
        super().__init__(**kwargs)
        self._job = job
        self.on_msg(self._on_front_end_msg)
        job.add_listener(self.refresh)
        self.refresh(job)

    def _on_front_end_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict):
            self.on_event(content.get("event"))

    def on_event(self, event: str | None) -> None:
        """A button of the view was pressed (the subclass says which it has)."""

    def refresh(self, job=None) -> None:
        raise NotImplementedError


class VerifyView(JobView):
    """Progress and per-step verdicts of a :class:`~autopar_nb.verify.job.VerifyJob` (the job's
    thread sets the traits): a bar, one row per step, each row pass/fail with the rule
    ``VerifyReport.judge`` used. ``progress``: {"steps", "done": parallel steps reported, "plan",
    "nproc"}; ``rows``: per step {"step", "loss"}, then with the report {"ref_loss", "loss_rel",
    "grad_rel", "param_rel", "ok", "rule", "param_tol"}."""

    _esm = STATIC / "verify.js"
    _css = bundle(STATIC / "dashboard.css")
    notes = traitlets.List().tag(sync=True)
    """the rules used and the tolerances, in words"""

    def on_event(self, event: str | None) -> None:
        if event == "stop":
            threading.Thread(target=self._job.stop, args=("Stop button",), daemon=True).start()

    def refresh(self, job=None) -> None:
        job = job or self._job
        with self.hold_sync():
            self.status, self.message, self.error = job.status, job.message, job.error or ""
            self.progress = {"steps": job.steps, "done": len(job.losses), "plan": job.plan_summary,
                             "nproc": job.nproc}
            self.rows = job.rows()
            self.notes = verify_notes(job.report) if job.report is not None else []


def verify_notes(report) -> list[str]:
    """The rules a VerifyReport judged its steps by, and its tolerances, in words."""
    used = sorted({report.judge(s)[1] for s in report.steps})
    out = [f"rtol {report.rtol:g}; "
           f"{'every step passes its rule' if report.ok else 'some step fails its rule'}"]
    out += [f"{rule}: {RULES.get(rule, rule)}" for rule in used]
    if report.param_floor:
        out.append(f"Adam floor: {report.param_floor:.2e} per step (2 x lr / largest |parameter|: "
                   "an element whose gradient is at rounding level moves by +-lr whichever way it "
                   "rounds)")
    if report.random_left:  # first: they may explain a mismatch
        out.insert(0, f"random ops left on in both runs: {', '.join(report.random_left)} (verify "
                      "cannot switch them off; the runs draw them differently)")
    if report.random_off:
        out.append("random ops switched off in both runs (per forward): "
                   f"{', '.join(report.random_off)}: the ranks would draw other masks than the "
                   "reference")
    if report.missing:
        out.append(f"no gradient in the parallel run for: {', '.join(report.missing)}")
    return out
