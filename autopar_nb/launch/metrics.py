"""What a run's ranks reported, kept on the notebook side: per-rank state, the metrics table and its
summary.

Plain data and pure functions; :class:`~autopar_nb.launch.run.Run` holds the instances under its
lock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankState:
    """What the notebook knows about one rank."""

    rank: int
    attempt: int = -1
    """restart attempt of the rank's current connection (0 = first start); -1 before it connected"""
    step: int | None = None
    """last step reported"""
    last_progress: float = 0.0
    """time.monotonic() of the last hello or step, or of the restart that began its current
    attempt"""
    connected: bool = False
    """its current attempt has said hello"""
    done: bool = False
    sample: dict = field(default_factory=dict)
    """latest device sample (cpu_percent, rss; gpu_util, gpu_mem_used, ... with NVML)"""
    last: dict = field(default_factory=dict)
    """latest step message"""
    log_tail: list[str] = field(default_factory=list)
    baseline: float | None = None
    """bytes the rank's process held before its model was built (the script's
    ``RSS_BEFORE_MODEL``)"""
    error: dict | None = None
    """its own failure in the current attempt: {"error", "traceback"} from its error message, or a
    note that its process ended without one"""
    failed_at: float | None = None
    """time.time() its error message arrived, or its connection closed without a "done" or error
    message"""
    closed_at: float | None = None
    """time.time() its connection closed without a "done" or error message while the run went on"""
    peak_rss: float = 0.0
    """the highest RSS its step messages reported (the peaks they carry included)"""
    dumps_stacks: bool = False
    """its script prints every thread's stack to stderr on SIGUSR1 (its "start" message said so)"""
    host: str | None = None
    """the address its metrics connection came from (an attached run: the host it runs on)"""
    lost: str | None = None
    """an attached run (``attached.py``) lost it: why (its connection closed without an end message,
    it went silent, or it never connected)"""

    def copy(self) -> RankState:
        """A copy whose dicts and lists are the copy's own."""
        return RankState(**{**self.__dict__, "sample": dict(self.sample), "last": dict(self.last),
                            "log_tail": list(self.log_tail),
                            "error": dict(self.error) if self.error else None})

    def stepped(self) -> bool:
        """It reported a step in its current attempt."""
        return bool(self.last) and self.last.get("attempt") == max(self.attempt, 0)

    def state(self, run_status: str) -> str:
        """starting | running | restarting | failed | lost | hung | finished | stopped, given the
        run's status."""
        if self.lost is not None:
            return "lost"
        if self.error is not None:
            return "failed"
        if self.done:
            return "finished"
        if run_status in ("hung", "stopped"):
            return run_status
        if run_status in ("failed", "finished"):
            return "stopped"  # ended by the agent after another rank's failure
        if run_status == "restarting" and not self.connected:
            return "restarting"
        return "running" if self.stepped() else "starting"


class MetricsTable(list):
    """The per-step metrics of a run: a list of dicts (one per rank and step), with a table repr.

    Columns: rank, attempt, step, loss, step_time_s, samples_per_s or tokens_per_s, rss / mem_*
    bytes, time. ``to_pandas()`` gives a DataFrame when pandas is installed.
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


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def step_row(rank: int, attempt: int, data: dict, time: float) -> dict:
    """The table row of one step message: rank, attempt, step, then the message's numbers (bools and
    text are dropped), then the time it arrived."""
    row = {"rank": rank, "attempt": attempt, "step": data["step"]}
    for k, v in data.items():
        if k not in row and isinstance(v, (int, float)) and not isinstance(v, bool):
            row[k] = v
    row["time"] = time
    return row


def summarize(rows: list[dict], *, status: str, plan: Any = None,
              baselines: dict[int, float] | None = None) -> dict:
    """Measured vs predicted (see :meth:`Run.summary`): steps, median steady-state step time, peak
    memory per rank (CUDA's peak; on CPU the RSS, less each rank's RSS before its model was built
    when ``baselines`` has it), on CUDA the caching allocator's peak reserve per rank
    (``reserved_by_rank``), and the plan's predictions when it has a cost."""
    out: dict[str, Any] = {"status": status, "steps": len({r["step"] for r in rows})}
    out["step_time_s"] = steady_step_time(rows)
    cuda = any(r.get("mem_peak") for r in rows)
    base = {} if cuda else (baselines or {})
    mem: dict[int, float] = {}
    for r in rows:
        m = r.get("mem_peak") or r.get("mem_reserved") or r.get("rss")
        if m is not None:
            m = max(0.0, float(m) - base.get(r["rank"], 0.0))
            mem[r["rank"]] = max(mem.get(r["rank"], 0.0), m)
    out["memory_by_rank"] = mem
    out["memory_kind"] = "cuda_peak" if cuda else "rss_above_baseline" if base else "rss"
    if cuda:  # the caching allocator's peak reserve: its fragmentation beside the tensors' peak
        reserved: dict[int, float] = {}
        for r in rows:
            if r.get("mem_peak_reserved") is not None:
                reserved[r["rank"]] = max(reserved.get(r["rank"], 0.0),
                                          float(r["mem_peak_reserved"]))
        out["reserved_by_rank"] = reserved
    cost = getattr(plan, "cost", None)
    if cost is not None:
        out["predicted_step_time_s"] = cost.step_time_s or None
        out["predicted_memory_by_rank"] = {i: m.total for i, m in enumerate(cost.memory_by_rank)}
        out["predicted_peak_memory_bytes"] = cost.peak_memory_bytes or None
    return out


def steady_step_time(rows: list[dict]) -> float | None:
    """Median step time, leaving out each rank's first step of each attempt (warm-up: allocations,
    first collectives) when there are other steps; None without timed steps."""
    first: dict[tuple, int] = {}
    for r in rows:
        key = (r["rank"], r["attempt"])
        first[key] = min(first.get(key, r["step"]), r["step"])
    timed = [r for r in rows if r.get("step_time_s") is not None]
    times = [r["step_time_s"] for r in timed if r["step"] != first[(r["rank"], r["attempt"])]]
    times = times or [r["step_time_s"] for r in timed]
    return statistics.median(times) if times else None
