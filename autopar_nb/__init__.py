"""autopar-nb: plan, show, run and export parallel training for PyTorch models from a notebook.

>>> import autopar_nb as ap
>>> graph = ap.capture(model, example_inputs)          # model may live on the meta device
>>> cluster = ap.Cluster.preset("h100-80gb", nodes=1)
"""

from .capture import CaptureError, capture
from .export import Exported, export
from .graph import Layer, ModelGraph, OpNode, RepeatedBlock
from .hardware import Cluster, DeviceSpec, LinkSpec
from .plan import Cost, LayerPlan, MemoryBreakdown, MeshPlan, Plan, PlanError
from .planner import plan  # last: the function shadows the autopar_nb.plan submodule attribute
from .runtime import ParallelModel, apply_plan
from .verify import VerifyReport, verify, verify_many

__all__ = [
    "CaptureError", "Cluster", "Cost", "DeviceSpec", "Layer", "LayerPlan", "LinkSpec", "MemoryBreakdown", "MeshPlan",
    "ModelGraph", "OpNode", "Plan", "PlanError", "RepeatedBlock", "capture", "load_ipython_extension",
    "Exported", "ParallelModel", "VerifyReport", "apply_plan", "export", "verify", "verify_many",
    "PlannerWidget", "plan",
]


def load_ipython_extension(ipython):
    """``%load_ext autopar_nb``: registers the ``%%autoparallel`` cell magic (imported lazily, so worker processes
    never import IPython or widgets)."""
    from .magic import AutoparallelMagics

    ipython.register_magics(AutoparallelMagics)


from .launch import Run, launch  # noqa: E402  (launch: issue 5)

__all__ += ["Run", "launch"]


def __getattr__(name):
    # PlannerWidget (issue 6) is imported on first use, so `import autopar_nb` (worker processes, exported runs)
    # never imports ipywidgets/anywidget; autopar_nb.plan is loaded by then, so this cannot shadow `plan`.
    if name == "PlannerWidget":
        from .widget import PlannerWidget

        return PlannerWidget
    raise AttributeError(f"module 'autopar_nb' has no attribute {name!r}")
