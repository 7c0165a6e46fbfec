"""Why the tensor-parallel walk (:mod:`.tp_styles`) keeps an attention whole, in one line for ``explain()`` and the
widget's override choices: a tensor of every head that a rank holding some of the heads cannot take as it is."""

from __future__ import annotations


def packet(op: str) -> str:
    """'aten.linear.default' -> 'linear' (for messages)."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def whole_bias(n, sharded, by_name) -> str:
    """Why matmul ``n`` cannot take operands split by heads when it adds a replicated tensor to their product (Bloom's
    ``alibi.baddbmm(q, k)``: the ALiBi bias of every head, made by the model and passed in); "" for another cause."""
    bias = [by_name[i].out_shapes[0] for i in n.inputs[:-2] if i not in sharded and i in by_name]
    if not bias or not all(i in sharded for i in n.inputs[-2:]):
        return ""
    return (f"{n.module_path or 'the model'} adds a tensor of every head made outside it (shape "
            f"{'x'.join(map(str, bias[0]))}, e.g. an ALiBi bias passed in) to its split scores in {packet(n.op)}: "
            "a rank holds only its own heads")


def refuse_shared(n, s_in: list[str], seed, refused: dict[str, str], sharded, graph, by_name, out_numel) -> bool:
    """True, and the projections ``seed`` that split ``s_in`` refused with :func:`shared_by_heads`'s reason, when
    elementwise op ``n`` meets its sharded inputs ``s_in`` with one tensor shared by all heads."""
    why = shared_by_heads(n, s_in, sharded, graph, by_name, out_numel)
    refused.update({k: why for k in seed if why and k not in refused})
    return bool(why)


def shared_by_heads(n, s_in: list[str], sharded, graph, by_name, out_numel) -> str:
    """Why elementwise op ``n`` cannot meet its sharded inputs ``s_in`` (split by heads) with a replicated input as
    large, which is one tensor broadcast to every head by ``expand`` and computed from trainable parameters (MLA's
    rope key, made by the low-rank key/value projection and shared by all heads: written into every head's key); ""
    for another cause. Each rank would compute that tensor's gradient from its own heads only, and nothing in the
    plain tensors between the modules sums it over the ranks."""
    for i in n.inputs:
        x = by_name.get(i)
        if x is None or i in sharded or packet(x.op) != "expand" or not x.in_shapes or not x.out_shapes or \
                len(x.in_shapes[0]) != len(x.out_shapes[0]) or out_numel.get(i, 0) < out_numel.get(s_in[0], 0) or \
                not any(a == 1 < b for a, b in zip(x.in_shapes[0], x.out_shapes[0], strict=True)):
            continue
        source = _trained_source(i, graph, by_name)
        if source is None:
            continue
        shape = "x".join(map(str, x.in_shapes[0]))
        return (f"{n.module_path or 'the model'} writes one tensor that all heads share into every head ({shape} "
                f"from {source}, broadcast over the heads by expand into {packet(n.op)}: e.g. MLA's rope key); split "
                "by heads, a rank would sum its gradient over its own heads only, and no TP style sums it over the "
                "ranks")
    return ""


def _trained_source(name: str, graph, by_name) -> str | None:
    """The module of the nearest op with a trainable parameter that ``name`` is computed from (None: none)."""
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
