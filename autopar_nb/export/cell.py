"""The notebook cell inside the exported script: verbatim, wrapped where the model is built on the
meta device or from a checkpoint's config, its imports merged with the runtime code's, its names
kept apart from the script's."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from ..source import ModelSource
from .kit import _free_names
from .values import ScriptValues

SCRIPT_NAMES = ("parallelize", "parse_args", "main", "RSS_BEFORE_MODEL")
"""names the template itself defines"""
PRETRAINED = ("FromConfig",)
"""runtime code a script whose cell's ``from_pretrained`` weights are read after ``parallelize``
runs with the cell"""


def script_cell(source: ModelSource, v: ScriptValues) -> str:
    """The cell as the script runs it: under ``FromConfig`` where its ``from_pretrained`` weights
    are read after ``parallelize`` (``v.from_config``), on the meta device under ``meta_init``."""
    cell = source.code.rstrip("\n")
    if v.from_config:
        cell = ("from_config = FromConfig().start()  # from_pretrained: the checkpoint's config "
                "here, its weights after parallelize\n" + cell + "\nfrom_config.stop()")
    if v.meta_init:
        cell = ("torch.set_default_device(\"meta\")  # the model is too large to build whole: "
                "shapes only, no storage\n" + cell + "\ntorch.set_default_device(None)")
    return cell


def weights_lines(v: ScriptValues) -> list[str]:
    """``main``'s lines that give a model built on the meta device its weights once parallelised:
    each rank initialises its shards (``meta_init``), then reads them from the checkpoint the model
    starts from (the cell's ``from_pretrained``, or export's ``weights=``); with CPU offload the
    shards are made on the host and the buffers moved to the device."""
    moved = ["buffers_to(parts, device)  # CPU offload: the parameters stay on the host, the "
             "buffers go to the device"]
    if not v.meta_init:
        return moved * v.offload
    lines = ["materialize(parts, skeleton, device=" + ('"cpu"' if v.offload else "device")
             + ", seed=SEED)  # local shards only, layer by layer"]
    if v.pretrained:
        ties = ", ties=TIES" if v.ties else ""
        path, why = ("WEIGHTS", "the weights it starts from") if v.weights else (
            "from_config.found[-1]", "the cell's from_pretrained")
        lines.append(f"load_pretrained({path}, parts, model=skeleton{ties})  # {why}: these shards")
    return lines + moved * v.offload


def whole_weights_lines(v: ScriptValues, model_var: str) -> list[str]:
    """``main``'s line that reads export's ``weights=`` into a model built whole, before it is
    parallelised (a ``from_pretrained`` cell reads its own; under ``meta_init``
    :func:`weights_lines` reads the shards)."""
    if not v.weights or v.meta_init:
        return []
    ties = ", ties=TIES" if v.ties else ""
    return [f"load_pretrained(WEIGHTS, [{model_var}]{ties})  # the weights the model starts from, "
            "whole"]


def _cell_imports(source: ModelSource) -> dict[str, tuple]:
    """The cell's top-level imports: bound name -> (module, name or None, alias or None), as
    :mod:`.kit` writes them."""
    out = {}
    for node in ast.parse(source.code).body:
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0]: (a.name, None, a.asname) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out |= {a.asname or a.name: (node.module, a.name, a.asname) for a in node.names}
    return out


def without_cell_imports(imports: set, source: ModelSource, *, keep: set) -> set:
    """The script's imports minus those the cell makes itself (the cell runs before the runtime code
    needs them; a second import of the same name would be dead code). ``torch`` and what the
    settings use stay: they are needed before the cell. A cell that binds a name the runtime uses to
    something else is an error."""
    bound = {i[2] or (i[1] if i[1] else i[0].split(".")[0]): i for i in imports}
    out = set(imports)
    for name, what in _cell_imports(source).items():
        if name not in bound:
            continue
        if bound[name] != what and not (what[1] is None and bound[name][1] is None
                                        and what[0].split(".")[0] == name):
            raise ValueError(f"the cell imports {name!r} as {what}, but the exported script's "
                             f"runtime code uses {name!r} for {bound[name]}: import it under "
                             "another name in the cell")
        if bound[name] == what and what not in keep and what != ("torch", None, None):
            out.discard(what)
    return out


def check_names(source: ModelSource, runtime_names: list[str]) -> None:
    """The cell's own top-level names must not be taken by the runtime code the script carries."""
    defined = set()
    for node in ast.parse(source.code).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    taken = sorted(defined & (set(runtime_names) | set(SCRIPT_NAMES)))
    if taken:
        raise ValueError(f"the cell defines {', '.join(taken)}, which the exported script uses for "
                         f"its own code: rename {'it' if len(taken) == 1 else 'them'} in the cell")


