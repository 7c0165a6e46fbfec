"""Whether sequence parallelism can apply to the tensor-parallel styles that :mod:`.tp_styles`
derives."""

from __future__ import annotations

from typing import NamedTuple

from ..plan import within
from .tp_refusals import packet
from .tp_styles import role_of

RESHAPES = ("view", "reshape", "_unsafe_view")
"""ops that take their output's sizes from the caller: a no-op on the global shape is not one on a
shard"""


class SpExtent(NamedTuple):
    """How far sequence parallelism reaches (:func:`sp_extent`)."""

    refused: str
    """why sequence parallelism cannot apply at all ("" when it can)"""
    last: str = ""
    """the last layer whose outputs may stay sequence shards ("": every layer, the region may end at
    the head)"""
    why_last: str = ""
    """why the region ends at :attr:`last`: what a shard would run wrong in the layers after it"""
    gather: str = ""
    """the layer after :attr:`last` that gathers the sequence at its input"""
    before: tuple[str, ...] = ()
    """the layers with parameters before the first block (:func:`first_block`), embeddings aside:
    they run on whole activations (a norm of the embeddings alone)"""


def sp_extent(graph, by_name, styles: dict[str, str], sharded: dict[str, int]) -> SpExtent:
    """Whether, and over which layers, sequence parallelism can apply to these TP styles.

    Under SP the tensors between TP regions are sequence shards (dim 1 of ``(batch, seq, ...)``):
    rowwise Linears output them, norms run on them, colwise Linears all-gather them. Vocab-parallel
    embeddings output replicated activations, which may be combined before the blocks (GPT-2's
    ``wte(idx) + wpe(arange(T))``, dropout); the runtime cuts the sequence once, at the first
    block's input (``planner.styles``: ``PrepareFirstInput``), so the first block's first read of
    such an activation is where shards begin, and no embedding may be looked up after shards went
    through a block (T5's decoder embedding after its encoder). Every other reader must take a shard
    as it is: an elementwise op whose other operands are shards too or broadcast vectors (not a
    full-sequence tensor), a view that keeps ``(batch, seq)``; never a replicated Linear, a
    reduction, or the model's output.

    Where a reader after the blocks cannot take a shard (Hugging Face GPT-2's ``view(-1, T, C)``
    after ``ln_f``, sized from the global input), the region ends earlier: the runtime gathers the
    whole sequence at the input of the first layer with parameters after the region
    (``planner.styles``: ``GATHER``), so that layer and the ones after it run on whole, replicated
    activations. :attr:`SpExtent.last` is then the last layer before it; SP is refused only where no
    such earlier end works.
    """
    why, failed = _walk(graph, by_name, styles, sharded)
    before = _before_blocks(graph, styles, sharded)
    if not why or failed is None:
        return SpExtent(why, before=before)
    layers = [lay.path for lay in graph.layers]
    embedded = {n.layer for n in graph.nodes if n.op_class == "embedding"}
    split = {n.layer for n in graph.nodes if styles.get(n.name) in ("colwise", "rowwise")
             or n.name in sharded}
    if any(n.layer in embedded and n.params and n.op_class != "embedding" for n in graph.nodes):
        # an embedding layer that normalizes too (BERT's) would start the runtime's region
        return SpExtent(why)
    # the runtime's region ends at a split layer; its next layer with parameters gathers (at or
    # before the failure)
    ends = [i for i, lay in enumerate(graph.layers) if lay.num_params and lay.path not in embedded]
    after = max((i for i in ends if i <= layers.index(failed)), default=None)
    last = max((i for i in ends if after is not None and i < after), default=None)
    if last is None or layers[last] not in split or _walk(graph, by_name, styles, sharded,
                                                          layers[after])[0]:
        return SpExtent(why)
    return SpExtent("", layers[last], why, layers[after], before)


def first_block(graph, styles: dict[str, str], sharded: dict[str, int]) -> str | None:
    """The first layer, embeddings' aside, that holds a split Linear: the runtime cuts the sequence
    at its input (``planner.styles``' region starts at the first split layer), so a layer with
    parameters before it (Bloom's ``word_embeddings_layernorm``, a norm of the embeddings alone)
    runs on whole activations."""
    embedded = {n.layer for n in graph.nodes if n.op_class == "embedding"}
    split = {n.layer for n in graph.nodes if styles.get(n.name) in ("colwise", "rowwise")
             or n.name in sharded}
    return next((lay.path for lay in graph.layers if lay.path in split
                 and lay.path not in embedded), None)


def _before_blocks(graph, styles: dict[str, str], sharded: dict[str, int]) -> tuple[str, ...]:
    """:attr:`SpExtent.before`."""
    first = first_block(graph, styles, sharded)
    embedded = {n.layer for n in graph.nodes if n.op_class == "embedding"}
    layers = [lay.path for lay in graph.layers]
    end = layers.index(first) if first is not None else len(layers)
    return tuple(lay.path for lay in graph.layers[:end] if lay.num_params
                 and lay.path not in embedded)


