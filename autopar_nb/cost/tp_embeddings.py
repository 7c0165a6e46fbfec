"""Which embeddings and tied weights the tensor-parallel walk (:mod:`.tp_styles`) may split: an
``nn.Embedding`` vocab-sharded only when its ids come from the model's inputs and its table is not
small, one with a column per attention head (T5's ``relative_attention_bias``) split by heads like
the scores it is added to, and a weight several modules share split only where every one of them is
split on the vocabulary."""

from __future__ import annotations


def from_inputs(graph, by_name) -> set[str]:
    """Names of the graph inputs and of the nodes computed from them (not from constants such as
    arange)."""
    out: set[str] = set()
    for n in graph.nodes:
        if any(i in out or i not in by_name for i in n.inputs):
            out.add(n.name)
    return out | {i for n in graph.nodes for i in n.inputs if i not in by_name}


def shardable_embedding(n, graph, from_input) -> bool:
    """An Embedding worth vocab-sharding: an ``nn.Embedding`` (not a bag) looked up with ids from
    the inputs, whose table has at least as many rows as columns."""
    if n.module_type != "Embedding" or not n.inputs or n.inputs[0] not in from_input:
        return False
    w = graph.params.get(n.params[0])
    return w is not None and len(w.shape) == 2 and w.shape[0] >= w.shape[1]


def head_biases(graph, by_name, from_input) -> dict[str, int]:
    """Embedding node -> H for tables with one column per attention head (T5's
    ``relative_attention_bias``): an ``nn.Embedding`` not worth vocab-sharding whose output (...,
    H), through views and elementwise ops, is an attention op's mask or is added to attention scores
    (B, H, T, T)."""
    readers: dict[str, list] = {}
    for n in graph.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n)

    def scores(name: str, heads: int) -> bool:
        shape = (tuple(by_name[name].out_shapes[0]) if name in by_name and by_name[name].out_shapes
                 else ())
        return len(shape) == 4 and shape[1] == heads and shape[2] == shape[3]

    out: dict[str, int] = {}
    for n in graph.nodes:
        if (n.op_class != "embedding" or n.module_type != "Embedding" or not n.params
                or not n.out_shapes or shardable_embedding(n, graph, from_input)):
            continue
        heads = int(n.out_shapes[0][-1])
        seen, todo = {n.name}, [n.name]
        while todo and n.name not in out:
            x = todo.pop()
            for r in readers.get(x, []):
                if r.op_class == "attention" and x not in r.inputs[:3] and r.in_shapes and \
                        len(r.in_shapes[0]) == 4 and r.in_shapes[0][1] == heads > 1:
                    out[n.name] = heads
                elif r.op_class == "elementwise" and heads > 1 and \
                        any(scores(i, heads) for i in r.inputs if i != x and i not in seen):
                    out[n.name] = heads
                elif r.op_class in ("view", "elementwise") and r.name not in seen:
                    seen.add(r.name)
                    todo.append(r.name)
    return out


def untied(graph, styles: dict[str, str], holders: dict[str, str]) -> set[str]:
    """Styled nodes whose weight another module shares (an output head tied to the token embedding:
    one parameter) when the modules sharing it are not all split on the vocabulary (rowwise
    embedding, colwise head): the runtime keeps a tie only between such shards, so the split ones go
    back to replicated. A module that holds the shared weight without running (T5's ``shared``) is
    split with them: ``holders`` gets its path -> style."""
    users: dict[str, list] = {}
    for n in graph.nodes:
        w = next((q for q in n.params if q in graph.params and len(graph.params[q].shape) == 2),
                 None)
        if w is not None and n.op_class in ("matmul", "embedding"):
            users.setdefault(w, []).append(n)
    out: set[str] = set()
    for w, nodes in users.items():
        owner = graph.params[w]
        idle = owner.module_path not in {n.module_path for n in nodes}
        if len({n.module_path for n in nodes}) + idle < 2:
            continue
        vocab = all(styles.get(n.name) == ("rowwise" if n.op_class == "embedding" else "colwise")
                    for n in nodes)
        held = {"Embedding": "rowwise", "Linear": "colwise"}.get(owner.module_type)
        if not vocab or (idle and held is None):
            out |= {n.name for n in nodes if n.name in styles}
        elif idle:
            holders[owner.module_path] = held
    return out
