"""Groups: containers of several layers (a ResNet stage) that the graph view can draw as one node
each, the ways to collapse them, coarsest first, and the node that stands for one.
"""

from __future__ import annotations

from collections import Counter

from ..graph import ModelGraph
from ..plan import within
from ..units import fmt_count
from .editor import STRATEGY_LABELS
from .splits import CHANGED_COLOR, STAGE_COLORS, STRATEGY_SPLITS, fill, layer_strategy
from .svg import dot_string as _q


def group_levels(graph: ModelGraph) -> list[frozenset[str]]:
    """Ways to collapse containers, coarsest first: at cut ``d`` every run of two or more
    consecutive layers whose paths share their first ``d`` names (and are longer than that) becomes
    one group. Levels that leave fewer than 3 elements, or that equal a finer one, are left out; the
    finest (no groups) is not listed."""
    deepest = max((len(lay.path.split(".")) for lay in graph.layers), default=1)
    out: list[frozenset[str]] = []
    for d in range(1, deepest):
        groups: list[str] = []
        runs: list[int] = []
        for lay in graph.layers:
            parts = lay.path.split(".")
            key = ".".join(parts[:d]) if len(parts) > d else None
            if key is not None and groups and groups[-1] == key:
                runs[-1] += 1
            else:
                groups.append(key)
                runs.append(1)
        chosen = frozenset(g for g, n in zip(groups, runs, strict=True) if g is not None and n >= 2)
        if chosen and len(groups) >= 3 and chosen not in out:
            out.append(chosen)
    return out


def child_groups(graph: ModelGraph, group: str) -> frozenset[str]:
    """The containers one level below ``group`` that hold two or more of its layers (what expanding
    it shows)."""
    depth = len(group.split("."))
    inside = [lay.path for lay in graph.layers if lay.path != group and within(lay.path, group)]
    counts = Counter(".".join(p.split(".")[:depth + 1]) for p in inside if len(p.split(".")) > depth
                     + 1)
    return frozenset(g for g, n in counts.items() if n >= 2)


def group_of(path: str, groups: frozenset[str]) -> str | None:
    best = None
    for g in groups:
        if path != g and within(path, g) and (best is None or len(g) < len(best)):
            best = g
    return best


def emit_group(lines, info, graph, plan, g, gid, glayers, acc, stage, pipelined, changed_layers,
               selected) -> None:
    """One node standing for the container ``g`` and its layers ``glayers``."""
    with_params = [lay for lay in glayers if lay.num_params]
    strategies = [layer_strategy(graph, plan, lay.path) for lay in with_params]
    splits = ([s for st in strategies for s in STRATEGY_SPLITS.get(st, ("replicated",))]
              or ["activation"])
    color_fill, tag, distinct = fill(splits)
    stages = sorted({stage.get(lay.path, 0) for lay in glayers})
    types = Counter(lay.type for lay in glayers)
    blocks = sorted({b.name for lay in glayers if (b := graph.block_of(lay.path))})
    params = sum(lay.num_params for lay in glayers)
    parts = g.split(".")
    k = len(parts)
    while k > 1 and len(".".join(parts[-k:])) > 28:
        k -= 1
    name = ".".join(parts[-k:])
    what = f"{len(glayers)} layers" + (f" · {fmt_count(params)} params" if params else "")
    label = f"{name}\n{what}{' · ' + tag if tag else ''}"
    strat = Counter(STRATEGY_LABELS.get(s, s) for s in strategies)
    differs = ", ".join(f"{n} {k}" for k, n in strat.most_common()) if len(strat) > 1 else ""
    if pipelined:
        label += f"\nstage {stages[0]}" if len(stages) == 1 else ("\nstages "
                                                                  f"{stages[0]}–{stages[-1]}")
    changed = any(lay.path in changed_layers for lay in glayers)
    st = stages[0]
    color = CHANGED_COLOR if changed else STAGE_COLORS[st % len(STAGE_COLORS)]
    style = "rounded,filled,dashed" if changed else "rounded,filled"
    width = 3 if changed or any(lay.path == selected for lay in glayers) else 2
    lines.append(f"  {_q(gid)} [id={_q(gid)}, label={_q(label)}, fillcolor={_q(color_fill)}, "
                 f"color={_q(color)}, penwidth={width}, style={_q(style)}, margin=\"0.12,0.06\"];")
    info[gid] = {"kind": "group", "label": g, "layer": glayers[0].path, "module": g, "group": g,
                 "layers": [lay.path for lay in glayers],
                 "types": ", ".join(f"{t} × {n}" if n > 1 else t for t, n in types.most_common(4)),
                 "blocks": blocks, "params": params, "flops": acc.get("flops", 0.0),
                 "flops_each": acc.get("flops", 0.0),
                 "param_bytes": sum(lay.param_bytes for lay in glayers), "ops": acc.get("ops", 0),
                 "split": distinct[0], "splits": distinct, "members": differs, "stage": st,
                 "stages": stages, "repeats": 1,
                 "target": {"pattern": f"{g}.*", "layers": [lay.path for lay in glayers]}}
