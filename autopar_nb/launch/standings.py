"""A tournament's results: one :class:`Entry` per plan, Kendall's tau of predicted vs measured
order, the winner.

Plain data and pure functions (no processes): :mod:`autopar_nb.launch.trials` fills them.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..units import fmt_bytes, fmt_time


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two paired score lists (ties in either count for neither order): 1 when
    they order the items alike, -1 when reversed; 0.0 when fewer than two items or either list is
    all ties."""
    if len(a) != len(b):
        raise ValueError(f"kendall_tau needs paired lists, got {len(a)} and {len(b)} items")
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denom = ((concordant + discordant + ties_a) * (concordant + discordant + ties_b)) ** 0.5
    return (concordant - discordant) / denom if denom else 0.0


def tau_over_distinguishable(predicted: list[float],
                             repeats: list[list[float]]) -> tuple[float | None, int]:
    """Kendall's tau of ``predicted`` against the measured order over the pairs of plans that
    repeats tell apart: plans ``i`` and ``j`` count only when every repeat of one measured faster
    than every repeat of the other (``repeats[i]``: plan ``i``'s measured step times, one per
    repeat). On a shared machine the same plan measures tens of percent apart from one run to the
    next, and a pair inside that noise has no measured order to match. Returns (tau, the number of
    such pairs); tau is None when no pair is told apart."""
    concordant = discordant = 0
    for i in range(len(predicted)):
        for j in range(i + 1, len(predicted)):
            if not repeats[i] or not repeats[j]:
                continue
            if max(repeats[i]) < min(repeats[j]):
                faster = i
            elif max(repeats[j]) < min(repeats[i]):
                faster = j
            else:
                continue
            other = j if faster == i else i
            if predicted[faster] < predicted[other]:
                concordant += 1
            elif predicted[faster] > predicted[other]:
                discordant += 1
    pairs = concordant + discordant
    return ((concordant - discordant) / pairs if pairs else None), pairs


def stable(times: list[float], *, warmup: int, min_steps: int, cv: float) -> bool:
    """Whether a trial's step times (in step order) have settled: at least ``min_steps`` steps after
    the first ``warmup`` ones, whose coefficient of variation (stdev / mean) is below ``cv``."""
    steady = times[warmup:]
    if len(steady) < max(2, min_steps):
        return False
    mean = statistics.fmean(steady)
    return mean > 0 and statistics.stdev(steady) / mean < cv


def steady_time(times: list[float], *, warmup: int) -> float | None:
    """The median step time after the first ``warmup`` steps (all of them when there are no more);
    None without steps."""
    if not times:
        return None
    return statistics.median(times[warmup:] or times)


def ranks(values: list[float | None]) -> list[int | None]:
    """1 for the smallest value, 2 for the next, ...; None stays None."""
    order = sorted((v, i) for i, v in enumerate(values) if v is not None)
    out: list[int | None] = [None] * len(values)
    for r, (_, i) in enumerate(order, 1):
        out[i] = r
    return out


def table(entries: list[Entry]) -> list[dict[str, Any]]:
    """One row per plan, in the planner's order: label, predicted / measured step and peak, ranks by
    each (among the plans measured so far: a tournament's progress shows the same table)."""
    rp = ranks([e.predicted_s if e.status == "measured" else None for e in entries])
    rm = ranks([e.measured_s for e in entries])
    rc = ranks([e.calibrated_s if e.status == "measured" else None for e in entries])
    return [{"plan": e.label, "status": e.status, "predicted_s": e.predicted_s,
             "measured_s": e.measured_s,
             "calibrated_s": e.calibrated_s, "predicted_peak": e.predicted_peak,
             "measured_peak": e.measured_peak, "rank_predicted": rp[i], "rank_measured": rm[i],
             "rank_calibrated": rc[i], "steps": e.steps,
             "note": e.reason} for i, e in enumerate(entries)]


@dataclass
class Entry:
    """One plan of a tournament."""

    plan: Any
    label: str
    """the plan's summary without its cost, and what sets it apart from the chosen plan"""
    predicted_s: float
    """the cost model's step time before the tournament's calibration"""
    predicted_peak: float
    """the worst rank's predicted training state (no allocator margin): what the measured peak
    compares with"""
    status: str = "pending"
    """pending | running | measured | skipped (predicted not to fit) | failed (its run did not
    finish) | stopped (the tournament was stopped during its trial or before it)"""
    reason: str = ""
    measured_s: float | None = None
    """median step time after warm-up (each step as slow as its slowest rank)"""
    measured_peak: float | None = None
    """the worst rank's peak memory (CPU: RSS above its RSS before the model was built)"""
    peak_by_rank: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    """steps it ran (fewer than asked when they were stable early)"""
    stopped_early: bool = False
    wall_s: float = 0.0
    calibrated_s: float | None = None
    """the cost model's step time after the tournament's calibration"""


