"""Per-rank head counts and widths for model code that reads global sizes.

After TP a rank's attention module holds ``heads / tp`` heads, but its forward may still read the global numbers
from attributes: GPT-2's ``split_size`` (``c_attn(x).split(self.split_size, dim=2)``), nanoGPT's ``n_embd`` and
``n_head``, T5's ``n_heads`` (``torch.zeros(1, self.n_heads, q, k)``), Phi-3's ``config.num_attention_heads``.
torchtitan once wrote ``attn.n_heads //= tp``; here the values are decided at export time from the model and the
plan, written in the script as plain numbers, and set as they are (setting them twice is harmless).

This file is copied verbatim into exported scripts: it imports only the standard library and torch.
"""

from __future__ import annotations

import copy

import torch.fx as fx
import torch.nn as nn

from .tp import select


def set_local_sizes(model: nn.Module, sizes: dict[str, dict[str, int]]) -> None:
    """Set per-rank sizes: ``sizes`` maps module patterns (``"h.*.attn"``; see :func:`select`) to attribute ->
    value. A dotted attribute (``"config.num_attention_heads"``) is set on the module's own shallow copy of that
    object, so the model's shared config keeps its global values. Patterns that match nothing are skipped (the
    modules may live on another pipeline stage)."""
    for pattern, attributes in sizes.items():
        for path in select(model, pattern):
            module = model.get_submodule(path)
            if isinstance(getattr(module, "graph", None), fx.Graph):
                continue  # traced for a pipeline: no attributes (pp.splits_into_equal_parts)
            for name, value in attributes.items():
                owner, _, attr = name.rpartition(".")
                target = module
                if owner:
                    if "." in owner:
                        raise ValueError(f"{path}: {name!r} is nested too deep; name an attribute of the module "
                                         "or of one object it holds (config.num_attention_heads)")
                    target = copy.copy(getattr(module, owner))
                    setattr(module, owner, target)
                if not hasattr(target, attr):
                    raise AttributeError(f"{path} ({type(module).__name__}) has no attribute {name!r} to set to its "
                                         "per-rank value; re-export the script for this model")
                setattr(target, attr, value)