@dataclass
class SplitCell:
    """The cell as a two-file script holds it: its imports merged with the script's, its classes,
    functions and literal constants at the top level (where a DataLoader worker unpickling the
    cell's dataset or collate function finds them by name), and its other statements as
    ``build_model``'s body, which runs when ``main`` calls it, not at import."""

    imports: set = field(default_factory=set)
    """(module, name or None, alias or None), as :func:`.kit.import_lines` writes them"""
    top: str = ""
    body: str = ""
    """the statements, unindented"""
    globals: list[str] = field(default_factory=list)
    """names the body binds that the top-level functions read: declared ``global`` there"""
    unused: list[str] = field(default_factory=list)
    """names the body binds that nothing in the cell reads"""


def split_cell(code: str) -> SplitCell:
    """``code`` split as :class:`SplitCell` describes, each statement with the comments above it. A
    statement the top level needs at definition time (a decorator's, default's or base class's name)
    moves up with it."""
    tree = ast.parse(code)
    lines = code.splitlines()
    segments, top, out, start = [], [], SplitCell(), 0
    for node in tree.body:
        text = "\n".join(lines[start:node.end_lineno]).strip("\n")
        start = node.end_lineno
        if isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom) and not node.level:
            out.imports |= {_import_tuple(node, a) for a in node.names
                            if getattr(node, "module", "") != "__future__"}
            text = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
            top.append(True)
        else:
            top.append(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                       or _constant(node))
        segments.append((node, text))
    changed = True
    while changed:  # what a top-level definition needs when it is defined moves up with it
        needed = {n for (node, _), up in zip(segments, top, strict=True) if up
                  for n in _definition_names(node)}
        changed = False
        for i, (node, _) in enumerate(segments):
            if not top[i] and _bound(node) & needed:
                top[i] = changed = True
    tops = [(node, text) for (node, text), up in zip(segments, top, strict=True) if up and text]
    out.top = "\n".join(text + ("\n\n" if isinstance(node, (ast.FunctionDef, ast.ClassDef)) or (
        j + 1 < len(tops) and isinstance(tops[j + 1][0], (ast.FunctionDef, ast.ClassDef))) else "")
                        for j, (node, text) in enumerate(tops)).strip("\n")
    body = [(node, text) for (node, text), up in zip(segments, top, strict=True) if not up]
    out.body = "\n".join(text for _, text in body)
    # their globals, not their own locals
    read_above = {n for node, _ in tops for n in _free_names(node)}
    read_here = {n for node, _ in body for n in _loads(node)}
    bound = [n for node, _ in body for n in sorted(_bound(node))]
    out.globals = list(dict.fromkeys(n for n in bound if n in read_above))
    out.unused = list(dict.fromkeys(n for n in bound if n not in read_above | read_here))
    return out


def _import_tuple(node: ast.stmt, alias: ast.alias) -> tuple:
    if isinstance(node, ast.Import):
        return alias.name, None, alias.asname
    return node.module, alias.name, alias.asname


def _constant(node: ast.stmt) -> bool:
    """``NAME = <literal>``: the cell's constants, which its classes may read as they are
    defined."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    try:
        ast.literal_eval(node.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return all(isinstance(t, ast.Name) for t in targets)


def _bound(node: ast.stmt) -> set[str]:
    """The module-level names a statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {a.asname or a.name.split(".")[0] for a in n.names}
    return out


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _definition_names(node: ast.stmt) -> set[str]:
    """Names a top-level statement reads as it runs: a function's decorators, defaults and
    annotations, a class's bases and body (its methods' bodies run later), a constant's value."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        parts = [*node.decorator_list, *a.defaults, *(d for d in a.kw_defaults if d is not None),
                 node.returns, *(x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs,
                                                        a.vararg, a.kwarg] if x)]
        return {n for p in parts if p is not None for n in _loads(p)}
    if isinstance(node, ast.ClassDef):
        return {n for p in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
                for n in _loads(p)} \
            | {n for s in node.body for n in _definition_names(s)}
    return _loads(node)
