"""The notebook cell inside the exported script: verbatim, wrapped where the model is built on the meta device or
from a checkpoint's config, its imports merged with the runtime code's, its names kept apart from the script's."""

from __future__ import annotations

import ast

from ..source import ModelSource
from .values import ScriptValues

SCRIPT_NAMES = ("parallelize", "parse_args", "main", "RSS_BEFORE_MODEL")
"""names the template itself defines"""
PRETRAINED = ("FromConfig", "load_pretrained")
"""runtime code a script whose cell's ``from_pretrained`` weights are read after ``parallelize`` carries"""


def script_cell(source: ModelSource, v: ScriptValues) -> str:
    """The cell as the script runs it: under ``FromConfig`` where its ``from_pretrained`` weights are read after
    ``parallelize`` (``v.pretrained``), on the meta device under ``meta_init``."""
    cell = source.code.rstrip("\n")
    if v.pretrained:
        cell = ("from_config = FromConfig().start()  # from_pretrained: the checkpoint's config here, its weights "
                "after parallelize\n" + cell + "\nfrom_config.stop()")
    if v.meta_init:
        cell = ("torch.set_default_device(\"meta\")  # the model is too large to build whole: shapes only, no "
                "storage\n" + cell + "\ntorch.set_default_device(None)")
    return cell


def weights_lines(v: ScriptValues) -> list[str]:
    """``main``'s lines that give a model built on the meta device its weights once parallelised: each rank
    initialises its shards (``meta_init``), then reads them from the cell's ``from_pretrained`` checkpoint."""
    lines = ["materialize(parts, skeleton, device=device, seed=SEED)  # local shards only, layer by layer"]
    if v.pretrained:
        ties = ", ties=TIES" if v.ties else ""
        lines.append(f"load_pretrained(from_config.found[-1], parts{ties})  # the cell's from_pretrained: these shards")
    return lines if v.meta_init else []


def _cell_imports(source: ModelSource) -> dict[str, tuple]:
    """The cell's top-level imports: bound name -> (module, name or None, alias or None), as :mod:`.kit` writes them."""
    out = {}
    for node in ast.parse(source.code).body:
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name.split(".")[0]: (a.name, None, a.asname) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out |= {a.asname or a.name: (node.module, a.name, a.asname) for a in node.names}
    return out


def without_cell_imports(imports: set, source: ModelSource, *, keep: set) -> set:
    """The script's imports minus those the cell makes itself (the cell runs before the runtime code needs them; a
    second import of the same name would be dead code). ``torch`` and what the settings use stay: they are needed
    before the cell. A cell that binds a name the runtime uses to something else is an error."""
    bound = {i[2] or (i[1] if i[1] else i[0].split(".")[0]): i for i in imports}
    out = set(imports)
    for name, what in _cell_imports(source).items():
        if name not in bound:
            continue
        if bound[name] != what and not (what[1] is None and bound[name][1] is None and what[0].split(".")[0] == name):
            raise ValueError(f"the cell imports {name!r} as {what}, but the exported script's runtime code uses "
                             f"{name!r} for {bound[name]}: import it under another name in the cell")
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
        raise ValueError(f"the cell defines {', '.join(taken)}, which the exported script uses for its own code: "
                         f"rename {'it' if len(taken) == 1 else 'them'} in the cell")
