"""DOT to SVG, and the SVG measured: the layout program (the system ``dot``, else the
``graphviz-pure`` wheel's binary, found next to this Python (``sysconfig.get_path("scripts")``)
rather than on the kernel's PATH, which may lack the venv's ``bin``), the drawing's size and boxes,
and the scale at which it fits a viewport with every label legible.
"""

from __future__ import annotations

import html
import re
import shutil
import sys
import sysconfig
from pathlib import Path

NODE_FONT, CLUSTER_FONT, EDGE_FONT = 10, 11, 9
"""DOT font sizes (pt). An SVG point is 4/3 CSS px, so at a view scale of 0.75 the smallest (9 pt)
is 9 px"""
LEGIBLE_SCALE = 9 / (EDGE_FONT * 4 / 3)
"""the smallest view scale at which every label is >= 9 px on screen"""


def dot_string(s: str) -> str:
    """A DOT double-quoted string; newlines become DOT line breaks."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_binary() -> str:
    """Path of the layout program: system ``dot`` if present, else the ``graphviz-pure`` script of
    this Python."""
    found = shutil.which("dot")
    if found:
        return found
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        for name in ("graphviz-pure", "graphviz-pure.exe", "dot"):
            p = Path(folder) / name
            if p.is_file():
                return str(p)
    raise RuntimeError("no graphviz layout program found: install the system package (apt-get "
                       "install graphviz) or the wheel (pip install graphviz-pure) into this "
                       "Python's environment")


def render_svg(dot: str) -> str:
    """Lay out DOT source and return the SVG text (no XML prolog)."""
    import graphviz
    import graphviz.backend.dot_command as dot_command

    dot_command.DOT_BINARY = Path(dot_binary())
    svg = graphviz.Source(dot, engine="dot").pipe(format="svg", encoding="utf-8", quiet=True)
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else svg


_SIZE = re.compile(r'<svg[^>]*?width="([\d.]+)pt"[^>]*?height="([\d.]+)pt"')
_GROUP = re.compile(r'<g id="([^"]+)" class="(?:node|cluster)">(.*?)</g>', re.S)
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def svg_size(svg: str) -> tuple[float, float]:
    """(width, height) of the SVG in points (CSS px = pt * 4/3)."""
    m = _SIZE.search(svg)
    return (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)


def svg_boxes(svg: str) -> dict[str, tuple[float, float, float, float]]:
    """SVG id -> (x0, y0, x1, y1) of every node and cluster's outline, in the SVG's coordinates."""
    out = {}
    for gid, body in _GROUP.findall(svg):
        m = re.search(r"<(?:path|polygon)[^>]*?(?:d|points)=\"([^\"]+)\"", body)
        if m:
            nums = [float(x) for x in _NUM.findall(m.group(1))]
            xs, ys = nums[0::2], nums[1::2]
        else:
            e = re.search(r'<ellipse[^>]*?cx="([-\d.]+)" cy="([-\d.]+)" rx="([\d.]+)" '
                          r'ry="([\d.]+)"', body)
            if not e:
                continue
            cx, cy, rx, ry = map(float, e.groups())
            xs, ys = [cx - rx, cx + rx], [cy - ry, cy + ry]
        if xs and ys:
            out[html.unescape(gid)] = (min(xs), min(ys), max(xs), max(ys))
    return out


def fit_ratio(width_pt: float, height_pt: float, viewport: tuple[float, float]) -> float:
    """The scale at which an SVG of this size fits ``viewport`` (CSS px, 4 % margin), over
    LEGIBLE_SCALE: >= 1 means the whole graph is in view with every label >= 9 px."""
    fit = 0.96 * min(viewport[0] / max(width_pt * 4 / 3, 1),
                     viewport[1] / max(height_pt * 4 / 3, 1))
    return fit / LEGIBLE_SCALE
