"""Running a model cell on the meta device and finding what it defines.

Workers and exported scripts re-run the cell on their own, so the cell must be self-contained: names
it uses but does not define are found here (with ``symtable``) before anything runs. The cell runs
in a copy of the user's namespace; the user's namespace is updated only when everything succeeded.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import symtable
import traceback
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import IterableDataset

from ..plan import FIX_ALIASES, FIX_KEYS
from ..runtime.data import first_tensor
from ..source import EXAMPLE_SAMPLES, ModelSource

INPUT_NAMES = ("example_inputs", "inputs", "example_input", "batch")
# names IPython puts in every namespace: a cell may not rely on them, but we don't report them as
# "earlier cells"
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "display", "_", "__", "___"}


class CellError(ValueError):
    """A problem with the user's cell; the message says what to do. The magic shows it without a
    traceback."""


@dataclass
class CellResult:
    """What a model cell defined."""

    source: ModelSource
    model: nn.Module
    example_inputs: Any
    namespace: dict[str, Any]
    bound: dict[str, Any]
    """the names the cell bound or rebound: what to copy into the user's namespace once everything
    succeeded"""
    included_cells: list[int]
    """history indices of earlier cells prepended with --include-cells"""
    model_inputs: Any = None
    """what the model is called with on the example (``ModelSource.model_inputs``): what capture
    traces"""
    per_rank_batch: int | None = None
    """samples the cell's ``make_batch(0, 0)`` returns: what each data-parallel rank trains on per
    step"""


def free_names(code: str, first_line: int = 1) -> set[str]:
    """Names the code reads but never binds (at module level or as globals of its functions), minus
    builtins. ``first_line``: the number of the code's first line in a syntax error's message."""
    try:
        table = symtable.symtable(code, "<cell>", "exec")
    except SyntaxError as e:
        text = f" (`{e.text.strip()}`)" if e.text and e.text.strip() else ""
        raise CellError(f"syntax error in the cell, line {(e.lineno or 1) + first_line - 1}{text}: "
                        f"{e.msg}") from None
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    free: set[str] = set()

    def visit(t: symtable.SymbolTable, top: bool) -> None:
        for s in t.get_symbols():
            if not s.is_referenced():
                continue
            if (top and not (s.is_assigned() or s.is_imported())) or (not top and s.is_global()):
                free.add(s.get_name())
        for child in t.get_children():
            visit(child, False)

    visit(table, True)
    return {n for n in free - bound if not hasattr(builtins, n)
            and not (n.startswith("__") and n.endswith("__"))}


def bound_names(code: str) -> set[str]:
    """Names a cell binds at module level (assignments, imports, defs, classes)."""
    try:
        table = symtable.symtable(code, "<cell>", "exec")
    except SyntaxError:
        return set()
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


def with_earlier_cells(code: str, history: list[str]) -> tuple[str, list[int]]:
    """Prepend the latest earlier cells (from ``history``, oldest first) that define the names
    ``code`` lacks, transitively. Returns the combined code and the history indices used. Cells
    containing IPython magics are never included (a plain script cannot run them)."""
    used: list[int] = []
    combined = code
    for _ in range(len(history)):
        added = False
        for name in sorted(free_names(combined) - _IPYTHON_NAMES):
            for i in range(len(history) - 1, -1, -1):
                cell = history[i]
                if i not in used and "get_ipython()" not in cell and name in bound_names(cell):
                    used.append(i)
                    added = True
                    break
        if not added:
            break
        combined = "\n\n".join([*(history[i].rstrip() for i in sorted(used)), code])
    return combined, sorted(used)


def run_model_cell(code: str, user_ns: dict[str, Any], *, model_var: str | None = None,
                   inputs_var: str | None = None, history: list[str] | None = None,
                   include_cells: bool = False, first_line: int = 1) -> CellResult:
    """Run ``code`` on the meta device in a copy of ``user_ns``, find the model and example inputs,
    and return what the cell bound in ``CellResult.bound`` for the caller to copy into ``user_ns``
    once everything else succeeded. Raises :class:`CellError` on any problem; ``user_ns`` is never
    modified here. ``first_line``: the number of the code's first line where the user sees it
    (:attr:`ModelSource.first_line`)."""
    included: list[int] = []
    missing = free_names(code, first_line) - _IPYTHON_NAMES
    if missing and include_cells:
        code, included = with_earlier_cells(code, history or [])
        missing = free_names(code, first_line) - _IPYTHON_NAMES
    earlier = sorted(n for n in missing if n in user_ns)
    if earlier:
        raise CellError(
            f"the cell uses {', '.join(earlier)} from earlier cells; worker processes and the "
            "exported script run this cell on its own, so move "
            f"{'its definition' if len(earlier) == 1 else 'their definitions'} (and imports) into "
            "the cell, or add --include-cells to prepend the earlier cells that define them")

    ns = dict(user_ns)
    before = {k: id(v) for k, v in ns.items()}
    source = ModelSource(code, first_line=first_line)
    try:
        source.run(ns, device="meta", seed=0)
    except Exception as e:
        raise CellError(_describe_user_error(e, source)) from None
    bound = {k: v for k, v in ns.items() if k != "__builtins__" and before.get(k) != id(v)}

    model_var = model_var or _find_model(bound)
    model = _require(ns, model_var, nn.Module, "--model", "an nn.Module instance")
    loss_fn = "loss_fn" if callable(ns.get("loss_fn")) and "loss_fn" in bound else None
    make_batch = "make_batch" if callable(ns.get("make_batch")) and "make_batch" in bound else None
    dataset = _find_dataset(bound)
    collate_fn = ("collate_fn" if dataset and callable(ns.get("collate_fn"))
                  and "collate_fn" in bound else None)
    if dataset and not inputs_var and not any(n in bound and _is_inputs(bound[n])
                                              for n in INPUT_NAMES):
        inputs_var = None  # the dataset's first samples are the example
        source = ModelSource(code, model_var, None, loss_fn, make_batch, dataset, collate_fn,
                             first_line=first_line)
        try:
            example_inputs = source.example_inputs(ns)
        except Exception as e:
            raise CellError(f"collating the first samples of {dataset!r} into example inputs "
                            f"failed: {_describe_user_error(e, source)}; bind example_inputs in "
                            "the cell") from None
        if not _is_inputs(example_inputs):
            raise CellError(f"the samples of {dataset!r}, collated, are a "
                            f"{type(example_inputs).__name__}, not a tensor, tuple or dict of "
                            "tensors; give the cell a collate_fn that makes one")
    elif make_batch and not inputs_var and not any(_is_inputs(v) for k, v in bound.items()
                                                   if not k.startswith("_")):
        inputs_var = None  # make_batch(0, 0) is the example
        source = ModelSource(code, model_var, None, loss_fn, make_batch, first_line=first_line)
        example_inputs = _make_batch_example(source, ns)
    else:
        inputs_var = inputs_var or _find_inputs(bound)
        example_inputs = _require(ns, inputs_var, object, "--inputs", "example inputs")

    source = ModelSource(code, model_var, inputs_var, loss_fn, make_batch, dataset, collate_fn,
                         first_line=first_line)
    source = dataclasses.replace(source, rows_per_sample=rows_per_sample(source, ns))
    return CellResult(source, model, example_inputs, ns, bound, included,
                      _model_inputs(source, ns, example_inputs), _per_rank_batch(source, ns))


def _make_batch_example(source: ModelSource, ns: dict[str, Any]) -> Any:
    example = _first_batch(source, ns, "for the example inputs")
    if not _is_inputs(example):
        raise CellError(f"{source.make_batch_var}(0, 0) returned a {type(example).__name__}, not a "
                        "tensor, tuple or dict of tensors")
    return example


def _per_rank_batch(source: ModelSource, ns: dict[str, Any]) -> int | None:
    """The samples of ``make_batch(0, 0)``, or None without make_batch."""
    if source.make_batch_var is None:
        return None
    return int(first_tensor(_first_batch(source, ns, "to read its batch size")).shape[0])


def collated_rows(source: ModelSource, ns: dict[str, Any], samples: int) -> tuple[int, int] | None:
    """(samples read, rows the cell's ``collate_fn`` makes of them) for the first ``samples`` of its
    dataset, read on the meta device as the example is; None without a dataset and collate_fn
    (torch's default collate makes one row of each sample) or where reading fails (the run says why
    in its own words)."""
    if source.dataset_var is None or source.make_batch_var or source.collate_fn_var is None:
        return None
    dataset = ns[source.dataset_var]
    try:
        with torch.device("meta"):
            items = list(islice(iter(dataset), samples)) if isinstance(
                dataset,
                IterableDataset) else [dataset[i] for i in range(min(samples, len(dataset)))]
            return len(items), int(first_tensor(ns[source.collate_fn_var](items)).shape[0])
    except Exception:
        return None


def rows_per_sample(source: ModelSource, ns: dict[str, Any]) -> int:
    """The rows the cell's ``collate_fn`` makes of each sample, read from the first
    :data:`EXAMPLE_SAMPLES` samples (a collate_fn that packs two rows of each makes 2); 1 without a
    collate_fn, or where the rows are not a whole multiple of the samples (a packing collate_fn:
    ``collate_note`` says what the run trains then)."""
    read = collated_rows(source, ns, EXAMPLE_SAMPLES)
    if read is None or not read[0] or read[1] % read[0]:
        return 1
    return max(1, read[1] // read[0])


def _first_batch(source: ModelSource, ns: dict[str, Any], why: str) -> Any:
    """``make_batch(0, 0)`` called on the meta device (no storage); its failure as one CellError."""
    try:
        with torch.device("meta"):
            return ns[source.make_batch_var](0, 0)
    except Exception as e:
        raise CellError(f"calling {source.make_batch_var}(0, 0) {why} failed: "
                        f"{_describe_user_error(e, source)}; bind example_inputs in the cell, or "
                        "fix make_batch") from None


def _model_inputs(source: ModelSource, ns: dict[str, Any], example: Any) -> Any:
    """What capture traces the model on (``ModelSource.model_inputs``), its failures as one line."""
    if source.loss_fn_var is None and isinstance(example, (tuple, list)):
        try:
            inspect.signature(ns[source.model_var].forward).bind(*example)
        except TypeError as e:
            raise CellError(
                f"the model's forward does not take the batch's {len(example)} parts ({e}); define "
                "loss_fn(model, batch) to say how a batch feeds the model, e.g. `def "
                "loss_fn(model, batch): x, y = batch; return F.cross_entropy(model(x), "
                "y)`") from None
    try:
        return source.model_inputs(ns, example)
    except Exception as e:
        raise CellError(f"finding how {source.loss_fn_var}(model, batch) calls the model on the "
                        f"example batch failed: {_describe_user_error(e, source)}") from None


def parse_fix(text: str | None) -> dict[str, Any]:
    """``"tp=2,zero=3,amp=bf16"`` -> ``{"tp": 2, "zero_stage": 3, "amp": "bf16"}`` (see
    FIX_KEYS)."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = FIX_ALIASES.get(key.strip(), key.strip())
        if not sep or key not in FIX_KEYS:
            raise CellError(f"--fix {item!r}: expected KEY=VALUE with KEY one of "
                            f"{', '.join(FIX_KEYS)} (aliases: "
                            f"{', '.join(f'{a}={k}' for a, k in FIX_ALIASES.items())})")
        value = value.strip()
        out[key] = int(value) if value.isdigit() else value
    return out


# ---- helpers -------------------------------------------------------------------------------------
def _find_model(bound: dict[str, Any]) -> str:
    mods = {k: v for k, v in bound.items() if isinstance(v, nn.Module) and not k.startswith("_")}
    if "model" in mods:
        return "model"
    inner = {id(m) for v in mods.values() for m in v.modules() if m is not v}
    top = sorted(k for k, v in mods.items() if id(v) not in inner)
    if len(top) == 1:
        return top[0]
    if not top:
        raise CellError("no model found: the cell binds no nn.Module instance; end it with e.g. "
                        "`model = MyModel()` (or name the variable with --model NAME)")
    raise CellError(f"the cell binds several models ({', '.join(top)}); name the one to plan with "
                    "--model NAME or call it `model`")


def _find_dataset(bound: dict[str, Any]) -> str | None:
    """The ``torch.utils.data.Dataset`` the cell binds: ``dataset``, else the only one; None when
    there is none."""
    from torch.utils.data import Dataset

    found = sorted(k for k, v in bound.items() if isinstance(v, Dataset) and not k.startswith("_"))
    if "dataset" in found or not found:
        return "dataset" if found else None
    if len(found) > 1:
        raise CellError(f"the cell binds several datasets ({', '.join(found)}); call the one to "
                        "train on `dataset`")
    return found[0]


def _is_inputs(v: Any) -> bool:
    """A tensor, or a non-empty tuple, list or str-keyed dict of them, nested (``(inputs, labels)``
    with a dict of inputs: the cell's ``loss_fn`` unpacks it)."""
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (tuple, list)) and v:
        return all(_is_inputs(x) for x in v)
    if isinstance(v, dict) and v:
        return all(isinstance(k, str) and _is_inputs(x) for k, x in v.items())
    return False


