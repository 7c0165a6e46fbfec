"""``Run``: a launched training run, as seen from the notebook.

Every field is filled by the run's monitor thread (see ``monitor.py``) under ``Run._lock``; the public methods read
it. Status values::

    starting -> running [-> restarting -> running ...] -> finished | failed | stopped | hung
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from . import procs

TERMINAL = ("finished", "failed", "stopped", "hung")
LOG_TAIL_LINES = 8
TAIL_BYTES = 64 * 1024
"""bytes read from the end of each log file for a tail"""
STARTUP_TIMEOUT_S = 120.0
"""seconds a rank may take to connect to the metrics channel before the hang check counts it as stalled"""


@dataclass
class RankState:
    """What the notebook knows about one rank."""

    rank: int
    attempt: int = -1
    """restart attempt of the rank's current connection (0 = first start); -1 before it connected"""
    step: int | None = None
    """last step reported"""
    last_progress: float = 0.0
    """time.monotonic() of the last hello or step, or of the restart that began its current attempt"""
    connected: bool = False
    """its current attempt has said hello"""
    done: bool = False
    sample: dict = field(default_factory=dict)
    """latest device sample (cpu_percent, rss; gpu_util, gpu_mem_used, ... with NVML)"""
    last: dict = field(default_factory=dict)
    """latest step message"""
    log_tail: list[str] = field(default_factory=list)


class MetricsTable(list):
    """The per-step metrics of a run: a list of dicts (one per rank and step), with a table repr.

    Columns: rank, attempt, step, loss, step_time_s, samples_per_s or tokens_per_s, rss / mem_* bytes, time.
    ``to_pandas()`` gives a DataFrame when pandas is installed.
    """

    def columns(self) -> list[str]:
        """Column names, in first-seen order."""
        cols: dict[str, None] = {}
        for row in self:
            cols.update(dict.fromkeys(row))
        return list(cols)

    def column(self, name: str, rank: int | None = None) -> list:
        """The values of one column (of one rank when ``rank`` is given)."""
        return [r.get(name) for r in self if rank is None or r["rank"] == rank]

    def to_pandas(self):
        """A pandas DataFrame of the table (pandas is not a dependency of autopar-nb)."""
        import pandas as pd

        return pd.DataFrame(list(self), columns=self.columns())

    def __repr__(self) -> str:
        cols = [c for c in self.columns() if c != "time"]
        if not self:
            return "MetricsTable(empty)"
        rows = [[_fmt(r.get(c)) for c in cols] for r in self[-20:]]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        more = f"... {len(self) - 20} earlier rows\n" if len(self) > 20 else ""
        return more + "\n".join(lines)


