"""Why the tensor-parallel walk (:mod:`.tp_styles`) keeps an attention whole, in one line for
``explain()`` and the widget's override choices: a tensor of every head that a rank holding some of
the heads cannot take as it is; the one such tensor TP can take (one piece of one replicated
projection's output: MLA's rope key, :func:`shared_piece`); and which of a walk's conflicts are kept
whole first (:func:`first_causes`)."""

from __future__ import annotations


def packet(op: str) -> str:
    """'aten.linear.default' -> 'linear' (for messages)."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


class Blame(dict):
    """Node -> why the TP walk keeps it whole: the first cause a walk found for it (``explain()``,
    the widget)."""

    def add(self, nodes, why: str) -> None:
        for k in nodes:
            self.setdefault(k, why)


def where(n) -> str:
    """'layer_norm in transformer.h.0.ln_1' (for messages)."""
    return f"{packet(n.op)} in {n.module_path or 'the model'}"


def whole_bias(n, sharded, by_name) -> str:
    """Why matmul ``n`` cannot take operands split by heads when it adds a replicated tensor to
    their product that does not go with the heads (:func:`bias_with_heads`): one made inside the
    module, or whose dim 0 is not the product's; "" for another cause."""
    bias = [by_name[i].out_shapes[0] for i in n.inputs[:-2] if i not in sharded and i in by_name]
    if (not bias or not all(i in sharded for i in n.inputs[-2:])
        or bias_with_heads(n, sharded, by_name)):
        return ""
    return (f"{n.module_path or 'the model'} adds a tensor of every head (shape "
            f"{'x'.join(map(str, bias[0]))}) to its split scores in {packet(n.op)} that TP cannot "
            "cut to a rank's heads: it is made inside the module, or its dim 0 is not the "
            "product's batch x heads")


def bias_with_heads(n, sharded, by_name) -> bool:
    """Whether every replicated tensor that matmul ``n`` adds to the product of its two operands
    split by heads (a batched product: heads flattened with the batch in dim 0) can go with the
    heads: it broadcasts over dim 0 (size 1, or fewer dims), or it holds dim 0 whole and is made
    outside ``n``'s module (Bloom's ALiBi bias (batch x heads, 1, T) in ``alibi.baddbmm(q, k)``,
    built once by the model and passed to every attention), so that the runtime cuts it to the
    rank's heads on the way in (``runtime/heads.py``), as the split projections cut the operands;
    the planner's stand-in run checks that it does (``planner/forward.py``)."""
    if not n.out_shapes or not all(i in sharded for i in n.inputs[-2:]):
        return False
    out = tuple(n.out_shapes[0])
    for i in n.inputs[:-2]:
        x = by_name.get(i)
        if i in sharded or x is None:
            continue
        shape = tuple(x.out_shapes[0]) if x.out_shapes else ()
        # fewer dims: broadcast over the leading ones
        shape = (1,) * (len(out) - len(shape)) + shape
        if len(shape) != len(out) or any(a not in (1, b)
                                         for a, b in zip(shape[1:], out[1:], strict=True)):
            return False
        # the runtime cuts only what enters the module
        inside = (not n.module_path or x.module_path == n.module_path
                  or x.module_path.startswith(n.module_path + "."))
        if shape[0] != 1 and (shape[0] != out[0] or inside):
            return False
    return True


def refuse_shared(n, s_in: list[str], seed, refused: dict[str, str], sharded, graph, by_name,
                  out_numel, shared: dict[str, tuple[int, int, int]]) -> bool:
    """True, and the projections ``seed`` that split ``s_in`` refused with :func:`shared_by_heads`'s
    reason, when elementwise op ``n`` meets its sharded inputs ``s_in`` with one tensor shared by
    all heads that cannot be isolated (:func:`shared_piece`). Where it can, ``shared`` gets its
    projection node -> (first, last + 1 feature, region) and the split goes on: the runtime sums
    that piece's gradient over the TP ranks."""
    why, src = shared_by_heads(n, s_in, sharded, graph, by_name, out_numel)
    piece = shared_piece(src, graph, by_name, sharded) if why else None
    if piece is not None:
        shared[piece[0]] = (piece[1], piece[2], sharded[s_in[0]])
        return False
    refused.update({k: why for k in seed if why and k not in refused})
    return bool(why)


