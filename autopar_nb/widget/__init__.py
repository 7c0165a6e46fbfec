"""The planner widget: graph view (layout.py), the editor's per-layer data (editor.py), global
choices (choices.py), alternatives and changes in words (differences.py), cost panels (panels.py),
the memory timeline (timeline.py) and the anywidget model (model.py; its edit handlers in edits.py,
its view handlers in view.py, its buttons and followed runs in runs.py) whose front end is
``autopar_nb/static/planner.js`` (with ``timeline.js`` and the vendored uPlot bundled in front of
it)."""

from .model import PlannerWidget

__all__ = ["PlannerWidget"]
