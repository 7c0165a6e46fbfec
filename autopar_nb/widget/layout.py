"""ModelGraph + Plan -> DOT -> SVG: the graph view of the planner widget, and the view that fits.

How much is shown is a :class:`View` (module depth below each layer, collapsed groups, column
breaks). :func:`auto_view` picks the most detailed view whose SVG fits the widget's viewport with
every label at least 9 px on screen: it tries group levels and depths from the finest down, and
wraps the sequence of layers into columns when that lets a tall, narrow graph fit a wide panel.

The drawing itself is :func:`~autopar_nb.widget.dot.layout` (``dot.py``), with the plan's splits and
collectives (``splits.py``) and the groups of layers (``groups.py``); ``svg.py`` renders the DOT and
measures the SVG. Their public names are importable from here, as the widget and the tests do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..graph import ModelGraph
from ..plan import Plan
from .dot import Layout, layout
from .groups import child_groups, group_levels
from .splits import (
    CHANGED_COLOR,
    COLLECTIVE_COLOR,
    LEGEND_STRATEGY,
    OUTPUT,
    SPLIT_PRIORITY,
    SPLIT_TAGS,
    SPLITS,
    STAGE_COLORS,
    STAGE_FILLS,
    STRATEGY_SPLITS,
    comm_edges,
    layer_strategy,
    split_of,
)
from .svg import (
    CLUSTER_FONT,
    EDGE_FONT,
    LEGIBLE_SCALE,
    NODE_FONT,
    dot_binary,
    fit_ratio,
    render_svg,
    svg_boxes,
    svg_size,
)
from .visible import MAX_OPS_SHOWN

__all__ = ["CHANGED_COLOR", "CLUSTER_FONT", "COLLECTIVE_COLOR", "DEFAULT_VIEWPORT", "EDGE_FONT",
           "LEGEND_STRATEGY", "LEGIBLE_SCALE", "MAX_OPS_SHOWN", "NODE_FONT", "OUTPUT", "SPLITS",
           "SPLIT_PRIORITY", "SPLIT_TAGS", "STAGE_COLORS", "STAGE_FILLS", "STRATEGY_SPLITS",
           "Layout", "View", "auto_view", "child_groups", "choose_breaks", "comm_edges",
           "dot_binary", "fit_ratio", "group_levels", "layer_strategy", "layout", "render_svg",
           "split_of", "svg_boxes", "svg_size"]

DEFAULT_VIEWPORT = (820, 600)
"""CSS px of the graph viewport before the front end has reported its own"""


@dataclass(frozen=True)
class View:
    """How much of the graph is shown: module ``depth`` below each layer (0 = one node per layer),
    container ``groups`` collapsed into one node each, and the elements (layer or group keys) that
    start a new column."""

    depth: int
    groups: frozenset[str] = frozenset()
    breaks: tuple[str, ...] = ()


def choose_breaks(lay: Layout, svg: str,
                  viewport: tuple[float, float]) -> tuple[tuple[str, ...], float]:
    """Column breaks for ``lay`` (measured in its one-column ``svg``) that let it fit ``viewport``
    (CSS px) at the largest scale, and that scale relative to the legible one (>= 1: every label >=
    9 px with the whole graph in view)."""
    w, h = svg_size(svg)
    best = ((), fit_ratio(w, h, viewport))
    boxes = svg_boxes(svg)
    elems = [(e["key"], boxes[e["box"]]) for e in lay.elements if e["box"] in boxes]
    if len(elems) < 2 or best[1] >= 1:
        return best
    gap = 0.3 * 72 + 8
    heights = [b[3] - b[1] + gap for _, b in elems]
    widths = [b[2] - b[0] for _, b in elems]
    extra = max(0.0, h - sum(heights))  # inputs above, output below
    for cols in range(2, min(8, len(elems)) + 1):
        cuts = _partition(heights, cols)
        if cuts is None:
            continue
        spans = list(zip([0, *cuts], [*cuts, len(elems)], strict=True))
        col_h = max(sum(heights[a:b]) for a, b in spans) + extra
        col_w = sum(max(widths[a:b]) for a, b in spans) + 30 * (len(spans) - 1) + 40
        scale = fit_ratio(col_w, col_h, viewport)
        if scale > best[1] * 1.05:
            best = (tuple(elems[c][0] for c in cuts), scale)
    return best


def _partition(heights: list[float], cols: int) -> list[int] | None:
    """Start indices of columns 2.. that minimise the tallest of ``cols`` contiguous columns
    (bisection on the cap with a greedy fill)."""
    lo, hi = max(heights), sum(heights)
    best = None
    for _ in range(40):
        cap = (lo + hi) / 2
        cuts, acc = [], 0.0
        for i, x in enumerate(heights):
            if acc + x > cap and acc > 0:
                cuts.append(i)
                acc = 0.0
            acc += x
        if len(cuts) <= cols - 1:
            best, hi = cuts, cap
        else:
            lo = cap
    if best is None or len(best) != cols - 1:
        return None
    return best


def auto_view(graph: ModelGraph, plan: Plan | None, *,
              viewport: tuple[float, float] = DEFAULT_VIEWPORT,
              expanded: set[str] | frozenset[str] = frozenset(), depth: int | None = None,
              groups: frozenset[str] | None = None, **kw) -> tuple[View, Layout, str,
                                                                   dict[str, Any]]:
    """The most detailed view that fits ``viewport`` legibly, its layout and SVG, and a report
    ({"tried": [...], "scale": fit scale / legible scale}). With ``depth`` (and ``groups``) given,
    only the columns are chosen."""
    if depth is not None:
        candidates = [(depth, frozenset(groups or ()))]
    else:
        levels = group_levels(graph)
        full = layout(graph, None, expanded=expanded).max_depth
        candidates = [(0, g) for g in levels] + [(d, frozenset()) for d in range(0, full + 1)]
    area = viewport[0] * viewport[1] * (0.75 / LEGIBLE_SCALE) ** 2  # pt² the graph may take
    tried: list[dict[str, Any]] = []
    cache: dict[int, tuple] = {}

    def attempt(i: int):
        if i in cache:
            return cache[i]
        d, g = candidates[i]
        lay = layout(graph, plan, expanded=expanded, depth=d, groups=g, **kw)
        if len(lay.nodes) * 2600 > area * 1.5 and len(candidates) > 1 and i > 0:
            cache[i] = (lay, None, (), 0.0)  # cannot fit legibly: not worth laying out
        else:
            svg = render_svg(lay.dot)
            breaks, scale = choose_breaks(lay, svg, viewport)
            cache[i] = (lay, svg, breaks, scale)
        tried.append({"depth": d, "groups": len(g), "nodes": len(lay.nodes),
                      "scale": round(cache[i][3], 3)})
        return cache[i]

    chosen = len(candidates) - 1
    if attempt(chosen)[3] < 1 and chosen > 0:
        # the finest candidate that fits (the fit shrinks as detail grows), else the coarsest
        lo, hi, chosen = 0, chosen - 1, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if attempt(mid)[3] >= 1:
                chosen, lo = mid, mid + 1
            else:
                hi = mid - 1
    # columns are predicted from the one-column boxes: check, else go coarser
    for i in range(chosen, -1, -1):
        d, g = candidates[i]
        lay, svg, breaks, scale = attempt(i)
        if svg is None:
            svg = render_svg(lay.dot)
            breaks, scale = choose_breaks(lay, svg, viewport)
        if breaks:
            lay = layout(graph, plan, expanded=expanded, depth=d, groups=g, breaks=breaks, **kw)
            svg = render_svg(lay.dot)
            scale = fit_ratio(*svg_size(svg), viewport)
        if scale >= 1 or i < chosen or cache[i][3] < 1:
            break
    return View(lay.depth, g, tuple(breaks)), lay, svg, {"tried": tried, "scale": round(scale, 3)}
