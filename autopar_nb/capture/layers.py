"""The graph's layers: the planning units of a model (:func:`find_layers`), runs of identical ones
(:func:`repeated_blocks`), the order the forward pass enters them, and which layer holds a module.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ..graph import RepeatedBlock
from ..plan import layer_of

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_repeated_blocks(mod: nn.Module) -> bool:
    """True when mod (or a descendant) is a container holding >= 2 non-leaf modules of the same
    class."""
    for m in mod.modules():
        if isinstance(m, CONTAINERS):
            kinds = [type(c) for c in m.children() if next(c.children(), None) is not None]
            if len(kinds) != len(set(kinds)):
                return True
    return False


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The planning units: children of the model, descending into containers and into modules that
    hold repeated blocks (so ``transformer.h.3`` is a layer, but a block's own ``attn`` and ``mlp``
    are not)."""
    layers: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, CONTAINERS) or _has_repeated_blocks(child):
                visit(path, child)
            else:
                layers.append((path, child))

    visit("", model)
    return layers or [("", model)]


def _signature(mod: nn.Module) -> tuple:
    return (type(mod), tuple((n, tuple(p.shape), p.dtype) for n, p in mod.named_parameters()))


def parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def repeated_blocks(layers: list[tuple[str, nn.Module]]) -> list[RepeatedBlock]:
    """Runs of >= 2 consecutive sibling layers with the same class and parameter shapes (non-leaf
    modules only)."""
    blocks: list[RepeatedBlock] = []
    run: list[tuple[str, nn.Module]] = []

    def close():
        if len(run) >= 2 and next(run[0][1].children(), None) is not None:
            kind = type(run[0][1]).__name__
            blocks.append(RepeatedBlock(parent(run[0][0]) or kind, kind, [p for p, _ in run]))

    for path, mod in layers:
        if run and (_signature(mod) != _signature(run[-1][1])
                    or parent(path) != parent(run[-1][0])):
            close()
            run = []
        run.append((path, mod))
    close()
    return blocks


def execution_order(layer_mods: list[tuple[str, nn.Module]],
                    raw: list) -> list[tuple[str, nn.Module]]:
    """Layers sorted by when the forward pass first enters them (what a pipeline must follow);
    layers the forward never calls keep their registration order, at the end."""
    paths = [p for p, _ in layer_mods]
    first: dict[str, int] = {}
    for i, r in enumerate(raw):
        lp = cached_layer_of(r.module_path, tuple(paths))
        if lp is not None:
            first.setdefault(lp, i)
    order = {p: (first.get(p, len(raw)), k) for k, p in enumerate(paths)}
    return sorted(layer_mods, key=lambda pm: order[pm[0]])


# a 126-layer model has thousands of ops and parameters, few module paths
@functools.lru_cache(maxsize=65536)
def cached_layer_of(path: str, layer_paths: tuple[str, ...]) -> str | None:
    """:func:`autopar_nb.plan.layer_of` (the layer holding module ``path``), cached."""
    return layer_of(path, layer_paths)
