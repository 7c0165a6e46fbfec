"""Re-running a model cell reuses its capture when nothing the trace depends on changed: the magic
rebuilds the model on the meta device (cheap) and captures again only when its key changes — every
module's path and class, the code its forward runs (and the functions of the cell that code calls),
its plain attributes, its parameters' and buffers' names, shapes and dtypes, and the example inputs'
structure, shapes and dtypes. A cell edited outside the model (the learning rate, a comment,
``--batch``) keeps the key."""

from __future__ import annotations

import hashlib
import re
import types
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..graph import ModelGraph
from . import capture

KEEP = 4
"""captures kept (the most recently used): one per model a notebook plans, a few models at a time"""
_CACHE: OrderedDict[str, ModelGraph] = OrderedDict()
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""an object's address in its repr: no part of what it is"""


def cached_capture(model: nn.Module, example_inputs: Any, *,
                   source: str | None = None) -> tuple[ModelGraph, bool]:
    """(the graph of ``model`` on ``example_inputs``, whether it was reused):
    :func:`~autopar_nb.capture.capture` once per :func:`capture_key`."""
    key = capture_key(model, example_inputs)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        # the same object: what was computed from it (its profile) is kept with it
        hit.source = source
        return hit, True
    graph = capture(model, example_inputs, source=source)
    _CACHE[key] = graph
    while len(_CACHE) > KEEP:
        _CACHE.popitem(last=False)
    return graph, False


def capture_key(model: nn.Module, example_inputs: Any) -> str:
    """A digest of what a trace of ``model`` on ``example_inputs`` depends on (see the module
    docstring)."""
    h = hashlib.sha256()
    seen: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        h.update(f"|{name}:{cls.__module__}.{cls.__qualname__}".encode())
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch."):
                break  # torch's own modules are the installed version's
            for attr in vars(klass).values():
                if isinstance(attr, types.FunctionType):
                    _code(h, attr, seen)
        for attr, value in sorted(vars(module).items()):
            if not attr.startswith("_") and not isinstance(value, nn.Module):
                _value(h, attr, value, seen)
        for pname, t in [*module.named_parameters(recurse=False),
                         *module.named_buffers(recurse=False)]:
            h.update(f"{pname}{tuple(t.shape)}{t.dtype}{t.requires_grad}".encode())
    leaves, spec = tree_flatten(example_inputs)
    h.update(str(spec).encode())
    for leaf in leaves:
        h.update((f"{tuple(leaf.shape)}{leaf.dtype}" if isinstance(leaf, torch.Tensor)
                  else repr(leaf)).encode())
    return h.hexdigest()


def _value(h, attr: str, value: Any, seen: set[int]) -> None:
    # a plain tensor attribute (a mask not registered as a buffer)
    if isinstance(value, torch.Tensor):
        h.update(f"{attr}{tuple(value.shape)}{value.dtype}".encode())
    elif isinstance(value, types.FunctionType):
        _code(h, value, seen)
    else:
        h.update(f"{attr}={ADDRESS.sub('', repr(value))}".encode())


def _code(h, fn: types.FunctionType, seen: set[int]) -> None:
    """The function's code, and that of the functions of its own module (the cell) it names."""
    if id(fn) in seen:
        return
    seen.add(id(fn))
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        h.update(code.co_code + repr((code.co_names, code.co_varnames)).encode())
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                stack.append(const)
            else:
                h.update(repr(const).encode())
        for name in code.co_names:
            g = fn.__globals__.get(name)
            if isinstance(g, types.FunctionType) and g.__module__ == fn.__module__:
                _code(h, g, seen)
