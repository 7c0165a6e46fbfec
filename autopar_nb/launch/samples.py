"""``Run.samples``: the run's time series, one row per rank and tick, each joining the rank's device
sample (the monitor's psutil or NVML reading) with what its step stream said last, and the watch's
events found in it.

:class:`RunSamples` is one side of :class:`~autopar_nb.launch.run.Run`, called from the monitor
thread.
"""

from __future__ import annotations

import time

import psutil

from . import watch
from .metrics import RankState
from .series import Timeline

SAMPLE_FIELDS = {
    "memory_bytes": "the rank's memory: on GPUs what its process holds by NVML's process list "
                    "('nvml'), else CUDA's reserved bytes from its last step ('cuda'), else the "
                    "memory used on its whole GPU by every process ('nvml-device'); on CPU its RSS "
                    "above rss_baseline_bytes ('psutil'; the raw RSS until the baseline is known; "
                    "'stream': the RSS its last step reported, for ranks whose process the "
                    "notebook cannot see, as in an attached run)",
    "utilization_pct": "NVML's SM utilisation on GPUs, else the process's CPU % (100 = one core)",
    "rss_bytes": "the process's resident set size (psutil, else what its last step reported)",
    "rss_baseline_bytes": "its RSS before the model was built (the exported script's "
                          "RSS_BEFORE_MODEL)",
    "rss_peak_bytes": "the process's peak RSS so far (Linux VmHWM): memory limits are held against "
                      "it, above the baseline, so a peak between two samples counts",
    "cuda_allocated_bytes": "torch.cuda.memory_allocated() at the rank's last step",
    "cuda_reserved_bytes": "torch.cuda.memory_reserved() at the rank's last step",
    "cuda_peak_bytes": "torch.cuda.max_memory_allocated() at the rank's last step",
    "nvml_used_bytes": "NVML: memory used on the rank's GPU (every process on it)",
    "nvml_process_bytes": "NVML: memory the rank's own process holds on its GPU, CUDA context "
                          "included (None where NVML lists the process under another PID, as in "
                          "containers)", "nvml_total_bytes": "NVML: the GPU's memory",
    "power_w": "NVML: board power", "temperature_c": "NVML: GPU temperature",
    "step": "the last step the rank reported", "loss": "the loss of that step",
    "step_time_s": "its step time",
    "samples_per_s": "its throughput (or tokens_per_s for token models)",
    "tokens_per_s": "its throughput in tokens",
    "data_wait_s": "the part of that step spent making and moving the batch",}
"""the numeric fields of ``Run.samples`` (None where unknown), besides ``t``, ``rank``, ``state``
and ``source``"""
STALE_SAMPLE_S = 1.5
"""a device sample this much older than the rank's last step predates it by more than a tick (its
process was not found since: it ended, or runs elsewhere): the RSS the step reported is shown
instead ("stream")"""


