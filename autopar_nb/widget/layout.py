"""ModelGraph + Plan -> DOT -> SVG: the graph view of the planner widget.

Ops are grouped in module clusters (one per layer, nested for submodules with several ops), repeated blocks are folded
into one cluster ("h × 12") unless expanded, containers of many layers can be collapsed into one node each ("groups":
a ResNet stage), nodes are coloured by the split the plan gives their module (and tagged with it in words, for readers
who cannot tell the colours apart), layer clusters are tinted by pipeline stage, and edges where communication
happens carry the collective and its bytes per step.

How much is shown is a :class:`View` (module depth below each layer, collapsed groups, column breaks).
:func:`auto_view` picks the most detailed view whose SVG fits the widget's viewport with every label at least 9 px
on screen: it tries group levels and depths from the finest down, and wraps the sequence of layers into columns
when that lets a tall, narrow graph fit a wide panel.

Rendering uses the system ``dot`` when there is one, else the ``graphviz-pure`` wheel's binary, found next to this
Python (``sysconfig.get_path("scripts")``) rather than on the kernel's PATH, which may lack the venv's ``bin``.
"""

from __future__ import annotations

import html
import re
import shutil
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..graph import ModelGraph, OpNode
from ..plan import DTYPE_NAMES, ITEMSIZE, Plan, within
from ..units import fmt_bytes, fmt_count
from .editor import STRATEGY_LABELS, current_strategy

# split key -> (legend label, fill colour). Light tints of the Okabe–Ito palette, chosen so that every pair stays
# apart (CIE76 ΔE >= 12) for normal vision and deuteranopia (Machado et al. 2009), and black text reads on each
# (contrast >= 8:1), checked by the tests. Nodes also name their split in words (SPLIT_TAGS).
SPLITS: dict[str, tuple[str, str]] = {
    "replicated": ("replicated", "#d9d9d9"),
    "fsdp": ("FSDP-sharded", "#8ecdf0"),
    "tp-colwise": ("TP column", "#f2b950"),
    "tp-rowwise": ("TP row", "#d7a1d0"),
    "sequence-parallel": ("sequence parallel", "#6fd0ae"),
    "vocab-parallel": ("vocab-parallel / embedding-sharded", "#fff08a"),
    "activation": ("no parameters", "#ffffff"),
}
SPLIT_TAGS = {"replicated": "", "fsdp": "FSDP", "tp-colwise": "TP col", "tp-rowwise": "TP row",
              "sequence-parallel": "SP", "vocab-parallel": "vocab", "activation": ""}
"""the split in words, on the node's second line"""
SPLIT_PRIORITY = ["tp-colwise", "tp-rowwise", "vocab-parallel", "sequence-parallel", "fsdp", "replicated", "activation"]
"""which split names a member of a folded block when its ops have several (a TP split says most)"""
STRATEGY_SPLITS: dict[str, tuple[str, ...]] = {
    "replicate": ("replicated",), "fsdp": ("fsdp",), "colwise": ("tp-colwise",), "rowwise": ("tp-rowwise",),
    "colwise-rowwise": ("tp-colwise", "tp-rowwise"), "vocab": ("vocab-parallel",),
    "sequence_parallel": ("sequence-parallel",), "none": ("activation",)}
"""a layer's strategy (editor.current_strategy) -> the split colours that show it"""
LEGEND_STRATEGY = {"replicated": "replicate", "fsdp": "fsdp", "tp-colwise": "colwise", "tp-rowwise": "rowwise",
                   "sequence-parallel": "sequence_parallel", "vocab-parallel": "vocab"}
"""legend swatch -> the strategy a node or cluster dropped on it takes (the graph's drag-to-split)"""
# pipeline stage hues: cluster outline and a pale background tint
STAGE_COLORS = ["#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#d6616b", "#8c6d31", "#17becf"]
STAGE_FILLS = ["#f0f6fc", "#fdf3ec", "#eff8f0", "#f4f3fa", "#f5f5f5", "#fbf0f1", "#f8f5ee", "#eefafc"]
CHANGED_COLOR = "#111111"
"""changed against the previous plan: a near-black dashed outline (nodes) or thick outline and "Δ" (clusters):
distinct from every fill by lightness, whatever the reader's colour vision"""
COLLECTIVE_COLOR = "#c0392b"
OUTPUT = "__output__"
"""name of the graph-output pseudo node (edges from the last layer's unconsumed ops)"""
MAX_OPS_SHOWN = 400
"""above this many visible ops, ``layout(depth=None)`` collapses ops into their modules"""
NODE_FONT, CLUSTER_FONT, EDGE_FONT = 10, 11, 9
"""DOT font sizes (pt). An SVG point is 4/3 CSS px, so at a view scale of 0.75 the smallest (9 pt) is 9 px"""
LEGIBLE_SCALE = 9 / (EDGE_FONT * 4 / 3)
"""the smallest view scale at which every label is >= 9 px on screen"""
DEFAULT_VIEWPORT = (820, 600)
"""CSS px of the graph viewport before the front end has reported its own"""


