"""The editor's per-layer data: table rows, the sharding board (one lane per split the planner can
run for this model, one chip per layer) and pipeline lanes; and the mapping from a front-end choice
to the session's override vocabulary. The plan-wide controls are :mod:`.choices`; alternatives and
change lists :mod:`.differences`.

Strategy values are the ``tp`` values of :meth:`Session.override` (plus "auto" and "fsdp"); labels
are what the controls show. Whether a split can apply to a layer is asked of the planner
(``planner.constraints.parse`` on a one-entry override), never decided here.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from ..cost.tp_styles import LAYOUT_WORDS, part_split
from ..graph import Layer, ModelGraph
from ..hardware import Cluster
from ..plan import RECOMPUTE, LayerPlan, Plan, PlanError, stage_rank
from ..planner.explain import whole_notes
from ..units import fmt_count

STRATEGY_LABELS = {
    "auto": "auto",
    "replicate": "replicated",
    "fsdp": "FSDP unit",
    "colwise-rowwise": "TP col → row",
    "colwise": "TP column",
    "rowwise": "TP row",
    "vocab": "vocab-parallel",
    "sequence_parallel": "sequence parallel",
}
LANES = ("replicate", "fsdp", "colwise-rowwise", "colwise", "rowwise", "vocab", "sequence_parallel")
"""the sharding board's lanes, in order (those no layer of the model can take are left out)"""
TP_LANES = ("colwise-rowwise", "colwise", "rowwise", "vocab", "sequence_parallel")


# ---- strategies ----------------------------------------------------------------------------------
def current_strategy(lp: LayerPlan, plan: Plan, layer: Layer | None = None) -> str:
    """What the plan does with this layer, in strategy terms (with ``layer``, an Embedding split by
    rows reads as vocab-parallel, as the runtime applies it)."""
    if (s := _strategy(lp, plan)) == "rowwise" and layer is not None and all(
            layer.modules.get(m) == "Embedding" for m, st in lp.tp.items() if st == "rowwise"):
        return "vocab"
    return s


def _strategy(lp: LayerPlan, plan: Plan) -> str:
    styles = {s for s in lp.tp.values() if s != "replicate"}
    if plan.mesh.tp > 1 and styles:
        if {"colwise", "rowwise"} <= styles:
            return "colwise-rowwise"
        if styles == {"sequence_parallel"}:
            return "sequence_parallel"
        styles.discard("sequence_parallel")
        if len(styles) == 1:
            (s,) = styles
            return "vocab" if s == "colwise" and plan.loss_parallel and lp is plan.layers[-1] else s
    if lp.sequence_parallel and plan.mesh.tp > 1:
        return "sequence_parallel"
    if plan.mesh.zero_stage >= 1 and plan.mesh.dp > 1 and lp.fsdp:
        return "fsdp"
    return "replicate"


def strategy_override(value: str) -> dict[str, Any]:
    """Front-end strategy value -> ``Session.override`` keyword arguments (None un-pins a field)."""
    if value == "auto":
        return {"tp": None, "fsdp": None}
    if value == "replicate":
        return {"tp": "replicate", "fsdp": False}
    if value == "fsdp":
        return {"tp": "replicate", "fsdp": True}
    if value not in STRATEGY_LABELS:
        raise ValueError(f"strategy {value!r} unknown; choose one of {', '.join(STRATEGY_LABELS)}")
    return {"tp": value}


_STRUCTURAL: dict[tuple[int, str, str], str] = {}


def names_modules(graph: ModelGraph, pattern: str) -> bool:
    """Whether ``pattern`` names modules inside layers rather than whole layers (the planner's own
    matching)."""
    from ..planner.constraints import _match

    whole, partial = _match(graph, pattern)
    return bool(partial) and not whole


