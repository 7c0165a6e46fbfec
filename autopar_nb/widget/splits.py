"""What a plan does to the graph, as the graph view shows it: the split of each node's module (a
colour from :data:`SPLITS` and a tag in words), the pipeline stage tints, the collectives on the
edges that carry communication and on each layer's parameters, and how the members of a folded block
differ.
"""

from __future__ import annotations

from collections import Counter

from ..graph import ModelGraph, OpNode
from ..plan import DTYPE_NAMES, ITEMSIZE, Plan
from ..units import fmt_bytes
from .editor import STRATEGY_LABELS, current_strategy

# split key -> (legend label, fill colour). Light tints of the Okabe–Ito palette, chosen so that
# every pair stays apart (CIE76 ΔE >= 12) for normal vision and deuteranopia (Machado et al. 2009),
# and black text reads on each (contrast >= 8:1), checked by the tests. Nodes also name their split
# in words (SPLIT_TAGS).
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
SPLIT_PRIORITY = ["tp-colwise", "tp-rowwise", "vocab-parallel", "sequence-parallel", "fsdp",
                  "replicated", "activation"]
"""which split names a member of a folded block when its ops have several (a TP split says most)"""
STRATEGY_SPLITS: dict[str, tuple[str, ...]] = {
    "replicate": ("replicated",), "fsdp": ("fsdp",), "colwise": ("tp-colwise",),
    "rowwise": ("tp-rowwise",), "colwise-rowwise": ("tp-colwise", "tp-rowwise"),
    "vocab": ("vocab-parallel",), "sequence_parallel": ("sequence-parallel",),
    "none": ("activation",)}
"""a layer's strategy (editor.current_strategy) -> the split colours that show it"""
LEGEND_STRATEGY = {"replicated": "replicate", "fsdp": "fsdp", "tp-colwise": "colwise",
                   "tp-rowwise": "rowwise", "sequence-parallel": "sequence_parallel",
                   "vocab-parallel": "vocab"}
"""legend swatch -> the strategy a node or cluster dropped on it takes (the graph's
drag-to-split)"""
# pipeline stage hues: cluster outline and a pale background tint
STAGE_COLORS = ["#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#d6616b", "#8c6d31",
                "#17becf"]
STAGE_FILLS = ["#f0f6fc", "#fdf3ec", "#eff8f0", "#f4f3fa", "#f5f5f5", "#fbf0f1", "#f8f5ee",
               "#eefafc"]
CHANGED_COLOR = "#111111"
"""changed against the previous plan: a near-black dashed outline (nodes) or thick outline and "Δ"
(clusters): distinct from every fill by lightness, whatever the reader's colour vision"""
COLLECTIVE_COLOR = "#c0392b"
OUTPUT = "__output__"
"""name of the graph-output pseudo node (edges from the last layer's unconsumed ops)"""


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
        if plan.mesh.zero_stage >= 1 and plan.mesh.dp > 1 and lp.fsdp:
            return "fsdp"
        return "replicated"
    if lp.sequence_parallel and node.op_class in ("norm", "elementwise") and style != "replicate":
        return "sequence-parallel"
    return "activation"


def layer_strategy(graph: ModelGraph, plan: Plan | None, path: str) -> str:
    """A layer's strategy in the editor's words ("colwise-rowwise", "fsdp", ...; "none" without
    parameters)."""
    if plan is None:
        return "replicate"
    layer = graph.layer(path)
    if not layer.num_params:
        return "none"
    try:
        return current_strategy(plan.layer(path), plan, layer)
    except KeyError:
        return "replicate"


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = ITEMSIZE.get(dtype, 4)
    for s in shape:
        n *= s
    return n


def fill(splits: list[str]) -> tuple[str, str, list[str]]:
    """(fillcolor, tag, distinct splits by count) for a node whose ops or members have ``splits``:
    one colour, or two (a hard split, the second at least a quarter) when they differ."""
    counts = Counter(s for s in splits if s != "activation") or Counter(splits)
    ranked = [k for k, _ in counts.most_common()]
    if len(ranked) == 1:
        return SPLITS[ranked[0]][1], SPLIT_TAGS[ranked[0]], ranked
    a, b = ranked[:2]
    share = min(0.75, max(0.5, counts[a] / (counts[a] + counts[b])))
    tags = [t for t in (SPLIT_TAGS[a], SPLIT_TAGS[b]) if t]
    tag = "/".join(tags) if len(tags) < 2 or not (tags[0].startswith("TP")
                                                  and tags[1].startswith("TP")) else \
        "TP col/row"
    return f"{SPLITS[a][1]};{share:.2f}:{SPLITS[b][1]}", tag, ranked


def comm_edges(graph: ModelGraph, plan: Plan | None) -> dict[tuple[str, str], str]:
    """(src op, dst op) -> label for edges that carry communication: TP collectives from kernels_ext
    split rules (on the op's output or input) and pipeline send/recv between stages. Bytes are per
    rank per optimizer step (the edge's tensor over the local batch, global_batch / dp samples)."""
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
    final = {n.name for n in graph.nodes if not consumers.get(n.name)
             and n.layer == graph.layers[-1].path}

    def size(n: OpNode) -> str:
        return fmt_bytes(sum(nbytes(s, act_dtype or n.dtype) for s in n.out_shapes[:1]) * scale)

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
            kind = ("reduce-scatter" if sp and split.forward == "all_reduce"
                    else split.forward.replace("_", "-"))
            for m in consumers.get(n.name, []) + ([OUTPUT] if n.name in final else []):
                out[(n.name, m)] = f"{kind} {size(n)}"
        elif split.comm_on == "input" and (split.backward or split.forward):
            kind = (split.forward or split.backward).replace("_", "-")
            if sp and split.forward is None:
                kind = "all-gather"
            for src in n.inputs:
                s = by_name.get(src)
                label = size(s) if s is not None else _input_size(graph, src, scale, act_dtype)
                out[(src, n.name)] = (f"{kind}{' (bwd)' if not split.forward and not sp else ''} "
                                      f"{label}")
    return out


def _input_size(graph: ModelGraph, name: str, scale: float, act_dtype: str | None) -> str:
    if len(graph.inputs) != 1:
        return ""
    t = graph.inputs[0]
    dtype = act_dtype if act_dtype and not t.dtype.startswith(("int", "uint")) else t.dtype
    return fmt_bytes(nbytes(t.shape, dtype) * scale)


def member_differences(graph: ModelGraph, plan: Plan | None, members: list[str]) -> str:
    """How the members of a folded block differ ("31 TP col→row, 1 FSDP · recompute 30 none, 2
    full"), "" when they are alike."""
    if plan is None:
        return ""
    parts = []
    strat = Counter(STRATEGY_LABELS.get(s, s)
                    for s in (layer_strategy(graph, plan, m) for m in members))
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


def param_collectives(layer, plan: Plan | None) -> str:
    """The data-parallel collectives on a layer's parameters and gradients per step (cluster label):
    FSDP all-gather
    + reduce-scatter (ZeRO 2/3), or gradient all-reduce (DDP, ZeRO 1)."""
    if plan is None or plan.mesh.dp <= 1 or not layer.param_bytes:
        return ""
    try:
        lp = plan.layer(layer.path)
    except KeyError:
        return ""
    shard = layer.param_bytes / (plan.mesh.tp if lp.tp else 1)
    if plan.mesh.zero_stage >= 1:
        gathers = 2 if plan.mesh.zero_stage == 3 else 1
        return f"dp: all-gather {gathers}x + reduce-scatter {fmt_bytes(shard)}"
    return f"dp: all-reduce grads {fmt_bytes(shard)}"