@dataclass(frozen=True)
class View:
    """How much of the graph is shown: module ``depth`` below each layer (0 = one node per layer), container
    ``groups`` collapsed into one node each, and the elements (layer or group keys) that start a new column."""

    depth: int
    groups: frozenset[str] = frozenset()
    breaks: tuple[str, ...] = ()


@dataclass
class Layout:
    """The DOT source of one view plus what the front end needs to make it interactive."""

    dot: str
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SVG element id -> {label, kind (op|module|group|input), op, layer, module, shapes, flops, memory, split,
    stage, target (what a drag onto a legend swatch re-plans)}"""
    clusters: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SVG cluster id -> {layer, block (name when it is a folded repeated block), label, differs}"""
    depth: int = 99
    """module depth shown below each layer (0 = one node per layer)"""
    max_depth: int = 0
    """deepest module nesting in the graph (the depth control's range)"""
    legend: list[dict[str, Any]] = field(default_factory=list)
    elements: list[dict[str, str]] = field(default_factory=list)
    """top-level elements in model order: {key, box (SVG id measured for columns), anchor (a node in it)}"""
    groups: frozenset[str] = frozenset()


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


def layer_strategy(graph: ModelGraph, plan: Plan | None, path: str) -> str:
    """A layer's strategy in the editor's words ("colwise-rowwise", "fsdp", ...; "none" without parameters)."""
    if plan is None:
        return "replicate"
    layer = graph.layer(path)
    if not layer.num_params:
        return "none"
    try:
        return current_strategy(plan.layer(path), plan, layer)
    except KeyError:
        return "replicate"


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


def _fill(splits: list[str]) -> tuple[str, str, list[str]]:
    """(fillcolor, tag, distinct splits by count) for a node whose ops or members have ``splits``: one colour, or two
    (a hard split, the second at least a quarter) when they differ."""
    counts = Counter(s for s in splits if s != "activation") or Counter(splits)
    ranked = [k for k, _ in counts.most_common()]
    if len(ranked) == 1:
        return SPLITS[ranked[0]][1], SPLIT_TAGS[ranked[0]], ranked
    a, b = ranked[:2]
    share = min(0.75, max(0.5, counts[a] / (counts[a] + counts[b])))
    tags = [t for t in (SPLIT_TAGS[a], SPLIT_TAGS[b]) if t]
    tag = "/".join(tags) if len(tags) < 2 or not (tags[0].startswith("TP") and tags[1].startswith("TP")) else \
        "TP col/row"
    return f"{SPLITS[a][1]};{share:.2f}:{SPLITS[b][1]}", tag, ranked


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
        return fmt_bytes(sum(_nbytes(s, act_dtype or n.dtype) for s in n.out_shapes[:1]) * scale)

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


# ---- groups: containers of several layers shown as one node ---------------------------------------------------------
def group_levels(graph: ModelGraph) -> list[frozenset[str]]:
    """Ways to collapse containers, coarsest first: at cut ``d`` every run of two or more consecutive layers whose
    paths share their first ``d`` names (and are longer than that) becomes one group. Levels that leave fewer than 3
    elements, or that equal a finer one, are left out; the finest (no groups) is not listed."""
    deepest = max((len(lay.path.split(".")) for lay in graph.layers), default=1)
    out: list[frozenset[str]] = []
    for d in range(1, deepest):
        groups: list[str] = []
        runs: list[int] = []
        for lay in graph.layers:
            parts = lay.path.split(".")
            key = ".".join(parts[:d]) if len(parts) > d else None
            if key is not None and groups and groups[-1] == key:
                runs[-1] += 1
            else:
                groups.append(key)
                runs.append(1)
        chosen = frozenset(g for g, n in zip(groups, runs, strict=True) if g is not None and n >= 2)
        if chosen and len(groups) >= 3 and chosen not in out:
            out.append(chosen)
    return out


