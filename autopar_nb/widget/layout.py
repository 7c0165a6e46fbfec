"""ModelGraph + Plan -> DOT -> SVG: the graph view of the planner widget.

Ops are grouped in module clusters (one per layer, nested for submodules with several ops), repeated blocks are folded
into one group ("h × 12") unless expanded, nodes are coloured by the split the plan gives their module, layer clusters
are tinted by pipeline stage, and edges where communication happens carry the collective and its bytes per step.

Rendering uses the system ``dot`` when there is one, else the ``graphviz-pure`` wheel's binary, found next to this
Python (``sysconfig.get_path("scripts")``) rather than on the kernel's PATH, which may lack the venv's ``bin``.
"""

from __future__ import annotations

import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..graph import ModelGraph, OpNode, human
from ..plan import DTYPE_NAMES, ITEMSIZE, Plan

# split key -> (legend label, fill colour). Colour-blind-safe-ish palette (Okabe–Ito based), light fills so labels read.
SPLITS: dict[str, tuple[str, str]] = {
    "replicated": ("replicated", "#e6e6e6"),
    "fsdp": ("FSDP-sharded", "#9ecae1"),
    "tp-colwise": ("TP column", "#fdae6b"),
    "tp-rowwise": ("TP row", "#d4a6e8"),
    "sequence-parallel": ("sequence parallel", "#a1d99b"),
    "vocab-parallel": ("vocab-parallel / embedding-sharded", "#f4a3a8"),
    "activation": ("no parameters", "#ffffff"),
}
# pipeline stage hues: cluster outline and a pale background tint
STAGE_COLORS = ["#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#d6616b", "#8c6d31", "#17becf"]
STAGE_FILLS = ["#f0f6fc", "#fdf3ec", "#eff8f0", "#f4f3fa", "#f5f5f5", "#fbf0f1", "#f8f5ee", "#eefafc"]
CHANGED_COLOR = "#ff7f0e"
COLLECTIVE_COLOR = "#c0392b"
OUTPUT = "__output__"
"""name of the graph-output pseudo node (edges from the last layer's unconsumed ops)"""
MAX_OPS_SHOWN = 400
"""above this many visible ops the default depth collapses ops into their modules"""


@dataclass
class Layout:
    """The DOT source of one view plus what the front end needs to make it interactive."""

    dot: str
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SVG element id -> {label, kind (op|module|input), op, layer, module, shapes, flops, memory, split, stage}"""
    clusters: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SVG cluster id -> {layer, block (name when it is a folded repeated block), label}"""
    depth: int = 99
    """module depth shown below each layer (0 = one node per layer)"""
    max_depth: int = 0
    """deepest module nesting in the graph (the depth control's range)"""
    legend: list[dict[str, str]] = field(default_factory=list)


def dot_binary() -> str:
    """Path of the layout program: system ``dot`` if present, else the ``graphviz-pure`` script of this Python."""
    found = shutil.which("dot")
    if found:
        return found
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        for name in ("graphviz-pure", "graphviz-pure.exe", "dot"):
            p = Path(folder) / name
            if p.is_file():
                return str(p)
    raise RuntimeError("no graphviz layout program found: install the system package (apt-get install graphviz) "
                       "or the wheel (pip install graphviz-pure) into this Python's environment")


def render_svg(dot: str) -> str:
    """Lay out DOT source and return the SVG text (no XML prolog)."""
    import graphviz
    import graphviz.backend.dot_command as dot_command

    dot_command.DOT_BINARY = Path(dot_binary())
    svg = graphviz.Source(dot, engine="dot").pipe(format="svg", encoding="utf-8", quiet=True)
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else svg


def split_of(node: OpNode, plan: Plan | None, graph: ModelGraph) -> str:
    """The legend key of the split ``plan`` gives ``node``'s module (see SPLITS)."""
    if plan is None:
        return "replicated" if node.params else "activation"
    try:
        lp = plan.layer(node.layer)
    except KeyError:
        return "replicated" if node.params else "activation"
    style = lp.tp.get(node.module_path) if plan.mesh.tp > 1 or lp.tp else None
    if node.params:
        if style == "rowwise" and node.op_class == "embedding":
            return "vocab-parallel"
        if style == "colwise" and node.op_class == "embedding":
            return "vocab-parallel"
        if style == "colwise" and plan.loss_parallel and node.layer == graph.layers[-1].path:
            return "vocab-parallel"
        if style == "colwise":
            return "tp-colwise"
        if style == "rowwise":
            return "tp-rowwise"
        if style == "sequence_parallel" or (lp.sequence_parallel and node.op_class == "norm"):
            return "sequence-parallel"
        if plan.mesh.zero_stage >= 2 and plan.mesh.dp > 1 and lp.fsdp:
            return "fsdp"
        return "replicated"
    if lp.sequence_parallel and node.op_class in ("norm", "elementwise") and style != "replicate":
        return "sequence-parallel"
    return "activation"


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = ITEMSIZE.get(dtype, 4)
    for s in shape:
        n *= s
    return n


