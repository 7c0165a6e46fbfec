"""Watching a run against its plan: events from the run's per-rank samples, its ranks' failures
and the plan's predictions.

Pure: plain dicts in, plain dicts out, no clock and no processes, so a test feeds it synthetic
samples. The inputs are what ``Run`` already holds: ``Run.samples`` (one dict per tick and rank:
``t``, ``rank``, ``memory_bytes``, ``step``, ``step_time_s``, ...), its step rows (every step of
every rank, for the straggler rule), each rank's failure (``{"error", "traceback"}``) and
``Run.comparison()``'s predictions (memory per rank on the basis the run measures; a step time only
where the plan's device is the run's).

A straggler is a rank that slows the run persistently (:func:`straggler_events`: the median over a
window of steps of its slowdown against the other ranks' median, warm-up steps left out), by far
more than the run's own step-to-step noise (a few CPU processes sharing two cores jitter by tens of
percent, and no rank is to blame). Ranks in lock-step report the same step time, since the others
wait for the slow one inside the collectives, so for them the slowdown is measured by what the rank
spends making its batch beyond the others (its own time, which every rank waited for); a rank slowed
in its compute is not told apart from the step reports alone.

Every event is ``{"t", "kind", "rank", "reason", ...figures}``; ``kind`` is one of :data:`KINDS`.
:class:`Watch` reports each (kind, rank) once, however often it is asked.
"""

from __future__ import annotations

import collections
import re
import statistics
from dataclasses import dataclass, field

from ..units import fmt_bytes, fmt_time

KINDS = ("oom", "memory_high", "straggler", "prediction_error")

OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory", re.IGNORECASE)
"""what a worker's error or traceback says when an allocation failed (CUDA's OOM, or the CPU
allocator's)"""
STRAGGLER_SCAN = 500
"""the straggler rule looks at the latest this many common steps (a long run: each tick stays
cheap)"""
KILLED = re.compile(r"SIGKILL|exit code -9\b|exit code 137\b")
"""how torch's agent reports a worker the kernel killed (the OOM killer, a cgroup's memory limit)"""


@dataclass
class WatchSettings:
    """What counts as an event."""

    memory_limit_bytes: float | None = None
    """each rank's device memory (a CPU limit, or the plan's device's); None: the GPU's own (NVML's
    ``nvml_total_bytes`` in the samples) where known, else no memory-limit events"""
    memory_threshold: float = 0.92
    """share of the limit above which a rank's memory is an event (``memory_high``)"""
    oom_kill_share: float = 0.8
    """a worker killed by SIGKILL counts as out of memory when its memory last reached this share of
    the limit"""
    straggler_ratio: float = 1.3
    """a rank is a straggler when it slows the steps by more than this factor against the other
    ranks' median ..."""
    straggler_steps: int = 5
    """... as the median over a window of this many steps that every rank reported
    (:func:`straggler_events`) ..."""
    straggler_noise: float = 4.0
    """... and the time it costs each step is above this many times the run's noise
    (:func:`step_noise`)"""
    warmup_steps: int = 2
    """steps of each run left out of the straggler rule: start-up, compilation and the first
    collectives"""
    prediction_tolerance: float = 0.3
    """relative error of a measured figure against the plan's prediction beyond which it is an
    event"""
    predicted_memory: list = field(default_factory=list)
    """bytes per rank (None where unknown): ``Run.comparison()["predicted_memory"]``"""
    predicted_step_time_s: float | None = None
    """``Run.comparison()["predicted_step_time_s"]``: None where times do not compare (another
    device) or are not judged (a CPU whose speed no run has calibrated: ``judge_time``)"""
    prediction_for: str = ""
    """the device the plan's predictions describe when it is not the run's
    (``Run.comparison()["other_device"]``, e.g. "h100-80gb" for CPU processes): no
    ``prediction_error`` then, since a gap says nothing about the plan"""
    prediction_slack_bytes: float = 0.0
    """memory a rank holds beyond the prediction by the way it is measured (on CPU, what torch
    allocates on first use counts in the RSS): a memory gap must exceed the tolerance by this much
    to be an event"""
    min_steps: int = 3
    """steps a rank must have reported before its figures are compared with the prediction"""
    enforce_limit: bool = False
    """a rank above ``memory_limit_bytes`` is stopped (an ``oom`` event with ``killed``): a CPU run
    of a plan made with a per-rank limit (``Cluster.preset("cpu", memory_gb=...)``), where nothing
    else would stop it"""


