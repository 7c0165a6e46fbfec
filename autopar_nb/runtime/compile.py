"""``torch.compile`` per repeated block (torchtitan's ``apply_compile``): each block is compiled on
its own, so one compiled graph is reused by every block of the same shape (Dynamo caches by code),
compile time does not grow with depth, and the per-block wrappers (FSDP units, checkpointing) stay
outside the compiled region's boundaries.

This file is copied verbatim into exported scripts: it imports only the standard library and torch.
"""

from __future__ import annotations

import torch.nn as nn

from .tp import select


def apply_compile(model: nn.Module, blocks, *, backend: str = "inductor",
                  fullgraph: bool = False) -> list[str]:
    """Compile the modules ``blocks`` names (patterns as in :func:`select`: ``"layers.*"``) in place
    with ``nn.Module.compile`` (parameter names and state dicts unchanged, unlike wrapping in
    ``torch.compile``); returns the paths compiled. Apply it after activation checkpointing and
    before FSDP (torchtitan's order), so the checkpointed region is what is compiled and FSDP's
    hooks stay outside."""
    paths = select(model, blocks)
    for path in paths:
        model.get_submodule(path).compile(backend=backend, fullgraph=fullgraph)
    return paths
