"""``Run``: a launched training run, as seen from the notebook.

Every field is filled by the run's monitor thread (see ``monitor.py``) under ``Run._lock``; the public methods read
it. Status values::

    starting -> running [-> restarting -> running ...] -> finished | failed | stopped | hung
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ..units import fmt_bytes, fmt_time
from . import compare, logfiles, procs, watch
from .failure import failure_order
from .hang import STARTUP_TIMEOUT_S, hang_message, silent_message, stalled_rank, waited_for
from .metrics import MetricsTable, RankState, step_row, summarize
from .series import StepSeries, Timeline

__all__ = ["LOG_TAIL_LINES", "SAMPLE_FIELDS", "STARTUP_TIMEOUT_S", "TERMINAL", "MetricsTable", "RankState", "Run"]

TERMINAL = ("finished", "failed", "stopped", "hung")
END_KINDS = {"finished": "finish", "failed": "fail", "stopped": "stop", "hung": "hang"}
"""the event kind of each final status"""
LOG_TAIL_LINES = 8
STACK_WAIT_S = 0.5
"""seconds the ranks get to print their stacks when a hang is found"""
ERROR_LOG_LINES = 60
"""lines of a rank's log shown for a failure that left no Python traceback"""
MAX_ROWS = 100_000
"""metrics rows kept; beyond, every other step is dropped (the stride doubles), as the series are decimated"""
SAMPLE_FIELDS = {
    "memory_bytes": "the rank's memory: on GPUs what its process holds by NVML's process list ('nvml'), else CUDA's "
                    "reserved bytes from its last step ('cuda'), else the memory used on its whole GPU by every "
                    "process ('nvml-device'); on CPU its RSS above rss_baseline_bytes ('psutil'; the raw RSS until "
                    "the baseline is known; 'stream': the RSS its last step reported, for ranks whose process the "
                    "notebook cannot see, as in an attached run)",
    "utilization_pct": "NVML's SM utilisation on GPUs, else the process's CPU % (100 = one core)",
    "rss_bytes": "the process's resident set size (psutil, else what its last step reported)",
    "rss_baseline_bytes": "its RSS before the model was built (the exported script's RSS_BEFORE_MODEL)",
    "rss_peak_bytes": "the process's peak RSS so far (Linux VmHWM): memory limits are held against it, above the "
                      "baseline, so a peak between two samples counts",
    "cuda_allocated_bytes": "torch.cuda.memory_allocated() at the rank's last step",
    "cuda_reserved_bytes": "torch.cuda.memory_reserved() at the rank's last step",
    "cuda_peak_bytes": "torch.cuda.max_memory_allocated() at the rank's last step",
    "nvml_used_bytes": "NVML: memory used on the rank's GPU (every process on it)",
    "nvml_process_bytes": "NVML: memory the rank's own process holds on its GPU, CUDA context included (None where "
                          "NVML lists the process under another PID, as in containers)",
    "nvml_total_bytes": "NVML: the GPU's memory",
    "power_w": "NVML: board power",
    "temperature_c": "NVML: GPU temperature",
    "step": "the last step the rank reported",
    "loss": "the loss of that step",
    "step_time_s": "its step time",
    "samples_per_s": "its throughput (or tokens_per_s for token models)",
    "tokens_per_s": "its throughput in tokens",
    "data_wait_s": "the part of that step spent making and moving the batch",
}
"""the numeric fields of ``Run.samples`` (None where unknown), besides ``t``, ``rank``, ``state`` and ``source``"""
STALE_SAMPLE_S = 1.5
"""a device sample this much older than the rank's last step predates it by more than a tick (its process was not
found since: it ended, or runs elsewhere): the RSS the step reported is shown instead ("stream")"""
STEP_FIELDS = ("loss", "step_time_s", "throughput", "data_wait_s")
CPU_LIMIT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
"""the workers' environment under a CPU memory limit (the plan's ``memory_limit_bytes``): glibc's fixed mmap threshold
(1 MiB), so a freed tensor of 1 MiB or more goes back to the system at once and a rank's peak RSS is its runtime's
floor plus the tensors the plan counts. glibc's default threshold rises to the largest block freed so far, so later
tensors come from a heap that keeps its free blocks: a 2-rank MLP grew from 200 MiB
at step 0 to 334-348 MiB above its baseline by step 30 (205-211 MiB with this), which no plan predicts. It costs
page faults on every step (that MLP: +17 % step time); a variable the user sets wins"""


def cpu_limit_env(plan: Any, backend: str) -> dict[str, str]:
    """:data:`CPU_LIMIT_ENV` for a CPU run of a plan made with a per-rank memory limit, else {}."""
    limited = (getattr(plan, "cluster", None) or {}).get("memory_limit_bytes")
    return dict(CPU_LIMIT_ENV) if limited and backend != "nccl" else {}


