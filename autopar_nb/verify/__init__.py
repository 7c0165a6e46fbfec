"""verify(source, plan): did parallelism change my model?

Exports the plan and runs that very script on ``nproc`` local processes (torch.distributed elastic
launch; gloo on CPU, NCCL on GPUs), then a single-process reference with the same seed, data,
learning-rate schedule and clipping, and reports per step the loss difference and the largest
gradient and parameter differences (the machinery: :mod:`autopar_nb.verify.check`; how the reference
reproduces the parallel run's arithmetic: :mod:`autopar_nb.verify.reference_run`). By default both
run in a standby of the warm pool (``launch/pool.py``, ``verify/job.py``); ``warm=False`` starts the
ranks from this process.
"""

from ..failures import VerifyError
from ..lazy import lazy_names

PUBLIC = {
    "api": ("ranks_use_cuda", "verify", "verify_many"),
    "reference_run": ("reference",),
    "report": ("FP32_RTOL", "LOW_PRECISION_RTOL", "StepDiff", "VerifyReport"),
}
"""module -> the names it defines that are read from this package, each imported on first use: a
verify rank (:mod:`.ranks`, forked from a forkserver that preloaded it, or spawned) imports torch,
the plan and the exported script's own imports, not export, capture and the planner that
:func:`verify` uses in the calling process (0.8 s of CPU per process)"""
_WHERE = {name: module for module, names in PUBLIC.items() for name in names}

__all__ = ["FP32_RTOL", "LOW_PRECISION_RTOL", "StepDiff", "VerifyError", "VerifyReport",
           "reference", "verify", "verify_many"]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
