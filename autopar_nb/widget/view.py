"""The planner widget's graph view: the depth, collapsed groups and columns it shows (chosen to fit
the front end's viewport, or set by the user), and the view messages (select a layer, expand or
collapse a block, set the depth, open a group, back to the auto view), none of which re-plans.
"""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from .entries import ended_at_clusters, labels_moved_down, remaining
from .layout import (
    DEFAULT_VIEWPORT,
    View,
    auto_view,
    child_groups,
    fit_ratio,
    layout,
    render_svg,
    svg_size,
)


class GraphView:
    """The view handlers of :class:`~autopar_nb.widget.model.PlannerWidget`, which they are mixed
    into: they read its ``session`` and the traits ``viewport``, ``expanded`` and ``selection``, and
    leave the view to use in ``_view`` (None: choose one to fit), ``_auto`` and ``_relayout`` for
    the next ``refresh``. Each returns None (view-only)."""

    def _on_viewport(self, change) -> None:
        size = self._viewport_size()
        old = self._view_size
        if abs(size[0] - old[0]) > 0.06 * old[0] or abs(size[1] - old[1]) > 0.06 * old[1]:
            self._relayout = "full" if self._auto else "columns"
            self.refresh()

    def _viewport_size(self) -> tuple[float, float]:
        vp = self.viewport or {}
        try:
            w, h = float(vp.get("width") or 0), float(vp.get("height") or 0)
        except (TypeError, ValueError):
            w = h = 0.0
        return (w, h) if w >= 200 and h >= 150 else DEFAULT_VIEWPORT

    def _graph_view(self, plan: Plan | None, changed: set[str]):
        """(Layout, SVG) of the view in use, choosing it (or only its columns) when asked."""
        s = self.session
        kw = {"expanded": set(self.expanded), "changed_layers": changed,
              "selected": self.selection or None}
        size = self._viewport_size()
        mode = "full" if self._view is None else self._relayout
        report: dict[str, Any] = {}
        if mode == "full":
            view, lay, svg, report = auto_view(s.graph, plan, viewport=size, **kw)
        elif mode == "columns":
            view, lay, svg, report = auto_view(s.graph, plan, viewport=size, depth=self._view.depth,
                                               groups=self._view.groups, **kw)
        else:
            view = self._view
            lay = layout(s.graph, plan, depth=view.depth, groups=view.groups, breaks=view.breaks,
                         **kw)
            svg = render_svg(lay.dot)
        svg = _clear_labels(lay.dot, svg)
        # of the drawing shown
        report = {**report, "scale": round(fit_ratio(*svg_size(svg), size), 3)}
        self._view, self._relayout, self._view_size = view, None, size
        return lay, svg, report

    def _select(self, msg) -> None:
        self.selection = msg.get("layer") or ""

    def _expand(self, msg) -> None:
        self.expanded = sorted({*self.expanded, msg["block"]})
        self._relayout = "columns"  # the depth stays what it was

    def _collapse(self, msg) -> None:
        self.expanded = [b for b in self.expanded if b != msg["block"]]
        self._relayout = "columns"

    def _set_depth(self, msg) -> None:
        depth = int(msg["value"])
        if self._view is not None:
            self._view = View(depth, self._view.groups, self._view.breaks)
        else:
            self._view = View(depth)
        self._auto = False
        self._relayout = "columns"

    def _expand_group(self, msg) -> None:
        """Open a collapsed container: its sub-containers of several layers stay collapsed, its
        other layers show."""
        g = msg["group"]
        view = self._view or View(0)
        if g not in view.groups:
            raise KeyError(f"{g!r} is not a collapsed group; collapsed: "
                           f"{', '.join(sorted(view.groups)) or 'none'}")
        self._view = View(view.depth, (view.groups - {g}) | child_groups(self.session.graph, g),
                          view.breaks)
        self._auto = False
        self._relayout = "columns"

    def _auto_view(self, msg) -> None:
        self.expanded = []
        self._auto = True
        self._relayout = "full"


def _clear_labels(dot: str, svg: str) -> str:
    """``svg`` (the drawing of ``dot``) with fewer edges through cluster labels: a label a skip edge
    crosses moved to its box's bottom where that leaves fewer crossed, then each edge into or out of
    a cluster past its label ended at the cluster's border (:mod:`.entries`: the same node
    boxes)."""
    moved = labels_moved_down(dot, svg)
    if moved is not None:
        below = render_svg(moved)
        if remaining(below) < remaining(svg):
            dot, svg = moved, below
    ended = ended_at_clusters(dot, svg)
    return svg if ended is None else render_svg(ended)
