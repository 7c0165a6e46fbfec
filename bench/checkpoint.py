"""The training stall per checkpoint save, synchronous (``save_checkpoint``) vs asynchronous (``AsyncCheckpointer``,
``dcp.async_save``), on 2 gloo processes on this machine (autopar_nb/runtime/checkpoint.py).

A DDP MLP (default 12 layers of 2048 x 2048: 50 M parameters, 201 MB of weights, 604 MB with AdamW's two moments per
rank) trains ``--steps`` steps with a save every ``--every``; each mode runs in fresh processes. Per save: the stall,
the time the training loop is held by the save call (synchronous: the whole save, files, checksums and manifest;
asynchronous: the staging copy of the rank's state into host memory, plus any wait for the save before it). Also
the mean step time with no save in flight and with one written in the background (the writer's CPU time is taken
from training on this 2-core machine), the wall time of the whole run (beside a run without saves: "none"), and each
rank's peak RSS (the staging copy's cost in host memory). The slowest rank's figures.

    PYTHONPATH=. .venv/bin/python bench/checkpoint.py [--width 2048] [--layers 12] [--steps 16] [--every 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autopar_nb.runtime.checkpoint import AsyncCheckpointer, save_checkpoint


def worker(rank: int, world: int, port: int, mode: str, a: argparse.Namespace, ckpt_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, a.width)
    saver = AsyncCheckpointer() if mode == "async" else None
    stalls, quiet, busy = [], [], []
    writing = False  # an async save may be in flight (until the next save or the end)
    t_run = time.perf_counter()
    for step in range(a.steps):
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        (busy if writing else quiet).append(time.perf_counter() - t0)
        if (step + 1) % a.every == 0 and mode != "none":
            t0 = time.perf_counter()
            path = f"{ckpt_dir}/step_{step + 1}"
            error = saver.save(path, model, opt, step + 1) if saver else save_checkpoint(path, model, opt, step + 1)
            assert error is None, error
            stalls.append(time.perf_counter() - t0)
            writing = saver is not None
    t0 = time.perf_counter()
    assert saver is None or saver.close() is None
    final_wait = time.perf_counter() - t0
    figures = {"stall": statistics.median(stalls) if stalls else 0.0, "quiet": statistics.mean(quiet[1:]),
               "busy": statistics.mean(busy) if busy else float("nan"), "final_wait": final_wait,
               "wall": time.perf_counter() - t_run, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "state": sum(t.nbytes for t in model.state_dict().values())
               + sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))}
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        worst = {k: max(g[k] for g in gathered) for k in figures}
        print(f"{mode:5} | stall per save {worst['stall']:.2f} s (median of {len(stalls)}) | step "
              f"{worst['quiet']:.3f} s before the first save, {worst['busy']:.3f} s after (a save may be in "
              f"flight) | last save's wait at the end {worst['final_wait']:.2f} s | run {worst['wall']:.1f} s | "
              f"peak RSS {worst['rss'] / 2**20:.0f} MiB, rank state {worst['state'] / 2**20:.0f} MiB", flush=True)
    import gc

    gc.collect()  # before destroy: a gloo thread taking the GIL at exit can abort the process
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    a = p.parse_args()
    n = a.layers * (a.width * a.width + a.width)
    print(f"`PYTHONPATH=. .venv/bin/python bench/checkpoint.py --width {a.width} --layers {a.layers} --steps "
          f"{a.steps} --every {a.every}` on {platform.machine()} ({os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}), torch {torch.__version__}, 2 gloo processes, DDP, {n / 1e6:.1f} M parameters "
          f"({n * 4 / 1e6:.0f} MB), AdamW, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    for mode in ("none", "sync", "async"):
        ckpt_dir = tempfile.mkdtemp(prefix="ckpt_bench_", dir=a.dir)
        try:
            mp.spawn(worker, args=(2, 29000 + (os.getpid() + len(mode)) % 1000, mode, a, ckpt_dir), nprocs=2)
        finally:
            shutil.rmtree(ckpt_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
