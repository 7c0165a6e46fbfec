"""PlannerWidget: the anywidget that shows a Session's plan and turns front-end edits into session calls.

The widget declares state (synced traits) and holds no planning logic: every edit becomes ``session.override(...)``
or ``session.replan(...)``, and the traits are recomputed from the session afterwards. The session notifies the widget
after every replan/undo/redo, so calls made in code (``ap.override(...)`` in another cell) show up here too.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets as t

from ..hardware import Cluster
from ..plan import Plan, PlanError
from . import editor, panels
from .layout import layout, render_svg

STATIC = Path(__file__).resolve().parent.parent / "static"
ACTIONS = ("verify", "export", "launch")


class PlannerWidget(anywidget.AnyWidget):
    """The planner view of one :class:`~autopar_nb.session.Session` (``ap.widget()``; the magic's output).

    Everything it does is also a Python call on the session: a strategy pick is ``ap.override(layer, tp=...)``,
    a drag between pipeline lanes ``ap.override(layer, stage=...)``, a global control ``ap.replan(fix={...})``,
    undo/redo ``ap.undo()``/``ap.redo()``. ``handle(msg)`` applies one front-end message (see ``_HANDLERS``).
    """

    _esm = STATIC / "planner.js"
    _css = STATIC / "planner.css"

    svg = t.Unicode("").tag(sync=True)
    """the graph view, laid out by graphviz"""
    nodes = t.Dict().tag(sync=True)
    """SVG node id -> hover/click data (op, shapes, FLOPs, memory, layer, split)"""
    clusters = t.Dict().tag(sync=True)
    """SVG cluster id -> {layer, block, label, expandable, collapsible}"""
    legend = t.List().tag(sync=True)
    depth = t.Int(0).tag(sync=True)
    max_depth = t.Int(0).tag(sync=True)
    expanded = t.List().tag(sync=True)
    """repeated blocks shown in full"""
    layers = t.List().tag(sync=True)
    """the editor table: one row per layer (see editor.layer_rows)"""
    stages = t.List().tag(sync=True)
    """pipeline lanes: [{index, layers}]"""
    memory = t.Dict().tag(sync=True)
    time = t.Dict().tag(sync=True)
    controls = t.Dict().tag(sync=True)
    """global controls: cluster, mesh degrees (fixed or auto), micro-batches, schedule, ZeRO, AMP"""
    summary = t.Unicode("").tag(sync=True)
    explanation = t.List().tag(sync=True)
    messages = t.List().tag(sync=True)
    """[{level: "error"|"info", text}] shown inline; an error keeps the last valid plan"""
    selection = t.Unicode("").tag(sync=True)
    """the selected layer path"""
    changed = t.List().tag(sync=True)
    """layer paths that changed against the previous plan"""
    changes = t.List().tag(sync=True)
    """every change against the previous plan, as text"""
    alternatives = t.List().tag(sync=True)
    can_undo = t.Bool(False).tag(sync=True)
    can_redo = t.Bool(False).tag(sync=True)
    actions = t.List().tag(sync=True)
    """the session methods offered as buttons (only those the session has)"""
    timings = t.Dict().tag(sync=True)
    """milliseconds: layout, render, replan (the last edit)"""
    run_options = t.Dict({"nproc": None, "verify_steps": 5, "launch_steps": 50}).tag(sync=True)
    """the Verify/Launch inputs, written by the front end: processes (None: ``run_defaults``) and steps"""
    run_defaults = t.Dict().tag(sync=True)
    """{"nproc": processes this machine runs the plan on (local_nproc)}"""
    panel = anywidget.WidgetTrait().tag(sync=True)
    """the live view below the planner: the last Launch's dashboard or the last Verify's progress"""
    revision = t.Int(0).tag(sync=True)
    """incremented on every refresh"""

    def __init__(self, session, **kwargs):
        super().__init__(**kwargs)
        self.session = session
        self._shown: Plan | None = session.plan
        self._previous: Plan | None = None
        self._depth: int | None = None
        self.last_result: Any = None
        """what the last Verify/Export/Launch button returned (a VerifyReport, Exported, Run)"""
        self._replan_ms: float | None = None
        self.on_msg(self._on_msg)
        observers = getattr(session, "_observers", None)
        if observers is not None:
            observers.append(self._on_session_change)
        error = None
        if session.plan is None:  # a planner view needs a plan: make the first one (ImportError: no planner)
            try:
                session.replan()
            except PlanError as e:
                error = f"no plan fits the constraints: {e}. Change them (ap.replan(fix=..., overrides=...))."
            except ImportError:
                raise
            except Exception as e:  # shown in the widget rather than lost in a display formatter's traceback
                error = f"the planner failed: {type(e).__name__}: {e}"
        self._shown = session.plan
        self.refresh()
        if error:
            self._say("error", error)

    def close(self) -> None:
        """Close the widget and stop following the session (``ap.widget()`` then makes a new one)."""
        observers = getattr(self.session, "_observers", [])
        if self._on_session_change in observers:
            observers.remove(self._on_session_change)
        if getattr(self.session, "_widget", None) is self:
            self.session._widget = None
        super().close()

    # ---- session -> traits --------------------------------------------------------------------------------------
    def _on_session_change(self, session) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Recompute every trait from the session (the plan shown, the previous one for highlights, the view)."""
        s = self.session
        if s.plan is not self._shown:
            self._previous, self._shown = self._shown, s.plan
        plan, prev = s.plan, self._previous
        changes = prev.diff(plan) if (prev is not None and plan is not None) else []
        changed = sorted({m.group(1) for c in changes if (m := re.match(r"layers\[(.+?)\]", c.path))})
        t0 = time.perf_counter()
        lay = layout(s.graph, plan, expanded=set(self.expanded), depth=self._depth, changed_layers=set(changed),
                     selected=self.selection or None)
        t1 = time.perf_counter()
        try:
            svg = render_svg(lay.dot)
        except Exception as e:  # no layout program: the editor and panels still work
            svg = f"<p class='ap-error'>graph view unavailable: {e}</p>"
        t2 = time.perf_counter()
        with self.hold_sync():
            self.svg, self.nodes, self.clusters, self.legend = svg, lay.nodes, lay.clusters, lay.legend
            self.depth, self.max_depth = lay.depth, lay.max_depth
            self.memory = panels.memory_panel(plan, s.cluster)
            self.time = panels.time_panel(plan)
            self.controls = editor.global_state(s.cluster, plan, s.fix)
            if plan is not None:
                self.layers = editor.layer_rows(s.graph, plan, s.overrides, set(changed))
                self.stages = editor.stage_lanes(plan)
                self.alternatives = editor.alternative_rows(plan)
                self.summary, self.explanation = plan.summary(), list(plan.explanation)
            else:
                self.layers, self.stages, self.alternatives = [], [], []
                self.summary, self.explanation = "no plan yet: call ap.replan()", []
            self.changed, self.changes = changed, [str(c) for c in changes]
            self.can_undo, self.can_redo = bool(getattr(s, "_undo", None)), bool(getattr(s, "_redo", None))
            self.actions = [a for a in ACTIONS if callable(getattr(s, a, None))]
            self.run_defaults = {"nproc": local_nproc(plan)} if plan is not None else {}
            self.timings = {"layout_ms": (t1 - t0) * 1e3, "render_ms": (t2 - t1) * 1e3,
                            "replan_ms": self._replan_ms}
            self.revision += 1

    # ---- front end -> session -----------------------------------------------------------------------------------
    def _on_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and "kind" in content:
            self.handle(content)

    def handle(self, msg: dict[str, Any]) -> None:
        """Apply one front-end message, e.g. ``{"kind": "strategy", "layer": "h.0", "value": "colwise-rowwise"}``.

        A rejected edit (PlanError: infeasible or invalid) leaves the session's constraints and plan as they were and
        shows the planner's reason inline."""
        kind = msg.get("kind")
        fn = _HANDLERS.get(kind)
        if fn is None:
            self._say("error", f"unknown widget message {kind!r}")
            return
        before = self.revision
        t0 = time.perf_counter()
        try:
            code = fn(self, msg)
        except (PlanError, ValueError, KeyError, IndexError, TypeError) as e:
            text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            self._say("error", f"{_describe(msg)} was not applied: {text}. The previous plan is kept; undo/redo "
                               f"and your other choices are unchanged.")
            return
        if code is None:  # view-only message
            if self.revision == before:
                self.refresh()
            return
        self._replan_ms = (time.perf_counter() - t0) * 1e3
        if self.revision == before:  # a session without observers
            self.refresh()
        else:
            self.timings = {**self.timings, "replan_ms": self._replan_ms}
        self._say("info", f"{_describe(msg)}: re-planned in {self._replan_ms:.0f} ms "
                          f"({len(self.changes)} change(s)). As code: {code}")

    def _say(self, level: str, text: str, detail: str = "") -> None:
        self.messages = [{"level": level, "text": text, "detail": detail}]

    # handlers return the equivalent Python call (None for view-only messages)
    def _strategy(self, msg) -> str:
        choices = editor.strategy_override(msg["value"])
        self.session.override(msg["layer"], **choices)
        return _call("override", msg["layer"], choices)

    def _recompute(self, msg) -> str:
        value = msg["value"]
        choices = {"recompute": None if value == "auto" else value}
        self.session.override(msg["layer"], **choices)
        return _call("override", msg["layer"], choices)

    def _unpin(self, msg) -> str:
        s = self.session
        overrides = {k: v for k, v in s.overrides.items() if k != msg["layer"]}
        s.replan(overrides=overrides)
        return f"ap.override({msg['layer']!r}, tp=None, fsdp=None, stage=None, recompute=None)"

    def _stage(self, msg) -> str:
        """Move a layer to another pipeline stage, together with the layers between it and that stage, so stages
        stay contiguous."""
        plan = self._require_plan()
        target = int(msg["stage"])
        nstages = plan.mesh.pp * plan.pipeline.virtual_stages
        if not 0 <= target < nstages:
            raise PlanError(f"stage {target} does not exist: the plan has {nstages} stage(s); raise pp first")
        paths = [lp.path for lp in plan.layers]
        i = paths.index(msg["layer"])
        stages = [lp.stage for lp in plan.layers]
        new = list(stages)
        for j in range(len(paths)):
            if (stages[i] < target and j >= i and stages[j] < target) or \
                    (stages[i] > target and j <= i and stages[j] > target):
                new[j] = target
        return self._apply_stages(paths, stages, new)

    def _boundary(self, msg) -> str:
        """Move the boundary in front of stage ``stage`` so that layer ``layer`` is its first layer."""
        plan = self._require_plan()
        s = int(msg["stage"])
        paths = [lp.path for lp in plan.layers]
        k = paths.index(msg["layer"])
        stages = [lp.stage for lp in plan.layers]
        new = [(s - 1 if j < k and st >= s else s if j >= k and st <= s - 1 else st) for j, st in enumerate(stages)]
        if s < 1 or new == stages:
            raise PlanError("that boundary move changes no layer's stage")
        return self._apply_stages(paths, stages, new)

    def _apply_stages(self, paths, old, new) -> str:
        s = self.session
        overrides = {k: dict(v) for k, v in s.overrides.items()}
        moved = [(p, n) for p, o, n in zip(paths, old, new, strict=True) if o != n]
        if not moved:
            raise PlanError("no layer changes stage: drop a layer on another lane, or a boundary on a layer of a "
                            "neighbouring stage")
        for p, n in moved:
            overrides[p] = {**overrides.get(p, {}), "stage": n}
        s.replan(overrides=overrides)
        return "; ".join(f"ap.override({p!r}, stage={n})" for p, n in moved)

    def _global(self, msg) -> str:
        s = self.session
        key, value = msg["key"], msg["value"]
        if key not in editor.GLOBAL_KEYS:
            raise ValueError(f"{key!r} is not a global choice; choose one of {', '.join(editor.GLOBAL_KEYS)}")
        fix = dict(s.fix)
        if value in (None, "", "auto"):
            fix.pop(key, None)
        else:
            if isinstance(value, str) and value.isdigit():
                value = int(value)
            elif isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            fix[key] = value
        s.replan(fix=fix)
        return f"ap.replan(fix={fix!r})"

    def _cluster(self, msg) -> str:
        s = self.session
        old = s.cluster
        preset = msg.get("preset") or old.name or "custom"
        nodes = int(msg.get("nodes", old.nodes))
        gpus = int(msg.get("gpus_per_node", old.gpus_per_node))
        if preset in ("custom", old.name):
            new = dataclasses.replace(old, nodes=nodes, gpus_per_node=gpus)
        else:
            new = Cluster.preset(preset, nodes=nodes, gpus_per_node=gpus)
        code = f"ap.replan(cluster=Cluster.preset({preset!r}, nodes={nodes}, gpus_per_node={gpus}))"
        try:
            s.replan(cluster=new)
        except PlanError:
            # fixed mesh degrees made for the old GPU count rarely fit the new one: let the planner choose them
            mesh_free = {k: v for k, v in s.fix.items() if k not in ("dp", "tp", "pp")}
            if mesh_free == s.fix:
                raise
            s.replan(fix=mesh_free, cluster=new)
            code = code[:-1] + f", fix={mesh_free!r})  # dp/tp/pp un-fixed"
        return code

    def _adopt(self, msg) -> str:
        plan = self._require_plan()
        alt = plan.alternatives[int(msg["index"])]
        fix = {**self.session.fix, **editor.adopt_fix(alt)}
        self.session.replan(fix=fix)
        return f"ap.replan(fix={fix!r})"

    def _undo(self, msg) -> str:
        self.session.undo()
        return "ap.undo()"

    def _redo(self, msg) -> str:
        self.session.redo()
        return "ap.redo()"

    def _action(self, msg) -> str:
        name = msg["name"]
        if name not in self.actions:
            raise ValueError(f"{name!r} is not available on this session")
        fn = getattr(self.session, name)
        kwargs = {}
        params = inspect.signature(fn).parameters
        if name in ("verify", "launch") and self.session.plan is not None and "nproc" in params:
            kwargs["nproc"] = int(self.run_options.get("nproc") or local_nproc(self.session.plan))
        if name in ("verify", "launch") and "steps" in params:
            kwargs["steps"] = int(self.run_options.get(f"{name}_steps") or (5 if name == "verify" else 50))
        try:
            if name == "verify" and callable(getattr(self.session, "plan_for", None)) and "nproc" in kwargs:
                result = self._verify_in_background(**kwargs)
            else:
                result = fn(**kwargs)
        except Exception as e:  # shown inline: an action failing must not break the widget
            self._say("error", f"ap.{name}() failed: {type(e).__name__}: {e}")
            return None
        self.last_result = result
        if name == "launch" and callable(getattr(result, "dashboard", None)):
            self.panel = result.dashboard()
        self._say("info", *_action_text(name, result, kwargs))
        return None

    def _verify_in_background(self, *, nproc: int, steps: int):
        """ap.verify(steps, nproc), run in a child process so the kernel stays free; its progress view goes below."""
        from ..launch.verifying import VerifyJob

        job = VerifyJob(self.session.source, self.session.plan_for(nproc), steps=steps, nproc=nproc)
        self.panel = job.view()
        return job

    def _select(self, msg) -> None:
        self.selection = msg.get("layer") or ""
        return None

    def _expand(self, msg) -> None:
        self.expanded = sorted({*self.expanded, msg["block"]})

    def _collapse(self, msg) -> None:
        self.expanded = [b for b in self.expanded if b != msg["block"]]

    def _set_depth(self, msg) -> None:
        self._depth = int(msg["value"])

    def _require_plan(self) -> Plan:
        if self.session.plan is None:
            raise PlanError("there is no plan yet: run ap.replan() first")
        return self.session.plan


_HANDLERS = {
    "strategy": PlannerWidget._strategy, "recompute": PlannerWidget._recompute, "unpin": PlannerWidget._unpin,
    "stage": PlannerWidget._stage, "boundary": PlannerWidget._boundary, "global": PlannerWidget._global,
    "cluster": PlannerWidget._cluster, "adopt": PlannerWidget._adopt, "undo": PlannerWidget._undo,
    "redo": PlannerWidget._redo, "action": PlannerWidget._action, "select": PlannerWidget._select,
    "expand": PlannerWidget._expand, "collapse": PlannerWidget._collapse, "depth": PlannerWidget._set_depth,
}


def local_nproc(plan: Plan) -> int:
    """Processes for the Verify/Launch buttons on this machine: the plan's world size when this machine has that many
    GPUs, else one model-parallel replica (tp * pp), times the data-parallel replicas that fit (2 on CPU)."""
    import torch

    avail = torch.cuda.device_count() if torch.cuda.is_available() else 2
    world, mp = plan.mesh.world_size, plan.mesh.tp * plan.mesh.pp
    if world <= avail:
        return world
    return mp * max(1, min(plan.mesh.dp, avail // mp))


def _action_text(name: str, result: Any, kwargs: dict | None = None) -> tuple[str, str]:
    """(message, detail) for the result of ``ap.<name>()``: the exported script's path and torchrun commands, the
    verify report or job, or the run."""
    args = ", ".join(f"{k}={v!r}" for k, v in (kwargs or {}).items())
    script = getattr(result, "script", None)
    if name == "export" and script is not None:
        cmds = list(getattr(result, "commands", []) or [])
        return (f"Exported {script} (the plan beside it: {getattr(result, 'plan_json', '')}). "
                f"Open it in a cell with %load {script}", "\n".join(cmds))
    if name == "launch":
        return (f"ap.launch({args}): the live dashboard is below; the Run is ap.widget().last_result "
                "(.wait(), .stop(), .samples, .metrics)", repr(result))
    if name == "verify" and hasattr(result, "view"):
        return (f"ap.verify({args}) runs in the background: its progress is below (ap.widget().last_result.wait() "
                "returns the VerifyReport)", "")
    first, _, rest = str(result).partition("\n")
    return f"ap.{name}(): {first}", rest


def _call(method: str, layer: str, choices: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in choices.items())
    return f"ap.{method}({layer!r}, {args})"


def _describe(msg: dict[str, Any]) -> str:
    kind = msg.get("kind")
    if kind == "strategy":
        return f"{msg.get('layer')}: strategy {editor.STRATEGY_LABELS.get(msg.get('value'), msg.get('value'))}"
    if kind == "recompute":
        return f"{msg.get('layer')}: recompute {msg.get('value')}"
    if kind == "stage":
        return f"{msg.get('layer')} -> stage {msg.get('stage')}"
    if kind == "boundary":
        return f"stage {msg.get('stage')} starts at {msg.get('layer')}"
    if kind == "global":
        return f"{msg.get('key')} = {msg.get('value')}"
    if kind == "cluster":
        return f"cluster {msg.get('preset')} {msg.get('nodes')} x {msg.get('gpus_per_node')}"
    if kind == "adopt":
        return f"adopt alternative {int(msg.get('index', 0)) + 1}"
    return str(kind)
