"""``tournament`` in the background: the planner widget's Tournament button, without blocking the
kernel.

:class:`TournamentJob` runs :func:`autopar_nb.launch.tournament.tournament` (the very function
``ap.tournament`` calls) in a thread of the kernel: its trials are launched runs, whose processes
and monitors already run beside the kernel, so the thread only waits on them and the kernel stays
free for other cells. The tournament's ``progress`` hook reports each plan as it starts and ends.
Displayed, a job is a :class:`TournamentView`: a bar, one row per plan (predicted, measured and
calibrated step time, peaks, ranks), a chart of measured against predicted step time per plan, the
verdict, and Adopt, which makes the measured winner the session's plan.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import traitlets

from .dashboard import STATIC, JobView, bundle
from .standings import Entry, TournamentResult, table
from .trials import tournament


class TournamentJob:
    """``tournament(session, k, steps, **kwargs)`` in a thread; ``wait()`` returns its
    TournamentResult.

    Status: running -> finished | stopped | failed.
    """

    def __init__(self, session: Any, k: int = 4, steps: int = 20, **kwargs: Any):
        self.session, self.k, self.steps = session, int(k), int(steps)
        self.status = "running"
        self.message = f"planning the {self.k} alternatives to run beside the plan"
        self.entries: list[Entry] = []
        self.result: TournamentResult | None = None
        self.error: str | None = None
        self.adopted = ""
        """what the last Adopt did, in words"""
        self._adopted = None
        self.started = time.time()
        self.ended: float | None = None
        self._listeners: list[Callable[[TournamentJob], None]] = []
        self._view = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(kwargs,), daemon=True,
                                        name="autopar-tournament")
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.ended is not None

    def wait(self, timeout: float | None = None) -> TournamentResult | None:
        """Block until the tournament ends; return its result (None when it failed)."""
        self._thread.join(timeout)
        return self.result

    def stop(self, reason: str = "stopped by the user") -> str:
        """End the running trial's workers, run no further plan, and wait for the tournament to end;
        what was measured until then stays in ``result``. Returns the final status."""
        if not self.done:
            self.message = f"stopping: {reason}"
            self._stop.set()
            self._notify()
        self._thread.join(30)
        return self.status

    def add_listener(self, fn: Callable[[TournamentJob], None]) -> None:
        """Call ``fn(job)`` (from the job's thread, or the kernel's after Adopt) when something
        changed."""
        self._listeners.append(fn)

    def rows(self) -> list[dict[str, Any]]:
        """The standings so far: one row per plan (``standings.table``)."""
        return table(list(self.entries))

    def adopt(self) -> str:
        """Make the measured winner the session's plan (``TournamentResult.adopt``); returns what
        happened, in words. Raises ValueError when nothing can be adopted."""
        r = self.result
        if r is None or r.winner is None:
            raise ValueError("no plan was measured: nothing to adopt")
        s, w = self.session, r.winner
        if s.plan is w.plan or (s.plan is not None and s.plan is self._adopted):
            self.adopted = f"{w.label} is the plan already"
        elif s.plan is not r.entries[0].plan:
            raise ValueError("the session's plan changed since the tournament, so its alternatives "
                             "are others: re-run the tournament, or take the winner's plan in code "
                             "(ap.widget().last_result.result.winner.plan)")
        elif not any(a is w.plan for a in s.plan.alternatives):
            raise ValueError("the winner came from a re-plan with more alternatives than "
                             "ap.plan.alternatives holds: take it in code "
                             "(ap.widget().last_result.result.winner.plan)")
        else:
            self._adopted = r.adopt()
            self.adopted = f"adopted {w.label} (ap.undo() goes back)"
        self._notify()
        return self.adopted

    def view(self):
        """The progress widget of this job (created on first use)."""
        if self._view is None:
            self._view = TournamentView(self)
        return self._view

    def _ipython_display_(self):
        from IPython.display import display

        display(self.view())

    def _run(self, kwargs: dict[str, Any]) -> None:
        try:
            self.result = tournament(self.session, self.k, self.steps, progress=self._progress,
                                     stop=self._stop, **kwargs)
            self.entries = list(self.result.entries)
            r = self.result
            self.status = "stopped" if r.stopped else "finished"
            self.message = (f"stopped after {r.ended} of {len(r.entries)} plans ({len(r.measured)} "
                            "measured)" if r.stopped
                            else f"{len(r.measured)} of {len(r.entries)} plans measured on "
                                 f"{r.nproc} processes in {r.wall_s:.1f} s")
        except Exception as e:  # shown in the view: the kernel keeps running
            self.status, self.error = "failed", traceback.format_exc()
            self.message = f"the tournament failed: {type(e).__name__}: {e}"
        self.ended = time.time()
        self._notify()

    def _progress(self, entries: list[Entry]) -> None:
        self.entries = list(entries)
        if self._stop.is_set():  # "stopping: ..." stays until the tournament ended
            self._notify()
            return
        running = next((i for i, e in enumerate(entries) if e.status == "running"), None)
        ended = sum(e.status in ("measured", "failed", "skipped") for e in entries)
        self.message = (f"trial {running + 1} of {len(entries)}: {entries[running].label}"
                        if running is not None else f"{ended} of {len(entries)} plans done")
        self._notify()

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn(self)
            except Exception:  # a closed widget must not stop the tournament
                pass


class TournamentView(JobView):
    """Progress and standings of a :class:`TournamentJob` (the job's thread sets the traits): a bar,
    one row per plan, a chart of measured against predicted step time per plan, the verdict, and
    Adopt. ``progress``: {"done": plans ended, "total": plans, "k", "steps"}; ``rows``: one per
    plan, ``standings.table``'s row (seconds and bytes; the front end writes their units)."""

    _esm = bundle(STATIC / "units.js", STATIC / "kernel.js", STATIC / "tournament.js")
    _css = bundle(STATIC / "dashboard.css")
    status = traitlets.Unicode("running").tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    """at the end: {"tau", "tau_calibrated", "winner" (row index), "margin", "wall_s", "saved"
    (where the calibration went, in words)}"""
    adopted = traitlets.Unicode("").tag(sync=True)

    def on_event(self, event: str | None) -> None:
        # not in the kernel's thread: stopping waits for the trial's workers to end
        if event == "stop":
            threading.Thread(target=self._job.stop, args=("Stop button",), daemon=True).start()
        elif event == "adopt":
            try:
                self._job.adopt()
            except ValueError as e:
                self.adopted = f"not adopted: {e}"

    def refresh(self, job: TournamentJob | None = None) -> None:
        job = job or self._job
        with self.hold_sync():
            self.status, self.message, self.error = job.status, job.message, job.error or ""
            ended = sum(e.status in ("measured", "failed", "skipped") for e in job.entries)
            self.progress = {"done": ended, "total": len(job.entries) or job.k + 1, "k": job.k,
                             "steps": job.steps}
            self.rows = job.rows()
            self.summary = summary_of(job.result) if job.result is not None else {}
            self.adopted = job.adopted


def summary_of(r: TournamentResult) -> dict[str, Any]:
    """What the view shows under the table once the tournament ended."""
    winner = next((i for i, e in enumerate(r.entries) if e is r.winner), None)
    if r.factors and r.preset == "cpu":
        saved = "calibration saved for the cpu preset on this machine: the next plan uses it"
    elif r.factors:
        saved = f"not saved: CPU processes do not calibrate the {r.preset or 'custom'} preset"
    else:
        saved = ""
    return {"tau": r.tau, "tau_calibrated": r.tau_calibrated, "winner": winner, "margin": r.margin,
            "wall_s": r.wall_s, "nproc": r.nproc, "verdict": r.verdict(), "saved": saved}