def child_groups(graph: ModelGraph, group: str) -> frozenset[str]:
    """The containers one level below ``group`` that hold two or more of its layers (what expanding it shows)."""
    depth = len(group.split("."))
    inside = [lay.path for lay in graph.layers if lay.path != group and within(lay.path, group)]
    counts = Counter(".".join(p.split(".")[:depth + 1]) for p in inside if len(p.split(".")) > depth + 1)
    return frozenset(g for g, n in counts.items() if n >= 2)


def _group_of(path: str, groups: frozenset[str]) -> str | None:
    best = None
    for g in groups:
        if path != g and within(path, g) and (best is None or len(g) < len(best)):
            best = g
    return best


# ---- the layout -----------------------------------------------------------------------------------------------------
def layout(graph: ModelGraph, plan: Plan | None = None, *, expanded: set[str] | frozenset[str] = frozenset(),
           depth: int | None = None, groups: set[str] | frozenset[str] = frozenset(),
           breaks: tuple[str, ...] | list[str] = (), changed_layers: set[str] | frozenset[str] = frozenset(),
           selected: str | None = None) -> Layout:
    """Build the DOT view of ``graph`` coloured by ``plan``.

    ``expanded`` names repeated blocks to show in full (others are folded into their first member); ``depth`` is the
    module depth below each layer to show (None: all ops, or less when that exceeds MAX_OPS_SHOWN); ``groups`` are
    containers drawn as one node each; ``breaks`` are elements (layer paths or groups) that start a new column;
    ``changed_layers`` are outlined as changed against the previous plan; ``selected`` is a layer to emphasise.
    """
    groups = frozenset(groups)
    # ---- folding: ops of hidden block members map onto the same-position op of the first member
    alias: dict[str, str] = {}
    hidden_layers: set[str] = set()
    folded: dict[str, list[str]] = {}
    for b in graph.blocks:
        if b.name in expanded or b.count < 2:
            continue
        first = graph.layer(b.members[0]).nodes
        if not all(len(graph.layer(m).nodes) == len(first) for m in b.members):
            continue
        folded[b.members[0]] = list(b.members)
        for m in b.members[1:]:
            hidden_layers.add(m)
            alias.update(zip(graph.layer(m).nodes, first, strict=True))
    # ops that read nothing and nobody reads (BatchNorm's num_batches_tracked += 1) are state updates, not dataflow
    read = {i for n in graph.nodes for i in n.inputs}
    isolated = {n.name for n in graph.nodes if not n.inputs and n.name not in read}
    visible_ops = [n for n in graph.nodes if n.name not in alias and n.name not in isolated]
    group_of = {lay.path: _group_of(lay.path, groups) for lay in graph.layers}

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
    pipelined = plan is not None and plan.mesh.pp * plan.pipeline.virtual_stages > 1
    keys = {n.name: _vis_key(n, rel(n), depth) for n in visible_ops}
    members: dict[str, int] = {}
    for k in keys.values():
        members[k] = members.get(k, 0) + 1
    node_vis: dict[str, str] = {}
    items: dict[str, dict[str, Any]] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for n in visible_ops:
        g = group_of.get(n.layer)
        if g is not None:
            gid = _sid("grp-", g)
            node_vis[n.name] = gid
            it = grouped.setdefault(g, {"flops": 0.0, "params": set(), "ops": 0})
            it["flops"] += n.flops
            it["params"].update(n.params)
            it["ops"] += 1
            continue
        key = keys[n.name] if members[keys[n.name]] > 1 else n.name
        vid = _sid("op-", n.name) if key == n.name else _sid("mod-", key)
        node_vis[n.name] = vid
        if vid not in items:
            items[vid] = {"kind": "op" if key == n.name else "module", "layer": n.layer, "module": n.module_path,
                          "ops": [], "flops": 0.0, "act": 0, "params": set(), "path": key}
        it = items[vid]
        it["ops"].append(n)
        it["flops"] += n.flops
        it["act"] += sum(_nbytes(s, n.dtype) for s in n.out_shapes)
        it["params"].update(n.params)
    for n in graph.nodes:
        if n.name in alias and alias[n.name] in node_vis:
            node_vis[n.name] = node_vis[alias[n.name]]

    info: dict[str, dict[str, Any]] = {}
    clusters: dict[str, dict[str, Any]] = {}
    elements: list[dict[str, str]] = []
    lines = ["digraph G {",
             f'  graph [rankdir=TB, nodesep=0.25, ranksep=0.3, fontname="Helvetica", fontsize={CLUSTER_FONT}, '
             'bgcolor="transparent", newrank=true];',
             f'  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize={NODE_FONT}, height=0.3, '
             'margin="0.08,0.03", penwidth=1, color="#555555"];',
             f'  edge [color="#777777", arrowsize=0.6, fontname="Helvetica", fontsize={EDGE_FONT}];']

    # graph inputs
    inputs = sorted({i for n in visible_ops for i in n.inputs if i not in node_vis and i not in by_name})
    for i in inputs:
        iid = _sid("in-", i)
        node_vis[i] = iid
        lines.append(f"  {_q(iid)} [id={_q(iid)}, label={_q(i)}, shape=ellipse, style=filled, fillcolor=\"#ffffff\"];")
        info[iid] = {"kind": "input", "label": i, "layer": None}

    def member_splits(vid_ops: list[OpNode], reps: list[str]) -> list[str]:
        """The split of this node in each member of a folded block (the same-position ops of every member)."""
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

    # nest items by module path inside their layer cluster
    by_layer: dict[str, list[str]] = {}
    for vid, it in items.items():
        by_layer.setdefault(it["layer"], []).append(vid)
    seen_groups: set[str] = set()
    for li, layer in enumerate(graph.layers):
        g = group_of.get(layer.path)
        if g is not None:
            if g in seen_groups:
                continue
            seen_groups.add(g)
            gid = _sid("grp-", g)
            glayers = [lay for lay in graph.layers if group_of.get(lay.path) == g]
            _emit_group(lines, info, graph, plan, g, gid, glayers, grouped.get(g, {}), stage, pipelined,
                        changed_layers, selected)
            elements.append({"key": g, "kind": "group", "box": gid, "anchor": gid})
            continue
        if layer.path in hidden_layers or layer.path not in by_layer:
            continue
        st = stage.get(layer.path, 0)
        reps = folded.get(layer.path, [layer.path])
        block = graph.block_of(layer.path)
        label = f"{block.name} × {len(reps)}" if len(reps) > 1 else layer.path
        label += f"  ·  {layer.type}"
        if pipelined:
            stages = sorted({stage.get(m, 0) for m in reps})
            label += f"  ·  stage {stages[0]}" if len(stages) == 1 else f"  ·  stages {stages[0]}–{stages[-1]}"
        differs = _member_differences(graph, plan, reps) if len(reps) > 1 else ""
        if differs:
            label += f"\n{differs}"
        grad_comm = _param_collectives(layer, plan)
        if grad_comm:
            label += f"\n{grad_comm}"
        changed = any(m in changed_layers for m in reps)
        if changed:
            label = "Δ " + label
        cid = _sid("cl-", layer.path)
        clusters[cid] = {"layer": layer.path, "block": block.name if len(reps) > 1 else None, "label": label,
                         "expandable": len(reps) > 1, "differs": differs, "changed": changed,
                         "collapsible": bool(block is not None and len(reps) == 1 and block.name in expanded),
                         "target": _target_block(block.name) if len(reps) > 1 else layer.path,
                         "layers": reps, "type": layer.type, "modules": {}}
        color = CHANGED_COLOR if changed else STAGE_COLORS[st % len(STAGE_COLORS)]
        width = 3.5 if changed else 3 if layer.path == selected else 1.5
        style = "rounded,filled,dashed" if len(reps) > 1 else "rounded,filled"
        lines.append(f"  subgraph {_q('cluster_' + str(li))} {{")
        lines.append(f"    id={_q(cid)}; label={_q(label)}; labeljust=l; style={_q(style)}; "
                     f"fillcolor={_q(STAGE_FILLS[st % len(STAGE_FILLS)])}; color={_q(color)}; penwidth={width};")
        _emit_modules(lines, by_layer[layer.path], items, layer, li, clusters[cid]["modules"])
        lines.append("  }")
        elements.append({"key": layer.path, "kind": "layer", "box": cid, "anchor": by_layer[layer.path][0]})
        for vid in by_layer[layer.path]:
            it = items[vid]
            ops = it["ops"]
            first = ops[0]
            weighted = [o for o in ops if o.params] or ops  # a module's colour: the ops holding its weights
            fill, tag, distinct = _fill([split_of(o, plan, graph) for o in weighted])
            per_member = member_splits(ops, reps) if len(reps) > 1 else []
            member_note = ""
            if len(set(per_member)) > 1:
                fill, tag, distinct = _fill(per_member)
                member_note = ", ".join(f"{SPLITS[k][0]} on {n} of {len(reps)}"
                                        for k, n in Counter(per_member).most_common())
            split = distinct[0]
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
            suffix = f" · {tag}" if tag else ""
            if it["kind"] == "op":
                label = f"{_short_op(first.op)}\n{shapes[0] if shapes else ''}{suffix}"
                title = first.name
            else:
                mod = it["path"]
                mtype = layer_of[it["layer"]].modules.get(mod) or (first.module_type if first.module_path == mod
                                                                    else "")
                name = (f"{graph.block_of(mod).name}.*" if len(reps) > 1 else mod) if mod == it["layer"] else \
                    mod.rsplit(".", 1)[-1]
                label = f"{name}\n{mtype + ' · ' if mtype else ''}{len(ops)} ops{suffix}"
                title = mod
            module = first.module_path if len(ops) == 1 else it["path"]
            info[vid] = {"kind": it["kind"], "label": title, "op": first.op if len(ops) == 1 else
                         ", ".join(sorted({_short_op(o.op) for o in ops})[:6]),
                         "layer": it["layer"], "module": module,
                         "in_shapes": in_shapes, "out_shapes": shapes, "flops": it["flops"] * len(reps),
                         "flops_each": it["flops"], "act_bytes": it["act"], "param_bytes": pbytes,
                         "split": split, "splits": distinct, "members": member_note, "stage": st,
                         "repeats": len(reps), "ops": len(ops),
                         "target": _node_target(graph, layer.path, module, reps, bool(it["params"]))}
            attrs = f"id={_q(vid)}, label={_q(label)}, fillcolor={_q(fill)}"
            if split == "activation" and len(distinct) == 1:
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
              and n.name not in read] if graph.layers else []
    if finals:
        oid = "out-output"
        lines.append(f"  {_q(oid)} [id={_q(oid)}, label=\"output\", shape=ellipse, style=filled, "
                     f"fillcolor=\"#ffffff\"];")
        info[oid] = {"kind": "input", "label": "output", "layer": None}
        for n in finals[-1:]:
            edges.setdefault((node_vis[n.name], oid), comm.get((n.name, OUTPUT)))

    # columns: an element in ``breaks`` starts a new column at the top; edges between columns do not rank
    column: dict[str, int] = {}
    col = 0
    starts: list[str] = []
    for e in elements:
        if e["key"] in breaks and column:
            col += 1
            starts.append(e["anchor"])
        column[e["key"]] = col
    vis_col: dict[str, int] = {}
    for e in elements:
        for vid in ([e["box"]] if e["kind"] == "group" else by_layer.get(e["key"], [])):
            vis_col[vid] = column[e["key"]]
    for (s, d), label in edges.items():
        extra = "" if vis_col.get(s, 0) == vis_col.get(d, vis_col.get(s, 0)) else ", constraint=false"
        if label:
            lines.append(f"  {_q(s)} -> {_q(d)} [label={_q(' ' + label)}, color={_q(COLLECTIVE_COLOR)}, "
                         f"fontcolor={_q(COLLECTIVE_COLOR)}, penwidth=1.6{extra}];")
        else:
            lines.append(f"  {_q(s)} -> {_q(d)}{f' [{extra[2:]}]' if extra else ''};")
    if starts and elements:
        top = _sid("in-", inputs[0]) if inputs else elements[0]["anchor"]
        lines.append("  {rank=same; " + " ".join(_q(x) for x in [top, *starts]) + ";}")
    lines.append("}")
    used = {s for i in info.values() for s in i.get("splits", [i.get("split")]) if s}
    legend = [{"key": k, "label": lab, "color": c, "strategy": LEGEND_STRATEGY.get(k)}
              for k, (lab, c) in SPLITS.items() if k in used or k != "activation"]
    legend.insert(4, {"key": "tp-pair", "label": "TP col → row pair", "color": SPLITS["tp-colwise"][1],
                      "color2": SPLITS["tp-rowwise"][1], "strategy": "colwise-rowwise"})
    return Layout("\n".join(lines), info, clusters, depth, max_depth, legend, elements, groups)


