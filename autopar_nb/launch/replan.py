"""Re-planning while training: when a rank runs out of memory, or comes near its limit, stop the
run, calibrate the cost model with what the ranks held, plan again with the user's pins kept, and
resume from the last complete DCP checkpoint under the new plan.

``ap.launch(..., replan=MODE)``:

* ``"ask"`` (default): the run records a proposal (``run.replan_proposal``) and goes on (or has
  failed, for an out-of-memory); the dashboard offers "Re-plan & resume" and "Stop";
  ``run.replan()`` does the same from code.
* ``"auto"``: at once — stop, re-plan, resume; ``run.wait()`` follows the run that continues it.

Stopping: after an out-of-memory the run has failed, and it resumes from the last complete
checkpoint (the steps since are redone, at most the checkpoint interval); near the limit
(``memory_high``) it goes on until its next checkpoint is complete (at most
:data:`CHECKPOINT_WAIT_S`) and stops there, so no step is lost.
* ``"off"``: events only (``run.events``), as before.

The decision and the words are pure functions (:func:`trigger_of`, :func:`cause_text`,
:func:`diff_text`, :func:`measured_peaks`); :class:`Replanner` does the stopping and starting. The
calibration (:meth:`Replanner.calibrate`) gives the planner the allocator margin the ranks really
needed and, where the plan's device is the run's and a step after the first was timed, the speed
factors of the measured step time:

* on CPU (:func:`autopar_nb.calibration.rss_margin_factors`): the margin's fixed part is what a rank
  held between steps beyond its parameters and optimizer state (the process group, thread stacks,
  the kernels' first-use pages: the same for any plan of the model), its fraction what its peak held
  beyond that and the predicted state. Under a CPU limit the ranks run with glibc's mmap threshold
  fixed (``run.CPU_LIMIT_ENV``), so freed activations go back at once and the peak does not grow
  over the steps: the first calibration holds, and one re-plan suffices (a 2-rank MLP's second leg
  held 135 MiB against 132 MiB predicted). Before, a fraction-only margin from the first step's peak
  was too small twice in three runs;
* on GPUs :func:`autopar_nb.calibration.margin_factors` (CUDA's peak against the prediction).

The planner fits the new plan under the watch's threshold of the limit (92 % by default), so the new
plan does not trigger again.

The checkpoint imposes no choice on the new plan: every ZeRO stage keeps its optimizer state in DCP,
which reshards it to the new layout.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import calibration
from ..runtime.metrics import peak_rss
from ..units import fmt_bytes, fmt_time
from . import compare, watch
from .report import held_peaks

MODES = ("ask", "auto", "off")
TRIGGERS = ("oom", "memory_high")
"""the watch's event kinds that call for a plan that uses less memory"""
CHECKPOINT_WAIT_S = 120.0
"""near the limit (not over it), a run goes on for at most this long to write its next checkpoint
before it stops"""
TIMED_STEPS = 2
"""near the limit, a run stops at its first checkpoint after this many steps: the first is warm-up,
so the step time calibrates from the others (:meth:`Replanner.calibrate_time`)"""
MAX_REPLANS = 4
"""re-plans in a row of one launch; beyond, the events are only reported"""
FIELD_NAMES = {"mesh.dp": "dp", "mesh.tp": "TP", "mesh.pp": "PP", "mesh.ep": "EP",
               "mesh.zero_stage": "ZeRO", "batch.micro_batches": "micro-batches",
               "pipeline.schedule": "schedule", "pipeline.virtual_stages": "virtual stages",
               "precision.amp": "AMP", "optimizer.name": "optimizer", "recompute": "recompute",
               "fsdp": "FSDP", "stage": "stage", "tp": "TP styles",
               "sequence_parallel": "sequence parallel", "compile": "compile",
               "fused_loss": "fused loss", "fused_norm": "fused RMSNorm",
               "loss_parallel": "loss parallel", "sync_batchnorm": "SyncBatchNorm"}
"""Plan.diff paths (for layers: the LayerPlan field) -> the words of a diff"""
IGNORED = ("cluster.", "model.", "batch.global_batch", "precision.", "pinned", "tp_parts")
"""paths that follow from the others (or from the cluster) and are left out of the diff's words"""


