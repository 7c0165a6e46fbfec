"""The two-file export: ``train.py``, which a person reads (settings, the cell's model,
``parallelize``, ``main``), and its runtime module beside it (``train_runtime.py``: the functions of
:mod:`autopar_nb.runtime` it calls and all they use, verbatim, as :mod:`.kit` assembles them), which
``train.py`` imports. The notebook's telemetry (the metrics stream, stack dumps, the memory before
the model, verify's observer) lives in the runtime module's ``distributed`` and ``train``, not in
``train.py``'s text.

Values reach the text as in :mod:`.render` (``repr`` of checked values, a ``TPStyle``'s
constructor), never as code.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
from pathlib import Path
from string import Template

from ..plan import Plan
from ..source import ModelSource
from . import kit
from .cell import PRETRAINED, SplitCell, check_names, split_cell
from .files import runtime_name
from .main_body import main_source
from .parallelize import parallelize_source
from .render import DATA_FLAGS, HF_FLAGS, summary_lines
from .settings import settings
from .values import ScriptValues

TEMPLATE = Path(__file__).with_name("train.py.tmpl")
RUNTIME_TEMPLATE = Path(__file__).with_name("runtime.py.tmpl")
RUNTIME_HEADER = '"""The runtime of '
"""how a runtime module written by export begins (what ``written_by_export`` recognises)"""
SCRIPT_IMPORTS = {("argparse", None, None), ("copy", None, None), ("functools", None, None),
                  ("torch", None, None),
                  ("torch.distributed.elastic.multiprocessing.errors", "record", None)}
"""what ``train.py``'s own lines may import (those it does not use are left out)"""


def render_files(source: ModelSource, plan: Plan, v: ScriptValues, *, script_name: str,
                 plan_file: str, steps: int, seed: int, launch: str) -> tuple[str, str]:
    """``train.py``'s text and its runtime module's (see the module docstring)."""
    setting_lines, setting_imports = settings(v, plan, seed=seed)
    par, par_uses, par_imports = parallelize_source(v)
    body, main_uses = main_source(v, source, telemetry=False)
    assembly = kit.assemble(["distributed", *par_uses, *main_uses,
                             *(PRETRAINED if v.from_config else ())])
    cell = split_cell(source.code)
    returns = _returns(source, v, body, cell)
    module = runtime_name(script_name)
    text = Template(TEMPLATE.read_text()).substitute(
        model_name=v.model_class, summary=summary_lines(v.model_class, plan.summary()),
        plan_file=plan_file, intro=textwrap.fill(f"Exported by autopar-nb from a notebook cell: "
                                                 "its statements are build_model() below, "
                            "its imports, classes and functions are at the top level. "
                            f"parallelize() applies the plan ({plan_file} beside this file) with "
                            f"the functions of {module}.py beside it (autopar-nb's runtime, "
                            "verbatim); nothing but torch (and the cell's own imports) is needed.",
                            width=116),
        launch=launch, imports="@IMPORTS@", settings="\n".join(setting_lines),
        cell_top=("\n\n\n# the notebook cell's classes and functions, at the top level (where "
                  "DataLoader workers find them)\n" + cell.top) if cell.top else "",
        build_doc=f"The notebook cell's statements: {', '.join(returns)}.",
        cell_body=_build_body(cell, v, returns),
        parallelize=par, steps=int(steps), main=body, unpack=", ".join(returns),
        data_flags=(DATA_FLAGS if v.dataset else "") + (HF_FLAGS if v.save_hf else ""),
        build_mesh="build_mesh(device, PP, DP, TP" + (", cp=CP)" if v.cp > 1 else ")"))
    loads = {n.id for n in ast.walk(ast.parse(text.replace("@IMPORTS@", "")))
             if isinstance(n, ast.Name)}
    used = sorted(set(assembly.names) & loads, key=kit._order_by_type)
    check_names(source, [*used, "build_model", "distributed"])
    imported = (sorted({i[2] or i[1] or i[0].split(".")[0]
                        for i in cell.imports} & {*used, "build_model"}))
    if imported:
        raise ValueError(f"the cell imports {', '.join(imported)}, which the exported script takes "
                         "from its runtime module: import it under another name in the cell")
    mine = {i for i in SCRIPT_IMPORTS | par_imports
            if (i[2] or i[1] or i[0].split(".")[0]) in loads}
    sections = kit.with_early(_merged(mine | setting_imports, cell.imports))
    # the file beside this one: first party where ruff runs from this folder, third party elsewhere;
    # the split keeps its import where it is either way
    sections.append("# isort: split\n" + _from_import(module, used))
    runtime = Template(RUNTIME_TEMPLATE.read_text()).substitute(
        doc=textwrap.fill(
            f"{script_name}: the functions of autopar_nb/runtime it calls, and all they use, "
            "verbatim (the code `verify` checked), each under a comment naming its file. Written "
            f"by ap.export beside {script_name}, which imports it; needs torch only.", width=116,
            initial_indent=" " * len(RUNTIME_HEADER), break_on_hyphens=False).lstrip(),
        imports="\n\n".join(kit.import_lines(assembly.imports)), kit=assembly.source())
    return text.replace("@IMPORTS@", "\n\n".join(sections)), runtime