def settings_for(comparison: dict, *, memory_limit_bytes: float | None = None,
                 **kw) -> WatchSettings:
    """Settings for a run from ``Run.comparison()`` (the predictions that describe its device)."""
    return WatchSettings(memory_limit_bytes=memory_limit_bytes,
                         predicted_memory=list(comparison.get("predicted_memory") or []),
                         predicted_step_time_s=comparison.get("predicted_step_time_s")
                         if comparison.get("judge_time", True) else None,
                         prediction_for=comparison.get("other_device") or "",
                         prediction_slack_bytes=float(comparison.get("memory_slack_bytes") or 0.0),
                         **kw)


def held(sample: dict) -> float | None:
    """The memory a sample holds against a limit: on CPU the peak RSS so far above the baseline (its
    RSS before building its model) where the peak is known, else ``memory_bytes``; None for a CPU
    rank whose baseline is not known yet, whose ``memory_bytes`` is then its raw RSS, the Python and
    torch runtime included."""
    if sample.get("source") in ("psutil", "stream"):
        base = sample.get("rss_baseline_bytes")
        if not base:
            return None
        if sample.get("rss_peak_bytes"):
            return max(float(sample.get("memory_bytes") or 0.0), sample["rss_peak_bytes"] - base)
    return sample.get("memory_bytes")


def limit_of(sample: dict, s: WatchSettings) -> float | None:
    """The memory limit a sample is held against: the settings', else its GPU's (NVML)."""
    return s.memory_limit_bytes or sample.get("nvml_total_bytes") or None


def by_rank(samples: list[dict]) -> dict[int, list[dict]]:
    """The samples of each rank, in time order (``Run.samples`` is in time order already)."""
    out: dict[int, list[dict]] = {}
    for s in samples:
        out.setdefault(s["rank"], []).append(s)
    return out


def step_times(rows: list[dict]) -> dict[int, float]:
    """{step: step time} of one rank's samples (a step seen at several ticks once; a redone step's
    latest)."""
    return {int(s["step"]): float(s["step_time_s"]) for s in rows
            if s.get("step") is not None and s.get("step_time_s") is not None}


def oom_events(samples: list[dict], errors: dict[int, dict], s: WatchSettings) -> list[dict]:
    """A rank whose failure says it ran out of memory (CUDA's OOM), or that was killed by SIGKILL
    while its memory was near the limit (CPU: the kernel's OOM killer or a cgroup limit leaves no
    Python traceback)."""
    out, rows = [], by_rank(samples)
    for rank, err in sorted(errors.items()):
        text = f"{err.get('error', '')}\n{err.get('traceback', '')}"
        last = next((r for r in reversed(rows.get(rank, [])) if held(r) is not None), {})
        mem, t = held(last) if last else None, err.get("t", last.get("t"))
        if OOM_TEXT.search(text):
            out.append({"t": t, "kind": "oom", "rank": rank, "memory_bytes": mem,
                        "step": last.get("step"),
                        "reason": f"rank {rank} ran out of memory: "
                                  f"{err.get('error', '').strip()[:200]}"})
        elif KILLED.search(text) and mem is not None and (limit := limit_of(last, s)) and \
                mem >= s.oom_kill_share * limit:
            out.append({"t": t, "kind": "oom", "rank": rank, "memory_bytes": mem,
                        "step": last.get("step"),
                        "reason": f"rank {rank} was killed (SIGKILL) with {fmt_bytes(mem)} of "
                                  f"{fmt_bytes(limit)} in use ({mem / limit:.0%}): out of memory"})
    return out