def check_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`MODES`, else ValueError naming them."""
    if mode not in MODES:
        raise ValueError(f"replan={mode!r}: choose 'ask' (propose a new plan, the default), 'auto' "
                         "(re-plan and resume at once) or 'off' (report the events only)")
    return mode


def trigger_of(events: list[dict]) -> dict | None:
    """The first event that calls for re-planning: an out-of-memory, else memory above the
    threshold."""
    for kind in TRIGGERS:
        hit = next((e for e in events if e.get("kind") == kind), None)
        if hit is not None:
            return hit
    return None


def cause_text(event: dict | None) -> str:
    """Why, in a few words: "rank 1 reached 94 % of 3.00 GiB at step 12"."""
    if event is None:
        return "re-planning was asked for"
    r, step = event.get("rank"), watch.step_text(event)
    limit, share = event.get("limit_bytes"), event.get("share")
    if event["kind"] == "memory_high":
        return f"rank {r} reached {share:.0%} of {fmt_bytes(limit)}{step}"
    if event.get("killed"):
        return f"rank {r} exceeded its {fmt_bytes(limit)} limit ({share:.0%}){step} and was stopped"
    return f"rank {r} ran out of memory{step}"


def _words(path: str) -> tuple[str, str | None]:
    """A Plan.diff path -> (the field's words, the layer path or None)."""
    m = re.fullmatch(r"layers\[(.+)\]\.(\w+)(?:\..*)?", path)
    if m:
        return FIELD_NAMES.get(m.group(2), m.group(2)), m.group(1)
    return FIELD_NAMES.get(path, path), None


def layers_text(paths: list[str]) -> str:
    """Layer paths in few words: ["h.2", "h.3", "h.5", "lm_head"] -> "h.2–3, h.5, lm_head"."""
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    for p in paths:
        head, _, tail = p.rpartition(".")
        if head and tail.isdigit():
            groups.setdefault(head, []).append(int(tail))
        else:
            plain.append(p)
    out = []
    for head, nums in groups.items():
        nums = sorted(set(nums))
        runs, start = [], nums[0]
        for a, b in zip(nums, nums[1:] + [None], strict=True):
            if b != a + 1:
                runs.append(f"{head}.{start}" + (f"–{a}" if a != start else ""))
                start = b
        out += runs
    return ", ".join(out + plain)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {x}" for k, x in v.items()) + "}" if v else "none"
    return str(v)


def diff_text(changes: list) -> str:
    """``Plan.diff`` changes in words: "ZeRO 2 → 3, recompute none → selective on layers.2–3"
    (global fields first, then each layer change once with the layers it applies to); "no change"
    when there is none."""
    glob: list[str] = []
    per_layer: dict[tuple, list[str]] = {}
    for c in changes:
        if any(c.path.startswith(x) or c.path.endswith(x) for x in IGNORED):
            continue
        name, layer = _words(c.path)
        if layer is None:
            glob.append(f"{name} {_value(c.old)} → {_value(c.new)}")
        else:
            per_layer.setdefault((name, _value(c.old), _value(c.new)), []).append(layer)
    parts = glob + [f"{name} {old} → {new} on {layers_text(paths)}"
                    for (name, old, new), paths in per_layer.items()]
    return ", ".join(parts) if parts else "no change"


def measured_peaks(samples: list[dict]) -> dict[int, float]:
    """rank -> the most memory it held in ``Run.samples`` (on CPU: RSS above its baseline, once
    known)."""
    return held_peaks(samples)


def peaks_now(run) -> dict[int, float]:
    """rank -> its peak RSS so far above its baseline, read now from each live CPU worker (Linux
    VmHWM); {} on GPUs (CUDA's peak comes with each step) or where unknown."""
    if run.backend == "nccl":
        return {}
    out = {}
    for r, proc in run.workers().items():
        base, peak = run.ranks()[r].baseline if r in run.ranks() else None, peak_rss(proc.pid)
        if base and peak:
            out[r] = max(0.0, peak - base)
    return out


def predicted_states(plan: Any, nproc: int) -> dict[int, float]:
    """rank -> the plan's predicted training state (before the allocator margin), where the plan has
    a cost."""
    out = {}
    for r in range(nproc):
        p = compare.predicted_memory(plan, r, model_state=True)
        if p:
            out[r] = p
    return out


def steps_reported(run) -> int:
    """How many different steps ``run``'s ranks reported."""
    with run._lock:
        return len({r["step"] for r in run._rows})


