"""What the numerics guard (autopar_nb/runtime/guard.py) costs per step, on 2 gloo processes on this machine.

Per step the guard adds, after the backward: the check that this rank's gradients are finite (their 2-norm; with
gradient clipping on, the clipping's own norm is used instead and this part is free) and one all-reduce of three
flags with its ``.tolist()``. Both are timed here beside a whole training step (forward, backward, DDP's all-reduce,
AdamW) of an MLP, as the median of many repetitions on every rank, the slowest rank's reported.

    PYTHONPATH=. .venv/bin/python bench/numerics_guard.py [--width 1024] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autopar_nb.runtime.guard import NumericsGuard, grads_finite


def median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(rank: int, world: int, port: int, width: int, layers: int, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    x = torch.randn(32, width)
    guard = NumericsGuard(spike_factor=5.0, max_skips=5)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept (zeroed): the guard's check reads them

    for _ in range(3):
        step()
    model(x).pow(2).mean().backward()  # gradients to check
    figures = {"step_s": median_s(step, reps),
               "grads_finite_s": median_s(lambda: grads_finite(params), reps * 5),
               "verdict_s": median_s(lambda: guard.verdict(1.0, grads_ok=True, device="cpu"), reps * 5)}
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        worst = {k: max(g[k] for g in gathered) for k in figures}
        guard_s = worst["grads_finite_s"] + worst["verdict_s"]
        n, load = sum(p.numel() for p in params), os.getloadavg()[0]
        print(f"`PYTHONPATH=. .venv/bin/python bench/numerics_guard.py --width {width} --layers {layers}` on "
              f"{platform.machine()} ({os.cpu_count()} CPUs, load {load:.1f}), torch {torch.__version__}, "
              f"{world} gloo processes, {n / 1e6:.1f} M parameters, batch 32, {time.strftime('%Y-%m-%d')}")
        print(f"step {worst['step_s'] * 1e3:.2f} ms | gradient check {worst['grads_finite_s'] * 1e6:.0f} us | "
              f"flag all-reduce {worst['verdict_s'] * 1e6:.0f} us | guard {guard_s * 1e6:.0f} us = "
              f"{guard_s / worst['step_s']:.1%} of the step")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=40)
    a = p.parse_args()
    mp.spawn(worker, args=(2, 29000 + os.getpid() % 1000, a.width, a.layers, a.reps), nprocs=2)


if __name__ == "__main__":
    main()
