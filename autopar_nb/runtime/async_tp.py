"""Asynchronous tensor parallelism (torchtitan's ``enable_async_tp``): Inductor's micro-pipeline
pass splits each TP all-gather followed by a matmul, and each matmul followed by a reduce-scatter,
into chunks over CUDA symmetric memory, so one chunk's collective runs while another's matmul
computes. It rewrites compiled graphs only: the blocks must go through ``torch.compile`` after this
is set.

This file is copied verbatim into exported scripts: it imports only the standard library and torch.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn on Inductor's micro-pipelined TP for the blocks compiled after this call, with symmetric
    memory on ``tp_mesh``'s process group. CUDA only: symmetric memory has no CPU (gloo)
    implementation."""
    if tp_mesh.device_type != "cuda":
        raise RuntimeError("async TP needs CUDA (symmetric memory), and the TP mesh is on "
                           f"{tp_mesh.device_type!r}: set plan.async_tp to false")
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
