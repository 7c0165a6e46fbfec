"""The dashed boxes inside a layer's cluster: one per submodule that holds two or more of the
layer's visible nodes, nested as the modules are.
"""

from __future__ import annotations

import re

from .svg import dot_string as _q


def svg_id(prefix: str, name: str) -> str:
    """The id of a DOT element (and of the SVG element drawn for it): ``prefix`` and ``name`` with
    what an id cannot hold replaced by ``_``."""
    return prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def emit_module_boxes(lines: list[str], vids: list[str], items: dict, layer, li: int,
                      boxes: dict) -> None:
    """Write nested clusters for submodules of two or more visible items; ``boxes`` gets {box id:
    [path, type]}."""
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
            boxes[svg_id("cl-", m)] = [m, next((o.module_type for v in vids
                                                for o in items[v]["ops"]
                                                if o.module_path == m), "")]
            lines.append(f"{indent}subgraph {_q(f'cluster_{li}_{counter[0]}')} {{ "
                         f"id={_q(svg_id('cl-', m))}; label="
                         f"{_q(m[len(layer.path) + 1:])}; style=\"rounded,dashed\"; "
                         "color=\"#aaaaaa\"; fillcolor=none;")
            emit(sub, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, "    ")
