"""What tensor parallelism needs to know of each layer: its modules' styles and parts, the sizes the
TP degree must divide, the key/value projections it may repeat, vocabularies, the norms outside TP
regions, and which parameters it splits."""

from __future__ import annotations

from ..autocast import NORM_MODULES
from ..tp_styles import splits_of
from .facts import Facts, in_layers
from .layers import LayerProfile, Repeatable


def count_tp(layers: dict[str, LayerProfile], f: Facts) -> set[str]:
    """Per layer: module TP styles, their parts, regions, what the TP degree must divide (split
    Linear dims, head counts, parts), the key/value projections it may repeat instead,
    vocabularies, vocab-parallel embedding parameters, norms outside TP regions. Returns the
    parameters TP splits."""
    split_params: set[str] = set()
    kv = _key_value_projections(f)
    for lp, n in in_layers(layers, f):
        style = f.tp.styles.get(n.name)
        if style:
            _count_styled(lp, n, style, f, kv, split_params)
        # whole on every rank, a piece of its output's gradient summed over them
        if n.name in f.tp.shared:
            first, end, region = f.tp.shared[n.name]
            width = int(n.out_shapes[0][-1])
            lp.tp[n.module_path] = "shared"
            lp.shared[n.module_path] = [first, end - first] + ([width - end] if end < width else [])
            lp.regions.add(region)
        # whole on every rank, fed each rank's heads, its gradient summed over them
        if n.name in f.tp.per_head:
            lp.tp[n.module_path] = "per_head"
            lp.regions.add(f.tp.per_head[n.name])
        norm_op = n.op_class == "norm" and "sequence_parallel" in splits_of(n.op)
        if (norm_op or _python_norm(n)) and n.name not in f.tp.sharded and n.module_path and \
                n.params and n.module_path not in lp.norms:
            lp.norms.append(n.module_path)
    # head-indexed tables go with their heads (runtime/heads.py's shard_head_tables), found by a
    # layout run at plan time: a rank holds heads / tp of them
    split_params.update(t for t in getattr(f.graph, "tp_tables", {}) if t in f.graph.params)
    owner = {m: lay.path for lay in f.graph.layers for m in lay.modules}
    # a module holding a shared weight without running is split with its users
    for module, style in f.tp.holders.items():
        if owner.get(module) in layers:
            layers[owner[module]].tp[module] = style
    for lp, n in in_layers(layers, f):
        hc = f.tp.heads.get(n.name)
        if hc:
            lp.heads.add(hc)
            lp.divisors.add(hc)
    return split_params


def _count_styled(lp: LayerProfile, n, style: str, f: Facts, kv: set[str],
                  split_params: set[str]) -> None:
    """:func:`count_tp`'s terms of op ``n``, which TP splits in ``style``; the parameters it splits
    are added to ``split_params``."""
    params = f.graph.params
    lp.tp[n.module_path] = style
    lp.regions.add(f.tp.region_of.get(n.name, -1))
    pp = f.tp.parts.get(n.name)
    # a rowwise projection's bias is added after the all-reduce, whole; so is that of a projection
    # split part by part (runtime/layouts.py's PackedColwiseParallel keeps it whole: FSDP could not
    # cut it part by part)
    packed = pp is not None and len(pp.counts) > 1 and not pp.gathered and not pp.table
    for pname in n.params:
        pi = params.get(pname)
        if pi is None or pi.is_buffer:
            continue
        if not (pname.endswith("bias") and (style == "rowwise" or packed and len(pi.shape) == 1)):
            split_params.add(pname)
    # the weight: the first 2-D parameter (addmm, Conv1D's op, reads its bias first)
    w = next((params[q] for q in n.params if q in params and len(params[q].shape) == 2),
             params.get(n.params[0]) if n.params else None)
    is_embedding = n.op_class == "embedding"
    if w is not None and is_embedding and style == "rowwise" and w.trainable:
        lp.embedding_params += w.numel
    if pp is not None:
        lp.parts[n.module_path] = pp
    if n.name in kv:
        # tp divides its heads (split) or is a multiple of them (repeated):
        # planner.degrees.tp_blockers
        ps = [params[q] for q in n.params
              if q in params and not params[q].is_buffer and params[q].trainable]
        lp.repeatable[n.module_path] = Repeatable(min(pp.counts), n.flops, n.bwd_flops,
                                                  sum(q.numel for q in ps),
                                                  sum(q.numel * q.itemsize for q in ps))
        if len(pp.counts) > 1:  # a fused multi-query projection: tp splits its query heads
            lp.divisors.add(max(pp.counts))
            lp.heads.add(max(pp.counts))
    elif w is not None and len(w.shape) == 2:
        if (is_embedding or n.name == f.tp.head) and not (pp is not None and pp.table):
            lp.vocab.add(w.shape[0])
        elif not is_embedding:
            out_dim = 1 if n.module_type == "Conv1D" else 0  # Conv1D stores its weight (in, out)
            lp.divisors.add(w.shape[out_dim] if style == "colwise" else w.shape[1 - out_dim])
    if pp is not None and n.name not in kv:
        lp.divisors.update(pp.counts)
        if pp.heads:
            lp.heads.update(pp.counts)


def _key_value_projections(f: Facts) -> set[str]:
    """Colwise ``nn.Linear`` nodes split into fewer heads than the query projection of their region
    (GQA/MQA's key and value projections), or fused projections whose key/value parts have fewer
    heads than their query part (Falcon's multi-query ``query_key_value``: 4 + 1 + 1 heads): TP may
    repeat them (their weight whole on every rank) when it exceeds those heads."""
    most: dict[int, int] = {}
    single = {k: pp.counts[0] for k, pp in f.tp.parts.items()
              if len(pp.counts) == 1 and pp.heads and not pp.table}
    for k, h in single.items():
        r = f.tp.region_of[k]
        most[r] = max(most.get(r, 0), h)
    fused = {k for k, pp in f.tp.parts.items() if len(pp.counts) > 1 and pp.heads and not pp.table
             and min(pp.counts) < max(pp.counts)
             and all(max(pp.counts) % h == 0 for h in pp.counts)}
    return {k for k in fused if f.by_name[k].module_type == "Linear"} | {
        k for k, h in single.items() if f.by_name[k].module_type == "Linear"
        and h < most[f.tp.region_of[k]] and most[f.tp.region_of[k]] % h == 0}


def _python_norm(n) -> bool:
    """A node of a norm module written in Python that reads its weight."""
    return bool(n.module_type) and n.module_type.endswith(NORM_MODULES) and \
        n.op_class == "elementwise"
