"""Launch: run an exported training script on local worker processes from the notebook, with live
metrics.

>>> run = launch("train.py", nproc=2, steps=50)     # returns at once
>>> run.wait(); run.status, run.metrics
"""

from .attached import AttachedRun, attach
from .launcher import LaunchError, launch, live_runs
from .run import MetricsTable, Run
from .standings import TournamentResult
from .trials import tournament

__all__ = ["AttachedRun", "LaunchError", "MetricsTable", "Run", "TournamentResult", "attach",
           "launch", "live_runs", "tournament"]
