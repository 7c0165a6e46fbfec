"""The two tracers: ``torch.export`` (:func:`from_export`) and, where it cannot trace a model that
runs eagerly, a ``TorchDispatchMode`` recording one eager forward pass (:func:`from_dispatch`); each
gives the raw ops to :func:`~.build.spliced`.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kernels_ext

from ..graph import ModelGraph
from . import blocks
from .build import RawOp, canonical_names, spliced
from .linear import as_linear, param_view


@contextlib.contextmanager
def _quiet_torch_logs():
    # a failed export logs from several torch loggers (fake tensors' "failed while attempting to run
    # meta" with a 20-line traceback at ERROR) and prints the partial graph to stderr; the
    # CaptureError (or fallback warning) says what matters
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


class _TensorsOnly(nn.Module):
    """Wraps a model so its output is the tensors it returns: outputs such as Hugging Face's cache
    objects are not pytrees torch.export can handle, and the graph only needs the tensors."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return tuple(_tensor_leaves(self.inner(*args, **kwargs)))


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensor_leaves(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensor_leaves(v)]
    return []


def from_export(model: nn.Module, args: tuple, kwargs: dict, stand_ins=None) -> ModelGraph:
    with (_quiet_torch_logs(),
          stand_ins.parameters_hidden() if stand_ins else contextlib.nullcontext()):
        ep = torch.export.export(_TensorsOnly(model), args, kwargs, strict=False)
    # the wrapper adds "inner." to every parameter and module path: strip it; tied weights get their
    # first name
    canonical = canonical_names(model)
    placeholder_target = {s.arg.name: canonical.get(t, t) for s in ep.graph_signature.input_specs
                          if getattr(s.arg, "name", None) and s.target is not None
                          for t in [s.target.removeprefix("inner.")]}
    alias: dict[str, str] = {}  # getitem node -> the multi-output node it unpacks
    raw: list[RawOp] = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target.__name__ == "getitem":
            alias[node.name] = alias.get(node.args[0].name, node.args[0].name)
            continue
        if param_view(node, placeholder_target, model) is not None:
            # a Linear subclass's weight.T stands for the weight itself, as under eager dispatch
            placeholder_target[node.name] = param_view(node, placeholder_target, model)
            continue
        stack = [(_clean_path(p), t) for p, t in (node.meta.get("nn_module_stack") or {}).values()]
        stack = [(p.removeprefix("inner").removeprefix("."), t) for p, t in stack if p != ""]
        module_path, module_type = stack[-1] if stack else ("", type(model).__name__)
        inputs, params = [], []
        for a in tree_flatten((node.args, node.kwargs))[0]:
            if isinstance(a, torch.fx.Node):
                if a.name in placeholder_target:
                    params.append(placeholder_target[a.name])
                else:
                    inputs.append(alias.get(a.name, a.name))
        to_val = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        args_v, kwargs_v = torch.fx.node.map_aggregate((node.args, node.kwargs), to_val)
        outs = [o for o in tree_flatten(node.meta.get("val"))[0] if isinstance(o, torch.Tensor)]
        op, args_v = as_linear(node, str(node.target), args_v, params, model, module_path)
        raw.append(RawOp(node.name, op, args_v, kwargs_v, outs, inputs, params, module_path,
                          _type_name(module_type)))
    returned = tree_flatten(ep.graph.output_node().args)[0]
    outs = [n.meta.get("val") for n in returned if isinstance(n, torch.fx.Node)]
    outs = [o for o in outs if isinstance(o, torch.Tensor)]
    return spliced(model, args, kwargs, raw, outs, "torch.export", stand_ins)


class Recorder(TorchDispatchMode):
    """Records every ATen call with the module stack active at the time."""

    def __init__(self, param_names: dict[int, str], stack: list[tuple[str, str]]):
        super().__init__()
        self.param_names, self.stack = param_names, stack
        self.producer: dict[int, str] = {}
        self.raw: list[RawOp] = []
        self.counts: dict[str, int] = defaultdict(int)
        self.keep: list[Any] = []  # keeps outputs alive so id() stays unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        rule = kernels_ext.lookup(str(func))
        if (rule is not None and rule.op_class == "view" and len(tensors) == 1
            and id(tensors[0]) in self.param_names):
            # a view of a parameter (F.linear's weight.t() under eager dispatch) stands for the
            # parameter itself
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.param_names[id(o)] = self.param_names[id(tensors[0])]
                    self.keep.append(o)
            return out
        base = func.overloadpacket.__name__
        name = f"{base}_{self.counts[base]}" if self.counts[base] else base
        self.counts[base] += 1
        inputs, params = [], []
        positional = str(func) in blocks.MARKERS  # a stand-in's inputs, "" where no op produced one
        for a in tensors:
            if id(a) in self.param_names:
                params.append(self.param_names[id(a)])
            elif id(a) in self.producer or positional:
                inputs.append(self.producer.get(id(a), ""))
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        for o in outs:
            self.producer[id(o)] = name
        self.keep.append(outs)
        path, typ = self.stack[-1]
        self.raw.append(RawOp(name, str(func), args, kwargs, outs, inputs, params, path, typ))
        return out


def from_dispatch(model: nn.Module, args: tuple, kwargs: dict, paths: dict[int, str],
                   stand_ins=None) -> ModelGraph:
    stack: list[tuple[str, str]] = [("", type(model).__name__)]

    def pre(mod, _inputs):
        stack.append((paths.get(id(mod), ""), type(mod).__name__))

    def post(mod, _inputs, _out):
        stack.pop()

    names = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        recorder = Recorder(names, stack)
        with recorder:
            out = model(*args, **kwargs)
    finally:
        h1.remove()
        h2.remove()
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return spliced(model, args, kwargs, recorder.raw, outs, "fx", stand_ins)


def _clean_path(path: str) -> str:
    # older torch.export versions spell paths as "L['self'].h[0].attn"; normalise to "h.0.attn"
    if path.startswith("L['self']"):
        path = path.removeprefix("L['self']").lstrip(".").replace("[", ".").replace("]", "")
    return path


def _type_name(t: Any) -> str:
    return t.rsplit(".", 1)[-1] if isinstance(t, str) else getattr(t, "__name__", str(t))
