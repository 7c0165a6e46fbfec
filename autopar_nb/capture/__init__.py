"""capture(model, example_inputs) -> ModelGraph: trace one forward pass on the meta device into an
operator graph.

``torch.export`` is the tracer. Where it cannot trace a model that still runs eagerly on meta
tensors, a fallback records every ATen call of one eager forward pass with a ``TorchDispatchMode``
(the same machinery ``make_fx`` uses) and module hooks for the module path; a warning says so.
Neither allocates parameter storage when the model lives on the meta device.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import kernels_ext
from kernels_ext import TensorMeta

from ..failures import where_in_model
from ..graph import Layer, ModelGraph, OpNode, ParamInfo, RepeatedBlock, TensorInfo
from ..plan import layer_of
from ..runtime.cp import takes_positions
from ..runtime.pp_graph import masks_as_in_eager
from ..runtime.train import switch_off_kv_cache
from . import blocks
from .linear import as_linear, class_name, param_view
from .meta_stand_in import stand_in, to_meta

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class CaptureError(RuntimeError):
    """The model could not be traced; the message names the module, the source line and what to
    do."""


def capture(model: nn.Module, example_inputs: Any, *, source: str | None = None,
            copy_blocks: bool = True) -> ModelGraph:
    """Trace ``model`` on ``example_inputs`` into a :class:`ModelGraph`.

    ``example_inputs`` is a tensor, a tuple/list of positional tensors, or a dict of keyword
    tensors. When the model is on the meta device, inputs are moved to meta too, so nothing is
    allocated. Identical repeated blocks are traced once and copied (``capture/blocks.py``: the same
    graph); ``copy_blocks=False`` traces every layer.

    >>> with torch.device("meta"):
    ...     m = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
    >>> capture(m, torch.randn(32, 1024)).num_params
    1574400
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture() needs an nn.Module, got {type(model).__name__}")
    args, kwargs = split_inputs(example_inputs)
    if any(p.is_meta for p in model.parameters()):
        args, kwargs = tree_map(to_meta, (args, kwargs))
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}

    was_training = model.training
    # trace the training graph: dropout and batch-norm statistics are part of the step
    model.train()
    cached = switch_off_kv_cache(model)  # as the script trains it (runtime/train.py)
    try:
        # a plain causal or bidirectional mask skipped, as the eager forward does
        # (runtime/pp_graph.py)
        try:
            with masks_as_in_eager(own_positions="position_ids" not in kwargs):
                graph = _copied_or_full(lambda s: _from_export(model, args, kwargs, s), model,
                                        copy_blocks)
        except Exception as export_error:
            located = where_in_model(export_error, model, paths)
            try:
                graph = _copied_or_full(lambda s: _from_dispatch(model, args, kwargs, paths, s),
                                        model, copy_blocks)
            except Exception as eager_error:
                raise _capture_error(eager_error, model, paths) from eager_error
            warnings.warn(f"torch.export could not trace {type(model).__name__} "
                          f"({_first_line(export_error)}{located}); captured by recording one "
                          "eager forward pass instead", stacklevel=2)
    finally:
        model.train(was_training)
        for config in cached:
            config.use_cache = True

    graph.source, graph.takes_positions = source, takes_positions(model)
    # the planner runs its TP layouts on it (planner/forward.py)
    graph.stand_in = stand_in(model, args, kwargs)
    return graph


def _copied_or_full(trace, model: nn.Module, copy_blocks: bool) -> ModelGraph:
    groups = [[(p, model.get_submodule(p)) for p in b.members]
              for b in _repeated_blocks(find_layers(model))]
    return blocks.copied_or_full(trace, groups if copy_blocks else [], _canonical_names(model))


