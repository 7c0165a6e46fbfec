"""The fused RMSNorm (``plan.fused_norm``, ``runtime/fused_norm.py``) as the cost model sees it: the
captured graph with each RMSNorm module's ops replaced by the one ``kernels_ext.rms_norm`` op the
runtime calls there, profiled like any graph, so its memory and time come from that op's kernels_ext
rule as every op's do.

What changes (tokens N, hidden H, fp32 statistics): the eager chain of a Hugging Face RMSNorm
(``to``, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``to``, ``mul``) keeps for backward its
input, the rstd and the normalised input (N x H, float32: the statistics are computed in float32);
the fused op keeps the input and the rstd, so each norm saves N x H x 4 bytes of activations.
``nn.RMSNorm`` (``aten.rms_norm``) on CPU is decomposed the same way (its rule saves a
``temp@cpu``); on CUDA torch's own kernel is already fused and nothing is saved.

Time: on CUDA (:func:`one_kernel`) ``kernels_ext.rms_norm`` runs one kernel (Liger-kernel's Triton
kernel when it is installed, else torch's ``_fused_rms_norm``) that reads x and the weight and
writes the output and the rstd, where the chain runs 5-8 kernels that move about 7 N x H x 4 bytes.
On the CPU the op's body runs the chain's kernels (``kernels_ext.fused``: pure PyTorch), so its
bytes and its per-op overhead are the chain's: there it saves memory, not time.
"""

from __future__ import annotations

import dataclasses

import kernels_ext

from ..graph import ModelGraph, OpNode
from ..plan import ITEMSIZE
from .profile import once_per_graph, profile, profile_of
from .tp_styles import packet

FUSED_OP = "kernels_ext.rms_norm.default"
CHAIN_OPS = {"to", "_to_copy", "pow", "mean", "add", "rsqrt", "mul", "_assert_tensor_metadata",
             "type_as", "rms_norm"}
"""the ops an RMSNorm module's eager forward runs (casts, the statistics, the scaling) or torch's
own rms_norm"""


def _module_runs(graph: ModelGraph) -> list[list[OpNode]]:
    """Consecutive nodes of one module, in graph order."""
    runs: list[list[OpNode]] = []
    for n in graph.nodes:
        if runs and runs[-1][0].module_path == n.module_path:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _rms_chain(run: list[OpNode], graph: ModelGraph, readers: dict[str, set[str]],
               dtypes: dict[str, str]) -> tuple[str, str, set[str]] | None:
    """(activation input, weight, no-op casts of the input) when the nodes of one module compute
    RMSNorm with its 1-D weight: only the ops of :data:`CHAIN_OPS`, torch's ``rms_norm`` or ``pow``,
    ``mean`` and ``rsqrt``; one weight, read by the last op (a ``mul``, or ``rms_norm``); one
    activation input from outside; nothing outside reads an op but the last, or a cast of the input
    to its own dtype (``x.to(torch.float32)`` of a float32 ``x`` is ``x``: the residual add may read
    it)."""
    ops = [packet(n.op) for n in run]
    if not run[0].module_path or any(op not in CHAIN_OPS for op in ops):
        return None
    if "rms_norm" not in ops and not {"pow", "mean", "rsqrt"} <= set(ops):
        return None
    compute = [n for n in run if n.op_class != "view"]
    last = compute[-1]
    params = {p for n in run for p in n.params}
    info = graph.params.get(next(iter(params))) if len(params) == 1 else None
    if (info is None or len(info.shape) != 1 or last.params != [info.name]
        or any(n.params for n in compute[:-1])):
        return None
    inside = {n.name for n in run}
    outside = {i for n in run for i in n.inputs if i not in inside}
    if len(outside) != 1:
        return None
    x = next(iter(outside))
    aliases = {n.name for n in compute if packet(n.op) in ("to", "_to_copy") and n.inputs == [x]
               and dtypes.get(x) == n.dtype}
    if any(readers.get(n.name, set()) - inside for n in compute[:-1] if n.name not in aliases):
        return None
    return x, info.name, aliases


def fused_norm_modules(graph: ModelGraph) -> list[str]:
    """The module paths whose ops compute RMSNorm (:func:`fuse_norms` replaces them), in graph
    order."""
    readers, dtypes = _readers(graph)
    return [run[0].module_path for run in _module_runs(graph)
            if _rms_chain(run, graph, readers, dtypes)]


def _readers(graph: ModelGraph) -> tuple[dict[str, set[str]], dict[str, str]]:
    """node or input name -> the nodes that read it; name -> dtype."""
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            readers.setdefault(i, set()).add(n.name)
    return readers, {n.name: n.dtype for n in graph.nodes}


