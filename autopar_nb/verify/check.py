"""Verify's machinery: the plan's exported script on ranks started from this process
(:mod:`.ranks`), the single-process reference (:mod:`.reference_run`), and the comparison
(:mod:`.report`). :mod:`autopar_nb.verify` is the entry point; the warm pool's verify standby
(``verify/job.py``) runs the same functions in its own process.

Each rank runs the exported script's top level and calls its ``main``, with an observer (set on the
script's runtime module, whose ``train`` calls it) that collects the loss, the full gradients and
the full parameters of every step; the single-process reference uses the same seed, data,
learning-rate schedule and clipping; the report gives per step the loss difference and the largest
gradient and parameter differences, relative to the largest reference value. Every random op of the
model's forward is switched off in both runs (:mod:`autopar_nb.randomness`: the ranks would draw
other masks than the reference); the report says which. After the parallel run, the reference also
takes each later step's gradients at the parallel run's own parameters
(:func:`same_parameter_grads`): the two runs' parameters drift apart by round-off (Adam turns
round-off in near-zero gradients into updates of up to ``lr``), so gradients at the same parameters
are what can be held to ``rtol`` at every step.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ..export import export
from ..export.values import script_values
from ..failures import RankFailed
from ..plan import Plan
from ..source import ModelSource
from .ranks import worker
from .reference_run import reference, same_parameter_grads
from .report import VerifyReport, compare, default_rtol, merge_ranks


def export_scripts(cases: list[tuple[ModelSource, Plan]], metas: list[bool],
                   directory: str | os.PathLike, *, steps: int, seed: int) -> list[str]:
    """Each case's exported script, written to ``directory`` (``verify_<i>.py``)."""
    return [str(export(src, plan, Path(directory) / f"verify_{i}.py", steps=steps, seed=seed,
                       meta_init=meta, quiet=True).script)
            for i, ((src, plan), meta) in enumerate(zip(cases, metas, strict=True))]


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def verify_here(cases: list[tuple[ModelSource, Plan]], metas: list[bool], scripts: list[str], *,
                steps: int, nproc: int, seed: int, rtol: float | None,
                start_method: str) -> list[VerifyReport]:
    """The parallel run of ``scripts`` on ``nproc`` ranks started from this process (torch elastic,
    ``start_method``), and the single-process reference in this process: in a thread beside the
    ranks when a core is left over for it (the ranks take one each), else after them."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"verify-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
                          start_method=start_method)
    jobs = [(script, src.model_var, plan.to_json(indent=None))
            for script, (src, plan) in zip(scripts, cases, strict=True)]
    values = [script_values(src, plan, seed=seed, meta_init=meta)
              for (src, plan), meta in zip(cases, metas, strict=True)]
    refs: list = []
    errors: list = []

    def run_references():
        try:
            refs.extend(reference(src, plan, steps=steps, seed=seed, values=v)
                        for (src, plan), v in zip(cases, values, strict=True))
        except BaseException as e:  # raised in the calling thread below
            errors.append(e)

    spare = cores() - nproc
    thread = None
    if spare >= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(spare)
        thread = threading.Thread(target=run_references, daemon=True,
                                  name="autopar-verify-reference")
        thread.start()
    try:
        results = _restoring_signal_handlers(elastic_launch(config, worker), jobs, steps)
    except ChildFailedError as e:
        raise RankFailed.of(e, [src for src, _ in cases]) from None
    finally:
        if thread is not None:
            thread.join()
            torch.set_num_threads(threads)
    if thread is None:
        run_references()
    if errors:
        raise errors[0]
    reports = []
    for i, (src, plan) in enumerate(cases):
        par = merge_ranks([results[r][i] for r in sorted(results)])
        ref = refs[i]
        ref["same_grads"] = same_parameter_grads(src, plan, par["params"], seed=seed,
                                                 values=values[i], scales=ref["scales"])
        tol = rtol if rtol is not None else default_rtol(plan)
        report = compare(plan, nproc, tol, par, ref)
        report.per_rank = [results[r][i]["info"] for r in sorted(results)]
        report.random_off, report.random_left = ref["random_off"], ref["random_left"]
        reports.append(report)
    return reports


def _restoring_signal_handlers(fn, *args):
    # the elastic launcher installs SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in the calling process
    # and leaves them; in a notebook kernel they would later turn the kernel's own shutdown into a
    # SignalException traceback
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names if hasattr(signal, n)}
    try:
        return fn(*args)
    finally:
        if threading.current_thread() is threading.main_thread():
            for n, handler in saved.items():
                signal.signal(getattr(signal, n), handler)


def kernel_cwd() -> str:
    """This process's working directory, where a verify's ranks and reference run (the notebook's
    folder: the cell's relative paths hold there, as under launch). Raises RuntimeError, saying what
    to do, when it was deleted."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise RuntimeError("this kernel's working directory was deleted, so verify's processes "
                           "would have none to run in: os.chdir() to an existing directory (the "
                           "one the cell's relative paths are relative to) and verify "
                           "again") from None
