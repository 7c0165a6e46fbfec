"""The traced ops assembled into a :class:`ModelGraph`: each op's FLOPs and bytes by its kernels_ext
rule, its layer, the layers' totals, the parameters; copies of identical blocks spliced in first.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

import kernels_ext
from kernels_ext import TensorMeta

from ..graph import Layer, ModelGraph, OpNode, ParamInfo, TensorInfo, sdpa_causal
from . import blocks
from .layers import cached_layer_of, execution_order, find_layers, parent, repeated_blocks
from .linear import class_name


class RawOp:
    """One traced call before layer assignment."""

    __slots__ = ("name", "op", "args", "kwargs", "outs", "inputs", "params", "module_path",
                 "module_type")

    def __init__(self, name, op, args, kwargs, outs, inputs, params, module_path, module_type):
        self.name, self.op, self.args, self.kwargs, self.outs = name, op, args, kwargs, outs
        self.inputs, self.params, self.module_path, self.module_type = (inputs, params, module_path,
                                                                        module_type)


def spliced(model, args, kwargs, raw: list[RawOp], outs: list, tracer: str,
             stand_ins) -> ModelGraph:
    """The graph of ``raw``, copies of the traced members spliced in where their identical members
    stood in."""
    raw, copied = (blocks.splice(raw, stand_ins, "fx" if tracer == "fx" else "export") if stand_ins
                   else (raw, 0))
    graph = build(model, args, kwargs, raw, outs, tracer)
    graph.copied_layers = copied
    return graph


def _tensor_metas(value: Any) -> list[TensorMeta]:
    """The TensorMeta leaves of nested args (tree_flatten would flatten the NamedTuple itself)."""
    if isinstance(value, TensorMeta):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensor_metas(v)]
    return []


def _info(t: Any) -> TensorInfo | None:
    if isinstance(t, torch.Tensor):
        return TensorInfo(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."),
                          t.element_size())
    return None


def _meta(t: Any) -> Any:
    """A traced value as kernels_ext sees it: tensors become TensorMeta, the rest is left alone."""
    if isinstance(t, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."),
                          t.element_size())
    if isinstance(t, (list, tuple)):
        return type(t)(_meta(x) for x in t)
    return t


def _dropout_p(op: str, args, kwargs) -> float | None:
    """The drop probability of a dropout op (``aten.dropout(input, p, train)`` and its variants; 0
    when it does not train) or of attention (SDPA's ``dropout_p``); None for any other op."""
    if "scaled_dot_product_attention" in op:  # (query, key, value, attn_mask, dropout_p, ...)
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return float(p) if isinstance(p, int | float) else None
    if "dropout" not in op or "backward" in op:
        return None
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    train = kwargs.get("train", args[2] if len(args) > 2 else True)
    return float(p) if train and isinstance(p, int | float) else 0.0


def build(model: nn.Module, args: tuple, kwargs: dict, raw: list[RawOp], outs: list,
           tracer: str) -> ModelGraph:
    layer_mods = find_layers(model)
    layer_paths = [p for p, _ in layer_mods]
    layer_mods = execution_order(layer_mods, raw)
    unknown: set[str] = set()
    nodes: list[OpNode] = []
    pending: list[OpNode] = []  # ops before the first layer: they join it
    last_layer: str | None = None
    renamed = {p: class_name(m) for p, m in model.named_modules()
               if class_name(m) != type(m).__name__}
    for r in raw:
        rule = kernels_ext.lookup(r.op)
        if rule is None:
            unknown.add(r.op)
            rule = kernels_ext.OpRule(r.op, "other")  # zero FLOPs, bytes still counted
        a, k = _meta(tuple(r.args)), {key: _meta(v) for key, v in r.kwargs.items()}
        out_meta = [_meta(o) for o in r.outs]
        flops = rule.forward_flops(a, k, out_meta)
        bwd, (rd, wr) = flops * rule.backward_factor, rule.bytes_moved(a, k, out_meta)
        in_shapes = [t.shape for t in _tensor_metas((a, k))]
        layer = cached_layer_of(r.module_path, tuple(layer_paths)) or last_layer
        node = OpNode(r.name, r.op, rule.op_class, r.inputs, in_shapes, [o.shape for o in out_meta],
                      out_meta[0].dtype if out_meta else "", flops, bwd, rd, wr, r.params,
                      r.module_path, renamed.get(r.module_path, r.module_type), layer or "",
                      r.op not in unknown, _dropout_p(r.op, r.args, r.kwargs),
                      sdpa_causal(r.op, r.args, r.kwargs))
        if layer is None:
            pending.append(node)
        else:
            for p in pending:
                p.layer = layer
            pending = []
            last_layer = layer
        nodes.append(node)
    for p in pending:  # a model whose forward never enters a layer
        p.layer = layer_paths[0]
    if unknown:
        warnings.warn(f"no kernels_ext rule for {', '.join(sorted(unknown))}: counted as 0 FLOPs; "
                      "register one with kernels_ext.register_op(...) to cost it", stacklevel=3)

    params = _param_infos(model)
    own_params: dict[str | None, list[ParamInfo]] = defaultdict(list)
    for p in (p for p in params.values() if not p.is_buffer):
        own_params[cached_layer_of(p.module_path, tuple(layer_paths))].append(p)
    by_layer: dict[str, list[OpNode]] = defaultdict(list)
    for n in nodes:
        by_layer[n.layer].append(n)
    repeated = repeated_blocks(layer_mods)
    member = {m: (b.name, i) for b in repeated for i, m in enumerate(b.members)}
    layers = []
    for path, mod in layer_mods:
        own = own_params.get(path, [])
        modules = {(f"{path}.{n}" if n and path else n or path): class_name(m)
                   for n, m in mod.named_modules()
                   if next(m.parameters(recurse=False), None) is not None}
        lnodes = by_layer.get(path, [])
        block, index = member.get(path, (None, None))
        layers.append(Layer(path, type(mod).__name__, sum(p.numel for p in own if p.trainable),
                            sum(p.numel * p.itemsize for p in own), sum(n.flops for n in lnodes),
                            sum(n.bwd_flops for n in lnodes), [n.name for n in lnodes], modules,
                            block, index))
    inputs = [i for i in map(_info, tree_flatten((args, kwargs))[0]) if i is not None]
    return ModelGraph(type(model).__name__, nodes, layers, repeated, params, inputs,
                      [i for i in map(_info, outs) if i is not None], tracer,
                      unknown_ops=sorted(unknown))


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter/buffer -> the first name it has (how named_parameters() reports
    it)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        out[name] = first.setdefault(id(t), name)
    return out


def _param_infos(model: nn.Module) -> dict[str, ParamInfo]:
    modules = dict(model.named_modules())
    out: dict[str, ParamInfo] = {}
    # named_parameters() skips duplicates: tied weights (lm_head.weight is wte.weight) count once,
    # under the first name
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        mpath = parent(name)
        is_buffer = not isinstance(t, nn.Parameter)
        out[name] = ParamInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                              t.element_size(), mpath, class_name(modules[mpath]),
                              t.requires_grad and not is_buffer, is_buffer)
    return out
