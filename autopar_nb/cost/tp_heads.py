"""Tensors that tensor parallelism splits by heads, followed through the TP walk
(:mod:`.tp_styles`): what runs inside each head needs no other rank's heads (Qwen3's RMSNorm of
every head's q and k, over ``head_dim``), so it leaves the attention split; a norm module's weight
read there is the same for every head, and its gradient is summed over the TP ranks."""

from __future__ import annotations

from .autocast import NORM_MODULES


def within_heads(n, s_in, headed: set[str]) -> bool:
    """Norm or reduction ``n`` works inside each head of its sharded inputs, all split by heads on
    their last-but-one dim (:func:`track_heads`): it keeps every dim but the last (a mean over
    ``head_dim`` with ``keepdim``, a norm op), so no rank needs another rank's heads."""
    if not s_in or any(i not in headed for i in s_in) or not n.in_shapes or not n.out_shapes:
        return False
    src, out = tuple(n.in_shapes[0]), tuple(n.out_shapes[0])
    return len(src) >= 3 and len(out) == len(src) and out[:-1] == src[:-1]


def track_heads(n, s_in, hc, headed: set[str], per_head: dict[str, int], region: int, graph,
                by_name) -> None:
    """Follow tensors split by heads on their last-but-one dim: the view that makes the heads
    (``hc``), then ops of such tensors alone that keep that dim where it is (elementwise ops, norms
    and reductions within each head); a norm module's weight read there is one value per feature of
    a head (``per_head``, see ``tp_styles.Walk.per_head``)."""
    if hc:
        headed.add(n.name)
        return
    src = tuple(by_name[s_in[0]].out_shapes[0]) if s_in and by_name[s_in[0]].out_shapes else ()
    out = tuple(n.out_shapes[0]) if n.out_shapes else ()
    if (n.op_class not in ("elementwise", "norm", "reduction") or not s_in
            or any(i not in headed for i in s_in)
            or len(out) < 3 or len(out) != len(src) or out[-2] != src[-2]):
        return
    headed.add(n.name)
    weights = [graph.params[p] for p in n.params if p in graph.params]
    if weights and (n.op_class == "norm" or n.module_type.endswith(NORM_MODULES)) and \
            all(tuple(w.shape) == out[-1:] for w in weights):
        per_head[n.name] = region
