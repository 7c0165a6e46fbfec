"""Edges that run through a cluster's label, ended at the cluster's border instead.

dot puts a cluster's label in a band above its first rank and routes an edge into a node of that rank straight
through it: in a chain of layers (ResNet, a decoder's blocks) nearly every layer's label is crossed by the edge that
enters it. Moving the label (``labeljust``, ``labelloc``) or pushing the node aside with a spacer node widens the
graph, and the widget then folds what it showed to fit. Graphviz's own ``compound=true`` with ``lhead`` ends an edge
where it meets the cluster's outline, after the layout: every node stays where it was, the graph keeps its size, and
the arrow points at the box the node heads. Only edges that do cross a label and head a node of the cluster's first
rank (the node right under the label) are ended there; an edge that runs on to a deeper node (a residual's skip)
is drawn whole, since ending it at the border would hide where it goes.
"""

from __future__ import annotations

import html
import re

_CLUSTER = re.compile(r'<g id="[^"]*" class="cluster">\s*<title>([^<]*)</title>(.*?)</g>', re.S)
_NODE = re.compile(r'<g id="[^"]*" class="node">\s*<title>([^<]*)</title>(.*?)</g>', re.S)
_EDGE = re.compile(r'<g id="[^"]*" class="edge">\s*<title>([^<]*)</title>(.*?)</g>', re.S)
_TEXT = re.compile(r'<text[^>]*?text-anchor="(\w+)" x="([-\d.]+)" y="([-\d.]+)"[^>]*?font-size="([\d.]+)"[^>]*>'
                   r"(.*?)</text>", re.S)
_SHAPE = re.compile(r'<(?:path|polygon)[^>]*?(?:d|points)="([^"]+)"')
_ELLIPSE = re.compile(r'<ellipse[^>]*?cx="([-\d.]+)" cy="([-\d.]+)" rx="([\d.]+)" ry="([\d.]+)"')
_PAIR = re.compile(r"(-?[\d.]+),(-?[\d.]+)")
_DOT_EDGE = re.compile(r'^(\s*)("(?:[^"\\]|\\.)*")\s*->\s*("(?:[^"\\]|\\.)*")\s*(?:\[(.*)\])?;\s*$')

Box = tuple[float, float, float, float]


def text_box(anchor: str, x: float, y: float, size: float, text: str) -> Box:
    """A label line's box from its SVG attributes, as the widget's label layer sizes it (planner.js): 0.6 em a
    character (Helvetica's widest digits and capitals are ~0.67 em, most letters ~0.5), ascent 0.9 em, descent
    0.3 em."""
    w = len(html.unescape(text)) * size * 0.6
    x0 = x - w / 2 if anchor == "middle" else x - w if anchor == "end" else x
    return (x0, y - 0.9 * size, x0 + w, y + 0.3 * size)


def _outline(body: str) -> Box | None:
    m = _SHAPE.search(body)
    if m:
        pts = [(float(a), float(b)) for a, b in _PAIR.findall(m.group(1))]
    else:
        e = _ELLIPSE.search(body)
        if not e:
            return None
        cx, cy, rx, ry = map(float, e.groups())
        pts = [(cx - rx, cy - ry), (cx + rx, cy + ry)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return (min(xs), min(ys), max(xs), max(ys)) if pts else None


def _curve(d: str, steps: int = 24) -> list[tuple[float, float]]:
    """Points along an SVG path of cubic Béziers, as graphviz writes edges (M p0 C p1 p2 p3 p4 p5 p6 ...)."""
    p = [(float(a), float(b)) for a, b in _PAIR.findall(d)]
    out = []
    for i in range(0, len(p) - 3, 3):
        (x0, y0), (x1, y1), (x2, y2), (x3, y3) = p[i:i + 4]
        for k in range(steps + 1):
            t = k / steps
            a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t * t, t ** 3
            out.append((a * x0 + b * x1 + c * x2 + e * x3, a * y0 + b * y1 + c * y2 + e * y3))
    return out


def _inside(pt: tuple[float, float], box: Box, pad: float = 1.0) -> bool:
    return box[0] + pad < pt[0] < box[2] - pad and box[1] + pad < pt[1] < box[3] - pad


def _contains(outer: Box, inner: Box) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def label_crossings(svg: str) -> list[tuple[str, str, Box]]:
    """(edge title "tail->head", cluster name, the line's box) for every cluster label line an edge runs through."""
    labels = [(name, text_box(a, float(x), float(y), float(s), t))
              for name, body in _CLUSTER.findall(svg) for a, x, y, s, t in _TEXT.findall(body)]
    out = []
    for title, body in _EDGE.findall(svg):
        m = _SHAPE.search(body)
        pts = _curve(m.group(1)) if m else []
        out += [(html.unescape(title), name, box) for name, box in labels if any(_inside(p, box) for p in pts)]
    return out


def entries(svg: str) -> dict[str, tuple[str, str]]:
    """Edge title "tail->head" -> ("lhead" or "ltail", the cluster it should end at): the outermost cluster whose
    label it crosses that holds one end and not the other, with that end in the cluster's first rank (no node of the
    cluster above it). An edge leaves a cluster upwards where the graph wraps into columns."""
    clusters = {html.unescape(n): _outline(b) for n, b in _CLUSTER.findall(svg)}
    nodes = {html.unescape(n): _outline(b) for n, b in _NODE.findall(svg)}
    nodes = {k: v for k, v in nodes.items() if v is not None}
    ends: dict[str, tuple[float, str, str]] = {}
    for title, name, _ in label_crossings(svg):
        tail, _, head = title.partition("->")
        box, h, t = clusters.get(name), nodes.get(head), nodes.get(tail)
        if box is None or h is None or t is None or _contains(box, h) == _contains(box, t):
            continue
        attr, end = ("lhead", h) if _contains(box, h) else ("ltail", t)
        if any(_contains(box, n) and n[3] < end[1] for n in nodes.values()):
            continue  # a node of the cluster sits above that end: the edge runs on past the label band
        area = (box[2] - box[0]) * (box[3] - box[1])
        if title not in ends or area > ends[title][0]:
            ends[title] = (area, attr, name)
    return {k: (attr, name) for k, (_, attr, name) in ends.items()}


def _unquote(s: str) -> str:
    return s[1:-1].replace('\\"', '"').replace("\\\\", "\\")


def ended_at_clusters(dot: str, svg: str) -> str | None:
    """``dot`` with the edges :func:`entries` finds in its drawing ``svg`` ended at their cluster (``lhead`` or
    ``ltail``, and ``compound=true`` on the graph); None when no edge crosses a label that way."""
    ends = entries(svg)
    if not ends:
        return None
    lines = dot.split("\n")
    for i, line in enumerate(lines):
        m = _DOT_EDGE.match(line)
        end = m and ends.get(f"{_unquote(m.group(2))}->{_unquote(m.group(3))}")
        if end:
            attrs = ", ".join(a for a in (m.group(4), f'{end[0]}="{end[1]}"') if a)
            lines[i] = f"{m.group(1)}{m.group(2)} -> {m.group(3)} [{attrs}];"
    opening = next(i for i, line in enumerate(lines) if line.rstrip().endswith("{"))
    lines.insert(opening + 1, "  compound=true;")
    return "\n".join(lines)
