"""A stand-in of the captured model: a copy on the meta device and the example inputs as meta
tensors.

The planner runs every tensor-parallel layout it would offer once on these (``planner/forward.py``):
the model's own forward on one rank's local shards, with no storage and no real process group.
Capture makes the copy, so the check sees the model as it was captured, whatever the user does with
it afterwards (move it to a GPU, train it); its weights are never copied (parameters and buffers
become meta tensors of the same shapes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map


@dataclass(eq=False)
class StandIn:
    """The meta copy of a captured model and its example inputs (see the module docstring)."""

    model: nn.Module
    args: tuple
    kwargs: dict
    results: dict = field(default_factory=dict)
    """layout key -> what running it gave (None: it ran; else (module path, why)): each layout runs
    once"""
    tables: dict = field(default_factory=dict)
    """layout key -> the head-indexed tables it split with the heads (module path -> name -> heads
    dim)"""
    stage_refusals: dict = field(default_factory=dict)
    """layout key -> why it cannot run inside pipeline stages ("" where it can:
    ``planner.degrees.stage_refusal``)"""


def to_meta(x: Any) -> Any:
    """A tensor as a meta tensor of the same shape and dtype (anything else as it is)."""
    return (torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) and not x.is_meta
            else x)


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` deep-copied with every parameter and buffer on the meta device (ties kept: one copy
    per tensor)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if not p.is_meta:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                       requires_grad=p.requires_grad)
    for b in model.buffers():
        if not b.is_meta:
            memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def stand_in(model: nn.Module, args: tuple, kwargs: dict) -> StandIn | None:
    """The stand-in of ``model`` called with ``args``/``kwargs``; None when the model cannot be
    copied (a module holding something ``deepcopy`` refuses): its layouts then go unchecked."""
    try:
        return StandIn(meta_copy(model), tree_map(to_meta, tuple(args)),
                       tree_map(to_meta, dict(kwargs)))
    except Exception:  # any failure to copy only means the layouts are not run at plan time
        return None
