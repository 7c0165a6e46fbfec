"""What every pass reads about the graph's tensors, computed once per profile: sizes and dtypes,
which storage each view shares, attention-score tensors, what requires grad, the tensor-parallel
styles; and the same under each autocast precision."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kernels_ext import moe_rules

from ...plan import ITEMSIZE, within
from ..autocast import AmpDtypes, amp_dtypes
from ..tp_styles import Walk, packet, rule_of, tp_walk
from .layers import LayerProfile

FLOAT = {"float64", "float32", "float16", "bfloat16"}


class Size(NamedTuple):
    """A tensor's elements, bytes per element and whether it is floating point."""

    numel: int
    itemsize: int
    floating: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class Facts:
    """What the passes of :func:`~.driver.profile` read about the graph's tensors, computed once."""

    graph: Any
    by_name: dict[str, Any]
    size: dict[str, Size]
    """tensor (a node's first output or a graph input) -> numel, itemsize, floating point"""
    dtype: dict[str, str]
    """tensor -> its dtype (as captured; under autocast in the facts :func:`amp_facts` makes)"""
    root: dict[str, str]
    """node -> the node whose storage it is a view of (itself when it owns one)"""
    noncontig: dict[str, bool]
    """node -> a non-contiguous view"""
    scores: set[str]
    """attention-score sized nodes (seq x seq)"""
    param_views: set[str]
    """views of parameters (an expert weight's transpose): held as parameters, never saved as
    activations"""
    tp: Walk
    """the TP styles :func:`..tp_styles.tp_walk` derives from dataflow (styles, head, sharded,
    regions, heads, parts)"""
    grad: set[str] = field(default_factory=set)
    """nodes whose output requires grad (a trainable parameter upstream): only their ops are
    recorded by autograd; the rest (masks, rotary cos/sin, position ids) save nothing"""
    autocast: AmpDtypes | None = None
    """the dtypes under autocast (None: the captured, float32 forward)"""
    routed: frozenset[str] = frozenset()
    """nodes of an experts module with one row per (token, choice) pair, as many as its first
    grouped matmul reads: under expert parallelism, the rows the router sends to a rank's experts
    (:func:`routed_rows`)"""


def graph_facts(graph, refused: dict[str, str], device_kind: str = "cuda") -> Facts:
    """The facts of ``graph``'s captured (float32) forward; ``refused`` is filled with the modules
    TP must not split, and why."""
    by_name = {n.name: n for n in graph.nodes}
    size, dtype = _sizes(graph)
    numels = {n.name: size[n.name].numel for n in graph.nodes}
    # modules whose split forward failed on stand-in tensors at plan time (planner/forward.py) stay
    # whole
    kept = getattr(graph, "tp_refused", {})
    keep = {n.name: why for n in graph.nodes for m, why in kept.items() if n.params
            and within(n.module_path, m)}
    refused.update(keep)
    tp = Walk(*tp_walk(graph, by_name, numels, refused, keep))
    root, noncontig = _storages(graph.nodes, device_kind, dtype)
    scores, param_views = _attention_scores(graph.nodes), _parameter_views(graph.nodes)
    return Facts(graph, by_name, size, dtype, root, noncontig, scores, param_views, tp,
                 _requires_grad(graph), routed=routed_rows(graph))


def amp_facts(f: Facts, device_kind: str, *, low_params: bool, fp32_ops=(),
              low_precision_ops=()) -> Facts:
    """``f`` as the forward runs under bf16 autocast (fp16 has the same sizes): every tensor at its
    dtype there (:mod:`..autocast`), views and no-op casts resolved again (a ``.to(float32)`` of a
    16-bit tensor copies). ``low_params``: the parameters themselves are 16-bit (FSDP's
    MixedPrecisionPolicy)."""
    amp = amp_dtypes(f.graph, f.dtype, device_kind=device_kind,
                     param_dtype="bfloat16" if low_params else None, fp32_ops=fp32_ops,
                     low_precision_ops=low_precision_ops)
    size = {k: v._replace(itemsize=ITEMSIZE[amp.dtype[k]]) if v.floating and k in amp.dtype else v
            for k, v in f.size.items()}
    graph, by_name = f.graph, f.by_name
    if amp.reads:  # the inputs ops really read there (AmpDtypes.reads)
        graph = copy.copy(f.graph)
        graph.nodes = [replace(n, inputs=amp.reads[n.name]) if n.name in amp.reads else n
                       for n in f.graph.nodes]
        by_name = {n.name: n for n in graph.nodes}
    root, noncontig = _storages(graph.nodes, device_kind, amp.dtype)
    return replace(f, graph=graph, by_name=by_name, size=size, dtype=amp.dtype, root=root,
                   noncontig=noncontig, autocast=amp)


