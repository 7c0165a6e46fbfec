"""``Run``: a launched training run, as seen from the notebook.

Every field is filled by the run's monitor thread (see ``monitor.py``) under ``Run._lock``; the
public methods read it. The monitor's side of the class is in three parts it inherits, each
overridable by ``AttachedRun``: the metrics stream into rank state (``ingest.py``), the time series
and its watch (``samples.py``) and the processes, from their restarts to the final status
(``supervise.py``); the measured-vs-predicted figures are computed in ``report.py``. Status values::

    starting -> running [-> restarting -> running ...] -> finished | failed | stopped | hung
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ..units import fmt_time
from . import compare, logfiles, procs, report
from .hang import STARTUP_TIMEOUT_S
from .ingest import TERMINAL, StreamIngest
from .metrics import MetricsTable, RankState, summarize
from .samples import SAMPLE_FIELDS, RunSamples
from .supervise import LOG_TAIL_LINES, Supervision

__all__ = ["LOG_TAIL_LINES", "SAMPLE_FIELDS", "STARTUP_TIMEOUT_S", "TERMINAL", "MetricsTable",
           "RankState", "Run"]

CPU_LIMIT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
"""the workers' environment under a CPU memory limit (the plan's ``memory_limit_bytes``): glibc's
fixed mmap threshold (1 MiB), so a freed tensor of 1 MiB or more goes back to the system at once and
a rank's peak RSS is its runtime's floor plus the tensors the plan counts. glibc's default threshold
rises to the largest block freed so far, so later tensors come from a heap that keeps its free
blocks: a 2-rank MLP grew from 200 MiB at step 0 to 334-348 MiB above its baseline by step 30
(205-211 MiB with this), which no plan predicts. It costs page faults on every step (that MLP: +17 %
step time); a variable the user sets wins"""


def cpu_limit_env(plan: Any, backend: str) -> dict[str, str]:
    """:data:`CPU_LIMIT_ENV` for a CPU run of a plan made with a per-rank memory limit, else {}."""
    limited = (getattr(plan, "cluster", None) or {}).get("memory_limit_bytes")
    return dict(CPU_LIMIT_ENV) if limited and backend != "nccl" else {}


class Run(StreamIngest, RunSamples, Supervision):
    """A training run on local worker processes, started by :func:`autopar_nb.launch.launch`.

    Non-blocking: the workers run in the background while the notebook stays free. Use ``wait()`` to
    block, ``stop()`` to end it, ``status`` / ``error`` / ``metrics`` / ``logs(rank)`` to inspect
    it, and ``calibrate()`` to feed the measured step time and memory back into the cost model.
    Displaying a Run shows its live dashboard.
    """

    def __init__(self, *, run_id: str, run_dir: Path, script: Path, nproc: int, steps: int | None,
                 token: str, backend: str, max_restarts: int, hang_timeout_s: float | None,
                 plan: Any = None, command: list[str] | None = None):
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
        """whether it ran through the warm pool (``launch(warm=True)``, see ``pool.py``)"""
        self.worker_env: dict[str, str] | None = None
        """the workers' environment (the GPUs they see); None: the kernel's"""
        self._token = token
        self._init_monitoring()
        self._init_stream(nproc)
        self._init_samples(nproc)
        self._init_status(nproc)
        self._init_findings()

    def _init_monitoring(self) -> None:
        """The monitor thread's hooks and handles, and the locks it shares with the kernel."""
        self._end_hooks: list[Callable[[Run], None]] = []
        """called once from the monitor thread when the run has ended (the pool starts its next
        standby)"""
        self._event_hooks: list[Callable[[Run, list[dict]], None]] = []
        """called from the monitor thread with the events each tick found (``replan.Replanner``);
        must not block"""
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._listeners: list[Callable[[Run], None]] = []
        self._proc = None  # the agent's subprocess.Popen
        self._server = None  # channel.MetricsServer
        self._monitor = None
        self._stop_reason: str | None = None
        self._teardown_lock = threading.Lock()
        self._ending = False  # _ended() has begun

    def _init_status(self, nproc: int) -> None:
        """The run's status before its first report, and the clocks and figures its reports set."""
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
        self.versions = {"timeline": 0, "steps": 0}
        """incremented whenever the time series or the step series change (for incremental
        readers)"""
        self.throughput_unit = "samples/s"
        self.gpu_name = ""
        """NVML's name of the first GPU (GPU runs only)"""

    def _init_findings(self) -> None:
        """What the run finds out as it goes (calibration, a hang, data waits, events) and the
        re-planning that may follow; none yet."""
        self.calibration: dict | None = None
        """what ``calibrate()`` stored: {"preset", "path", "factors", "ratio"}"""
        self.hang: dict | None = None
        """when the run hung: {"rank" that stopped reporting first, "seconds" without progress,
        "stacks": {rank: every thread's Python stack, printed by the rank when the hang was found
        (exported scripts)}}"""
        self.data: dict | None = None
        """the script's data-wait verdict when training ended: {"share": the slowest rank's share of
        step time spent waiting for batches, "bottleneck": share above 10 %, "message": the line the
        script printed, with remedies when data loading is the bottleneck} (None before it arrives,
        or from a script that sends none)"""
        self.events: list[dict] = []
        """{"t": seconds since launch, "kind", "rank", "reason", ...} in the order found: the run's
        own (launch, restart, finish | fail | stop | hang), what the watch found (oom, memory_high,
        straggler, prediction_error: see watch.py), the ranks' own (numerics, checkpoint) and
        re-planning's (replan, resume: see replan.py)"""
        self.memory_threshold = 0.92
        """share of a rank's memory limit above which its memory is a ``memory_high`` event"""
        self.replanning = None
        """the ``replan.Replanner`` of a launch with ``replan="ask"|"auto"`` (None: "off", or a
        plain launch)"""
        self.replan_proposal: dict | None = None
        """set when an event calls for re-planning: {"trigger": the event, "cause", "text",
        "given_up"}"""
        self.continued_by: Run | None = None
        """the run that resumed this one under a new plan (``replan()``)"""
        self.continues: Run | None = None
        """the run this one resumed from"""

    # ---- public API ------------------------------------------------------------------------------
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
        """On failure: {"rank", "error", "traceback", "attempt"} of the first rank that failed, else
        None."""
        return self._error

    @property
    def done(self) -> bool:
        """True once the run has ended (any terminal status) and every worker is gone."""
        return self._done.is_set()

    @property
    def metrics(self) -> MetricsTable:
        """Every step message received, one row per (rank, step, attempt), in (attempt, step, rank)
        order."""
        with self._lock:
            rows = [dict(r) for r in self._rows]
        return MetricsTable(sorted(rows, key=lambda r: (r.get("attempt", 0), r.get("step", 0),
                                                        r.get("rank", 0))))

    @property
    def samples(self) -> list[dict]:
        """The run's time series: one plain dict per rank and tick, a tick every
        ``monitor.SAMPLE_INTERVAL_S`` seconds from launch (start-up included), in time order::

            {"t": seconds since launch, "rank": 0, "state": "running", "source": "psutil",
             "memory_bytes": ..., "utilization_pct": ..., "step": ..., "loss": ..., ...}

        ``source`` says where ``memory_bytes`` came from: "nvml" | "cuda" | "nvml-device" | "psutil"
        | "stream" (None before the rank's process exists or reported); the other keys are
        :data:`SAMPLE_FIELDS` (None where unknown). Memory stays bounded over long runs: beyond 1000
        ticks every other one is dropped (the interval between samples doubles), the latest kept."""
        with self._lock:
            return self._timeline.samples()

    def loss_curve(self, rank: int = 0) -> list[tuple[int, float]]:
        """(step, loss) of one rank, in step order; a step redone after a restart counts once (its
        latest value)."""
        with self._lock:
            by_step = {r["step"]: r["loss"] for r in self._rows if r["rank"] == rank
                       and r.get("loss") is not None}
        return sorted(by_step.items())

    def last_steps(self) -> dict[int, int | None]:
        """rank -> last step it reported."""
        with self._lock:
            return {r: s.step for r, s in self._ranks.items()}

    def ranks(self) -> dict[int, RankState]:
        """rank -> a copy of what is known about it (step, attempt, device sample, last log
        lines)."""
        with self._lock:
            return {r: s.copy() for r, s in self._ranks.items()}

    def workers(self) -> dict[int, psutil.Process]:
        """rank -> live worker process (psutil), as last seen by the monitor (refreshed about once a
        second); looked up now while some rank is missing (a warm run's ranks report their first
        step before the first refresh)."""
        with self._lock:
            w = dict(self._workers)
        if len(w) < self.nproc and not self._done.is_set():
            w = self._refresh_workers()
        return w

    def processes(self) -> list[psutil.Process]:
        """Every process of this run still alive (the agent and its workers, found by the run's
        token in their environment); empty once the run has ended."""
        return procs.processes_with_token(self._token)

    def logs(self, rank: int = 0, *, attempt: int | None = None, tail: int | None = None) -> str:
        """The output of one rank (stdout, then stderr) in one attempt (default: the latest),
        optionally only the last ``tail`` lines."""
        return logfiles.rank_output(logfiles.rank_dir(self.run_dir, self.run_id, rank, attempt),
                                    tail)

    def rows_since(self, index: int) -> list[dict]:
        """The metrics rows from ``index`` on (rows are only ever appended): for incremental
        consumers."""
        with self._lock:
            return [dict(r) for r in self._rows[index:]]

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends (or ``timeout`` seconds pass) and return the status; after a
        re-plan, until the run that continues it ends, and its status. Interrupting it
        (KeyboardInterrupt, the notebook's stop button) stops the run, then re-raises."""
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    break
            # a re-plan continues it: follow
            if self._done.is_set() and self.replanning is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self.replanning.wait_for(self, left) and self.continued_by is not None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    return self.continued_by.wait(left)
        except KeyboardInterrupt:
            self.stop("interrupted (KeyboardInterrupt in wait())")
            raise
        return self._status

    def replan(self):
        """Stop this run (if it still runs), calibrate with the memory it measured, re-plan with the
        user's pins kept and resume from the last complete checkpoint under the new plan; returns
        the run that continues (see :mod:`autopar_nb.launch.replan`), or None when no plan uses less
        memory (``events`` says why)."""
        if self.replanning is None:
            raise ValueError("this run cannot re-plan: launch it from a session (ap.launch(..., "
                             "replan='ask' or 'auto')), which knows the model and its pins")
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
            # no monitor to finalise the run: do it here
            if self._monitor is None or not self._monitor.is_alive():
                self._end_without_monitor()
        return self._status

    def summary(self) -> dict:
        """Measured vs predicted: median steady-state step time (each rank's first step per attempt
        is left out when there are more), peak memory per rank (CUDA mem_peak, else the RSS above
        each rank's RSS before its model was built), the plan's predictions when a plan with a cost
        was given, and ``data``: the script's data-wait verdict (see :attr:`data`)."""
        with self._lock:
            rows = list(self._rows)
            baselines = {r: s.baseline for r, s in self._ranks.items() if s.baseline}
            data = dict(self.data) if self.data else None
        return {**summarize(rows, status=self._status, plan=self.plan, baselines=baselines),
                "data": data}

    def summary_line(self) -> str:
        """One line: steps and median step time."""
        s = self.summary()
        t = f", {fmt_time(s['step_time_s'])}/step" if s["step_time_s"] else ""
        return f"{s['steps']} steps{t}"

    def rss_figures(self) -> dict[int, dict[str, float]]:
        """CPU ranks: rank -> {"peak": its peak RSS above its baseline (VmHWM, as the samples and
        each step's report read it), "floor": the least RSS above its baseline a step reported (at a
        step's end: what it holds between steps)}, for the ranks whose baseline is known; {} on
        GPUs."""
        return report.rss_figures(self)

    def predicted_breakdowns(self) -> dict[int, Any]:
        """rank -> the plan's MemoryBreakdown for it (None where the plan has none): what its memory
        compares with."""
        return {r: compare.predicted_breakdown(self.plan, r) for r in range(self.nproc)}

    def measured(self) -> dict[str, Any]:
        """What this run measured beside its plan's predictions, on the basis they compare (see
        :mod:`autopar_nb.launch.compare`): ``{"basis", "by_rank": {rank: {"peak": fig, "between
        steps": fig}}, "time": fig | {"compared", "note"}}`` where ``fig = {"measured", "predicted",
        "ratio"}`` (None where unknown). Per rank: its peak against the predicted training state, no
        margin (CPU: RSS above its baseline; GPU: CUDA's peak allocated), on GPUs also the caching
        allocator's peak reserve (``"reserved"``) against the whole prediction, whose margin is
        there to cover it, and what it held between steps (the least at a step's end) against the
        parameters and optimizer state the plan keeps there; the median step time (its first step
        left out) against the plan's where the plan's device is the run's. A launched run measures
        no other component."""
        return report.measured(self)

    def explain(self) -> str:
        """The measured figures beside the plan's, in words (see :meth:`measured`);
        ``plan.explain(run)`` puts them after the plan's own explanation."""
        return report.explain(self)

    def comparison(self) -> dict:
        """What this run may be compared with in its plan (see :mod:`autopar_nb.launch.compare`):
        the devices, whether step times compare, the predicted memory per rank and on what basis,
        and notes saying so."""
        return compare.comparison(self.plan, backend=self.backend, nproc=self.nproc,
                                  gpu_name=self.gpu_name)

    def calibrate(self, cluster: Any = None, *, preset: str | None = None,
                  save: bool = True) -> dict[str, float]:
        """Measured / predicted factors of this run (see :mod:`autopar_nb.calibration` for the
        keys), stored for the cluster preset (``cluster.name``, ``preset``, or the plan's) so the
        next plan uses them; returns them. Needs a finished run with step metrics and a plan with a
        cost."""
        from .. import calibration

        name = preset or getattr(cluster, "name", None) or compare.plan_device(self.plan)
        if self.backend != "nccl" and name and name != "cpu":
            raise ValueError("this run used CPU processes, so its step times say nothing about "
                             f"{name}: calibrate the 'cpu' preset (preset='cpu', with a plan made "
                             "for it), or run on those GPUs")
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
        """Call ``fn(run)`` from the monitor thread whenever new data arrived (at most about 4 times
        a second)."""
        self._listeners.append(fn)