def memory_events(samples: list[dict], s: WatchSettings) -> list[dict]:
    """The first sample of each rank whose memory is above ``memory_threshold`` of its limit."""
    out = []
    for rank, rows in sorted(by_rank(samples).items()):
        hit = next((r for r in rows if (limit := limit_of(r, s)) and
                    (held(r) or 0) >= s.memory_threshold * limit), None)
        if hit is not None:
            limit, mem = limit_of(hit, s), held(hit)
            share, where = mem / limit, step_text(hit)
            out.append({"t": hit["t"], "kind": "memory_high", "rank": rank, "memory_bytes": mem,
                        "limit_bytes": limit, "share": share, "step": hit.get("step"),
                        "reason": f"rank {rank} reached {share:.0%} of {fmt_bytes(limit)}{where} "
                                  f"(threshold {s.memory_threshold:.0%})"})
    return out


def over_limit_events(samples: list[dict], s: WatchSettings) -> list[dict]:
    """With ``enforce_limit``: the first sample of each rank above the memory limit, as an ``oom``
    event with ``killed`` (the caller stops that rank, as the kernel's OOM killer or a GPU's
    allocator would)."""
    if not s.enforce_limit or not s.memory_limit_bytes:
        return []
    out = []
    for rank, rows in sorted(by_rank(samples).items()):
        hit = next((r for r in rows if (held(r) or 0) > s.memory_limit_bytes), None)
        if hit is not None:
            mem, limit = held(hit), s.memory_limit_bytes
            out.append({"t": hit["t"], "kind": "oom", "rank": rank, "memory_bytes": mem,
                        "limit_bytes": limit, "share": mem / limit, "step": hit.get("step"),
                        "killed": True, "reason": f"rank {rank} exceeded its memory limit: "
                                                  f"{fmt_bytes(mem)} above its baseline, "
                                  f"{mem / limit:.0%} of {fmt_bytes(limit)}{step_text(hit)}; "
                                  "stopped (SIGKILL) as an out-of-memory would"})
    return out


def step_text(sample: dict) -> str:
    """' at step N' when the sample knows its step."""
    return f" at step {sample['step']}" if sample.get("step") is not None else ""


def step_figures(rows: list[dict]) -> dict[int, tuple[float, float]]:
    """{step: (step time, data wait)} of one rank's samples or step rows (a step seen at several
    ticks once; a redone step's latest; no data wait known: 0)."""
    return {int(s["step"]): (float(s["step_time_s"]), float(s.get("data_wait_s") or 0.0))
            for s in rows if s.get("step") is not None and s.get("step_time_s") is not None}


def slowdowns(figures: dict[int, dict[int, tuple[float, float]]], rank: int,
              step: int) -> tuple[float, str, dict]:
    """How much slower ``rank`` made ``step`` than the other ranks (their median): (ratio, what,
    figures).

    Two measures, the larger wins. ``"step time"``: its step time against the others' (ranks that do
    not wait for each other). ``"data"``: ranks in lock-step (every synchronous plan) report the
    same step time, since the others wait for the slow one in the collectives; what a rank spends
    making its batch is its own, so its data wait beyond the others' (``excess``) is time every rank
    waited for it: the step took ``t`` where ``t - excess`` would do."""
    t, wait = figures[rank][step]
    others = [f[step] for r, f in figures.items() if r != rank]
    others_t, others_wait = (statistics.median(o[0] for o in others),
                             statistics.median(o[1] for o in others))
    by_time = t / others_t if others_t > 0 else 1.0
    excess = max(0.0, wait - others_wait)
    by_data = t / max(t - excess, 1e-3 * t) if excess > 0 else 1.0
    info = {"step_time_s": t, "others_s": others_t, "data_wait_s": wait,
            "others_data_wait_s": others_wait}
    return (by_data, "data", info) if by_data > by_time else (by_time, "step time", info)


