"""The global choices: the plan-wide choices the widget has a control for, with their current
values, whether the user fixed them and the options each may take; and the precision editor's two op
lists."""

from __future__ import annotations

import difflib
from typing import Any

from ..cost.autocast import ops_named
from ..graph import ModelGraph
from ..hardware import PRESETS, Cluster
from ..plan import AMP, AMP_OPS, RECOMPUTE, SCHEDULES, ZERO_STAGES, Plan, PlanError, normalize_fix

GLOBAL_NAMES = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "zero_stage": "ZeRO",
                "micro_batches": "micro-batches", "schedule": "schedule",
                "virtual_stages": "virtual stages", "recompute": "recompute", "amp": "AMP",
                "sequence_parallel": "sequence parallel", "optimizer": "optimizer"}
_SHORTER = {"sequence_parallel": "seq. parallel", "recompute": "recompute (all layers)"}
CONTROL_LABELS = {k: _SHORTER.get(k, GLOBAL_NAMES[k])
                  for k in ("dp", "tp", "pp", "zero_stage", "micro_batches",
                                                                  "schedule", "virtual_stages",
                            "amp",
                                                                  "sequence_parallel", "recompute")}
"""the global choices the widget has a control for, in the order shown, with the control's label
(the other fix keys, e.g. the optimizer or expert parallelism, are set in Python:
``ap.replan(fix={"optimizer": ...})``)"""
GLOBAL_KEYS = tuple(CONTROL_LABELS)


def global_state(cluster: Cluster, plan: Plan | None, fix: dict[str, Any], *,
                 disabled: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """The global controls: cluster (preset, nodes, GPUs per node), each plan-wide choice's current
    value and whether it is fixed by the user or chosen by the planner ("auto"), the options each
    may take and, in ``disabled``, the options the planner cannot plan with the other choices, with
    the reason."""
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
        "gpus_per_node": cluster.gpus_per_node, "world_size": cluster.world_size,
        "device": cluster.describe(), "values": values,
        "fixed": {k: fix[k] for k in GLOBAL_KEYS if k in fix}, "options": global_options(cluster),
        "disabled": disabled or {}, "labels": CONTROL_LABELS,}


def global_options(cluster: Cluster) -> dict[str, list]:
    """Every option each global control lists (mesh degrees: the divisors of the world size); which
    of them the planner cannot take with the other choices is :func:`option_refusals`' answer."""
    world = cluster.world_size
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return {"dp": divisors, "tp": divisors, "pp": divisors, "zero_stage": list(ZERO_STAGES),
            "micro_batches": [1, 2, 4, 8, 16, 32, 64], "schedule": list(SCHEDULES),
            "virtual_stages": [1, 2, 4], "amp": list(AMP), "sequence_parallel": [False, True],
            "recompute": list(RECOMPUTE)}


OP_LISTS = {"fp32_ops": "keep in float32", "low_precision_ops": "run in low precision"}
"""the precision editor's two lists (fix keys, as ``ap.replan(fix=...)`` takes them) and their
labels"""


def precision_state(graph: ModelGraph, plan: Plan | None, fix: dict[str, Any]) -> dict[str, Any]:
    """The precision editor: each list's ops (as fixed, else the plan's), how many ops of this model
    each name reaches, the names the lists take (``plan.AMP_OPS``: torch's and Paddle's), and why
    the lists cannot be edited ("" when they can: they need autocast, so a plan in float32 with AMP
    not fixed to bf16/fp16 cannot take them)."""
    amp = fix.get("amp", plan.precision.amp if plan is not None else "none")
    lists = {k: list(fix.get(k, getattr(plan.precision, k) if plan is not None else []))
             for k in OP_LISTS}
    names = sorted({op for ops in lists.values() for op in ops})
    return {"amp": amp, "lists": lists, "labels": OP_LISTS, "choices": list(AMP_OPS),
            "reach": {op: ops_named(graph, op) for op in names},
            "disabled": "" if amp != "none"
            else "the op lists apply under autocast: choose AMP bf16 or fp16 under "
                                                 "Global choices first (in float32 every op "
                                                 "already runs in float32)"}


def precision_fix(fix: dict[str, Any], amp: str, which: str, op: str,
                  action: str) -> tuple[dict[str, Any], str]:
    """(the fix with ``op`` added to or removed from the list ``which``, a note): adding a name the
    other list holds moves it. ``amp``: the precision in force. Raises ValueError/PlanError, saying
    what to do, for a list or action that does not exist, a name the lists do not take, a name
    already there or absent, or lists without autocast."""
    if which not in OP_LISTS:
        raise ValueError(f"{which!r} is not an op list; choose one of {', '.join(OP_LISTS)}")
    if action not in ("add", "remove"):
        raise ValueError(f"action {action!r} unknown; choose add or remove")
    op = str(op or "").strip()
    label = OP_LISTS[which]
    if not op:
        raise ValueError(f"type an op name to {label} (e.g. softmax, layer_norm, matmul, "
                         "elementwise_add)")
    if op not in AMP_OPS:
        near = difflib.get_close_matches(op.lower(), AMP_OPS, n=4, cutoff=0.6)
        hint = f"did you mean {', '.join(near)}?" if near else ("the names it takes: "
                                                                f"{', '.join(AMP_OPS)}")
        raise PlanError(f"{op!r} is not an op name the precision lists take; {hint}")
    if amp == "none":
        raise PlanError("the op lists apply under autocast: choose AMP bf16 or fp16 under Global "
                        "choices first")
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
            raise ValueError(f"{op} is not in the list to {label}; it holds "
                             f"{', '.join(lists[which]) or 'nothing'}")
        lists[which].remove(op)
    out = {k: v for k, v in fix.items() if k not in OP_LISTS}
    out.update({k: v for k, v in lists.items() if v})
    return normalize_fix(out), note