@dataclass
class TournamentResult:
    """What :func:`autopar_nb.launch.trials.tournament` measured; ``adopt()`` takes the winner."""

    entries: list[Entry]
    tau: float | None
    """Kendall's tau of predicted vs measured step times over the measured plans (None with fewer
    than two)"""
    tau_calibrated: float | None
    """the same after the tournament's calibration (in-sample: fitted on these measurements)"""
    scales: dict[str, float]
    """the fitted scale of each step-time component (``calibration.COMPONENTS``)"""
    factors: dict[str, float]
    """the calibrated cost-model factors (saved under ``preset`` when the tournament saved them)"""
    preset: str
    nproc: int
    wall_s: float
    session: Any = None
    stopped: bool = False
    """the tournament was stopped before every plan had run: the entries measured until then are
    kept"""

    @property
    def measured(self) -> list[Entry]:
        """The entries that were run to the end, in the planner's order."""
        return [e for e in self.entries if e.status == "measured"]

    @property
    def winner(self) -> Entry | None:
        """The measured fastest entry."""
        return min(self.measured, key=lambda e: e.measured_s, default=None)

    @property
    def margin(self) -> float | None:
        """How much faster the winner was than the runner-up, as a fraction of the runner-up's step
        time."""
        times = sorted(e.measured_s for e in self.measured)
        return 1 - times[0] / times[1] if len(times) > 1 and times[1] else None

    def adopt(self):
        """The winner's Plan; with a session, also made the session's plan (``session.adopt``: one
        ``undo()`` goes back; the planner's choice when it won). Raises ValueError when no plan was
        measured."""
        w = self.winner
        if w is None:
            raise ValueError("no plan was measured: nothing to adopt (see the table's reasons)")
        s = self.session
        if s is not None and s.plan is not None and w.plan is not s.plan:
            return s.adopt(w.plan) if any(a is w.plan for a in s.plan.alternatives) else w.plan
        return w.plan

    def table(self) -> list[dict[str, Any]]:
        """One row per plan, in the planner's order (:func:`table`)."""
        return table(self.entries)

    @property
    def ended(self) -> int:
        """How many plans ran to an end (measured, failed or skipped as predicted not to fit)."""
        return sum(e.status in ("measured", "failed", "skipped") for e in self.entries)

    def verdict(self) -> str:
        """One line: the winner, by how much, and tau before and after calibration; a stopped
        tournament says after how many plans."""
        head = f"stopped after {self.ended} of {len(self.entries)} plans; " if self.stopped else ""
        return head + self._verdict()

    def _verdict(self) -> str:
        w = self.winner
        if w is None:
            return "no plan measured"
        first = self.entries[0]
        who = "the planner's choice" if w is first else f"an alternative ({w.label})"
        by = f" by {self.margin:.0%} over the runner-up" if self.margin is not None else ""
        tau = "n/a" if self.tau is None else f"{self.tau:+.2f}"
        tauc = "n/a" if self.tau_calibrated is None else f"{self.tau_calibrated:+.2f}"
        return (f"winner: {who}, {fmt_time(w.measured_s)}/step{by}; Kendall's tau predicted vs "
                f"measured {tau}, after calibration {tauc}; {len(self.measured)} of "
                f"{len(self.entries)} plans measured on {self.nproc} processes in "
                f"{self.wall_s:.1f} s")

    def __repr__(self) -> str:
        head = (f"{'#':>2} {'plan':<44} {'pred':>9} {'meas':>9} {'calib':>9} {'pred peak':>10} "
                f"{'meas peak':>10} {'rk p/m/c':>9}  note")
        lines = [head]
        for i, r in enumerate(self.table()):
            rk = "/".join("-" if r[k] is None else str(r[k])
                          for k in ("rank_predicted", "rank_measured",
                                                                         "rank_calibrated"))
            lines.append(f"{i:>2} {r['plan'][:44]:<44} {fmt_time(r['predicted_s']):>9} "
                         f"{_t(r['measured_s']):>9} {_t(r['calibrated_s']):>9} "
                         f"{fmt_bytes(r['predicted_peak']):>10} {_b(r['measured_peak']):>10} "
                         f"{rk:>9}  {r['status']}{': ' + r['note'] if r['note'] else ''}")
        return "\n".join([*lines, self.verdict()])

    def _repr_html_(self) -> str:
        cols = ("plan", "predicted", "measured", "calibrated", "pred. peak", "meas. peak",
                "rank pred/meas/calib", "status")
        rows = []
        for r in self.table():
            rk = "/".join("–" if r[k] is None else str(r[k])
                          for k in ("rank_predicted", "rank_measured",
                                                                         "rank_calibrated"))
            cells = (r["plan"], fmt_time(r["predicted_s"]), _t(r["measured_s"]),
                     _t(r["calibrated_s"]), fmt_bytes(r["predicted_peak"]), _b(r["measured_peak"]),
                     rk, r["status"] + (f": {r['note']}" if r["note"] else ""))
            rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                        + "</tr>")
        head = "".join(f"<th>{c}</th>" for c in cols)
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
                f"<p>{html.escape(self.verdict())}</p>")


def _t(s: float | None) -> str:
    return "-" if s is None else fmt_time(s)


def _b(n: float | None) -> str:
    return "-" if n is None else fmt_bytes(n)
