"""Distributed checkpoints (DCP): every rank writes its shards; a checkpoint loads at another world size or layout.

A checkpoint counts once every rank finished writing it (a ``COMPLETE`` marker after a barrier), so a run killed in
the middle of a save resumes from the one before. ZeRO-1's ``ZeroRedundancyOptimizer`` has no DCP state dict: its
shards are one file per rank (resume with the same data-parallel size). Tensors split part by part (fused
projections, ``_StridedShard``) are stored in their original layout (see :func:`dcp_layout`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from .layouts import dcp_layout, restore_layout

# optimizer state keyed by parameter name, so each pipeline rank's share is its own set of keys
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest ``step_N`` folder of ``ckpt_dir`` whose save finished on every rank."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    steps = [int(d.removeprefix("step_")) for d in os.listdir(ckpt_dir)
             if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, "COMPLETE"))]
    return os.path.join(ckpt_dir, f"step_{max(steps)}") if steps else None


def _states(model, optimizer):
    """(model state, optimizer state or None when ZeRO-1 keeps its own) in DCP's form."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return get_state_dict(model, [])[0], None
    return get_state_dict(model, optimizer, options=FLAT)


def save_checkpoint(path: str, model, optimizer, step: int, *, data=None) -> None:
    """Write ``model`` (a module, or a ModuleList of this rank's pipeline stages), ``optimizer``, ``step`` and the
    ``data`` stream's position (a run that reads a dataset)."""
    model_sd, optim_sd = _states(model, optimizer)
    state = {"model": model_sd, "step": step} | ({"optim": optim_sd} if optim_sd is not None else {})
    state |= {"data": data.state_dict()} if data is not None else {}
    dcp.save(dcp_layout(state), checkpoint_id=path)
    if optim_sd is None:
        torch.save(optimizer.optim.state_dict(), os.path.join(path, f"zero1_rank{dist.get_rank()}.pt"))
    dist.barrier()  # every rank's shards are on disk before the checkpoint counts
    if dist.get_rank() == 0:
        open(os.path.join(path, "COMPLETE"), "w").close()


def load_checkpoint(path: str, model, optimizer, *, data=None) -> int:
    """Read a checkpoint written by :func:`save_checkpoint` into ``model``, ``optimizer`` and the ``data`` stream
    (without a saved position, the stream counts from the step); returns its step."""
    model_sd, optim_sd = _states(model, optimizer)
    like = {"model": model_sd, "step": 0} | ({"optim": optim_sd} if optim_sd is not None else {})
    if data is not None and "data.step" in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        like["data"] = data.state_dict()
    state = dcp_layout(like)
    dcp.load(state, checkpoint_id=path)
    state = restore_layout(state, like)
    if "data" in state:
        data.load_state_dict(state["data"])
    if optim_sd is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        optimizer.optim.load_state_dict(torch.load(os.path.join(path, f"zero1_rank{dist.get_rank()}.pt")))
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=FLAT)
    return state["step"]
