"""A traced model's graph made to compute what its eager forward does, before it is cut into
pipeline stages.

Tracing loses what eager code decides at run time: whether a Hugging Face model's masking skips a
plain causal mask, the order a leaf reads its inputs in, a ``split`` into equal parts of a width
that tensor parallelism changes, the dtype casts that follow a parameter's dtype. Each rewrite here
puts one of those back.

The schedules send a stage's outputs to the next stage as its positional inputs. A value that a
later stage reads from further back (a Hugging Face model's attention mask and rotary cos/sin, made
once and read by every layer; the labels its loss reads; an encoder's output read by every decoder
block) is passed on through the stages between (:func:`chain_stages`).
"""

from __future__ import annotations

import contextlib
import operator
import sys

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.export.unflatten import InterpreterModule


@contextlib.contextmanager
def masks_as_in_eager(*, own_positions: bool):
    """While the pipeline is traced, Hugging Face's masking skips a plain causal or bidirectional
    mask as its eager forward does (SDPA's ``is_causal``, or no mask at all; with grouped-query
    attention SDPA then reads the key/value heads as they are). Under ``torch.export`` it never
    skips: an exported model may later run with other query lengths, and the position ids it makes
    (``own_positions``: the batch has none) cannot be read to rule out packed sequences. The
    pipeline's graph runs only at the shapes it was traced with, and positions the model makes are
    0..n-1 in every row. Without this every layer of a stage would save a float copy of the mask
    and, with GQA, its keys and values repeated to every head: about 12 % more activation memory
    than the same layers hold unpipelined (LLaMA at tests/memcells.py's size); an encoder (ViT, BERT
    without an attention mask) would send an all-True mask between stages and save its float copy in
    every layer. A padding mask, a sliding window, unequal query and key lengths or position ids in
    the batch go the original way; a model that is not a Hugging Face one is untouched."""
    masking = sys.modules.get("transformers.masking_utils")
    skip_causal = getattr(masking, "_ignore_causal_mask_sdpa", None)
    skip_bidirectional = getattr(masking, "_ignore_bidirectional_mask_sdpa", None)
    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    if skip_causal is None or find_packed is None:
        yield
        return

    def causal(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if padding_mask is None and q_length == kv_length and local_attention_size is None:
            return True
        return skip_causal(padding_mask, q_length, kv_length, q_offset, kv_offset,
                           local_attention_size)

    def bidirectional(padding_mask, kv_length, local_attention_size=None):
        if padding_mask is None and (local_attention_size is None
                                     or kv_length < local_attention_size):
            return True
        return skip_bidirectional(padding_mask, kv_length, local_attention_size)

    patches = {"_ignore_causal_mask_sdpa": causal}
    if skip_bidirectional is not None:  # (older transformers have no bidirectional skip)
        patches["_ignore_bidirectional_mask_sdpa"] = bidirectional
    if own_positions:
        patches["find_packed_sequence_indices"] = lambda position_ids: None
    saved = {name: getattr(masking, name) for name in patches}
    for name, fn in patches.items():
        setattr(masking, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(masking, name, fn)


def inputs_read_as_in_eager(root: nn.Module) -> int:
    """Give back to the caller the reads of a traced leaf's input that the trace put in the leaf.

    ``x.to(dtype)`` of an ``x`` of that dtype returns ``x`` itself, and torch.export then takes
    every later read of ``x`` for a read of the cast: a Hugging Face RMSNorm
    (``hidden_states.to(torch.float32)``) is traced returning its input too, which the block
    reads as its residual. Such a leaf returns two values where the module returns one, so the
    original module cannot take its place again, and a TP style on it (sequence parallelism on
    the norms) meets a list. Each output of a traced module that is its own input (through casts
    that were no-ops when traced) is read from the caller's argument instead, as in eager, and
    the module stops returning it. Applied to every graph below ``root``; returns how many it
    rewrote.
    """
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        rewrote = 0
        for call in [n for n in graph.nodes if n.op == "call_module"]:
            leaf = module.get_submodule(call.target)  # not a stage: stages pass inputs on
            if isinstance(leaf, InterpreterModule) and not call.kwargs:
                rewrote += _read_inputs_in_caller(graph, call, leaf)
        if rewrote:
            _recompile(module)
            count += rewrote
    return count


def _read_inputs_in_caller(graph: fx.Graph, call: fx.Node, leaf: nn.Module) -> int:
    """:func:`inputs_read_as_in_eager` for one call of ``leaf`` in ``graph``."""
    inner = leaf.graph
    placeholders = [n for n in inner.nodes if n.op == "placeholder"]
    output = next(n for n in inner.nodes if n.op == "output")
    results = output.args[0]
    items = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
    if (not isinstance(results, (list, tuple)) or len(placeholders) != len(call.args)
            or len(items) != len(call.users)):
        return 0
    given = {}  # output index -> index of the input it is
    for i, result in enumerate(results):
        source = _passed_through(result)
        if source in placeholders:
            given[i] = placeholders.index(source)
    if not given or len(given) == len(results):
        return 0
    kept = [i for i in range(len(results)) if i not in given]
    for item in items:
        i = item.args[1]
        if i in given or len(kept) == 1:
            item.replace_all_uses_with(call.args[given[i]] if i in given else call)
            graph.erase_node(item)
        else:
            item.args = (call, kept.index(i))
    left = [results[i] for i in kept]
    output.args = (left[0] if len(kept) == 1 else type(results)(left),)
    _recompile(leaf)
    return len(given)


def _passed_through(node):
    """The placeholder ``node`` is, through casts that were no-ops when traced; else None."""
    while (isinstance(node, fx.Node) and node.op == "call_function"
           and node.target is torch.ops.aten.to.dtype):
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
                and before.dtype == after.dtype):
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def inputs_in_order_of_use(root: nn.Module) -> int:
    """Give every traced module below ``root`` its inputs in the order its code first reads them.

    torch.export's unflattener inserts each input it finds at the top of the module's graph, so a
    traced module takes its inputs in reverse order of first use: a Hugging Face decoder layer or
    attention module takes the rotary cos/sin first and its hidden states last, and a style that
    prepares a module's first input (``PrepareFirstInput``: where the TP plan shards or gathers
    the hidden states) would lay out the rotary cos. A module that starts on its first argument,
    as these do, takes it first again. Returns how many modules it reordered.
    """
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        calls: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls.setdefault(node.target, []).append(node)
        reordered = 0
        for target, nodes in calls.items():
            leaf = module.get_submodule(target)
            if isinstance(leaf, InterpreterModule) and all(not n.kwargs for n in nodes):
                reordered += _order_inputs_by_use(leaf, nodes)
        if reordered:
            _recompile(module)  # its calls pass the inputs in the new order
            count += reordered
    return count


def _order_inputs_by_use(leaf: nn.Module, calls: list[fx.Node]) -> int:
    """:func:`inputs_in_order_of_use` for one traced module and its calls (1: reordered)."""
    graph = leaf.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if any(len(c.args) != len(placeholders) for c in calls):
        return 0
    first = {p: min((position[u] for u in p.users), default=len(position)) for p in placeholders}
    order = sorted(range(len(placeholders)), key=lambda i: (first[placeholders[i]], i))
    if order == list(range(len(placeholders))):
        return 0
    body = next(n for n in graph.nodes if n.op != "placeholder")  # the output at least
    for i in order:
        body.prepend(placeholders[i])
    for c in calls:
        c.args = tuple(c.args[i] for i in order)
    leaf.arg_names = [placeholders[i].target for i in order]  # how keyword inputs are matched
    _recompile(leaf)
    return 1


def splits_into_equal_parts(root: nn.Module) -> int:
    """Make each traced ``split`` that cut a tensor into equal parts cut it into as many equal
    parts whatever its width when it runs.

    The trace fixes the width the code computed from the model's global sizes (GPT-2's
    ``c_attn(x).split(self.split_size, dim=2)``; a ``chunk`` is traced as such a split). Under
    tensor parallelism a packed projection's output holds every part at its per-rank width
    (``PackedColwiseParallel``), which the eager code splits by its per-rank ``split_size``
    (``set_local_sizes``). At the traced shapes nothing changes. Applied to every graph below
    ``root``; returns how many splits it rewrote.
    """
    split = torch.ops.aten.split.Tensor
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        rewrote = 0
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is split]:
            x, size = node.args[:2]
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            traced = getattr(x, "meta", {}).get("val")
            if not isinstance(traced, torch.Tensor) or not isinstance(size, int) or size <= 0:
                continue
            width = traced.shape[dim]
            if isinstance(width, int) and width % size == 0 and width // size > 1:
                node.target, node.args, node.kwargs = equal_parts, (x, width // size, dim), {}
                rewrote += 1
        if rewrote:
            _recompile(module)
            count += rewrote
    return count


def equal_parts(x: torch.Tensor, parts: int, dim: int) -> tuple:
    """``x`` split into ``parts`` equal parts along ``dim``."""
    return torch.split(x, x.shape[dim] // parts, dim)


def attention_called_late(root: nn.Module) -> int:
    """Make every traced attention call ``F.scaled_dot_product_attention`` as it is when the stage
    runs, not the aten op the trace recorded. torch's ``context_parallel`` replaces that function
    for the duration of a step (its ring attention over the cp ranks); a graph calling the op
    directly would attend over this rank's part of the sequence only. Outside ``context_parallel``
    the function dispatches to the same op. Returns how many it rewrote."""
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        calls = [n for n in graph.nodes if n.op == "call_function"
                 and n.target is torch.ops.aten.scaled_dot_product_attention.default]
        for node in calls:
            node.target = scaled_dot_product_attention
        if calls:
            _recompile(module)
            count += len(calls)
    return count


def scaled_dot_product_attention(*args, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, looked up at each call (see
    :func:`attention_called_late`)."""
    return F.scaled_dot_product_attention(*args, **kwargs)


def _recompile(module: nn.Module) -> None:
    """Regenerate a traced module's code after its graph changed (an unflattened module runs its
    graph, and keeps a compiled copy)."""
    compiled = module if isinstance(module, fx.GraphModule) else module.__dict__.get("graph_module")
    if isinstance(compiled, fx.GraphModule):
        compiled.recompile()


def casts_as_in_eager(root: nn.Module) -> int:
    """Give back the dtype casts torch.export drops: traced without autocast, ``x.float()`` of a
    float32 ``x`` is a no-op, left in the graph as ``aten._assert_tensor_metadata(x,
    dtype=float32)`` only, which fails once the stage runs under autocast and ``x`` is 16-bit
    (Mixtral's router: ``softmax(router_logits.float())``). Each such assertion becomes the cast
    itself (``x.to(dtype)``: nothing when ``x`` has that dtype), read by every later user of ``x``,
    as the eager code's cast was. Applied to every graph below ``root``; returns how many it
    rewrote."""
    assert_meta = torch.ops.aten._assert_tensor_metadata.default
    count = 0
    for module in root.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        asserts = [n for n in graph.nodes if n.op == "call_function" and n.target is assert_meta]
        for node in asserts:
            dtype, x = node.kwargs.get("dtype"), node.args[0]
            if dtype is None or not isinstance(x, fx.Node):
                continue
            with graph.inserting_after(node):
                cast = graph.call_function(torch.ops.aten.to.dtype, (x, dtype))
            for user in [u for u in x.users if u is not cast and u is not node
                         and order.get(u, -1) > order[node]]:
                user.replace_input_with(x, cast)
            graph.erase_node(node)
            count += 1
        compiled = (module if isinstance(module, fx.GraphModule)
                    else module.__dict__.get("graph_module"))
        # an unflattened module's codegen copy, too
        if asserts and isinstance(compiled, fx.GraphModule):
            compiled.recompile()
    return count


def casts_follow_parameters(root: nn.Module) -> int:
    """Make each traced cast to the dtype of a parameter it meets follow that parameter's dtype
    when it runs.

    Eager code writes ``x.to(weight.dtype)`` before an op that reads ``weight`` (Mixtral's experts
    before their grouped matmul), and the trace records the dtype the weight had then, float32.
    FSDP's mixed precision gathers the weight in bf16 for the forward: the eager code would cast
    ``x`` to bf16, the traced graph casts it to float32 and the op meets two dtypes. Each cast
    whose result an op reads beside a parameter (or a view of one) of the cast's traced dtype
    becomes :func:`cast_like` of that parameter: the same cast wherever the dtypes are as traced.
    Applied to every graph below ``root``; returns how many casts it rewrote.
    """
    count = 0
    for module in list(root.modules()):
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        rewrote = 0
        for cast in [n for n in graph.nodes if n.op == "call_function"
                     and n.target is torch.ops.aten.to.dtype]:
            like = next((a for u in cast.users for a in u.all_input_nodes
                         if a is not cast and order[a] < order[cast]
                         and _parameter_dtype(module, a) == cast.args[1]), None)
            if like is not None:
                cast.target, cast.args = cast_like, (cast.args[0], like)
                rewrote += 1
        if rewrote:
            _recompile(module)
            count += rewrote
    return count


_VIEWS = {torch.ops.aten.transpose.int, torch.ops.aten.t.default, torch.ops.aten.view.default,
          torch.ops.aten.reshape.default, torch.ops.aten.permute.default,
          torch.ops.aten.select.int, torch.ops.aten.slice.Tensor,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default}


def _parameter_dtype(module: nn.Module, node: fx.Node):
    """The dtype of the parameter of ``module`` that ``node`` reads (through views), or None."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if node.op != "get_attr":
        return None
    try:
        return module.get_parameter(node.target).dtype
    except AttributeError:  # a buffer or a constant
        return None


def cast_like(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``x`` in ``other``'s dtype."""
    return x.to(other.dtype)


def chain_stages(split_gm: fx.GraphModule) -> None:
    """Rewrite the traced pipeline so that every stage reads exactly the previous stage's outputs,
    in order, and the first stage every model input: a value read further on than the next stage
    (made once and read by every layer; a model input only the loss reads) is passed on, unchanged,
    by each stage between (its gradient, where it has one, flows back the same way). Every stage
    returns a tuple; the last one the model's outputs, in order."""
    g = split_gm.graph
    calls = [n for n in g.nodes if n.op == "call_module"]
    roots = [n for n in g.nodes if n.op == "placeholder"]
    stage_of = {c: i for i, c in enumerate(calls)}
    produced = {r: -1 for r in roots}  # outer value -> the stage that makes it (-1: a model input)
    for n in g.nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in stage_of:
            produced[n] = stage_of[n.args[0]]
        elif n in stage_of and not any(u.op == "call_function" and u.target is operator.getitem
                                       for u in n.users):
            produced[n] = stage_of[n]  # a stage returning one value
    # outer value -> the last stage reading it (len(calls): the model's output)
    last_read: dict = {}
    for c in calls:
        for a in c.args:
            if a not in produced:
                raise NotImplementedError(f"pipeline stage {stage_of[c]} reads {a} ({a.op}), which "
                                          "no stage returns; choose other stage boundaries")
            last_read[a] = max(last_read.get(a, -1), stage_of[c])
    output = next(n for n in g.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    for a in outs:
        if a not in produced:
            raise NotImplementedError(f"the model returns {a} ({a.op}), which no pipeline stage "
                                      "returns")
        last_read[a] = len(calls)
    order = {n: i for i, n in enumerate(g.nodes)}
    # live[k]: the values crossing the cut before stage k (k = len(calls): the model's outputs, in
    # order)
    live = [roots] + [sorted((v for v, last in last_read.items() if produced[v] < k <= last),
                             key=order.__getitem__)
                      for k in range(1, len(calls))] + [outs]
    for k, c in enumerate(calls):
        _rewire_stage(split_gm.get_submodule(c.target), c, live[k], live[k + 1], produced, stage=k)
    new = fx.Graph()
    new._codegen = g._codegen
    value = {r: new.placeholder(r.target) for r in roots}
    for k, c in enumerate(calls):
        call = new.call_module(c.target, tuple(value[v] for v in live[k]))
        value = {v: new.call_function(operator.getitem, (call, i))
                 for i, v in enumerate(live[k + 1])}
    new.output(tuple(value[v] for v in outs))
    split_gm.graph = new
    split_gm.recompile()


def _rewire_stage(sub: fx.GraphModule, call: fx.Node, inputs: list, outputs: list, produced: dict,
                  *, stage: int) -> None:
    """Give stage module ``sub`` (called by outer node ``call``) the placeholders ``inputs`` (outer
    values, in order) and the outputs ``outputs``: its own results, or inputs passed on."""
    g = sub.graph
    old = [n for n in g.nodes if n.op == "placeholder"]  # 1:1 with call.args
    inner_out = next(n for n in g.nodes if n.op == "output")
    results = inner_out.args[0]
    # a getitem of this stage's call
    mine = {v: results[v.args[1]] if v.op == "call_function" else results
            for v in produced if produced[v] == stage and (v is call or v.args[0] is call)}
    had = dict(zip(call.args, old, strict=True))  # outer value -> the placeholder it arrives at
    # later stages: names no model keyword can take
    if stage > 0 or list(call.args) != list(inputs):
        with g.inserting_before(next(iter(g.nodes))):
            fresh = {v: g.placeholder(v.target if stage == 0 else f"recv_{v.name}") for v in inputs}
        for v, ph in zip(call.args, old, strict=True):
            ph.replace_all_uses_with(fresh[v])
            g.erase_node(ph)
        had = fresh
        g._codegen = fx.graph.CodeGen()  # plain positional/keyword arguments, one per placeholder
    # the schedules hand a rank's keyword inputs to each stage it holds: only the first reads them
    if stage > 0:
        with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
            g.placeholder("**model_kwargs")
    with g.inserting_before(inner_out):
        g.output(tuple(had[v] if v in had else mine[v] for v in outputs))
    g.erase_node(inner_out)
    g.lint()
    sub.recompile()
