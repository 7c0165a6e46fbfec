"""Module paths written as patterns over repeated blocks, as the exported script holds them: a
complete set of blocks as ``"layers.*"``, one relative TP plan per module list (torchtitan's
layout), per-block values written once, and the FSDP units.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.nn as nn

from ..plan import Plan, within
from ..runtime.tp import TPStyle


def _containers(model: nn.Module) -> dict[str, list[str]]:
    """Paths of module lists/dicts (repeated blocks) -> their children's paths."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 1:
            out[path] = [f"{path}.{name}" if path else name for name, _ in module.named_children()]
    return out


def compress(model: nn.Module, paths: list[str]) -> list[str]:
    """``paths`` (in model order) with every complete set of blocks of a module list written as one
    pattern (``"layers.*"``), where its first block was."""
    complete = {c: f"{c}.*" if c else "*" for c, children in _containers(model).items()
                if set(children) <= set(paths)}
    out: list[str] = []
    for path in paths:
        pattern = (complete.get(path.rpartition(".")[0], path) if "." in path or "" in complete
                   else path)
        if pattern not in out:
            out.append(pattern)
    return out


def relative_plans(model: nn.Module, styles: dict[str, TPStyle]) -> tuple[dict[str, TPStyle],
                                                                          dict[str, dict]]:
    """torchtitan's TP layout: one relative plan for the blocks of each module list that share it,
    absolute paths for everything else (the modules around the blocks, blocks' own entry/exit
    styles, blocks that differ)."""
    absolute = dict(styles)
    blocks: dict[str, dict[str, TPStyle]] = {}
    for container, children in _containers(model).items():
        rel = {
            child: {p[len(child) + 1:]: s
                    for p, s in styles.items() if p.startswith(child + ".")}
            for child in children
        }
        common, count = Counter(tuple(sorted(r.items())) for r in rel.values()).most_common(1)[0]
        if not common or count < 2:
            continue
        same = [c for c in children if tuple(sorted(rel[c].items())) == common]
        if len(same) < len(children):
            # an override made some blocks differ: keep them all absolute (explicit beats clever)
            continue
        plan = {k: s
                for k, s in sorted(common,
                                   key=lambda kv: _module_order(model, f"{children[0]}.{kv[0]}"))}
        blocks[f"{container}.*" if container else "*"] = plan
        for child in same:
            for k in rel[child]:
                absolute.pop(f"{child}.{k}")
    return absolute, blocks


def block_patterns(model: nn.Module, by_path: dict[str, Any]) -> dict[str, Any]:
    """``by_path`` with the entries that every block of a module list has alike (the same path
    inside the block, the same value) written once, as a pattern: ``{"h.0.attn": x, "h.1.attn": x}``
    -> ``{"h.*.attn": x}``."""
    out = dict(by_path)
    for container, children in sorted(_containers(model).items(), key=lambda kv: len(kv[0])):
        inside: dict[str, dict[str, Any]] = {}  # path inside a block -> block -> value
        for path, value in out.items():
            for child in children:
                if path.startswith(child + "."):
                    inside.setdefault(path[len(child) + 1:], {})[child] = value
        for rel, values in inside.items():
            first = next(iter(values.values()))
            if len(values) == len(children) and all(x == first for x in values.values()):
                pattern = f"{container}.*.{rel}" if container else f"*.{rel}"
                out = {(pattern if k == f"{children[0]}.{rel}" else k): x for k, x in out.items()
                       if k == f"{children[0]}.{rel}" or k not in {f"{c}.{rel}" for c in children}}
    return out


def _module_order(model: nn.Module, path: str) -> int:
    return list(dict(model.named_modules())).index(path)


def fsdp_units(model: nn.Module, plan: Plan, ties: list[list[str]]) -> list[Any]:
    """FSDP units from the plan's layers: each layer with ``fsdp`` and parameters of its own; the
    final norm and the head together (torchtitan's ``[norm, output]``); layers holding a tied
    parameter stay in the root unit."""
    modules = dict(model.named_modules())
    tied = {p.rpartition(".")[0] for group in ties for p in group}

    def holds_tie(path: str) -> bool:
        return any(within(t, path) for t in tied)

    layers = [lp.path for lp in plan.layers if lp.fsdp and lp.path in modules
              and not holds_tie(lp.path) and any(True for _ in modules[lp.path].parameters())]
    tail: list[Any] = []
    if (len(layers) >= 2 and layers[-1] == plan.layers[-1].path
        and "norm" in type(modules[layers[-2]]).__name__.lower()):
        tail, layers = [layers[-2:]], layers[:-2]
    return [*compress(model, layers), *tail]
