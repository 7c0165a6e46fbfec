"""The public functions of :mod:`autopar_nb.verify`: :func:`verify` and :func:`verify_many` export
the plans, run the scripts on local processes (here, or in a standby of the warm pool) beside a
single-process reference, and return the reports."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..export import with_weights
from ..failures import VerifyError
from ..hardware import nvml_visible_gpus
from ..plan import Plan
from ..source import ModelSource
from .check import export_scripts, verify_here
from .report import VerifyReport


def verify(source: ModelSource, plan: Plan, *, steps: int = 5, nproc: int | None = None,
           seed: int = 0, rtol: float | None = None, meta_init: bool = False,
           start_method: str = "spawn", warm: bool = True,
           weights: str | os.PathLike | None = None) -> VerifyReport:
    """Run ``plan``'s exported script on ``nproc`` local processes and a single-process reference;
    compare ``steps`` steps.

    ``nproc`` defaults to the plan's world size (dp * tp * pp) and must equal it. ``meta_init``
    builds the parallel model on the meta device and initialises it shard by shard (the path for
    models larger than host memory). ``warm`` runs both in the warm pool (see :func:`verify_many`).
    ``weights``: the checkpoint folder a model built from a config starts from, in both runs
    (``export(weights=...)``; in :func:`verify_many`, each case's ``ModelSource.weights``).
    """
    return verify_many([(with_weights(source, weights), plan)], steps=steps, nproc=nproc, seed=seed,
                       rtol=rtol, meta_init=meta_init, start_method=start_method, warm=warm)[0]


def verify_many(cases: list[tuple[ModelSource, Plan]], *, steps: int = 5, nproc: int | None = None,
                seed: int = 0, rtol: float | None = None, meta_init: bool | list[bool] = False,
                start_method: str = "spawn", warm: bool = True) -> list[VerifyReport]:
    """:func:`verify` for several (source, plan) pairs of the same world size in ONE launch of
    processes (starting processes costs seconds; running a small plan costs less). ``meta_init`` may
    be one flag per case.

    The scripts are exported here (an unsupported plan raises here, as export() would). ``warm``
    (default): the parallel run and the reference run in a standby of the warm pool
    (``autopar_nb/launch/pool.py``): a process that has imported torch and autopar_nb, whose ranks
    are forked from a forkserver that preloaded them (``start_method="forkserver"``); the first
    verify of a kernel starts it, each later one finds the next. A rank's failure there raises
    :class:`VerifyError` with that process's traceback. ``warm=False``: ranks started with
    ``start_method`` from this process, and the reference here — except where the ranks use GPUs:
    then both run in a fresh child process, so that this kernel never initialises CUDA (a CUDA
    context in the kernel holds GPU memory the workers need, and on exclusive-process GPUs it would
    lock them out).
    """
    if not cases:
        return []
    if nproc is None:
        nproc = cases[0][1].mesh.world_size
    for _, plan in cases:
        if plan.mesh.world_size != nproc:
            raise ValueError(f"plan {plan.summary()} needs {plan.mesh.world_size} processes, not "
                             f"nproc={nproc}; verify plans of different world sizes in separate "
                             "calls")
    metas = meta_init if isinstance(meta_init, list) else [meta_init] * len(cases)
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        scripts = export_scripts(cases, metas, tmp, steps=steps, seed=seed)
        # on a GPU host the reference must not open CUDA in this kernel
        if warm or ranks_use_cuda():
            return _verify_in_child(cases, metas, scripts, steps=steps, nproc=nproc, seed=seed,
                                    rtol=rtol, work_dir=tmp, warm=warm)
        return verify_here(cases, metas, scripts, steps=steps, nproc=nproc, seed=seed, rtol=rtol,
                           start_method=start_method)


def ranks_use_cuda() -> bool:
    """Whether the ranks will run on GPUs (the exported script picks CUDA when it sees one), found
    without opening CUDA in this process: NVML, else torch's device count (which does not initialise
    CUDA either)."""
    gpus = nvml_visible_gpus()
    if gpus is not None:
        return bool(gpus)
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def _verify_in_child(cases, metas, scripts, *, steps, nproc, seed, rtol, work_dir,
                     warm) -> list[VerifyReport]:
    """The parallel run and the reference in another process: a standby of the warm pool, or a fresh
    one."""
    from .job import VerifyJob

    job = VerifyJob(cases=cases, scripts=scripts, steps=steps, nproc=nproc, seed=seed, rtol=rtol,
                    meta_init=metas, work_dir=Path(work_dir) / "job", warm=warm)
    try:
        job.wait()
    except KeyboardInterrupt:
        job.stop("interrupted (KeyboardInterrupt in verify())")
        raise
    if job.reports is None:
        raise VerifyError(f"{job.message} (the whole account: this error's .details)",
                          job.error or "")
    return job.reports
