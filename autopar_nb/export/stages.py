"""A plan's pipeline stages checked against where the model lets a stage start, before a script is
written: a plan set by hand (a Plan dict, an edited plan JSON) may cut where the runtime's split
cannot run."""

from __future__ import annotations

import torch.nn as nn

from ..capture import CaptureError
from ..capture.cache import cached_capture
from ..cost.profile.crossings import refused_stages, stage_rules
from ..plan import Plan, PlanError


def check_stage_starts(model: nn.Module, inputs, plan: Plan) -> None:
    """PlanError naming the layer, the reason and what to do instead where ``plan`` starts a
    pipeline stage at a layer where its stage cannot run
    (:func:`~autopar_nb.cost.profile.crossings.refused_stages`: the rules the planner places stages
    by, each stage judged as a whole). The model's capture (on the meta device) is the session's
    where it made one; a model the capture cannot trace, or a plan of other layers, is left to the
    runtime's split (which checks the stages it cut: ``runtime/pp_split.py``). Nothing to check at
    pp=1."""
    if plan.mesh.pp == 1:
        return
    try:
        graph, _ = cached_capture(model, inputs)
    except CaptureError:
        return
    paths = [lay.path for lay in graph.layers]
    if paths != [lp.path for lp in plan.layers]:
        return
    why = refused_stages(paths, stage_rules(graph), [lp.stage for lp in plan.layers])
    if why:
        raise PlanError(f"{why} (plan.layers[*].stage)")