def _walk(graph, by_name, styles: dict[str, str], sharded: dict[str, int], after: str | None = None
          ) -> tuple[str, str | None]:
    """(why a shard would run wrong, the layer of the op that would: None when no op does) with the
    sequence gathered at the input of layer ``after`` (None: SP up to the model's output); see
    :func:`sp_extent`."""
    if graph.seq_len is None:
        return "the inputs are not token sequences", None
    seq: set[str] = set()
    # replicated activations made from vocab-parallel lookups before the blocks
    pre: set[str] = set()
    embedded = {n.layer for n in graph.nodes if n.op_class == "embedding"}
    first = first_block(graph, styles, sharded)
    index = {lay.path: i for i, lay in enumerate(graph.layers)}
    blocks = {lay.path for lay in graph.layers if lay.num_params and lay.path not in embedded and
              first is not None and index[lay.path] >= index[first]}
    split = {n.module_path for n in graph.nodes
             if n.module_path
             and (styles.get(n.name) in ("colwise", "rowwise") or n.name in sharded)}
    used = {i for n in graph.nodes for i in n.inputs}
    gather, past, entry = index.get(after, len(index)), False, None
    for n in graph.nodes:
        p = packet(n.op)
        past = past or index.get(n.layer, -1) >= gather
        # whole activations from the input of layer `after` on, which gathers what enters that
        # module
        if past:
            bypass = ([] if n.layer == after and within(n.module_path, after)
                      else [i for i in n.inputs if i in seq])
            if bypass:
                return (f"{n.name} ({p}) reads a sequence shard that bypasses {after}, which "
                        "gathers them"), n.layer
            continue
        cut = [i for i in n.inputs if i in pre]
        if cut and not seq and n.layer in blocks:
            seq.add(cut[0])  # the first block's input: the runtime cuts it along the sequence
            pre.clear()
            entry = (cut[0], n.layer)
        shards = _shards_seen(n, seq, entry)
        s_in = [i for i in n.inputs if i in shards]
        if pre and not s_in and [i for i in n.inputs if i in pre]:
            # still before the blocks: elementwise ops, dropout, views of replicated activations
            pre.add(n.name)
            continue
        style = styles.get(n.name)
        if style == "rowwise" and n.op_class == "embedding":
            idx = tuple(n.in_shapes[1]) if len(n.in_shapes) > 1 else ()
            if len(idx) != 2 or idx[1] != graph.seq_len:
                return f"{n.module_path} looks up ids of shape {idx}, not (batch, seq)", n.layer
            began = next((m for m in graph.nodes if m.name in seq and m.op_class != "embedding"),
                         None)
            # the runtime cuts the sequence once, where the first block starts
            if began is not None:
                return (f"{n.module_path} looks up tokens after sequence shards went through "
                        f"{began.module_path or began.name} (an encoder-decoder)"), n.layer
            pre.add(n.name)
        elif style == "rowwise":
            seq.add(n.name)
        elif style == "colwise" or n.name in sharded:
            continue  # colwise Linears gather their input; TP regions hold feature shards
        elif n.module_path in split:
            # the split module's own views (Hugging Face Conv1D flattens (batch, seq) around its
            # addmm)
            if s_in:
                seq.add(n.name)
        elif role_of(n.op) == "norm" and n.params and n.module_path:
            if not s_in:
                return (f"norm {n.module_path} would read a full-sequence tensor where SP expects "
                        "a sequence shard"), n.layer
            seq.add(n.name)
        elif s_in:
            why = _shard_reader(n, p, s_in, shards, by_name)
            if why:
                return why, n.layer
            if why is not None:
                seq.add(n.name)
    outs = [name for name in seq if name not in used]
    if outs:
        return f"the model's output {outs[0]} would be a sequence shard", None
    return "", None


def _shards_seen(n, seq: set[str], entry: tuple[str, str] | None) -> set[str]:
    """The sequence shards as op ``n`` reads them: the runtime cuts the first block's input where it
    enters that module (``entry``: (tensor, layer)), so an op outside the block reads that tensor
    whole."""
    if entry is None or within(n.module_path, entry[1]):
        return seq
    return seq - {entry[0]}


def _shard_reader(n, p: str, s_in: list[str], seq: set[str], by_name) -> str | None:
    """Whether op ``n`` (outside split modules and norms) can read the sequence shards ``s_in``: ""
    when its output is a shard too, None when it has no output, else why it cannot."""
    out = tuple(n.out_shapes[0]) if n.out_shapes else ()
    src = tuple(by_name[s_in[0]].out_shapes[0]) if by_name[s_in[0]].out_shapes else ()
    where = f"{n.name} ({p}{' in ' + n.module_path if n.module_path else ''})"
    if n.op_class == "elementwise":
        others = [i for i in n.inputs if i not in seq and i in by_name and by_name[i].out_shapes and
                  len(by_name[i].out_shapes[0]) >= 2]
        if others:
            return (f"{n.name} combines a sequence shard with the full-sequence tensor {others[0]} "
                    f"({by_name[others[0]].module_path or 'computed in forward'})")
        return ""
    if n.op_class == "view" and out == src and p in RESHAPES:
        # a no-op in the trace reshapes with sizes the code computed from the global shape (Hugging
        # Face GPT-2's view(-1, T, C) after ln_f): on a rank's shard it silently moves tokens
        # between rows
        return f"{where} reshapes a sequence shard to its global shape {list(out)}"
    if n.op_class == "view" and len(out) >= 2 and out[:2] == src[:2]:
        return ""
    if n.op_class == "view" and not n.out_shapes:
        # a metadata check (aten._assert_tensor_metadata, e.g. before a norm's .to()): no output
        return None
    if n.op_class == "reduction" and len(out) >= 2 and out[:2] == src[:2]:
        return ""  # over the features of each token (a norm written in Python: x.pow(2).mean(-1))
    return f"{where} reads a sequence shard"
