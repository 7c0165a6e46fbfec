"""Tensor-parallel styles by dataflow, for the cost model and the planner.

Tensor parallelism is derived from dataflow, not from names (Megatron-LM's pairing, Shoeybi et al. 2019):
walking the ops in order with a replicated/sharded state per tensor, a ``Linear`` that reads a replicated tensor is
``colwise`` (its output is sharded on the last dim), one that reads a sharded tensor is ``rowwise`` (its partial
output is all-reduced back to replicated); an ``Embedding`` is ``rowwise`` (vocab-parallel); a colwise ``Linear``
whose sharded output is the model's output is the vocab-parallel head (``loss_parallel``), kept only when it has at
least as many outputs as inputs (an LM head, not a 10-way classifier). Which ops are
Linear-like (a "colwise" and a "rowwise" split), Embedding-like, norms, reductions or splits, which collective each
style implies, and which views reshape, come from the op's ``kernels_ext`` rule (``splits``, ``tp_role``,
``layout``), never from its name, so a registered custom op takes part. A sharded
tensor that reaches an op that cannot take it (a norm, a residual add with a full-size replicated tensor, a
reduction, a Linear kept replicated, or a ``split``/``chunk``/``unbind``/``slice`` of the sharded last dim such as
nanoGPT's fused ``c_attn(x).split(C, dim=2)``, where contiguous shards would mix q, k and v) turns the Linears that
sharded it back to ``replicate``. Only ``nn.Linear`` and ``nn.Embedding`` modules get split styles (what PyTorch's
``ColwiseParallel``/``RowwiseParallel`` accept); an Embedding is vocab-sharded only when its ids come from the model's
inputs (not ``torch.arange`` positions) and the table has at least as many rows as columns (not a small table).
:func:`sp_check` says whether sequence parallelism is valid for the resulting styles. Head counts come from the
``view``/``reshape`` that splits a sharded last dim into ``(heads, head_dim)``; TP degrees must divide them and
every split Linear dim.
"""

from __future__ import annotations

import kernels_ext


def packet(op: str) -> str:
    """'aten.linear.default' -> 'linear' (for messages)."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def rule_of(op: str) -> kernels_ext.OpRule | None:
    """The kernels_ext rule for ``op`` (None for an op no rule covers)."""
    return kernels_ext.lookup(op)


def role_of(op: str) -> str:
    """The op's ``tp_role`` ("norm", "reduction", "split"; "" for an op TP shards pass through)."""
    rule = kernels_ext.lookup(op)
    return rule.tp_role if rule is not None else ""


def tp_walk(graph, by_name, out_numel, refused: dict[str, str] | None = None):
    """Assign colwise/rowwise styles by dataflow (module docstring). Returns (styles by node, name of the
    vocab-parallel head node or "", sharded node -> region id, styled node -> region id, view node -> head count).
    ``refused`` (when given) gets node -> why for Linears that must never be split (whatever a user override says):
    their sharded output is split/chunked along the sharded dim."""
    disabled: set[str] = set()
    refused = {} if refused is None else refused
    for _ in range(20):
        result = _walk_once(graph, by_name, out_numel, disabled, refused)
        if result[0] is None:
            disabled |= result[1]
            continue
        return result
    return {}, "", {}, {}, {}


def _from_inputs(graph, by_name) -> set[str]:
    """Names of the graph inputs and of the nodes computed from them (not from constants such as arange)."""
    out: set[str] = set()
    for n in graph.nodes:
        if any(i in out or i not in by_name for i in n.inputs):
            out.add(n.name)
    return out | {i for n in graph.nodes for i in n.inputs if i not in by_name}


def _shardable_embedding(n, graph, from_input) -> bool:
    """An Embedding worth vocab-sharding: an ``nn.Embedding`` (not a bag) looked up with ids from the inputs, whose
    table has at least as many rows as columns."""
    if n.module_type != "Embedding" or not n.inputs or n.inputs[0] not in from_input:
        return False
    w = graph.params.get(n.params[0])
    return w is not None and len(w.shape) == 2 and w.shape[0] >= w.shape[1]


def _splits_last_dim(n) -> bool:
    """A split/chunk/unbind/slice/select node that cuts its input's last dim."""
    if role_of(n.op) != "split" or not n.in_shapes or not n.out_shapes:
        return False
    src = tuple(n.in_shapes[0])
    for out in n.out_shapes:
        out = tuple(out)
        if len(out) == len(src) and out[-1:] != src[-1:]:
            return True
        if len(out) == len(src) - 1 and out == src[:-1]:
            return True
    return False