def straggler_events(samples: list[dict], s: WatchSettings,
                     steps: list[dict] | None = None) -> list[dict]:
    """A rank that slowed the run persistently: over a window of ``straggler_steps`` steps every
    rank reported, the median of its per-step slowdown against the other ranks' median
    (:func:`slowdowns`) is above ``straggler_ratio`` (a median: one slow step, or a few, is not
    enough; one fast step does not hide it), and the median time it cost each step is above
    ``straggler_noise`` times the run's noise (:func:`step_noise`): on a loaded CPU the ranks' steps
    jitter by more than the ratio, and a gap inside that jitter blames no rank. The first
    ``warmup_steps`` steps are left out (start-up, compilation, the first collectives). From the
    run's step rows (``steps``: every step) when given, else from the samples (a step per tick).
    Limits: a rank slowed in its compute, not its data, keeps lock-step ranks waiting inside the
    collectives, where no figure the ranks report shows whose fault it was (pending a per-rank
    compute time from the runtime)."""
    rows = by_rank(steps if steps else samples)
    figures = {r: step_figures(v) for r, v in rows.items()}
    if len(figures) < 2:
        return []
    common = (sorted(set.intersection(*(set(f) for f in figures.values())))
              [s.warmup_steps:][-STRAGGLER_SCAN:])
    noise = step_noise(figures, common)
    out = []
    for rank in sorted(figures):
        per_step = [(step, *slowdowns(figures, rank, step)) for step in common]
        for end in range(s.straggler_steps, len(per_step) + 1):
            window = per_step[end - s.straggler_steps:end]
            ratio = statistics.median(w[1] for w in window)
            # the seconds the rank cost each step (t - t / ratio, whichever measure won), against
            # the noise
            cost = statistics.median(w[3]["step_time_s"] * (1 - 1 / max(w[1], 1.0)) for w in window)
            if ratio > s.straggler_ratio and cost > s.straggler_noise * noise:
                e = straggler(rank, window, ratio, rows[rank])
                out.append({**e, "noise_s": noise,
                            "reason": f"{e['reason']}; {fmt_time(cost)} a step, against "
                                                              "step-to-step noise of "
                                                              f"{fmt_time(noise)}"})
                break
    return out


def step_noise(figures: dict[int, dict[int, tuple[float, float]]], steps: list[int]) -> float:
    """The run's step-to-step noise in seconds: each rank's spread of step times over ``steps``
    (1.4826 x the median absolute deviation, a standard deviation that a few slow steps do not
    inflate), the median over ranks (a straggler's own swings do not count as the others' noise)."""
    spreads = []
    for f in figures.values():
        times = [f[step][0] for step in steps]
        if len(times) >= 2:
            mid = statistics.median(times)
            spreads.append(1.4826 * statistics.median(abs(x - mid) for x in times))
    return statistics.median(spreads) if spreads else 0.0


def straggler(rank: int, window: list[tuple], ratio: float, rows: list[dict]) -> dict:
    """The ``straggler`` event of ``rank`` for its slow ``window`` of (step, ratio, what,
    figures)."""
    step, _, _, f = window[-1]
    what = collections.Counter(w[2] for w in window).most_common(1)[0][0]
    t = next((x["t"] for x in rows if x.get("step") == step and x.get("t") is not None),
             rows[-1].get("t"))
    n = len(window)
    if what == "data":
        detail = (f"it spent {fmt_time(f['data_wait_s'])} making its batch against "
                  f"{fmt_time(f['others_data_wait_s'])} on the other ranks, which waited for it")
    else:
        detail = (f"{fmt_time(f['step_time_s'])} against {fmt_time(f['others_s'])} on the other "
                  "ranks")
    return {"t": t, "kind": "straggler", "rank": rank, "step": step, "ratio": ratio, "what": what,
            **f, "reason": f"rank {rank} slowed the run {ratio:.1f}x over {n} steps (median; step "
                           f"{step}: {detail})"}


def prediction_off(kind: str, measured: float | None, predicted: float | None,
                   s: WatchSettings) -> bool:
    """Whether a measured ``kind`` ("memory" or "step_time") is a prediction error: off the plan's
    ``predicted`` by more than ``prediction_tolerance`` (memory: and ``prediction_slack_bytes``),
    where the predictions describe the run's device and, for times, are judged. The one rule:
    :func:`prediction_events` raises its events by it and the dashboard and the widget mark a
    measured figure by it (a 3.9x on CPU RSS, within the slack, is shown, not flagged)."""
    if not measured or not predicted or s.prediction_for:
        return False
    if kind == "step_time":
        return (bool(s.predicted_step_time_s)
                and abs(measured / predicted - 1) > s.prediction_tolerance)
    return abs(measured - predicted) > s.prediction_tolerance * predicted + s.prediction_slack_bytes