# ---- inputs --------------------------------------------------------------------------------------
def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """The model's call of ``example_inputs``: (args, kwargs) (a dict is passed by keyword, a tuple
    or list positionally, anything else as the one argument)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


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


# ---- tracing -------------------------------------------------------------------------------------
class _RawOp:
    """One traced call before layer assignment."""

    __slots__ = ("name", "op", "args", "kwargs", "outs", "inputs", "params", "module_path",
                 "module_type")

    def __init__(self, name, op, args, kwargs, outs, inputs, params, module_path, module_type):
        self.name, self.op, self.args, self.kwargs, self.outs = name, op, args, kwargs, outs
        self.inputs, self.params, self.module_path, self.module_type = (inputs, params, module_path,
                                                                        module_type)


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


def _from_export(model: nn.Module, args: tuple, kwargs: dict, stand_ins=None) -> ModelGraph:
    with (_quiet_torch_logs(),
          stand_ins.parameters_hidden() if stand_ins else contextlib.nullcontext()):
        ep = torch.export.export(_TensorsOnly(model), args, kwargs, strict=False)
    # the wrapper adds "inner." to every parameter and module path: strip it; tied weights get their
    # first name
    canonical = _canonical_names(model)
    placeholder_target = {s.arg.name: canonical.get(t, t) for s in ep.graph_signature.input_specs
                          if getattr(s.arg, "name", None) and s.target is not None
                          for t in [s.target.removeprefix("inner.")]}
    alias: dict[str, str] = {}  # getitem node -> the multi-output node it unpacks
    raw: list[_RawOp] = []
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
        raw.append(_RawOp(node.name, op, args_v, kwargs_v, outs, inputs, params, module_path,
                          _type_name(module_type)))
    returned = tree_flatten(ep.graph.output_node().args)[0]
    outs = [n.meta.get("val") for n in returned if isinstance(n, torch.fx.Node)]
    outs = [o for o in outs if isinstance(o, torch.Tensor)]
    return _spliced(model, args, kwargs, raw, outs, "torch.export", stand_ins)


def _spliced(model, args, kwargs, raw: list[_RawOp], outs: list, tracer: str,
             stand_ins) -> ModelGraph:
    """The graph of ``raw``, copies of the traced members spliced in where their identical members
    stood in."""
    raw, copied = (blocks.splice(raw, stand_ins, "fx" if tracer == "fx" else "export") if stand_ins
                   else (raw, 0))
    graph = _build(model, args, kwargs, raw, outs, tracer)
    graph.copied_layers = copied
    return graph


class _Recorder(TorchDispatchMode):
    """Records every ATen call with the module stack active at the time."""

    def __init__(self, param_names: dict[int, str], stack: list[tuple[str, str]]):
        super().__init__()
        self.param_names, self.stack = param_names, stack
        self.producer: dict[int, str] = {}
        self.raw: list[_RawOp] = []
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
        self.raw.append(_RawOp(name, str(func), args, kwargs, outs, inputs, params, path, typ))
        return out


def _from_dispatch(model: nn.Module, args: tuple, kwargs: dict, paths: dict[int, str],
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
        recorder = _Recorder(names, stack)
        with recorder:
            out = model(*args, **kwargs)
    finally:
        h1.remove()
        h2.remove()
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return _spliced(model, args, kwargs, recorder.raw, outs, "fx", stand_ins)


def _clean_path(path: str) -> str:
    # older torch.export versions spell paths as "L['self'].h[0].attn"; normalise to "h.0.attn"
    if path.startswith("L['self']"):
        path = path.removeprefix("L['self']").lstrip(".").replace("[", ".").replace("]", "")
    return path


def _type_name(t: Any) -> str:
    return t.rsplit(".", 1)[-1] if isinstance(t, str) else getattr(t, "__name__", str(t))


# ---- layers --------------------------------------------------------------------------------------
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


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _repeated_blocks(layers: list[tuple[str, nn.Module]]) -> list[RepeatedBlock]:
    """Runs of >= 2 consecutive sibling layers with the same class and parameter shapes (non-leaf
    modules only)."""
    blocks: list[RepeatedBlock] = []
    run: list[tuple[str, nn.Module]] = []

    def close():
        if len(run) >= 2 and next(run[0][1].children(), None) is not None:
            kind = type(run[0][1]).__name__
            blocks.append(RepeatedBlock(_parent(run[0][0]) or kind, kind, [p for p, _ in run]))

    for path, mod in layers:
        if run and (_signature(mod) != _signature(run[-1][1])
                    or _parent(path) != _parent(run[-1][0])):
            close()
            run = []
        run.append((path, mod))
    close()
    return blocks


def _execution_order(layer_mods: list[tuple[str, nn.Module]],
                     raw: list[_RawOp]) -> list[tuple[str, nn.Module]]:
    """Layers sorted by when the forward pass first enters them (what a pipeline must follow);
    layers the forward never calls keep their registration order, at the end."""
    paths = [p for p, _ in layer_mods]
    first: dict[str, int] = {}
    for i, r in enumerate(raw):
        lp = _layer_of(r.module_path, tuple(paths))
        if lp is not None:
            first.setdefault(lp, i)
    order = {p: (first.get(p, len(raw)), k) for k, p in enumerate(paths)}
    return sorted(layer_mods, key=lambda pm: order[pm[0]])


# a 126-layer model has thousands of ops and parameters, few module paths
@functools.lru_cache(maxsize=65536)
def _layer_of(path: str, layer_paths: tuple[str, ...]) -> str | None:
    return layer_of(path, layer_paths)


# ---- assembling the graph ------------------------------------------------------------------------
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


def _build(model: nn.Module, args: tuple, kwargs: dict, raw: list[_RawOp], outs: list,
           tracer: str) -> ModelGraph:
    layer_mods = find_layers(model)
    layer_paths = [p for p, _ in layer_mods]
    layer_mods = _execution_order(layer_mods, raw)
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
        layer = _layer_of(r.module_path, tuple(layer_paths)) or last_layer
        node = OpNode(r.name, r.op, rule.op_class, r.inputs, in_shapes, [o.shape for o in out_meta],
                      out_meta[0].dtype if out_meta else "", flops, bwd, rd, wr, r.params,
                      r.module_path, renamed.get(r.module_path, r.module_type), layer or "",
                      r.op not in unknown, _dropout_p(r.op, r.args, r.kwargs))
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
        own_params[_layer_of(p.module_path, tuple(layer_paths))].append(p)
    by_layer: dict[str, list[OpNode]] = defaultdict(list)
    for n in nodes:
        by_layer[n.layer].append(n)
    repeated = _repeated_blocks(layer_mods)
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


def _canonical_names(model: nn.Module) -> dict[str, str]:
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
        mpath = _parent(name)
        is_buffer = not isinstance(t, nn.Parameter)
        out[name] = ParamInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                              t.element_size(), mpath, class_name(modules[mpath]),
                              t.requires_grad and not is_buffer, is_buffer)
    return out


# ---- errors --------------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _capture_error(e: BaseException, model: nn.Module, paths: dict[int, str]) -> CaptureError:
    where = where_in_model(e, model, paths)
    text = str(e)
    if any(s in text for s in ("data-dependent", "Data dependent", "data dependent", "meta tensors",
                               "GuardOnDataDependent", ".item()", "Tensor.item")):
        hint = ("The forward pass depends on tensor values (an `if` on a tensor, .item(), "
                "nonzero()...), which cannot be known while tracing on the meta device. Rewrite it "
                "with torch.where/torch.cond, or compute it from shapes instead of values.")
    elif any(s in text for s in ("Meta tensors", "fake impl", "Meta kernel", "meta kernel")):
        hint = ("The op has no meta-device implementation: register one in kernels_ext, or capture "
                "on real (small) inputs with ap.capture(model, inputs).")
    else:
        hint = "Check that the model runs on the example inputs (their shapes and dtypes)."
    return CaptureError(f"cannot trace {type(model).__name__}{where}: "
                        f"{_first_line(e).rstrip('.')}. {hint}")
