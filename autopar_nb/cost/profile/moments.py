"""What is alive beside a layer's saved tensors at each of its ops: in backward, the gradients the
op holds and those still accumulating (:attr:`~.layers.LayerProfile.moments`); in forward, the
storages the graph still reads, what a module's caller keeps alive, autocast's copies
(:attr:`~.layers.LayerProfile.forward`). :mod:`.saved` builds both in its walk."""

from __future__ import annotations

from collections import defaultdict

from ...plan import ITEMSIZE
from ..tp_styles import packet
from .facts import Facts, in_layers, math_attention, scores_numel
from .layers import LayerProfile, Saved


def lifetimes(f: Facts) -> dict[str, tuple[int, int, int]]:
    """Each storage the forward makes (a node owning its storage, :attr:`.facts.Facts.root`; not a
    parameter's view) -> (the index of the op making it, of its last reader — a reader of any view
    of it —, and of the last op of the outermost module call, begun after it was made, that reads
    it): a module's caller holds the arguments it passes until the call returns, so in an eager
    forward a storage lives to the later of the two."""
    nodes = f.graph.nodes
    calls = _module_calls(nodes)
    life: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in dict.fromkeys(n.inputs):
            lf = life.get(f.root.get(i, i))
            if lf is not None:
                lf[1] = k
                lf[2] = max(lf[2], next((end for start, end in calls[k] if start > lf[0]), k))
        if f.root.get(n.name, n.name) == n.name and n.out_shapes and n.name not in f.param_views:
            life[n.name] = [k, k, k]
    return {r: tuple(v) for r, v in life.items()}


def _module_calls(nodes) -> list[list[tuple[int, int]]]:
    """Per op, the (first op, last op) of each module call it runs in, outermost first: a call is a
    maximal run of consecutive ops whose ``module_path`` is the module's or inside it (the model's
    own forward, "", is none)."""
    spans: list[list[list[int]]] = []
    open_: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        parts = n.module_path.split(".") if n.module_path else []
        paths = [".".join(parts[:d]) for d in range(1, len(parts) + 1)]
        for p in [p for p in open_ if p not in paths]:
            del open_[p]  # its call has ended (its span's end is the last op it saw)
        row = []
        for p in paths:
            span = open_.setdefault(p, [k, k])
            span[1] = k
            row.append(span)
        spans.append(row)
    return [[(s, e) for s, e in row] for row in spans]


class Alive:
    """The storages alive as the forward reaches each op (:func:`lifetimes`), swept in graph
    order."""

    def __init__(self, lives: dict[str, tuple[int, int, int]]):
        self.lives = lives
        self.made: dict[int, list[str]] = defaultdict(list)
        for r, (k, _, _) in lives.items():
            self.made[k].append(r)
        self.upto, self.now = -1, {}

    def at(self, k: int) -> list[tuple[str, bool]]:
        """(storage, alive only through a caller's argument) for each storage alive at op ``k``
        (increasing)."""
        for j in range(self.upto + 1, k + 1):
            for r in self.made.get(j, ()):
                self.now[r] = self.lives[r]
        self.upto = max(self.upto, k)
        for r in [r for r, (_, _, held) in self.now.items() if held < k]:  # (held >= last)
            del self.now[r]
        return [(r, last < k) for r, (_, last, _) in self.now.items()]


def layer_inputs(layers: dict[str, LayerProfile], f: Facts) -> dict[str, set[str]]:
    """layer -> the storages entering it (made outside it, read by one of its ops; as
    :func:`.crossings.count_boundaries` counts them)."""
    layer_of_node = {n.name: n.layer for n in f.graph.nodes}
    out: dict[str, set[str]] = {path: set() for path in layers}
    for lp, n in in_layers(layers, f):
        out[lp.path].update(f.root.get(i, i) for i in n.inputs if layer_of_node.get(i) != n.layer)
    return out


