"""The live dashboard of a Run: an anywidget whose traits the monitor thread sets (kernel side only).

It declares state and holds no logic beyond turning ``Run`` figures into plain lists: ``static/dashboard.js``
draws per-rank memory bars (measured vs the plan's prediction and the device limit), utilisation, the loss curve,
throughput, the status line, the last log lines per rank and a Stop button; at the end, measured vs predicted step
time and memory. Trait updates reach the browser while other cells run (see ../shared/notes/browser-testing.md).
"""

from __future__ import annotations

import threading
from pathlib import Path

import anywidget
import psutil
import traitlets

MAX_POINTS = 1000
"""loss/throughput points kept per curve: beyond it, every other point is dropped and the step stride doubles"""


class Curve:
    """A decimated (step, value) curve, built incrementally so a refresh costs O(new rows), not O(run length).

    Keeps the points whose step is a multiple of the current stride, plus the latest point; a step that is not
    newer than the last kept one (a restart redoing steps after its checkpoint) cuts the curve back to before it.
    """

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max_points
        self.stride = 1
        self.points: list[list[float]] = []
        self.last: list[float] | None = None

    def add(self, step: int, value: float) -> None:
        """Append one point (see the class docstring for redone steps)."""
        while self.points and self.points[-1][0] >= step:
            self.points.pop()
        if self.last is not None and self.last[0] >= step:
            self.last = None
        if step % self.stride == 0:
            self.points.append([step, value])
            if len(self.points) > self.max_points:
                self.stride *= 2
                self.points = [p for p in self.points if p[0] % self.stride == 0]
        self.last = [step, value]

    def values(self) -> list[list[float]]:
        """The points to draw, the latest one included."""
        if self.last is not None and (not self.points or self.points[-1][0] < self.last[0]):
            return [*self.points, self.last]
        return list(self.points)


class Dashboard(anywidget.AnyWidget):
    """Live view of one :class:`~autopar_nb.launch.run.Run` (``display(run)`` shows it)."""

    _esm = Path(__file__).parent.parent / "static" / "dashboard.js"
    status = traitlets.Unicode("starting").tag(sync=True)
    message = traitlets.Unicode("").tag(sync=True)
    error = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    """{"rank", "error", "traceback"} of the failed rank"""
    ranks = traitlets.List().tag(sync=True)
    """per rank: {"rank", "step", "attempt", "mem", "mem_kind", "mem_pred", "mem_limit", "util", "util_kind",
    "throughput", "power_w", "temperature_c", "log": [str]}"""
    loss = traitlets.Dict().tag(sync=True)
    """rank (str) -> [[step, loss], ...]"""
    throughput = traitlets.List().tag(sync=True)
    """[[step, value], ...] of rank 0"""
    throughput_unit = traitlets.Unicode("samples/s").tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    """at the end: measured vs predicted step time and peak memory"""

    def __init__(self, run, **kwargs):
        super().__init__(**kwargs)
        self._run = run
        self._total_ram = float(psutil.virtual_memory().total)
        self._seen = 0  # metrics rows already folded into the curves
        self._loss: dict[int, Curve] = {}
        self._rate = Curve()
        self._unit = "samples/s"
        self._refresh_lock = threading.Lock()
        self.on_msg(self._on_front_end_msg)
        run.add_listener(self.refresh)
        self.refresh(run)

    def _on_front_end_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("event") == "stop":
            # stopping takes a few seconds: do not hold the kernel's message loop meanwhile
            threading.Thread(target=self._run.stop, args=("Stop button",), daemon=True).start()

    def refresh(self, run=None) -> None:
        """Copy the run's current figures into the traits (called from the monitor thread)."""
        run = run or self._run
        cost = getattr(run.plan, "cost", None)
        pred = [m.total for m in cost.memory_by_rank] if cost is not None else []
        ranks = []
        for r, st in sorted(run.ranks().items()):
            last, sample = st.last, st.sample
            cuda = last.get("mem_peak") is not None or last.get("mem_allocated") is not None
            mem = last.get("mem_allocated") if cuda else (sample.get("rss") or last.get("rss"))
            limit = sample.get("gpu_mem_total") if "gpu_mem_total" in sample else (None if cuda else self._total_ram)
            util_kind = "gpu" if "gpu_util" in sample else "cpu"
            ranks.append({
                "rank": r, "step": st.step, "attempt": max(st.attempt, 0), "mem": mem,
                "mem_peak": last.get("mem_peak"), "mem_reserved": last.get("mem_reserved"),
                "mem_kind": "cuda" if cuda else "rss", "mem_pred": pred[r] if r < len(pred) else None,
                "mem_limit": limit, "gpu_mem_used": sample.get("gpu_mem_used"),
                "util": sample.get("gpu_util", sample.get("cpu_percent")), "util_kind": util_kind,
                "throughput": last.get("tokens_per_s", last.get("samples_per_s")),
                "power_w": sample.get("power_w"), "temperature_c": sample.get("temperature_c"), "log": st.log_tail,
            })
        with self._refresh_lock:  # the monitor thread and the constructor may both refresh
            new = run.rows_since(self._seen)
            self._seen += len(new)
            for row in new:
                if row.get("loss") is not None:
                    self._loss.setdefault(row["rank"], Curve()).add(row["step"], row["loss"])
                if "tokens_per_s" in row:
                    self._unit = "tokens/s"
                rate = row.get("tokens_per_s", row.get("samples_per_s"))
                if row["rank"] == 0 and rate is not None:
                    self._rate.add(row["step"], rate)
            with self.hold_sync():
                self.status, self.message, self.error = run.status, run.message, run.error
                self.ranks = ranks
                if new:
                    self.loss = {str(r): c.values() for r, c in sorted(self._loss.items())}
                    self.throughput = self._rate.values()
                    self.throughput_unit = self._unit
                if run.done:
                    self.summary = _summary(run)


def _summary(run) -> dict:
    s = run.summary()
    mem = s.get("memory_by_rank") or {}
    pred = s.get("predicted_memory_by_rank") or {}
    return {
        "step_time_s": s.get("step_time_s"), "predicted_step_time_s": s.get("predicted_step_time_s"),
        "peak_memory": max(mem.values()) if mem else None, "memory_kind": s.get("memory_kind"),
        "predicted_peak_memory": max(pred.values()) if pred else None, "steps": s.get("steps"),
    }