def checkpoint_of(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint in ``ckpt_dir`` (the runtime's own rule: a ``step_N`` with its
    manifest)."""
    from ..runtime.checkpoint import latest_checkpoint

    return latest_checkpoint(str(ckpt_dir)) if ckpt_dir else None


class Replanner:
    """Re-plans the runs of one launch (see the module docstring).

    ``plan_fn(calibration, target_bytes, pins)`` plans again (the session: its pins kept, the
    calibrated factors added, each rank fitted under ``target_bytes``) and returns the plan at the
    run's process count; ``launch_fn(plan, run_dir)`` exports and launches it with the launch's
    flags (its ``ckpt_dir``: the new run resumes from the last checkpoint). ``cluster``: the cluster
    the plan was made for (its current factors)."""

    def __init__(self, mode: str, *, cluster: Any, plan_fn: Callable, launch_fn: Callable,
                 ckpt_dir: str | None = None, max_replans: int = MAX_REPLANS):
        self.mode = check_mode(mode)
        self.cluster = cluster
        self.plan_fn, self.launch_fn = plan_fn, launch_fn
        self.ckpt_dir = ckpt_dir
        self.max_replans = max_replans
        self.count = 0
        self._lock = threading.Lock()
        self._busy: dict[str, threading.Event] = {}
        """run_id -> set when that run's re-plan has ended (continued, or given up)"""

    def attach(self, run) -> None:
        """Watch ``run``'s events (its monitor thread calls :meth:`on_events`)."""
        run.replanning = self
        if self.mode != "off":
            run._event_hooks.append(self.on_events)

    def on_events(self, run, events: list[dict]) -> None:
        """New watch events of ``run`` (monitor thread, under the run's lock: nothing here
        blocks)."""
        trigger = trigger_of(events)
        if trigger is None or run.replan_proposal is not None:
            return
        if self.count >= self.max_replans:
            run.replan_proposal = {"trigger": trigger, "cause": cause_text(trigger),
                                   "given_up": True,
                                   "text": f"{cause_text(trigger)}; not re-planned: {self.count} "
                                           "re-plans already"}
            return
        run.replan_proposal = {"trigger": trigger, "cause": cause_text(trigger), "given_up": False,
                               "text": f"{cause_text(trigger)}: re-plan for less memory and resume "
                                       "from the last checkpoint?" if self.mode == "ask"
                               else f"{cause_text(trigger)}: re-planning"}
        if self.mode == "auto":
            self._begin(run)
            threading.Thread(target=self._replan_quietly, args=(run,), daemon=True,
                             name=f"autopar-replan-{run.run_id[:8]}").start()

    def busy(self, run) -> bool:
        """Whether a re-plan of ``run`` is under way."""
        ev = self._busy.get(run.run_id)
        return ev is not None and not ev.is_set()

    def wait_for(self, run, timeout: float | None = None) -> bool:
        """Block until ``run``'s re-plan (if any) has ended; False on timeout."""
        ev = self._busy.get(run.run_id)
        return True if ev is None else ev.wait(timeout)

    def _begin(self, run) -> bool:
        """Mark ``run``'s re-plan as under way; False when one is already (or done)."""
        with self._lock:
            if run.run_id in self._busy:
                return False
            self._busy[run.run_id] = threading.Event()
            return True

    def _replan_quietly(self, run) -> None:
        try:
            self._replan(run)
        except Exception as e:  # a thread must not die silently: the run says what failed
            self._record(run,
                         {"kind": "replan", "reason": f"re-planning failed: {type(e).__name__}: "
                                                      f"{e}", "plan_diff": [], "failed": True})
        finally:
            self._busy[run.run_id].set()

    def replan(self, run):
        """Stop ``run`` if it still runs, re-plan and resume; returns the run that continues it
        (None when no plan uses less memory: the event says why). Called by ``run.replan()`` and the
        dashboard's button."""
        if run.continued_by is not None:
            return run.continued_by
        if not self._begin(run):
            self.wait_for(run)
            return run.continued_by
        try:
            return self._replan(run)
        finally:
            self._busy[run.run_id].set()

    def _replan(self, run):
        proposal = run.replan_proposal or {}
        trigger = proposal.get("trigger")
        cause = proposal.get("cause") or cause_text(trigger)
        if not run.done and self.ckpt_dir and (trigger or {}).get("kind") != "oom":
            # near the limit, not over it: stop at the next checkpoint, lose no step
            self.wait_for_checkpoint(run)
        # the checkpoint's save included, which the last 1 s sample may have missed
        peaks = peaks_now(run)
        if not run.done:
            run.stop(f"re-planning: {cause}")
        t_stopped = time.monotonic() - run._t0
        checkpoint = checkpoint_of(self.ckpt_dir)
        factors, note = self.calibrate(run, peaks)
        limit = run.comparison()["memory_limit_bytes"] or _device_limit(run, trigger)
        threshold = run._watch.settings.memory_threshold if run._watch is not None else 0.92
        target = threshold * limit if limit else None
        pins: dict = {}
        try:
            new = self.plan_fn(factors, target, pins)
        except Exception as e:  # PlanError: nothing fits; the reason says by how much
            return self._record(run, {"kind": "replan", "reason": f"no new plan: {e}",
                                      "plan_diff": [], "failed": True, "cause": cause})
        changes = run.plan.diff(new)
        words = diff_text(changes)
        if words == "no change":
            return self._record(run,
                                {"kind": "replan",
                                 "reason": f"the planner keeps the same plan although {cause}: "
                                           "stopped", "plan_diff": [], "failed": True,
                                 "cause": cause})
        where = (f"resuming from {checkpoint}" if checkpoint else
                 "no checkpoint yet (launch with ckpt_dir=..., ckpt_every=...): starting over from "
                 "step 0")
        reason = f"{words} because {cause}; {note}; {where}"
        event = self._record(run, {"kind": "replan", "rank": (trigger or {}).get("rank"),
                                   "reason": reason,
                                   "cause": cause,
                                   "plan_diff": [{"path": c.path, "old": c.old, "new": c.new}
                                                 for c in changes],
                                   "diff_text": words, "checkpoint": checkpoint,
                                   "calibration": factors,
                                   "plan": new.summary(),
                                   "trigger_t": trigger.get("t") if trigger else None,
                                   "stopped_t": t_stopped, "pins": pins})
        self.count += 1
        nxt = self.launch_fn(new, Path(run.run_dir) / f"replan{self.count}")
        run.continued_by, nxt.continues = nxt, run
        self.attach(nxt)
        nxt.add_listener(lambda r: _resumed(r, run, event, checkpoint))
        if run._dashboard is not None:
            run._dashboard.follow(nxt)
        return nxt

    def wait_for_checkpoint(self, run, timeout_s: float = CHECKPOINT_WAIT_S, *,
                            timed_steps: int = TIMED_STEPS) -> str | None:
        """Block until ``run`` completes a checkpoint newer than the latest one now after at least
        ``timed_steps`` steps (so the step time calibrates: the first step is warm-up), ends, or has
        an out-of-memory event (then the last checkpoint is the one to resume from), at most
        ``timeout_s``; returns the latest."""
        before = checkpoint_of(self.ckpt_dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not run.done:
            if any(e.get("kind") == "oom" for e in list(run.events)):
                return checkpoint_of(self.ckpt_dir)
            now, timed = checkpoint_of(self.ckpt_dir), steps_reported(run) >= timed_steps
            if now != before and timed:
                return now
            # a checkpoint before enough steps: wait for the next one
            before = before if timed else now
            time.sleep(0.05)
        return checkpoint_of(self.ckpt_dir)

    def calibrate(self, run, peaks: dict[int, float] | None = None) -> tuple[dict, str]:
        """(factors, words): the allocator margin from the peak each rank held (its samples', and
        ``peaks`` read just before it stopped) against the plan's prediction, and the speed factors
        from its step time (:meth:`calibrate_time`). On CPU the margin's fixed part is what a rank
        holds between steps beyond the tensors the plan keeps there, its fraction what the peak
        holds beyond that (:func:`autopar_nb.calibration.rss_margin_factors`); on GPUs
        :func:`~autopar_nb.calibration.margin_factors`. No memory factors when the plan predicts no
        memory."""
        current = calibration._current_factors(self.cluster)
        factors, words = self.calibrate_memory(run, peaks, current)
        speed, time_words = self.calibrate_time(run, current)
        return {**factors, **speed}, f"{words}; {time_words}"

    def calibrate_memory(self, run, peaks: dict[int, float] | None,
                         current: dict) -> tuple[dict, str]:
        """The allocator margin (see :meth:`calibrate`) and its words."""
        rss = run.rss_figures()
        measured = {**measured_peaks(run.samples), **{r: v["peak"] for r, v in rss.items()}}
        for r, v in (peaks or {}).items():
            measured[r] = max(measured.get(r, 0.0), v)
        try:
            if rss:
                factors, rec = calibration.rss_margin_factors(
                    measured, {r: v["floor"] for r, v in rss.items()},
                    {r: compare.predicted_breakdown(run.plan, r) for r in measured})
                return factors, (
                    f"calibrated: rank {rec['rank']} peaked at {fmt_bytes(rec['measured_bytes'])} "
                    f"against {fmt_bytes(rec['predicted_bytes'])} predicted and held "
                    f"{fmt_bytes(rec['floor_bytes'])} between steps, so the plan allows "
                    f"{fmt_bytes(rec['margin_fixed_bytes'])} + {rec['margin_fraction']:.0%} on top "
                    "of the predicted bytes")
            factors, rec = calibration.margin_factors(measured,
                                                      predicted_states(run.plan, run.nproc),
                                                      current=current)
        except ValueError as e:
            return {}, f"memory not calibrated ({e})"
        return factors, (f"calibrated: rank {rec['rank']} peaked at "
                         f"{fmt_bytes(rec['measured_bytes'])} against "
                         f"{fmt_bytes(rec['predicted_bytes'])} predicted, so the plan allows "
                         f"{rec['margin_fraction']:.0%} on top of the predicted bytes")

    @staticmethod
    def calibrate_time(run, current: dict) -> tuple[dict, str]:
        """The speed factors from the run's steady steps (its first step, the warm-up, left out; at
        least one other step needed) against the plan's step time, where the plan's device is the
        run's (:func:`autopar_nb.calibration.time_factors`: one uniform correction, a single run
        cannot tell the op classes apart); and its words."""
        predicted = run.comparison().get("predicted_step_time_s")
        if not predicted:
            return {}, "step time not calibrated (the plan's device is not the run's)"
        rows = list(run.metrics)
        if not rows:
            return {}, "step time not calibrated (no step was measured)"
        if len({r["step"] for r in rows}) < 2:
            return {}, "step time not calibrated (only the first, warm-up step was measured)"
        from .metrics import steady_step_time

        measured = steady_step_time(rows)
        compiled = any(getattr(lp, "compile", False) for lp in getattr(run.plan, "layers", None)
                       or [])
        factors, rec = calibration.time_factors(measured, predicted, current=current,
                                                compiled=compiled)
        if not factors:
            return {}, "step time not calibrated (no timed step)"
        return factors, (f"steps took {fmt_time(measured)} against {fmt_time(predicted)} predicted "
                         f"(x{rec['ratio']:.2f}), so the plan's speed factors are scaled by that")

    @staticmethod
    def _record(run, event: dict) -> dict:
        event = {"t": time.monotonic() - run._t0, **event}
        with run._lock:
            run.events.append(event)
        run._notify()
        return event


def _device_limit(run, trigger: dict | None) -> float | None:
    """The limit the trigger was measured against (a GPU's memory, from NVML), when the plan set
    none."""
    return (trigger or {}).get("limit_bytes")


def _resumed(run, previous, replan_event: dict, checkpoint: str | None) -> None:
    """Listener of the continuing run: at its first step, a ``resume`` event (once), with the
    seconds from the triggering sample of the run before to this first step."""
    if run.first_step_time is None or any(e.get("kind") == "resume" for e in run.events):
        return
    trig = replan_event.get("trigger_t")
    since = ((run.started + run.first_step_time) - (previous.started + trig) if trig is not None
             else None)
    first = min((r["step"] for r in run.rows_since(0) if r.get("step") is not None), default=None)
    where = f"from {checkpoint}" if checkpoint else "from step 0"
    event = {"t": run.first_step_time, "kind": "resume", "step": first,
             "seconds_from_trigger": since,
             "reason": f"training resumed {where} at step {first} under {run.plan.summary()}"
                       + (f", {since:.1f} s after the triggering sample" if since is not None
                          else "")}
    with run._lock:
        if not any(e.get("kind") == "resume" for e in run.events):
            run.events.append(event)
