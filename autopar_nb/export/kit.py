"""The runtime's own source, assembled for a script: the named functions of
:mod:`autopar_nb.runtime` and everything they use, verbatim.

Each runtime module imports only the standard library and torch and holds imports, functions,
classes and constants. For the names a script calls, :func:`assemble` follows every global name each
definition uses: a name another runtime module defines is taken along (its source, recursively), a
name the module imports becomes that import in the script, a constant its assignment. The script
therefore runs the very code that the runtime's tests exercise, and a test compares the two texts.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
import sysconfig
from dataclasses import dataclass, field
from functools import cache

from .. import runtime

STDLIB = set(sys.stdlib_module_names)
INSTALLED = ("stdlib", "platstdlib", "purelib", "platlib")
"""``sysconfig`` paths whose modules are installed ones (third party for isort)"""
ORDER = ("mesh", "deathsig", "data", "fused_loss", "fused_norm", "float8", "cp", "tp", "async_tp",
         "layouts", "heads", "ac", "compile", "fsdp", "ddp", "ep", "batchnorm", "pp_graph",
         "pp_split", "pp", "init", "amp", "optim", "guard", "units", "checkpoint", "metrics",
         "train")
"""the runtime's modules in the order a reader meets them in a script: set-up, the techniques, the
training loop"""


@dataclass
class Module:
    """What one runtime module defines at its top level."""

    name: str
    source: str
    imports: dict[str, tuple[str, str | None, str | None]] = field(default_factory=dict)
    """bound name -> (module, imported name or None for ``import module``, alias or None)"""
    relative: dict[str, tuple[str, str]] = field(default_factory=dict)
    """bound name -> (sibling runtime module, name there)"""
    definitions: dict[str, ast.stmt] = field(default_factory=dict)
    """function, class or constant name -> its statement"""

    def segment(self, name: str) -> str:
        """The source of a definition, decorators and the comment lines right above it included."""
        node = self.definitions[name]
        lines = self.source.splitlines()
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        return "\n".join(lines[first:node.end_lineno])


@cache
def _module(name: str) -> Module:
    mod = importlib.import_module(f"{runtime.__name__}.{name}")
    source = inspect.getsource(mod)
    out = Module(name, source)
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            for a in node.names:
                out.imports[a.asname or a.name.split(".")[0]] = (a.name, None, a.asname)
        elif isinstance(node, ast.ImportFrom) and node.level:
            for a in node.names:
                out.relative[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for a in node.names:
                out.imports[a.asname or a.name] = (node.module, a.name, a.asname)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.definitions[node.name] = node
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            out.definitions[node.targets[0].id] = node
    return out


def modules() -> list[str]:
    """The runtime's modules, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(runtime.__path__)
                  if not m.name.startswith("_"))


def where(name: str) -> str:
    """The runtime module that defines ``name``."""
    found = [m for m in modules() if name in _module(m).definitions]
    if not found:
        raise KeyError(f"no runtime module defines {name!r}")
    if len(found) > 1:
        raise RuntimeError(f"{name!r} is defined in {len(found)} runtime modules "
                           f"({', '.join(found)}): one name, one meaning")
    return found[0]


