"""The planner widget: graph view (layout.py), editor data (editor.py), cost panels (panels.py) and the anywidget
model (model.py) whose front end is ``autopar_nb/static/planner.js``."""

from .model import PlannerWidget

__all__ = ["PlannerWidget"]
