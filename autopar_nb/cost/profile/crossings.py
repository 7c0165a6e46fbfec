"""What crosses the boundaries between layers: the bytes entering and leaving each layer, and the
tensors a pipeline cut before each layer would send."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from .facts import FLOAT, Facts, in_layers
from .layers import Crossing, LayerProfile


def count_boundaries(layers: dict[str, LayerProfile], f: Facts, amp: dict[str, Facts]) -> None:
    """Bytes entering each layer (each storage once) and leaving it (read by a later layer, or the
    model output), in the float32 forward and under each autocast precision."""
    for path, (inp, out, shared) in _boundary_bytes(layers, f).items():
        layers[path].input_bytes, layers[path].output_bytes = inp, out
        layers[path].shared_inputs["fp32"] = shared
    for precision, fa in amp.items():
        for path, (inp, out, shared) in _boundary_bytes(layers, fa).items():
            layers[path].input_amp[precision], layers[path].output_amp[precision] = inp, out
            layers[path].shared_inputs[precision] = shared


def _boundary_bytes(layers: dict[str, LayerProfile], f: Facts
                    ) -> dict[str, tuple[float, float, dict[str, float]]]:
    """layer -> (bytes entering it, bytes leaving it, the entering storages other layers read too
    -> their bytes) at the dtypes of ``f``."""
    consumers: dict[str, list[str]] = defaultdict(list)
    for n in f.graph.nodes:
        for i in n.inputs:
            consumers[i].append(n.name)
    layer_of_node = {n.name: n.layer for n in f.graph.nodes}
    last = f.graph.nodes[-1] if f.graph.nodes else None
    entered: set[tuple[str, str]] = set()
    out = {path: [0.0, 0.0] for path in layers}
    for lp, n in in_layers(layers, f):
        for i in n.inputs:
            key = f.root.get(i, i)
            if layer_of_node.get(i) != n.layer and (n.layer, key) not in entered:
                entered.add((n.layer, key))  # an input read by several ops is held once
                out[lp.path][0] += f.size[key].nbytes
        readers = consumers.get(n.name, [])
        if n.op_class == "view" and readers:
            continue
        elsewhere = [c for c in readers if layer_of_node.get(c) != n.layer]
        if n.out_shapes and n.dtype in FLOAT and (elsewhere or (n is last and not readers)):
            out[lp.path][1] += f.size[n.name].nbytes
    n_readers = Counter(key for _, key in entered)
    shared: dict[str, dict[str, float]] = defaultdict(dict)
    for layer, key in entered:
        if n_readers[key] > 1 and layer in out:
            shared[layer][key] = float(f.size[key].nbytes)
    return {k: (v[0], v[1], shared.get(k, {})) for k, v in out.items()}


def count_crossings(f: Facts, amp: dict[str, Facts],
                    first_saver: dict[str, str]) -> list[list[Crossing]]:
    """Per layer index k, the tensors a pipeline cut right before layer k sends, as
    ``runtime/pp_graph.py``'s ``chain_stages`` passes them: every value made before k (or a model
    input) that an op at or after k reads, once each (a value read further on is passed through
    every stage between). A node outside every layer (code in a model's own forward between its
    modules) belongs to the layer before it, as a cut at the next layer's start leaves it. Only a
    layer's first call moves the position: T5's stacks call their dropout again after the final
    norm, and that second call runs where the graph has it, in the layer before. ``first_saver``:
    storage -> the layer whose op saves it first (:func:`.saved.count_saved`)."""
    index = {lay.path: i for i, lay in enumerate(f.graph.layers)}
    where: dict[str, int] = {name: -1 for name in f.size if name not in f.by_name}  # model inputs
    last_read: dict[str, int] = {}
    at, called = 0, set()
    for n in f.graph.nodes:
        if n.layer in index and n.layer not in called:
            called.add(n.layer)
            at = index[n.layer]
        where[n.name] = at
        for i in n.inputs:
            last_read[i] = max(last_read.get(i, -1), at)
    out: list[list[Crossing]] = [[] for _ in f.graph.layers]
    for name, last in last_read.items():
        made = where.get(name)
        if made is None or f.size.get(name) is None:
            continue
        saver = first_saver.get(f.root.get(name, name))
        crossing = Crossing({"fp32": float(f.size[name].nbytes),
                             **{p: float(fa.size[name].nbytes) for p, fa in amp.items()}},
                            name in f.grad, made, index.get(saver) if saver is not None else None)
        for k in range(max(made, 0) + 1, last + 1):
            out[k].append(crossing)
    return out


def stage_start_refusals(graph) -> dict[int, str]:
    """Layer index -> why no pipeline stage may start at that layer, whatever the stage's other
    layers (the starts the planner places stages at). ``pipeline()`` cuts the traced graph at the
    first call of each stage's first layer, and torch's ``split_module`` then orders the stages by
    the values they read from one another; two rules follow, true of any model,

    * a layer the forward calls again after another layer's ops (T5's stack dropout, after the
      embedding and after the final norm) would start a stage at each of its calls;
    * a stage must read a value the stage before it computed from the model's inputs or parameters:
      otherwise nothing orders it after the one before, and a split may run it first (a rotary table
      or learned position embedding reads only positions made from nothing, ``arange``, which
      context parallelism hands in as ``position_ids``: a stage of the rotary table alone then ran
      before stage 0 and its successor was called without the hidden states, "forward() missing 2
      required positional arguments");

    and a third, of the runtime: every stage holds parameters (Phi's ``embed_dropout`` and
    ``rotary_emb`` made a stage of their own, which DDP refused to wrap; a rank holding only such a
    stage would build an optimizer over no parameters, which torch refuses too). Here a layer is
    refused where it alone breaks the last two (it reads nothing the layer before computed, or holds
    no parameters): a stage of whole runs of such starts always meets them. :func:`refused_stages`
    checks a whole plan's stages by the rules themselves.

    Positions as :func:`count_crossings` has them (a node outside every layer belongs to the layer
    before)."""
    return starts_refused([lay.path for lay in graph.layers], stage_rules(graph))


def starts_refused(paths: list[str], rules: StageRules) -> dict[int, str]:
    """:func:`stage_start_refusals` from the graph's :class:`StageRules`."""
    out = dict(rules.refused)
    for k in range(1, len(paths)):
        if (k - 1, k) not in rules.reads:
            out.setdefault(k, f"it reads nothing {paths[k - 1]} computed, so nothing orders its "
                              "stage after the one before")
        if not rules.params[k]:
            out.setdefault(k, "it holds no parameters of its own: a stage of such layers alone "
                              "would hold none (DDP refuses to wrap it, and a rank with no other "
                              "stage has nothing to optimise)")
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class StageRules:
    """What the rules of :func:`stage_start_refusals` read from a graph: ``refused``, layer index ->
    why no stage may start there at all (called more than once, never called); ``reads``, the
    positions (q, p), q < p, where an op at p reads a value computed (from the model's inputs or
    parameters) at q; ``params``, each layer's count."""

    refused: dict[int, str]
    reads: frozenset[tuple[int, int]]
    params: list[int]


def stage_rules(graph) -> StageRules:
    """:class:`StageRules` of ``graph``."""
    index = {lay.path: i for i, lay in enumerate(graph.layers)}
    made = {n.name for n in graph.nodes}
    where: dict[str, int] = {}
    # values that depend on an input or a parameter (not on constants alone)
    computed: set[str] = set()
    reads: set[tuple[int, int]] = set()
    out: dict[int, str] = {}
    at, last, done = 0, None, set()
    for n in graph.nodes:
        if n.layer in index and n.layer != last:
            if n.layer in done:
                out.setdefault(index[n.layer],
                               "the forward calls it more than once, and a stage would start at "
                                               "each call")
            else:
                at = index[n.layer]
            if last is not None:
                done.add(last)
            last = n.layer
        where[n.name] = at
        if n.params or any(i not in made or i in computed for i in n.inputs):
            computed.add(n.name)
        reads |= {(where[i], at) for i in n.inputs if i in computed and i in where
                  and where[i] < at}
    for k in range(1, len(graph.layers)):
        if graph.layers[k].path not in done | {last}:
            out[k] = "the forward never calls it"
    return StageRules(out, frozenset(reads), [lay.num_params for lay in graph.layers])


def refused_stages(paths: list[str], rules: StageRules, stages: list[int]) -> str:
    """Why a whole plan's stages (``stages``: each layer's, in order) cannot run, in one sentence
    naming the layer a stage starts at, the reason and what to do instead; "" when they can. Exactly
    the rules of :func:`stage_start_refusals`, each stage judged as a whole: a stage may start at a
    layer that alone reads nothing the layer before computed (LLaMA's rotary table) when a later
    layer of the stage does (the first decoder layer reads the hidden states), and at a layer
    without parameters when the stage holds some."""
    starts = [0] + [k for k in range(1, len(stages)) if stages[k] != stages[k - 1]]
    ends = [*starts[1:], len(stages)]
    for prev, i, end in zip(starts, starts[1:], ends[1:], strict=False):
        span = f"{paths[i]}" + (f" to {paths[end - 1]}" if end - 1 > i else "")
        why = rules.refused.get(i) or (
            "" if any(prev <= q < i <= p < end for q, p in rules.reads) else
            f"its stage ({span}) reads nothing stage {stages[prev]} computed, so nothing orders it "
            "after the one before") or (
            "" if sum(rules.params[i:end]) else
            f"its stage ({span}) holds no parameters (DDP refuses to wrap it, and a rank with no "
            "other stage has nothing to optimise)")
        if why:
            return _refusal(paths, starts_refused(paths, rules), i - 1, stages[prev], i, stages[i],
                            why)
    return ""


def refused_stage_start(paths: list[str], refusals: dict[int, str], stages: dict[int, int]) -> str:
    """Why stages set by hand cannot run, in one sentence naming the layer, the reason and what to
    do instead; "" when they may. ``stages``: layer index -> stage, for some layers (pins) or all (a
    plan's); the first layer is on stage 0 unless given. ``refusals``: :func:`stage_start_refusals`.
    A stage is forced to start at a refused layer where a layer is given a later stage than the
    given one before it and every layer between is refused: the partition may move a stage start
    only onto a layer between them."""
    known = sorted(({0: 0} | stages).items())
    for (j, a), (i, s) in zip(known, known[1:], strict=False):
        if s > a and all(k in refusals for k in range(j + 1, i + 1)):
            return _refusal(paths, refusals, j, a, i, s, refusals[i])
    return ""


def pinned_glue(paths: list[str], rules: StageRules, refusals: dict[int, str],
                stages: dict[int, int]) -> tuple[frozenset[int], str]:
    """The layers that stay in the stage of the layer before them for a partition honouring the pins
    ``stages`` (layer index -> stage), and why the pins cannot run ("" when they can). Where a pin
    forces a stage to start at a layer ``refusals`` has (:func:`refused_stage_start`), the start is
    kept when its stage can meet the rules as a whole (:func:`refused_stages`): the layers after it
    up to the first that reads something the unit before computed, with parameters among them, are
    glued to it (LLaMA's rotary table with model.layers.0)."""
    glued = set(refusals)
    known = sorted(({0: 0} | stages).items())
    for (j, a), (i, s) in zip(known, known[1:], strict=False):
        if not (s > a and all(k in glued for k in range(j + 1, i + 1))):
            continue
        # the first layer of the unit before
        unit = max((k for k in range(i) if k not in glued), default=0)
        end = next((m for m in range(i, len(paths)) if sum(rules.params[i:m + 1])
                    and any(unit <= q < i <= p <= m for q, p in rules.reads)), None)
        clash = next((k for k in range(i + 1, (end or i) + 1) if stages.get(k, s) != s), None)
        if i in rules.refused or end is None or clash is not None:
            return frozenset(glued), refused_stage_start(paths, refusals, stages)
        glued = (glued - {i}) | set(range(i + 1, end + 1))
    return frozenset(glued), ""


def _refusal(paths: list[str], refusals: dict[int, str], j: int, a: int, i: int, s: int,
             why: str) -> str:
    """Stage ``s`` cannot start at layer ``i`` (``why``), the layer ``j`` before it on stage ``a``:
    what to do."""
    start = next((k for k in range(i + 1, len(paths)) if k not in refusals), None)
    instead = f"start it at {paths[start]}" if start is not None else ("no later layer may start a "
                                                                       "stage")
    return (f"stage {s} cannot start at {paths[i]}: {why}; {instead}, or keep {paths[i]} on stage "
            f"{a} with {paths[j]}")