def _read_end(path: Path, limit: int | None) -> str:
    """The text of ``path`` (its last ``limit`` bytes, from a line start, when given); "" if it cannot be read."""
    try:
        with open(path, "rb") as f:
            if limit is not None:
                size = f.seek(0, 2)
                f.seek(max(0, size - limit))
                data = f.read()
                if size > limit:
                    data = data.split(b"\n", 1)[-1]
            else:
                data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    return text if not text or text.endswith("\n") else text + "\n"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


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
            return {r: RankState(**{**s.__dict__, "sample": dict(s.sample), "last": dict(s.last),
                                    "log_tail": list(s.log_tail)}) for r, s in self._ranks.items()}

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
        d = self._attempt_dir(rank, attempt)
        if d is None:
            return ""
        # with a tail, read only the end of each file: the monitor asks every second, and logs grow with the run
        limit = None if tail is None else TAIL_BYTES
        text = "".join(_read_end(d / name, limit) for name in ("stdout.log", "stderr.log"))
        if tail is not None:
            text = "\n".join(text.splitlines()[-tail:])
        return text

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
        out: dict[str, Any] = {"status": self._status, "steps": len({r["step"] for r in rows})}
        # the first step of each rank and attempt carries warm-up (allocations, first collectives): leave it out
        first: dict[tuple, int] = {}
        for r in rows:
            key = (r["rank"], r["attempt"])
            first[key] = min(first.get(key, r["step"]), r["step"])
        timed = [r for r in rows if r.get("step_time_s") is not None]
        times = [r["step_time_s"] for r in timed if r["step"] != first[(r["rank"], r["attempt"])]]
        times = times or [r["step_time_s"] for r in timed]
        out["step_time_s"] = statistics.median(times) if times else None
        mem: dict[int, float] = {}
        for r in rows:
            m = r.get("mem_peak") or r.get("mem_reserved") or r.get("rss")
            if m is not None:
                mem[r["rank"]] = max(mem.get(r["rank"], 0.0), float(m))
        out["memory_by_rank"] = mem
        out["memory_kind"] = "cuda_peak" if any(r.get("mem_peak") for r in rows) else "rss"
        cost = getattr(self.plan, "cost", None)
        if cost is not None:
            out["predicted_step_time_s"] = cost.step_time_s or None
            out["predicted_memory_by_rank"] = {i: m.total for i, m in enumerate(cost.memory_by_rank)}
            out["predicted_peak_memory_bytes"] = cost.peak_memory_bytes or None
        return out

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

    # ---- monitor side (called from the monitor thread) -----------------------------------------------------------
    def _ingest(self, msgs: list) -> bool:
        if not msgs:
            return False
        now = time.monotonic()
        with self._lock:
            for m in msgs:
                st = self._ranks.setdefault(m.rank, RankState(m.rank))
                if m.kind == "hello":
                    att = m.data.get("attempt")
                    latest = self._latest_attempt()
                    st.attempt = att if isinstance(att, int) else latest if latest >= 0 else st.attempt + 1
                    st.last_progress, st.done, st.connected = now, False, True
                    if self._status in ("starting", "restarting") and st.attempt > 0:
                        self._set_status("restarting", f"restart {st.attempt}: rank {m.rank} reconnected")
                elif m.kind == "data":
                    self._ingest_data(st, m, now)
        return True

    def _ingest_data(self, st: RankState, m, now: float) -> None:
        d = m.data
        if "step" in d and isinstance(d["step"], int):
            row = {"rank": m.rank, "attempt": max(st.attempt, 0), "step": d["step"]}
            for k, v in d.items():
                if k not in row and isinstance(v, (int, float)) and not isinstance(v, bool):
                    row[k] = v
            row["time"] = m.time
            self._rows.append(row)
            st.step, st.last, st.last_progress = d["step"], row, now
            if self.first_step_time is None:
                self.first_step_time = now - self._t0
            if self._status in ("starting", "restarting"):
                self._set_status("running", "running")
            total = f"/{self.steps}" if self.steps else ""
            if self._status == "running":
                self._message = f"running: step {max(s.step or 0 for s in self._ranks.values())}{total}"
        elif d.get("event") == "done":
            st.done = True
        elif d.get("event") == "error":
            err = {"rank": m.rank, "attempt": max(st.attempt, 0), "error": str(d.get("error", "")),
                   "traceback": str(d.get("traceback", ""))}
            if self._error is None or self._error.get("attempt", 0) < err["attempt"]:
                self._error = err
            if st.attempt >= self.max_restarts:  # no restart left: this is the run's failure
                self._error_time = now
                self._set_status("failed", f"rank {m.rank} failed: {err['error']}")
            else:
                self._set_status("restarting", f"rank {m.rank} failed ({err['error']}); restarting")

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

    def _attempt_dir(self, rank: int, attempt: int | None) -> Path | None:
        # torch's DefaultLogsSpecs: <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log
        attempts = sorted((self.run_dir / "logs").glob(f"{self.run_id}_*/attempt_*"),
                          key=lambda p: int(p.name.split("_")[1]))
        if attempt is not None:
            attempts = [p for p in attempts if p.name == f"attempt_{attempt}"]
        if not attempts:
            return None
        # local rank == global rank on one node
        return attempts[-1] / str(rank)

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
        found = [int(p.name.split("_")[1]) for p in (self.run_dir / "logs").glob(f"{self.run_id}_*/attempt_*")]
        return max(found, default=-1)

    def _read_log_tails(self) -> None:
        tails = {}
        for r in range(self.nproc):  # torch already prefixes stderr lines with "[rankN]:"
            lines = self.logs(r, tail=LOG_TAIL_LINES).splitlines()
            tails[r] = [line if line.startswith(f"[rank{r}]") else f"[rank{r}] {line}" for line in lines]
        with self._lock:
            for r, t in tails.items():
                self._ranks[r].log_tail = t

    def _check_hang(self) -> None:
        now = time.monotonic()
        off = self.hang_timeout_s is None or self._server is None
        if off or self._status in TERMINAL or self._stop_reason is not None:
            if self._error_time is not None and now - self._error_time > 3.0 and self._agent_alive():
                # a failed rank with no restart left: torch's agent ends the others; make sure it does
                self._stop_reason = self._stop_reason or "failure"
                self._teardown()
            return
        with self._lock:
            # a rank that has not connected yet is still starting (importing torch, building the model): it gets
            # STARTUP_TIMEOUT_S at least; and while no rank at all has connected, the script may simply not speak
            # the metrics protocol: that is no hang (the status line says so instead)
            if not any(s.connected for s in self._ranks.values()):
                if now - self._t0 > STARTUP_TIMEOUT_S and self._status == "starting":
                    self._message = (f"no rank has reported metrics after {STARTUP_TIMEOUT_S:.0f} s: does the script "
                                     "implement the metrics protocol (AUTOPAR_METRICS)? See run.logs(0)")
                return
            limit = {r: self.hang_timeout_s if s.connected else max(self.hang_timeout_s, STARTUP_TIMEOUT_S)
                     for r, s in self._ranks.items()}
            stalled = {r: now - max(s.last_progress, self._t0) for r, s in self._ranks.items() if not s.done}
            if not any(t >= limit[r] for r, t in stalled.items()):
                return
            steps = ", ".join(f"rank {r}: {'-' if s.step is None else s.step}" for r, s in self._ranks.items())
            worst = max(stalled, key=stalled.get)
            self._status = "hung"
            self._message = (f"hung: no step progress on rank {worst} for {stalled[worst]:.1f} s "
                             f"(hang_timeout_s={self.hang_timeout_s}); last step per rank: {steps}; tearing down")
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
        # make sure nothing of the run is left, even if the agent itself was killed
        if procs.processes_with_token(self._token):
            self._teardown()
        try:
            result = json.loads((self.run_dir / "result.json").read_text())
        except (OSError, ValueError):
            result = {"state": "killed" if self._stop_reason else "error",
                      "error": f"the agent exited with code {self._proc.returncode if self._proc else '?'}"}
        with self._lock:
            self._result = result
            self.ended = time.time()
            elapsed = f"{self.ended - self.started:.1f} s"
            if self._status == "hung":
                pass
            elif self._stop_reason not in (None, "failure"):
                self._status, self._message = "stopped", f"stopped ({self._stop_reason}) after {elapsed}"
            elif result.get("state") == "succeeded":
                self._status, self._message = "finished", f"finished {self.summary_line()} in {elapsed}"
            else:
                if self._error is None:
                    self._error = self._error_from_result(result)
                e = self._error
                self._status = "failed"
                self._message = f"failed: rank {e['rank']}: {e['error']}" if e else f"failed: {result}"
        self._server_close()
        self._done.set()

    def summary_line(self) -> str:
        """One line: steps and median step time."""
        s = self.summary()
        t = f", {s['step_time_s'] * 1e3:.1f} ms/step" if s["step_time_s"] else ""
        return f"{s['steps']} steps{t}"

    def _error_from_result(self, result: dict) -> dict | None:
        failures = result.get("failures") or {}
        if not failures:
            err = result.get("error")
            return {"rank": None, "attempt": 0, "error": str(err), "traceback": ""} if err else None
        rank = min(failures, key=int)
        f = failures[rank]
        msg = f.get("message") or ""
        tb = ""
        if f.get("error_file"):
            try:  # written by @record in the worker: {"message": {"message": ..., "extraInfo": {"py_callstack"}}}
                data = json.loads(Path(f["error_file"]).read_text())["message"]
                msg = data.get("message", msg) if isinstance(data, dict) else str(data)
                tb = data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""
            except (OSError, ValueError, KeyError, TypeError):
                pass
        if not tb:
            tb = self.logs(int(rank), tail=30)
        sig = f" ({f['signal']})" if f.get("signal") else ""
        return {"rank": int(rank), "attempt": 0, "error": f"exit code {f.get('exitcode')}{sig}: {msg}".strip(),
                "traceback": tb}

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