class Run:
    """A training run on local worker processes, started by :func:`autopar_nb.launch.launch`.

    Non-blocking: the workers run in the background while the notebook stays free. Use ``wait()`` to block,
    ``stop()`` to end it, ``status`` / ``error`` / ``metrics`` / ``logs(rank)`` to inspect it, and ``calibrate()``
    to feed the measured step time and memory back into the cost model. Displaying a Run shows its live dashboard.
    """

    def __init__(self, *, run_id: str, run_dir: Path, script: Path, nproc: int, steps: int | None, token: str,
                 backend: str, max_restarts: int, hang_timeout_s: float | None, plan: Any = None,
                 command: list[str] | None = None):
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.script = Path(script)
        self.nproc = nproc
        self.steps = steps
        self.backend = backend
        """"gloo" (CPU workers) or "nccl" (one GPU per worker)"""
        self.max_restarts = max_restarts
        self.hang_timeout_s = hang_timeout_s
        self.plan = plan
        self.command = command or []
        """the equivalent torchrun command line"""
        self.warm = False
        self.worker_env: dict[str, str] | None = None
        """the workers' environment (the GPUs they see); None: the kernel's"""
        """whether it ran through the warm pool (``launch(warm=True)``, see ``pool.py``)"""
        self._end_hooks: list[Callable[[Run], None]] = []
        """called once from the monitor thread when the run has ended (the pool starts its next standby)"""
        self._event_hooks: list[Callable[[Run, list[dict]], None]] = []
        """called from the monitor thread with the events each tick found (``replan.Replanner``); must not block"""
        self._token = token
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._listeners: list[Callable[[Run], None]] = []
        self._proc = None  # the agent's subprocess.Popen
        self._server = None  # channel.MetricsServer
        self._monitor = None
        self._stop_reason: str | None = None
        self._teardown_lock = threading.Lock()
        self._ending = False  # _ended() has begun
        self._rows = MetricsTable()
        self._ranks = {r: RankState(r) for r in range(nproc)}
        self._workers: dict[int, psutil.Process] = {}
        self._status = "starting"
        self._message = f"starting {nproc} worker(s)"
        self._error: dict | None = None
        self._result: dict | None = None
        self._error_time: float | None = None
        self._attempt_seen = -1
        self.started = time.time()
        self._t0 = time.monotonic()
        self.first_step_time: float | None = None
        """seconds from launch to the first step's metrics (any rank)"""
        self.ended: float | None = None
        self.monitor_cpu_s: float | None = None
        """CPU seconds the monitor thread used (set when the run has ended)"""
        self._dashboard = None
        self._timeline = Timeline(nproc, tuple(SAMPLE_FIELDS), ("state", "source"))
        self._steps = StepSeries(nproc, STEP_FIELDS)
        self._tick = -1
        self._rows_stride = 1
        self.versions = {"timeline": 0, "steps": 0}
        """incremented whenever the time series or the step series change (for incremental readers)"""
        self.throughput_unit = "samples/s"
        self.gpu_name = ""
        """NVML's name of the first GPU (GPU runs only)"""
        self.calibration: dict | None = None
        """what ``calibrate()`` stored: {"preset", "path", "factors", "ratio"}"""
        self.hang: dict | None = None
        """when the run hung: {"rank" that stopped reporting first, "seconds" without progress, "stacks": {rank:
        every thread's Python stack, printed by the rank when the hang was found (exported scripts)}}"""
        self.data: dict | None = None
        """the script's data-wait verdict when training ended: {"share": the slowest rank's share of step time spent
        waiting for batches, "bottleneck": share above 10 %, "message": the line the script printed, with remedies
        when data loading is the bottleneck} (None before it arrives, or from a script that sends none)"""
        self.events: list[dict] = []
        """{"t": seconds since launch, "kind", "rank", "reason", ...} in the order found: the run's own (launch,
        restart, finish | fail | stop | hang), what the watch found (oom, memory_high, straggler, prediction_error:
        see watch.py), the ranks' own (numerics, checkpoint) and re-planning's (replan, resume: see replan.py)"""
        self._watch: watch.Watch | None = None
        self.memory_threshold = 0.92
        """share of a rank's memory limit above which its memory is a ``memory_high`` event"""
        self.replanning = None
        """the ``replan.Replanner`` of a launch with ``replan="ask"|"auto"`` (None: "off", or a plain launch)"""
        self.replan_proposal: dict | None = None
        """set when an event calls for re-planning: {"trigger": the event, "cause", "text", "given_up"}"""
        self.continued_by: Run | None = None
        """the run that resumed this one under a new plan (``replan()``)"""
        self.continues: Run | None = None
        """the run this one resumed from"""

    # ---- public API ---------------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        """starting | running | restarting | finished | failed | stopped | hung"""
        return self._status

    @property
    def message(self) -> str:
        """The status line: what is happening, or why the run ended."""
        return self._message

    @property
    def error(self) -> dict | None:
        """On failure: {"rank", "error", "traceback", "attempt"} of the first rank that failed, else None."""
        return self._error

    @property
    def done(self) -> bool:
        """True once the run has ended (any terminal status) and every worker is gone."""
        return self._done.is_set()

    @property
    def metrics(self) -> MetricsTable:
        """Every step message received, one row per (rank, step, attempt), in (attempt, step, rank) order."""
        with self._lock:
            rows = [dict(r) for r in self._rows]
        return MetricsTable(sorted(rows, key=lambda r: (r.get("attempt", 0), r.get("step", 0), r.get("rank", 0))))

    @property
    def samples(self) -> list[dict]:
        """The run's time series: one plain dict per rank and tick, a tick every ``monitor.SAMPLE_INTERVAL_S``
        seconds from launch (start-up included), in time order::

            {"t": seconds since launch, "rank": 0, "state": "running", "source": "psutil",
             "memory_bytes": ..., "utilization_pct": ..., "step": ..., "loss": ..., ...}

        ``source`` says where ``memory_bytes`` came from: "nvml" | "cuda" | "nvml-device" | "psutil" | "stream"
        (None before the rank's process exists or reported); the other keys are :data:`SAMPLE_FIELDS` (None where
        unknown). Memory stays bounded over long runs: beyond 1000 ticks every other one is dropped (the interval
        between samples doubles), the latest kept."""
        with self._lock:
            return self._timeline.samples()

    def loss_curve(self, rank: int = 0) -> list[tuple[int, float]]:
        """(step, loss) of one rank, in step order; a step redone after a restart counts once (its latest value)."""
        with self._lock:
            by_step = {r["step"]: r["loss"] for r in self._rows if r["rank"] == rank and r.get("loss") is not None}
        return sorted(by_step.items())

    def last_steps(self) -> dict[int, int | None]:
        """rank -> last step it reported."""
        with self._lock:
            return {r: s.step for r, s in self._ranks.items()}

    def ranks(self) -> dict[int, RankState]:
        """rank -> a copy of what is known about it (step, attempt, device sample, last log lines)."""
        with self._lock:
            return {r: s.copy() for r, s in self._ranks.items()}

    def workers(self) -> dict[int, psutil.Process]:
        """rank -> live worker process (psutil), as last seen by the monitor (refreshed about once a second); looked
        up now while some rank is missing (a warm run's ranks report their first step before the first refresh)."""
        with self._lock:
            w = dict(self._workers)
        if len(w) < self.nproc and not self._done.is_set():
            w = self._refresh_workers()
        return w

    def processes(self) -> list[psutil.Process]:
        """Every process of this run still alive (the agent and its workers, found by the run's token in their
        environment); empty once the run has ended."""
        return procs.processes_with_token(self._token)

    def logs(self, rank: int = 0, *, attempt: int | None = None, tail: int | None = None) -> str:
        """The output of one rank (stdout, then stderr) in one attempt (default: the latest), optionally only the
        last ``tail`` lines."""
        return logfiles.rank_output(logfiles.rank_dir(self.run_dir, self.run_id, rank, attempt), tail)

    def rows_since(self, index: int) -> list[dict]:
        """The metrics rows from ``index`` on (rows are only ever appended): for incremental consumers."""
        with self._lock:
            return [dict(r) for r in self._rows[index:]]

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends (or ``timeout`` seconds pass) and return the status; after a re-plan, until the
        run that continues it ends, and its status. Interrupting it (KeyboardInterrupt, the notebook's stop button)
        stops the run, then re-raises."""
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    break
            if self._done.is_set() and self.replanning is not None:  # a re-plan continues it: follow
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self.replanning.wait_for(self, left) and self.continued_by is not None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    return self.continued_by.wait(left)
        except KeyboardInterrupt:
            self.stop("interrupted (KeyboardInterrupt in wait())")
            raise
        return self._status

    def replan(self):
        """Stop this run (if it still runs), calibrate with the memory it measured, re-plan with the user's pins kept
        and resume from the last complete checkpoint under the new plan; returns the run that continues (see
        :mod:`autopar_nb.launch.replan`), or None when no plan uses less memory (``events`` says why)."""
        if self.replanning is None:
            raise ValueError("this run cannot re-plan: launch it from a session (ap.launch(..., replan='ask' or "
                             "'auto')), which knows the model and its pins")
        return self.replanning.replan(self)

    def legs(self) -> list[Run]:
        """This run and the runs that continued it after re-plans, in order."""
        out, r = [self], self.continued_by
        while r is not None:
            out.append(r)
            r = r.continued_by
        return out

    def stop(self, reason: str = "stopped by the user") -> str:
        """End every worker (within about 4 s) and return the final status."""
        with self._lock:
            if self._stop_reason is None and not self._done.is_set():
                self._stop_reason = reason
                self._message = f"stopping: {reason}"
        try:
            self._teardown()
        except Exception:  # e.g. out of file descriptors: tried again below, or by the monitor
            pass
        deadline = time.monotonic() + 5.0
        while not self._done.wait(0.1) and time.monotonic() < deadline:
            if self._monitor is None or not self._monitor.is_alive():  # no monitor to finalise the run: do it here
                self._end_without_monitor()
        return self._status

    def summary(self) -> dict:
        """Measured vs predicted: median steady-state step time (each rank's first step per attempt is left out when
        there are more), peak memory per rank (CUDA mem_peak, else the RSS above each rank's RSS before its model
        was built), the plan's predictions when a plan with a cost was given, and ``data``: the script's data-wait
        verdict (see :attr:`data`)."""
        with self._lock:
            rows = list(self._rows)
            baselines = {r: s.baseline for r, s in self._ranks.items() if s.baseline}
            data = dict(self.data) if self.data else None
        return {**summarize(rows, status=self._status, plan=self.plan, baselines=baselines), "data": data}

    def rss_figures(self) -> dict[int, dict[str, float]]:
        """CPU ranks: rank -> {"peak": its peak RSS above its baseline (the samples' VmHWM; the step reports' RSS
        where no peak is known), "floor": the least RSS above its baseline a step reported (at a step's end: what it
        holds between steps)}, for the ranks whose baseline is known; {} on GPUs."""
        if self.backend == "nccl":
            return {}
        with self._lock:
            base = {r: s.baseline for r, s in self._ranks.items() if s.baseline}
            rows = [r for r in self._rows if r.get("rss") and r["rank"] in base]
        peaks = {r: v for r, v in _peaks(self.samples).items() if r in base}
        out: dict[int, dict[str, float]] = {}
        for row in rows:
            r, held = row["rank"], max(0.0, float(row["rss"]) - base[row["rank"]])
            fig = out.setdefault(r, {"peak": peaks.get(r, 0.0), "floor": held})
            fig["floor"], fig["peak"] = min(fig["floor"], held), max(fig["peak"], held)
        return out

    def predicted_breakdowns(self) -> dict[int, Any]:
        """rank -> the plan's MemoryBreakdown for it (None where the plan has none): what its memory compares with."""
        return {r: compare.predicted_breakdown(self.plan, r) for r in range(self.nproc)}

    def measured(self) -> dict[str, Any]:
        """What this run measured beside its plan's predictions, on the basis they compare (see
        :mod:`autopar_nb.launch.compare`): ``{"basis", "by_rank": {rank: {"peak": fig, "between steps": fig}},
        "time": fig | {"compared", "note"}}`` where ``fig = {"measured", "predicted", "ratio"}`` (None where unknown).
        Per rank: its peak against the predicted training state, no margin (CPU: RSS above its baseline; GPU:
        CUDA's peak allocated), on GPUs also the caching allocator's peak reserve (``"reserved"``) against the whole
        prediction, whose margin is there to cover it, and what it held between steps (the least at a step's end)
        against the parameters and optimizer state the plan keeps there; the median step time (its first step left
        out) against the plan's where the plan's device is the run's. A launched run measures no other component."""
        from ..calibration import persistent_bytes

        c = self.comparison()
        cpu = c["memory_basis"] == "rss_above_baseline"
        peaks, floors = self._measured_memory()
        reserved = {} if cpu else self.summary().get("reserved_by_rank") or {}
        by_rank = {}
        for r in sorted(set(peaks) | set(floors)):
            mb = compare.predicted_breakdown(self.plan, r)
            by_rank[r] = {"peak": _figure(peaks.get(r), compare.predicted_memory(self.plan, r, model_state=True)),
                          "between steps": _figure(floors.get(r), persistent_bytes(mb) if mb is not None else None)}
            if reserved.get(r):
                by_rank[r]["reserved"] = _figure(reserved[r], compare.predicted_memory(self.plan, r,
                                                                                      model_state=False))
        cost = getattr(self.plan, "cost", None)
        predicted_t = float(cost.step_time_s) if cost is not None and cost.step_time_s else None
        compared = bool(c["compare_time"])
        time_fig = {**_figure(self.summary().get("step_time_s"), predicted_t if compared else None),
                    "predicted": predicted_t, "compared": compared,
                    "note": "" if compared else (f"not compared: the plan was made for "
                                                 f"{c['plan_device'] or 'another device'}, the run used "
                                                 f"{c['run_device']}")}
        basis = ("peak RSS above each rank's RSS before its model was built, against the predicted training state "
                 "(no allocator margin)" if cpu else "CUDA's peak allocated, against the predicted tensors (no "
                 "allocator margin); the allocator's peak reserve against the whole prediction, whose margin covers "
                 "its fragmentation")
        return {"basis": basis, "device": c["run_device"], "by_rank": by_rank, "time": time_fig,
                "throughput": self._measured_throughput(cost, time_fig)}

    def _measured_throughput(self, cost: Any, time_fig: dict) -> dict:
        """The median samples/s (or tokens/s) the steps reported against the plan's, and the MFU that follows
        from the measured step time (the plan's FLOPs per step over it), where times compare; else {}."""
        if cost is None or not time_fig["compared"] or not time_fig["measured"]:
            return {}
        import statistics

        tokens = self.throughput_unit == "tokens/s"
        key = "tokens_per_s" if tokens else "samples_per_s"
        with self._lock:
            values = [r[key] for r in self._rows if r.get(key)]
        predicted = cost.tokens_per_s if tokens else cost.samples_per_s
        scale = time_fig["predicted"] / time_fig["measured"]
        return {"unit": self.throughput_unit, **_figure(statistics.median(values) if values else None, predicted),
                "mfu": _figure(float(cost.mfu) * scale, float(cost.mfu))}

    def explain(self) -> str:
        """The measured figures beside the plan's, in words (see :meth:`measured`); ``plan.explain(run)`` puts
        them after the plan's own explanation."""
        m = self.measured()

        def fig(f, unit, what: str = "predicted") -> str:
            if not f["measured"]:
                return "not measured"
            pred = f" against {unit(f['predicted'])} {what} (x{f['ratio']:.2f})" if f["ratio"] else ""
            return f"{unit(f['measured'])}{pred}"

        lines = [f"Measured by run {self.run_id[:8]} ({self.status}, {m['device']}); memory: {m['basis']}."]
        for r, f in m["by_rank"].items():
            reserve = (f"; the allocator's peak reserve {fig(f['reserved'], fmt_bytes, 'predicted, margin included')}"
                       if "reserved" in f else "")
            lines.append(f"Rank {r}: peak {fig(f['peak'], fmt_bytes)}{reserve}; between steps "
                         f"{fig(f['between steps'], fmt_bytes)} (parameters and optimizer state).")
        t = m["time"]
        lines.append(f"Step time (median): {fig(t, fmt_time)}" + (f"; {t['note']}" if t["note"] else "") + ".")
        lines.append("Each other component is not measured by a launched run (bench/memory.py measures them with "
                     "torch's memory tracker).")
        return "\n".join(lines)

    def _measured_memory(self) -> tuple[dict[int, float], dict[int, float]]:
        """(rank -> peak bytes, rank -> bytes held between steps): on CPU above each rank's baseline
        (:meth:`rss_figures`); on GPUs CUDA's peak allocated and the least allocated at a step's end."""
        rss = self.rss_figures()
        if rss:
            return {r: v["peak"] for r, v in rss.items()}, {r: v["floor"] for r, v in rss.items()}
        peaks: dict[int, float] = {}
        floors: dict[int, float] = {}
        with self._lock:
            rows = list(self._rows)
        for row in rows:
            r = row["rank"]
            if row.get("mem_peak") is not None:
                peaks[r] = max(peaks.get(r, 0.0), float(row["mem_peak"]))
            if row.get("mem_allocated") is not None:
                floors[r] = min(floors.get(r, float("inf")), float(row["mem_allocated"]))
        return peaks, floors

    def comparison(self) -> dict:
        """What this run may be compared with in its plan (see :mod:`autopar_nb.launch.compare`): the devices, whether
        step times compare, the predicted memory per rank and on what basis, and notes saying so."""
        return compare.comparison(self.plan, backend=self.backend, nproc=self.nproc, gpu_name=self.gpu_name)

    def calibrate(self, cluster: Any = None, *, preset: str | None = None, save: bool = True) -> dict[str, float]:
        """Measured / predicted factors of this run (see :mod:`autopar_nb.calibration` for the keys), stored for
        the cluster preset (``cluster.name``, ``preset``, or the plan's) so the next plan uses them; returns them.
        Needs a finished run with step metrics and a plan with a cost."""
        from .. import calibration

        name = preset or getattr(cluster, "name", None) or compare.plan_device(self.plan)
        if self.backend != "nccl" and name and name != "cpu":
            raise ValueError(f"this run used CPU processes, so its step times say nothing about {name}: calibrate "
                             "the 'cpu' preset (preset='cpu', with a plan made for it), or run on those GPUs")
        factors = calibration.from_run(self, cluster=cluster, preset=preset, save=save)
        if save:
            s = self.summary()
            self.calibration = {"preset": name, "path": str(calibration.path()), "factors": factors,
                                "ratio": s["step_time_s"] / s["predicted_step_time_s"]}
            self._notify()
        return factors

    def dashboard(self):
        """The live dashboard widget of this run (created on first use; kernel side only)."""
        if self._dashboard is None:
            from .dashboard import Dashboard

            self._dashboard = Dashboard(self)
        return self._dashboard

    def _ipython_display_(self):
        from IPython.display import display

        display(self.dashboard())

    def __repr__(self) -> str:
        return f"Run({self.run_id[:8]}, {self.nproc} proc, {self._status}: {self._message})"

    def add_listener(self, fn: Callable[[Run], None]) -> None:
        """Call ``fn(run)`` from the monitor thread whenever new data arrived (at most about 4 times a second)."""
        self._listeners.append(fn)

    # ---- monitor side (called from the monitor thread, see monitor.py) --------------------------------------------
    def _ingest(self, msgs: list) -> bool:
        """Take the channel's messages (hello / step / done / error); True when there were any."""
        if not msgs:
            return False
        now = time.monotonic()
        with self._lock:
            # a connection that closes in this batch without its rank's "done" is a death seen now: known before
            # another rank's error in the same batch is judged (that error may be its consequence)
            finished = {m.rank for m in msgs if m.kind == "data" and m.data.get("event") == "done"}
            for m in msgs:
                if m.kind == "closed" and m.rank not in finished:
                    self._on_closed(self._ranks.setdefault(m.rank, RankState(m.rank)), m.time)
            for m in msgs:
                st = self._ranks.setdefault(m.rank, RankState(m.rank))
                if m.kind == "hello":
                    self._on_hello(st, m.data, now)
                elif m.kind == "closed":
                    self._on_closed(st, m.time)
                elif m.kind != "data":
                    continue
                elif m.data.get("event") in watch.RANK_EVENTS:  # the guard's, a failed save (before: they name a step)
                    self.events.append(watch.rank_event(m.data, rank=m.rank, t=m.time - self.started))
                elif isinstance(m.data.get("step"), int):
                    self._on_step(st, m.data, m.time, now)
                elif m.data.get("event") == "done":
                    st.done = True
                elif m.data.get("event") == "error":
                    self._on_error(st, m.data, m.time, now)
                elif m.data.get("event") == "start":
                    self._on_start(st, m.data)
                elif m.data.get("event") == "data":
                    self._on_data(m.data)
        return True

    def _on_hello(self, st: RankState, data: dict, now: float) -> None:
        # the attempt the rank says it is in (torch's TORCHELASTIC_RESTART_COUNT), else the agent's latest
        att = data.get("attempt")
        latest = self._latest_attempt()
        att = att if isinstance(att, int) and not isinstance(att, bool) else latest if latest >= 0 else st.attempt + 1
        # a restart restarts the whole group: every rank still in an older attempt starts over; the first rank of
        # the new attempt to speak makes the status "restarting" (until the attempt's first step)
        first_back = att > 0 and len(self._behind(att, now)) == len(self._ranks)
        st.attempt = att
        st.last_progress, st.done, st.connected = now, False, True
        if (first_back or self._status in ("starting", "restarting")) and st.attempt > 0:
            self._set_status("restarting", f"restart {st.attempt}: rank {st.rank} reconnected")

    def _on_start(self, st: RankState, data: dict) -> None:
        """The rank's RSS before it built its model: its memory is counted above it, the samples so far included.
        And whether it prints its stacks on SIGUSR1."""
        st.dumps_stacks = data.get("stacks") is True
        base = data.get("rss_before_model")
        if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
            return
        st.baseline = float(base)
        tl = self._timeline
        if st.rank < tl.nranks:
            rss, src = tl.cols["rss_bytes"][st.rank], tl.text["source"][st.rank]
            tl.set("rss_baseline_bytes", st.rank, [st.baseline] * len(tl))
            tl.set("memory_bytes", st.rank, [max(0.0, v - st.baseline) if k == "psutil" else m for v, k, m in
                                             zip(rss, src, tl.cols["memory_bytes"][st.rank], strict=True)])
            self.versions["timeline"] += 1

    def _on_data(self, data: dict) -> None:
        """The data-wait verdict (``runtime/train.py`` ``data_summary``: every rank sends the same, the slowest
        rank's share): kept when well-formed, the message cut to 500 characters."""
        share, bottleneck, text = data.get("data_wait_share"), data.get("bottleneck"), data.get("message")
        if isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 <= share <= 1.0 \
                and isinstance(bottleneck, bool) and isinstance(text, str):
            self.data = {"share": float(share), "bottleneck": bottleneck, "message": text[:500]}

    def _on_step(self, st: RankState, data: dict, sent: float, now: float) -> None:
        row = step_row(st.rank, max(st.attempt, 0), data, sent)
        if data["step"] % self._rows_stride == 0:
            self._rows.append(row)
            if len(self._rows) > MAX_ROWS:
                self._rows_stride *= 2
                self._rows[:] = [r for r in self._rows if r["step"] % self._rows_stride == 0]
        st.step, st.last, st.last_progress = data["step"], row, now
        st.peak_rss = max(st.peak_rss, float(row.get("rss") or 0.0))
        if "tokens_per_s" in row:
            self.throughput_unit = "tokens/s"
        self._steps.add(st.rank, row["step"], row["attempt"], {
            "loss": row.get("loss"), "step_time_s": row.get("step_time_s"), "data_wait_s": row.get("data_wait_s"),
            "throughput": row.get("tokens_per_s", row.get("samples_per_s"))})
        self.versions["steps"] += 1
        if self.first_step_time is None:
            self.first_step_time = now - self._t0
        if self._status in ("starting", "restarting"):
            self._set_status("running", "running")
        if self._status == "running":
            total = f"/{self.steps}" if self.steps else ""
            self._message = f"running: step {self._current_step()}{total}"

    def _current_step(self) -> int:
        """The highest step reported in the latest attempt any rank is in (a restart starts the count again)."""
        attempt = max(s.attempt for s in self._ranks.values())
        return max((s.step for s in self._ranks.values() if s.attempt == attempt and s.step is not None), default=0)

    def _on_error(self, st: RankState, data: dict, sent: float, now: float) -> None:
        st.error = logfiles.reported_error(data)
        st.failed_at = sent
        # a peer whose connection closed without a word before this error died first (a signal, a crash in C++)
        for other in self._ranks.values():
            if other.error is None and other.closed_at is not None and not other.done:
                other.error = {"error": "its process ended without reporting an error (killed by a signal, or a "
                                        "crash outside Python): see its exit code and log", "traceback": ""}
                other.failed_at = other.closed_at
        self._update_error()
        e = self._error
        if st.attempt >= self.max_restarts:  # no restart left: this is the run's failure
            self._error_time = now
            self._set_status("failed", f"rank {e['rank']} failed: {e['error']}")
        else:
            self._set_status("restarting", f"rank {e['rank']} failed ({e['error']}); restarting")

    def _on_closed(self, st: RankState, when: float) -> None:
        """A rank's connection closed: normal after its "done", a sign of death otherwise (unless the run is being
        stopped, or has ended)."""
        st.connected = False
        if not st.done and st.error is None and st.closed_at is None and self._stop_reason in (None, "failure") \
                and self._status not in ("stopped", "hung"):
            st.closed_at = when

    def _update_error(self) -> None:
        """``error`` from the ranks' failures: the first one (see failure.py), with the others as consequences."""
        order = failure_order(self._ranks)
        if not order:
            return
        cause = self._ranks[order[0]]
        t0 = cause.failed_at or self.started
        self._error = {"rank": cause.rank, "attempt": max(cause.attempt, 0), **cause.error,
                       "time_s": t0 - self.started,
                       "knock_on": [{"rank": r, "error": self._ranks[r].error["error"],
                                     "after_s": (self._ranks[r].failed_at or t0) - t0} for r in order[1:]]}

    def _set_status(self, status: str, message: str) -> None:
        if self._status in TERMINAL and status not in TERMINAL:
            return
        self._status, self._message = status, message

    def _refresh_workers(self) -> dict[int, psutil.Process]:
        w = {}
        if self._proc is not None and self._proc.poll() is None:
            try:
                w = procs.workers_of(psutil.Process(self._proc.pid))
            except psutil.Error:
                w = {}
        with self._lock:
            self._workers = w
        return w

    def _record_tick(self, tick: int, samples: dict[int, dict]) -> None:
        """Tick ``tick`` (every SAMPLE_INTERVAL_S from launch): the device samples of each rank with what its step
        stream said last, into the time series."""
        t = time.monotonic() - self._t0
        with self._lock:
            self._update_samples(samples)
            if tick <= self._tick:
                return
            self._tick = tick
            rows = {r: self._sample_of(self._ranks[r]) for r in range(self.nproc) if r in self._ranks}
            self._timeline.add(tick, t, rows)
            self.versions["timeline"] += 1
            self._watch_tick()

    def _update_samples(self, samples: dict[int, dict]) -> None:
        """The ranks' latest device samples (a rank not in ``samples`` keeps its last one)."""
        with self._lock:
            for rank, s in samples.items():
                self._ranks.setdefault(rank, RankState(rank)).sample = s

    def _watch_tick(self) -> None:
        """New events from the samples, the ranks' failures and the plan's predictions (under ``_lock``)."""
        if self._watch is None:
            c = self.comparison()
            self._watch = watch.Watch(watch.settings_for(c, memory_limit_bytes=c["memory_limit_bytes"],
                                                         enforce_limit=c["enforce_limit"],
                                                         memory_threshold=self.memory_threshold))
        errors = {r: st.error for r, st in self._ranks.items() if st.error}
        new = self._watch.update(self._timeline.samples(), errors=errors, steps=self._step_rows())
        self.events += new
        for e in new:
            if e.get("killed"):
                self._kill_rank(e["rank"])
        for hook in self._event_hooks:
            if new:
                hook(self, new)

    def _step_rows(self) -> list[dict]:
        """The step rows of the latest attempt, each with ``t`` (seconds since launch), for the watch (under
        ``_lock``)."""
        attempt = max((r["attempt"] for r in self._rows), default=0)
        return [{**r, "t": r["time"] - self.started} for r in self._rows if r["attempt"] == attempt]

    def _lifecycle(self, kind: str, reason: str, t: float | None = None) -> None:
        """An event of the run itself (launch, restart, its end) in ``events``, beside the watch's (the dashboard's
        timeline shows both); ``t``: seconds since launch (default: now)."""
        with self._lock:
            t = time.monotonic() - self._t0 if t is None else t
            self.events.append({"t": t, "kind": kind, "rank": None, "reason": reason})

    def _kill_rank(self, rank: int) -> None:
        """SIGKILL one worker (a rank above its memory limit, see watch.over_limit_events): torch's agent sees it
        die as the kernel's OOM killer would leave it."""
        proc = self._workers.get(rank)
        try:
            if proc is not None:
                proc.kill()
        except psutil.Error:  # already gone
            pass

    def _sample_of(self, st: RankState) -> dict:
        s, last = st.sample, st.last
        d = {"state": st.state(self._status), "rss_bytes": s.get("rss"), "rss_baseline_bytes": st.baseline,
             "rss_peak_bytes": s.get("rss_peak"),
             "cuda_allocated_bytes": last.get("mem_allocated"), "cuda_reserved_bytes": last.get("mem_reserved"),
             "cuda_peak_bytes": last.get("mem_peak"), "nvml_used_bytes": s.get("gpu_mem_used"),
             "nvml_process_bytes": s.get("gpu_proc_mem"),
             "nvml_total_bytes": s.get("gpu_mem_total"), "power_w": s.get("power_w"),
             "temperature_c": s.get("temperature_c"), "utilization_pct": s.get("gpu_util", s.get("cpu_percent")),
             **{k: last.get(k) for k in ("step", "loss", "step_time_s", "samples_per_s", "tokens_per_s",
                                         "data_wait_s")}}
        if s.get("gpu_proc_mem") is not None:
            d["source"], d["memory_bytes"] = "nvml", s["gpu_proc_mem"]
        elif last.get("mem_reserved") is not None:
            d["source"], d["memory_bytes"] = "cuda", last["mem_reserved"]
        elif s.get("gpu_mem_used") is not None:  # device-wide: every process on the GPU, until the rank reports
            d["source"], d["memory_bytes"] = "nvml-device", s["gpu_mem_used"]
        elif s.get("rss") is not None or last.get("rss") is not None:  # the fresher of psutil's and its step's
            stale = last.get("rss") is not None and (last.get("time") or 0.0) - (s.get("time") or 0.0) > STALE_SAMPLE_S
            d["source"] = "psutil" if s.get("rss") is not None and not stale else "stream"
            rss = d["rss_bytes"] = s["rss"] if d["source"] == "psutil" else last["rss"]
            d["memory_bytes"] = max(0.0, rss - st.baseline) if st.baseline else rss
        else:
            d["source"] = None
        return d

    def _check_attempt(self) -> None:
        """A new attempt directory means torch's agent restarted the worker group: every rank starts over (its
        start-up allowance for the hang check too), and the status says so."""
        latest = self._latest_attempt()
        if latest <= self._attempt_seen:
            return
        now = time.monotonic()
        with self._lock:
            first = self._attempt_seen < 0
            self._attempt_seen = latest
            if first:
                return
            self._lifecycle("restart", f"restart {latest} of {self.max_restarts}: the agent restarts every worker"
                            + (f" after rank {self._error['rank']} failed" if self._error else ""))
            if len(self._behind(latest, now)) == len(self._ranks):  # else a rank's hello said so first
                self._set_status("restarting",
                                 f"restart {latest} of {self.max_restarts}: the agent restarts every worker")

    def _behind(self, attempt: int, now: float) -> list[RankState]:
        """Ranks not yet in restart ``attempt`` start over (under ``_lock``): what they reported in the old attempt
        (steps, errors) is history, and the hang check gives them their start-up allowance again."""
        behind = [st for st in self._ranks.values() if st.attempt < attempt]
        for st in behind:
            st.last_progress, st.connected, st.done = now, False, False
            st.error = st.failed_at = st.closed_at = None
            st.step, st.last = None, {}
        return behind

    def _latest_attempt(self) -> int:
        """The agent's latest restart attempt, from its per-attempt log directories (-1 before any)."""
        return logfiles.latest_attempt(self.run_dir, self.run_id)

    def _read_log_tails(self) -> None:
        tails = {r: logfiles.tagged(self.logs(r, tail=LOG_TAIL_LINES).splitlines(), r) for r in range(self.nproc)}
        with self._lock:
            for r, t in tails.items():
                self._ranks[r].log_tail = t

    def _check_hang(self) -> None:
        """Tear the run down when a rank has made no step progress for ``hang_timeout_s`` (see hang.py); after a
        failure with no restart left, make sure torch's agent really ends the other ranks."""
        now = time.monotonic()
        off = self.hang_timeout_s is None or self._server is None
        if off or self._status in TERMINAL or self._stop_reason is not None:
            if self._error_time is not None and now - self._error_time > 3.0 and self._agent_alive():
                self._stop_reason = self._stop_reason or "failure"
                self._teardown()
            return
        with self._lock:
            if not any(s.connected for s in self._ranks.values()):
                if now - self._t0 > STARTUP_TIMEOUT_S and self._status == "starting":
                    self._message = silent_message()
                return
            found = stalled_rank(self._ranks, now=now, t0=self._t0, timeout=self.hang_timeout_s)
            if found is None:
                return
            self._status = "hung"
            self._message = hang_message(self._ranks, *found, self.hang_timeout_s)
            self._stop_reason = "hang"
            self.hang = {"rank": found[0], "seconds": found[1], "stacks": {}}
        self._notify()
        stacks = self._dump_stacks()
        with self._lock:
            first = waited_for(self._ranks, found[0], stacks)  # the stacks may tell who the others wait for
            seconds = time.monotonic() - max(self._ranks[first].last_progress, self._t0)
            self.hang = {"rank": first, "seconds": seconds, "stacks": stacks}
            self._message = hang_message(self._ranks, first, seconds, self.hang_timeout_s, stacks)
        self._notify()
        self._teardown()

    def _dump_stacks(self, wait_s: float = STACK_WAIT_S) -> dict[int, str]:
        """rank -> where its threads are: each rank whose script registered faulthandler for SIGUSR1 (the exported
        script does when launched) prints every thread's Python stack to its stderr; the new part of that log."""
        sizes = {}
        for r, proc in self.workers().items():
            st = self._ranks.get(r)
            d = logfiles.rank_dir(self.run_dir, self.run_id, r)
            if st is None or not st.dumps_stacks or d is None:
                continue
            try:
                sizes[r] = (d / "stderr.log").stat().st_size if (d / "stderr.log").exists() else 0
                proc.send_signal(signal.SIGUSR1)
            except (OSError, psutil.Error):
                continue
        if not sizes:
            return {}
        time.sleep(wait_s)  # faulthandler writes from a signal handler: it takes milliseconds
        out = {}
        for r, size in sizes.items():
            try:
                with open(logfiles.rank_dir(self.run_dir, self.run_id, r) / "stderr.log", "rb") as f:
                    f.seek(size)
                    out[r] = f.read(logfiles.TAIL_BYTES).decode(errors="replace")
            except OSError:
                continue
        return out

    def _agent_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _agent_exited(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def _teardown(self) -> None:
        """End the agent and every worker (idempotent, any thread)."""
        with self._teardown_lock:
            procs.terminate(self._proc, self._token)

    def _finalise(self) -> None:
        """The agent has exited: make sure nothing of the run is left, read its result, set the final status."""
        if procs.processes_with_token(self._token):  # even if the agent itself was killed
            self._teardown()
        try:
            result = json.loads((self.run_dir / "result.json").read_text())
        except (OSError, ValueError):
            rc = self._proc.returncode if self._proc is not None else None
            how = (f"was killed by {signal.Signals(-rc).name}" if isinstance(rc, int) and rc < 0 and
                   -rc in signal.Signals._value2member_map_ else f"exited with code {rc}")
            result = {"state": "killed" if self._stop_reason else "error",
                      "error": f"the elastic agent {how} before it wrote result.json; every worker was ended "
                               "(see agent.log in the run directory)"}
        with self._lock:
            self._result = result
            self.ended = time.time()
            self._set_final_status(result, f"{self.ended - self.started:.1f} s")
            self._lifecycle(END_KINDS.get(self._status, self._status), self._message)
            self._watch_tick()  # the agent's account of a killed rank (its signal) arrives only now
        self._server_close()
        self._read_log_tails()  # a run shorter than a tick has shown no log yet
        if self._tick >= 0:  # sampled: the end as a last sample, how each rank finished
            self._record_tick(self._tick + 1, {})
        self._notify()  # listeners see the final status before wait() returns
        self._ended()

    def _set_final_status(self, result: dict, elapsed: str) -> None:
        if self._status == "hung":  # the hang check said why already
            return
        if self._stop_reason not in (None, "failure"):
            self._status, self._message = "stopped", f"stopped ({self._stop_reason}) after {elapsed}"
        elif result.get("state") == "succeeded":
            self._status, self._message = "finished", f"finished {self.summary_line()} in {elapsed}"
            if self.data and self.data["bottleneck"]:
                self._message += f"; {self.data['message']}"
        else:
            self._errors_from_result(result)
            e = self._error
            self._status = "failed"
            if e is None:
                self._message = f"failed: {result}"
            elif e["rank"] is None:  # the agent itself failed (rendezvous, killed): no rank to name
                self._message = f"failed: {e['error']}"
            else:
                self._message = f"failed: rank {e['rank']}: {e['error']}"

    def summary_line(self) -> str:
        """One line: steps and median step time."""
        s = self.summary()
        t = f", {fmt_time(s['step_time_s'])}/step" if s["step_time_s"] else ""
        return f"{s['steps']} steps{t}"

    def _errors_from_result(self, result: dict) -> None:
        """The agent's account of the failed ranks (exit codes, signals, @record tracebacks) joins what the channel
        said: ranks that died without a word get their exit code and log; then ``error`` names the first."""
        failures = logfiles.failures_from_result(result, lambda rank: self.logs(rank, tail=ERROR_LOG_LINES))
        if not failures and self._error is None:
            self._error = logfiles.error_from_result(result, lambda rank: "")
            return
        for r, f in failures.items():
            st = self._ranks.setdefault(r, RankState(r))
            said = st.error is not None and bool(st.error["traceback"])  # its own error message, with a traceback
            if said:
                continue
            if st.failed_at is None:
                st.failed_at = st.closed_at or (float(f["timestamp"]) if f.get("timestamp") else None) or time.time()
            # the agent knows how it ended: its exit code and signal, and its Python stack or its log's end
            note = "" if f["python"] else " (no Python traceback: killed, or a crash outside Python)"
            st.error = {"error": f"{f['error']}{note}", "traceback": f["traceback"]}
        self._update_error()

    def _server_close(self) -> None:
        if self._server is not None:
            self._server.close()

    def _monitor_crashed(self, e: BaseException, *, tries: int = 3, pause_s: float = 1.0) -> None:
        """The monitor thread failed: the run has failed, and every process of it is ended here (tried ``tries``
        times); if even that fails (no file descriptors left), ``stop()`` tries again and marks the run done."""
        with self._lock:
            self._status, self._message = "failed", f"the monitor thread crashed ({type(e).__name__}: {e})"
        self._stop_reason = self._stop_reason or "monitor error"
        for i in range(tries):
            if self._end_without_monitor():
                return
            if i + 1 < tries:
                time.sleep(pause_s)
        with self._lock:
            self._message += "; its processes could not all be ended yet: call run.stop()"

    def _end_without_monitor(self) -> bool:
        """End the agent and every worker, and once none is left mark the run ended and done (any thread, when the
        monitor cannot; idempotent). True when nothing of the run is left."""
        try:
            self._teardown()
            left = self._agent_alive() or bool(procs.processes_with_token(self._token))
        except Exception:  # e.g. out of file descriptors: not ended yet
            return False
        if left:
            return False
        try:
            self._server_close()
        except Exception:  # a channel that cannot close: its sockets go with the kernel
            pass
        with self._lock:
            if self._status not in TERMINAL:
                self._status, self._message = "stopped", f"stopped ({self._stop_reason})"
            if self.ended is None:
                self.ended = time.time()
        self._ended()
        return True

    def _ended(self) -> None:
        """Every process of the run is gone: the end hooks, then ``done`` (so a launch right after ``wait()``
        finds the next standby the hooks started). Once only."""
        with self._teardown_lock:
            if self._ending:
                return
            self._ending = True
        for hook in self._end_hooks:
            try:
                hook(self)
            except Exception:  # a pool that cannot start its next standby: the next launch starts one
                pass
        self._done.set()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn(self)
            except Exception:  # a broken listener (a closed widget) must not stop the monitor
                pass


def _peaks(samples: list[dict]) -> dict[int, float]:
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