def forward_moment(n, k: int, f: Facts, alive: Alive, seen: set[str], device_kind: str,
                   entering: set[str], own: set[str]
                   ) -> tuple[tuple[Saved, ...], tuple[Saved, ...], tuple[Saved, ...],
                              tuple[Saved, ...]]:
    """What op ``n`` (the graph's ``k``-th) holds in forward besides the saved tensors (``seen``):
    (the storages the graph still reads — its inputs, its output, those read later — and the copies
    autocast makes of its inputs, none of them saved yet, and the CPU math attention's own
    transients; the storages only a caller keeps alive then, :attr:`.layers.Moment.held`; the
    layer's inputs (``entering``) among the first or among what the layer saved so far (``own``),
    and among the second: :attr:`.layers.Moment.entered`). Measured with PyTorch's MemTracker."""
    work, held, entered, entered_held = [], [], [], []
    for r, by_caller in alive.at(k):
        if r not in seen:
            x = Saved(f.size[r].nbytes, r in f.tp.sharded, quadratic=r in f.scores,
                      routed=r in f.routed)
            (held if by_caller else work).append(x)
            if r in entering:
                (entered_held if by_caller else entered).append(x)
        elif r in entering and r in own:
            entered.append(Saved(f.size[r].nbytes, r in f.tp.sharded, quadratic=r in f.scores,
                                 routed=r in f.routed))
    cast = f.autocast.cast if f.autocast is not None else None
    for i in dict.fromkeys(n.inputs) if cast is not None else ():
        to = cast(n.name, i) if i in f.size and f.size[i].floating else None
        if to is not None and f"cast:{n.name}:{i}" not in seen:
            work.append(Saved(f.size[i].numel * ITEMSIZE[to],
                              i in f.tp.sharded or n.name in f.tp.sharded, quadratic=i in f.scores,
                              routed=i in f.routed))
    work += _math_attention_transients(n, f, device_kind)
    return tuple(work), tuple(held), tuple(entered), tuple(entered_held)


def accumulating_gradients(f: Facts) -> dict[str, tuple[Saved, ...]]:
    """Per op, the gradients alive during its backward besides its own (:func:`gradients_of`): those
    of the tensors made before it and read after it (the residual stream a block's skip reads, an
    encoder's output every cross-attention reads, a position bias), whose later readers' backward
    has begun their gradient, and, for an input read again after the op, the sum its new gradient is
    accumulated into (autograd adds out of place; a MemTracker census of T5's decoder backward holds
    the encoder output's gradient, that sum and the incoming part at once). A view's gradient is its
    own until the view's backward (Mixtral's experts read the up half of their fused gate/up output
    after the gate half's SiLU: half of it). An add's backward hands its output's gradient itself to
    each operand: the operands of the adds a gradient has reached so far hold one storage (a
    parallel residual's input and attention output, GPT-NeoX; an output projection's output and the
    skip beside it, LLaMA). Summed per TP kind (bytes split or not, score-sized or not)."""
    nodes = f.graph.nodes
    readers: dict[str, list[int]] = defaultdict(list)
    for k, n in enumerate(nodes):
        for i in dict.fromkeys(n.inputs):
            readers[i].append(k)
    last = {t: ks[-1] for t, ks in readers.items()}
    made = {n.name: k for k, n in enumerate(nodes)}

    def passes_through(t: str, k: int) -> bool:
        """Op k is an add whose backward hands t its output's gradient."""
        n = nodes[k]
        return (n.op == "aten.add.Tensor" and f.size.get(n.name) == f.size.get(t)
                and f.dtype.get(n.name) == f.dtype.get(t))

    def storage(t: str, k: int) -> str:
        """Whose gradient t's is at op k's backward (t read after k)."""
        later = [r for r in readers.get(t, ()) if r > k]
        while len(later) == 1 and passes_through(t, later[0]):
            t = nodes[later[0]].name
            later = readers.get(t, [])
        return t

    # the gradient-carrying tensors some op after their maker reads
    tracked = {t for t, k in last.items()
               if t in made and k > made[t] and t in f.grad and t not in f.param_views
               and f.size[t].floating}
    ends: dict[int, list[str]] = defaultdict(list)
    for t in tracked:
        ends[last[t]].append(t)
    live: dict[str, None] = {}  # made before the current op, read after it (insertion ordered)
    out: dict[str, tuple[Saved, ...]] = {}
    for k, n in enumerate(nodes):
        for t in ends.get(k, ()):
            live.pop(t, None)
        sums: dict[tuple[bool, bool, bool], float] = defaultdict(float)
        held = {storage(n.name, k)}  # the op's own output's gradient is in gradients_of
        for t in live:
            if (g := storage(t, k)) not in held:
                held.add(g)
                sums[t in f.tp.sharded, t in f.scores, t in f.routed] += f.size[t].nbytes
        for t in dict.fromkeys(n.inputs):
            if t in live:
                sums[t in f.tp.sharded, t in f.scores, t in f.routed] += f.size[t].nbytes
        if sums and n.op_class != "view":
            out[n.name] = tuple(Saved(b, region, quadratic=quad, routed=routed)
                                for (region, quad, routed), b in sums.items())
        if n.name in tracked:
            live[n.name] = None
    return out


