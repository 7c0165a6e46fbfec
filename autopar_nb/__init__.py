"""autopar-nb: plan, show, run and export parallel training for PyTorch models from a notebook.

>>> import autopar_nb as ap
>>> graph = ap.capture(model, example_inputs)          # model may live on the meta device
>>> plan = ap.plan(graph, ap.Cluster.preset("h100-80gb", nodes=2), global_batch=256)
>>> print(plan.explain())

In a notebook: ``%load_ext autopar_nb`` and ``%%autoparallel`` (see ``%autoparallel?``).
"""

import sys
import types

from .lazy import lazy_names

PUBLIC = {
    "capture": ("CaptureError", "capture"),
    "export": ("Exported", "export"),
    "graph": ("Layer", "ModelGraph", "OpNode", "RepeatedBlock"),
    "hardware": ("Cluster", "DeviceSpec", "LinkSpec"),
    "launch": ("Run", "TournamentResult", "launch", "tournament"),
    "plan": ("Cost", "LayerPlan", "MemoryBreakdown", "MeshPlan", "Plan", "PlanError"),
    "planner": ("plan",),
    "planner.timeline": ("MemoryTimeline", "memory_timeline"),
    "verify": ("VerifyReport", "verify", "verify_many"),
    "widget": ("PlannerWidget",),
}
"""module -> the public names it defines, each imported on first use: a worker process that imports
one module of the package (an exported script's ranks: the cell's ``autopar_nb.zoo``) imports only
that module and what it imports, not the planner, capture and export (seconds of CPU per process),
nor IPython or widgets"""
_WHERE = {name: module for module, names in PUBLIC.items() for name in names}

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


__getattr__, __dir__ = lazy_names(__name__, _WHERE)


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # importing a submodule binds it on its package: ``autopar_nb.plan`` (the contract),
        # ``.export``, ``.launch``, ``.verify``, ``.capture`` would hide the public functions of
        # those names, whichever was imported first (code reads those modules by their full name)
        if not (name in _WHERE and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
