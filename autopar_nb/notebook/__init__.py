"""The notebook front: the model cell run on the meta device (cell.py), the Session a planner view
and the magic share (session.py), and ``%%autoparallel`` itself (magic.py)."""
