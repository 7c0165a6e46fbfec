"""Failures told in one line, at the user's code: a capture's (the module of the model and the
user's line that called it), and a parallel run's (which rank failed first, where in the cell or the
exported script, and its error — not torchrun's ``ChildFailedError`` box, which stays one attribute
away: ``details``)."""

from __future__ import annotations

import linecache
import re
import traceback

FRAME = re.compile(r'^ *File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?: '
                   r'{4,}(?P<text>[^\n]*))?', re.M)
"""one frame of a Python traceback, with its source line when the traceback shows it"""
LIBRARY = re.compile(
    r"[/\\](site-packages|dist-packages|lib/python3\.\d+|autopar_nb|kernels_ext)[/\\]")
"""files that are not the user's: installed packages, the standard library, this package"""


def where_failed(traceback_text: str, code: str | None = None, first_line: int = 1) -> str:
    """Where a traceback's failure is in the user's code: its innermost frame outside libraries
    (:data:`LIBRARY`; the exported script is the user's), as "cell line N (`text`)" when that line
    is one of ``code``'s, else "FILE line N in FUNCTION (`text`)"; "" when every frame is a
    library's. ``first_line``: the number of the code's first line where the user sees it
    (``ModelSource.first_line``)."""
    frames = [m for m in FRAME.finditer(traceback_text or "") if not LIBRARY.search(m["file"])]
    if not frames:
        return ""
    m = frames[-1]
    text = (m["text"] or "").strip()
    lines = [line.strip() for line in (code or "").splitlines()]
    if text and text in lines:
        return f"cell line {lines.index(text) + first_line} (`{text}`)"
    name = m["file"].replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name} line {m['line']} in {m['fn'].strip()}" + (f" (`{text}`)" if text else "")


def where_in_model(e: BaseException, model, paths: dict[int, str]) -> str:
    """' in module h.0.mlp.fc (Linear), called at file:line: `code`': the deepest module of the
    model in the traceback, and the deepest frame of the user's own code (not torch's or this
    package's) that a module of the model runs; '' when no module of the model is in it."""
    deepest = user = None
    # here, not at the top: launch's monitor reads failures without paying torch's import
    import torch
    import torch.nn as nn

    skip = (torch.__file__.rsplit("/", 1)[0], __file__.rsplit("/", 1)[0])
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        code = frame.f_code
        me = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if isinstance(me, nn.Module) and id(me) in paths:
            deepest = (paths[id(me)] or "<model>", type(me).__name__)
            if not code.co_filename.startswith(skip):
                user = (code.co_filename, lineno)
    if deepest is None:
        return ""
    out = f" in module {deepest[0]} ({deepest[1]})"
    if user is not None:
        line = linecache.getline(user[0], user[1]).strip()
        # a cell has no file
        at = f"cell line {user[1]}" if user[0].startswith("<") else f"{user[0]}:{user[1]}"
        out += f", called at {at}" + (f": `{line}`" if line else "")
    return out


class VerifyError(RuntimeError):
    """A verify's parallel run failed. The message is one line; ``details`` holds the whole account
    (tracebacks, torchrun's report)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class RankFailed(VerifyError):
    """A rank of the parallel run failed: the message names the rank that failed first, where in the
    user's code (the cell's line, else the script's) and its error."""

    @classmethod
    def of(cls, e, sources: list) -> RankFailed:
        """From torch's ``ChildFailedError`` ``e`` of a launch running the cells of ``sources``
        (ModelSources)."""
        rank, failure = e.get_first_failure()
        data = failure.error_file_data.get("message") if isinstance(failure.error_file_data,
                                                                    dict) else None
        message = data.get("message", "") if isinstance(data, dict) else str(data
                                                                             or failure.message)
        stack = data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""
        sites = [where_failed(stack, src.code, src.first_line) for src in sources]
        where = next((w for w in sites if w.startswith("cell line")), sites[0] if sites else "")
        head = message.strip().splitlines()[-1] if message.strip() else ("exit code "
                                                                         f"{failure.exitcode}")
        return cls(f"rank {rank} failed" + (f" at {where}" if where else "") + f": {head}",
                   f"{stack}\n{e}".strip())
