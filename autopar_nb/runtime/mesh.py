"""The process group and the device mesh: world ranks factored as (pp, dp, tp), TP innermost so a TP group stays
inside a node; expert parallelism splits the dp dim into (dp_mod_ep, ep)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def init_distributed(*, timeout_s: float = 600.0) -> str:
    """Join the process group torchrun describes in the environment (NCCL on GPUs, gloo on CPU) unless one exists;
    returns the device type, ``"cuda"`` or ``"cpu"``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return device
    backend, timeout = ("nccl" if device == "cuda" else "gloo"), timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # a restarted attempt (torchrun --max-restarts) meets in a fresh key space of the agent's store, so stale
        # keys of the failed attempt cannot break its rendezvous
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store), timeout=timeout,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend, timeout=timeout)
    return device


def build_mesh(device: str, pp: int, dp: int, tp: int):
    """The 3-D mesh with dims ``("pp", "dp", "tp")`` (size-1 dims kept, so ``mesh["dp"]`` always exists)."""
    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise SystemExit(f"this plan runs on pp({pp}) * dp({dp}) * tp({tp}) = {pp * dp * tp} processes, not {world}: "
                         "start it with the torchrun command at the top of the script")
    return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


def expert_mesh(mesh, *, ep: int):
    """The mesh's data-parallel dim split for expert parallelism: a 4-D view with dims ``("pp", "dp_mod_ep", "ep",
    "tp")`` of the same ranks. ``ep`` groups consecutive data-parallel ranks (inside a node, as TP's are), which split
    each module's experts; ``dp_mod_ep`` links the ranks of the dp / ep groups that hold the same experts (their
    gradients are averaged there). ``mesh["dp"]`` stays the whole data-parallel group for everything else (torchtitan
    borrows EP from the data-parallel ranks the same way)."""
    dp = mesh["dp"].size()
    if dp % ep:
        raise SystemExit(f"expert parallelism over ep({ep}) ranks needs a data-parallel degree it divides, not "
                         f"dp({dp})")
    return mesh._unflatten("dp", (dp // ep, ep), ("dp_mod_ep", "ep"))


def device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
