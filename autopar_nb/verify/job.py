"""``verify`` in the background: the planner widget's Verify button, without blocking the kernel.

:class:`VerifyJob` runs :func:`autopar_nb.verify.check.verify_here` in a child process (``python -m
autopar_nb.verify.job JOB.json``), so the kernel stays free and Stop can end it (with the worker
processes verify starts). Its progress comes over the launcher's metrics channel: the exported
script's ranks report each step of the parallel run there (verify runs that very script); when every
rank has said "done", the single-process reference runs; then the report is read back
(``report.json``). Displayed, a job is a :class:`VerifyView`: a progress bar, one row per step, each
row marked pass/fail with the rule it was judged by (``VerifyReport.judge``).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..launch import procs
from ..launch.channel import MetricsServer

_jobs: weakref.WeakSet[VerifyJob] = weakref.WeakSet()


class VerifyJob:
    """``verify(source, plan, steps=..., nproc=...)`` in a child process; ``wait()`` returns the
    VerifyReport.

    ``cases`` (with ``scripts``, their exported scripts) instead of ``source``/``plan``: several
    plans in one launch (``verify_many``); ``reports`` then holds one report per case. ``warm``
    (default): the child is a standby of the warm pool (``pool.py``), with torch and autopar_nb
    imported and a forkserver that preloaded them for its ranks; False: a fresh ``python -m
    autopar_nb.verify.job JOB.json`` whose ranks are spawned.

    Status: starting -> parallel -> reference -> passed | mismatch | error | stopped.
    """

    def __init__(self, source: Any = None, plan: Any = None, *, cases: list | None = None,
                 scripts: list[str] | None = None, steps: int = 5, nproc: int | None = None,
                 seed: int = 0, rtol: float | None = None, meta_init: bool | list[bool] = False,
                 work_dir: str | os.PathLike | None = None, warm: bool = True):
        cases = list(cases) if cases is not None else [(source, plan)]
        metas = meta_init if isinstance(meta_init, list) else [meta_init] * len(cases)
        self.steps = int(steps)
        self.nproc = int(nproc or cases[0][1].mesh.world_size)
        self.plan_summary = "; ".join(p.summary() for _, p in cases)
        self.warm = warm
        self.status = "starting"
        self.message = f"starting verify of {self.plan_summary} on {self.nproc} processes"
        self.losses: dict[int, float] = {}
        """step -> the parallel run's loss (every rank reports the global loss; the first report
        counts)"""
        self.report = None
        self.reports: list | None = None
        """one VerifyReport per case (``report`` is the first)"""
        self.error: str | None = None
        self.started = time.time()
        self.ended: float | None = None
        self._done_ranks: set[int] = set()
        self._listeners: list[Callable[[VerifyJob], None]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._view = None
        from .check import kernel_cwd

        self.dir = Path(work_dir or tempfile.mkdtemp(prefix="autopar-verify-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        job = {"cases": [{"source": dataclasses.asdict(src), "plan": p.to_json(), "meta_init": m,
                          "script": scripts[i] if scripts else None}
                         for i, ((src, p), m) in enumerate(zip(cases, metas, strict=True))],
               "steps": self.steps, "nproc": self.nproc, "seed": seed, "rtol": rtol,
               "report": str(self.dir / "report.json"), "log": str(self.dir / "verify.log"),
               "parent_pid": os.getpid(), "warm": warm, "cwd": kernel_cwd()}
        (self.dir / "job.json").write_text(json.dumps(job))
        from ..launch.pool import job_env

        # the job's token and metrics address: below
        env = job_env({**os.environ, "PYTHONUNBUFFERED": "1"})
        self._refill = None
        if warm:
            from ..launch.pool import POOL, verify_preload

            preload = verify_preload("\n".join(src.code for src, _ in cases))
            # the ranks run in the kernel's working directory (job["cwd"]): a file of the cell's
            # imports there shadows a preloaded module, as a script's directory does for launch
            standby = POOL.hand("verify", self.dir / "job.json", env=env, monitor=True,
                                preload=preload, script_dir=job["cwd"])
            self._server, self._token, self._proc = standby.server, standby.token, standby.proc
            self._refill = lambda: POOL.refill("verify", env=env, monitor=True, preload=preload)
        else:
            self._server = MetricsServer()
            self._token = self._server.token
            env = {**env, "AUTOPAR_METRICS": self._server.address, procs.TOKEN_ENV: self._token,
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            with open(self.dir / "verify.log", "wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(self.dir / "job.json")], env=env,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _jobs.add(self)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="autopar-verify")
        self._thread.start()

    # ---- public ----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.ended is not None

    def wait(self, timeout: float | None = None):
        """Block until the job ends; return the VerifyReport (None when it failed or was
        stopped)."""
        self._thread.join(timeout)
        return self.report

    def stop(self, reason: str = "stopped by the user") -> str:
        """End the verify process and every worker it started."""
        with self._lock:
            if self.done:
                return self.status
            self._stopping = True
            self.message = f"stopping: {reason}"
        procs.terminate(self._proc, self._token)
        self._thread.join(10)
        return self.status

    def add_listener(self, fn: Callable[[VerifyJob], None]) -> None:
        """Call ``fn(job)`` (from the job's thread) when something changed."""
        self._listeners.append(fn)

    def view(self):
        """The progress widget of this job (created on first use)."""
        if self._view is None:
            from ..launch.dashboard import VerifyView

            self._view = VerifyView(self)
        return self._view

    def _ipython_display_(self):
        from IPython.display import display

        display(self.view())

    def rows(self) -> list[dict]:
        """One row per step: the parallel loss as it comes, then the report's comparison and
        verdict."""
        if self.report is None:
            return [{"step": s, "loss": v} for s, v in sorted(self.losses.items())]
        r = self.report
        out = []
        for s in r.steps:
            ok, rule = r.judge(s)
            prev = r.steps[s.step - 1].param_rel if 0 < s.step <= len(r.steps) else 0.0
            # the tolerances the rule applied (see VerifyReport.judge); None: gradients not judged
            # at this step
            grad_tol = {"rtol": r.rtol, "adam": r.rtol + prev}.get(rule,
                                                                   r.rtol if s.step == 0 else None)
            out.append({"step": s.step, "loss": s.loss, "ref_loss": s.ref_loss,
                        "loss_rel": s.loss_rel, "grad_rel": s.grad_rel, "param_rel": s.param_rel,
                        "ok": ok, "rule": rule, "loss_tol": r.rtol, "grad_tol": grad_tol,
                        "param_tol": r.rtol + (s.step + 1) * r.param_floor})
        return out

    def __repr__(self) -> str:
        return f"VerifyJob({self.plan_summary}, {self.nproc} proc, {self.status}: {self.message})"

    # ---- the job's thread ------------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            while self._proc.poll() is None:
                if self._ingest(self._server.poll(0.2)):
                    self._notify()
            self._ingest(self._server.poll(0.1))
            self._finish()
        except Exception as e:  # never leave the job looking alive
            self.status, self.error = "error", f"the verify monitor failed: {type(e).__name__}: {e}"
        finally:
            self._server.close()
            # its forkserver (warm), or ranks of a killed process
            if procs.processes_with_token(self._token):
                procs.terminate(None, self._token)
            # the next standby warms up now that this job's processes are gone
            if self._refill is not None:
                try:
                    self._refill()
                except Exception:  # the next verify starts one
                    pass
            self.ended = self.ended or time.time()
            self._notify()

    def _ingest(self, msgs: list) -> bool:
        changed = False
        for m in msgs:
            if m.kind != "data":
                continue
            step = m.data.get("step")
            if (isinstance(step, int) and step not in self.losses
                and isinstance(m.data.get("loss"), (int, float))):
                self.losses[step] = float(m.data["loss"])
                changed = True
            elif m.data.get("event") == "done":
                self._done_ranks.add(m.rank)
                changed = True
        if changed and self.status in ("starting", "parallel"):
            if len(self._done_ranks) >= self.nproc:
                self.status, self.message = "reference", ("the single-process reference runs the "
                                                          "same steps")
            elif self.losses:
                self.status = "parallel"
                self.message = (f"parallel run: step {max(self.losses) + 1} of {self.steps} on "
                                f"{self.nproc} processes")
        return changed

    def _finish(self) -> None:
        from .report import StepDiff, VerifyReport

        self.ended = time.time()
        if self._stopping:
            self.status, self.message = "stopped", ("stopped after "
                                                    f"{self.ended - self.started:.1f} s")
            return
        try:
            data = json.loads((self.dir / "report.json").read_text())
        except (OSError, ValueError):
            log = (self.dir / "verify.log").read_text(errors="replace")[-6000:]
            self.status, self.message = "error", ("the verify process exited with code "
                                                  f"{self._proc.returncode}")
            self.error = log
            return
        if "error" in data:
            self.status, self.message, self.error = ("error", data["error"],
                                                     data.get("traceback", ""))
            return
        fields = {f.name for f in dataclasses.fields(VerifyReport)}
        self.reports = [VerifyReport(**{k: v for k, v in d.items() if k in fields and k != "steps"},
                                     steps=[StepDiff(**s) for s in d["steps"]])
                        for d in data["reports"]]
        self.report = self.reports[0]
        ok = all(r.ok for r in self.reports)
        self.status = "passed" if ok else "mismatch"
        self.message = (f"{'OK' if ok else 'MISMATCH'}: {self.steps} steps on {self.nproc} "
                        "processes agree with the single-process reference" if ok
                        else f"MISMATCH: see the rows marked fail ({self.steps} steps on "
                             f"{self.nproc} processes)") + \
            f" ({self.ended - self.started:.1f} s)"

    def _notify(self) -> None:
        for fn in list(self._listeners):
            try:
                fn(self)
            except Exception:  # a closed widget must not stop the job
                pass


@atexit.register
def _stop_all_at_exit() -> None:
    for job in list(_jobs):
        if not job.done:
            job.stop("the kernel is shutting down")


# ---- the child process ---------------------------------------------------------------------------
def enter_cwd(cwd: str | None) -> None:
    """Run in the kernel's working directory ``cwd`` (a warm standby was started in the one the
    kernel had then), with it as ``sys.path[0]`` in place of the directory this process started in,
    as ``python -m`` run there has it; multiprocessing hands both to every rank it starts."""
    if not cwd:
        return
    try:
        here = os.getcwd()
    except FileNotFoundError:
        here = None
    os.chdir(cwd)
    if sys.path and here is not None and sys.path[0] in (here, ""):
        sys.path[0] = cwd
    elif cwd not in sys.path[:1]:
        sys.path.insert(0, cwd)


def main(job_path: str, *, watch: bool = True) -> int:
    job = json.loads(Path(job_path).read_text())
    enter_cwd(job.get("cwd"))
    # the same watchdog as the launch agent's: the kernel gone, so are we
    from ..launch.agent import _watch_parent

    if watch:
        threading.Thread(target=_watch_parent, args=(job["parent_pid"],), daemon=True).start()
    # a standby: its output goes to the job's log from now on
    if job.get("warm") and job.get("log"):
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for std in (1, 2):
            os.dup2(fd, std)
        os.close(fd)
    out = Path(job["report"])
    try:
        from ..plan import Plan
        from ..source import ModelSource
        from .check import export_scripts, verify_here

        cases = [(ModelSource(**c["source"]), Plan.from_json(c["plan"])) for c in job["cases"]]
        metas = [bool(c["meta_init"]) for c in job["cases"]]
        with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
            scripts = [c["script"] for c in job["cases"]]
            if not all(scripts):
                scripts = export_scripts(cases, metas, tmp, steps=job["steps"], seed=job["seed"])
            reports = verify_here(cases, metas, scripts, steps=job["steps"], nproc=job["nproc"],
                                  seed=job["seed"], rtol=job["rtol"],
                                  start_method="forkserver" if job.get("warm") else "spawn")
        data = {"reports": [dataclasses.asdict(r) for r in reports]}
        rc = 0
    except BaseException as e:  # the kernel shows it: nothing is lost in a log
        # failures.RankFailed
        one_line = str(e) if hasattr(e, "details") else f"{type(e).__name__}: {e}"
        data = {"error": one_line, "traceback": getattr(e, "details", "") or traceback.format_exc()}
        rc = 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, out)
    return rc


def standby(preload: list[str], idle_timeout_s: float, parent_pid: int) -> int:
    """A verify standby of the warm pool: the forkserver for the ranks preloads torch,
    autopar_nb.verify.ranks and the cell's imports while this process imports what ``main`` needs;
    then one job (its path on standard input)."""
    import signal

    from ..launch.agent import (
        _watch_parent,
        exit_now,
        forkserver_ready,
        start_forkserver,
        wait_for_job,
    )

    # torch's own handler replaces it
    signal.signal(signal.SIGTERM, lambda *_: exit_now(128 + signal.SIGTERM))
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    start_forkserver(preload)
    from ..export import export  # noqa: F401

    forkserver_ready()
    print(f"standby ready; preloaded in the forkserver: {', '.join(preload)}", flush=True)
    job = wait_for_job(idle_timeout_s)
    return 0 if job is None else main(job, watch=False)


if __name__ == "__main__":
    # without unloading torch (seconds on a busy machine): the report is written
    from ..launch.agent import exit_now

    if sys.argv[1:2] == ["--standby"]:
        exit_now(standby(json.loads(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
    exit_now(main(sys.argv[1]))