def _target_block(block: str) -> str:
    return f"{block}.*"


def _node_target(graph: ModelGraph, layer: str, module: str, reps: list[str], has_params: bool) -> dict[str, Any]:
    """What a drag of this node onto a legend swatch re-plans: the override pattern (the module inside the layer, or
    the same module in every member of a folded block) and the layers it covers; ``None`` pattern without
    parameters."""
    if not has_params:
        return {"pattern": None, "layers": reps, "why": "this op has no parameters to split: drag its layer's "
                                                         "cluster, or a node with weights"}
    if len(reps) > 1:
        block = graph.block_of(layer)
        suffix = module[len(layer):] if module.startswith(layer) else ""
        return {"pattern": f"{block.name}.*{suffix}", "layers": reps}
    return {"pattern": module or layer, "layers": reps}


def _member_differences(graph: ModelGraph, plan: Plan | None, members: list[str]) -> str:
    """How the members of a folded block differ ("31 TP col→row, 1 FSDP · recompute 30 none, 2 full"), "" when they
    are alike."""
    if plan is None:
        return ""
    parts = []
    strat = Counter(STRATEGY_LABELS.get(s, s) for s in (layer_strategy(graph, plan, m) for m in members))
    if len(strat) > 1:
        parts.append(", ".join(f"{n} {k}" for k, n in strat.most_common()))
    lps = {lp.path: lp for lp in plan.layers}
    rec = Counter(lps[m].recompute for m in members if m in lps)
    if len(rec) > 1:
        parts.append("recompute " + ", ".join(f"{n} {k}" for k, n in rec.most_common()))
    pins = sum(1 for m in members if m in lps and lps[m].pinned)
    if pins and pins < len(members) and parts:
        parts.append(f"{pins} pinned")
    return "  ·  ".join(parts)


