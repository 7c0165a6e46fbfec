"""The planner widget's edits: each front-end edit message applied to the session (a layer's
override, its pipeline stage, a global choice, a precision list, the cluster, an alternative
adopted, undo and redo).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..hardware import Cluster
from ..plan import RECOMPUTE, Plan, PlanError
from . import editor, stage_moves
from .choices import GLOBAL_KEYS, GLOBAL_NAMES, precision_fix
from .differences import adopt_fix


class Edits:
    """The edit handlers of :class:`~autopar_nb.widget.model.PlannerWidget`, which they are mixed
    into (they act on its ``session``). Each returns the equivalent Python call the widget's message
    shows, or (that call, a note on what else moved); a PlanError or ValueError says why the edit
    was not applied."""

    def _strategy(self, msg) -> str:
        choices = editor.strategy_override(msg["value"])
        self.session.override(msg["layer"], **choices)
        return _call("override", msg["layer"], choices)

    def _shard(self, msg) -> str:
        """Pin one split on several layers (a drag of chips on the sharding board) or on the
        layers/modules of a pattern (a graph node dropped on a legend swatch): one re-plan, one undo
        step."""
        s = self.session
        value = msg["value"]
        choices = editor.strategy_override(value)
        if msg.get("pattern"):  # a module (or every member's module) from the graph
            pattern = msg["pattern"]
            choices = editor.pattern_override(s.graph, pattern, value)
            why = editor.structural_refusal(s.graph, pattern, value) if value != "auto" else ""
            if why:
                raise PlanError(why)
            s.override(pattern, **choices)
            return _call("override", pattern, choices)
        paths = list(dict.fromkeys(msg.get("layers") or [msg["layer"]]))
        known = {lay.path for lay in s.graph.layers}
        unknown = [p for p in paths if p not in known]
        if unknown:
            raise KeyError(f"no layer {unknown[0]!r}")
        overrides, patterns = editor.set_layer_fields(s.graph, s.overrides, paths, choices)
        s.replan(overrides=overrides)
        pins = {k: v for k, v in choices.items() if v is not None}
        if len(patterns) == 1:
            return _call("override", patterns[0], choices)
        if not patterns:
            return f"ap.replan(overrides={overrides!r})  # un-pins tp/fsdp on {len(paths)} layers"
        entries = ", ".join(f"{p!r}: {pins!r}" for p in patterns)
        return f"ap.replan(overrides={{**ap.overrides, {entries}}})"

    def _recompute(self, msg) -> str:
        value = msg["value"]
        choices = {"recompute": None if value == "auto" else value}
        if value != "auto" and value not in RECOMPUTE:
            raise ValueError(f"recompute {value!r} unknown; choose one of auto, "
                             f"{', '.join(RECOMPUTE)}")
        s = self.session
        paths = list(dict.fromkeys(msg.get("layers") or [msg["layer"]]))
        if len(paths) == 1:
            s.override(paths[0], **choices)
            return _call("override", paths[0], choices)
        overrides, patterns = editor.set_layer_fields(s.graph, s.overrides, paths, choices)
        s.replan(overrides=overrides)
        if len(patterns) == 1:
            return _call("override", patterns[0], choices)
        entries = ", ".join(f"{p!r}: {{'recompute': {value!r}}}" for p in patterns)
        return f"ap.replan(overrides={{**ap.overrides, {entries}}})"

    def _unpin(self, msg) -> str:
        s = self.session
        fields = {"tp": None, "fsdp": None, "stage": None, "recompute": None}
        overrides, _ = editor.set_layer_fields(s.graph, s.overrides, [msg["layer"]], fields)
        s.replan(overrides=overrides)
        return f"ap.override({msg['layer']!r}, tp=None, fsdp=None, stage=None, recompute=None)"

    def _stage(self, msg) -> str:
        """Move a layer to another pipeline stage, together with the layers between it and that
        stage, so stages stay contiguous."""
        plan = self._require_plan()
        target = int(msg["stage"])
        nstages = plan.mesh.pp * plan.pipeline.virtual_stages
        if not 0 <= target < nstages:
            raise PlanError(f"stage {target} does not exist: the plan has {nstages} stage(s); "
                            "raise pp first")
        paths = [lp.path for lp in plan.layers]
        i = paths.index(msg["layer"])
        stages = [lp.stage for lp in plan.layers]
        new = list(stages)
        for j in range(len(paths)):
            if (stages[i] < target and j >= i and stages[j] < target) or \
                    (stages[i] > target and j <= i and stages[j] > target):
                new[j] = target
        return self._apply_stages(paths, stages, new, msg["layer"])

    def _boundary(self, msg) -> str:
        """Move the boundary in front of stage ``stage`` so that layer ``layer`` is its first
        layer."""
        plan = self._require_plan()
        s = int(msg["stage"])
        paths = [lp.path for lp in plan.layers]
        k = paths.index(msg["layer"])
        stages = [lp.stage for lp in plan.layers]
        new = [(s - 1 if j < k and st >= s else s if j >= k and st <= s - 1 else st)
               for j, st in enumerate(stages)]
        if s < 1 or new == stages:
            raise PlanError("that boundary move changes no layer's stage")
        return self._apply_stages(paths, stages, new)

    def _apply_stages(self, paths, old, new, dragged=None):
        """Pin the moved layers' stages. The lanes are the plan's pp x virtual stages under its
        schedule: they are fixed too (when they were the planner's), so the stages the user dragged
        between keep their meaning."""
        s = self.session
        plan = self._require_plan()
        overrides = {k: dict(v) for k, v in s.overrides.items()}
        moved = [(p, n) for p, o, n in zip(paths, old, new, strict=True) if o != n]
        if not moved:
            raise PlanError("no layer changes stage: drop a layer on another lane, or a boundary "
                            "on a layer of a neighbouring stage")
        for p, n in moved:
            overrides[p] = {**overrides.pop(p, {}), "stage": n}
        lanes = {"pp": plan.mesh.pp, "virtual_stages": plan.pipeline.virtual_stages,
                 "schedule": plan.pipeline.schedule}
        added = {k: v for k, v in lanes.items() if k not in s.fix}
        try:
            s.replan(fix={**s.fix, **added}, overrides=overrides)
        except PlanError:
            if not added:
                raise
            # the lanes cannot hold this move (e.g. too few layers left for the other stages): let
            # the planner choose them; the message names what it changed
            s.replan(overrides=overrides)
            added = {}
        entries = ", ".join(f"{p!r}: {overrides[p]!r}" for p, _ in moved)
        code = (f"ap.replan(fix={{**ap.fix, **{added!r}}}, overrides={{**ap.overrides, "
                f"{entries}}})") if added else \
            f"ap.replan(overrides={{**ap.overrides, {entries}}})"
        note = (" The lanes are kept: "
                f"{', '.join(f'{GLOBAL_NAMES[k]}={v}' for k, v in added.items())} are now fixed "
                "(undo restores both)." if added else "")
        return code, note + stage_moves.other_stage_moves(paths, old, s.current_plan(), moved,
                                                          dragged)

    def _global(self, msg) -> str:
        s = self.session
        key, value = msg["key"], msg["value"]
        if key not in GLOBAL_KEYS:
            raise ValueError(f"{key!r} is not a global choice; choose one of "
                             f"{', '.join(GLOBAL_KEYS)}")
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

    def _precision(self, msg) -> tuple[str, str]:
        """Add an op to, or remove one from, a precision list (``{"kind": "precision", "list":
        "fp32_ops", "op": "softmax", "action": "add"}``): ``ap.replan(fix={..., "fp32_ops":
        [...]})``."""
        s = self.session
        amp = s.fix.get("amp", s.plan.precision.amp if s.plan is not None else "none")
        fix, note = precision_fix(s.fix, amp, msg.get("list"), msg.get("op"),
                                  msg.get("action", "add"))
        s.replan(fix=fix)
        return f"ap.replan(fix={fix!r})", note

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
            # fixed mesh degrees made for the old GPU count rarely fit the new one: let the planner
            # choose them
            mesh_free = {k: v for k, v in s.fix.items() if k not in ("dp", "tp", "pp")}
            if mesh_free == s.fix:
                raise
            s.replan(fix=mesh_free, cluster=new)
            code = code[:-1] + f", fix={mesh_free!r})  # dp/tp/pp un-fixed"
        return code

    def _adopt(self, msg) -> str:
        """Make an alternative the current plan without pinning anything (``Session.adopt``)."""
        index = int(msg["index"])
        adopt = getattr(self.session, "adopt", None)
        if adopt is None:  # a session class without adopt(): pin its shape instead
            alt = self._require_plan().alternatives[index]
            fix = {**self.session.fix, **adopt_fix(alt)}
            self.session.replan(fix=fix)
            return f"ap.replan(fix={fix!r})"
        adopt(index)
        return f"ap.adopt({index})"

    def _undo(self, msg) -> str:
        self.session.undo()
        return "ap.undo()"

    def _redo(self, msg) -> str:
        self.session.redo()
        return "ap.redo()"

    def _require_plan(self) -> Plan:
        if self.session.plan is None:
            raise PlanError("there is no plan yet: run ap.replan() first")
        return self.session.plan


def _call(method: str, layer: str, choices: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in choices.items())
    return f"ap.{method}({layer!r}, {args})"