def _walk_once(graph, by_name, out_numel, disabled, refused):
    styles: dict[str, str] = {}
    sharded: dict[str, int] = {}  # node -> region id
    seeds: dict[str, frozenset] = {}
    region_of: dict[str, int] = {}
    heads: dict[str, int] = {}
    next_region = 0
    conflicts: set[str] = set()
    from_input = _from_inputs(graph, by_name)
    last: set[str] = set()  # sharded nodes whose sharded dim is still the last dim (colwise output, elementwise)
    for n in graph.nodes:
        p = packet(n.op)
        s_in = [i for i in n.inputs if i in sharded]
        splits = splits_of(n.op)
        linear_like = bool(n.params) and n.op_class == "matmul" and "colwise" in splits and "rowwise" in splits
        if linear_like and n.module_type != "Linear":
            if s_in:  # a Linear-like op PyTorch TP cannot shard reads a sharded tensor
                conflicts |= frozenset().union(*(seeds[i] for i in s_in))
            continue
        if linear_like and n.name not in disabled:
            if s_in:
                styles[n.name] = "rowwise"
                region_of[n.name] = sharded[s_in[0]]
            else:
                styles[n.name] = "colwise"
                rid = next_region
                # linears reading the same replicated input (q/k/v, w1/w3) belong to the same region
                for other, st in styles.items():
                    if st == "colwise" and other != n.name and by_name[other].inputs[:1] == n.inputs[:1]:
                        rid = region_of[other]
                        break
                else:
                    next_region += 1
                region_of[n.name] = rid
                sharded[n.name] = rid
                seeds[n.name] = frozenset([n.name])
                last.add(n.name)
            continue
        if linear_like and s_in:  # a Linear kept replicated cannot read a sharded tensor
            conflicts |= frozenset().union(*(seeds[i] for i in s_in))
            continue
        if n.op_class == "embedding" and "rowwise" in splits and n.params and n.name not in disabled and \
                _shardable_embedding(n, graph, from_input):
            styles[n.name] = "rowwise"
            region_of[n.name] = next_region
            next_region += 1
            continue
        if not s_in:
            continue
        seed = frozenset().union(*(seeds[i] for i in s_in))
        rep_in = [i for i in n.inputs if i not in sharded and i in by_name and by_name[i].op_class != "view"]
        if role_of(n.op) in ("norm", "reduction"):
            conflicts |= seed
            continue
        if s_in[0] in last and _splits_last_dim(n):  # fused QKV: contiguous shards would mix q, k and v
            conflicts |= seed
            for k in seed:
                refused[k] = (f"its output is cut by {p} ({n.name}) along the dim a colwise shard splits, so each "
                              "rank's contiguous shard would mix the pieces (e.g. q/k/v of a fused QKV)")
            continue
        if rep_in and any(out_numel.get(i, 0) >= out_numel.get(s_in[0], 0) for i in rep_in) and \
                n.op_class == "elementwise":
            conflicts |= seed
            continue
        rule = rule_of(n.op)
        if n.op_class == "view" and rule is not None and rule.layout in ("view", "reshape") and n.out_shapes:
            src = by_name.get(s_in[0])
            if src is not None and src.out_shapes:
                hc = _split_heads(src.out_shapes[0], n.out_shapes[0])
                if hc:
                    heads[n.name] = hc
        sharded[n.name] = sharded[s_in[0]]
        seeds[n.name] = seed
        src = by_name.get(s_in[0])
        if all(i in last for i in s_in) and src is not None and src.out_shapes and n.out_shapes and \
                tuple(n.out_shapes[0])[-1:] == tuple(src.out_shapes[0])[-1:]:
            last.add(n.name)
    final = {n.name for n in graph.nodes if n.name in sharded and n.name not in styles}
    head_node = ""
    used = {i for n in graph.nodes for i in n.inputs}
    for name in [n.name for n in graph.nodes if n.name in sharded]:
        if name not in used:  # a sharded model output
            w = graph.params.get(by_name[name].params[0]) if by_name[name].params else None
            # a vocab-parallel head only where it pays: many outputs per input (an LM head, not a 10-way classifier)
            if styles.get(name) == "colwise" and w is not None and len(w.shape) == 2 and w.shape[0] >= w.shape[1]:
                head_node = name
            else:
                conflicts |= seeds[name]
    # a colwise Linear with no rowwise partner and not the head (sharded tensor dies elsewhere) is fine only as head
    rowwise_regions = {region_of[k] for k, v in styles.items() if v == "rowwise" and
                       by_name[k].op_class != "embedding"}
    for k, v in styles.items():
        if v == "colwise" and k != head_node and region_of[k] not in rowwise_regions:
            conflicts.add(k)
    if conflicts:
        return None, conflicts
    del final
    return styles, head_node, sharded, region_of, heads


