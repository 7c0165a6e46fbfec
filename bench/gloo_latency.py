"""What a blocking handoff between two real gloo processes costs on this machine, against the cost model's figures.

    .venv/bin/python bench/gloo_latency.py [--n 500]

``bench/overhead.py`` times the host's side of pipelining on PyTorch's fake process group, where a send returns at
once; the ``cpu`` preset's link (``hardware.LOOPBACK``) adds 50 us per message. Between real processes a pipeline's
``recv`` sleeps until the other rank has run and sent, so on cores shared with other processes each handoff also
waits for the scheduler to run the sender. This measures, on 2 spawned processes (one thread each, as the
launcher's workers run), the median and 90th percentile of a send + recv round trip of 16 floats (two handoffs),
and of an all-reduce of the same tensor, with the load average before and after: the figure that a per micro-batch
pipeline cost on a shared CPU host would come from, and how much it moves with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, port: int, n: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.zeros(16)
    for _ in range(20):  # the first collectives connect and warm up
        dist.all_reduce(x)
    round_trips, all_reduces = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        round_trips.append(time.perf_counter() - t0)
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        all_reduces.append(time.perf_counter() - t0)
    if rank == 0:
        out.put((round_trips, all_reduces))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=500, help="round trips (and all-reduces) timed")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    load = os.getloadavg()[0]
    port = 20000 + os.getpid() % 20000
    procs = [ctx.Process(target=worker, args=(r, port, args.n, out)) for r in range(2)]
    for p in procs:
        p.start()
    round_trips, all_reduces = out.get()
    for p in procs:
        p.join()
    for name, t in (("send + recv round trip", round_trips), ("all_reduce of 16 floats", all_reduces)):
        print(f"{name}: median {statistics.median(t) * 1e6:.0f} us, p90 {statistics.quantiles(t, n=10)[-1] * 1e6:.0f}"
              f" us ({len(t)} timed)")
    print(f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
