"""export(source, plan, path): the plan as a ``torchrun`` script a person reads (``train.py``) and
its runtime module beside it (``train_runtime.py``), plus ``plan.json``; with ``target="slurm"`` an
``sbatch`` script beside them too, with ``target="k8s"`` a Kubeflow PyTorchJob manifest.

The script reads like a hand-written one (nanoGPT's ``train.py``, torchtitan's
``parallelize_llama``): a docstring with the launch commands, settings saying where each came from
in the plan, the notebook cell as ``build_model()`` (its imports, classes and functions at the top
level), a ``parallelize`` that calls the runtime's functions in torchtitan's order, and ``main``.
The runtime module holds those functions of :mod:`autopar_nb.runtime` and all they use, verbatim
(:mod:`.kit`), and the notebook's telemetry. ``single_file=True`` writes the older one-file form
instead (the cell at the top level, the runtime's functions inside). ``verify`` and ``launch`` run
these very files. Neither imports autopar_nb.

Pipeline: :mod:`.values` (plan -> plain values; :mod:`.checks` refuses, :mod:`.patterns` groups
the blocks) -> :mod:`.script` (the two files) or :mod:`.render` (one); :mod:`.commands` the
torchrun lines, which :mod:`.slurm` and :mod:`.k8s` wrap for a scheduler; :mod:`.write` writes the
files; :mod:`.files` names them and runs a script in this process (verify's and measure's ranks).
"""

from ..lazy import lazy_names

PUBLIC = {
    "commands": ("LaunchCommand", "Layout", "launch_commands", "launch_text", "layout",
                 "torchrun_command", "torchrun_commands"),
    "files": ("run_script", "runtime_name"),
    "write": ("Exported", "TARGETS", "export", "render_script", "render_two_files", "with_weights",
              "written_by_export"),
}
"""module -> the names it defines that are read from this package, each imported on first use: a
verify or measure rank runs an exported script with :func:`.files.run_script` and imports no more
of export (the rest imports the planner and capture: 0.8 s of CPU per process)"""
_WHERE = {name: module for module, names in PUBLIC.items() for name in names}

__all__ = ["Exported", "LaunchCommand", "Layout", "TARGETS", "export", "launch_commands",
           "launch_text", "layout", "render_script", "render_two_files", "run_script",
           "runtime_name", "torchrun_command", "torchrun_commands"]


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