class RunSamples:
    """The run's time series and the watch over it, updated from the monitor thread under
    ``_lock``."""

    def _init_samples(self, nproc: int) -> None:
        """An empty time series: a column per sample field and rank."""
        self._timeline = Timeline(nproc, tuple(SAMPLE_FIELDS), ("state", "source"))
        self._tick = -1
        self._watch: watch.Watch | None = None

    def _record_tick(self, tick: int, samples: dict[int, dict]) -> None:
        """Tick ``tick`` (every SAMPLE_INTERVAL_S from launch): the device samples of each rank with
        what its step stream said last, into the time series."""
        t = time.monotonic() - self._t0
        with self._lock:
            self._update_samples(samples)
            if tick <= self._tick:
                return
            self._tick = tick
            rows = {r: self._sample_of(self._ranks[r]) for r in range(self.nproc)
                    if r in self._ranks}
            self._timeline.add(tick, t, rows)
            self.versions["timeline"] += 1
            self._watch_tick()

    def _update_samples(self, samples: dict[int, dict]) -> None:
        """The ranks' latest device samples (a rank not in ``samples`` keeps its last one)."""
        with self._lock:
            for rank, s in samples.items():
                self._ranks.setdefault(rank, RankState(rank)).sample = s

    def _sample_of(self, st: RankState) -> dict:
        s, last = st.sample, st.last
        d = {"state": st.state(self._status), "rss_bytes": s.get("rss"),
             "rss_baseline_bytes": st.baseline, "rss_peak_bytes": s.get("rss_peak"),
             "cuda_allocated_bytes": last.get("mem_allocated"),
             "cuda_reserved_bytes": last.get("mem_reserved"),
             "cuda_peak_bytes": last.get("mem_peak"), "nvml_used_bytes": s.get("gpu_mem_used"),
             "nvml_process_bytes": s.get("gpu_proc_mem"),
             "nvml_total_bytes": s.get("gpu_mem_total"), "power_w": s.get("power_w"),
             "temperature_c": s.get("temperature_c"),
             "utilization_pct": s.get("gpu_util", s.get("cpu_percent")),
             **{k: last.get(k)
                for k in ("step", "loss", "step_time_s", "samples_per_s", "tokens_per_s",
                          "data_wait_s")}}
        if s.get("gpu_proc_mem") is not None:
            d["source"], d["memory_bytes"] = "nvml", s["gpu_proc_mem"]
        elif last.get("mem_reserved") is not None:
            d["source"], d["memory_bytes"] = "cuda", last["mem_reserved"]
        # device-wide: every process on the GPU, until the rank reports
        elif s.get("gpu_mem_used") is not None:
            d["source"], d["memory_bytes"] = "nvml-device", s["gpu_mem_used"]
        # the fresher of psutil's and its step's
        elif s.get("rss") is not None or last.get("rss") is not None:
            stale = (last.get("rss") is not None
                     and (last.get("time") or 0.0) - (s.get("time") or 0.0) > STALE_SAMPLE_S)
            d["source"] = "psutil" if s.get("rss") is not None and not stale else "stream"
            rss = d["rss_bytes"] = s["rss"] if d["source"] == "psutil" else last["rss"]
            d["memory_bytes"] = max(0.0, rss - st.baseline) if st.baseline else rss
        else:
            d["source"] = None
        return d

    def _watch_tick(self) -> None:
        """New events from the samples, the ranks' failures and the plan's predictions (under
        ``_lock``)."""
        if self._watch is None:
            c = self.comparison()
            self._watch = watch.Watch(watch.settings_for(c,
                                                         memory_limit_bytes=c["memory_limit_bytes"],
                                                         enforce_limit=c["enforce_limit"],
                                                         memory_threshold=self.memory_threshold))
        errors = {r: st.error for r, st in self._ranks.items() if st.error}
        new = self._watch.update(self._timeline.samples(), errors=errors, steps=self._step_rows())
        self.events += new
        for e in new:
            if e.get("killed"):
                self._kill_rank(e["rank"])
        for hook in self._event_hooks:
            if new:
                hook(self, new)

    def _step_rows(self) -> list[dict]:
        """The step rows of the latest attempt, each with ``t`` (seconds since launch), for the
        watch (under ``_lock``)."""
        attempt = max((r["attempt"] for r in self._rows), default=0)
        return [{**r, "t": r["time"] - self.started} for r in self._rows if r["attempt"] == attempt]

    def _lifecycle(self, kind: str, reason: str, t: float | None = None) -> None:
        """An event of the run itself (launch, restart, its end) in ``events``, beside the watch's
        (the dashboard's timeline shows both); ``t``: seconds since launch (default: now)."""
        with self._lock:
            t = time.monotonic() - self._t0 if t is None else t
            self.events.append({"t": t, "kind": kind, "rank": None, "reason": reason})

    def _kill_rank(self, rank: int) -> None:
        """SIGKILL one worker (a rank above its memory limit, see watch.over_limit_events): torch's
        agent sees it die as the kernel's OOM killer would leave it."""
        proc = self._workers.get(rank)
        try:
            if proc is not None:
                proc.kill()
        except psutil.Error:  # already gone
            pass
