"""Edges that run through a cluster's label, ended at the cluster's border instead.

dot puts a cluster's label in a band above its first rank and routes an edge into a node of that
rank straight through it: in a chain of layers (ResNet, a decoder's blocks) nearly every layer's
label is crossed by the edge that enters it. Moving the label (``labeljust``, ``labelloc``) or
pushing the node aside with a spacer node widens the graph, and the widget then folds what it showed
to fit. Graphviz's own ``compound=true`` with ``lhead`` ends an edge where it meets the cluster's
outline, after the layout: every node stays where it was, the graph keeps its size, and the arrow
points at the box the node heads. Only edges that do cross a label and head a node of the cluster's
first rank (the node right under the label) are ended there; an edge that runs on to a deeper node
(a residual's skip) is drawn whole, since ending it at the border would hide where it goes. For
those, the cluster's label goes to the bottom of its box (``labelloc=b``, :func:`labels_moved_down`)
where that leaves fewer labels crossed: the skip then enters through an empty top, and the edges
that leave the cluster from its last rank end at its border as above. The label band is as high at
the bottom, so the graph keeps its width; dot makes it a little taller (ResNet-34 at depth 3: 974 ->
1051 pt, its 5 crossed label lines -> 1).
"""

from __future__ import annotations

import html
import re

_CLUSTER = re.compile(r'<g id="[^"]*" class="cluster">\s*<title>([^<]*)</title>(.*?)</g>', re.S)
_NODE = re.compile(r'<g id="[^"]*" class="node">\s*<title>([^<]*)</title>(.*?)</g>', re.S)
_EDGE = re.compile(r'<g id="[^"]*" class="edge">\s*<title>([^<]*)</title>(.*?)</g>', re.S)
_TEXT = re.compile(r'<text[^>]*?text-anchor="(\w+)" x="([-\d.]+)" '
                   r'y="([-\d.]+)"[^>]*?font-size="([\d.]+)"[^>]*>' r"(.*?)</text>", re.S)
_SHAPE = re.compile(r'<(?:path|polygon)[^>]*?(?:d|points)="([^"]+)"')
_ELLIPSE = re.compile(r'<ellipse[^>]*?cx="([-\d.]+)" cy="([-\d.]+)" rx="([\d.]+)" ry="([\d.]+)"')
_PAIR = re.compile(r"(-?[\d.]+),(-?[\d.]+)")
_SUBGRAPH = re.compile(r'^\s*subgraph ("(?:[^"\\]|\\.)*") \{(.*)$')
_DOT_EDGE = re.compile(r'^(\s*)("(?:[^"\\]|\\.)*")\s*->\s*("(?:[^"\\]|\\.)*")\s*(?:\[(.*)\])?;\s*$')

Box = tuple[float, float, float, float]


def text_box(anchor: str, x: float, y: float, size: float, text: str) -> Box:
    """A label line's box from its SVG attributes, as the widget's label layer sizes it
    (planner.js): 0.6 em a character (Helvetica's widest digits and capitals are ~0.67 em, most
    letters ~0.5), ascent 0.9 em, descent 0.3 em."""
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
    """Points along an SVG path of cubic Béziers, as graphviz writes edges (M p0 C p1 p2 p3 p4 p5 p6
    ...)."""
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
    return (outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2]
            and inner[3] <= outer[3])


def _within(box: Box, outline: Box | None) -> Box:
    """A label line's box cut to its cluster's outline, as the label layer cuts it (the estimate of
    0.6 em a character runs past a narrow box)."""
    if outline is None:
        return box
    return (max(box[0], outline[0] + 2), box[1], min(box[2], outline[2] - 2), box[3])


def label_crossings(svg: str) -> list[tuple[str, str, Box]]:
    """(edge title "tail->head", cluster name, the line's box) for every cluster label line an edge
    runs through."""
    labels = [(name, _within(text_box(a, float(x), float(y), float(s), t), _outline(body)))
              for name, body in _CLUSTER.findall(svg) for a, x, y, s, t in _TEXT.findall(body)]
    out = []
    for title, body in _EDGE.findall(svg):
        m = _SHAPE.search(body)
        pts = _curve(m.group(1)) if m else []
        out += [(html.unescape(title), name, box) for name, box in labels
                if any(_inside(p, box) for p in pts)]
    return out


def _crossed(svg: str):
    """(edge title, cluster name, the cluster's box, the end inside it or None, whether that end is
    the node next to the label band) for every label line an edge crosses (the label's band: the
    top, or the bottom under ``labelloc=b``)."""
    clusters = {html.unescape(n): _outline(b) for n, b in _CLUSTER.findall(svg)}
    nodes = {html.unescape(n): _outline(b) for n, b in _NODE.findall(svg)}
    nodes = {k: v for k, v in nodes.items() if v is not None}
    for title, name, line in label_crossings(svg):
        tail, _, head = title.partition("->")
        box, h, t = clusters.get(name), nodes.get(head), nodes.get(tail)
        if box is None or h is None or t is None or _contains(box, h) == _contains(box, t):
            yield title, name, box, None, False
            continue
        end = h if _contains(box, h) else t
        top = line[1] < (box[1] + box[3]) / 2
        beyond = [n for n in nodes.values() if _contains(box, n)
                  and (n[3] < end[1] if top else n[1] > end[3])]
        yield title, name, box, ("lhead" if end is h else "ltail"), not beyond


def remaining(svg: str) -> int:
    """How many label lines stay crossed once the edges :func:`entries` finds end at their
    cluster."""
    return sum(1 for _, _, _, attr, beside in _crossed(svg) if not (attr and beside))


def labels_moved_down(dot: str, svg: str) -> str | None:
    """``dot`` with ``labelloc=b`` on each cluster whose label an edge crosses on its way into or
    out of it past the node under the label (a residual's skip: :func:`entries` leaves it whole);
    None when there is none."""
    names = {name for _, name, _, attr, beside in _crossed(svg) if attr and not beside}
    if not names:
        return None
    lines = dot.split("\n")
    for i, line in enumerate(lines[:-1]):
        m = _SUBGRAPH.match(line)
        if m and _unquote(m.group(1)) in names:
            # the attributes on the subgraph's line or on the next
            k = i if "label=" in m.group(2) else i + 1
            lines[k] = lines[k].replace("label=", "labelloc=b; label=", 1)
    return "\n".join(lines)


def entries(svg: str) -> dict[str, tuple[str, str]]:
    """Edge title "tail->head" -> ("lhead" or "ltail", the cluster it should end at): the outermost
    cluster whose label it crosses that holds one end and not the other, with that end the node next
    to the label (no node of the cluster between it and the label's band). An edge leaves a cluster
    upwards where the graph wraps into columns."""
    ends: dict[str, tuple[float, str, str]] = {}
    for title, name, box, attr, beside in _crossed(svg):
        if not (attr and beside):
            continue  # it runs on past the label band, or it does not go in or out of the cluster
        area = (box[2] - box[0]) * (box[3] - box[1])
        if title not in ends or area > ends[title][0]:
            ends[title] = (area, attr, name)
    return {k: (attr, name) for k, (_, attr, name) in ends.items()}


def _unquote(s: str) -> str:
    return s[1:-1].replace('\\"', '"').replace("\\\\", "\\")


def ended_at_clusters(dot: str, svg: str) -> str | None:
    """``dot`` with the edges :func:`entries` finds in its drawing ``svg`` ended at their cluster
    (``lhead`` or ``ltail``, and ``compound=true`` on the graph); None when no edge crosses a label
    that way."""
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