def splits_of(op: str) -> dict:
    """The TP splits kernels_ext registers for ``op`` (style -> Split), {} when none."""
    rule = kernels_ext.lookup(op)
    return rule.splits if rule is not None else {}


def _split_heads(in_shape, out_shape) -> int | None:
    """(B, T, D) -> (B, T, nh, hd) with nh * hd = D: the head count nh (the sharded outer factor)."""
    if len(out_shape) <= len(in_shape):
        return None
    k = len(in_shape) - 1
    if tuple(out_shape[:k]) != tuple(in_shape[:k]):
        return None
    rest = out_shape[k:]
    if len(rest) == 2 and rest[0] * rest[1] == in_shape[-1]:
        return int(rest[0])
    return None


def sp_check(graph, by_name, styles: dict[str, str], sharded: dict[str, int]) -> str:
    """Why sequence parallelism cannot apply to these TP styles ("" when it can).

    Under SP the tensors between TP regions are sequence shards (dim 1 of ``(batch, seq, ...)``): vocab-parallel
    embeddings and rowwise Linears output them, norms run on them, colwise Linears all-gather them. Every other
    reader must take a shard as it is: an elementwise op whose other operands are shards too or broadcast vectors
    (not ``wte(idx) + wpe(arange(T))``, a full-sequence table), a view that keeps ``(batch, seq)``; never a replicated
    Linear, a reduction, or the model's output.
    """
    if graph.seq_len is None:
        return "the inputs are not token sequences"
    seq: set[str] = set()
    used = {i for n in graph.nodes for i in n.inputs}
    for n in graph.nodes:
        p = packet(n.op)
        s_in = [i for i in n.inputs if i in seq]
        style = styles.get(n.name)
        if style == "rowwise" and n.op_class == "embedding":
            idx = tuple(n.in_shapes[1]) if len(n.in_shapes) > 1 else ()
            if len(idx) != 2 or idx[1] != graph.seq_len:
                return f"{n.module_path} looks up ids of shape {idx}, not (batch, seq)"
            seq.add(n.name)
        elif style == "rowwise":
            seq.add(n.name)
        elif style == "colwise" or n.name in sharded:
            continue  # colwise Linears gather their input; TP regions hold feature shards
        elif role_of(n.op) == "norm" and n.params and n.module_path:
            if not s_in:
                return f"norm {n.module_path} would read a full-sequence tensor where SP expects a sequence shard"
            seq.add(n.name)
        elif s_in:
            out = tuple(n.out_shapes[0]) if n.out_shapes else ()
            src = tuple(by_name[s_in[0]].out_shapes[0]) if by_name[s_in[0]].out_shapes else ()
            if n.op_class == "elementwise":
                others = [i for i in n.inputs if i not in seq and i in by_name and by_name[i].out_shapes and
                          len(by_name[i].out_shapes[0]) >= 2]
                if others:
                    return (f"{n.name} combines a sequence shard with the full-sequence tensor {others[0]} "
                            f"({by_name[others[0]].module_path or 'computed in forward'})")
                seq.add(n.name)
            elif n.op_class == "view" and len(out) >= 2 and out[:2] == src[:2]:
                seq.add(n.name)
            elif n.op_class == "view" and not n.out_shapes:
                continue  # a metadata check (aten._assert_tensor_metadata, e.g. before a norm's .to()): no output
            elif n.op_class == "reduction" and len(out) >= 2 and out[:2] == src[:2]:
                seq.add(n.name)  # over the features of each token (a norm written in Python: x.pow(2).mean(-1))
            else:
                return f"{n.name} ({p}{' in ' + n.module_path if n.module_path else ''}) reads a sequence shard"
    outs = [name for name in seq if name not in used]
    if outs:
        return f"the model's output {outs[0]} would be a sequence shard"
    return ""
