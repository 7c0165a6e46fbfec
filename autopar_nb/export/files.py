"""The exported files' names, and running an exported script in this process: what a verify or
measure rank needs of export, standard library only (the rest of export imports the planner and
capture, seconds of CPU in every rank that would import it)."""

from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path


def runtime_name(script_name: str) -> str:
    """The runtime module's name for the script ``script_name``: ``train.py`` -> ``train_runtime``
    (one per script, so that two exports in one folder, or verify's scripts in one process, never
    share one)."""
    name = re.sub(r"\W", "_", Path(script_name).stem)
    return ("_" if not name or name[0].isdigit() else "") + name + "_runtime"


def run_script(path: str | Path, *, run_name: str,
               build: bool = False) -> tuple[dict, object | None]:
    """Run an exported script's top level in this process as ``runpy.run_path`` does (its ``main``
    is not called) and return its namespace and its runtime module (None for a one-file script). The
    runtime module is imported afresh from beside the script, replacing a module of that name
    imported before (another export's), since ``run_path`` does not put the script's folder on
    ``sys.path``. ``build``: call ``build_model`` now, seeded as ``main`` seeds it, and have
    ``main``'s call return what it built (measure: the model before the tracker)."""
    import torch

    path = Path(path)
    name = runtime_name(path.name)
    module = None
    if path.with_name(name + ".py").exists():
        spec = importlib.util.spec_from_file_location(name, path.with_name(name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    ns = runpy.run_path(str(path), run_name=run_name)
    if build and "build_model" in ns:
        torch.manual_seed(ns["SEED"])
        built, rng = ns["build_model"](), torch.get_rng_state()

        # what main's build_model() would have built, the generator where building left it
        def prebuilt():
            torch.set_rng_state(rng)
            return built

        # main reads the module's (run_path copies them)
        ns["build_model"].__globals__["build_model"] = prebuilt
    return ns, module