def pattern_override(graph: ModelGraph, pattern: str, value: str) -> dict[str, Any]:
    """``Session.override`` arguments for strategy ``value`` on ``pattern``: as
    :func:`strategy_override` for layers; for modules inside a layer "replicate" is
    ``tp="replicate"`` only and FSDP units (whole layers) do not apply."""
    if not names_modules(graph, pattern):
        return strategy_override(value)
    if value == "fsdp":
        raise PlanError(f"{pattern!r} names modules inside a layer; FSDP units are whole layers: "
                        "give the layer's cluster (or its chip on the sharding board) this split")
    return {"tp": None} if value == "auto" else {"tp": value}


def structural_refusal(graph: ModelGraph, pattern: str, value: str) -> str:
    """Why the planner cannot apply strategy ``value`` to the layers or modules ``pattern`` names,
    whatever the other choices ("" when it can): ``planner.constraints.parse`` on that one override.
    Cached per graph."""
    key = (id(graph), pattern, value)
    if key in _STRUCTURAL:
        return _STRUCTURAL[key]
    from ..cost.profile import profile_of
    from ..planner.constraints import parse

    try:
        choice = {k: v for k, v in pattern_override(graph, pattern, value).items() if v is not None}
        parse(graph, profile_of(graph), {}, {pattern: choice})
        why = ""
    except PlanError as e:
        why = re.sub(rf"^override {re.escape(repr(pattern))}: ", "", str(e))
    if len(_STRUCTURAL) > 20000:
        _STRUCTURAL.clear()
    _STRUCTURAL[key] = why
    return why


def plan_refusal(value: str, plan: Plan | None, fix: dict[str, Any], cluster: Cluster) -> str:
    """Why ``value`` cannot take effect under the global choices in force ("" when it can)."""
    if value in TP_LANES:
        if cluster.world_size == 1:
            return "one GPU: there is nothing to split a layer over"
        if fix.get("tp") == 1:
            return "tp is fixed to 1 under Global choices: set tp to auto or ≥ 2 first"
    if value == "fsdp" and plan is not None and (plan.mesh.zero_stage < 1 or plan.mesh.dp < 2):
        return ("an own FSDP unit needs ZeRO 1-3 with dp ≥ 2; this plan is "
                f"ZeRO-{plan.mesh.zero_stage} with dp={plan.mesh.dp} (set ZeRO under Global "
                "choices first)")
    return ""


def refusals(graph: ModelGraph, pattern: str, values, plan: Plan | None, fix: dict[str, Any],
             cluster: Cluster) -> dict[str, str]:
    """{value: reason} for the strategies ``pattern`` cannot take now (structural first, then the
    global choices)."""
    out = {}
    for v in values:
        why = structural_refusal(graph, pattern, v) or plan_refusal(v, plan, fix, cluster)
        if why:
            out[v] = why
    return out


def strategy_choices(graph: ModelGraph, layer: Layer) -> list[str]:
    """The strategies the planner can apply to ``layer`` (its own answer,
    :func:`structural_refusal`)."""
    if not layer.num_params:
        return ["auto", "replicate"]
    pattern = _kind_pattern(graph, layer.path)
    return ["auto", *[v for v in LANES if not structural_refusal(graph, pattern, v)]]


def _kind_pattern(graph: ModelGraph, path: str) -> str:
    """The layer that stands for ``path`` when asking the planner: a repeated block's first member
    (members share their structure)."""
    b = graph.block_of(path)
    return b.members[0] if b is not None else path