def _emit_group(lines, info, graph, plan, g, gid, glayers, acc, stage, pipelined, changed_layers, selected) -> None:
    """One node standing for the container ``g`` and its layers ``glayers``."""
    with_params = [lay for lay in glayers if lay.num_params]
    strategies = [layer_strategy(graph, plan, lay.path) for lay in with_params]
    splits = [s for st in strategies for s in STRATEGY_SPLITS.get(st, ("replicated",))] or ["activation"]
    fill, tag, distinct = _fill(splits)
    stages = sorted({stage.get(lay.path, 0) for lay in glayers})
    types = Counter(lay.type for lay in glayers)
    blocks = sorted({b.name for lay in glayers if (b := graph.block_of(lay.path))})
    params = sum(lay.num_params for lay in glayers)
    parts = g.split(".")
    k = len(parts)
    while k > 1 and len(".".join(parts[-k:])) > 28:
        k -= 1
    name = ".".join(parts[-k:])
    what = f"{len(glayers)} layers" + (f" · {fmt_count(params)} params" if params else "")
    label = f"{name}\n{what}{' · ' + tag if tag else ''}"
    strat = Counter(STRATEGY_LABELS.get(s, s) for s in strategies)
    differs = ", ".join(f"{n} {k}" for k, n in strat.most_common()) if len(strat) > 1 else ""
    if pipelined:
        label += f"\nstage {stages[0]}" if len(stages) == 1 else f"\nstages {stages[0]}–{stages[-1]}"
    changed = any(lay.path in changed_layers for lay in glayers)
    st = stages[0]
    color = CHANGED_COLOR if changed else STAGE_COLORS[st % len(STAGE_COLORS)]
    style = "rounded,filled,dashed" if changed else "rounded,filled"
    width = 3 if changed or any(lay.path == selected for lay in glayers) else 2
    lines.append(f"  {_q(gid)} [id={_q(gid)}, label={_q(label)}, fillcolor={_q(fill)}, color={_q(color)}, "
                 f"penwidth={width}, style={_q(style)}, margin=\"0.12,0.06\"];")
    info[gid] = {"kind": "group", "label": g, "layer": glayers[0].path, "module": g, "group": g,
                 "layers": [lay.path for lay in glayers], "types": ", ".join(f"{t} × {n}" if n > 1 else t
                                                                             for t, n in types.most_common(4)),
                 "blocks": blocks, "params": params, "flops": acc.get("flops", 0.0),
                 "flops_each": acc.get("flops", 0.0),
                 "param_bytes": sum(lay.param_bytes for lay in glayers), "ops": acc.get("ops", 0),
                 "split": distinct[0], "splits": distinct, "members": differs, "stage": st, "stages": stages,
                 "repeats": 1, "target": {"pattern": f"{g}.*", "layers": [lay.path for lay in glayers]}}


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
        return f"dp: all-gather {gathers}x + reduce-scatter {fmt_bytes(shard)}"
    return f"dp: all-reduce grads {fmt_bytes(shard)}"


