"""The compute passes: FLOPs by op class (the part tensor parallelism divides and the part it
replicates), bytes memory-bound ops move, the same under each autocast precision, and the keys and
values context parallelism passes round."""

from __future__ import annotations

from ...plan import ITEMSIZE
from ..efficiency import gemm_of
from ..flash import attention_of
from .facts import FLOAT, Facts, in_layers, numel, returns_input, selective_recomputes
from .layers import AmpTime, LayerProfile


def count_compute(layers: dict[str, LayerProfile], f: Facts) -> None:
    """FLOPs by op class (split or replicated under TP), bytes of memory-bound ops, the largest
    backward step."""
    again = selective_recomputes(layers, f)
    for lp, n in in_layers(layers, f):
        in_region, split_op = n.name in f.tp.sharded, n.name in f.tp.styles
        if n.op_class != "view":
            lp.n_ops += 1
        nbytes = 0 if returns_input(n, f) else n.bytes_read + n.bytes_written
        if n.op_class == "embedding" and n.params and n.params[0] in f.graph.params:
            # a lookup reads the rows it gathers, not the table; its backward writes a dense
            # gradient of the whole table (nn.Embedding without sparse=True: zero-fill + index_add)
            w = f.graph.params[n.params[0]]
            nbytes = 2 * n.bytes_written + sum(f.size[i].nbytes for i in n.inputs)
            if split_op:
                lp.emb_bwd_split += w.numel * w.itemsize
            else:
                lp.emb_bwd_rep += w.numel * w.itemsize
        if n.op_class in ("matmul", "conv", "attention"):
            split = in_region or split_op
            fwd, bwd = (lp.flops_split, lp.bwd_split) if split else (lp.flops_rep, lp.bwd_rep)
            fwd[n.op_class] += n.flops
            bwd[n.op_class] += n.bwd_flops
            if n.op_class == "matmul":
                _add_gemm(lp, n, f.tp.styles.get(n.name, "") if split else None)
            elif n.op_class == "attention" and (a := attention_of(n)) is not None:
                lp.attentions = (*lp.attentions, a)
            if n.name in f.scores:
                lp.quad_flops += n.flops
            if n.name in again and split:
                lp.sel_split += n.flops
            elif n.name in again:
                lp.sel_rep += n.flops
        elif n.op_class != "view":
            lp.flops_other += n.flops
            lp.bwd_other += n.bwd_flops
            if in_region:
                lp.mem_split += nbytes
            else:
                lp.mem_rep += nbytes
            if n.name in f.scores:
                lp.quad_flops += n.flops
        if n.out_shapes and n.op_class != "view":
            # its backward holds the gradients of its output and of its activation inputs at once
            inputs = sum(f.size[i].nbytes for i in n.inputs if f.size[i].floating)
            lp.largest_out = max(lp.largest_out, f.size[n.name].nbytes + inputs)


def _add_gemm(lp: LayerProfile, n, style: str | None) -> None:
    """Records matmul ``n``'s shape on the layer, with the dimension TP divides (``style``: a
    colwise projection's outputs, a rowwise one's inputs, "" a split attention's heads; None:
    replicated)."""
    split = "" if style is None else {"colwise": "n", "rowwise": "k"}.get(style, "batch")
    g = gemm_of(n, split)
    if g is not None:
        lp.gemms = (*lp.gemms, g)


def count_amp_time(layers: dict[str, LayerProfile], f: Facts, amp: dict[str, Facts]) -> None:
    """Each layer's :attr:`LayerProfile.time_amp`: its time terms under each autocast precision
    (``amp``: precision -> its facts; ``f``: the captured, float32 ones)."""
    for precision, fa in amp.items():
        terms = _amp_time(layers, f, fa, low_params=precision == "autocast_lowp")
        for path, t in terms.items():
            layers[path].time_amp[precision] = t


