"""A failed parallel run told in one line: which rank failed first, where in the user's code (the cell's line, else
the exported script's), and its error — not torchrun's ``ChildFailedError`` box, which stays one attribute away
(``details``)."""

from __future__ import annotations

import re

FRAME = re.compile(r'^ *File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?: {4,}(?P<text>[^\n]*))?',
                   re.M)
"""one frame of a Python traceback, with its source line when the traceback shows it"""
LIBRARY = re.compile(r"[/\\](site-packages|dist-packages|lib/python3\.\d+|autopar_nb|kernels_ext)[/\\]")
"""files that are not the user's: installed packages, the standard library, this package"""


def where_failed(traceback_text: str, code: str | None = None) -> str:
    """Where a traceback's failure is in the user's code: its innermost frame outside libraries (:data:`LIBRARY`;
    the exported script is the user's), as "cell line N (`text`)" when that line is one of ``code``'s, else "FILE
    line N in FUNCTION (`text`)"; "" when every frame is a library's."""
    frames = [m for m in FRAME.finditer(traceback_text or "") if not LIBRARY.search(m["file"])]
    if not frames:
        return ""
    m = frames[-1]
    text = (m["text"] or "").strip()
    lines = [line.strip() for line in (code or "").splitlines()]
    if text and text in lines:
        return f"cell line {lines.index(text) + 1} (`{text}`)"
    name = m["file"].replace("\\", "/").rsplit("/", 1)[-1]
    return f"{name} line {m['line']} in {m['fn'].strip()}" + (f" (`{text}`)" if text else "")


class VerifyError(RuntimeError):
    """A verify's parallel run failed. The message is one line; ``details`` holds the whole account (tracebacks,
    torchrun's report)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class RankFailed(VerifyError):
    """A rank of the parallel run failed: the message names the rank that failed first, where in the user's code
    (the cell's line, else the script's) and its error."""

    @classmethod
    def of(cls, e, codes: list[str]) -> RankFailed:
        """From torch's ``ChildFailedError`` ``e`` of a launch running the cells ``codes``."""
        rank, failure = e.get_first_failure()
        data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
        message = data.get("message", "") if isinstance(data, dict) else str(data or failure.message)
        stack = data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""
        sites = [where_failed(stack, code) for code in codes]
        where = next((w for w in sites if w.startswith("cell line")), sites[0] if sites else "")
        head = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
        return cls(f"rank {rank} failed" + (f" at {where}" if where else "") + f": {head}",
                   f"{stack}\n{e}".strip())
