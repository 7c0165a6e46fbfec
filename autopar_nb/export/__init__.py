"""export(source, plan, path): the plan as a standalone ``torchrun`` script, plus ``plan.json`` beside it; with
``target="slurm"`` an ``sbatch`` script beside them too, with ``target="k8s"`` a Kubeflow PyTorchJob manifest.

The script reads like a hand-written one (nanoGPT's ``train.py``, torchtitan's ``parallelize_llama``): a docstring
with the launch commands, settings saying where each came from in the plan, the notebook cell verbatim, the
functions of :mod:`autopar_nb.runtime` it needs (copied verbatim by :mod:`.kit`), a ``parallelize`` that calls them
in order, and ``main``. ``verify`` and ``launch`` run this very script. It never imports autopar_nb.

Pipeline: :mod:`.values` (plan -> plain values, :mod:`.styles` for TP) -> :mod:`.render` (text); :mod:`.commands`
the torchrun lines, which :mod:`.slurm` and :mod:`.k8s` wrap for a scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..plan import Plan
from ..source import ModelSource
from . import forward_check  # noqa: F401  (registers the planner's TP forward check)
from .commands import LaunchCommand, Layout, launch_commands, launch_text, layout, torchrun_command, torchrun_commands
from .k8s import pytorchjob_manifest
from .render import render_script as _render
from .slurm import sbatch_script
from .values import script_values

TARGETS = ("torchrun", "slurm", "k8s")
"""what :func:`export` writes besides the script: nothing more, an sbatch script, a PyTorchJob manifest"""


def render_script(source: ModelSource, plan: Plan, *, script_name: str = "train.py", plan_file: str = "plan.json",
                  steps: int = 100, seed: int = 0, meta_init: bool | None = None) -> str:
    """The script's text (see :func:`export`)."""
    values = script_values(source, plan, seed=seed, meta_init=meta_init)
    return _render(source, plan, values, script_name=script_name, plan_file=plan_file, steps=steps, seed=seed,
                   launch=launch_text(script_name, plan))


@dataclass
class Exported:
    """What :func:`export` wrote."""

    script: Path
    plan_json: Path
    commands: list[str]
    """torchrun for one node (when the plan fits one), then for several, then elastic"""
    job: Path | None = None
    """the sbatch script (``target="slurm"``) or PyTorchJob manifest (``target="k8s"``)"""
    submit: list[str] = field(default_factory=list)
    """how to start ``job``"""

    def __str__(self) -> str:
        lines = [f"wrote {self.script} and {self.plan_json}" + (f" and {self.job}" if self.job else "")]
        return "\n".join(lines + [f"  {c}" for c in self.submit or self.commands])


def written_by_export(path: Path) -> bool:
    """Whether the file at ``path`` is an earlier output of :func:`export` (so writing over it loses nothing of the
    user's): a script carrying the runtime's blocks, a plan JSON, or a job file whose header says autopar-nb wrote
    it. Read as text, never executed; a file that is not UTF-8 text is not ours."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    if path.name.endswith(".plan.json"):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return False
        return isinstance(data, dict) and "schema_version" in data and "mesh" in data
    if path.suffix == ".py":
        return text.startswith('"""Train ') and "\n# autopar_nb/runtime/" in text and "\ndef parallelize(" in text
    return "written by autopar-nb" in text.replace("\n# ", " ")


def _refuse_overwrite(paths: list[Path]) -> None:
    """FileExistsError naming the first of ``paths`` that exists and is not an earlier export (nothing written)."""
    for p in paths:
        if p.exists() and not written_by_export(p):
            raise FileExistsError(f"{p} exists and was not written by ap.export(): nothing was written. Pass "
                                  "overwrite=True to replace it, or export to another path")


def export(source: ModelSource, plan: Plan, path: str | Path, *, steps: int = 100, seed: int = 0,
           meta_init: bool | None = None, quiet: bool = False, target: str = "torchrun", overwrite: bool = False,
           **job) -> Exported:
    """Write the training script for ``plan`` to ``path`` and the plan to ``<path stem>.plan.json`` beside it.

    ``meta_init``: build the model on the meta device and initialise it shard by shard (models larger than host
    memory); None decides by size (above 2**30 parameters). Nothing is written when the plan cannot be rendered.
    ``target``: ``"torchrun"`` (the script only), ``"slurm"`` (also ``<stem>.sbatch``: :func:`.slurm.sbatch_script`
    takes the ``job`` keywords) or ``"k8s"`` (also ``<stem>.pytorchjob.yaml``: :func:`.k8s.pytorchjob_manifest`).
    Prints the commands unless ``quiet``. A file at one of those paths that an earlier export did not write is
    kept (FileExistsError, nothing written) unless ``overwrite``.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise ValueError(f"export path {str(path)!r} should end in .py (it is a Python script)")
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: choose one of {', '.join(map(repr, TARGETS))}")
    if job and target == "torchrun":
        raise TypeError(f"export() got options for a job file ({', '.join(job)}) but target='torchrun' writes none: "
                        "pass target='slurm' or 'k8s'")
    plan_path = path.with_name(path.stem + ".plan.json")
    text = render_script(source, plan, script_name=path.name, plan_file=plan_path.name, steps=steps, seed=seed,
                         meta_init=meta_init)
    job_path, job_text, submit = None, None, []
    if target == "slurm":

        job_path = path.with_suffix(".sbatch")
        job_text = sbatch_script(path.name, plan, **job)
        submit = [f"sbatch {job_path.name}  # from the directory holding {path.name}"]
    elif target == "k8s":

        job_path = path.with_name(path.stem + ".pytorchjob.yaml")
        job_text = pytorchjob_manifest(path.name, plan, script_text=text, plan_text=plan.to_json() + "\n", **job)
        submit = [f"kubectl apply -f {job_path.name}"]
    if not overwrite:
        _refuse_overwrite([path, plan_path] + ([job_path] if job_path is not None else []))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    plan_path.write_text(plan.to_json() + "\n")
    if job_path is not None:
        job_path.write_text(job_text)
    result = Exported(script=path, plan_json=plan_path, commands=torchrun_commands(path.name, plan), job=job_path,
                      submit=submit)
    if not quiet:
        print(result)
    return result


__all__ = ["Exported", "LaunchCommand", "Layout", "TARGETS", "export", "launch_commands", "launch_text", "layout",
           "render_script", "torchrun_command", "torchrun_commands"]
