"""``Run``: a launched training run, as seen from the notebook.

Every field is filled by the run's monitor thread (see ``monitor.py``) under ``Run._lock``; the public methods read
it. Status values::

    starting -> running [-> restarting -> running ...] -> finished | failed | stopped | hung
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from . import logfiles, procs
from .hang import STARTUP_TIMEOUT_S, hang_message, silent_message, stalled_rank
from .metrics import MetricsTable, RankState, step_row, summarize

__all__ = ["LOG_TAIL_LINES", "STARTUP_TIMEOUT_S", "TERMINAL", "MetricsTable", "RankState", "Run"]

TERMINAL = ("finished", "failed", "stopped", "hung")
LOG_TAIL_LINES = 8


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
        self._token = token
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._listeners: list[Callable[[Run], None]] = []
        self._proc = None  # the agent's subprocess.Popen
        self._server = None  # channel.MetricsServer
        self._monitor = None
        self._stop_reason: str | None = None
        self._teardown_lock = threading.Lock()
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
        """rank -> live worker process (psutil), as last seen by the monitor (refreshed about once a second)."""
        with self._lock:
            return dict(self._workers)

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
        """Block until the run ends (or ``timeout`` seconds pass) and return the status. Interrupting it
        (KeyboardInterrupt, the notebook's stop button) stops the run, then re-raises."""
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._done.wait(0.1):
                if deadline is not None and time.monotonic() >= deadline:
                    break
        except KeyboardInterrupt:
            self.stop("interrupted (KeyboardInterrupt in wait())")
            raise
        return self._status

    def stop(self, reason: str = "stopped by the user") -> str:
        """End every worker (within about 4 s) and return the final status."""
        with self._lock:
            if self._stop_reason is None and not self._done.is_set():
                self._stop_reason = reason
                self._message = f"stopping: {reason}"
        self._teardown()
        self._done.wait(5.0)
        return self._status

    def summary(self) -> dict:
        """Measured vs predicted: median steady-state step time (each rank's first step per attempt is left out when
        there are more), peak memory per rank (CUDA mem_peak, else RSS), and the plan's predictions when a plan with a
        cost was given."""
        with self._lock:
            rows = list(self._rows)
        return summarize(rows, status=self._status, plan=self.plan)

    def calibrate(self, cluster: Any = None, *, preset: str | None = None, save: bool = True) -> dict[str, float]:
        """Measured / predicted factors of this run (see :mod:`autopar_nb.calibration` for the keys), stored for
        the cluster preset (``cluster.name``, ``preset``, or the plan's) so the next plan uses them; returns them.
        Needs a finished run with step metrics and a plan with a cost."""
        from .. import calibration

        return calibration.from_run(self, cluster=cluster, preset=preset, save=save)

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
            for m in msgs:
                st = self._ranks.setdefault(m.rank, RankState(m.rank))
                if m.kind == "hello":
                    self._on_hello(st, m.data, now)
                elif m.kind != "data":
                    continue
                elif isinstance(m.data.get("step"), int):
                    self._on_step(st, m.data, m.time, now)
                elif m.data.get("event") == "done":
                    st.done = True
                elif m.data.get("event") == "error":
                    self._on_error(st, m.data, now)
        return True

    def _on_hello(self, st: RankState, data: dict, now: float) -> None:
        # the attempt the rank says it is in (torch's TORCHELASTIC_RESTART_COUNT), else the agent's latest
        att = data.get("attempt")
        latest = self._latest_attempt()
        st.attempt = att if isinstance(att, int) else latest if latest >= 0 else st.attempt + 1
        st.last_progress, st.done, st.connected = now, False, True
        if self._status in ("starting", "restarting") and st.attempt > 0:
            self._set_status("restarting", f"restart {st.attempt}: rank {st.rank} reconnected")

    def _on_step(self, st: RankState, data: dict, sent: float, now: float) -> None:
        row = step_row(st.rank, max(st.attempt, 0), data, sent)
        self._rows.append(row)
        st.step, st.last, st.last_progress = data["step"], row, now
        if self.first_step_time is None:
            self.first_step_time = now - self._t0
        if self._status in ("starting", "restarting"):
            self._set_status("running", "running")
        if self._status == "running":
            total = f"/{self.steps}" if self.steps else ""
            self._message = f"running: step {max(s.step or 0 for s in self._ranks.values())}{total}"

    def _on_error(self, st: RankState, data: dict, now: float) -> None:
        err = {"rank": st.rank, "attempt": max(st.attempt, 0), "error": str(data.get("error", "")),
               "traceback": str(data.get("traceback", ""))}
        if self._error is None or self._error.get("attempt", 0) < err["attempt"]:
            self._error = err
        if st.attempt >= self.max_restarts:  # no restart left: this is the run's failure
            self._error_time = now
            self._set_status("failed", f"rank {st.rank} failed: {err['error']}")
        else:
            self._set_status("restarting", f"rank {st.rank} failed ({err['error']}); restarting")

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

    def _set_samples(self, samples: dict[int, dict]) -> None:
        with self._lock:
            for rank, s in samples.items():
                self._ranks.setdefault(rank, RankState(rank)).sample = s

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
            for st in self._ranks.values():
                st.last_progress, st.connected, st.done = now, False, False
            self._set_status("restarting", f"restart {latest} of {self.max_restarts}: the agent restarts every worker")

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
        self._notify()
        self._teardown()

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
            result = {"state": "killed" if self._stop_reason else "error",
                      "error": f"the agent exited with code {self._proc.returncode if self._proc else '?'}"}
        with self._lock:
            self._result = result
            self.ended = time.time()
            self._set_final_status(result, f"{self.ended - self.started:.1f} s")
        self._server_close()
        self._done.set()

    def _set_final_status(self, result: dict, elapsed: str) -> None:
        if self._status == "hung":  # the hang check said why already
            return
        if self._stop_reason not in (None, "failure"):
            self._status, self._message = "stopped", f"stopped ({self._stop_reason}) after {elapsed}"
        elif result.get("state") == "succeeded":
            self._status, self._message = "finished", f"finished {self.summary_line()} in {elapsed}"
        else:
            if self._error is None:
                self._error = self._error_from_result(result)
            e = self._error
            self._status = "failed"
            self._message = f"failed: rank {e['rank']}: {e['error']}" if e else f"failed: {result}"

    def summary_line(self) -> str:
        """One line: steps and median step time."""
        s = self.summary()
        t = f", {s['step_time_s'] * 1e3:.1f} ms/step" if s["step_time_s"] else ""
        return f"{s['steps']} steps{t}"

    def _error_from_result(self, result: dict) -> dict | None:
        return logfiles.error_from_result(result, lambda rank: self.logs(rank, tail=30))

    def _server_close(self) -> None:
        if self._server is not None:
            self._server.close()

    def _monitor_crashed(self, e: Exception) -> None:
        with self._lock:
            self._status, self._message = "failed", f"the monitor thread crashed ({type(e).__name__}: {e})"
        self._stop_reason = self._stop_reason or "monitor error"
        self._teardown()
        self._server_close()
        self._done.set()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn(self)
            except Exception:  # a broken listener (a closed widget) must not stop the monitor
                pass
