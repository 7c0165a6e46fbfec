"""autopar-nb: plan, show, run and export parallel training for PyTorch models from a notebook.

>>> import autopar_nb as ap
>>> graph = ap.capture(model, example_inputs)          # model may live on the meta device
>>> plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", nodes=2), global_batch=256)
>>> print(plan.explain())

In a notebook: ``%load_ext autopar_nb`` and ``%%autoparallel`` (see ``%autoparallel?``).
"""

from .capture import CaptureError, capture
from .export import Exported, export
from .graph import Layer, ModelGraph, OpNode, RepeatedBlock
from .hardware import Cluster, DeviceSpec, LinkSpec
from .launch import Run, TournamentResult, launch, tournament
from .plan import Cost, LayerPlan, MemoryBreakdown, MeshPlan, Plan, PlanError
from .planner.timeline import MemoryTimeline, memory_timeline
from .verify import VerifyReport, verify, verify_many

# isort: split
# bound last: the function `plan` shadows the attribute of the contract module autopar_nb.plan
# (code imports the contract with `from autopar_nb.plan import Plan`, which still works)
from .planner import plan

__all__ = [
    "CaptureError", "Cluster", "Cost", "DeviceSpec", "Exported", "Layer", "LayerPlan", "LinkSpec",
    "MemoryBreakdown", "MemoryTimeline", "MeshPlan", "ModelGraph", "OpNode", "Plan", "PlanError",
    "PlannerWidget", "RepeatedBlock", "Run", "TournamentResult", "VerifyReport", "capture",
    "export", "launch", "load_ipython_extension", "memory_timeline", "plan", "tournament", "verify",
    "verify_many",
]


def load_ipython_extension(ipython):
    """``%load_ext autopar_nb``: registers the ``%%autoparallel`` cell magic (imported lazily, so
    worker processes never import IPython or widgets)."""
    from .notebook.magic import AutoparallelMagics

    ipython.register_magics(AutoparallelMagics)


def __getattr__(name):
    # PlannerWidget is imported on first use, so `import autopar_nb` (worker processes) never
    # imports ipywidgets
    if name == "PlannerWidget":
        from .widget import PlannerWidget

        return PlannerWidget
    raise AttributeError(f"module 'autopar_nb' has no attribute {name!r}")
