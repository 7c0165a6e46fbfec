"""Bounded per-rank series of a run: device samples over time (:class:`Timeline`) and step figures
by step (:class:`StepSeries`).

Both keep at most ``max_points`` x values. When full, every other one is dropped and the stride
doubles (ticks or steps kept are the multiples of the stride), so an hour-long run costs what a
15-minute one does; the latest point is always kept, as a provisional one that the next point
replaces unless it falls on the stride. Columns are ``array('d')`` with NaN for "no value": cheap to
append, and handed to the front end as float32 bytes.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

NAN = float("nan")
MAX_POINTS = 1000
"""x values kept per series"""


def _num(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else NAN


def _val(v: float):
    """A stored float as a plain value: NaN -> None, whole numbers -> int."""
    if math.isnan(v):
        return None
    return int(v) if v.is_integer() and abs(v) < 2**53 else v


def float32_bytes(*columns: array) -> bytes:
    """``array('d')`` columns, one after the other, as float32 bytes in machine order (NaN stays
    NaN)."""
    try:
        import numpy as np
    except ImportError:  # 30x slower, same bytes
        return b"".join(array("f", c).tobytes() for c in columns)
    return b"".join(np.frombuffer(c, dtype=np.float64).astype(np.float32).tobytes() for c in columns
                    if len(c))


class Timeline:
    """Per-rank samples taken together at ticks of a fixed interval: numeric ``fields`` and text
    ``labels``."""

    def __init__(self, nranks: int, fields: tuple[str, ...], labels: tuple[str, ...] = (), *,
                 max_points: int = MAX_POINTS):
        self.nranks, self.fields, self.labels, self.max_points = nranks, fields, labels, max_points
        self.stride = 1
        self.ticks = array("q")
        """tick numbers (0, 1, 2, ... from launch) of the kept samples"""
        self.t = array("d")
        """seconds since launch of each kept tick"""
        self.cols = {f: [array("d") for _ in range(nranks)] for f in fields}
        self.text: dict[str, list[list]] = {k: [[] for _ in range(nranks)] for k in labels}
        self._provisional = False

    def __len__(self) -> int:
        return len(self.t)

    def add(self, tick: int, t: float, per_rank: dict[int, dict]) -> None:
        """One tick: ``per_rank[rank]`` holds the fields and labels of that rank (missing ones are
        NaN / None)."""
        if self._provisional:
            self._pop()
        self.ticks.append(tick)
        self.t.append(t)
        for r in range(self.nranks):
            d = per_rank.get(r) or {}
            for f in self.fields:
                self.cols[f][r].append(_num(d.get(f)))
            for k in self.labels:
                self.text[k][r].append(d.get(k))
        self._provisional = tick % self.stride != 0
        if len(self.t) - self._provisional > self.max_points:
            self._decimate()

    def set(self, field: str, rank: int, values: Iterable[float]) -> None:
        """Replace one rank's column (e.g. memory recomputed once a baseline is known)."""
        self.cols[field][rank] = array("d", values)

    def _pop(self) -> None:
        self.ticks.pop()
        self.t.pop()
        for cols in self.cols.values():
            for c in cols:
                c.pop()
        for rows in self.text.values():
            for c in rows:
                c.pop()

    def _decimate(self) -> None:
        self.stride *= 2
        last = len(self.t) - 1
        keep = [i for i, k in enumerate(self.ticks) if k % self.stride == 0 or i == last]
        self._provisional = self.ticks[last] % self.stride != 0
        self.ticks = array("q", (self.ticks[i] for i in keep))
        self.t = array("d", (self.t[i] for i in keep))
        for f, cols in self.cols.items():
            self.cols[f] = [array("d", (c[i] for i in keep)) for c in cols]
        for k, rows in self.text.items():
            self.text[k] = [[c[i] for i in keep] for c in rows]

    def samples(self) -> list[dict]:
        """One plain dict per (tick, rank), in time order: ``{"t", "rank", <field or label>: value
        or None}``."""
        out = []
        for i, t in enumerate(self.t):
            for r in range(self.nranks):
                d = {"t": round(t, 3), "rank": r}
                for k in self.labels:
                    d[k] = self.text[k][r][i]
                for f in self.fields:
                    d[f] = _val(self.cols[f][r][i])
                out.append(d)
        return out


class StepSeries:
    """Per-rank figures by step: one row per kept step, one column per (field, rank). Ranks report
    the same step at slightly different times, so a row is made by the first rank that reports its
    step and filled by the others; a rank reporting a step whose row was dropped (decimated away) is
    ignored. A restart (a higher attempt) redoes the steps after its checkpoint: the rows from its
    first step on are cut first."""

    def __init__(self, nranks: int, fields: tuple[str, ...], *, max_points: int = MAX_POINTS):
        self.nranks, self.fields, self.max_points = nranks, fields, max_points
        self.stride = 1
        self.x = array("d")
        self.cols = {f: [array("d") for _ in range(nranks)] for f in fields}
        self.attempt = 0

    def __len__(self) -> int:
        return len(self.x)

    def add(self, rank: int, step: int, attempt: int, values: dict) -> None:
        """One rank's figures at ``step`` of restart ``attempt``."""
        if attempt > self.attempt:
            self.attempt = attempt
            self._cut(step)
        elif attempt < self.attempt or not 0 <= rank < self.nranks:
            return  # a late line of an attempt that has been restarted
        if not self.x or step > self.x[-1]:
            if self.x and self.x[-1] % self.stride != 0:
                self._cut(self.x[-1])  # the provisional last row makes way
            self.x.append(step)
            for cols in self.cols.values():
                for c in cols:
                    c.append(NAN)
            if len(self.x) - (step % self.stride != 0) > self.max_points:
                self._decimate()
        i = len(self.x) - 1
        while i >= 0 and self.x[i] > step:
            i -= 1
        if i < 0 or self.x[i] != step:
            return
        for f in self.fields:
            self.cols[f][rank][i] = _num(values.get(f))

    def _cut(self, step: float) -> None:
        """Drop the rows of ``step`` and after."""
        n = len(self.x)
        while n and self.x[n - 1] >= step:
            n -= 1
        del self.x[n:]
        for cols in self.cols.values():
            for c in cols:
                del c[n:]

    def _decimate(self) -> None:
        self.stride *= 2
        last = len(self.x) - 1
        keep = [i for i, s in enumerate(self.x) if s % self.stride == 0 or i == last]
        self.x = array("d", (self.x[i] for i in keep))
        for f, cols in self.cols.items():
            self.cols[f] = [array("d", (c[i] for i in keep)) for c in cols]

    def curve(self, field: str, rank: int) -> list[tuple[int, float]]:
        """(step, value) of one rank where it has a value."""
        return [(int(s), v) for s, v in zip(self.x, self.cols[field][rank], strict=True)
                if not math.isnan(v)]