def _input_size(graph: ModelGraph, name: str, scale: float, act_dtype: str | None) -> str:
    if len(graph.inputs) != 1:
        return ""
    t = graph.inputs[0]
    dtype = act_dtype if act_dtype and not t.dtype.startswith(("int", "uint")) else t.dtype
    return fmt_bytes(_nbytes(t.shape, dtype) * scale)


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


def _emit_modules(lines: list[str], vids: list[str], items: dict, layer, li: int, boxes: dict) -> None:
    """Write nested clusters for submodules of two or more visible items; ``boxes`` gets {box id: [path, type]}."""
    def chain(it) -> list[str]:
        mod = it["module"] if it["kind"] == "op" else it["path"]
        if not mod.startswith(layer.path + "."):
            return []
        parts = mod[len(layer.path) + 1:].split(".")
        if it["kind"] == "module":
            parts = parts[:-1]
        return [layer.path + "." + ".".join(parts[:k]) for k in range(1, len(parts) + 1)]

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
        for m, sub in ((k, v) for k, v in node.items() if k is not None):
            counter[0] += 1
            boxes[_sid("cl-", m)] = [m, next((o.module_type for v in vids for o in items[v]["ops"]
                                              if o.module_path == m), "")]
            lines.append(f"{indent}subgraph {_q(f'cluster_{li}_{counter[0]}')} {{ id={_q(_sid('cl-', m))}; label="
                         f"{_q(m[len(layer.path) + 1:])}; style=\"rounded,dashed\"; color=\"#aaaaaa\"; fillcolor=none;")
            emit(sub, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, "    ")