def fuse_norms(graph: ModelGraph, device_kind: str) -> ModelGraph | None:
    """``graph`` as the runtime runs it with ``plan.fused_norm``: each RMSNorm module's ops replaced
    by one ``kernels_ext.rms_norm`` node (named as the module's last op, so its readers are
    unchanged), its bytes one kernel's on CUDA, else the chain's (module docstring); None when the
    graph has no RMSNorm module."""
    readers, dtypes = _readers(graph)
    rule = kernels_ext.lookup(FUSED_OP)
    nodes, fused, alias = [], 0, {}
    for run in _module_runs(graph):
        chain = _rms_chain(run, graph, readers, dtypes)
        if chain is None:
            nodes += [dataclasses.replace(n, inputs=[alias.get(i, i) for i in n.inputs]) if alias
                      else n for n in run]
            continue
        fused += 1
        alias |= dict.fromkeys(chain[2], alias.get(chain[0], chain[0]))  # a no-op cast is its input
        nodes.append(_fused_node(run, chain, graph, rule, device_kind,
                                 alias.get(chain[0], chain[0]), dtypes))
    if not fused:
        return None
    by_name = {n.name for n in nodes}
    layers = [dataclasses.replace(lay, nodes=[m for m in lay.nodes if m in by_name])
              for lay in graph.layers]
    return dataclasses.replace(graph, nodes=nodes, layers=layers)


def one_kernel(device_kind: str) -> bool:
    """Whether the fused RMSNorm runs as one kernel on ``device_kind``: on CUDA (Liger's or torch's
    fused kernel), not on the CPU."""
    return device_kind == "cuda"


_FUSED_PROFILES: dict = {}


def fused_norm_profile(graph: ModelGraph, device_kind: str, *, fp32_ops=(), low_precision_ops=()):
    """The :class:`~.profile.GraphProfile` of :func:`fuse_norms`'s graph (what
    ``Evaluator.norm_prof`` holds), or None when the model has no RMSNorm module; computed once per
    (graph, device kind, op lists) while the graph lives, as :func:`~.profile.profile_of` (the
    planner asks for it on every call: a whole profile each time)."""
    return once_per_graph(_FUSED_PROFILES, graph,
                          (device_kind, tuple(fp32_ops), tuple(low_precision_ops)),
                          lambda: _fused_norm_profile(graph, device_kind, fp32_ops,
                                                      low_precision_ops))


def _fused_norm_profile(graph: ModelGraph, device_kind: str, fp32_ops, low_precision_ops):
    fused = fuse_norms(graph, device_kind)
    if fused is None:
        return None
    prof = profile(fused, device_kind=device_kind, fp32_ops=fp32_ops,
                   low_precision_ops=low_precision_ops)
    # the op's body launches the chain's kernels: the same per-op overhead
    if not one_kernel(device_kind):
        eager = profile_of(graph, device_kind, fp32_ops=fp32_ops,
                           low_precision_ops=low_precision_ops)
        for before, after in zip(eager.layers, prof.layers, strict=True):
            after.n_ops = before.n_ops
    return prof


def _fused_node(run: list[OpNode], chain: tuple[str, str, set[str]], graph: ModelGraph, rule,
                device_kind: str, x: str, dtypes: dict[str, str]) -> OpNode:
    weight = chain[1]
    last = [n for n in run if n.op_class != "view"][-1]
    x_shape = last.out_shapes[0]  # RMSNorm keeps the shape
    w = graph.params[weight]
    out, rows = tuple(last.out_shapes[0]), tuple(last.out_shapes[0][:-1])
    item = kernels_ext.TensorMeta
    dtype_size = ITEMSIZE.get(last.dtype, 4)
    metas = [item(tuple(out), last.dtype, dtype_size), item(rows + (1,), "float32", 4)]
    args = (item(tuple(x_shape), last.dtype, dtype_size), item(tuple(w.shape), w.dtype, w.itemsize),
            1e-6)
    flops = rule.forward_flops(args, {}, metas)
    if one_kernel(device_kind):
        read, written = rule.bytes_moved(args, {}, metas)
    # the op's pure-PyTorch body runs the chain's kernels (a cast to the dtype it has already runs
    # none)
    else:
        kernels = [n for n in run
                   if not (packet(n.op) == "to" and dtypes.get(n.inputs[0]) == n.dtype)]
        read, written = sum(n.bytes_read for n in kernels), sum(n.bytes_written for n in kernels)
    return OpNode(last.name, FUSED_OP, rule.op_class, [x], [tuple(x_shape), tuple(w.shape)],
                  [out, rows + (1,)], last.dtype, flops, flops * rule.backward_factor, read,
                  written, [weight], last.module_path, last.module_type, last.layer)


def saved_per_norm(tokens: int, hidden: int) -> int:
    """Bytes of activations one fused RMSNorm saves against the eager chain: the float32 normalised
    input, N x H x 4 (module docstring)."""
    return tokens * hidden * 4


def chain_bytes(tokens: int, hidden: int) -> int:
    """Bytes the eager chain of a float32 Hugging Face RMSNorm moves in forward: ``pow`` (2 NH),
    ``mean`` (NH + N), ``add`` and ``rsqrt`` (2 N each), ``mul`` by the rstd (2 NH + N), ``mul`` by
    the weight (2 NH + H), times 4 bytes; its two casts (``to(float32)``, ``to(input_dtype)``) hand
    back their float32 input and move nothing."""
    nh, n = tokens * hidden, tokens
    return 4 * (7 * nh + 6 * n + hidden)


def fused_bytes(tokens: int, hidden: int) -> int:
    """Bytes the fused kernel moves in forward: reads x and the weight, writes the output and the
    rstd (x 4)."""
    return 4 * (2 * tokens * hidden + hidden + tokens)


__all__ = ["chain_bytes", "fuse_norms", "fused_bytes", "fused_norm_modules", "fused_norm_profile",
           "saved_per_norm"]
