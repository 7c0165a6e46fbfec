"""The kernel side's one monitor thread: reads the metrics channel, samples the devices, watches the
agent.

Devices are sampled at about 1 Hz: through NVML (nvidia-ml-py) when the run uses GPUs — utilisation,
memory used/total, power, temperature per GPU — else through psutil per worker process (CPU %, RSS).
The thread only updates the :class:`~autopar_nb.launch.run.Run` (under its lock) and calls its
listeners; it never touches widgets itself, the dashboard's listener does.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import psutil

from ..hardware import GpuInfo, visible_gpus
from ..runtime.metrics import peak_rss

if TYPE_CHECKING:
    from .run import Run

SAMPLE_INTERVAL_S = 1.0
"""seconds between device samples: tick k is taken at k * SAMPLE_INTERVAL_S after launch
(``Run.samples``)"""
PUSH_INTERVAL_S = 0.25
"""at most this often the listeners (the dashboard) hear about new data"""
BATCH_S = 0.05
"""the thread wakes at most this often while messages flow (they wait in the sockets meanwhile):
ranks stepping every few milliseconds would otherwise wake it, and preempt a worker, hundreds of
times a second"""


def batch_rest(woke: float) -> float:
    """Seconds left of the :data:`BATCH_S` pause that began at ``woke``: read from the clock once,
    never below zero (on a loaded host the time between two reads can pass the rest of the
    pause)."""
    return max(0.0, BATCH_S - (time.monotonic() - woke))


class DeviceSampler:
    """Samples GPUs through NVML when ``use_gpu`` and NVML works, else each worker process through
    psutil.

    ``env`` is the workers' environment (default: this process's): local rank k uses the k-th GPU
    its ``CUDA_VISIBLE_DEVICES`` names (indices, GPU-UUID prefixes or MIG instances, resolved by
    :func:`~autopar_nb.hardware.visible_gpus`), which need not be the kernel's."""

    def __init__(self, use_gpu: bool, env: dict[str, str] | None = None):
        self.nvml = None
        self.gpu_name = ""
        self.gpus: list[GpuInfo] = []
        if use_gpu:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = pynvml
                self.gpus = visible_gpus(dict(os.environ if env is None else env))
                name = pynvml.nvmlDeviceGetName(self.handle(0))
                self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:  # no driver / no permission: fall back to per-process figures
                pass
        self._procs: dict[int, psutil.Process] = {}

    def handle(self, local_rank: int):
        """NVML's handle of the GPU (or MIG instance) a local rank uses: by UUID for MIG instances
        (they have no index of their own), else by NVML index; local rank k when the visible GPUs
        are unknown."""
        nv = self.nvml
        gpu = self.gpus[local_rank] if local_rank < len(self.gpus) else None
        if gpu is not None and gpu.uuid.startswith("MIG-"):
            return nv.nvmlDeviceGetHandleByUUID(gpu.uuid)
        return nv.nvmlDeviceGetHandleByIndex(gpu.nvml_index if gpu is not None
                                             and gpu.nvml_index is not None else local_rank)

    def sample(self, workers: dict[int, psutil.Process]) -> dict[int, dict]:
        """rank -> {"cpu_percent", "rss", "rss_peak" (Linux VmHWM)} for every live worker, plus GPU
        fields ("gpu_util", "gpu_mem_used", "gpu_mem_total", "power_w", "temperature_c", and
        "gpu_proc_mem" — what the worker's own process holds on its GPU, when NVML reports it under
        the worker's PID) when NVML is on. Each GPU figure is read on its own: one NVML cannot give
        (a MIG instance has no utilisation or power of its own) leaves only that one out."""
        out: dict[int, dict] = {}
        for rank, proc in workers.items():
            try:
                cached = self._procs.get(proc.pid)
                fresh = cached is None or cached.create_time() != proc.create_time()
                if fresh:
                    self._procs[proc.pid] = cached = proc
                with cached.oneshot():
                    cpu = cached.cpu_percent(None)  # the first call only starts psutil's interval
                    if fresh:
                        cpu = cpu_since_start(cached)
                    out[rank] = {"cpu_percent": cpu, "rss": cached.memory_info().rss,
                                 "time": time.time(), "rss_peak": peak_rss(proc.pid)}
            except psutil.Error:
                continue
        if self.nvml is not None:
            for rank in list(out) or list(workers):
                proc = workers.get(rank)
                out.setdefault(rank, {}).update(self._gpu_figures(rank, proc.pid if proc is not None
                                                                  else None))
        return out

    def _gpu_figures(self, local_rank: int, pid: int | None) -> dict:
        """The NVML figures of one rank's GPU, each left out when NVML cannot give it."""
        nv = self.nvml
        try:
            h = self.handle(local_rank)
        except Exception:  # a GPU that stops answering: skip it this round
            return {}
        queries = {
            "gpu_util": lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
            "gpu_mem_used": lambda: float(nv.nvmlDeviceGetMemoryInfo(h).used),
            "gpu_mem_total": lambda: float(nv.nvmlDeviceGetMemoryInfo(h).total),
            "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
            "temperature_c": lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            "gpu_proc_mem": lambda: _process_memory(nv, h, pid),
        }
        d = {}
        for key, query in queries.items():
            try:
                value = query()
            except Exception:  # not supported on this device (MIG), or not available right now
                continue
            if value is not None:
                d[key] = value
        return d

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # already shut down
                pass


