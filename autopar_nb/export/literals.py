"""Python source text from plain values, as the exported script writes them: a literal (one line
where it fits, else one item per line), a ``{path: ParallelStyle(...)}`` dict, and a call wrapped at
the script's width. Each literal is read back with ``ast.literal_eval`` before it is used: plain
data only, never code.
"""

from __future__ import annotations

import ast
import json


def literal(value, indent: int = 0, width: int = 120) -> str:
    """``value`` (plain data: numbers, strings, bools, None, lists, tuples, dicts) as Python source
    with double quotes, on one line when it fits ``width`` minus ``indent``, else one item per
    line."""
    text = one_line(value)
    if indent + len(text) > width and isinstance(value, (list, tuple, dict)) and value:
        pad = " " * (indent + 4)
        items = ([f"{one_line(k)}: {literal(v, indent + 4, width)}" for k, v in value.items()]
                 if isinstance(value, dict) else [literal(v, indent + 4, width) for v in value])
        opening, closing = {dict: "{}", list: "[]", tuple: "()"}[type(value)]
        text = (opening + "\n" + "".join(f"{pad}{item},\n" for item in items) + " " * indent
                + closing)
    if ast.literal_eval(text) != value:  # plain data only, never code
        raise ValueError(f"{value!r} is not plain data")
    return text


def one_line(value) -> str:
    if isinstance(value, str):
        # a JSON string is a Python string literal (double quotes, escapes)
        text = json.dumps(value)
        return text if ast.literal_eval(text) == value else repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(one_line(v) for v in value)
        return (f"[{inner}]" if isinstance(value, list)
                else f"({inner}{',' if len(value) == 1 else ''})")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{one_line(k)}: {one_line(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise TypeError(f"{type(value).__name__} is not plain data")


def style_dict(styles: dict, indent: int = 0, width: int = 120) -> str:
    """A ``{path: ParallelStyle(...)}`` literal (nested for block plans), one entry per line,
    wrapped at 120."""
    pad = " " * (indent + 4)
    lines = []
    for path, style in styles.items():
        if isinstance(style, dict):
            lines.append(f"{pad}{one_line(path)}: {style_dict(style, indent + 4, width)},")
            continue
        line = f"{pad}{one_line(path)}: {style.source()},"
        if len(line) > width:
            head, _, args = style.source().partition("(")
            line = f"{pad}{one_line(path)}: {head}(\n{pad}    {args},"
        lines.append(line)
    return "{\n" + "\n".join(lines) + "\n" + " " * indent + "}" if lines else "{}"


def call(target: str, *args: str, indent: int = 0, width: int = 120, **kwargs: str) -> str:
    """``target(args..., key=value...)`` as source (arguments are source text) for a line where
    ``target`` starts at column ``indent``, wrapped at ``width`` with continuation lines aligned to
    the opening parenthesis."""
    items = [*args, *(f"{k}={val}" for k, val in kwargs.items())]
    line = " " * indent + f"{target}("
    lines, pad = [], " " * len(line)
    for i, item in enumerate(items):
        text = item + (")" if i == len(items) - 1 else ",")
        sep = "" if line.endswith("(") else " "
        if len(line) + len(sep) + len(text) > width and sep:
            lines.append(line)
            line, sep = pad, ""
        line += sep + text
    lines.append(line if items else line + ")")
    return "\n".join(lines)[indent:]
