"""export(source, plan, path): the plan as a standalone ``torchrun`` script, plus ``plan.json`` beside it.

The script reads like a hand-written one (nanoGPT's ``train.py``, torchtitan's ``parallelize_llama``): a docstring
with the launch commands, settings saying where each came from in the plan, the notebook cell verbatim, the
functions of :mod:`autopar_nb.runtime` it needs (copied verbatim by :mod:`.kit`), a ``parallelize`` that calls them
in order, and ``main``. ``verify`` and ``launch`` run this very script. It never imports autopar_nb.

Pipeline: :mod:`.values` (plan -> plain values, :mod:`.styles` for TP) -> :mod:`.render` (text).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..plan import Plan
from ..source import ModelSource
from .render import render_script as _render
from .values import script_values


@dataclass
class Exported:
    """What :func:`export` wrote."""

    script: Path
    plan_json: Path
    commands: list[str]
    """torchrun for one node, then for several"""

    def __str__(self) -> str:
        return f"wrote {self.script} and {self.plan_json}\n" + "\n".join(f"  {c}" for c in self.commands)


def torchrun_commands(script: str, plan: Plan, *, nodes: int | None = None) -> list[str]:
    """``torchrun`` command lines: one node with every rank, and ``nodes`` nodes (default: the plan's cluster, at
    least 2) sharing them."""
    world = plan.mesh.world_size
    nodes = nodes or max(2, plan.cluster.get("nodes", 1))
    per_node = max(1, world // nodes)
    one = f"torchrun --nproc-per-node {world} {script}"
    multi = (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
             f"--rdzv-endpoint HOST:29500 --rdzv-id {Path(script).stem} {script}")
    return [one, multi]


def render_script(source: ModelSource, plan: Plan, *, script_name: str = "train.py", plan_file: str = "plan.json",
                  steps: int = 100, seed: int = 0, meta_init: bool | None = None) -> str:
    """The script's text (see :func:`export`)."""
    values = script_values(source, plan, seed=seed, meta_init=meta_init)
    commands = torchrun_commands(script_name, plan)
    nodes = max(2, plan.cluster.get("nodes", 1))
    return _render(source, plan, values, script_name=script_name, plan_file=plan_file, steps=steps, seed=seed,
                   commands=commands, nodes=nodes)


def export(source: ModelSource, plan: Plan, path: str | Path, *, steps: int = 100, seed: int = 0,
           meta_init: bool | None = None, quiet: bool = False) -> Exported:
    """Write the training script for ``plan`` to ``path`` and the plan to ``<path stem>.plan.json`` beside it.

    ``meta_init``: build the model on the meta device and initialise it shard by shard (models larger than host
    memory); None decides by size (above 2**30 parameters). Nothing is written when the plan cannot be rendered.
    Prints the torchrun commands unless ``quiet``.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise ValueError(f"export path {str(path)!r} should end in .py (it is a Python script)")
    plan_path = path.with_name(path.stem + ".plan.json")
    text = render_script(source, plan, script_name=path.name, plan_file=plan_path.name, steps=steps, seed=seed,
                         meta_init=meta_init)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    plan_path.write_text(plan.to_json() + "\n")
    result = Exported(script=path, plan_json=plan_path, commands=torchrun_commands(path.name, plan))
    if not quiet:
        print(result)
    return result


__all__ = ["Exported", "export", "render_script", "torchrun_commands"]
