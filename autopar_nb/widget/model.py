"""PlannerWidget: the anywidget that shows a Session's plan and turns front-end edits into session
calls.

The widget declares state (synced traits) and holds no planning logic: every edit becomes
``session.override(...)`` or ``session.replan(...)``, and the traits are recomputed from the session
afterwards. The session notifies the widget after every replan/undo/redo, so calls made in code
(``ap.override(...)`` in another cell) show up here too.
"""

from __future__ import annotations

import re
import time
from typing import Any

import anywidget
import traitlets as t

from ..launch.dashboard import SHARED_JS, STATIC, UPLOT, bundle
from ..plan import Plan, PlanError
from ..units import fmt_time
from . import editor, lever_rows, measured, options, panels, timeline
from .actions import calibrated_badge, local_nproc
from .choices import global_state, precision_state
from .describe import describe
from .differences import alternative_rows, change_groups, global_differences, plan_summary
from .edits import Edits
from .layout import DEFAULT_VIEWPORT, LEGIBLE_SCALE, View, layout
from .runs import Runs
from .view import GraphView

ACTIONS = ("verify", "export", "launch", "tournament")


class PlannerWidget(Edits, GraphView, Runs, anywidget.AnyWidget):
    """The planner view of one :class:`~autopar_nb.notebook.session.Session` (``ap.widget()``; the
    magic's output).

    Everything it does is also a Python call on the session: a strategy pick or a drag on the
    sharding board is ``ap.override(layers, tp=...)``, a drag between pipeline lanes
    ``ap.override(layer, stage=...)``, a global control ``ap.replan(fix={...})``, Adopt
    ``ap.adopt(i)``, undo/redo ``ap.undo()``/``ap.redo()``. ``handle(msg)`` applies one front-end
    message (see ``_HANDLERS``).
    """

    _esm = bundle(*SHARED_JS, STATIC / "timeline.js", STATIC / "planner.js")
    _css = bundle(UPLOT / "uPlot.min.css", STATIC / "planner.css")

    svg = t.Unicode("").tag(sync=True)
    """the graph view, laid out by graphviz"""
    nodes = t.Dict().tag(sync=True)
    """SVG node id -> hover/click/drag data (op, shapes, FLOPs, memory, layer, split, target)"""
    clusters = t.Dict().tag(sync=True)
    """SVG cluster id -> {layer, block, label, expandable, collapsible, differs, target}"""
    legend = t.List().tag(sync=True)
    depth = t.Int(0).tag(sync=True)
    max_depth = t.Int(0).tag(sync=True)
    expanded = t.List().tag(sync=True)
    """repeated blocks shown in full"""
    view = t.Dict().tag(sync=True)
    """how the graph is shown: {depth, groups, breaks (columns), auto (chosen to fit), scale (fit /
    legible)}"""
    viewport = t.Dict().tag(sync=True)
    """the graph viewport's size in CSS px, written by the front end: {width, height} (the auto view
    fits it)"""
    layers = t.List().tag(sync=True)
    """the editor table: one row per layer (see editor.layer_rows)"""
    board = t.Dict().tag(sync=True)
    """the sharding board: lanes (splits the planner can run here), chips (layers), refusals
    (editor.sharding_board)"""
    stages = t.List().tag(sync=True)
    """pipeline lanes: [{index, layers, rank, chunk, label}]"""
    memory = t.Dict().tag(sync=True)
    time = t.Dict().tag(sync=True)
    components = t.Dict().tag(sync=True)
    """the peak rank's named memory components with their sources (panels.memory_components)"""
    timeline = t.Dict().tag(sync=True)
    """each pipeline rank's predicted memory over the moments of one step (widget/timeline.py)"""
    measured = t.Dict().tag(sync=True)
    """what the latest launched run of the plan shown measured, beside the prediction ({} before:
    measured.py)"""
    controls = t.Dict().tag(sync=True)
    """global controls: cluster, mesh degrees (fixed or auto), micro-batches, schedule, ZeRO, AMP,
    and the options the planner cannot take with the other choices (``disabled``)"""
    precision = t.Dict().tag(sync=True)
    """the precision editor: the op lists kept in float32 / run in low precision
    (``choices.precision_state``)"""
    summary = t.Unicode("").tag(sync=True)
    explanation = t.List().tag(sync=True)
    messages = t.List().tag(sync=True)
    """[{level: "error"|"warning"|"info", text, detail}] shown inline; an error keeps the last valid
    plan, a warning says the action ran something other than the plan as made (another process
    count)"""
    selection = t.Unicode("").tag(sync=True)
    """the selected layer path"""
    changed = t.List().tag(sync=True)
    """layer paths that changed against the previous plan"""
    changes = t.List().tag(sync=True)
    """every change against the previous plan, as text (behind a disclosure)"""
    change_groups = t.List().tag(sync=True)
    """the same changes grouped for a reader (differences.change_groups): [{text, count, layers}]"""
    alternatives = t.List().tag(sync=True)
    # lever_rows.lever_rows: each lever flipped alone, shown under the alternatives
    levers = t.List().tag(sync=True)
    can_undo = t.Bool(False).tag(sync=True)
    can_redo = t.Bool(False).tag(sync=True)
    actions = t.List().tag(sync=True)
    """the session methods offered as buttons (only those the session has)"""
    timings = t.Dict().tag(sync=True)
    """milliseconds: layout, render, replan (the last edit's planner time)"""
    run_options = t.Dict({"nproc": None, "verify_steps": 5, "launch_steps": 50, "tournament_k": 4,
                          "tournament_steps": 20}).tag(sync=True)
    """the Verify/Launch/Tournament inputs, written by the front end: processes (None:
    ``run_defaults``), steps, the tournament's alternatives"""
    run_defaults = t.Dict().tag(sync=True)
    """{"nproc": processes this machine runs the plan on (local_nproc)}"""
    panel = anywidget.WidgetTrait().tag(sync=True)
    """the last Launch's live dashboard, below the planner"""
    verify_panel = anywidget.WidgetTrait().tag(sync=True)
    """the last Verify's progress, below the dashboard: a Verify does not take a run's place"""
    tournament_panel = anywidget.WidgetTrait().tag(sync=True)
    """the last Tournament's progress and standings, below the others"""
    calibrated = t.Dict().tag(sync=True)
    """{text: "calibrated on <date> from N runs", title} when the session plans with measured
    step-time factors"""
    revision = t.Int(0).tag(sync=True)
    """incremented on every refresh"""

    def __init__(self, session, **kwargs):
        super().__init__(**kwargs)
        self.session = session
        self._shown: Plan | None = session.plan
        self._previous: Plan | None = None
        self._view: View | None = None
        """the graph view in use (None: choose one to fit the viewport)"""
        self._auto = True
        """the view is the auto view (re-chosen when the viewport changes); False once the user set
        the depth"""
        self._relayout: str | None = None
        """"full" (choose depth, groups and columns) or "columns" (keep depth and groups) at the
        next refresh"""
        self._view_size: tuple[float, float] = DEFAULT_VIEWPORT
        self._refusal_cache: tuple[Any, dict] | None = None
        self._refresh_ms = 0.0
        self.last_result: Any = None
        """what the last Verify/Export/Launch button returned (a VerifyReport, Exported, Run)"""
        self._replan_ms: float | None = None
        self._runs: list = []
        """the launched runs this widget follows (measured.FOLLOWED latest): their figures sit
        beside the plan's"""
        self._measured_at = 0.0
        self._jobs: dict[str, Any] = {}
        """the last background Verify and Tournament: while one runs, the buttons that would share
        the machine are refused"""
        self.on_msg(self._on_msg)
        self.observe(self._on_viewport, names="viewport")
        observers = getattr(session, "_observers", None)
        if observers is not None:
            observers.append(self._on_session_change)
        error = None
        # a planner view needs a plan: make the first one (ImportError: no planner)
        if session.plan is None:
            try:
                session.replan()
            except PlanError as e:
                error = (f"no plan fits the constraints: {e}. Change them (ap.replan(fix=..., "
                         "overrides=...)).")
            except ImportError:
                raise
            # shown in the widget rather than lost in a display formatter's traceback
            except Exception as e:
                error = f"the planner failed: {type(e).__name__}: {e}"
        self._shown = session.plan
        self.refresh()
        if error:
            self._say("error", error)

    def close(self) -> None:
        """Close the widget and stop following the session (``ap.widget()`` then makes a new
        one)."""
        observers = getattr(self.session, "_observers", [])
        if self._on_session_change in observers:
            observers.remove(self._on_session_change)
        if getattr(self.session, "_widget", None) is self:
            self.session._widget = None
        super().close()

    # ---- session -> traits -----------------------------------------------------------------------
    def _on_session_change(self, session) -> None:
        # about a plan no longer shown (an edit made here says what it did right after)
        self.messages = []
        self.refresh()

    def refresh(self) -> None:
        """Recompute every trait from the session (the plan shown, the previous one for highlights,
        the view)."""
        t_start = time.perf_counter()
        s = self.session
        if s.plan is not self._shown:
            self._previous, self._shown = self._shown, s.plan
        plan, prev = s.plan, self._previous
        changes = prev.diff(plan) if (prev is not None and plan is not None) else []
        changed = sorted({m.group(1) for c in changes
                          if (m := re.match(r"layers\[(.+?)\]", c.path))})
        # outlines mark what an edit touched; when most layers changed (tp 1 -> 8) they would mark
        # everything
        outlined = set(changed) if len(changed) <= max(3, len(s.graph.layers) // 2) else set()
        t0 = time.perf_counter()
        try:
            lay, svg, report = self._graph_view(plan, outlined)
        except Exception as e:  # no layout program: the editor and panels still work
            lay = layout(s.graph, plan, expanded=set(self.expanded), depth=0)
            svg, report = f"<p class='ap-error'>graph view unavailable: {e}</p>", {}
            self._view = self._view or View(0)
        t1 = time.perf_counter()
        if plan is not None:
            editor.annotate_targets(s.graph, lay.nodes, lay.clusters, plan, s.fix, s.cluster)
        with self.hold_sync():
            self.svg, self.nodes, self.clusters, self.legend = (svg, lay.nodes, lay.clusters,
                                                                lay.legend)
            self.depth, self.max_depth = lay.depth, lay.max_depth
            v = self._view
            self.view = {"depth": v.depth, "groups": sorted(v.groups), "breaks": list(v.breaks),
                         "columns": len(v.breaks) + 1, "auto": self._auto,
                         "scale": report.get("scale"), "legible": LEGIBLE_SCALE,
                         "outlined": bool(outlined) or not changed}
            self.memory = panels.memory_panel(plan, s.cluster)
            self.time = panels.time_panel(plan)
            self.components = panels.memory_components(plan, s.cluster)
            seen = getattr(s, "measured_timelines", None)
            self.timeline = timeline.timeline_panel(s.graph, plan, s.cluster,
                                                    measured=seen[1] if seen and seen[0] is plan
                                                    else None)
            self.measured = measured.measured_panel(plan, self._runs)
            self.controls = global_state(s.cluster, plan, s.fix, disabled=self._option_refusals())
            self.precision = precision_state(s.graph, plan, s.fix)
            if plan is not None:
                self.layers = editor.layer_rows(s.graph, plan, s.overrides, set(changed))
                self.board = editor.sharding_board(s.graph, plan, s.overrides, s.fix, s.cluster,
                                                   set(changed))
                self.stages = editor.stage_lanes(plan)
                self.alternatives, self.levers = alternative_rows(plan), lever_rows.lever_rows(plan)
                self.summary, self.explanation = (plan_summary(plan, s.cluster),
                                                  list(plan.explanation))
            else:
                (self.layers, self.stages, self.alternatives, self.levers,
                 self.board) = [], [], [], [], {}
                self.summary, self.explanation = "no plan yet: call ap.replan()", []
            self.changed, self.changes = changed, [str(c) for c in changes]
            self.change_groups = change_groups(s.graph, changes)
            self.can_undo, self.can_redo = (bool(getattr(s, "_undo", None)),
                                            bool(getattr(s, "_redo", None)))
            self.actions = [a for a in ACTIONS if callable(getattr(s, a, None))]
            self.run_defaults = {"nproc": local_nproc(plan)} if plan is not None else {}
            self.calibrated = calibrated_badge(s.cluster)
            self._refresh_ms = (time.perf_counter() - t_start) * 1e3
            self.timings = {"layout_ms": (t1 - t0) * 1e3, "render_ms": 0.0,
                            "refresh_ms": self._refresh_ms, "replan_ms": self._replan_ms}
            self.revision += 1

    def _option_refusals(self) -> dict[str, dict[str, str]]:
        s = self.session
        key = (s.cluster, repr(sorted(s.fix.items())), repr(s.overrides), s.batch)
        if self._refusal_cache is None or self._refusal_cache[0] != key:
            try:
                found = options.option_refusals(s.graph, s.cluster, s.fix, s.overrides, s.batch)
            except Exception:  # the controls still work; the planner says why when an edit fails
                found = {}
            self._refusal_cache = (key, found)
        return self._refusal_cache[1]

    # ---- front end -> session --------------------------------------------------------------------
    def _on_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and "kind" in content:
            self.handle(content)

    def handle(self, msg: dict[str, Any]) -> None:
        """Apply one front-end message, e.g. ``{"kind": "strategy", "layer": "h.0", "value":
        "colwise-rowwise"}``.

        A rejected edit (PlanError: infeasible or invalid) leaves the session's constraints and plan
        as they were and shows the planner's reason inline; every control is redrawn from the plan
        in force."""
        kind = msg.get("kind")
        fn = _HANDLERS.get(kind)
        if fn is None:
            self._say("error", f"unknown widget message {kind!r}")
            return
        # the new plan, its timings and the message reach the front end together
        with self.hold_sync():
            before, plan_before = self.revision, self.session.plan
            t0 = time.perf_counter()
            self._refresh_ms = 0.0
            try:
                code = fn(self, msg)
            except (PlanError, ValueError, KeyError, IndexError, TypeError) as e:
                text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
                self._say("error", f"{describe(msg)} was not applied: {text}. The previous plan is "
                                   f"kept; undo/redo and your other choices are unchanged.")
                return
            if code is None:  # view-only message
                if self.revision == before:
                    self.refresh()
                return
            elapsed = (time.perf_counter() - t0) * 1e3
            if self.revision == before:  # a session without observers
                self.refresh()
            self._replan_ms = max(0.0, elapsed - self._refresh_ms)
            self.timings = {**self.timings, "replan_ms": self._replan_ms}
            note = ""
            if kind in _LAYER_EDITS and plan_before is not None and self.session.plan is not None:
                moved = global_differences(plan_before, self.session.plan)
                if moved:
                    note = (f" The planner also changed {', '.join(moved)} to make it work (undo "
                            "restores both; fix them under Global choices to keep them).")
            if isinstance(code, tuple):
                code, extra = code
                note = extra + note
            n = len(self.change_groups)
            took = fmt_time(self._replan_ms / 1e3)
            done = "adopted, nothing re-planned" if kind == "adopt" else f"re-planned in {took}"
            self._say("info", f"{describe(msg)}: {done} ({n} change{'s' if n != 1 else ''}).{note} "
                              f"As code: {code}")

    def _say(self, level: str, text: str, detail: str = "") -> None:
        self.messages = [{"level": level, "text": text, "detail": detail}]


_HANDLERS = {
    "strategy": PlannerWidget._strategy, "shard": PlannerWidget._shard,
    "recompute": PlannerWidget._recompute, "unpin": PlannerWidget._unpin,
    "stage": PlannerWidget._stage, "boundary": PlannerWidget._boundary,
    "global": PlannerWidget._global, "precision": PlannerWidget._precision,
    "cluster": PlannerWidget._cluster, "adopt": PlannerWidget._adopt, "undo": PlannerWidget._undo,
    "redo": PlannerWidget._redo, "action": PlannerWidget._action, "select": PlannerWidget._select,
    "expand": PlannerWidget._expand, "collapse": PlannerWidget._collapse,
    "depth": PlannerWidget._set_depth, "expand_group": PlannerWidget._expand_group,
    "auto_view": PlannerWidget._auto_view,}
_LAYER_EDITS = {"strategy", "shard", "recompute", "unpin", "stage", "boundary"}
"""edits of layers: a change of a global choice they cause is said in the message"""
