"""The metrics client: one JSON line per step to the notebook's launcher, when one is listening."""

from __future__ import annotations

import contextlib
import json
import os
import socket

import torch


class Metrics:
    """One JSON line per record to the launcher at ``AUTOPAR_METRICS=host:port`` (after a hello line with
    ``AUTOPAR_TOKEN``); without those variables, nothing is sent."""

    def __init__(self, rank: int):
        self.sock = None
        address, token = os.environ.get("AUTOPAR_METRICS"), os.environ.get("AUTOPAR_TOKEN")
        if address and token:
            host, port = address.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=30)
            self.send({"token": token, "rank": rank})

    def send(self, record: dict) -> None:
        if self.sock is not None:
            try:
                self.sock.sendall((json.dumps(record) + "\n").encode())
            except OSError:  # the launcher went away: keep training
                self.sock = None


def memory_stats(device: str) -> dict:
    """Bytes: CUDA allocator figures on GPUs, and the process's resident set size (psutil, when installed)."""
    stats = {}
    if device == "cuda":
        stats = {"mem_allocated": torch.cuda.memory_allocated(), "mem_reserved": torch.cuda.memory_reserved(),
                 "mem_peak": torch.cuda.max_memory_allocated()}
    with contextlib.suppress(ImportError):
        import psutil

        stats["rss"] = psutil.Process().memory_info().rss
    return stats
