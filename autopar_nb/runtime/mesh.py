"""The device mesh: world ranks factored as (pp, dp, tp), TP innermost so a TP group stays inside a node."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    """The process-group backend for a device type: NCCL on GPUs, gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


def build_mesh(pp: int, dp: int, tp: int, *, device: str | None = None) -> DeviceMesh:
    """A 3-D :class:`DeviceMesh` with dims ``("pp", "dp", "tp")``; initialises the default process group if needed.

    Size-1 dims are kept so ``mesh["dp"]`` etc. always exist.
    """
    device = device or device_type()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if pp * dp * tp != world:
        raise ValueError(f"pp({pp}) * dp({dp}) * tp({tp}) = {pp * dp * tp} != world_size({world}); "
                         f"launch {pp * dp * tp} processes or change the plan's mesh")
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend_for(device))
    return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
