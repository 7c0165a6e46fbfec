"""What :func:`export` writes and how: the script's text (two files or one), the job file of a
scheduler, and the check that a file about to be replaced was an earlier export's."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..plan import Plan
from ..source import ModelSource
from .commands import (
    launch_text,
    torchrun_commands,
)
from .files import runtime_name
from .k8s import pytorchjob_manifest
from .render import render_script as _render
from .script import RUNTIME_HEADER, render_files
from .slurm import sbatch_script
from .values import script_values

TARGETS = ("torchrun", "slurm", "k8s")
"""what :func:`export` writes besides the script: nothing more, an sbatch script, a PyTorchJob
manifest"""


def render_script(source: ModelSource, plan: Plan, *, script_name: str = "train.py",
                  plan_file: str = "plan.json", steps: int = 100, seed: int = 0,
                  meta_init: bool | None = None) -> str:
    """The script's text (see :func:`export`)."""
    values = script_values(source, plan, seed=seed, meta_init=meta_init)
    return _render(source, plan, values, script_name=script_name, plan_file=plan_file, steps=steps,
                   seed=seed, launch=launch_text(script_name, plan))


def render_two_files(source: ModelSource, plan: Plan, *, script_name: str = "train.py",
                     plan_file: str = "plan.json", steps: int = 100, seed: int = 0,
                     meta_init: bool | None = None) -> tuple[str, str]:
    """The texts of the script and of its runtime module (see :func:`export`)."""
    values = script_values(source, plan, seed=seed, meta_init=meta_init)
    return render_files(source, plan, values, script_name=script_name, plan_file=plan_file,
                        steps=steps, seed=seed, launch=launch_text(script_name, plan))


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
    runtime: Path | None = None
    """the runtime module the script imports (None: ``single_file``)"""

    def __str__(self) -> str:
        files = [self.script, self.runtime, self.plan_json, self.job]
        lines = ["wrote " + ", ".join(str(f) for f in files if f is not None)]
        return "\n".join(lines + [f"  {c}" for c in self.submit or self.commands])


def written_by_export(path: Path) -> bool:
    """Whether the file at ``path`` is an earlier output of :func:`export` (so writing over it loses
    nothing of the user's): a script (two-file or one-file), a runtime module, a plan JSON, or a job
    file whose header says autopar-nb wrote it. Read as text, never executed; a file that is not
    UTF-8 text is not ours."""
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
    if path.suffix == ".py" and text.startswith(RUNTIME_HEADER):
        return "\n# autopar_nb/runtime/" in text and "\ndef distributed(" in text
    if path.suffix == ".py":
        return text.startswith('"""Train ') and "\ndef parallelize(" in text and (
            "\n# autopar_nb/runtime/" in text or "\ndef build_model(" in text)
    return "written by autopar-nb" in text.replace("\n# ", " ")


def _refuse_overwrite(paths: list[Path]) -> None:
    """FileExistsError naming the first of ``paths`` that exists and is not an earlier export
    (nothing written)."""
    for p in paths:
        if p.exists() and not written_by_export(p):
            raise FileExistsError(f"{p} exists and was not written by ap.export(): nothing was "
                                  "written. Pass overwrite=True to replace it, or export to "
                                  "another path")


def export(source: ModelSource, plan: Plan, path: str | Path, *, steps: int = 100, seed: int = 0,
           meta_init: bool | None = None, quiet: bool = False, target: str = "torchrun",
           overwrite: bool = False, single_file: bool = False,
           weights: str | os.PathLike | None = None, **job) -> Exported:
    """Write the training script for ``plan`` to ``path``, its runtime module beside it
    (``<stem>_runtime.py``, which the script imports) and the plan to ``<path stem>.plan.json``.

    ``single_file``: the script alone, the runtime's functions inside it and the cell at its top
    level (the older form). ``meta_init``: build the model on the meta device and initialise it
    shard by shard (models larger than host memory); None decides by size (above 2**30 parameters).
    ``weights``: a folder of safetensors files (``save_pretrained``'s) that a model the cell builds
    from a config starts from, read as a ``from_pretrained`` cell's checkpoint is
    (:attr:`ModelSource.weights`). Nothing is written when the plan cannot be rendered. ``target``:
    ``"torchrun"`` (the script only), ``"slurm"`` (also ``<stem>.sbatch``:
    :func:`.slurm.sbatch_script` takes the ``job`` keywords) or ``"k8s"`` (also
    ``<stem>.pytorchjob.yaml``: :func:`.k8s.pytorchjob_manifest`). Prints the commands unless
    ``quiet``. A file at one of those paths that an earlier export did not write is kept
    (FileExistsError, nothing written) unless ``overwrite``.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise ValueError(f"export path {str(path)!r} should end in .py (it is a Python script)")
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: choose one of {', '.join(map(repr, TARGETS))}")
    if job and target == "torchrun":
        raise TypeError(f"export() got options for a job file ({', '.join(job)}) but "
                        "target='torchrun' writes none: pass target='slurm' or 'k8s'")
    source = with_weights(source, weights)
    plan_path = path.with_name(path.stem + ".plan.json")
    runtime_path, runtime_text = None, None
    options = dict(script_name=path.name, plan_file=plan_path.name, steps=steps, seed=seed,
                   meta_init=meta_init)
    if single_file:
        text = render_script(source, plan, **options)
    else:
        text, runtime_text = render_two_files(source, plan, **options)
        runtime_path = path.with_name(runtime_name(path.name) + ".py")
    job_path, job_text, submit = _job(target, path, plan, text, runtime_path, runtime_text, job)
    written = {path: text, runtime_path: runtime_text, plan_path: plan.to_json() + "\n",
               job_path: job_text}
    written.pop(None, None)
    if not overwrite:
        _refuse_overwrite(list(written))
    path.parent.mkdir(parents=True, exist_ok=True)
    for p, content in written.items():
        p.write_text(content)
    result = Exported(script=path, plan_json=plan_path, commands=torchrun_commands(path.name, plan),
                      job=job_path, submit=submit, runtime=runtime_path)
    if not quiet:
        print(result)
    return result


def with_weights(source: ModelSource, weights: str | os.PathLike | None) -> ModelSource:
    """``source`` starting from the checkpoint folder ``weights`` (an absolute path: the script may
    run elsewhere), or as it is for None."""
    if weights is None:
        return source
    return dataclasses.replace(source, weights=os.path.abspath(os.fspath(weights)))


def _job(target: str, path: Path, plan: Plan, text: str, runtime_path: Path | None,
         runtime_text: str | None, job: dict) -> tuple[Path | None, str | None, list[str]]:
    """The job file of ``target`` (its path, text and the command that submits it), or Nones for
    torchrun."""
    if target == "slurm":
        job_path = path.with_suffix(".sbatch")
        return job_path, sbatch_script(path.name, plan, **job), [
            f"sbatch {job_path.name}  # from the directory holding {path.name}"]
    if target == "k8s":
        job_path = path.with_name(path.stem + ".pytorchjob.yaml")
        files = {runtime_path.name: runtime_text} if runtime_path is not None else {}
        return job_path, pytorchjob_manifest(path.name, plan, script_text=text,
                                             plan_text=plan.to_json() + "\n", files=files,
                                             **job), ["kubectl apply -f "
                                                      f"{job_path.name}"]
    return None, None, []
