"""The metrics client: one JSON line per step to the notebook's launcher, when one is listening."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket

import torch


class Metrics:
    """JSON lines to the launcher at ``AUTOPAR_METRICS`` (host:port) after a hello with ``AUTOPAR_TOKEN``; else none."""

    def __init__(self, rank: int, *, rss_before_model: int | None = None):
        address, token = os.environ.get("AUTOPAR_METRICS"), os.environ.get("AUTOPAR_TOKEN")
        self.sock = None
        if address and token:
            try:  # a worker that cannot reach the notebook (on another host) trains on without streaming
                self.sock = socket.create_connection(tuple(address.rsplit(":", 1)), timeout=10)
            except (OSError, ValueError) as e:
                print(f"metrics: cannot reach AUTOPAR_METRICS={address} ({e}); training without it", flush=True)
        # torchrun's restart count and limit, and the world size: a notebook attached from afar follows restarts
        names = {"attempt": "TORCHELASTIC_RESTART_COUNT", "max_restarts": "TORCHELASTIC_MAX_RESTARTS",
                 "world": "WORLD_SIZE"}
        elastic = {k: int(os.environ[v]) for k, v in names.items() if os.environ.get(v, "").isdigit()}
        self.send({"token": token, "rank": rank, **elastic})  # nothing is sent without a launcher
        stacks = self.sock is not None and hasattr(signal, "SIGUSR1")  # so a hang shows where every thread waits
        if stacks:
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # to stderr; the rank goes on
        self.send({"event": "start", "pid": os.getpid(), "rss_before_model": rss_before_model, "stacks": stacks})

    def send(self, record: dict) -> None:
        if self.sock is not None:
            try:
                self.sock.sendall((json.dumps(record) + "\n").encode())
            except OSError:  # the launcher went away: keep training
                self.sock = None


def process_rss() -> int | None:
    """Bytes this process holds in RAM now (Linux; else None). Runs before the cell's imports: imports ``os`` itself."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_stats(device: str) -> dict:
    """Bytes: CUDA allocator figures on GPUs (allocated and reserved, now and at their peaks), and the process's
    resident set size (None where unknown)."""
    stats = {}
    if device == "cuda":
        stats = {"mem_allocated": torch.cuda.memory_allocated(), "mem_reserved": torch.cuda.memory_reserved(),
                 "mem_peak": torch.cuda.max_memory_allocated(), "mem_peak_reserved": torch.cuda.max_memory_reserved()}
    return {**stats, "rss": process_rss()}
