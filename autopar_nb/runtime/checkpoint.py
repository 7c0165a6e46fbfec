"""Distributed checkpoints (DCP): every rank writes its shards; a checkpoint loads at another world size or layout.

A checkpoint counts once every rank finished writing it (a ``COMPLETE`` marker after a barrier), so a run killed in
the middle of a save resumes from the one before. ZeRO-1's ``ZeroRedundancyOptimizer`` has no DCP state dict: its
shards are one file per rank (resume with the same data-parallel size). Tensors split part by part (fused
projections, ``_StridedShard``) are stored in their original layout (see :func:`dcp_layout`). Keys are the model's
parameter names whatever the plan: a rank holding several pipeline stages (:class:`PipelineStages`) stores its
stages' entries without the stage index, so a checkpoint written under one schedule loads under any other plan.
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
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


class PipelineStages(nn.ModuleList):
    """The pipeline stages one rank holds, checkpointed as one model: by the model's names, not the stage index."""


STAGE_INDEX = re.compile(r"^((?:state|param_groups)\.)?\d+\.")
"""the index of a pipeline stage in a key of a ``ModuleList`` of stages: ``0.layers.1.w`` (model),
``state.0.layers.1.w.exp_avg`` and ``param_groups.0.layers.1.w.lr`` (flattened optimizer state)"""


def by_name(state: dict | None, stages: bool) -> dict | None:
    """``state`` keyed by the model's names: without the stage index when ``stages`` (the entries of a tied
    parameter that two stages of this rank hold under one name are equal: the first is kept)."""
    if state is None or not stages:
        return state
    out: dict = {}
    for key, value in state.items():
        out.setdefault(STAGE_INDEX.sub(r"\1", key), value)
    return out


def by_stage(loaded: dict | None, like: dict | None, stages: bool) -> dict | None:
    """The inverse of :func:`by_name`: ``loaded`` (keyed by name) back under the keys of ``like``."""
    if loaded is None or not stages:
        return loaded
    return {key: loaded[STAGE_INDEX.sub(r"\1", key)] for key in like}


def save_checkpoint(path: str, model, optimizer, step: int, *, data=None) -> None:
    """Write ``model`` (a module, or this rank's :class:`PipelineStages`), ``optimizer``, ``step`` and the
    ``data`` stream's position (a run that reads a dataset), keyed by the model's names (:func:`by_name`)."""
    stages = isinstance(model, PipelineStages)
    model_sd, optim_sd = (by_name(sd, stages) for sd in _states(model, optimizer))
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
    stages = isinstance(model, PipelineStages)
    model_sd, optim_sd = _states(model, optimizer)
    like = ({"model": by_name(model_sd, stages), "step": 0}
            | ({"optim": by_name(optim_sd, stages)} if optim_sd is not None else {}))
    if data is not None and "data.step" in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
        like["data"] = data.state_dict()
    state = dcp_layout(like)
    dcp.load(state, checkpoint_id=path)
    state = restore_layout(state, like)
    if "data" in state:
        data.load_state_dict(state["data"])
    model_state = by_stage(state["model"], model_sd, stages)
    if optim_sd is None:
        set_state_dict(model, [], model_state_dict=model_state, optim_state_dict={})
        optimizer.optim.load_state_dict(torch.load(os.path.join(path, f"zero1_rank{dist.get_rank()}.pt")))
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=by_stage(state["optim"], optim_sd, stages), options=FLAT)
    return state["step"]