def _shape(s: tuple[int, ...]) -> str:
    return "×".join(map(str, s)) if s else "scalar"


def _q(s: str) -> str:
    """A DOT double-quoted string; newlines become DOT line breaks."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _sid(prefix: str, name: str) -> str:
    return prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _short_op(op: str) -> str:
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else op
    return {"scaled_dot_product_attention": "sdpa"}.get(name, name)


def comm_edges(graph: ModelGraph, plan: Plan | None) -> dict[tuple[str, str], str]:
    """(src op, dst op) -> label for edges that carry communication: TP collectives from kernels_ext split rules
    (on the op's output or input) and pipeline send/recv between stages. Bytes are per rank per optimizer step
    (the edge's tensor over the local batch, global_batch / dp samples)."""
    if plan is None:
        return {}
    from kernels_ext import lookup

    scale = plan.batch.global_batch / max(1, graph.batch_size) / max(1, plan.mesh.dp)
    act_dtype = DTYPE_NAMES.get(plan.precision.amp)  # None without autocast: the op's own dtype
    stage = {lp.path: lp.stage for lp in plan.layers}
    by_name = {n.name: n for n in graph.nodes}
    consumers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for src in n.inputs:
            consumers.setdefault(src, []).append(n.name)
    out: dict[tuple[str, str], str] = {}
    final = {n.name for n in graph.nodes if not consumers.get(n.name) and n.layer == graph.layers[-1].path}

    def size(n: OpNode) -> str:
        b = sum(_nbytes(s, act_dtype or n.dtype) for s in n.out_shapes[:1]) * scale
        return f"{human(b).replace(' ', ' ')}B"

    for n in graph.nodes:
        for src in n.inputs:
            s = by_name.get(src)
            if s is not None and stage.get(s.layer, 0) != stage.get(n.layer, 0):
                out[(src, n.name)] = f"send/recv {size(s)}"
        if plan.mesh.tp <= 1:
            continue
        try:
            style = plan.layer(n.layer).tp.get(n.module_path)
            sp = plan.layer(n.layer).sequence_parallel
        except KeyError:
            continue
        rule = lookup(n.op) if style else None
        split = rule.splits.get(style) if rule else None
        if split is None:
            continue
        if split.comm_on == "output" and split.forward:
            kind = "reduce-scatter" if sp and split.forward == "all_reduce" else split.forward.replace("_", "-")
            for m in consumers.get(n.name, []) + ([OUTPUT] if n.name in final else []):
                out[(n.name, m)] = f"{kind} {size(n)}"
        elif split.comm_on == "input" and (split.backward or split.forward):
            kind = (split.forward or split.backward).replace("_", "-")
            if sp and split.forward is None:
                kind = "all-gather"
            for src in n.inputs:
                s = by_name.get(src)
                label = size(s) if s is not None else _input_size(graph, src, scale, act_dtype)
                out[(src, n.name)] = f"{kind}{' (bwd)' if not split.forward and not sp else ''} {label}"
    return out


def layout(graph: ModelGraph, plan: Plan | None = None, *, expanded: set[str] | frozenset[str] = frozenset(),
           depth: int | None = None, changed_layers: set[str] | frozenset[str] = frozenset(),
           selected: str | None = None) -> Layout:
    """Build the DOT view of ``graph`` coloured by ``plan``.

    ``expanded`` names repeated blocks to show in full (others are folded into their first member); ``depth`` is the
    module depth below each layer to show (None: all ops, or less when that exceeds MAX_OPS_SHOWN);
    ``changed_layers`` are outlined as changed against the previous plan; ``selected`` is a layer to emphasise.
    """
    # ---- folding: ops of hidden block members map onto the same-position op of the first member
    alias: dict[str, str] = {}
    hidden_layers: set[str] = set()
    folded: dict[str, int] = {}
    for b in graph.blocks:
        if b.name in expanded or b.count < 2:
            continue
        first = graph.layer(b.members[0]).nodes
        if not all(len(graph.layer(m).nodes) == len(first) for m in b.members):
            continue
        folded[b.members[0]] = b.count
        for m in b.members[1:]:
            hidden_layers.add(m)
            alias.update(zip(graph.layer(m).nodes, first, strict=True))
    visible_ops = [n for n in graph.nodes if n.name not in alias]

    layer_of = {layer.path: layer for layer in graph.layers}
    by_name = {n.name: n for n in graph.nodes}
    block_name = {m: b.name for b in graph.blocks for m in b.members}

    def rel(n: OpNode) -> list[str]:
        lp = n.layer
        if n.module_path == lp or not n.module_path.startswith(lp + "."):
            return []
        return n.module_path[len(lp) + 1:].split(".")

    max_depth = max((len(rel(n)) for n in visible_ops), default=0) + 1
    if depth is None:
        depth = max_depth
        while depth > 0 and len({_vis_key(n, rel(n), depth) for n in visible_ops}) > MAX_OPS_SHOWN:
            depth -= 1
    depth = max(0, min(depth, max_depth))

    stage = {lp.path: lp.stage for lp in plan.layers} if plan else {}
    keys = {n.name: _vis_key(n, rel(n), depth) for n in visible_ops}
    members: dict[str, int] = {}
    for k in keys.values():
        members[k] = members.get(k, 0) + 1
    node_vis: dict[str, str] = {}
    items: dict[str, dict[str, Any]] = {}
    for n in visible_ops:
        key = keys[n.name] if members[keys[n.name]] > 1 else n.name
        vid = _sid("op-", n.name) if key == n.name else _sid("mod-", key)
        node_vis[n.name] = vid
        split = split_of(n, plan, graph)
        if vid not in items:
            items[vid] = {"kind": "op" if key == n.name else "module", "layer": n.layer, "module": n.module_path,
                          "ops": [], "flops": 0.0, "act": 0, "params": set(), "splits": [], "path": key}
        it = items[vid]
        it["ops"].append(n)
        it["flops"] += n.flops
        it["act"] += sum(_nbytes(s, n.dtype) for s in n.out_shapes)
        it["params"].update(n.params)
        it["splits"].append(split)
    for n in graph.nodes:
        if n.name in alias:
            node_vis[n.name] = node_vis[alias[n.name]]

    count = folded
    info: dict[str, dict[str, Any]] = {}
    clusters: dict[str, dict[str, Any]] = {}
    lines = ["digraph G {",
             '  graph [rankdir=TB, nodesep=0.25, ranksep=0.3, fontname="Helvetica", fontsize=11, '
             'bgcolor="transparent", newrank=true];',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, height=0.3, '
             'margin="0.08,0.03", penwidth=1, color="#555555"];',
             '  edge [color="#777777", arrowsize=0.6, fontname="Helvetica", fontsize=8];']

    # graph inputs
    inputs = sorted({i for n in visible_ops for i in n.inputs if i not in node_vis})
    for i in inputs:
        iid = _sid("in-", i)
        node_vis[i] = iid
        lines.append(f"  {_q(iid)} [id={_q(iid)}, label={_q(i)}, shape=ellipse, style=filled, fillcolor=\"#ffffff\"];")
        info[iid] = {"kind": "input", "label": i, "layer": None}

    # nest items by module path inside their layer cluster
    by_layer: dict[str, list[str]] = {}
    for vid, it in items.items():
        by_layer.setdefault(it["layer"], []).append(vid)
    for li, layer in enumerate(graph.layers):
        if layer.path in hidden_layers or layer.path not in by_layer:
            continue
        st = stage.get(layer.path, 0)
        reps = count.get(layer.path, 1)
        block = graph.block_of(layer.path)
        label = f"{block.name} × {reps}" if reps > 1 else layer.path
        label += f"  ·  {layer.type}"
        if plan is not None and plan.mesh.pp * plan.pipeline.virtual_stages > 1:
            stages = sorted({stage.get(m, 0) for m in block.members}) if reps > 1 else [st]
            label += f"  ·  stage {stages[0]}" if len(stages) == 1 else f"  ·  stages {stages[0]}–{stages[-1]}"
        grad_comm = _param_collectives(layer, plan)
        if grad_comm:
            label += f"\n{grad_comm}"
        cid = _sid("cl-", layer.path)
        clusters[cid] = {"layer": layer.path, "block": block.name if reps > 1 else None, "label": label,
                         "expandable": bool(reps > 1),
                         "collapsible": bool(block is not None and reps == 1 and block.name in expanded)}
        changed = layer.path in changed_layers or (reps > 1 and any(m in changed_layers for m in block.members))
        color = CHANGED_COLOR if changed else STAGE_COLORS[st % len(STAGE_COLORS)]
        width = 3 if changed or layer.path == selected else 1.5
        style = "rounded,filled,dashed" if reps > 1 else "rounded,filled"
        lines.append(f"  subgraph {_q('cluster_' + str(li))} {{")
        lines.append(f"    id={_q(cid)}; label={_q(label)}; labeljust=l; style={_q(style)}; "
                     f"fillcolor={_q(STAGE_FILLS[st % len(STAGE_FILLS)])}; color={_q(color)}; penwidth={width};")
        _emit_modules(lines, by_layer[layer.path], items, layer.path, li)
        lines.append("  }")
        for vid in by_layer[layer.path]:
            it = items[vid]
            ops = it["ops"]
            first = ops[0]
            splits = [s for s in it["splits"] if s != "activation"] or ["activation"]
            split = max(set(splits), key=splits.count)
            shapes = [_shape(s) for s in first.out_shapes] if len(ops) == 1 else [_shape(s) for s in ops[-1].out_shapes]
            in_shapes = []
            for src in first.inputs:
                sn = by_name.get(src)
                if sn is not None and sn.out_shapes:
                    in_shapes.append(_shape(sn.out_shapes[0]))
                else:
                    gi = _graph_input_shape(graph, src)
                    if gi:
                        in_shapes.append(gi)
            pbytes = sum(graph.params[p].numel * graph.params[p].itemsize for p in it["params"] if p in graph.params)
            if it["kind"] == "op":
                label = f"{_short_op(first.op)}\n{shapes[0] if shapes else ''}"
                title = first.name
            else:
                mod = it["path"]
                mtype = layer_of[it["layer"]].modules.get(mod) or first.module_type
                label = f"{mod.rsplit('.', 1)[-1]}\n{mtype or ''} · {len(ops)} ops"
                title = mod
            info[vid] = {"kind": it["kind"], "label": title, "op": first.op if len(ops) == 1 else
                         ", ".join(sorted({_short_op(o.op) for o in ops})[:6]),
                         "layer": it["layer"], "module": first.module_path if len(ops) == 1 else it["path"],
                         "in_shapes": in_shapes, "out_shapes": shapes, "flops": it["flops"] * reps,
                         "flops_each": it["flops"], "act_bytes": it["act"], "param_bytes": pbytes,
                         "split": split, "stage": st, "repeats": reps, "ops": len(ops)}
            attrs = f"id={_q(vid)}, label={_q(label)}, fillcolor={_q(SPLITS[split][1])}"
            if split == "activation":
                attrs += ', color="#999999"'
            if layer.path == selected:
                attrs += ", penwidth=2"
            lines.append(f"  {_q(vid)} [{attrs}];")

    # edges (deduplicated on visible ends), communication labels
    comm = comm_edges(graph, plan)
    edges: dict[tuple[str, str], str | None] = {}
    for n in graph.nodes:
        dst = node_vis.get(n.name)
        for src in n.inputs:
            s = node_vis.get(src)
            if s is None or dst is None or s == dst:
                continue
            sl = by_name[src].layer if src in by_name else None
            same_block = sl is not None and block_name.get(sl) is not None and block_name.get(sl) == block_name.get(
                n.layer)
            if same_block and sl != n.layer and (sl in hidden_layers or n.layer in hidden_layers):
                continue  # member i -> member i+1 inside a folded block: not drawn
            label = comm.get((src, n.name))
            if (s, dst) not in edges or (label and not edges[(s, dst)]):
                edges[(s, dst)] = label
    finals = [n for n in graph.nodes if n.layer == graph.layers[-1].path and n.name in node_vis
              and not any(n.name in m.inputs for m in graph.nodes)] if graph.layers else []
    if finals:
        oid = "out-output"
        lines.append(f"  {_q(oid)} [id={_q(oid)}, label=\"output\", shape=ellipse, style=filled, "
                     f"fillcolor=\"#ffffff\"];")
        info[oid] = {"kind": "input", "label": "output", "layer": None}
        for n in finals[-1:]:
            edges.setdefault((node_vis[n.name], oid), comm.get((n.name, OUTPUT)))
    for (s, d), label in edges.items():
        if label:
            lines.append(f"  {_q(s)} -> {_q(d)} [label={_q(' ' + label)}, color={_q(COLLECTIVE_COLOR)}, "
                         f"fontcolor={_q(COLLECTIVE_COLOR)}, penwidth=1.6];")
        else:
            lines.append(f"  {_q(s)} -> {_q(d)};")
    lines.append("}")
    used = {i["split"] for i in info.values() if "split" in i}
    legend = [{"key": k, "label": lab, "color": c} for k, (lab, c) in SPLITS.items() if k in used or k != "activation"]
    return Layout("\n".join(lines), info, clusters, depth, max_depth, legend)


def _param_collectives(layer, plan: Plan | None) -> str:
    """The data-parallel collectives on a layer's parameters and gradients per step (cluster label): FSDP all-gather
    + reduce-scatter (ZeRO 2/3), or gradient all-reduce (DDP, ZeRO 1)."""
    if plan is None or plan.mesh.dp <= 1 or not layer.param_bytes:
        return ""
    try:
        lp = plan.layer(layer.path)
    except KeyError:
        return ""
    shard = layer.param_bytes / (plan.mesh.tp if lp.tp else 1)
    if plan.mesh.zero_stage >= 2:
        gathers = 2 if plan.mesh.zero_stage == 3 else 1
        return f"dp: all-gather {gathers}x + reduce-scatter {human(shard).replace(' ', ' ')}B"
    return f"dp: all-reduce grads {human(shard).replace(' ', ' ')}B"


def _input_size(graph: ModelGraph, name: str, scale: float, act_dtype: str | None) -> str:
    if len(graph.inputs) != 1:
        return ""
    t = graph.inputs[0]
    dtype = act_dtype if act_dtype and not t.dtype.startswith(("int", "uint")) else t.dtype
    return f"{human(_nbytes(t.shape, dtype) * scale)}B"


def _graph_input_shape(graph: ModelGraph, name: str) -> str | None:
    if len(graph.inputs) == 1:
        return _shape(graph.inputs[0].shape)
    return None


def _vis_key(n: OpNode, rel: list[str], depth: int) -> str:
    """Depth 0: the layer; depth d: the module d levels below the layer when the op lies that deep, else the op."""
    if depth == 0:
        return n.layer
    if len(rel) >= depth:
        return n.layer + "." + ".".join(rel[:depth])
    return n.name


def _emit_modules(lines: list[str], vids: list[str], items: dict, layer_path: str, li: int) -> None:
    """Write nested clusters for submodules holding two or more visible items."""
    def chain(it) -> list[str]:
        mod = it["module"] if it["kind"] == "op" else it["path"]
        if not mod.startswith(layer_path + "."):
            return []
        parts = mod[len(layer_path) + 1:].split(".")
        if it["kind"] == "module":
            parts = parts[:-1]
        return [layer_path + "." + ".".join(parts[:k]) for k in range(1, len(parts) + 1)]

    chains = {vid: chain(items[vid]) for vid in vids}
    size: dict[str, int] = {}
    for c in chains.values():
        for m in c:
            size[m] = size.get(m, 0) + 1
    tree: dict = {}
    for vid, c in chains.items():
        node = tree
        for m in c:
            if size[m] >= 2:
                node = node.setdefault(m, {})
        node.setdefault(None, []).append(vid)
    counter = [0]

    def emit(node: dict, indent: str) -> None:
        for vid in node.get(None, []):
            lines.append(f"{indent}{_q(vid)};")
        for m, sub in node.items():
            if m is None:
                continue
            counter[0] += 1
            name = m[len(layer_path) + 1:]
            lines.append(f"{indent}subgraph {_q(f'cluster_{li}_{counter[0]}')} {{ id={_q(_sid('cl-', m))}; "
                         f"label={_q(name)}; style=\"rounded,dashed\"; color=\"#aaaaaa\"; fillcolor=none;")
            emit(sub, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, "    ")
