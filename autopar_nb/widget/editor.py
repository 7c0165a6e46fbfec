"""The editor's data: per-layer table rows, the sharding board (one lane per split the planner can run for this
model, one chip per layer), pipeline lanes, global controls with the values the planner can take, alternatives,
readable change lists; and the mapping from a front-end choice to the session's override vocabulary.

Strategy values are the ``tp`` values of :meth:`Session.override` (plus "auto" and "fsdp"); labels are what the
controls show. Whether a split can apply to a layer is asked of the planner (``planner.constraints.parse`` on a
one-entry override), never decided here.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any

from ..cost.tp_styles import LAYOUT_WORDS, part_split
from ..graph import Layer, ModelGraph
from ..hardware import PRESETS, Cluster
from ..plan import AMP, RECOMPUTE, SCHEDULES, ZERO_STAGES, LayerPlan, Plan, PlanError, stage_rank
from ..units import fmt_bytes, fmt_count, fmt_time

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
GLOBAL_NAMES = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "zero_stage": "ZeRO", "micro_batches": "micro-batches",
                "schedule": "schedule", "virtual_stages": "virtual stages", "recompute": "recompute", "amp": "AMP",
                "sequence_parallel": "sequence parallel", "optimizer": "optimizer"}
_SHORTER = {"sequence_parallel": "seq. parallel", "recompute": "recompute (all layers)"}
CONTROL_LABELS = {k: _SHORTER.get(k, GLOBAL_NAMES[k]) for k in ("dp", "tp", "pp", "zero_stage", "micro_batches",
                                                                  "schedule", "virtual_stages", "amp",
                                                                  "sequence_parallel", "recompute")}
"""the global choices the widget has a control for, in the order shown, with the control's label (the other fix keys,
e.g. the optimizer or expert parallelism, are set in Python: ``ap.replan(fix={"optimizer": ...})``)"""
GLOBAL_KEYS = tuple(CONTROL_LABELS)


# ---- strategies ---------------------------------------------------------------------------------------------------
def current_strategy(lp: LayerPlan, plan: Plan, layer: Layer | None = None) -> str:
    """What the plan does with this layer, in strategy terms (with ``layer``, an Embedding split by rows reads as
    vocab-parallel, as the runtime applies it)."""
    s = _strategy(lp, plan)
    if s == "rowwise" and layer is not None and all(
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
    if plan.mesh.zero_stage >= 2 and plan.mesh.dp > 1 and lp.fsdp:
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
    """Whether ``pattern`` names modules inside layers rather than whole layers (the planner's own matching)."""
    from ..planner.constraints import _match

    whole, partial = _match(graph, pattern)
    return bool(partial) and not whole


def pattern_override(graph: ModelGraph, pattern: str, value: str) -> dict[str, Any]:
    """``Session.override`` arguments for strategy ``value`` on ``pattern``: as :func:`strategy_override` for layers;
    for modules inside a layer "replicate" is ``tp="replicate"`` only and FSDP units (whole layers) do not apply."""
    if not names_modules(graph, pattern):
        return strategy_override(value)
    if value == "fsdp":
        raise PlanError(f"{pattern!r} names modules inside a layer; FSDP units are whole layers: give the layer's "
                        "cluster (or its chip on the sharding board) this split")
    return {"tp": None} if value == "auto" else {"tp": value}


def structural_refusal(graph: ModelGraph, pattern: str, value: str) -> str:
    """Why the planner cannot apply strategy ``value`` to the layers or modules ``pattern`` names, whatever the
    other choices ("" when it can): ``planner.constraints.parse`` on that one override. Cached per graph."""
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
    if value == "fsdp" and plan is not None and (plan.mesh.zero_stage < 2 or plan.mesh.dp < 2):
        return (f"an own FSDP unit needs ZeRO-2/3 with dp ≥ 2; this plan is ZeRO-{plan.mesh.zero_stage} with "
                f"dp={plan.mesh.dp} (set ZeRO under Global choices first)")
    return ""


def refusals(graph: ModelGraph, pattern: str, values, plan: Plan | None, fix: dict[str, Any],
             cluster: Cluster) -> dict[str, str]:
    """{value: reason} for the strategies ``pattern`` cannot take now (structural first, then the global choices)."""
    out = {}
    for v in values:
        why = structural_refusal(graph, pattern, v) or plan_refusal(v, plan, fix, cluster)
        if why:
            out[v] = why
    return out


def strategy_choices(graph: ModelGraph, layer: Layer) -> list[str]:
    """The strategies the planner can apply to ``layer`` (its own answer, :func:`structural_refusal`)."""
    if not layer.num_params:
        return ["auto", "replicate"]
    pattern = _kind_pattern(graph, layer.path)
    return ["auto", *[v for v in LANES if not structural_refusal(graph, pattern, v)]]


def _kind_pattern(graph: ModelGraph, path: str) -> str:
    """The layer that stands for ``path`` when asking the planner: a repeated block's first member (members share
    their structure)."""
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


# ---- layer table ----------------------------------------------------------------------------------------------
def layer_rows(graph: ModelGraph, plan: Plan, overrides: dict[str, dict[str, Any]],
               changed: set[str]) -> list[dict[str, Any]]:
    """One row per layer: path, type, params, stage, strategy (pinned value or "auto"), what auto chose, the valid
    choices with labels, recompute, pinned fields, whether it changed against the previous plan."""
    rows = []
    for layer in graph.layers:
        try:
            lp = plan.layer(layer.path)
        except KeyError:
            continue
        chosen = current_strategy(lp, plan, layer) if layer.num_params else "replicate"
        pin = pinned_entry(overrides, layer.path)
        choices = strategy_choices(graph, layer)
        if "tp" in pin or "fsdp" in pin:
            value = ("fsdp" if pin.get("fsdp") else "replicate") if pin.get("tp", "replicate") == "replicate" \
                else pin["tp"]
        else:
            value = "auto"
        if value not in choices:
            choices.append(value)
        pinned = sorted(set(lp.pinned) | set(pin))
        rows.append({"path": layer.path, "type": layer.type, "params": fmt_count(layer.num_params),
                     "flops": fmt_count(layer.flops, "FLOP"), "block": layer.block, "stage": lp.stage,
                     "strategy": value, "auto": chosen,
                     "auto_label": "no parameters" if not layer.num_params else STRATEGY_LABELS.get(chosen, chosen) + (
                         " + SP" if lp.sequence_parallel and chosen == "colwise-rowwise" else "") +
                     layout_note(layer, lp, plan.mesh.tp),
                     "choices": [{"value": c, "label": STRATEGY_LABELS.get(c, c)} for c in choices],
                     "recompute": lp.recompute, "recompute_pinned": "recompute" in pin,
                     "stage_pinned": "stage" in pin, "pinned": pinned, "changed": layer.path in changed,
                     "tp": lp.tp, "sequence_parallel": lp.sequence_parallel, "fsdp": lp.fsdp})
    return rows


def layout_note(layer: Layer, lp: LayerPlan, tp: int) -> str:
    """How the layer's colwise modules with parts (``LayerPlan.tp_parts``) are split at ``tp``, for the table:
    " · c_attn split part by part", " · k_proj, v_proj repeated" ("" when none has parts)."""
    notes: dict[str, list[str]] = {}
    for m, parts in lp.tp_parts.items():
        kind, shared = layer.modules.get(m, ""), lp.tp.get(m) == "shared"
        how = "shared" if shared else part_split(parts, tp, repeatable=kind == "Linear", packable=kind != "Embedding")
        notes.setdefault(LAYOUT_WORDS.get(how, "cannot be split"), []).append(m.rsplit(".", 1)[-1])
    return "".join(f" · {', '.join(names)} {word}" for word, names in notes.items())


# ---- sharding board -------------------------------------------------------------------------------------------
def sharding_board(graph: ModelGraph, plan: Plan, overrides: dict[str, dict[str, Any]], fix: dict[str, Any],
                   cluster: Cluster, changed: set[str]) -> dict[str, Any]:
    """The sharding board: ``lanes`` (the splits the planner can run for some layer of this model, with what each
    means now), ``chips`` (one per layer with parameters, in model order: its lane, recompute, pins, block, and the
    kind whose refusals apply), ``refused`` ({kind: {lane: reason}} for lanes and recompute modes the kind cannot
    take now), ``recompute`` (the recompute modes), ``hidden`` (layers without parameters, not shown)."""
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
        chips.append({"path": layer.path, "lane": lane, "kind": kind, "block": layer.block, "type": layer.type,
                      "params": fmt_count(layer.num_params), "recompute": lp.recompute,
                      "pinned": "tp" in pin or "fsdp" in pin, "recompute_pinned": "recompute" in pin,
                      "sp": lp.sequence_parallel, "stage": lp.stage, "changed": layer.path in changed})
    # a lane some layer could take (now, or once the global choices allow it)
    valid = [v for v in LANES if any(v not in r or r[v] == plan_refusal(v, plan, fix, cluster)
                                     for r in refused.values())]
    hints = {
        "replicate": ("no TP; sharded with the root FSDP unit" if z >= 2 and dp > 1 else
                      "whole on every rank (DDP)" if dp > 1 else "whole on every rank"),
        "fsdp": "its own FSDP unit: gathered just before use, freed after",
        "colwise-rowwise": "Megatron pair: first Linear(s) by columns, the next by rows; one all-reduce",
        "colwise": "every Linear/Embedding split by output columns",
        "rowwise": "every Linear split by input rows (an Embedding by vocabulary)",
        "vocab": "embedding rows / output head columns split by vocabulary",
        "sequence_parallel": "norms run on a slice of the sequence",
    }
    lanes = [{"value": v, "label": STRATEGY_LABELS[v], "hint": hints[v],
              "python": _kwargs(strategy_override(v))} for v in valid]
    return {"lanes": lanes, "chips": chips, "refused": refused, "kinds": kinds,
            "recompute": [{"value": r, "label": r} for r in RECOMPUTE], "hidden": hidden,
            "blocks": {b.name: b.members for b in graph.blocks}}


def annotate_targets(graph: ModelGraph, nodes: dict, clusters: dict, plan: Plan | None, fix: dict[str, Any],
                     cluster: Cluster) -> None:
    """Add ``refused`` ({strategy: reason}) to every graph node and cluster that can be given a split (a drag onto a
    legend swatch, the right-click menu): asked of the planner for the node's module pattern, or for its layers."""
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
            info["refused"] = for_layers([p for p in target.get("layers", []) if graph.layer(p).num_params])
    for c in clusters.values():
        layers = [p for p in c.get("layers", []) if graph.layer(p).num_params]
        c["refused"] = for_layers(layers) if layers else {v: "this layer has no parameters to split" for v in LANES}


def _kwargs(choices: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in choices.items())


# ---- overrides for a set of layers --------------------------------------------------------------------------
def layer_globs(graph: ModelGraph, paths) -> list[str]:
    """Glob patterns (``fnmatch``, as ``Session.override`` takes them) that name exactly the layers ``paths``:
    ``"h.*"`` for every member of a repeated block, ``"h.1[0-9]"`` for h.10–h.19, else the paths."""
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
    """New overrides in which ``fields`` (None = un-pin) hold for exactly the layers ``paths``, and the patterns
    written. Earlier entries that only name these layers lose the fields (superseded); a glob that also names other
    layers keeps pinning them (un-pinning splits it into patterns for the others); the new entries go last, so
    they win, as the planner reads overrides in order."""
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


# ---- pipeline lanes -------------------------------------------------------------------------------------------
def stage_ranks(pp: int, virtual: int, schedule: str) -> list[tuple[int, int]]:
    """(pipeline rank, model chunk on that rank) of each stage: one stage per rank, interleaved/looped placement
    (stage s on rank s % pp), or a V (rank r holds stages r and 2pp-1-r), as ``runtime/pp.py: stage_ids``."""
    n = pp * virtual
    return [(stage_rank(s, pp, n, schedule), s // pp) for s in range(n)]


def stage_lanes(plan: Plan, memory_by_stage: list[float] | None = None) -> list[dict[str, Any]]:
    """Pipeline lanes: ``[{index, layers: [path], rank, chunk, label}]`` in model order; the label says which
    pipeline rank (and, with virtual stages, which of its model chunks) runs the stage."""
    v = plan.pipeline.virtual_stages
    ranks = stage_ranks(plan.mesh.pp, v, plan.pipeline.schedule)
    lanes = []
    for i, paths in enumerate(plan.stage_layers()):
        r, c = ranks[i] if i < len(ranks) else (i, 0)
        label = f"stage {i}" + (f" · pp rank {r}" if plan.mesh.pp > 1 else "") + (f" · chunk {c}" if v > 1 else "")
        lane = {"index": i, "layers": paths, "rank": r, "chunk": c, "label": label}
        if memory_by_stage and i < len(memory_by_stage):
            lane["peak"] = memory_by_stage[i]
        lanes.append(lane)
    return lanes


# ---- global controls ------------------------------------------------------------------------------------------
def global_state(cluster: Cluster, plan: Plan | None, fix: dict[str, Any], *,
                 disabled: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """The global controls: cluster (preset, nodes, GPUs per node), each plan-wide choice's current value and
    whether it is fixed by the user or chosen by the planner ("auto"), the options each may take and, in
    ``disabled``, the options the planner cannot plan with the other choices, with the reason."""
    m = plan.mesh if plan else None
    values = {}
    if plan is not None:
        values = {"dp": m.dp, "tp": m.tp, "pp": m.pp, "zero_stage": m.zero_stage,
                  "micro_batches": plan.batch.micro_batches, "schedule": plan.pipeline.schedule,
                  "virtual_stages": plan.pipeline.virtual_stages, "amp": plan.precision.amp,
                  "sequence_parallel": any(lp.sequence_parallel for lp in plan.layers),
                  "recompute": max(RECOMPUTE, key=[lp.recompute for lp in plan.layers].count)}
    return {
        "preset": cluster.name or "custom", "presets": [*PRESETS, "cpu"], "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node, "world_size": cluster.world_size, "device": cluster.describe(),
        "values": values, "fixed": {k: fix[k] for k in GLOBAL_KEYS if k in fix},
        "options": global_options(cluster), "disabled": disabled or {}, "labels": CONTROL_LABELS,
    }


def global_options(cluster: Cluster) -> dict[str, list]:
    """Every option each global control lists (mesh degrees: the divisors of the world size); which of them the
    planner cannot take with the other choices is :func:`option_refusals`' answer."""
    world = cluster.world_size
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return {"dp": divisors, "tp": divisors, "pp": divisors, "zero_stage": list(ZERO_STAGES),
            "micro_batches": [1, 2, 4, 8, 16, 32, 64], "schedule": list(SCHEDULES),
            "virtual_stages": [1, 2, 4], "amp": list(AMP), "sequence_parallel": [False, True],
            "recompute": list(RECOMPUTE)}


# ---- alternatives ---------------------------------------------------------------------------------------------
def global_choices(plan: Plan) -> dict[str, Any]:
    """The plan-wide choices that tell alternatives apart."""
    rec = sorted({lp.recompute for lp in plan.layers} - {"none"})
    return {"dp": plan.mesh.dp, "tp": plan.mesh.tp, "pp": plan.mesh.pp, "zero_stage": plan.mesh.zero_stage,
            "ep": plan.mesh.ep, "schedule": plan.pipeline.schedule if plan.mesh.pp > 1 else None,
            "virtual_stages": plan.pipeline.virtual_stages, "amp": plan.precision.amp,
            "sequence_parallel": any(lp.sequence_parallel for lp in plan.layers),
            "recompute": "/".join(rec) or "none", "micro_batches": plan.batch.micro_batches}


def global_differences(a: Plan, b: Plan, *, skip: tuple[str, ...] = ()) -> list[str]:
    """"ZeRO 2 → 3", "micro-batches 2 → 4": the plan-wide choices that differ from ``a`` to ``b``."""
    ga, gb = global_choices(a), global_choices(b)
    out = []
    for k in ga:
        if k in skip or ga[k] == gb[k] or (k == "schedule" and None in (ga[k], gb[k])):
            continue  # a schedule appears or goes with the pipeline: said beside pp
        text = f"{GLOBAL_NAMES.get(k, k)} {_v(ga[k])} → {_v(gb[k])}"
        if k == "pp" and (ga["schedule"] is None) != (gb["schedule"] is None):
            text += f" ({ga['schedule'] or gb['schedule']})"
        out.append(text)
    return out


def _v(x) -> str:
    return "on" if x is True else "off" if x is False else str(x)


def trade(base: Plan, alt: Plan) -> str:
    """What ``alt`` trades against ``base``: "+4% time (+0.10 ms), −18% memory (−210 MiB)"."""
    if base.cost is None or alt.cost is None:
        return ""
    t0, t1 = base.cost.step_time_s, alt.cost.step_time_s
    m0, m1 = base.cost.peak_memory_bytes, alt.cost.peak_memory_bytes
    parts = []
    for name, a, b, fmt in (("time", t0, t1, fmt_time), ("memory", m0, m1, fmt_bytes)):
        if a <= 0:
            continue
        d = b / a - 1
        if abs(d) < 0.005:
            parts.append(f"same {name}")
        else:
            sign = "+" if d > 0 else "−"
            parts.append(f"{sign}{abs(d) * 100:.0f}% {name} ({sign}{fmt(abs(b - a))})")
    return ", ".join(parts)


def alternative_rows(plan: Plan) -> list[dict[str, Any]]:
    """The next best plans, grouped when they differ from each other only in micro-batches: per group, what differs
    from the chosen plan, what it trades (time vs memory) and, per member, its index (for adopting) and cost."""
    groups: dict[tuple, dict[str, Any]] = {}
    for i, alt in enumerate(plan.alternatives):
        g = global_choices(alt)
        key = tuple((k, v) for k, v in g.items() if k != "micro_batches")
        c = alt.cost
        member = {"index": i, "micro_batches": alt.batch.micro_batches,
                  "step_s": c.step_time_s if c else None, "peak_bytes": c.peak_memory_bytes if c else None,
                  "trade": trade(plan, alt)}
        if key not in groups:
            groups[key] = {"summary": alt.summary().split(" | ")[0], "members": [],
                           "differs": global_differences(plan, alt, skip=("micro_batches",))}
        groups[key]["members"].append(member)
    rows = []
    for grp in groups.values():
        members = sorted(grp["members"], key=lambda m: m["step_s"] or 0)
        best = members[0]
        mbs = sorted(m["micro_batches"] for m in members)
        differs = list(grp["differs"])
        if len(members) == 1 and plan.batch.micro_batches != best["micro_batches"]:
            differs.append(f"micro-batches {plan.batch.micro_batches} → {best['micro_batches']}")
        elif len(members) > 1 and not differs:
            differs.append(f"micro-batches {plan.batch.micro_batches} → {', '.join(map(str, mbs))}")
        # per variant, in words (the row's hover text); Plan.diff per alternative cost ~30 ms each on a 7B graph
        lines = [f"{m['micro_batches']} micro-batches: {fmt_time(m['step_s'])}/step, peak {fmt_bytes(m['peak_bytes'])}"
                 f" ({m['trade']})" for m in members]
        rows.append({"index": best["index"], "summary": grp["summary"], "members": members,
                     "differs": differs or ["the same choices, placed differently"],
                     "trade": best["trade"], "step_s": best["step_s"], "peak_bytes": best["peak_bytes"],
                     "micro_batches_only": not grp["differs"], "changes": [grp["summary"], *lines]})
    return rows


def adopt_fix(alt: Plan) -> dict[str, Any]:
    """The global choices that pin ``alt``'s shape, for ``Session.replan(fix=...)`` (what pinning an alternative
    would take; the widget's Adopt does not pin, see ``Session.adopt``)."""
    fix = {"dp": alt.mesh.dp, "tp": alt.mesh.tp, "pp": alt.mesh.pp, "zero_stage": alt.mesh.zero_stage,
           "micro_batches": alt.batch.micro_batches, "amp": alt.precision.amp}
    if alt.mesh.pp > 1:
        fix["schedule"] = alt.pipeline.schedule
        fix["virtual_stages"] = alt.pipeline.virtual_stages
    return fix


# ---- what changed, in words ---------------------------------------------------------------------------------------
_LAYER_CHANGE = re.compile(r"layers\[(?P<layer>.+?)\]\.(?P<field>\w+)(?:\.(?P<module>.+))?$")
_GLOBAL_NAMES = {"mesh.dp": "dp", "mesh.tp": "tp", "mesh.pp": "pp", "mesh.ep": "ep", "mesh.zero_stage": "ZeRO",
                 "batch.micro_batches": "micro-batches", "batch.global_batch": "global batch",
                 "pipeline.schedule": "schedule", "pipeline.virtual_stages": "virtual stages",
                 "precision.amp": "AMP", "precision.param_dtype": "parameter dtype",
                 "precision.reduce_dtype": "reduce dtype", "loss_parallel": "loss parallel",
                 "sync_batchnorm": "SyncBatchNorm"}
_FIELD_NAMES = {"tp": "tp", "stage": "stage", "recompute": "recompute", "fsdp": "own FSDP unit",
                "sequence_parallel": "sequence parallel", "tp_parts": "TP parts", "pinned": "pinned"}


def name_layers(graph: ModelGraph, paths) -> str:
    """"h.1, h.2", "h.0–11", "32 layers (layers.0–31)", in model order with runs of a block's members as ranges."""
    order = {lay.path: i for i, lay in enumerate(graph.layers)}
    paths = sorted(set(paths), key=lambda p: order.get(p, 0))
    runs: list[list[str]] = []
    for p in paths:
        b = graph.block_of(p)
        if runs and b is not None and graph.block_of(runs[-1][-1]) is b and \
                b.members.index(p) == b.members.index(runs[-1][-1]) + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    names = [r[0] if len(r) == 1 else f"{r[0]}–{r[-1].rsplit('.', 1)[-1]}" for r in runs]
    text = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
    return text if len(paths) <= 3 else f"{len(paths)} layers ({text})"


def change_groups(graph: ModelGraph, changes) -> list[dict[str, Any]]:
    """The changes of ``Plan.diff`` grouped for a reader: one line per global choice ("tp: 1 → 2"), and per
    (field, old → new) over layers: "tp: replicate → colwise on 224 modules in 32 layers (wq, wk, wv, w1, w3)".
    Each group: {text, count (raw changes), layers}."""
    out: list[dict[str, Any]] = []
    grouped: dict[tuple, dict[str, Any]] = {}
    for c in changes:
        m = _LAYER_CHANGE.match(c.path)
        if m is None:
            name = _GLOBAL_NAMES.get(c.path, c.path)
            out.append({"text": f"{name}: {_fmt(c.old)} → {_fmt(c.new)}", "count": 1, "layers": []})
            continue
        field, module = m.group("field"), m.group("module")
        old, new = c.old, c.new
        if field == "tp":
            old, new = old or "replicate", new or "replicate"
        if field == "tp_parts":
            old, new = "", ""
        if field == "pinned":
            added, removed = sorted(set(new or []) - set(old or [])), sorted(set(old or []) - set(new or []))
            old, new = ", ".join(removed), ", ".join(added)
        key = (field, _fmt(old), _fmt(new))
        g = grouped.setdefault(key, {"layers": [], "modules": [], "count": 0})
        g["count"] += 1
        if m.group("layer") not in g["layers"]:
            g["layers"].append(m.group("layer"))
        if module:
            g["modules"].append(module)
    for (field, old, new), g in sorted(grouped.items(), key=lambda kv: -kv[1]["count"]):
        where = name_layers(graph, g["layers"])
        if field == "pinned":
            what = " and ".join(x for x in (f"pinned {new}" if new else "", f"un-pinned {old}" if old else "") if x)
            text = f"{what} on {where}"
        elif field == "tp_parts":
            text = f"TP layout of fused projections changed on {len(g['modules'])} module(s) in {where}"
        elif g["modules"]:
            short = list(dict.fromkeys(mod.rsplit(".", 1)[-1] for mod in g["modules"]))
            mods = ", ".join(short[:5]) + ("…" if len(short) > 5 else "")
            n = len(g["modules"])
            text = (f"{_FIELD_NAMES.get(field, field)}: {old} → {new} on {n} module{'s' if n > 1 else ''} in "
                    f"{where} ({mods})")
        else:
            text = f"{_FIELD_NAMES.get(field, field)}: {old} → {new} on {where}"
        out.append({"text": text, "count": g["count"], "layers": g["layers"]})
    return out


def _fmt(x) -> str:
    if x is None:
        return "none"
    if isinstance(x, bool):
        return "on" if x else "off"
    if isinstance(x, list):
        return "[" + ", ".join(map(str, x)) + "]"
    return str(x)


def plan_summary(plan: Plan, cluster: Cluster | None = None) -> str:
    """The header line: the plan's shape, step time and peak memory against one rank's limit (the memory panel's)."""
    shape = plan.summary().split(" | ")[0]
    if plan.cost is None:
        return shape
    limit = f" of {fmt_bytes(cluster.rank_memory_bytes)}" if cluster is not None else ""
    return (f"{shape} | {fmt_time(plan.cost.step_time_s)}/step, peak {fmt_bytes(plan.cost.peak_memory_bytes)}"
            f"{limit}")



# ---- mixed precision op lists (plan.precision.fp32_ops / low_precision_ops) ----------------------------------------
OP_LISTS = {"fp32_ops": "keep in float32", "low_precision_ops": "run in low precision"}
"""the precision editor's two lists (fix keys, as ``ap.replan(fix=...)`` takes them) and their labels"""


def precision_state(graph: ModelGraph, plan: Plan | None, fix: dict[str, Any]) -> dict[str, Any]:
    """The precision editor: each list's ops (as fixed, else the plan's), how many ops of this model each name
    reaches, the names the lists take (``plan.AMP_OPS``: torch's and Paddle's), and why the lists cannot be edited
    ("" when they can: they need autocast, so a plan in float32 with AMP not fixed to bf16/fp16 cannot take them)."""
    from ..cost.autocast import ops_named
    from ..plan import AMP_OPS

    amp = fix.get("amp", plan.precision.amp if plan is not None else "none")
    lists = {k: list(fix.get(k, getattr(plan.precision, k) if plan is not None else [])) for k in OP_LISTS}
    names = sorted({op for ops in lists.values() for op in ops})
    return {"amp": amp, "lists": lists, "labels": OP_LISTS, "choices": list(AMP_OPS),
            "reach": {op: ops_named(graph, op) for op in names},
            "disabled": "" if amp != "none" else "the op lists apply under autocast: choose AMP bf16 or fp16 under "
                                                 "Global choices first (in float32 every op already runs in float32)"}


def precision_fix(fix: dict[str, Any], amp: str, which: str, op: str, action: str) -> tuple[dict[str, Any], str]:
    """(the fix with ``op`` added to or removed from the list ``which``, a note): adding a name the other list holds
    moves it. ``amp``: the precision in force. Raises ValueError/PlanError, saying what to do, for a list or action
    that does not exist, a name the lists do not take, a name already there or absent, or lists without autocast."""
    from ..plan import AMP_OPS, normalize_fix

    if which not in OP_LISTS:
        raise ValueError(f"{which!r} is not an op list; choose one of {', '.join(OP_LISTS)}")
    if action not in ("add", "remove"):
        raise ValueError(f"action {action!r} unknown; choose add or remove")
    op = str(op or "").strip()
    label = OP_LISTS[which]
    if not op:
        raise ValueError(f"type an op name to {label} (e.g. softmax, layer_norm, matmul, elementwise_add)")
    if op not in AMP_OPS:
        near = difflib.get_close_matches(op.lower(), AMP_OPS, n=4, cutoff=0.6)
        hint = f"did you mean {', '.join(near)}?" if near else f"the names it takes: {', '.join(AMP_OPS)}"
        raise PlanError(f"{op!r} is not an op name the precision lists take; {hint}")
    if amp == "none":
        raise PlanError("the op lists apply under autocast: choose AMP bf16 or fp16 under Global choices first")
    other = next(k for k in OP_LISTS if k != which)
    lists = {k: list(fix.get(k, [])) for k in OP_LISTS}
    note = ""
    if action == "add":
        if op in lists[which]:
            raise ValueError(f"{op} is already in the list to {label}")
        if op in lists[other]:
            lists[other].remove(op)
            note = f" ({op} left the list to {OP_LISTS[other]})"
        lists[which].append(op)
    else:
        if op not in lists[which]:
            raise ValueError(f"{op} is not in the list to {label}; it holds {', '.join(lists[which]) or 'nothing'}")
        lists[which].remove(op)
    out = {k: v for k, v in fix.items() if k not in OP_LISTS}
    out.update({k: v for k, v in lists.items() if v})
    return normalize_fix(out), note
