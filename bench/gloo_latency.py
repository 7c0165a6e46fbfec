"""What a blocking handoff between two real gloo processes costs on this machine, against the cost model's figures.

    .venv/bin/python bench/gloo_latency.py [--n 300] [--steps 30] [--stages 2]

``bench/overhead.py`` times the host's side of pipelining on PyTorch's fake process group, where a send returns at
once. Between real processes a pipeline's ``recv`` sleeps until the other rank has run and sent, so on cores shared
with other processes each handoff also waits for the scheduler to run the sender. This measures, on 2 spawned
processes (``--stages``: as many; one thread each, as the launcher's workers run), with the load average before
and after:

1. a send + recv round trip (two handoffs) for the sizes a small CPU pipeline sends, 16 floats to 1 MiB (median and
   90th percentile; half a round trip is one handoff), between ranks 0 and 1, and an all-reduce of 16 floats;
2. torch's ``Schedule1F1B`` over ``--stages`` stages, one per process (``torch.distributed.pipelining``, as
   ``runtime/pp.py`` builds it) over a fixed batch split into 2, 4, 8 and 16 micro-batches (those of at least one
   per stage), timed in turn round after round: the median step time against n, its least-squares slope (what one
   more micro-batch costs a step), and the same slope of each rank running its own stage alone (forward, backward,
   no schedule, no sends): the difference is what the schedule and its handoffs add per micro-batch, the ``cpu``
   preset's ``cpu_pp_microbatch_s`` + ``pp_handoff_s`` (``autopar_nb/cost/factors.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar_nb.cost.factors import CPU_PP_HANDOFF_S, DEFAULT

SIZES = (16, 2048, 16384, 262144)
"""floats per message: a few bytes, a micro-batch of 32 x 64 activations, 256 x 64, 1 MiB"""
MICRO_BATCHES = (2, 4, 8, 16)
BATCH, WIDTH, LAYERS = 64, 64, 2
"""the pipeline's global batch (rows), its width and the Linear + ReLU pairs per stage: a small model, so that
compute does not hide the per micro-batch cost"""


def round_trips(rank: int, x: torch.Tensor, n: int) -> list[float]:
    """Seconds of ``n`` send + recv round trips of ``x`` between ranks 0 and 1, timed on rank 0."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        out.append(time.perf_counter() - t0)
    return out


def stage_module(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])


def interleaved_medians(fns: dict, steps: int) -> dict:
    """{key: median seconds of ``fns[key]()``} over ``steps`` rounds after 3 of warm-up, each round calling every
    function once (so that the load's drift over the run falls on all of them alike), each call started together
    on both ranks (a barrier before it, not timed)."""
    times = {k: [] for k in fns}
    for i in range(steps + 3):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


def pipeline_times(rank: int, stages: int, steps: int) -> tuple[dict[int, float], dict[int, float]]:
    """({n: median seconds of a 1F1B step with n micro-batches}, {n: the same rank's stage run alone n times}),
    each step as slow as its slowest rank (the maximum over the ``stages`` ranks)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    module = stage_module(rank)
    batch = torch.randn(BATCH, WIDTH)
    fns = {}
    counts = micro_batch_counts(stages)
    for n in counts:
        schedule = Schedule1F1B(PipelineStage(module, rank, stages, torch.device("cpu")), n,
                                loss_fn=lambda out, target: out.sum())

        def step(schedule=schedule):
            if rank == 0:
                schedule.step(batch)
            elif rank == stages - 1:
                schedule.step(target=batch)
            else:
                schedule.step()

        def local(n=n):
            for mb in batch.chunk(n):
                module(mb.requires_grad_()).sum().backward()
        fns["1f1b", n], fns["alone", n] = step, local
    t = interleaved_medians(fns, steps)
    both = torch.tensor([[t["1f1b", n], t["alone", n]] for n in counts], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return ({n: float(both[i, 0]) for i, n in enumerate(counts)}, {n: float(both[i, 1]) for i, n in enumerate(counts)})


def micro_batch_counts(stages: int) -> list[int]:
    """The micro-batch counts timed: torch's 1F1B needs at least one micro-batch per stage."""
    return [n for n in MICRO_BATCHES if n >= stages]


def worker(rank: int, stages: int, port: int, n: int, steps: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=stages)
    small = torch.zeros(16)
    for _ in range(20):  # the first collectives connect and warm up
        dist.all_reduce(small)
    trips = {size: round_trips(rank, torch.zeros(size), n) if rank < 2 else [] for size in SIZES}
    all_reduces = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_reduce(small)
        all_reduces.append(time.perf_counter() - t0)
    piped, alone = pipeline_times(rank, stages, steps)
    if rank == 0:
        out.put((trips, all_reduces, piped, alone))
    dist.barrier()
    dist.destroy_process_group()


def slope(times: dict[int, float]) -> float:
    """Least-squares seconds per micro-batch of {n: seconds}."""
    ns = list(times)
    mn, mt = statistics.mean(ns), statistics.mean(times.values())
    return sum((k - mn) * (times[k] - mt) for k in ns) / sum((k - mn) ** 2 for k in ns)


def report(trips, all_reduces, piped, alone, stages: int) -> None:
    def us(t):
        return f"median {statistics.median(t) * 1e6:.0f} us, p90 {statistics.quantiles(t, n=10)[-1] * 1e6:.0f} us"
    for size, t in trips.items():
        print(f"send + recv round trip, {size} floats ({size * 4 / 1024:.1f} KiB): {us(t)} ({len(t)} timed)")
    print(f"all_reduce of 16 floats: {us(all_reduces)} ({len(all_reduces)} timed)")
    print(f"{stages}-stage 1F1B, batch {BATCH} x {WIDTH}, {LAYERS} Linear+ReLU per stage, median step (slowest "
          "rank):")
    for n in piped:
        print(f"  {n:2d} micro-batches: 1F1B {piped[n] * 1e3:7.2f} ms, the stage alone {alone[n] * 1e3:6.2f} ms")
    sp, sa = slope(piped), slope(alone)
    print(f"slope: 1F1B {sp * 1e6:.0f} us per micro-batch, the stage alone {sa * 1e6:.0f} us: the schedule and its "
          f"handoffs add {(sp - sa) * 1e6:.0f} us per micro-batch and stage")
    host = DEFAULT.cpu_pp_microbatch_s
    print(f"pp_handoff_s = that - cpu_pp_microbatch_s ({host * 1e6:.0f} us, the host's side) = "
          f"{(sp - sa - host) * 1e6:.0f} us (the cpu preset has {CPU_PP_HANDOFF_S * 1e6:.0f} us)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="round trips (and all-reduces) timed per size")
    parser.add_argument("--steps", type=int, default=30, help="pipeline steps timed per micro-batch count")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages, one process each (2 to 16)")
    args = parser.parse_args()
    if not 2 <= args.stages <= 16:
        parser.error(f"--stages {args.stages}: 2 to 16 (1F1B needs a micro-batch per stage, 16 at most here)")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    load = os.getloadavg()[0]
    port = 20000 + os.getpid() % 20000
    procs = [ctx.Process(target=worker, args=(r, args.stages, port, args.n, args.steps, out))
             for r in range(args.stages)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    report(*result, args.stages)
    print(f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
