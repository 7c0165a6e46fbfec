"""What autograd saves for backward in each layer, each storage once, from each op's ``kernels_ext``
rule (``OpRule.saves``); what selective recompute keeps instead; and, in the same walk, each op's
backward and forward moments (:mod:`.moments`)."""

from __future__ import annotations

from typing import NamedTuple

from ...plan import ITEMSIZE
from ..tp_styles import packet, rule_of
from .facts import Facts, Size, in_layers, math_attention, scores_numel, selective_recomputes
from .layers import LayerProfile, Moment, Saved
from .moments import (
    Alive,
    accumulating_gradients,
    forward_moment,
    gradients_of,
    layer_inputs,
    lifetimes,
    math_attention_gradients,
)


class _Keep(NamedTuple):
    """A tensor one op keeps for backward, before storages are deduplicated."""

    key: str
    """the storage it keeps alive (the same key from two ops counts once)"""
    size: Size
    region: bool
    gathered: bool = False
    quadratic: bool = False
    stat: bool = False


def count_saved(layers: dict[str, LayerProfile], f: Facts, amp: dict[str, Facts],
                device_kind: str) -> dict[str, str]:
    """Each layer's saved tensors (:attr:`LayerProfile.saved`, ``saved_amp``), backward moments
    (``moments``) and forward moments (``forward``) in the float32 forward (``f``) and under each
    autocast precision (``amp``: precision -> its facts). Returns each storage the float32 forward
    saves -> the layer that saves it first."""
    first_saver: dict[str, str] = {}
    lives = lifetimes(f)
    for precision, fp in (("fp32", f), *amp.items()):
        _saved_at(layers, fp, precision, device_kind, lives,
                  first_saver if precision == "fp32" else None)
    return first_saver


def _saved_at(layers: dict[str, LayerProfile], f: Facts, precision: str, device_kind: str,
              lives: dict[str, tuple[int, int, int]], first: dict[str, str] | None) -> None:
    """What autograd saves in each layer at the dtypes of ``f`` (``precision``), each storage once
    (in the layer of the first op that saves it), with each op's :class:`Moment` in backward and in
    forward (``lives``: :func:`.moments.lifetimes`). An op no trainable parameter reaches is not
    recorded (saves nothing), nor one that returns its input (p = 0 dropout). ``first``: filled with
    each saved storage's layer."""
    seen: set[str] = set()
    saved: dict[str, list[Saved]] = {path: [] for path in layers}
    moments: dict[str, list[Moment]] = {path: [] for path in layers}
    forward: dict[str, list[Moment]] = {path: [] for path in layers}
    weight_pass: dict[str, list[tuple[int, Saved]]] = {path: [] for path in layers}
    cached = dict.fromkeys(layers, 0)  # the tensors selective recompute keeps of the ops so far
    again = selective_recomputes(layers, f)
    accumulating = accumulating_gradients(f)
    index = {n.name: k for k, n in enumerate(f.graph.nodes)}
    alive = Alive(lives)
    entering = layer_inputs(layers, f)
    own: dict[str, set[str]] = {path: set() for path in layers}  # the storages each layer saves
    for lp, n in in_layers(layers, f):
        cached[lp.path] += len(_selective_kept(n, f, device_kind, again))
        rule = rule_of(n.op)
        recorded = rule is not None and n.name in f.grad and (
            f.root.get(n.name, n.name) == n.name or n.op_class == "view")
        for keep in _kept_by(n, rule, f, device_kind) if recorded else ():
            if keep.key in seen or keep.size.numel == 0:
                continue
            seen.add(keep.key)
            own[lp.path].add(keep.key)
            if first is not None:
                first[keep.key] = lp.path
            # a copy's key ends with what it copies ("cast:op:input"), a temporary's with its op
            saved[lp.path].append(Saved(keep.size.numel * keep.size.itemsize, keep.region,
                                        keep.gathered, keep.quadratic, keep.stat,
                                        routed=keep.key.rpartition(":")[2] in f.routed))
        if n.op_class == "view" or not n.out_shapes:
            continue
        k, kept = index[n.name], len(saved[lp.path])
        if recorded:
            grads = math_attention_gradients(n, f, device_kind) or gradients_of(n, f)
            moments[lp.path].append(Moment(kept, grads + accumulating.get(n.name, ()), op=k))
            if _weight_pass_start(n, f):
                weight_pass[lp.path].append((k, grads[0]))
        work, held, entered, entered_held = forward_moment(n, k, f, alive, seen, device_kind,
                                                           entering[lp.path], own[lp.path])
        forward[lp.path].append(Moment(kept, work, cached[lp.path], op=k, held=held,
                                       entered=entered, entered_held=entered_held))
    for path, lp in layers.items():
        if precision == "fp32":
            lp.saved = saved[path]
        else:
            lp.saved_amp[precision] = saved[path]
        lp.moments[precision] = moments[path]
        lp.forward[precision] = forward[path]
        lp.weight_pass[precision] = weight_pass[path]


