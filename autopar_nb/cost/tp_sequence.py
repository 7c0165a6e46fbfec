"""Whether sequence parallelism can apply to the tensor-parallel styles that :mod:`.tp_styles` derives."""

from __future__ import annotations

from .tp_refusals import packet
from .tp_styles import role_of


def sp_check(graph, by_name, styles: dict[str, str], sharded: dict[str, int]) -> str:
    """Why sequence parallelism cannot apply to these TP styles ("" when it can).

    Under SP the tensors between TP regions are sequence shards (dim 1 of ``(batch, seq, ...)``): vocab-parallel
    embeddings and rowwise Linears output them, norms run on them, colwise Linears all-gather them. The runtime cuts
    the sequence once, where the blocks start, so no embedding may be looked up after shards went through a block
    (T5's decoder embedding after its encoder). Every other
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
            began = next((m for m in graph.nodes if m.name in seq and m.op_class != "embedding"), None)
            if began is not None:  # the runtime cuts the sequence once, where the first block starts
                return (f"{n.module_path} looks up tokens after sequence shards went through "
                        f"{began.module_path or began.name} (an encoder-decoder)")
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
