"""What a rank tells the notebook beside its printed lines, none of which training needs: one JSON
line per step to the launcher when one is listening (``AUTOPAR_METRICS``), stack dumps on SIGUSR1,
and verify's and measure's hooks (:class:`Run`); :func:`distributed` holds them around an exported
script's ``main``."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import signal
import socket
import sysconfig
import traceback

import torch
import torch.distributed as dist

from .mesh import init_distributed


class Metrics:
    """JSON lines to the launcher at ``AUTOPAR_METRICS`` (host:port) after a hello with
    ``AUTOPAR_TOKEN``; else none."""

    def __init__(self, rank: int, *, rss_before_model: int | None = None):
        address, token = os.environ.get("AUTOPAR_METRICS"), os.environ.get("AUTOPAR_TOKEN")
        self.sock = None
        if address and token:
            # a worker that cannot reach the notebook (on another host) trains on without streaming
            try:
                self.sock = socket.create_connection(tuple(address.rsplit(":", 1)), timeout=10)
            except (OSError, ValueError) as e:
                print(f"metrics: cannot reach AUTOPAR_METRICS={address} ({e}); training without it",
                      flush=True)
        # torchrun's restart count and limit, and the world size: a notebook attached from afar
        # follows restarts
        names = {"attempt": "TORCHELASTIC_RESTART_COUNT",
                 "max_restarts": "TORCHELASTIC_MAX_RESTARTS", "world": "WORLD_SIZE"}
        elastic = {k: int(os.environ[v]) for k, v in names.items()
                   if os.environ.get(v, "").isdigit()}
        self.send({"token": token, "rank": rank, **elastic})  # nothing is sent without a launcher
        # so a hang shows where every thread waits
        stacks = self.sock is not None and hasattr(signal, "SIGUSR1")
        if stacks:
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # to stderr; the rank goes on
        self.send({"event": "start", "pid": os.getpid(), "rss_before_model": rss_before_model,
                   "stacks": stacks})

    def send(self, record: dict) -> None:
        if self.sock is not None:
            try:
                self.sock.sendall((json.dumps(record) + "\n").encode())
            except OSError:  # the launcher went away: keep training
                self.sock = None


def process_rss() -> int | None:
    """Bytes this process holds in RAM now (Linux; else None). Runs before the cell's imports:
    imports ``os`` itself."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss(pid: int | str = "self") -> float | None:
    """The process's peak resident set size so far (Linux: ``VmHWM`` in ``/proc/PID/status``),
    bytes; None elsewhere. Between two samples a step's activations may come and go: the peak does
    not miss them."""
    try:
        with open(f"/proc/{pid}/status") as f:
            # kB
            return next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def memory_stats(device: str) -> dict:
    """Bytes: CUDA allocator figures on GPUs (allocated and reserved, now and at their peaks); on
    CPU the process's resident set size and its peak so far (each None where unknown: the peak rides
    on every step's report, so a short run whose monitor sampled it rarely still knows it)."""
    if device == "cuda":
        return {"mem_allocated": torch.cuda.memory_allocated(),
                "mem_reserved": torch.cuda.memory_reserved(),
                "mem_peak": torch.cuda.max_memory_allocated(),
                "mem_peak_reserved": torch.cuda.max_memory_reserved(), "rss": process_rss()}
    return {"rss": process_rss(), "rss_peak": peak_rss()}


class Run:
    """The notebook's view of this process's run, kept out of the exported script's text: the
    metrics stream of the open :func:`distributed` block (``current``) and an in-process
    observer."""

    current = None
    """the :class:`Metrics` of the open :func:`distributed` block (None outside one)"""
    observer = None
    """``after_backward(step, parts, loss)`` and ``after_step(step, parts)``, which :func:`train`
    calls on every rank: set on the class by verify and measure, which call a script's ``main`` in
    their own processes"""


def failure_line(e: BaseException, rank: int) -> str:
    """A rank's failure in one line: where in the user's code (the innermost frame outside torch,
    the standard library, installed packages and this runtime, else outside the libraries) and the
    error's first line."""
    libs = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    tb = e.__traceback__
    frames = [(s, fr.f_globals)
              for s, (fr, _) in zip(traceback.extract_tb(tb), traceback.walk_tb(tb), strict=True)
              if not s.filename.startswith(libs)]
    # the runtime's own frames: the package's runtime modules, or the exported runtime (whose
    # globals hold this function); the frames that call into the user's code (verify's, launch's)
    # are outer ones and not the last
    ours = [s for s, g in frames if g.get("failure_line") is not failure_line and
            not (g.get("__name__") or "").startswith("autopar_nb.runtime")]
    where = "".join(f" at {os.path.basename(s.filename)} line {s.lineno} in {s.name}"
                    + (f" (`{s.line}`)" if s.line
                                                                                          else "")
                    for s in (ours or [s for s, _ in frames])[-1:])
    return (f"rank {rank} failed{where}: {type(e).__name__}: "
            f"{(str(e).strip().splitlines() or [''])[0]}")


@contextlib.contextmanager
def distributed():
    """``with distributed() as device:`` the process group of torchrun's environment (gloo without a
    GPU) around an exported script's ``main``, and its report to the notebook when
    ``AUTOPAR_METRICS`` is set (:class:`Metrics`): the memory before the model, each step, an error
    raised in the block (raised again), the end. A process group that was open before (verify runs
    several scripts in one) is left open."""
    owns_group = not dist.is_initialized()
    rss = process_rss()  # before the model is built: the launcher's memory chart counts above it
    device = init_distributed()
    metrics = Run.current = Metrics(dist.get_rank(), rss_before_model=rss)
    try:
        yield device
    except BaseException as e:
        metrics.send({"event": "error", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()})
        # the last line of the rank's traceback, and of the one torchrun's report quotes
        if hasattr(e, "add_note"):
            e.add_note(failure_line(e, dist.get_rank()))
        raise
    finally:
        Run.current = None
    metrics.send({"event": "done"})
    if owns_group:
        gc.collect()  # before destroy: a gloo thread taking the GIL at exit can abort the process
        dist.destroy_process_group()
