"""One node of the graph view (an op, or a module's ops drawn as one): its colour and tag from the
split the plan gives the ops holding its weights, its label, its shapes, and what a drag of it onto
a legend swatch re-plans.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..graph import ModelGraph, OpNode
from ..plan import Plan
from .splits import SPLIT_PRIORITY, SPLITS, fill, split_of


def node_fill(graph: ModelGraph, plan: Plan | None, by_name: dict[str, OpNode],
              ops: list[OpNode], reps: list[str]) -> tuple[str, str, list[str], str]:
    """(fill colour, tag, the distinct splits, how the members differ) of the node showing ``ops``:
    the split of the ops holding its weights, or where the members ``reps`` of a folded block split
    it differently, each member's split."""
    # a module's colour: the ops holding its weights
    weighted = [o for o in ops if o.params] or ops
    color, tag, distinct = fill([split_of(o, plan, graph) for o in weighted])
    per_member = member_splits(graph, plan, by_name, ops, reps) if len(reps) > 1 else []
    if len(set(per_member)) <= 1:
        return color, tag, distinct, ""
    color, tag, distinct = fill(per_member)
    note = ", ".join(f"{SPLITS[k][0]} on {n} of {len(reps)}"
                     for k, n in Counter(per_member).most_common())
    return color, tag, distinct, note


def member_splits(graph: ModelGraph, plan: Plan | None, by_name: dict[str, OpNode],
                  vid_ops: list[OpNode], reps: list[str]) -> list[str]:
    """The split of this node in each member of a folded block (the same-position ops of every
    member)."""
    out = []
    for m in reps:
        offset = graph.layer(m).nodes
        first = graph.layer(reps[0]).nodes
        pos = {name: i for i, name in enumerate(first)}
        ops = [by_name[offset[pos[o.name]]] for o in vid_ops if o.name in pos]
        ops = [o for o in ops if o.params] or ops
        s = {split_of(o, plan, graph) for o in ops}
        out.append(min(s, key=SPLIT_PRIORITY.index))  # the member's most telling split
    return out


def node_shapes(graph: ModelGraph, by_name: dict[str, OpNode],
                ops: list[OpNode]) -> tuple[list[str], list[str]]:
    """(the shapes the node's first op reads, the shapes its last op makes), in words."""
    first = ops[0]
    shapes = [shape_text(s) for s in (first if len(ops) == 1 else ops[-1]).out_shapes]
    in_shapes = []
    for src in first.inputs:
        sn = by_name.get(src)
        if sn is not None and sn.out_shapes:
            in_shapes.append(shape_text(sn.out_shapes[0]))
        else:
            gi = graph_input_shape(graph, src)
            if gi:
                in_shapes.append(gi)
    return in_shapes, shapes


def node_label(graph: ModelGraph, layer_of: dict[str, Any], it: dict[str, Any], reps: list[str],
               shapes: list[str], tag: str) -> tuple[str, str]:
    """(the node's label, the name the front end shows for it): an op's name and output shape, or
    a module's name, type and op count; the split's tag after either."""
    ops = it["ops"]
    first = ops[0]
    suffix = f" · {tag}" if tag else ""
    if it["kind"] == "op":
        return f"{short_op(first.op)}\n{shapes[0] if shapes else ''}{suffix}", first.name
    mod = it["path"]
    mtype = layer_of[it["layer"]].modules.get(mod) or (first.module_type
                                                       if first.module_path == mod else "")
    name = ((f"{graph.block_of(mod).name}.*" if len(reps) > 1 else mod)
            if mod == it["layer"] else mod.rsplit(".", 1)[-1])
    return f"{name}\n{mtype + ' · ' if mtype else ''}{len(ops)} ops{suffix}", mod


def param_bytes(graph: ModelGraph, params: set[str]) -> int:
    """Bytes of the parameters ``params`` (names the graph does not hold count nothing)."""
    return sum(graph.params[p].numel * graph.params[p].itemsize for p in params
               if p in graph.params)


def node_target(graph: ModelGraph, layer: str, module: str, reps: list[str],
                has_params: bool) -> dict[str, Any]:
    """What a drag of this node onto a legend swatch re-plans: the override pattern (the module
    inside the layer, or the same module in every member of a folded block) and the layers it
    covers; ``None`` pattern without parameters."""
    if not has_params:
        return {"pattern": None, "layers": reps,
                "why": "this op has no parameters to split: drag its layer's cluster, or a node "
                       "with weights"}
    if len(reps) > 1:
        block = graph.block_of(layer)
        suffix = module[len(layer):] if module.startswith(layer) else ""
        return {"pattern": f"{block.name}.*{suffix}", "layers": reps}
    return {"pattern": module or layer, "layers": reps}


def graph_input_shape(graph: ModelGraph, name: str) -> str | None:
    """The shape of the graph's input, in words, when it has only one (None otherwise)."""
    if len(graph.inputs) == 1:
        return shape_text(graph.inputs[0].shape)
    return None


def shape_text(s: tuple[int, ...]) -> str:
    """``(8, 128)`` -> ``"8×128"``; ``()`` -> ``"scalar"``."""
    return "×".join(map(str, s)) if s else "scalar"


def short_op(op: str) -> str:
    """``"aten.linear.default"`` -> ``"linear"``; scaled dot-product attention -> ``"sdpa"``."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else op
    return {"scaled_dot_product_attention": "sdpa"}.get(name, name)
