"""How two plans differ, in words: the alternatives beside the chosen plan (what differs from it,
what each trades), the changes an edit made, grouped for a reader, and the header line."""

from __future__ import annotations

import re
from typing import Any

from ..graph import ModelGraph
from ..hardware import Cluster
from ..plan import Plan
from ..units import fmt_bytes, fmt_time
from .choices import GLOBAL_NAMES


def global_choices(plan: Plan) -> dict[str, Any]:
    """The plan-wide choices that tell alternatives apart."""
    rec = sorted({lp.recompute for lp in plan.layers} - {"none"})
    return {"dp": plan.mesh.dp, "tp": plan.mesh.tp, "pp": plan.mesh.pp,
            "zero_stage": plan.mesh.zero_stage, "ep": plan.mesh.ep,
            "schedule": plan.pipeline.schedule if plan.mesh.pp > 1 else None,
            "virtual_stages": plan.pipeline.virtual_stages, "amp": plan.precision.amp,
            "sequence_parallel": any(lp.sequence_parallel for lp in plan.layers),
            "recompute": "/".join(rec) or "none", "micro_batches": plan.batch.micro_batches}


def global_differences(a: Plan, b: Plan, *, skip: tuple[str, ...] = ()) -> list[str]:
    """"ZeRO 2 → 3", "micro-batches 2 → 4": the plan-wide choices that differ from ``a`` to
    ``b``."""
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
    """The next best plans, grouped when they differ from each other only in micro-batches: per
    group, what differs from the chosen plan, what it trades (time vs memory) and, per member, its
    index (for adopting) and cost."""
    groups: dict[tuple, dict[str, Any]] = {}
    for i, alt in enumerate(plan.alternatives):
        g = global_choices(alt)
        key = tuple((k, v) for k, v in g.items() if k != "micro_batches")
        c = alt.cost
        member = {"index": i, "micro_batches": alt.batch.micro_batches,
                  "step_s": c.step_time_s if c else None,
                  "peak_bytes": c.peak_memory_bytes if c else None, "trade": trade(plan, alt)}
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
        # per variant, in words (the row's hover text); Plan.diff per alternative cost ~30 ms each
        # on a 7B graph
        lines = [f"{m['micro_batches']} micro-batches: {fmt_time(m['step_s'])}/step, peak "
                 f"{fmt_bytes(m['peak_bytes'])} ({m['trade']})" for m in members]
        rows.append({"index": best["index"], "summary": grp["summary"], "members": members,
                     "differs": differs or ["the same choices, placed differently"],
                     "trade": best["trade"], "step_s": best["step_s"],
                     "peak_bytes": best["peak_bytes"], "micro_batches_only": not grp["differs"],
                     "changes": [grp["summary"], *lines]})
    return rows


def adopt_fix(alt: Plan) -> dict[str, Any]:
    """The global choices that pin ``alt``'s shape, for ``Session.replan(fix=...)`` (what pinning an
    alternative would take; the widget's Adopt does not pin, see ``Session.adopt``)."""
    fix = {"dp": alt.mesh.dp, "tp": alt.mesh.tp, "pp": alt.mesh.pp,
           "zero_stage": alt.mesh.zero_stage, "micro_batches": alt.batch.micro_batches,
           "amp": alt.precision.amp}
    if alt.mesh.pp > 1:
        fix["schedule"] = alt.pipeline.schedule
        fix["virtual_stages"] = alt.pipeline.virtual_stages
    return fix


# ---- what changed, in words ----------------------------------------------------------------------
_LAYER_CHANGE = re.compile(r"layers\[(?P<layer>.+?)\]\.(?P<field>\w+)(?:\.(?P<module>.+))?$")
_GLOBAL_NAMES = {"mesh.dp": "dp", "mesh.tp": "tp", "mesh.pp": "pp", "mesh.ep": "ep",
                 "mesh.zero_stage": "ZeRO", "batch.micro_batches": "micro-batches",
                 "batch.global_batch": "global batch", "pipeline.schedule": "schedule",
                 "pipeline.virtual_stages": "virtual stages", "precision.amp": "AMP",
                 "precision.param_dtype": "parameter dtype",
                 "precision.reduce_dtype": "reduce dtype", "loss_parallel": "loss parallel",
                 "sync_batchnorm": "SyncBatchNorm"}
_FIELD_NAMES = {"tp": "tp", "stage": "stage", "recompute": "recompute", "fsdp": "own FSDP unit",
                "sequence_parallel": "sequence parallel", "tp_parts": "TP parts",
                "pinned": "pinned"}


def name_layers(graph: ModelGraph, paths) -> str:
    """"h.1, h.2", "h.0–11", "32 layers (layers.0–31)", in model order with runs of a block's
    members as ranges."""
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
    """The changes of ``Plan.diff`` grouped for a reader: one line per global choice ("tp: 1 → 2"),
    and per (field, old → new) over layers: "tp: replicate → colwise on 224 modules in 32 layers
    (wq, wk, wv, w1, w3)". Each group: {text, count (raw changes), layers}."""
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
            added, removed = (sorted(set(new or []) - set(old or [])),
                              sorted(set(old or []) - set(new or [])))
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
            what = " and ".join(x for x in (f"pinned {new}" if new else "",
                                            f"un-pinned {old}" if old else "") if x)
            text = f"{what} on {where}"
        elif field == "tp_parts":
            text = (f"TP layout of fused projections changed on {len(g['modules'])} module(s) in "
                    f"{where}")
        elif g["modules"]:
            short = list(dict.fromkeys(mod.rsplit(".", 1)[-1] for mod in g["modules"]))
            mods = ", ".join(short[:5]) + ("…" if len(short) > 5 else "")
            n = len(g["modules"])
            text = (f"{_FIELD_NAMES.get(field, field)}: {old} → {new} on {n} "
                    f"module{'s' if n > 1 else ''} in {where} ({mods})")
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
    """The header line: the plan's shape, step time and peak memory against one rank's limit (the
    memory panel's)."""
    shape = plan.summary().split(" | ")[0]
    if plan.cost is None:
        return shape
    limit = f" of {fmt_bytes(cluster.rank_memory_bytes)}" if cluster is not None else ""
    return (f"{shape} | {fmt_time(plan.cost.step_time_s)}/step, peak "
            f"{fmt_bytes(plan.cost.peak_memory_bytes)}{limit}")