def _find_inputs(bound: dict[str, Any]) -> str:
    for name in INPUT_NAMES:
        if name in bound and _is_inputs(bound[name]):
            return name
    candidates = sorted(k for k, v in bound.items() if _is_inputs(v) and not k.startswith("_"))
    if len(candidates) == 1:
        return candidates[0]
    hint = ("define `example_inputs = (torch.randint(0, vocab, (batch, seq)),)` (a tensor, tuple "
            "or dict of tensors) in the cell, or name the variable with --inputs NAME")
    if not candidates:
        raise CellError(f"no example inputs found: {hint}")
    raise CellError(f"several tensors could be the example inputs ({', '.join(candidates)}): "
                    f"{hint}")


def _require(ns: dict[str, Any], name: str, kind: type, option: str, what: str) -> Any:
    if name not in ns:
        raise CellError(f"{option} {name}: the cell defines no variable {name!r}")
    value = ns[name]
    if kind is nn.Module and not isinstance(value, nn.Module):
        raise CellError(f"{option} {name}: {name!r} is a {type(value).__name__}, not {what}")
    if kind is object and not _is_inputs(value):
        raise CellError(f"{option} {name}: {name!r} is a {type(value).__name__}; example inputs "
                        "must be a tensor, a tuple/list of tensors or a dict of tensors")
    return value


def _describe_user_error(e: BaseException, source: ModelSource) -> str:
    line = ""
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_filename == source.filename:
            # ModelSource.run numbers the lines as the notebook does
            line = f" (cell line {lineno})"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"the cell raised {type(e).__name__}{line}: {msg}"