def prediction_events(samples: list[dict], s: WatchSettings) -> list[dict]:
    """A rank whose peak memory so far, or median step time (its first step left out: start-up),
    differs from the plan's prediction by more than ``prediction_tolerance`` (memory: and
    ``prediction_slack_bytes``), once it reported ``min_steps`` steps. None when the plan was made
    for another device (``prediction_for``)."""
    out = []
    if s.prediction_for:
        return out
    for rank, rows in sorted(by_rank(samples).items()):
        times = step_times(rows)
        if len(times) < s.min_steps:
            continue
        t, step = rows[-1]["t"], max(times)
        predicted = s.predicted_memory[rank] if rank < len(s.predicted_memory) else None
        peak = max((r["memory_bytes"] for r in rows if r.get("memory_bytes") is not None),
                   default=None)
        if prediction_off("memory", peak, predicted, s):
            out.append(mismatch(t, rank, step, "memory", peak, predicted, fmt_bytes))
        if s.predicted_step_time_s:
            first = min(times)  # start-up: left out
            median = statistics.median(v for k, v in times.items() if k != first)
            if prediction_off("step_time", median, s.predicted_step_time_s, s):
                out.append(mismatch(t, rank, step, "step_time", median, s.predicted_step_time_s,
                                    fmt_time))
    return out


def mismatch(t: float, rank: int, step: int, what: str, measured: float, predicted: float,
             unit) -> dict:
    """A ``prediction_error`` event: ``what`` ("memory" or "step_time") measured vs predicted."""
    ratio = measured / predicted
    label = "peak memory" if what == "memory" else "median step time"
    return {"t": t, "kind": "prediction_error", "rank": rank, "what": what, "step": step,
            "measured": measured, "predicted": predicted, "ratio": ratio,
            "reason": f"rank {rank}'s {label} is {unit(measured)}, {ratio:.2f}x the plan's "
                      f"{unit(predicted)}"}


RANK_EVENTS = ("numerics", "checkpoint")
"""events a rank sends itself (runtime/train.py): the numerics guard skipped a step or rolled back,
a checkpoint was not saved"""


def rank_event(data: dict, *, rank: int, t: float) -> dict:
    """The event of a rank's message: its kind, step, action ("skip", "rollback", "failed") and its
    line as the reason (cut to 500 characters)."""
    step, action = data.get("step"), data.get("action")
    return {"t": t, "kind": data["event"], "rank": rank,
            "step": step if isinstance(step, int) else None, "action": action
            if isinstance(action, str) else None, "reason": str(data.get("message", ""))[:500]}


def detect(samples: list[dict], *, errors: dict[int, dict] | None = None,
           settings: WatchSettings | None = None, steps: list[dict] | None = None) -> list[dict]:
    """Every event the samples and failures show, in time order (see the module docstring);
    ``steps``: the run's step rows (every step of every rank: ``rank``, ``step``, ``step_time_s``,
    ``data_wait_s``, ``t``), for the straggler rule."""
    s = settings or WatchSettings()
    # the limit's own stop comes before the agent's account of the killed rank (the same oom, said
    # once)
    events = (over_limit_events(samples, s) + oom_events(samples, errors or {}, s)
              + memory_events(samples, s) + straggler_events(samples, s, steps)
              + prediction_events(samples, s))
    return sorted(events, key=lambda e: (e["t"] if e["t"] is not None else float("inf"),
                                         KINDS.index(e["kind"])))


class Watch:
    """:func:`detect` asked again and again (at each monitor tick): each (kind, rank, what) reported
    once."""

    def __init__(self, settings: WatchSettings | None = None):
        self.settings = settings or WatchSettings()
        self.seen: set[tuple] = set()

    def update(self, samples: list[dict], *, errors: dict[int, dict] | None = None,
               steps: list[dict] | None = None) -> list[dict]:
        """The events not reported before."""
        new = []
        for e in detect(samples, errors=errors, settings=self.settings, steps=steps):
            key = (e["kind"], e["rank"], e.get("what"))
            if key not in self.seen:
                self.seen.add(key)
                new.append(e)
        return new