def shared_piece(name: str, graph, by_name, sharded) -> tuple[str, int, int] | None:
    """(projection node, first feature, last feature + 1) of the one replicated ``Linear`` whose
    output features ``name`` (a tensor broadcast to every head) is computed from, through a split of
    its last dim and ops without trainable parameters (MLA's rope key: ``kv_a_proj_with_mqa``'s last
    ``qk_rope_head_dim`` outputs, rotated by rope); None when there is not exactly one such piece
    (then no style can sum its gradient alone)."""
    todo, seen, found = [name], {name}, set()
    while todo:
        n = by_name.get(todo.pop())
        if n is None:
            continue
        for i in n.inputs:
            x = by_name.get(i)
            if x is None or i in seen:
                continue
            seen.add(i)
            if any(p in graph.params and graph.params[p].trainable for p in x.params):
                found.add((i, n.name))
            else:
                todo.append(i)
    if len(found) != 1:
        return None
    proj, cut = next(iter(found))
    p, c = by_name[proj], by_name[cut]
    if p.module_type != "Linear" or proj in sharded or packet(c.op) not in ("split_with_sizes",
                                                                            "split") or \
            not p.out_shapes or any(len(o) != len(p.out_shapes[0]) for o in c.out_shapes):
        return None
    widths = [int(o[-1]) for o in c.out_shapes]
    used = {tuple(r.in_shapes[0]) for r in graph.nodes if cut in r.inputs and r.name in seen
            and r.in_shapes}
    hits = [k for k, o in enumerate(c.out_shapes) if tuple(o) in used]
    if len(hits) != 1 or [tuple(o) for o in c.out_shapes].count(tuple(c.out_shapes[hits[0]])) != 1:
        return None  # which piece reaches the heads cannot be told from the shapes
    start = sum(widths[:hits[0]])
    return proj, start, start + widths[hits[0]]


def shared_by_heads(n, s_in: list[str], sharded, graph, by_name, out_numel) -> str:
    """Why elementwise op ``n`` cannot meet its sharded inputs ``s_in`` (split by heads) with a
    replicated input as large, which is one tensor broadcast to every head by ``expand`` and
    computed from trainable parameters (MLA's rope key, made by the low-rank key/value projection
    and shared by all heads: written into every head's key); "" for another cause. Each rank would
    compute that tensor's gradient from its own heads only, and nothing in the plain tensors between
    the modules sums it over the ranks. Returns (why, that tensor's node)."""
    for i in n.inputs:
        x = by_name.get(i)
        if (x is None or i in sharded or packet(x.op) != "expand" or not x.in_shapes
                or not x.out_shapes or len(x.in_shapes[0]) != len(x.out_shapes[0])
                or out_numel.get(i, 0) < out_numel.get(s_in[0], 0)
                or not any(a == 1 < b
                           for a, b in zip(x.in_shapes[0], x.out_shapes[0], strict=True))):
            continue
        source = _trained_source(i, graph, by_name)
        if source is None:
            continue
        shape = "x".join(map(str, x.in_shapes[0]))
        return (f"{n.module_path or 'the model'} writes one tensor that all heads share into every "
                f"head ({shape} from {source}, broadcast over the heads by expand into "
                f"{packet(n.op)}: e.g. MLA's rope key); split by heads, a rank would sum its "
                "gradient over its own heads only, and it is not one piece of one projection's "
                "output, whose gradient TP could sum over the ranks"), i
    return "", ""


def _trained_source(name: str, graph, by_name) -> str | None:
    """The module of the nearest op with a trainable parameter that ``name`` is computed from (None:
    none)."""
    todo, seen = [name], {name}
    while todo:
        n = by_name.get(todo.pop(0))
        if n is None:
            continue
        if any(p in graph.params and graph.params[p].trainable for p in n.params):
            return n.module_path
        todo += [i for i in n.inputs if i not in seen]
        seen.update(n.inputs)
    return None


def first_causes(conflicts: set[str], graph, by_name) -> set[str]:
    """The conflicting nodes that no other conflicting node of their layer feeds. A conflict
    downstream of another may be its consequence, so it is decided on the next walk, once the first
    are kept whole: MLA's low-rank ``q_a_proj``, wrongly taken for colwise, makes ``q_b_proj`` its
    rowwise partner, which leaves the attention's output replicated and ``o_proj`` colwise; keeping
    ``o_proj`` whole with it would lose the attention's split."""
    readers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.name)
    fed: set[str] = set()
    for c in conflicts:
        layer, todo, seen = by_name[c].layer, [c], {c}
        while todo:
            for r in readers.get(todo.pop(), ()):
                if r not in seen and by_name[r].layer == layer:
                    seen.add(r)
                    todo.append(r)
        fed |= (seen - {c}) & conflicts
    return (conflicts - fed) or conflicts