# ---- measuring an SVG and choosing the view ---------------------------------------------------------------------
_SIZE = re.compile(r'<svg[^>]*?width="([\d.]+)pt"[^>]*?height="([\d.]+)pt"')
_GROUP = re.compile(r'<g id="([^"]+)" class="(?:node|cluster)">(.*?)</g>', re.S)
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def svg_size(svg: str) -> tuple[float, float]:
    """(width, height) of the SVG in points (CSS px = pt * 4/3)."""
    m = _SIZE.search(svg)
    return (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)


def svg_boxes(svg: str) -> dict[str, tuple[float, float, float, float]]:
    """SVG id -> (x0, y0, x1, y1) of every node and cluster's outline, in the SVG's coordinates."""
    out = {}
    for gid, body in _GROUP.findall(svg):
        m = re.search(r"<(?:path|polygon)[^>]*?(?:d|points)=\"([^\"]+)\"", body)
        if m:
            nums = [float(x) for x in _NUM.findall(m.group(1))]
            xs, ys = nums[0::2], nums[1::2]
        else:
            e = re.search(r'<ellipse[^>]*?cx="([-\d.]+)" cy="([-\d.]+)" rx="([\d.]+)" ry="([\d.]+)"', body)
            if not e:
                continue
            cx, cy, rx, ry = map(float, e.groups())
            xs, ys = [cx - rx, cx + rx], [cy - ry, cy + ry]
        if xs and ys:
            out[html.unescape(gid)] = (min(xs), min(ys), max(xs), max(ys))
    return out


def fit_ratio(width_pt: float, height_pt: float, viewport: tuple[float, float]) -> float:
    """The scale at which an SVG of this size fits ``viewport`` (CSS px, 4 % margin), over LEGIBLE_SCALE: >= 1 means
    the whole graph is in view with every label >= 9 px."""
    fit = 0.96 * min(viewport[0] / max(width_pt * 4 / 3, 1), viewport[1] / max(height_pt * 4 / 3, 1))
    return fit / LEGIBLE_SCALE