def _weight_pass_start(n, f: Facts) -> bool:
    """Op ``n`` reads a trainable parameter (or a view of one) and an activation that requires grad:
    its autograd node is where a parameter's path meets the stage input's, one of the
    ``intermediates`` torch's ``stage_backward_input`` hooks to keep the gradient flowing into it
    (``get_param_groups``)."""
    params = f.graph.params
    reads = any(params[p].trainable for p in n.params if p in params) or any(
        i in f.param_views for i in n.inputs)
    return reads and any(i in f.grad and i not in f.param_views for i in n.inputs)


def count_selective(layers: dict[str, LayerProfile], f: Facts, amp: dict[str, Facts],
                    device_kind: str) -> None:
    """Each layer's :attr:`LayerProfile.selective` in the float32 forward (``f``) and under each
    autocast precision (``amp``): what the runtime's selective recompute (``runtime/ac.py``: torch's
    selective checkpoint with a policy that must save bmm/convolution/attention outputs and those of
    every other weight matmul) keeps, besides the inputs the checkpoint holds
    (:func:`_selective_kept` of each op)."""
    for precision, fp in (("fp32", f), *amp.items()):
        kept: dict[str, list[Saved]] = {path: [] for path in layers}
        again = selective_recomputes(layers, fp)
        for lp, n in in_layers(layers, fp):
            kept[lp.path] += _selective_kept(n, fp, device_kind, again)
        for path, lp in layers.items():
            lp.selective[precision] = kept[path]


def _selective_kept(n, f: Facts, device_kind: str, again: frozenset[str]) -> list[Saved]:
    """What selective recompute keeps of op ``n``: the output of a matmul, convolution or attention
    op (a fused attention kernel's log-sum-exp with it; the CPU math kernel's two bmm outputs,
    float32 under autocast) but not of the weight matmuls it runs ``again``; nothing of other ops.
    A row-parallel output is its local partial sum, full size even under sequence parallelism
    (``gathered``)."""
    if n.op_class not in ("matmul", "conv", "attention") or not n.out_shapes or n.name in again:
        return []
    size, region = f.size[n.name]._replace(floating=True), n.name in f.tp.sharded
    if math_attention(n, device_kind):
        item = max(size.itemsize, 4)
        return [Saved(scores_numel(n) * item, region, quadratic=True),
                Saved(size.numel * item, region)]
    kept = [Saved(size.nbytes, region, gathered=f.tp.styles.get(n.name) == "rowwise",
                  routed=n.name in f.routed)]
    rule = rule_of(n.op)
    if n.op_class == "attention" and rule is not None and rule.stats is not None:
        kept.append(Saved(rule.stats(n.in_shapes, n.out_shapes) * 4, region, stat=True))
    return kept