def gradients_of(n, f: Facts) -> tuple[Saved, ...]:
    """The gradients op ``n``'s backward holds at once (:attr:`.layers.Moment.work`), at the dtypes
    of ``f``."""
    style = f.tp.styles.get(n.name)
    out = f.size[n.name]
    grads = [Saved(out.nbytes, n.name in f.tp.sharded, gathered=style == "rowwise",
                   quadratic=n.name in f.scores, routed=n.name in f.routed)]
    if style == "rowwise":
        grads.append(Saved(out.nbytes, False, sp_only=True))
    for i in n.inputs:
        if i in f.grad and i not in f.param_views and f.size[i].floating:
            grads.append(Saved(f.size[i].nbytes, i in f.tp.sharded, gathered=style == "colwise",
                               quadratic=i in f.scores, routed=i in f.routed))
    x = n.inputs[0] if n.inputs else None
    if packet(n.op) == "index" and x is not None and x in f.grad and f.size[x].floating:
        # IndexBackward0 puts the gradient into zeros of the input's size out of place
        # (index_put): the zeros and the result are alive at once (dispatch log, torch 2.13)
        grads.append(Saved(f.size[x].nbytes, x in f.tp.sharded, quadratic=x in f.scores,
                           routed=x in f.routed))
    return tuple(grads)


def _math_attention_transients(n, f: Facts, device_kind: str) -> tuple[Saved, ...]:
    """What :func:`.facts.math_attention` holds at its end beyond its operands, its output and what
    it saves, when it computes a 16-bit attention in float32 (measured with MemTracker, torch 2.13
    CPU): float32 copies of q, k and v and the scaled q, the 16-bit copy of the dropped weights it
    makes, and its float32 output (its 16-bit q, k, v and output are among the storages alive,
    :func:`forward_moment`). Empty when it computes in its inputs' dtype (not measured)."""
    if not math_attention(n, device_kind) or f.size[n.name].itemsize >= 4 or len(n.inputs) < 3:
        return ()
    region = n.name in f.tp.sharded
    q, k, v = n.inputs[:3]
    upcast = [Saved(f.size[i].numel * 4, region) for i in (q, k, v, q)]
    dropped = Saved(scores_numel(n) * f.size[n.name].itemsize, region, quadratic=True)
    return (*upcast, dropped, Saved(f.size[n.name].numel * 4, region))


def math_attention_gradients(n, f: Facts, device_kind: str) -> tuple[Saved, ...]:
    """The gradients :func:`.facts.math_attention`'s backward holds at its peak, the backward of
    ``weights @ v`` (its first): the output's gradient, the weights' gradient (score-sized, in the
    kernel's compute dtype: float32 for 16-bit inputs) and v's (compute dtype), and for 16-bit
    inputs the output gradient's float32 copy; q's and k's do not exist yet (a dispatch-mode census
    of SDPA's backward on CPU, torch 2.13: the generic rule, :func:`gradients_of`, has no
    score-sized gradient). Empty for other ops."""
    if not math_attention(n, device_kind) or len(n.inputs) < 3:
        return ()
    region, out = n.name in f.tp.sharded, f.size[n.name]
    item = max(out.itemsize, 4)
    grads = [Saved(out.nbytes, region), Saved(scores_numel(n) * item, region, quadratic=True),
             Saved(f.size[n.inputs[2]].numel * item, region)]
    if out.itemsize < item:
        grads.append(Saved(out.numel * item, region))
    return tuple(grads)


def count_later_gradients(layers: dict[str, LayerProfile], f: Facts,
                          split_params: set[str]) -> None:
    """Each backward moment's :attr:`.layers.Moment.later`: the layer's own trainable parameters
    read by an op after the moment's op (a parameter's gradient exists from its last reader's
    backward on)."""
    graph = f.graph
    # layer -> its parameter -> its last reader
    last: dict[str, dict[str, int]] = {path: {} for path in layers}
    for k, n in enumerate(graph.nodes):
        lp = layers.get(n.layer)
        for pname in n.params if lp is not None else ():
            pi = graph.params.get(pname)
            if pi is not None and not pi.is_buffer and pi.trainable and pname not in lp.borrowed:
                last[lp.path][pname] = k
    for path, lp in layers.items():
        readers = sorted((k, pname) for pname, k in last[path].items())
        for precision, moments in lp.moments.items():
            lp.moments[precision] = [
                m._replace(later=_numel_after(m.op, readers, graph, split_params)) for m in moments]


def _numel_after(op: int, readers: list[tuple[int, str]], graph,
                 split_params: set[str]) -> tuple[int, int]:
    """(TP-split, replicated) numel of the parameters whose last reader (``readers``: (op index,
    name)) comes after op ``op``."""
    split = rep = 0
    for k, pname in readers:
        if k > op:
            n = graph.params[pname].numel
            split, rep = (split + n, rep) if pname in split_params else (split, rep + n)
    return split, rep