def routed_rows(graph) -> frozenset[str]:
    """The nodes of each experts module (one that runs a grouped matmul over stacked expert weights,
    ``kernels_ext.moe_rules``) whose first dim is the rows of its first grouped matmul: the (token,
    choice) pairs, sorted, gathered, through the experts and weighted. Under expert parallelism a
    rank's experts run them on the rows the router sent it, balanced or not (``runtime/ep.py``: its
    local forward on the all-to-all's output); the tensors per token (the sum over the choices, the
    module's output) stay with the rank's own tokens."""
    grouped = {r.name for r in moe_rules.GROUPED_MATMULS}
    rows: dict[str, int] = {}
    for n in graph.nodes:
        if n.op.rpartition(".")[0] in grouped and n.in_shapes and n.in_shapes[0]:
            rows.setdefault(n.module_path, n.in_shapes[0][0])
    return frozenset(n.name for n in graph.nodes
                     if n.out_shapes and n.out_shapes[0]
                     and any(within(n.module_path, m) and n.out_shapes[0][0] == r
                             for m, r in rows.items()))


def _requires_grad(graph) -> set[str]:
    """Nodes with a floating output that depends on a trainable parameter (autograd's
    requires_grad)."""
    trainable = {name for name, p in graph.params.items() if p.trainable}
    grad: set[str] = set()
    for n in graph.nodes:
        if n.dtype in FLOAT and (any(p in trainable for p in n.params)
                                 or any(i in grad for i in n.inputs)):
            grad.add(n.name)
    return grad


def _sizes(graph) -> tuple[dict[str, Size], dict[str, str]]:
    """Sizes and dtypes of every node's (first) output and of the graph inputs. A graph input is
    named by the nodes that read it; it takes the example inputs in the order the nodes first read
    one."""
    size = {n.name: Size(numel(n.out_shapes[0]) if n.out_shapes else 0, ITEMSIZE.get(n.dtype, 4),
                         n.dtype in FLOAT)
            for n in graph.nodes}
    dtype = {n.name: n.dtype for n in graph.nodes}
    inputs = list(graph.inputs)
    placeholders = 0
    for n in graph.nodes:
        for name in n.inputs:
            if name not in size:
                ti = inputs[min(placeholders, len(inputs) - 1)] if inputs else None
                size[name] = (Size(ti.numel, ti.itemsize, ti.dtype in FLOAT) if ti
                              else Size(0, 4, True))
                dtype[name] = ti.dtype if ti else "float32"
                placeholders += 1
    return size, dtype


def _storages(nodes, device_kind: str, dtype: dict[str, str]
              ) -> tuple[dict[str, str], dict[str, bool]]:
    """(node -> the node that owns its storage, node -> a non-contiguous view), from each view's
    rule layout and each tensor's ``dtype``."""
    root: dict[str, str] = {}
    noncontig: dict[str, bool] = {}
    attention_out: set[str] = set()
    permuted = _permuted(nodes)
    for n in nodes:
        if n.op_class == "attention" and not math_attention(n, device_kind) and (
                device_kind != "cpu" or (n.inputs and n.inputs[0] in permuted)):
            # CUDA's fused kernels write (B, T, nh, hd), the CPU flash kernel the query's layout
            attention_out.add(n.name)
        src = n.inputs[0] if n.inputs else None
        returns_src = src is not None and _returns_input(n, dtype.get(src), dtype.get(n.name),
                                                         noncontig.get(src, False))
        if returns_src:
            root[n.name], noncontig[n.name] = root.get(src, src), noncontig.get(src, False)
            if src in attention_out:
                attention_out.add(n.name)
        elif n.op_class == "view" and src is not None:
            rule = rule_of(n.op)
            layout = rule.layout if rule is not None else ""
            base_nc = noncontig.get(src, False)
            if packet(n.op) == "transpose" and src in attention_out:
                # fused attention kernels return (B, nh, T, hd) as a transposed view of a
                # (B, T, nh, hd) buffer: transposing back is contiguous, and the out-projection
                # saves it without a copy
                root[n.name], noncontig[n.name] = root.get(src, src), False
            elif layout == "strided":
                root[n.name], noncontig[n.name] = root.get(src, src), True
            elif layout == "reshape" and base_nc:
                # a reshape of a non-contiguous view copies
                root[n.name], noncontig[n.name] = n.name, False
            else:
                root[n.name], noncontig[n.name] = root.get(src, src), base_nc
        else:
            root[n.name], noncontig[n.name] = n.name, False
    return root, noncontig


def _permuted(nodes) -> set[str]:
    """Tensors laid out transposed in memory: a transpose's view, and what an elementwise op makes
    from one (its output follows its first full-size input's strides, as TensorIterator orders
    dimensions); a second transpose undoes it, a copy (contiguous, reshape, cat) ends it."""
    out: set[str] = set()
    shape = {n.name: tuple(n.out_shapes[0]) if n.out_shapes else () for n in nodes}
    for n in nodes:
        src = n.inputs[0] if n.inputs else None
        if src is None:
            continue
        name = packet(n.op)
        if name == "transpose":
            if src not in out:
                out.add(n.name)
        elif n.op_class == "view" and name not in ("reshape", "view", "flatten", "_unsafe_view"):
            if src in out:
                out.add(n.name)
        elif n.op_class == "elementwise" and name not in ("cat", "stack", "contiguous", "clone"):
            full = [i for i in n.inputs if shape.get(i) == shape[n.name]]
            if full and full[0] in out:
                out.add(n.name)
    return out


