"""The editor's data: per-layer table rows with the strategy choices valid for each layer, pipeline lanes, global
controls and alternatives; and the mapping from a front-end choice to the session's override vocabulary.

Strategy values are the ``tp`` values of :meth:`Session.override` (plus "auto" and "fsdp"); labels are what the
dropdown shows.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from ..cost.tp_styles import LAYOUT_WORDS, part_split
from ..graph import Layer, ModelGraph, human
from ..hardware import PRESETS, Cluster
from ..plan import AMP, FIX_KEYS, RECOMPUTE, SCHEDULES, ZERO_STAGES, LayerPlan, Plan

STRATEGY_LABELS = {
    "auto": "auto",
    "replicate": "replicate",
    "fsdp": "fsdp",
    "colwise": "tp-colwise",
    "rowwise": "tp-rowwise",
    "colwise-rowwise": "tp col→row (Megatron)",
    "sequence_parallel": "sequence-parallel",
    "vocab": "vocab-parallel",
}
GLOBAL_KEYS = tuple(k for k in FIX_KEYS if k != "optimizer")
"""the fix keys the widget has a control for (the optimizer is set in Python: ``ap.replan(fix={"optimizer": ...})``)"""


def strategy_choices(graph: ModelGraph, layer: Layer) -> list[str]:
    """The strategies that make sense for ``layer``, from the ops it runs (kernels_ext split rules): a layer with
    several linears can be Megatron-split (its sequence parallelism is the global ``sequence_parallel``), a single
    linear column- or row-wise (vocab-parallel when it produces the vocabulary), an embedding vocab-parallel or
    column-wise, a norm-only layer sequence-parallel."""
    ops = graph.layer_nodes(layer.path)
    linears = [n for n in ops if n.op_class == "matmul" and n.params]
    embeddings = [n for n in ops if n.op_class == "embedding" and n.params]
    norms = [n for n in ops if n.op_class == "norm"]
    out = ["auto", "replicate"]
    if layer.num_params:
        out.append("fsdp")
    if len(linears) >= 2:
        out.append("colwise-rowwise")
    elif len(linears) == 1:
        out += ["colwise", "rowwise"]
        vocab = {graph.params[p].shape[0] for e in graph.nodes if e.op_class == "embedding" for p in e.params
                 if p in graph.params and graph.params[p].shape}
        if any(s and s[-1] in vocab for s in linears[0].out_shapes):
            out.append("vocab")
    elif embeddings:
        out += ["vocab", "colwise"]
    elif norms:
        out.append("sequence_parallel")
    return out


def current_strategy(lp: LayerPlan, plan: Plan) -> str:
    """What the plan does with this layer, in strategy terms."""
    styles = {s for s in lp.tp.values() if s != "replicate"}
    if plan.mesh.tp > 1 and styles:
        if {"colwise", "rowwise"} <= styles:
            return "colwise-rowwise"
        if styles == {"sequence_parallel"}:
            return "sequence_parallel"
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


def pinned_entry(overrides: dict[str, dict[str, Any]], path: str) -> dict[str, Any]:
    """The override fields that apply to layer ``path`` (exact entry last, so it wins over globs)."""
    out: dict[str, Any] = {}
    for pattern, entry in overrides.items():
        if pattern != path and fnmatch.fnmatchcase(path, pattern):
            out.update(entry)
    out.update(overrides.get(path, {}))
    return out


def layer_rows(graph: ModelGraph, plan: Plan, overrides: dict[str, dict[str, Any]],
               changed: set[str]) -> list[dict[str, Any]]:
    """One row per layer: path, type, params, stage, strategy (pinned value or "auto"), what auto chose, the valid
    choices with labels, recompute, pinned fields, whether it changed against the previous plan."""
    rows = []
    emb = {layer.path for layer in graph.layers if any(n.op_class == "embedding" and n.params
                                                       for n in graph.layer_nodes(layer.path))}
    for layer in graph.layers:
        try:
            lp = plan.layer(layer.path)
        except KeyError:
            continue
        chosen = current_strategy(lp, plan) if layer.num_params else "replicate"
        if chosen == "rowwise" and layer.path in emb:
            chosen = "vocab"
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
        rows.append({"path": layer.path, "type": layer.type, "params": human(layer.num_params),
                     "flops": human(layer.flops), "block": layer.block, "stage": lp.stage,
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
        kind = layer.modules.get(m, "")
        how = part_split(parts, tp, repeatable=kind == "Linear", packable=kind != "Embedding")
        notes.setdefault(LAYOUT_WORDS.get(how, "cannot be split"), []).append(m.rsplit(".", 1)[-1])
    return "".join(f" · {', '.join(names)} {word}" for word, names in notes.items())


def stage_lanes(plan: Plan, memory_by_stage: list[float] | None = None) -> list[dict[str, Any]]:
    """Pipeline lanes: ``[{index, layers: [path], pinned: [path]}]`` in model order."""
    lanes = []
    for i, paths in enumerate(plan.stage_layers()):
        lane = {"index": i, "layers": paths}
        if memory_by_stage and i < len(memory_by_stage):
            lane["peak"] = memory_by_stage[i]
        lanes.append(lane)
    return lanes


def global_state(cluster: Cluster, plan: Plan | None, fix: dict[str, Any]) -> dict[str, Any]:
    """The global controls: cluster (preset, nodes, GPUs per node), each plan-wide choice's current value and
    whether it is fixed by the user or chosen by the planner ("auto"), and the options each may take."""
    m = plan.mesh if plan else None
    values = {}
    if plan is not None:
        values = {"dp": m.dp, "tp": m.tp, "pp": m.pp, "zero_stage": m.zero_stage,
                  "micro_batches": plan.batch.micro_batches, "schedule": plan.pipeline.schedule,
                  "virtual_stages": plan.pipeline.virtual_stages, "amp": plan.precision.amp,
                  "sequence_parallel": any(lp.sequence_parallel for lp in plan.layers),
                  "recompute": max(RECOMPUTE, key=[lp.recompute for lp in plan.layers].count)}
    world = cluster.world_size
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return {
        "preset": cluster.name or "custom", "presets": [*PRESETS, "cpu"], "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node, "world_size": world, "device": cluster.describe(),
        "values": values, "fixed": {k: fix[k] for k in GLOBAL_KEYS if k in fix},
        "options": {"dp": divisors, "tp": divisors, "pp": divisors, "zero_stage": list(ZERO_STAGES),
                    "micro_batches": [1, 2, 4, 8, 16, 32, 64], "schedule": list(SCHEDULES),
                    "virtual_stages": [1, 2, 4], "amp": list(AMP), "sequence_parallel": [False, True],
                    "recompute": list(RECOMPUTE)},
    }


def alternative_rows(plan: Plan) -> list[dict[str, Any]]:
    """Top-k alternatives: summary, predicted cost and what differs from the chosen plan."""
    rows = []
    for i, alt in enumerate(plan.alternatives):
        changes = plan.diff(alt)
        c = alt.cost
        rows.append({"index": i, "summary": alt.summary().split(" | ")[0],
                     "step_ms": c.step_time_s * 1e3 if c else None,
                     "peak_gib": c.peak_memory_bytes / 2**30 if c else None, "mfu": c.mfu if c else None,
                     "changes": [str(ch) for ch in changes[:6]], "n_changes": len(changes)})
    return rows


def adopt_fix(alt: Plan) -> dict[str, Any]:
    """The global choices that pin ``alt``'s shape, for ``Session.replan(fix=...)``."""
    fix = {"dp": alt.mesh.dp, "tp": alt.mesh.tp, "pp": alt.mesh.pp, "zero_stage": alt.mesh.zero_stage,
           "micro_batches": alt.batch.micro_batches, "amp": alt.precision.amp}
    if alt.mesh.pp > 1:
        fix["schedule"] = alt.pipeline.schedule
        fix["virtual_stages"] = alt.pipeline.virtual_stages
    return fix