def _kept_by(n, rule, f: Facts, device_kind: str) -> list[_Keep]:
    """The tensors op ``n`` keeps for its backward: its rule's ``saves`` tokens
    (``kernels_ext.SAVES``) on this device kind, resolved against the graph."""
    in_region, scores = n.name in f.tp.sharded, n.name in f.scores
    # a parameter's view is held with the parameter
    acts = [i for i in n.inputs if i not in f.param_views]
    trainable = f.graph.params
    reads_param = any(trainable[p].trainable for p in n.params if p in trainable) or \
        len(acts) < len(n.inputs)
    floats = [i for i in acts if f.size[i].floating]
    # an operand is kept only for another's gradient: x * cos keeps cos, not x, when cos needs none
    needed = [i for k, i in enumerate(acts) if f.size[i].floating
              and (reads_param or any(j in f.grad for m, j in enumerate(acts) if m != k))]
    out = f.size[n.name]
    colwise = f.tp.styles.get(n.name) == "colwise"

    cast_to = f.autocast.cast if f.autocast is not None else lambda _n, _i: None

    def kept_input(i: str) -> _Keep:
        nd = len(f.by_name[i].out_shapes[0]) if i in f.by_name and f.by_name[i].out_shapes else 2
        to = cast_to(n.name, i)
        if to is not None:
            # autocast (or the plan's op lists) hands the op a copy in another dtype: it saves that
            key, size = f"cast:{n.name}:{i}", f.size[i]._replace(itemsize=ITEMSIZE[to])
        elif rule.flattens_ndim and nd >= rule.flattens_ndim and f.noncontig.get(i, False):
            # the op makes a contiguous copy and saves that
            key, size = f"copy:{n.name}:{i}", f.size[i]
        else:
            key = f.root.get(i, i)
            size = f.size[key]  # a view keeps its whole base storage alive
        return _Keep(key, size, i in f.tp.sharded or key in f.tp.sharded, colwise, i in f.scores)

    if math_attention(n, device_kind):
        return _math_attention_saves(n, f, kept_input)
    kept: list[_Keep] = []
    if f.autocast is not None and n.name in f.autocast.keeps_all:
        # OpPrecision's WithoutAutocast holds the op's float32 inputs and its output until backward
        kept += [kept_input(i) for i in floats]
        kept.append(_Keep(n.name, out._replace(floating=True), in_region, quadratic=scores))
    for what in rule.saves_on(device_kind):
        operands = what == "operands" and (len(floats) >= 2 or (floats and reads_param))
        if what == "inputs" or operands:
            kept += [kept_input(i) for i in needed]
        elif what == "input":
            kept += [kept_input(i) for i in floats[:1]]
        elif what == "qkv":
            kept += [kept_input(i if k == 0 else _unrepeated(i, f)) for k, i in enumerate(acts[:3])]
        elif what == "output":
            kept.append(_Keep(n.name, out._replace(floating=True), in_region, quadratic=scores))
        elif what == "stats":
            # float32, but ATen's CPU norm kernels keep them 16-bit when input and weight are both
            # 16-bit (a registered op such as kernels_ext's fused RMSNorm computes its rstd in
            # float32 whatever it reads)
            low = device_kind == "cpu" and n.op_class == "norm" and n.op.startswith("aten.") and \
                f.autocast is not None and n.name in f.autocast.all_low
            stats = Size(rule.stats(n.in_shapes, n.out_shapes), 2 if low else 4, True)
            kept.append(_Keep(f"stats:{n.name}", stats, in_region, stat=True))
        elif what == "ids":
            kept += [_Keep(f.root.get(i, i), f.size[i]._replace(floating=False), False)
                     for i in acts[:1]]
        elif what == "mask":
            kept.append(_Keep(f"mask:{n.name}", Size(out.numel, 1, False), in_region,
                              quadratic=scores))
        elif what == "temp":
            kept.append(_Keep(f"temp:{n.name}", out._replace(floating=True), in_region,
                              quadratic=scores))
        elif what == "input_sized" and floats:
            to = cast_to(n.name, floats[0])
            size = f.size[floats[0]]._replace(itemsize=ITEMSIZE[to]) if to else f.size[floats[0]]
            kept.append(_Keep(f"temp:{n.name}", size, in_region))
        elif what == "bool_arg":
            mask = next((i for i in acts if not f.size[i].floating), None)
            if mask is not None:
                kept.append(_Keep(f"bool:{n.name}", Size(f.size[mask].numel, 1, False), False))
    return kept


def _math_attention_saves(n, f: Facts, kept_input) -> list[_Keep]:
    """What :func:`.facts.math_attention` keeps (measured with autograd's saved tensors, torch 2.13
    CPU). With 16-bit inputs (autocast) the CPU math kernel computes in float32: q, k and v are
    converted first (v then saved as its float32 copy) and the score-sized tensors are float32. A
    non-contiguous v (heads transposed out of a projection's output) is copied when ``scores @ v``
    folds its batch dims, and that copy is what it saves."""
    region = n.name in f.tp.sharded
    q, k, v = (n.inputs + [None] * 3)[:3]
    item = max(f.size[n.name].itemsize, 4)
    scores = Size(scores_numel(n), item, True)
    upcast = f.size[n.name].itemsize < item
    copied_v = upcast or f.noncontig.get(v, False)
    return [_Keep(f"q:{n.name}", f.size[q]._replace(itemsize=item), region),
            _Keep(f"k:{n.name}", f.size[k]._replace(itemsize=item), region),
            _Keep(f"v:{n.name}", f.size[v]._replace(itemsize=item), region) if copied_v
            else kept_input(v),
            *(_Keep(f"{what}:{n.name}", scores, region, quadratic=True)
              for what in ("softmax", "noise", "dropped"))]


def _unrepeated(name: str, f: Facts) -> str:
    """Key/value heads that ``repeat_kv`` expanded (``x[:, :, None].expand(...).reshape(...)``)
    before attention: the tensor before the expansion, which is what attention saves when it runs on
    the key/value heads itself. Hugging Face passes them to SDPA with ``enable_gqa=True`` when there
    is no attention mask (``transformers/integrations/sdpa_attention.py``, ``use_gqa_in_sdpa``); the
    captured graph shows the expansion because ``torch.export`` materialises the causal mask."""
    cur, expanded = name, False
    while cur in f.by_name and f.by_name[cur].op_class == "view" and f.by_name[cur].inputs:
        n = f.by_name[cur]
        if packet(n.op) == "expand" and f.size[n.inputs[0]].numel < f.size[cur].numel:
            expanded = True
        cur = n.inputs[0]
    return cur if expanded else name
