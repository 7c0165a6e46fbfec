"""ModelGraph + Plan -> DOT: :func:`layout` draws one view of the graph (see ``layout.py`` for how
the view is chosen).

Ops are grouped in module clusters (one per layer, nested for submodules with several ops), repeated
blocks are folded into one cluster ("h × 12") unless expanded, containers of many layers can be
collapsed into one node each (``groups.py``), nodes are coloured by the split the plan gives their
module and tagged with it in words (``splits.py``), layer clusters are tinted by pipeline stage, and
edges where communication happens carry the collective and its bytes per step.

Which node shows each op is ``visible.py``'s; how one node looks, ``node_view.py``'s; the boxes of
submodules inside a layer's cluster, ``module_boxes.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..graph import ModelGraph, OpNode
from ..plan import Plan
from .groups import emit_group, group_of
from .module_boxes import emit_module_boxes, svg_id
from .node_view import node_fill, node_label, node_shapes, node_target, param_bytes, short_op
from .splits import (
    CHANGED_COLOR,
    COLLECTIVE_COLOR,
    LEGEND_STRATEGY,
    OUTPUT,
    SPLITS,
    STAGE_COLORS,
    STAGE_FILLS,
    comm_edges,
    member_differences,
    nbytes,
    param_collectives,
)
from .svg import CLUSTER_FONT, EDGE_FONT, NODE_FONT
from .svg import dot_string as _q
from .visible import fold_blocks, module_below_layer, node_key, shown_depth


@dataclass
class Layout:
    """The DOT source of one view plus what the front end needs to make it interactive."""

    dot: str
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SVG element id -> {label, kind (op|module|group|input), op, layer, module, shapes, flops,
    memory, split, stage, target (what a drag onto a legend swatch re-plans)}"""
    clusters: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SVG cluster id -> {layer, block (name when it is a folded repeated block), label, differs}"""
    depth: int = 99
    """module depth shown below each layer (0 = one node per layer)"""
    max_depth: int = 0
    """deepest module nesting in the graph (the depth control's range)"""
    legend: list[dict[str, Any]] = field(default_factory=list)
    elements: list[dict[str, str]] = field(default_factory=list)
    """top-level elements in model order: {key, box (SVG id measured for columns), anchor (a node in
    it)}"""
    groups: frozenset[str] = frozenset()


def layout(graph: ModelGraph, plan: Plan | None = None, *,
           expanded: set[str] | frozenset[str] = frozenset(), depth: int | None = None,
           groups: set[str] | frozenset[str] = frozenset(),
           breaks: tuple[str, ...] | list[str] = (),
           changed_layers: set[str] | frozenset[str] = frozenset(),
           selected: str | None = None) -> Layout:
    """Build the DOT view of ``graph`` coloured by ``plan``.

    ``expanded`` names repeated blocks to show in full (others are folded into their first member);
    ``depth`` is the module depth below each layer to show (None: all ops, or less when that exceeds
    MAX_OPS_SHOWN); ``groups`` are containers drawn as one node each; ``breaks`` are elements (layer
    paths or groups) that start a new column; ``changed_layers`` are outlined as changed against the
    previous plan; ``selected`` is a layer to emphasise.
    """
    groups = frozenset(groups)
    alias, hidden_layers, folded = fold_blocks(graph, expanded)
    # ops that read nothing and nobody reads (BatchNorm's num_batches_tracked += 1) are state
    # updates, not dataflow
    read = {i for n in graph.nodes for i in n.inputs}
    isolated = {n.name for n in graph.nodes if not n.inputs and n.name not in read}
    visible_ops = [n for n in graph.nodes if n.name not in alias and n.name not in isolated]
    grouping = {lay.path: group_of(lay.path, groups) for lay in graph.layers}
    depth, max_depth = shown_depth(visible_ops, depth)
    drawing = _Drawing(graph, plan, expanded=expanded, changed_layers=changed_layers,
                       selected=selected)
    items, grouped = drawing.collect(visible_ops, grouping, depth, alias)
    inputs = drawing.inputs(visible_ops)
    by_layer = drawing.layers(items, grouped, grouping, folded, hidden_layers)
    edges = drawing.edges(hidden_layers, read)
    drawing.columns(edges, by_layer, breaks, inputs)
    return Layout("\n".join(drawing.lines), drawing.info, drawing.clusters, depth, max_depth,
                  _legend(drawing.info), drawing.elements, groups)


def _legend(info: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The swatches: every split but "no parameters" (shown when some node has it), and the TP
    pair."""
    used = {s for i in info.values() for s in i.get("splits", [i.get("split")]) if s}
    legend = [{"key": k, "label": lab, "color": c, "strategy": LEGEND_STRATEGY.get(k)}
              for k, (lab, c) in SPLITS.items() if k in used or k != "activation"]
    legend.insert(4,
                  {"key": "tp-pair", "label": "TP col → row pair", "color": SPLITS["tp-colwise"][1],
                   "color2": SPLITS["tp-rowwise"][1], "strategy": "colwise-rowwise"})
    return legend


class _Drawing:
    """One view in the making: the DOT lines written so far, and what the front end is told of each
    node, cluster and top-level element."""

    def __init__(self, graph: ModelGraph, plan: Plan | None, *, expanded: set[str] | frozenset[str],
                 changed_layers: set[str] | frozenset[str], selected: str | None):
        self.graph, self.plan = graph, plan
        self.expanded, self.changed_layers, self.selected = expanded, changed_layers, selected
        self.layer_of = {layer.path: layer for layer in graph.layers}
        self.by_name = {n.name: n for n in graph.nodes}
        self.stage = {lp.path: lp.stage for lp in plan.layers} if plan else {}
        self.pipelined = plan is not None and plan.mesh.pp * plan.pipeline.virtual_stages > 1
        self.node_vis: dict[str, str] = {}
        """op (or graph input) -> the id of the node that shows it"""
        self.info: dict[str, dict[str, Any]] = {}
        self.clusters: dict[str, dict[str, Any]] = {}
        self.elements: list[dict[str, str]] = []
        self.lines = ["digraph G {",
                      f'  graph [rankdir=TB, nodesep=0.25, ranksep=0.3, fontname="Helvetica", '
                      f'fontsize={CLUSTER_FONT}, bgcolor="transparent", newrank=true];',
                      '  node [shape=box, style="rounded,filled", fontname="Helvetica", '
                      f'fontsize={NODE_FONT}, '
                      'height=0.3, margin="0.08,0.03", penwidth=1, color="#555555"];',
                      '  edge [color="#777777", arrowsize=0.6, fontname="Helvetica", '
                      f'fontsize={EDGE_FONT}];']

    def collect(self, visible_ops: list[OpNode], grouping: dict[str, str | None], depth: int,
                alias: dict[str, str]) -> tuple[dict[str, dict[str, Any]],
                                                dict[str, dict[str, Any]]]:
        """The nodes: (node id -> its ops and sums, group -> its sums). Ops at ``depth`` below their
        layer share a module's node when two or more do; a folded member's ops are drawn by their
        first member's nodes."""
        keys = {n.name: node_key(n, module_below_layer(n), depth) for n in visible_ops}
        members: dict[str, int] = {}
        for k in keys.values():
            members[k] = members.get(k, 0) + 1
        items: dict[str, dict[str, Any]] = {}
        grouped: dict[str, dict[str, Any]] = {}
        for n in visible_ops:
            g = grouping.get(n.layer)
            if g is not None:
                gid = svg_id("grp-", g)
                self.node_vis[n.name] = gid
                it = grouped.setdefault(g, {"flops": 0.0, "params": set(), "ops": 0})
                it["flops"] += n.flops
                it["params"].update(n.params)
                it["ops"] += 1
                continue
            key = keys[n.name] if members[keys[n.name]] > 1 else n.name
            vid = svg_id("op-", n.name) if key == n.name else svg_id("mod-", key)
            self.node_vis[n.name] = vid
            if vid not in items:
                items[vid] = {"kind": "op" if key == n.name else "module", "layer": n.layer,
                              "module": n.module_path, "ops": [], "flops": 0.0, "act": 0,
                              "params": set(), "path": key}
            it = items[vid]
            it["ops"].append(n)
            it["flops"] += n.flops
            it["act"] += sum(nbytes(s, n.dtype) for s in n.out_shapes)
            it["params"].update(n.params)
        for n in self.graph.nodes:
            if n.name in alias and alias[n.name] in self.node_vis:
                self.node_vis[n.name] = self.node_vis[alias[n.name]]
        return items, grouped

    def inputs(self, visible_ops: list[OpNode]) -> list[str]:
        """The graph's inputs, one ellipse each; returns their names."""
        inputs = sorted({i for n in visible_ops for i in n.inputs if i not in self.node_vis
                         and i not in self.by_name})
        for i in inputs:
            iid = svg_id("in-", i)
            self.node_vis[i] = iid
            self.lines.append(f"  {_q(iid)} [id={_q(iid)}, label={_q(i)}, shape=ellipse, "
                              "style=filled, "
                              "fillcolor=\"#ffffff\"];")
            self.info[iid] = {"kind": "input", "label": i, "layer": None}
        return inputs

    def layers(self, items: dict[str, dict[str, Any]], grouped: dict[str, dict[str, Any]],
               grouping: dict[str, str | None], folded: dict[str, list[str]],
               hidden_layers: set[str]) -> dict[str, list[str]]:
        """Each shown layer a cluster of its nodes, each group one node, in model order; returns
        layer -> the ids of its nodes."""
        by_layer: dict[str, list[str]] = {}
        for vid, it in items.items():
            by_layer.setdefault(it["layer"], []).append(vid)
        seen_groups: set[str] = set()
        for li, layer in enumerate(self.graph.layers):
            g = grouping.get(layer.path)
            if g is not None:
                if g in seen_groups:
                    continue
                seen_groups.add(g)
                gid = svg_id("grp-", g)
                glayers = [lay for lay in self.graph.layers if grouping.get(lay.path) == g]
                emit_group(self.lines, self.info, self.graph, self.plan, g, gid, glayers,
                           grouped.get(g, {}), self.stage, self.pipelined, self.changed_layers,
                           self.selected)
                self.elements.append({"key": g, "kind": "group", "box": gid, "anchor": gid})
                continue
            if layer.path in hidden_layers or layer.path not in by_layer:
                continue
            self.layer(layer, li, folded.get(layer.path, [layer.path]), by_layer[layer.path], items)
        return by_layer

    def layer(self, layer: Any, li: int, reps: list[str], vids: list[str],
              items: dict[str, dict[str, Any]]) -> None:
        """One layer's cluster (a folded block's, for its members ``reps``), its submodule boxes and
        its nodes."""
        graph, plan = self.graph, self.plan
        st = self.stage.get(layer.path, 0)
        block = graph.block_of(layer.path)
        label = f"{block.name} × {len(reps)}" if len(reps) > 1 else layer.path
        label += f"  ·  {layer.type}"
        if self.pipelined:
            stages = sorted({self.stage.get(m, 0) for m in reps})
            label += f"  ·  stage {stages[0]}" if len(stages) == 1 else (
                "  ·  stages "
                f"{stages[0]}–{stages[-1]}")
        differs = member_differences(graph, plan, reps) if len(reps) > 1 else ""
        if differs:
            label += f"\n{differs}"
        grad_comm = param_collectives(layer, plan)
        if grad_comm:
            label += f"\n{grad_comm}"
        changed = any(m in self.changed_layers for m in reps)
        if changed:
            label = "Δ " + label
        cid = svg_id("cl-", layer.path)
        self.clusters[cid] = {"layer": layer.path, "block": block.name if len(reps) > 1 else None,
                              "label": label,
                              "expandable": len(reps) > 1, "differs": differs, "changed": changed,
                              "collapsible": bool(block is not None and len(reps) == 1
                                                  and block.name in self.expanded),
                              "target": _target_block(block.name) if len(reps) > 1 else layer.path,
                              "layers": reps, "type": layer.type, "modules": {}}
        color = CHANGED_COLOR if changed else STAGE_COLORS[st % len(STAGE_COLORS)]
        width = 3.5 if changed else 3 if layer.path == self.selected else 1.5
        style = "rounded,filled,dashed" if len(reps) > 1 else "rounded,filled"
        self.lines.append(f"  subgraph {_q('cluster_' + str(li))} {{")
        self.lines.append(f"    id={_q(cid)}; label={_q(label)}; labeljust=l; style={_q(style)}; "
                          f"fillcolor={_q(STAGE_FILLS[st % len(STAGE_FILLS)])}; color={_q(color)}; "
                          f"penwidth={width};")
        emit_module_boxes(self.lines, vids, items, layer, li, self.clusters[cid]["modules"])
        self.lines.append("  }")
        self.elements.append({"key": layer.path, "kind": "layer", "box": cid, "anchor": vids[0]})
        for vid in vids:
            self.node(vid, items[vid], layer, reps, st)

    def node(self, vid: str, it: dict[str, Any], layer: Any, reps: list[str], st: int) -> None:
        """One op's or module's node: its colour and tag from the split of the ops holding its
        weights (in each member of a folded block), its label, and what the front end shows of
        it."""
        graph = self.graph
        ops = it["ops"]
        first = ops[0]
        color, tag, distinct, member_note = node_fill(graph, self.plan, self.by_name, ops, reps)
        split = distinct[0]
        in_shapes, shapes = node_shapes(graph, self.by_name, ops)
        label, title = node_label(graph, self.layer_of, it, reps, shapes, tag)
        module = first.module_path if len(ops) == 1 else it["path"]
        self.info[vid] = {"kind": it["kind"], "label": title, "op": first.op if len(ops) == 1 else
                          ", ".join(sorted({short_op(o.op) for o in ops})[:6]),
                          "layer": it["layer"], "module": module,
                          "in_shapes": in_shapes, "out_shapes": shapes,
                          "flops": it["flops"] * len(reps), "flops_each": it["flops"],
                          "act_bytes": it["act"], "param_bytes": param_bytes(graph, it["params"]),
                          "split": split, "splits": distinct, "members": member_note, "stage": st,
                          "repeats": len(reps), "ops": len(ops),
                          "target": node_target(graph, layer.path, module, reps,
                                                bool(it["params"]))}
        attrs = f"id={_q(vid)}, label={_q(label)}, fillcolor={_q(color)}"
        if split == "activation" and len(distinct) == 1:
            attrs += ', color="#999999"'
        if layer.path == self.selected:
            attrs += ", penwidth=2"
        self.lines.append(f"  {_q(vid)} [{attrs}];")

    def edges(self, hidden_layers: set[str], read: set[str]) -> dict[tuple[str, str], str | None]:
        """(from id, to id) -> the communication it carries (None: none), deduplicated on the
        visible ends; the output's node is written, fed by the last layer's final op."""
        graph, node_vis, by_name = self.graph, self.node_vis, self.by_name
        block_name = {m: b.name for b in graph.blocks for m in b.members}
        comm = comm_edges(graph, self.plan)
        edges: dict[tuple[str, str], str | None] = {}
        for n in graph.nodes:
            dst = node_vis.get(n.name)
            for src in n.inputs:
                s = node_vis.get(src)
                if s is None or dst is None or s == dst:
                    continue
                sl = by_name[src].layer if src in by_name else None
                same_block = (sl is not None and block_name.get(sl) is not None
                              and block_name.get(sl) == block_name.get(n.layer))
                if same_block and sl != n.layer and (sl in hidden_layers
                                                     or n.layer in hidden_layers):
                    continue  # member i -> member i+1 inside a folded block: not drawn
                label = comm.get((src, n.name))
                if (s, dst) not in edges or (label and not edges[(s, dst)]):
                    edges[(s, dst)] = label
        finals = [n for n in graph.nodes if n.layer == graph.layers[-1].path and n.name in node_vis
                  and n.name not in read] if graph.layers else []
        if finals:
            oid = "out-output"
            self.lines.append(f"  {_q(oid)} [id={_q(oid)}, label=\"output\", shape=ellipse, "
                              "style=filled, "
                              f"fillcolor=\"#ffffff\"];")
            self.info[oid] = {"kind": "input", "label": "output", "layer": None}
            for n in finals[-1:]:
                edges.setdefault((node_vis[n.name], oid), comm.get((n.name, OUTPUT)))
        return edges

    def columns(self, edges: dict[tuple[str, str], str | None], by_layer: dict[str, list[str]],
                breaks: tuple[str, ...] | list[str], inputs: list[str]) -> None:
        """The edges, and the columns: an element in ``breaks`` starts a new column at the top;
        edges between columns do not rank."""
        column: dict[str, int] = {}
        col = 0
        starts: list[str] = []
        for e in self.elements:
            if e["key"] in breaks and column:
                col += 1
                starts.append(e["anchor"])
            column[e["key"]] = col
        vis_col: dict[str, int] = {}
        for e in self.elements:
            for vid in ([e["box"]] if e["kind"] == "group" else by_layer.get(e["key"], [])):
                vis_col[vid] = column[e["key"]]
        for (s, d), label in edges.items():
            extra = ("" if vis_col.get(s, 0) == vis_col.get(d, vis_col.get(s, 0))
                     else ", constraint=false")
            if label:
                self.lines.append(f"  {_q(s)} -> {_q(d)} [label={_q(' ' + label)}, "
                                  f"color={_q(COLLECTIVE_COLOR)}, "
                                  f"fontcolor={_q(COLLECTIVE_COLOR)}, penwidth=1.6{extra}];")
            else:
                self.lines.append(f"  {_q(s)} -> {_q(d)}{f' [{extra[2:]}]' if extra else ''};")
        if starts and self.elements:
            top = svg_id("in-", inputs[0]) if inputs else self.elements[0]["anchor"]
            self.lines.append("  {rank=same; " + " ".join(_q(x) for x in [top, *starts]) + ";}")
        self.lines.append("}")


def _target_block(block: str) -> str:
    return f"{block}.*"