def _free_names(node: ast.AST) -> list[str]:
    """Names a definition reads but does not bind itself (arguments, assignments, loop and ``with``
    targets, local imports, nested definitions), in order of first use: its globals."""
    local: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            local.add(n.arg)
        elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            local.add(n.id)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            local.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            local |= {a.asname or a.name.split(".")[0] for a in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n is not node:
            local.add(n.name)
    seen: dict[str, None] = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local:
            seen.setdefault(n.id, None)
    return list(seen)


@dataclass
class Assembly:
    """Definitions (in dependency order: what a definition uses comes before it) and the imports
    they need."""

    blocks: list[tuple[str, str, str]] = field(default_factory=list)
    """(module, name, source)"""
    imports: set[tuple[str, str | None, str | None]] = field(default_factory=set)

    @property
    def names(self) -> list[str]:
        return [name for _, name, _ in self.blocks]

    def source(self) -> str:
        """The definitions grouped by runtime module (in :data:`ORDER`), each group under a comment
        naming its file, each definition where it is in that file."""
        def key(block):
            module, name, _ = block
            rank = ORDER.index(module) if module in ORDER else len(ORDER)
            return rank, module, _module(module).definitions[name].lineno

        out, current = [], None
        for module, _, text in sorted(self.blocks, key=key):
            if module != current:
                current = module
                text = f"# autopar_nb/runtime/{module}.py\n{text}"
            out.append(text)
        return "\n\n\n".join(out)


def assemble(names: list[str]) -> Assembly:
    """The runtime definitions ``names`` and all they use (see the module docstring)."""
    out = Assembly()
    done: set[tuple[str, str]] = set()
    bound: dict[str, tuple] = {}

    def bind(name: str, what: tuple) -> None:
        if bound.setdefault(name, what) != what:
            raise RuntimeError(f"runtime name {name!r} means two things: {bound[name]} and {what}")

    def visit(module: str, name: str) -> None:
        if (module, name) in done:
            return
        done.add((module, name))
        mod = _module(module)
        node = mod.definitions[name]
        bind(name, ("def", module))
        for used in _free_names(node):
            if used == name or hasattr(builtins, used):
                continue
            if used in mod.definitions:
                visit(module, used)
            elif used in mod.relative:
                sibling, original = mod.relative[used]
                if original != used:
                    raise RuntimeError(f"runtime/{module}.py imports {original} as {used}: keep "
                                       "runtime names as they are defined")
                visit(sibling, used)
            elif used in mod.imports:
                bind(used, mod.imports[used])
                out.imports.add(mod.imports[used])
            else:
                raise RuntimeError(f"runtime/{module}.py: {name} uses {used!r}, which the module "
                                   "neither defines nor imports")
        out.blocks.append((module, name, mod.segment(name)))

    for name in names:
        visit(where(name), name)
    return out


EARLY = "end_with_the_agent"
"""what a script runs first, before torch's import (``runtime/deathsig.py``: torchrun's agent may
die meanwhile)"""


def with_early(imports: set[tuple[str, str | None, str | None]],
               extra: set = frozenset()) -> list[str]:
    """A script's import sections (:func:`import_lines` of ``imports`` and ``extra``), :data:`EARLY`
    run between ``from __future__`` and them: its imports (not repeated below), then under ``if
    __name__ == "__main__":`` its source (verbatim) and its call. Inside the ``if``, the imports
    below stay at the top of the file for linters (E402)."""
    assembly = assemble([EARLY])
    body = "\n".join(f"    {line}" if line else "" for line in assembly.source().splitlines())
    block = (f'if __name__ == "__main__":  # first, before torch\'s import, which torchrun\'s '
             'agent may not outlive\n' f"{body}\n    {EARLY}()")
    future, *early = import_lines(assembly.imports)
    rest = import_lines({i for i in imports if i not in assembly.imports}, extra)[1:]
    return [future, *early, block, *rest]


def import_lines(imports: set[tuple[str, str | None, str | None]],
                 extra: set = frozenset()) -> list[str]:
    """``import`` statements as ruff's isort writes them: standard library, third party, then first
    party (what is not installed: :func:`first_party`); plain imports before ``from`` imports; names
    ordered constants, classes, functions."""
    everything = {_from_form(i) for i in set(imports) | set(extra)}
    sections = ["from __future__ import annotations"]
    kind = {m: 0 if m in STDLIB else 2 if first_party(m) else 1
            for m in {i[0].split(".")[0] for i in everything}}
    for section in (0, 1, 2):
        chosen = [i for i in everything if kind[i[0].split(".")[0]] == section]
        plain = sorted({(m, a) for m, n, a in chosen if n is None}, key=lambda x: x[0].lower())
        lines = [f"import {m}" + (f" as {a}" if a else "") for m, a in plain]
        froms: dict[str, set[str]] = {}
        for m, n, a in chosen:
            if n is not None:
                froms.setdefault(m, set()).add(n + (f" as {a}" if a else ""))
        for m in sorted(froms, key=str.lower):
            names = sorted(froms[m], key=_order_by_type)
            line = f"from {m} import {', '.join(names)}"
            if len(line) > 120:
                line = f"from {m} import (\n" + "".join(f"    {n},\n" for n in names) + ")"
            lines.append(line)
        if lines:
            sections.append("\n".join(lines))
    return sections


@cache
def first_party(module: str) -> bool:
    """Whether ruff's isort would call the top-level ``module`` first party where the script is
    exported and checked: a module found outside the installed packages (a file beside the notebook,
    a package worked on in place) is; an installed one, or one not found here, is not."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) or next(iter(getattr(spec, "submodule_search_locations",
                                                                None) or []), None)
    if spec is None or not origin or origin in ("built-in", "frozen"):
        return False
    roots = {os.path.realpath(p) + os.sep for k, p in sysconfig.get_paths().items()
             if k in INSTALLED and p}
    return not os.path.realpath(origin).startswith(tuple(roots))


def _from_form(what: tuple) -> tuple:
    """``import torch.nn as nn`` as ``from torch import nn`` (the same binding; ruff's PLR0402
    prefers it)."""
    module, name, alias = what
    if name is None and alias and "." in module and module.rsplit(".", 1)[1] == alias:
        return module.rsplit(".", 1)[0], alias, None
    return what


def _order_by_type(name: str) -> tuple[int, str]:
    """isort's order-by-type: CONSTANTS, then Classes, then functions."""
    n = name.split()[0]
    return (0 if n.isupper() and len(n) > 1 else 1 if n[0].isupper() else 2, n)