_NO_OP_IF_SAME = ("to", "_to_copy", "type_as", "contiguous")
"""ops that return their input itself when nothing changes (same dtype; contiguous already)"""


def _returns_input(n, src_dtype: str | None, dtype: str | None, src_noncontig: bool) -> bool:
    """The op returns its input tensor: ``x.to(x.dtype)``, ``x.contiguous()`` of a contiguous ``x``,
    dropout with p = 0 (ATen's ``dropout`` returns the input then: nothing is saved), a reshape to
    the same shape."""
    if n.dropout_p == 0.0 and n.op_class != "attention":
        return True
    name = packet(n.op)
    copies = name == "contiguous" and src_noncontig
    if name in _NO_OP_IF_SAME and src_dtype == dtype and not copies:
        return name != "_to_copy"  # _to_copy always copies; .to() is the op that may return self
    return name in ("reshape", "view") and len(n.in_shapes) == 1 and n.out_shapes and \
        tuple(n.in_shapes[0]) == tuple(n.out_shapes[0])


def _parameter_views(nodes) -> set[str]:
    """View nodes of parameters only (``w.transpose(-2, -1)``, and views of those)."""
    views: set[str] = set()
    for n in nodes:
        if n.op_class == "view" and (n.params or n.inputs) and all(i in views for i in n.inputs):
            views.add(n.name)
    return views


def _attention_scores(nodes) -> set[str]:
    """Attention scores by dataflow: the output of an activation x activation matmul (q @ k^T),
    carried through the ops that follow (scale, mask, softmax, dropout) until the next such matmul
    (scores @ v) consumes it."""
    scores: set[str] = set()
    for n in nodes:
        if n.op_class == "matmul" and not n.params and len(n.inputs) >= 2:
            batched = n.out_shapes and len(n.out_shapes[0]) >= 3
            if not any(i in scores for i in n.inputs) and batched:
                scores.add(n.name)
        elif n.op_class not in ("attention", "matmul") and any(i in scores for i in n.inputs):
            scores.add(n.name)
    return scores


def returns_input(n, f: Facts) -> bool:
    """Op ``n`` (not a view) hands back its input tensor and runs no kernel (:func:`_returns_input`:
    dropout with p = 0, ``.to`` its own dtype, ``contiguous`` of a contiguous tensor): it moves no
    bytes."""
    return n.op_class != "view" and f.root.get(n.name, n.name) != n.name


def in_layers(layers: dict[str, LayerProfile], f: Facts):
    """(layer profile, node) for every node of a profiled layer, in graph order."""
    for n in f.graph.nodes:
        lp = layers.get(n.layer)
        if lp is not None:
            yield lp, n


def weight_matmul(n) -> bool:
    """Op ``n`` runs as one ``mm`` / ``addmm`` kernel (a Linear, a Conv1D's ``addmm``, ``x @ w`` of
    a 2-D right operand): what ``runtime/ac.py``'s selective recompute counts
    (``ALTERNATE_OPS``)."""
    name = packet(n.op)
    if name in ("linear", "mm", "addmm"):
        return True
    ranks = [len(s) for s in n.in_shapes[:2]]
    return name == "matmul" and len(ranks) == 2 and ranks[1] == 2 and ranks[0] >= 2


def selective_recomputes(layers: dict[str, LayerProfile], f: Facts) -> frozenset[str]:
    """The weight matmuls selective recompute runs again (``runtime/ac.py``): the second,
    fourth, ... of each layer's forward."""
    count = dict.fromkeys(layers, 0)
    again = set()
    for lp, n in in_layers(layers, f):
        if n.op_class == "matmul" and n.out_shapes and weight_matmul(n):
            count[lp.path] += 1
            if count[lp.path] % 2 == 0:
                again.add(n.name)
    return frozenset(again)


def math_attention(n, device_kind: str) -> bool:
    """SDPA that runs PyTorch's math kernel: on CPU with dropout (the CPU flash kernel has no
    dropout). It saves scaled copies of q and k, v, and three score-sized tensors (softmax output,
    dropout noise, dropped weights), not its output, which it returns contiguous in (B, nh, T,
    hd)."""
    return device_kind == "cpu" and n.op_class == "attention" and bool(n.dropout_p)


def scores_numel(n) -> int:
    """Elements of attention op ``n``'s score matrix: the query's leading dims and length times the
    keys' length."""
    (*lead, _), kshape = n.in_shapes[0], n.in_shapes[1]
    return numel(lead) * kshape[-2]


def numel(shape) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n
