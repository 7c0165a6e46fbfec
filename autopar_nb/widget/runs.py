"""The planner widget's runs: the Verify / Export / Launch / Tournament buttons (a Verify or a
Tournament in the background, so the kernel stays free, with its progress view below the planner),
and the launched runs whose measured figures it shows beside the plan's predictions.
"""

from __future__ import annotations

import inspect
import time

from ..launch.tournament_job import TournamentJob
from ..plan import Plan
from . import measured
from .actions import action_message, calibrated_badge, refusal, run_kwargs


class Runs:
    """The run handlers of :class:`~autopar_nb.widget.model.PlannerWidget`, which they are mixed
    into (they act on its ``session``, ``_jobs`` and ``_runs`` and set the panel traits).
    ``_action`` returns None: its own message says what ran."""

    def follow(self, run) -> None:
        """Show what ``run`` (a launched Run) measures beside the plan's predictions while it runs
        and after; the session's launches are followed (``Session.launch``, the Launch button)."""
        if run in self._runs or not callable(getattr(run, "add_listener", None)):
            return
        self._runs = (self._runs + [run])[-measured.FOLLOWED:]
        run.add_listener(self._on_run)

    def _on_run(self, run) -> None:
        """A followed run has news (its monitor thread, at most every 0.25 s): the measured figures,
        at most once a second and at its end; a run that continues under a new plan is followed
        too."""
        nxt = getattr(run, "continued_by", None)
        if nxt is not None:
            self.follow(nxt)
        now = time.monotonic()
        if not run.done and now - self._measured_at < 1.0:
            return
        self._measured_at = now
        self.measured = measured.measured_panel(self.session.plan, self._runs)

    def _action(self, msg) -> str:
        name = msg["name"]
        if name not in self.actions:
            raise ValueError(f"{name!r} is not available on this session")
        why = refusal(name, self._jobs, getattr(self.session, "cluster", None))
        if why:
            self._say("error", f"{name.capitalize()} refused: {why}.")
            return None
        fn = getattr(self.session, name)
        # the click carries the inputs: their trait update may still wait in the front end
        # (ipywidgets holds a model's updates while an earlier one is unanswered), and the click's
        # message is sent at once
        if isinstance(msg.get("run_options"), dict):
            self.run_options = {**self.run_options, **msg["run_options"]}
        kwargs = run_kwargs(name, inspect.signature(fn).parameters, self.session.plan,
                            self.run_options)
        # the plan that runs: the session's, or plan_for's at another process count (said first)
        ran = None
        # launch's re-plan for its steps, said here rather than on the kernel's stdout
        replanned: list[str] = []
        try:
            if name == "launch" and "steps" in kwargs and callable(getattr(self.session,
                                                                           "plan_steps", None)):
                self.session.plan_steps(kwargs["steps"], say=replanned.append)
            if (name == "verify" and callable(getattr(self.session, "plan_for", None))
                and "nproc" in kwargs):
                ran = self.session.plan_for(kwargs["nproc"])
                result = self._verify_in_background(ran, **kwargs)
            elif name == "tournament":
                kwargs = {k: int(self.run_options.get(f"tournament_{k}") or d)
                          for k, d in (("k", 4), ("steps", 20))}
                result = self._tournament_in_background(**kwargs)
            else:
                result = fn(**kwargs)
        except Exception as e:  # shown inline: an action failing must not break the widget
            self._say("error", f"ap.{name}() failed: {type(e).__name__}: {e}")
            return None
        self.last_result = result
        if name == "launch" and callable(getattr(result, "dashboard", None)):
            self.follow(result)
            self.panel = result.dashboard()
        self._say(*action_message(name, result, kwargs, ran or getattr(result, "plan", None),
                                  *replanned))
        return None

    def _verify_in_background(self, plan: Plan, *, nproc: int, steps: int):
        """ap.verify(steps, nproc), run in a child process so the kernel stays free; its progress
        view goes below."""
        from ..verify import job as verify_job

        job = self._jobs["verify"] = verify_job.VerifyJob(self.session.source, plan, steps=steps,
                                                          nproc=nproc)
        self.verify_panel = job.view()
        return job

    def _tournament_in_background(self, *, k: int, steps: int):
        """ap.tournament(k, steps), run in a thread so the kernel stays free; its standings go
        below. When it ends, the header says which calibration the session's next plan uses."""
        job = self._jobs["tournament"] = TournamentJob(self.session, k, steps)
        job.add_listener(lambda j: setattr(self, "calibrated", calibrated_badge(
            self.session.cluster)) if j.done else None)
        self.tournament_panel = job.view()
        return job