def choose_breaks(lay: Layout, svg: str, viewport: tuple[float, float]) -> tuple[tuple[str, ...], float]:
    """Column breaks for ``lay`` (measured in its one-column ``svg``) that let it fit ``viewport`` (CSS px) at the
    largest scale, and that scale relative to the legible one (>= 1: every label >= 9 px with the whole graph in
    view)."""
    w, h = svg_size(svg)
    best = ((), fit_ratio(w, h, viewport))
    boxes = svg_boxes(svg)
    elems = [(e["key"], boxes[e["box"]]) for e in lay.elements if e["box"] in boxes]
    if len(elems) < 2 or best[1] >= 1:
        return best
    gap = 0.3 * 72 + 8
    heights = [b[3] - b[1] + gap for _, b in elems]
    widths = [b[2] - b[0] for _, b in elems]
    extra = max(0.0, h - sum(heights))  # inputs above, output below
    for cols in range(2, min(8, len(elems)) + 1):
        cuts = _partition(heights, cols)
        if cuts is None:
            continue
        spans = list(zip([0, *cuts], [*cuts, len(elems)], strict=True))
        col_h = max(sum(heights[a:b]) for a, b in spans) + extra
        col_w = sum(max(widths[a:b]) for a, b in spans) + 30 * (len(spans) - 1) + 40
        scale = fit_ratio(col_w, col_h, viewport)
        if scale > best[1] * 1.05:
            best = (tuple(elems[c][0] for c in cuts), scale)
    return best


def _partition(heights: list[float], cols: int) -> list[int] | None:
    """Start indices of columns 2.. that minimise the tallest of ``cols`` contiguous columns (bisection on the cap
    with a greedy fill)."""
    lo, hi = max(heights), sum(heights)
    best = None
    for _ in range(40):
        cap = (lo + hi) / 2
        cuts, acc = [], 0.0
        for i, x in enumerate(heights):
            if acc + x > cap and acc > 0:
                cuts.append(i)
                acc = 0.0
            acc += x
        if len(cuts) <= cols - 1:
            best, hi = cuts, cap
        else:
            lo = cap
    if best is None or len(best) != cols - 1:
        return None
    return best


def auto_view(graph: ModelGraph, plan: Plan | None, *, viewport: tuple[float, float] = DEFAULT_VIEWPORT,
              expanded: set[str] | frozenset[str] = frozenset(), depth: int | None = None,
              groups: frozenset[str] | None = None, **kw) -> tuple[View, Layout, str, dict[str, Any]]:
    """The most detailed view that fits ``viewport`` legibly, its layout and SVG, and a report ({"tried": [...],
    "scale": fit scale / legible scale}). With ``depth`` (and ``groups``) given, only the columns are chosen."""
    if depth is not None:
        candidates = [(depth, frozenset(groups or ()))]
    else:
        levels = group_levels(graph)
        full = layout(graph, None, expanded=expanded).max_depth
        candidates = [(0, g) for g in levels] + [(d, frozenset()) for d in range(0, full + 1)]
    area = viewport[0] * viewport[1] * (0.75 / LEGIBLE_SCALE) ** 2  # pt² the graph may take
    tried: list[dict[str, Any]] = []
    cache: dict[int, tuple] = {}

    def attempt(i: int):
        if i in cache:
            return cache[i]
        d, g = candidates[i]
        lay = layout(graph, plan, expanded=expanded, depth=d, groups=g, **kw)
        if len(lay.nodes) * 2600 > area * 1.5 and len(candidates) > 1 and i > 0:
            cache[i] = (lay, None, (), 0.0)  # cannot fit legibly: not worth laying out
        else:
            svg = render_svg(lay.dot)
            breaks, scale = choose_breaks(lay, svg, viewport)
            cache[i] = (lay, svg, breaks, scale)
        tried.append({"depth": d, "groups": len(g), "nodes": len(lay.nodes), "scale": round(cache[i][3], 3)})
        return cache[i]

    chosen = len(candidates) - 1
    if attempt(chosen)[3] < 1 and chosen > 0:
        # the finest candidate that fits (the fit shrinks as detail grows), else the coarsest
        lo, hi, chosen = 0, chosen - 1, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if attempt(mid)[3] >= 1:
                chosen, lo = mid, mid + 1
            else:
                hi = mid - 1
    for i in range(chosen, -1, -1):  # columns are predicted from the one-column boxes: check, else go coarser
        d, g = candidates[i]
        lay, svg, breaks, scale = attempt(i)
        if svg is None:
            svg = render_svg(lay.dot)
            breaks, scale = choose_breaks(lay, svg, viewport)
        if breaks:
            lay = layout(graph, plan, expanded=expanded, depth=d, groups=g, breaks=breaks, **kw)
            svg = render_svg(lay.dot)
            scale = fit_ratio(*svg_size(svg), viewport)
        if scale >= 1 or i < chosen or cache[i][3] < 1:
            break
    return View(lay.depth, g, tuple(breaks)), lay, svg, {"tried": tried, "scale": round(scale, 3)}