def _returns(source: ModelSource, v: ScriptValues, body: str, cell: SplitCell) -> list[str]:
    """What ``build_model`` hands ``main``: the model, and of the cell's data, loss and checkpoint
    the names ``main`` reads that the cell's statements bind (its functions and classes are the
    module's already)."""
    loads = {n.id for n in ast.walk(ast.parse(textwrap.dedent(body))) if isinstance(n, ast.Name)}
    names = [source.inputs_var, source.loss_fn_var, source.make_batch_var, source.dataset_var,
             source.collate_fn_var, "from_config" if v.from_config else None]
    # _build_body's
    bound = set(cell.globals) | set(cell.unused) | _bound_in(cell.body) | {"from_config"}
    return list(dict.fromkeys([source.model_var,
                               *(n for n in names if n and n in loads and n in bound)]))


def _bound_in(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)
            and not isinstance(n.ctx, ast.Load)}


def _build_body(cell: SplitCell, v: ScriptValues, returns: list[str]) -> str:
    """``build_model``'s body: ``global`` for the names the cell's functions read, the statements
    (under ``FromConfig`` where its ``from_pretrained`` weights are read after ``parallelize``, on
    the meta device under ``meta_init``), and the ``return``."""
    names = [n for n in cell.globals + cell.unused if n not in returns or n in cell.globals]
    lines = ([f"global {', '.join(names)}  # the cell's names its functions read (or nothing does)"]
             if names else [])
    code = cell.body
    if v.from_config:
        code = ("from_config = FromConfig().start()  # from_pretrained: the checkpoint's config "
                "here, its weights after parallelize\n" + code + "\nfrom_config.stop()")
    if v.meta_init:
        code = ("torch.set_default_device(\"meta\")  # too large to build whole: shapes only, no "
                "storage\n" + code
                + "\ntorch.set_default_device(None)")
    return _indent("\n".join([*lines, code, f"return {', '.join(returns)}"]))


def _indent(code: str, pad: str = "    ") -> str:
    """``code`` indented by ``pad``, except the lines inside a multi-line string (whose text would
    change)."""
    inside = set()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
            inside |= set(range(tok.start[0] + 1, tok.end[0] + 1))
    return "\n".join(pad + line if line.strip() and i not in inside else line
                     for i, line in enumerate(code.splitlines(), 1))


def _merged(script: set, cell: set) -> set:
    """The script's imports and the cell's, one statement per name: a name the cell imports from
    elsewhere than the script's own lines do is an error (say which to rename)."""
    bound = {i[2] or i[1] or i[0].split(".")[0]: i for i in script}
    for what in cell:
        name = what[2] or what[1] or what[0].split(".")[0]
        if name in bound and bound[name] != what and not (what[1] is None and what[2] is None):
            raise ValueError(f"the cell imports {name!r} as {what}, but the exported script uses "
                             f"{name!r} for {bound[name]}: import it under another name in the "
                             "cell")
    return script | cell


def _from_import(module: str, names: list[str]) -> str:
    """``from module import names`` as ruff's isort writes it (one name a line past 120 columns)."""
    line = f"from {module} import {', '.join(names)}"
    return line if len(line) <= 120 else (f"from {module} import "
                                          "(\n") + "".join(f"    {n},\n" for n in names) + ")"