def _process_memory(nv, handle, pid: int | None) -> float | None:
    """Bytes the process ``pid`` holds on the GPU ``handle`` (its CUDA context included), by NVML's
    process list; None when NVML does not list that PID — in a container NVML reports host PIDs,
    which differ from ours."""
    if pid is None:
        return None
    procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    used = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory is not None]
    return float(sum(used)) if used else None


def cpu_since_start(proc: psutil.Process) -> float | None:
    """The process's CPU % (100 = one core) averaged since it started: its first reading, where
    psutil's ``cpu_percent`` has no interval yet."""
    try:
        t = proc.cpu_times()
        age = time.time() - proc.create_time()
    except psutil.Error:
        return None
    return 100.0 * (t.user + t.system) / age if age > 0.05 else None


class Monitor(threading.Thread):
    """Runs until the agent process has exited and the run is finalised."""

    def __init__(self, run: Run, *, sample: bool = True, nvml: bool | None = None):
        """``nvml``: sample this machine's GPUs (default: when the run uses NCCL; False for ranks on
        other hosts)."""
        super().__init__(daemon=True, name=f"autopar-monitor-{run.run_id[:8]}")
        self.run_ = run
        self.sample_devices = sample
        use_gpu = run.backend == "nccl" if nvml is None else nvml
        self.sampler = DeviceSampler(use_gpu, run.worker_env) if sample else None

    def run(self) -> None:
        r = self.run_
        last_push = 0.0
        pushed_status = None
        next_tick = 0
        if self.sampler is not None:
            r.gpu_name = self.sampler.gpu_name
        try:
            while True:
                woke = time.monotonic()
                wait = min(0.2, max(0.0, r._t0 + next_tick * SAMPLE_INTERVAL_S - woke))
                msgs = r._server.poll(wait) if r._server is not None else (time.sleep(wait) or [])
                rest = batch_rest(woke) if msgs else 0.0
                if rest > 0:  # let more arrive: one wake-up for many lines
                    time.sleep(rest)
                    msgs += r._server.poll(0)
                changed = r._ingest(msgs)
                if self.sampler is not None and any(m.kind == "hello" for m in msgs):
                    # a rank that says hello exists now: its figures at once, not at the next tick
                    # (warm ranks connect ~0.3 s after the call and may finish a short run within
                    # the first tick)
                    r._update_samples(self.sampler.sample(r._refresh_workers()))
                now = time.monotonic()
                tick = int((now - r._t0) / SAMPLE_INTERVAL_S)
                # a tick late by more than an interval is skipped, not made up
                if tick >= next_tick:
                    next_tick = tick + 1
                    r._check_attempt()
                    workers = r._refresh_workers()
                    if self.sampler is not None:
                        r._record_tick(tick, self.sampler.sample(workers))
                    r._read_log_tails()
                    changed = True
                r._check_hang()
                if r._agent_exited():
                    # the ranks' last lines may still be in flight: drain for a moment, then
                    # finalise
                    deadline = time.monotonic() + 0.3
                    while time.monotonic() < deadline and r._server is not None:
                        r._ingest(r._server.poll(0.05))
                    r._finalise()
                    break
                # a new status is pushed at once: a warm restart's "restarting" may last less than
                # the interval
                if changed and (now - last_push >= PUSH_INTERVAL_S or r._status != pushed_status):
                    last_push, pushed_status = now, r._status
                    r._notify()
        # the monitor must never die silently: the run would look alive forever
        except BaseException as e:
            try:
                r._monitor_crashed(e)
            except Exception:  # stop() ends what is left (Run._end_without_monitor)
                pass
        finally:
            if self.sampler is not None:
                self.sampler.close()
            # this thread's CPU time: the monitor's cost (bench/launch.py)
            r.monitor_cpu_s = time.thread_time()
            r._notify()