def pinned_entry(overrides: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    """The override fields that apply to layer ``path``, later entries winning as in the planner."""
    out: dict[str, Any] = {}
    parts = path.split(".")
    for pattern, entry in overrides.items():
        if any(fnmatch.fnmatchcase(".".join(parts[:k]), pattern) for k in range(1, len(parts) + 1)):
            out.update(entry)
    return out


# ---- layer table ---------------------------------------------------------------------------------
def layer_rows(graph: ModelGraph, plan: Plan, overrides: dict[str, dict[str, Any]],
               changed: set[str]) -> list[dict[str, Any]]:
    """One row per layer: path, type, params, stage, strategy (pinned value or "auto"), what auto
    chose, the valid choices with labels, recompute, pinned fields, whether it changed against the
    previous plan."""
    rows, whole = [], whole_notes(graph, plan)
    for layer in graph.layers:
        try:
            lp = plan.layer(layer.path)
        except KeyError:
            continue
        chosen = current_strategy(lp, plan, layer) if layer.num_params else "replicate"
        pin = pinned_entry(overrides, layer.path)
        choices = strategy_choices(graph, layer)
        if "tp" in pin or "fsdp" in pin:
            value = (("fsdp" if pin.get("fsdp") else "replicate")
                     if pin.get("tp", "replicate") == "replicate" else pin["tp"])
        else:
            value = "auto"
        if value not in choices:
            choices.append(value)
        pinned = sorted(set(lp.pinned) | set(pin))
        rows.append({"path": layer.path, "type": layer.type, "params": fmt_count(layer.num_params),
                     "flops": fmt_count(layer.flops, "FLOP"), "block": layer.block,
                     "stage": lp.stage, "strategy": value, "auto": chosen,
                     "auto_label": "no parameters" if not layer.num_params
                     else STRATEGY_LABELS.get(chosen, chosen) + (
                         " + SP" if lp.sequence_parallel and chosen == "colwise-rowwise" else "") +
                     layout_note(layer, lp, plan.mesh.tp) + whole.get(layer.path, ""),
                     "choices": [{"value": c, "label": STRATEGY_LABELS.get(c, c)} for c in choices],
                     "recompute": lp.recompute, "recompute_pinned": "recompute" in pin,
                     "stage_pinned": "stage" in pin, "pinned": pinned,
                     "changed": layer.path in changed,
                     "tp": lp.tp, "sequence_parallel": lp.sequence_parallel, "fsdp": lp.fsdp})
    return rows


def layout_note(layer: Layer, lp: LayerPlan, tp: int) -> str:
    """How the layer's colwise modules with parts (``LayerPlan.tp_parts``) are split at ``tp``, for
    the table: " · c_attn split part by part", " · k_proj, v_proj repeated" ("" when none has
    parts)."""
    notes: dict[str, list[str]] = {}
    for m, parts in lp.tp_parts.items():
        kind, shared = layer.modules.get(m, ""), lp.tp.get(m) == "shared"
        how = "shared" if shared else part_split(parts, tp, repeatable=kind == "Linear",
                                                 packable=kind != "Embedding")
        notes.setdefault(LAYOUT_WORDS.get(how, "cannot be split"), []).append(m.rsplit(".", 1)[-1])
    return "".join(f" · {', '.join(names)} {word}" for word, names in notes.items())


# ---- sharding board ------------------------------------------------------------------------------
def sharding_board(graph: ModelGraph, plan: Plan, overrides: dict[str, dict[str, Any]],
                   fix: dict[str, Any], cluster: Cluster, changed: set[str]) -> dict[str, Any]:
    """The sharding board: ``lanes`` (the splits the planner can run for some layer of this model,
    with what each means now), ``chips`` (one per layer with parameters, in model order: its lane,
    recompute, pins, block, and the kind whose refusals apply), ``refused`` ({kind: {lane: reason}}
    for lanes and recompute modes the kind cannot take now), ``recompute`` (the recompute modes),
    ``hidden`` (layers without parameters, not shown)."""
    chips, kinds, refused = [], {}, {}
    hidden = 0
    z, dp = plan.mesh.zero_stage, plan.mesh.dp
    for layer in graph.layers:
        if not layer.num_params:
            hidden += 1
            continue
        try:
            lp = plan.layer(layer.path)
        except KeyError:
            continue
        kind = _kind_pattern(graph, layer.path)
        if kind not in refused:
            refused[kind] = refusals(graph, kind, LANES, plan, fix, cluster)
            kinds[kind] = layer.type
        pin = pinned_entry(overrides, layer.path)
        lane = current_strategy(lp, plan, layer)
        chips.append({"path": layer.path, "lane": lane, "kind": kind, "block": layer.block,
                      "type": layer.type, "params": fmt_count(layer.num_params),
                      "recompute": lp.recompute, "pinned": "tp" in pin or "fsdp" in pin,
                      "recompute_pinned": "recompute" in pin, "sp": lp.sequence_parallel,
                      "stage": lp.stage, "changed": layer.path in changed})
    # a lane some layer could take (now, or once the global choices allow it)
    valid = [v for v in LANES if any(v not in r or r[v] == plan_refusal(v, plan, fix, cluster)
                                     for r in refused.values())]
    hints = {
        "replicate": ("no TP; sharded with the root FSDP unit" if z >= 2 and dp > 1 else
                      "whole on every rank (DDP)" if dp > 1 else "whole on every rank"),
        "fsdp": "its own FSDP unit: gathered just before use, freed after",
        "colwise-rowwise": "Megatron pair: first Linear(s) by columns, the next by rows; one "
                           "all-reduce",
        "colwise": "every Linear/Embedding split by output columns",
        "rowwise": "every Linear split by input rows (an Embedding by vocabulary)",
        "vocab": "embedding rows / output head columns split by vocabulary",
        "sequence_parallel": "norms run on a slice of the sequence",}
    lanes = [{"value": v, "label": STRATEGY_LABELS[v], "hint": hints[v],
              "python": _kwargs(strategy_override(v))} for v in valid]
    return {"lanes": lanes, "chips": chips, "refused": refused, "kinds": kinds,
            "recompute": [{"value": r, "label": r} for r in RECOMPUTE], "hidden": hidden,
            "blocks": {b.name: b.members for b in graph.blocks}}


def annotate_targets(graph: ModelGraph, nodes: dict, clusters: dict, plan: Plan | None,
                     fix: dict[str, Any], cluster: Cluster) -> None:
    """Add ``refused`` ({strategy: reason}) to every graph node and cluster that can be given a
    split (a drag onto a legend swatch, the right-click menu): asked of the planner for the node's
    module pattern, or for its layers."""
    by_kind: dict[str, dict[str, str]] = {}

    def for_layers(paths) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in paths:
            k = _kind_pattern(graph, p)
            if k not in by_kind:
                by_kind[k] = refusals(graph, k, LANES, plan, fix, cluster)
            for v, why in by_kind[k].items():
                out.setdefault(v, f"{p}: {why}" if len(paths) > 1 else why)
        return out

    for info in nodes.values():
        target = info.get("target")
        if not target:
            continue
        if target.get("pattern") and info.get("kind") != "group":
            info["refused"] = refusals(graph, target["pattern"], LANES, plan, fix, cluster)
        else:
            info["refused"] = for_layers([p for p in target.get("layers", [])
                                          if graph.layer(p).num_params])
    for c in clusters.values():
        layers = [p for p in c.get("layers", []) if graph.layer(p).num_params]
        c["refused"] = for_layers(layers) if layers else {v: "this layer has no parameters to split"
                                                          for v in LANES}


def _kwargs(choices: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in choices.items())


# ---- overrides for a set of layers ---------------------------------------------------------------
def layer_globs(graph: ModelGraph, paths) -> list[str]:
    """Glob patterns (``fnmatch``, as ``Session.override`` takes them) that name exactly the layers
    ``paths``: ``"h.*"`` for every member of a repeated block, ``"h.1[0-9]"`` for h.10–h.19, else
    the paths."""
    from ..planner.constraints import _match

    want = set(paths)
    order = [lay.path for lay in graph.layers]
    index = {p: i for i, p in enumerate(order)}
    by_prefix: dict[str, list[int]] = {}
    rest = []
    for p in sorted(want, key=lambda p: index.get(p, 0)):
        m = re.fullmatch(r"(.*\.)?(\d+)", p)
        if m:
            by_prefix.setdefault(m.group(1) or "", []).append(int(m.group(2)))
        else:
            rest.append(p)
    out: list[str] = []

    def exact(pattern: str, names: set[str]) -> bool:
        whole, partial = _match(graph, pattern)
        return {order[i] for i in whole} == names and not partial

    for prefix, nums in by_prefix.items():
        names = {f"{prefix}{n}" for n in nums}
        siblings = {p for p in order if re.fullmatch(re.escape(prefix) + r"\d+", p)}
        if names == siblings and len(names) > 1 and exact(f"{prefix}*", names):
            out.append(f"{prefix}*")
            continue
        tens: dict[int, list[int]] = {}
        for n in sorted(nums):
            tens.setdefault(n // 10, []).append(n % 10)
        for t, units in tens.items():
            head = f"{prefix}{t if t else ''}"
            if len(units) == 1:
                pat = f"{head}{units[0]}"
            elif units == list(range(units[0], units[-1] + 1)):
                pat = f"{head}[{units[0]}-{units[-1]}]"
            else:
                pat = f"{head}[{''.join(map(str, units))}]"
            group = {f"{prefix}{t * 10 + u}" for u in units}
            out += [pat] if exact(pat, group) else sorted(group, key=lambda p: index.get(p, 0))
    return out + rest


def set_layer_fields(graph: ModelGraph, overrides: dict[str, dict[str, Any]], paths,
                     fields: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """New overrides in which ``fields`` (None = un-pin) hold for exactly the layers ``paths``, and
    the patterns written. Earlier entries that only name these layers lose the fields (superseded);
    a glob that also names other layers keeps pinning them (un-pinning splits it into patterns for
    the others); the new entries go last, so they win, as the planner reads overrides in order."""
    from ..planner.constraints import _match

    order = [lay.path for lay in graph.layers]
    want = set(paths)
    out = {k: dict(v) for k, v in overrides.items()}
    moved: list[tuple[str, dict[str, Any]]] = []
    for pattern, entry in list(out.items()):
        keys = [k for k in fields if k in entry]
        if not keys:
            continue
        whole, partial = _match(graph, pattern)
        named = {order[i] for i in whole}
        if not named & want or partial:
            continue
        if named <= want:
            for k in keys:
                entry.pop(k)
        elif any(fields[k] is None for k in keys):
            kept = {k: entry.pop(k) for k in keys}
            for pat in layer_globs(graph, sorted(named - want, key=order.index)):
                moved.append((pat, kept))
        if not entry:
            out.pop(pattern)
    for pat, kept in moved:
        out[pat] = {**out.pop(pat, {}), **kept}
    new = {k: v for k, v in fields.items() if v is not None}
    patterns = layer_globs(graph, sorted(want, key=order.index)) if new else []
    for pat in patterns:
        out[pat] = {**out.pop(pat, {}), **new}
    return out, patterns


# ---- pipeline lanes ------------------------------------------------------------------------------
def stage_ranks(pp: int, virtual: int, schedule: str) -> list[tuple[int, int]]:
    """(pipeline rank, model chunk on that rank) of each stage: one stage per rank,
    interleaved/looped placement (stage s on rank s % pp), or a V (rank r holds stages r and
    2pp-1-r), as ``runtime/pp.py: stage_ids``."""
    n = pp * virtual
    return [(stage_rank(s, pp, n, schedule), s // pp) for s in range(n)]


def stage_lanes(plan: Plan, memory_by_stage: list[float] | None = None) -> list[dict[str, Any]]:
    """Pipeline lanes: ``[{index, layers: [path], rank, chunk, label}]`` in model order; the label
    says which pipeline rank (and, with virtual stages, which of its model chunks) runs the
    stage."""
    v = plan.pipeline.virtual_stages
    ranks = stage_ranks(plan.mesh.pp, v, plan.pipeline.schedule)
    lanes = []
    for i, paths in enumerate(plan.stage_layers()):
        r, c = ranks[i] if i < len(ranks) else (i, 0)
        label = (f"stage {i}" + (f" · pp rank {r}" if plan.mesh.pp > 1 else "")
                 + (f" · chunk {c}" if v > 1 else ""))
        lane = {"index": i, "layers": paths, "rank": r, "chunk": c, "label": label}
        if memory_by_stage and i < len(memory_by_stage):
            lane["peak"] = memory_by_stage[i]
        lanes.append(lane)
    return lanes
