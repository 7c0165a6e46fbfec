"""Which node shows each op in one view of the graph: the members of a repeated block folded into
its first member (unless expanded), and the ops a module depth below their layer sharing that
module's node.
"""

from __future__ import annotations

from ..graph import ModelGraph, OpNode

MAX_OPS_SHOWN = 400
"""above this many visible ops, ``layout(depth=None)`` collapses ops into their modules"""


def fold_blocks(graph: ModelGraph, expanded: set[str] | frozenset[str]) -> tuple[
        dict[str, str], set[str], dict[str, list[str]]]:
    """Folding: the ops of hidden block members map onto the same-position op of the first member.
    Returns (op -> the op it is drawn as, the hidden layers, first member -> every member) for the
    blocks not ``expanded``."""
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
    return alias, hidden_layers, folded


def module_below_layer(n: OpNode) -> list[str]:
    """The op's module path below its layer, as names ([] at the layer itself)."""
    lp = n.layer
    if n.module_path == lp or not n.module_path.startswith(lp + "."):
        return []
    return n.module_path[len(lp) + 1:].split(".")


def shown_depth(visible_ops: list[OpNode], depth: int | None) -> tuple[int, int]:
    """(the module depth shown, the deepest there is): ``depth`` within range, or without one the
    deepest that shows at most MAX_OPS_SHOWN nodes."""
    max_depth = max((len(module_below_layer(n)) for n in visible_ops), default=0) + 1
    if depth is None:
        depth = max_depth
        while depth > 0 and len({node_key(n, module_below_layer(n), depth)
                                 for n in visible_ops}) > MAX_OPS_SHOWN:
            depth -= 1
    return max(0, min(depth, max_depth)), max_depth


def node_key(n: OpNode, rel: list[str], depth: int) -> str:
    """What the op's node stands for at ``depth`` (``rel``: its module below its layer). Depth 0:
    the layer; depth d: the module d levels below the layer when the op lies that deep, else the
    op."""
    if depth == 0:
        return n.layer
    if len(rel) >= depth:
        return n.layer + "." + ".".join(rel[:depth])
    return n.name
