"""How a colwise projection's output is cut into parts, for the TP walk (:mod:`.tp_styles`): a
split/chunk/slice of its sharded last dim (nanoGPT's fused ``c_attn(x).split(C, dim=2)``), a split
of its heads after the view into heads (Falcon's multi-query ``query_key_value``), the view that
names each piece's heads, and the :class:`Parts` they make (``LayerPlan.tp_parts``)."""

from __future__ import annotations

from typing import NamedTuple

import kernels_ext

from .tp_refusals import packet


def role_of(op: str) -> str:
    """The op's ``tp_role`` ("norm", "reduction", "split"; "" for an op TP shards pass through)."""
    rule = kernels_ext.lookup(op)
    return rule.tp_role if rule is not None else ""


class Parts(NamedTuple):
    """How a colwise module's output is made: its pieces in order (``LayerPlan.tp_parts``)."""

    counts: tuple[int, ...]
    """heads per piece (or features per piece when ``heads`` is False)"""
    heads: bool
    """the counts are heads (every piece split into heads of one width by a view), else features"""
    width: int
    """the output's features"""
    table: bool = False
    """a head-indexed embedding (one column per head): its output stays split by heads, never packed
    or repeated"""

    @property
    def gathered(self) -> bool:
        """Parts of different widths: no DTensor placement holds them, the runtime splits the weight
        as one block and all-gathers the output."""
        return len(set(self.counts)) > 1


def _splits_last_dim(n) -> bool:
    """A split/chunk/unbind/slice/select node that cuts its input's last dim."""
    if role_of(n.op) != "split" or not n.in_shapes or not n.out_shapes:
        return False
    src = tuple(n.in_shapes[0])
    for out in n.out_shapes:
        out = tuple(out)
        if len(out) == len(src) and out[-1:] != src[-1:]:
            return True
        if len(out) == len(src) - 1 and out == src[:-1]:
            return True
    return False


def fused_cut(n, s_in, last, origin, pieces, width, by_name) -> str | None:
    """None when ``n`` does not cut a colwise projection's output into parts; else :func:`_cut`'s
    answer. A cut is a split/chunk/slice of a sharded last dim (nanoGPT's ``c_attn(x).split(C,
    dim=2)``), or of the heads dim of the projection's whole output viewed as heads (Falcon's
    multi-query ``query_key_value``: ``view(B, T, -1, hd)``, then ``split([heads, 1, 1], dim=-2)``:
    the query heads, one key head, one value head)."""
    if s_in[0] in last and _splits_last_dim(n):
        why = _cut(n, s_in, origin, pieces, width)
        if not why:
            last.add(n.name)  # each piece is sharded on its last dim: a second cut is refused
        return why
    view = by_name.get(s_in[0])
    if (len(s_in) > 1 or role_of(n.op) != "split" or view is None or view.op_class != "view"
            or not view.inputs or view.inputs[0] not in origin
            or origin[view.inputs[0]][1] is not None or not view.out_shapes):
        return None
    heads = tuple(view.out_shapes[0])
    if not split_heads(by_name[view.inputs[0]].out_shapes[0], heads):
        return None
    outs = [tuple(o) for o in n.out_shapes]
    if len(outs) < 2 or any(len(o) != len(heads) or o[:-2] != heads[:-2] or o[-1] != heads[-1]
                            for o in outs):
        return None
    return _cut(n, [view.inputs[0]], origin, pieces, width, heads=[o[-2] for o in outs],
                head_dim=heads[-1])


def _cut(n, s_in, origin, pieces, width, *, heads=None, head_dim=1) -> str:
    """Record the pieces ``n`` (a split/chunk/slice of a sharded last dim; with ``heads``: of so
    many heads each, of ``head_dim`` features) cuts from a colwise projection's output (``origin``:
    node -> (projection, piece indices or None for the whole output); ``pieces``: projection ->
    [[width, heads or None], ...]); "" when they can be split part by part, else why not."""
    src = origin.get(s_in[0])
    if len(s_in) > 1 or src is None or src[1] is not None:
        return (f"{packet(n.op)} ({n.name}) cuts a sharded tensor that is not one projection's "
                "output along the sharded dim")
    proj = src[0]
    outs = [tuple(o) for o in n.out_shapes]
    if heads is None and any(len(o) != len(n.in_shapes[0]) for o in outs):
        return f"{packet(n.op)} ({n.name}) takes single features from its output (no part to split)"
    have = pieces.setdefault(proj, [])
    if len(outs) > 1 and have:
        return f"its output is cut twice ({packet(n.op)} {n.name} after an earlier cut)"
    start = len(have)
    have += [[int(o[-1]), None] for o in outs] if heads is None else [[int(h * head_dim), int(h)]
                                                                      for h in heads]
    if sum(w for w, _ in have) > width[proj]:
        return (f"the pieces cut from its output ({', '.join(str(w) for w, _ in have)} features) "
                f"overlap: more than its {width[proj]} outputs")
    origin[n.name] = (proj, tuple(range(start, len(have))))
    return ""


def name_heads(view, hc: int, src, origin, pieces, whole_heads) -> bool:
    """Count ``hc`` heads for the projection output or piece a head-splitting ``view`` reads (False:
    not one)."""
    o = origin.get(src)
    if o is None:
        return False
    proj, idx = o
    if idx is None:
        whole_heads.setdefault(proj, hc)
        return True
    width = int(view.in_shapes[0][-1]) if view.in_shapes else 0
    for i in idx:
        if pieces[proj][i][0] == width and pieces[proj][i][1] is None:
            pieces[proj][i][1] = hc
            return True
    return any(pieces[proj][i][0] == width for i in idx)  # another view of a piece already counted


def parts_of(proj_width: int, cut: list[list] | None, heads: int | None) -> Parts | None:
    if cut:
        if (all(h for _, h in cut) and len({w // h for w, h in cut}) == 1
            and all(w % h == 0 for w, h in cut)):
            return Parts(tuple(h for _, h in cut), True, proj_width)
        return Parts(tuple(w for w, _ in cut), False, proj_width)
    if heads:
        return Parts((heads,), True, proj_width)
    return None


def split_heads(in_shape, out_shape) -> int | None:
    """(B, T, D) -> (B, T, nh, hd) with nh * hd = D: the head count nh (the sharded outer
    factor)."""
    if len(out_shape) <= len(in_shape):
        return None
    k = len(in_shape) - 1
    if tuple(out_shape[:k]) != tuple(in_shape[:k]):
        return None
    rest = out_shape[k:]
    if len(rest) == 2 and rest[0] * rest[1] == in_shape[-1]:
        return int(rest[0])
    return None
