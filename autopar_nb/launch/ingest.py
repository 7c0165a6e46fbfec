"""What a run knows from its metrics stream: each rank's hello, start, steps, data verdict, error,
"done" and closed connection, turned into per-rank state (``metrics.RankState``), the metrics rows,
the step series, the run's error and the status they imply.

:class:`StreamIngest` is one side of :class:`~autopar_nb.launch.run.Run`: the monitor thread calls
``_ingest`` with each batch the channel read; ``AttachedRun`` overrides the ``_on_*`` hooks for
ranks on other hosts.
"""

from __future__ import annotations

import time

from . import logfiles, watch
from .failure import failure_order
from .metrics import MetricsTable, RankState, step_row
from .series import StepSeries

TERMINAL = ("finished", "failed", "stopped", "hung")
"""the statuses a run ends in"""
MAX_ROWS = 100_000
"""metrics rows kept; beyond, every other step is dropped (the stride doubles), as the series are
decimated"""
STEP_FIELDS = ("loss", "step_time_s", "throughput", "data_wait_s")


class StreamIngest:
    """The run's state as its ranks' messages tell it, updated from the monitor thread under
    ``_lock``."""

    def _init_stream(self, nproc: int) -> None:
        """The state the stream fills: every rank's, the rows and the step series."""
        self._rows = MetricsTable()
        self._ranks = {r: RankState(r) for r in range(nproc)}
        self._steps = StepSeries(nproc, STEP_FIELDS)
        self._rows_stride = 1

    def _ingest(self, msgs: list) -> bool:
        """Take the channel's messages (hello / step / done / error); True when there were any."""
        if not msgs:
            return False
        now = time.monotonic()
        with self._lock:
            # a connection that closes in this batch without its rank's "done" is a death seen now:
            # known before another rank's error in the same batch is judged (that error may be its
            # consequence)
            finished = {m.rank for m in msgs if m.kind == "data" and m.data.get("event") == "done"}
            for m in msgs:
                if m.kind == "closed" and m.rank not in finished:
                    self._on_closed(self._ranks.setdefault(m.rank, RankState(m.rank)), m.time)
            for m in msgs:
                st = self._ranks.setdefault(m.rank, RankState(m.rank))
                if m.kind == "hello":
                    self._on_hello(st, m.data, now)
                elif m.kind == "closed":
                    self._on_closed(st, m.time)
                elif m.kind != "data":
                    continue
                # the guard's, a failed save (before: they name a step)
                elif m.data.get("event") in watch.RANK_EVENTS:
                    self.events.append(watch.rank_event(m.data, rank=m.rank,
                                                        t=m.time - self.started))
                elif isinstance(m.data.get("step"), int):
                    self._on_step(st, m.data, m.time, now)
                elif m.data.get("event") == "done":
                    st.done = True
                elif m.data.get("event") == "error":
                    self._on_error(st, m.data, m.time, now)
                elif m.data.get("event") == "start":
                    self._on_start(st, m.data)
                elif m.data.get("event") == "data":
                    self._on_data(m.data)
        return True

    def _on_hello(self, st: RankState, data: dict, now: float) -> None:
        # the attempt the rank says it is in (torch's TORCHELASTIC_RESTART_COUNT), else the agent's
        # latest
        att = data.get("attempt")
        latest = self._latest_attempt()
        att = (att if isinstance(att, int) and not isinstance(att, bool) else latest if latest >= 0
               else st.attempt + 1)
        # a restart restarts the whole group: every rank still in an older attempt starts over; the
        # first rank of the new attempt to speak makes the status "restarting" (until the attempt's
        # first step)
        first_back = att > 0 and len(self._behind(att, now)) == len(self._ranks)
        st.attempt = att
        st.last_progress, st.done, st.connected = now, False, True
        if (first_back or self._status in ("starting", "restarting")) and st.attempt > 0:
            self._set_status("restarting", f"restart {st.attempt}: rank {st.rank} reconnected")

    def _behind(self, attempt: int, now: float) -> list[RankState]:
        """Ranks not yet in restart ``attempt`` start over (under ``_lock``): what they reported in
        the old attempt (steps, errors) is history, and the hang check gives them their start-up
        allowance again."""
        behind = [st for st in self._ranks.values() if st.attempt < attempt]
        for st in behind:
            st.last_progress, st.connected, st.done = now, False, False
            st.error = st.failed_at = st.closed_at = None
            st.step, st.last = None, {}
        return behind

    def _on_start(self, st: RankState, data: dict) -> None:
        """The rank's RSS before it built its model: its memory is counted above it, the samples so
        far included. And whether it prints its stacks on SIGUSR1."""
        st.dumps_stacks = data.get("stacks") is True
        base = data.get("rss_before_model")
        if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
            return
        st.baseline = float(base)
        tl = self._timeline
        if st.rank < tl.nranks:
            rss, src = tl.cols["rss_bytes"][st.rank], tl.text["source"][st.rank]
            tl.set("rss_baseline_bytes", st.rank, [st.baseline] * len(tl))
            tl.set("memory_bytes", st.rank,
                   [max(0.0, v - st.baseline) if k == "psutil" else m
                    for v, k, m in zip(rss, src, tl.cols["memory_bytes"][st.rank], strict=True)])
            self.versions["timeline"] += 1

    def _on_data(self, data: dict) -> None:
        """The data-wait verdict (``runtime/train.py`` ``data_summary``: every rank sends the same,
        the slowest rank's share): kept when well-formed, the message cut to 500 characters."""
        share, bottleneck, text = (data.get("data_wait_share"), data.get("bottleneck"),
                                   data.get("message"))
        if isinstance(share, (int, float)) and not isinstance(share, bool) and 0.0 <= share <= 1.0 \
                and isinstance(bottleneck, bool) and isinstance(text, str):
            self.data = {"share": float(share), "bottleneck": bottleneck, "message": text[:500]}

    def _on_step(self, st: RankState, data: dict, sent: float, now: float) -> None:
        row = step_row(st.rank, max(st.attempt, 0), data, sent)
        if data["step"] % self._rows_stride == 0:
            self._rows.append(row)
            if len(self._rows) > MAX_ROWS:
                self._rows_stride *= 2
                self._rows[:] = [r for r in self._rows if r["step"] % self._rows_stride == 0]
        st.step, st.last, st.last_progress = data["step"], row, now
        st.peak_rss = max(st.peak_rss, float(row.get("rss") or 0.0),
                          float(row.get("rss_peak") or 0.0))
        if "tokens_per_s" in row:
            self.throughput_unit = "tokens/s"
        self._steps.add(st.rank, row["step"], row["attempt"], {
            "loss": row.get("loss"), "step_time_s": row.get("step_time_s"),
            "data_wait_s": row.get("data_wait_s"),
            "throughput": row.get("tokens_per_s", row.get("samples_per_s"))})
        self.versions["steps"] += 1
        if self.first_step_time is None:
            self.first_step_time = now - self._t0
        if self._status in ("starting", "restarting"):
            self._set_status("running", "running")
        if self._status == "running":
            total = f"/{self.steps}" if self.steps else ""
            self._message = f"running: step {self._current_step()}{total}"

    def _current_step(self) -> int:
        """The highest step reported in the latest attempt any rank is in (a restart starts the
        count again)."""
        attempt = max(s.attempt for s in self._ranks.values())
        return max((s.step for s in self._ranks.values() if s.attempt == attempt
                    and s.step is not None), default=0)

    def _on_error(self, st: RankState, data: dict, sent: float, now: float) -> None:
        st.error = logfiles.reported_error(data)
        st.failed_at = sent
        # a peer whose connection closed without a word before this error died first (a signal, a
        # crash in C++)
        for other in self._ranks.values():
            if other.error is None and other.closed_at is not None and not other.done:
                other.error = {"error": "its process ended without reporting an error (killed by a "
                                        "signal, or a crash outside Python): see its exit code and "
                                        "log", "traceback": ""}
                other.failed_at = other.closed_at
        self._update_error()
        e = self._error
        if st.attempt >= self.max_restarts:  # no restart left: this is the run's failure
            self._error_time = now
            self._set_status("failed", f"rank {e['rank']} failed: {e['error']}")
        else:
            self._set_status("restarting", f"rank {e['rank']} failed ({e['error']}); restarting")

    def _on_closed(self, st: RankState, when: float) -> None:
        """A rank's connection closed: normal after its "done", a sign of death otherwise (unless
        the run is being stopped, or has ended)."""
        st.connected = False
        if (not st.done and st.error is None and st.closed_at is None
                and self._stop_reason in (None, "failure")
                and self._status not in ("stopped", "hung")):
            st.closed_at = when

    def _update_error(self) -> None:
        """``error`` from the ranks' failures: the first one (see failure.py), with the others as
        consequences."""
        order = failure_order(self._ranks)
        if not order:
            return
        cause = self._ranks[order[0]]
        t0 = cause.failed_at or self.started
        self._error = {"rank": cause.rank, "attempt": max(cause.attempt, 0), **cause.error,
                       "time_s": t0 - self.started,
                       "knock_on": [{"rank": r, "error": self._ranks[r].error["error"],
                                     "after_s": (self._ranks[r].failed_at or t0) - t0}
                                    for r in order[1:]]}

    def _set_status(self, status: str, message: str) -> None:
        if self._status in TERMINAL and status not in TERMINAL:
            return
        self._status, self._message = status, message