def _amp_time(layers: dict[str, LayerProfile], f: Facts, fa: Facts, *,
              low_params: bool) -> dict[str, AmpTime]:
    """layer -> its :class:`AmpTime` under the autocast facts ``fa``: compute ops kept in float32 at
    the float32 rate (:attr:`AmpTime.fp32_split`), memory-bound ops' bytes at their tensors' dtypes,
    the copies autocast inserts; a layer with no op of its own (a tied table whose ops another layer
    runs, T5's ``shared``) has none."""
    amp = fa.autocast
    out = {path: AmpTime() for path in layers}
    for lp, n in in_layers(layers, f):
        t = out[lp.path]
        in_region = n.name in f.tp.sharded
        if n.op_class in ("matmul", "conv", "attention"):
            if amp.target.get(n.name) == "float32":
                split = in_region or n.name in f.tp.styles  # as count_compute splits its FLOPs
                fwd, bwd = ((t.fp32_split, t.bwd_fp32_split) if split
                            else (t.fp32_rep, t.bwd_fp32_rep))
                fwd[n.op_class] += n.flops
                bwd[n.op_class] += n.bwd_flops
        elif n.op_class != "view":
            nbytes = 0 if returns_input(n, fa) else _amp_bytes(n, f, fa, low_params=low_params)
            if in_region:
                t.mem_split += nbytes
            else:
                t.mem_rep += nbytes
        for i in dict.fromkeys(n.inputs):
            to = amp.cast(n.name, i)
            if to is None or not f.size[i].floating:
                continue
            copy = f.size[i].numel * (ITEMSIZE[fa.dtype[i]] + ITEMSIZE[to])
            t.casts += 1
            where = "split" if i in f.tp.sharded else "whole" if n.name in f.tp.styles else "rep"
            setattr(t, f"cast_{where}", getattr(t, f"cast_{where}") + copy)
            if i in f.grad:
                setattr(t, f"cast_bwd_{where}", getattr(t, f"cast_bwd_{where}") + copy)
    return out


def _amp_bytes(n, f: Facts, fa: Facts, *, low_params: bool) -> float:
    """Bytes one memory-bound op moves under autocast: its captured bytes (as :func:`count_compute`
    counts them), each activation input read at the dtype it has when the op runs (autocast's copy
    when it makes one), each floating parameter at its 16-bit copy's or 16-bit own size, its output
    at its dtype there."""
    amp = fa.autocast
    read = 0
    for i in n.inputs:
        if i in f.size and f.size[i].floating:
            now = amp.cast(n.name, i) or fa.dtype.get(i, f.dtype[i])
            read += f.size[i].numel * (ITEMSIZE[now] - f.size[i].itemsize)
    lower = amp.target.get(n.name) in ("bfloat16", "float16")
    for p in n.params:
        pi = f.graph.params.get(p)
        if pi is not None and pi.dtype in FLOAT and (low_params or lower):
            read += pi.numel * (2 - pi.itemsize)
    out = f.size[n.name]
    written = out.numel * (fa.size[n.name].itemsize - out.itemsize) if n.out_shapes else 0
    if n.op_class == "embedding" and n.params and n.params[0] in f.graph.params:
        return 2 * (n.bytes_written + written) + sum(fa.size[i].nbytes for i in n.inputs)
    return n.bytes_read + n.bytes_written + read + written


def count_keys_values(layers: dict[str, LayerProfile], f: Facts) -> None:
    """Bytes of the keys and values every attention op reads (SDPA's second and third inputs), of
    its queries (the size of its output too), and which ops they are: context parallelism's ring
    runs there."""
    for k, n in enumerate(f.graph.nodes):
        lp = layers.get(n.layer)
        if lp is None or n.op_class != "attention" or len(n.in_shapes) < 3:
            continue
        elements = numel(n.in_shapes[1]) + numel(n.in_shapes[2])
        lp.kv_bytes += elements * f.size[n.name].itemsize
        lp.kv_half += elements * 2
        lp.q_bytes += numel(n.in_shapes[0]) * f.size[n.name].itemsize
        lp.q_half += numel(n.in_shapes[0]) * 2
        lp.attention_ops += (k,)
