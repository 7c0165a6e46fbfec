"""The process group and the device mesh: world ranks factored as (pp, dp, tp), TP innermost so a TP
group stays inside a node; with context parallelism (pp, dp, cp, tp); expert parallelism splits the
dp dim into (dp_mod_ep, ep)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .deathsig import end_with_the_agent

MESH_DIMS = ("pp", "dp", "tp")


def init_distributed(*, timeout_s: float = 600.0) -> str:
    """Join the process group torchrun describes in the environment (NCCL on GPUs, gloo on CPU)
    unless one exists; returns the device type, ``"cuda"`` or ``"cpu"``."""
    # also where the script was imported, not run (its first lines set it as __main__)
    end_with_the_agent()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        local, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        # set_device(LOCAL_RANK) would fail on some ranks with "invalid device ordinal"
        if local > gpus:
            raise SystemExit(too_many_processes(local, gpus,
                                                int(os.environ.get("WORLD_SIZE", local)),
                                                sys.argv[0]))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return device
    backend, timeout = ("nccl" if device == "cuda" else "gloo"), timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # a restarted attempt (torchrun --max-restarts) meets in a fresh key space of the agent's
        # store, so stale keys of the failed attempt cannot break its rendezvous
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False)
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store),
                                timeout=timeout, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend, timeout=timeout)
    return device


def too_many_processes(local: int, gpus: int, world: int, script: str) -> str:
    """What to run instead when torchrun started ``local`` processes on a node of ``gpus`` GPUs."""
    n = max(d for d in range(1, gpus + 1) if world % d == 0)  # processes per node
    return (f"torchrun started {local} processes on a node with {gpus} GPU(s). Run the {world} "
            f"processes as {world // n} nodes x {n}, on each: torchrun --nnodes {world // n} "
            f"--nproc-per-node {n} --rdzv-backend c10d --rdzv-endpoint HOST:29500 {script} (HOST: "
            "the first node's address)")


def build_mesh(device: str, pp: int, dp: int, tp: int, *, cp: int = 1):
    """The mesh with dims ``("pp", "dp", "tp")`` (size-1 dims kept, so ``mesh["dp"]`` always
    exists), and with context parallelism (``cp`` > 1) ``("pp", "dp", "cp", "tp")`` plus
    ``"dp_cp"``: the dp and cp ranks flattened, which hold the same parameters and average gradients
    (torchtitan's ``dp_shard_cp``). Another world size that ``pp * cp * tp`` divides (an elastic
    job: ``torchrun --nnodes MIN:MAX``) changes dp only."""
    world, replica = dist.get_world_size(), pp * cp * tp
    if world % replica:
        raise SystemExit(f"this plan runs on pp({pp}) * dp({dp}) * cp({cp}) * tp({tp}) = "
                         f"{dp * replica} processes (or a multiple of {replica}), not {world}: "
                         "start it with the torchrun command atop the script")
    if world != dp * replica and dist.get_rank() == 0:
        print(f"{world} processes, not the plan's {dp * replica}: dp({world // replica}), not "
              f"dp({dp})", flush=True)
    shape, names = ((pp, world // replica, cp, tp), ("pp", "dp", "cp", "tp")) if cp > 1 else (
        (pp, world // replica, tp), MESH_DIMS)
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    if cp > 1:
        mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def expert_mesh(mesh, *, ep: int):
    """The mesh's data-parallel dim split for expert parallelism: a 4-D view with dims ``("pp",
    "dp_mod_ep", "ep", "tp")`` of the same ranks. ``ep`` groups consecutive data-parallel ranks
    (inside a node, as TP's are), which split each module's experts; ``dp_mod_ep`` links the ranks
    of the dp / ep groups that hold the same experts (their gradients are averaged there).
    ``mesh["dp"]`` stays the whole data-parallel group for everything else (torchtitan borrows EP
    from the data-parallel ranks the same way)."""
    dp = mesh["dp"].size()
    if dp % ep:
        raise SystemExit(f"expert parallelism over ep({ep}) ranks needs a data-parallel degree it "
                         f"divides, not dp({dp})")
    return mesh._unflatten("dp", (dp // ep, ep), ("dp_mod_ep", "ep"))


def device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
