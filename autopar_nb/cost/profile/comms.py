"""The tensor-parallel collectives each layer's TP styles imply."""

from __future__ import annotations

from ..tp_styles import splits_of
from .facts import Facts, in_layers
from .layers import Comm, LayerProfile


def count_comms(layers: dict[str, LayerProfile], f: Facts) -> None:
    """TP collectives: what the kernels_ext Split of each styled op says its style implies, one per
    distinct tensor (q/k/v, w1/w3 share their input). A head-indexed embedding keeps its output
    split (no collective); a projection with parts of different widths all-gathers its output in
    forward, and its rowwise partner, reading the whole (replicated) result, all-gathers that
    input's gradient in backward (DTensor's Replicate -> Shard(-1) and back; counted with
    CommDebugMode)."""
    done: set[tuple[str, str]] = set()
    gathered = {f.tp.region_of[k] for k, pp in f.tp.parts.items() if pp.gathered}
    for lp, n in in_layers(layers, f):
        # the shared piece's gradient, all-reduced over the TP ranks in backward
        if n.name in f.tp.shared:
            first, end, _ = f.tp.shared[n.name]
            size, share = f.size[n.name], (end - first) / int(n.out_shapes[0][-1])
            lp.comms.append(Comm("all_reduce", size.nbytes * share,
                                 size.numel * share * min(size.itemsize, 2), "bwd"))
        style = f.tp.styles.get(n.name)
        split = splits_of(n.op).get(style) if style else None
        pp = f.tp.parts.get(n.name)
        if split is None or (pp is not None and pp.table):
            continue
        size = f.size[n.name]
        if pp is not None and pp.gathered:
            lp.comms.append(Comm("all_gather", size.nbytes, size.numel * min(size.itemsize, 2),
                                 "fwd"))
        float_acts = [i for i in n.inputs if f.size[i].floating]
        if style == "rowwise" and f.tp.region_of.get(n.name) in gathered and float_acts and \
                float_acts[0] not in f.tp.sharded:
            whole = f.size[float_acts[0]]
            lp.comms.append(Comm("all_gather", whole.nbytes, whole.numel * min(whole.itemsize, 2),
                                 "bwd"))
        for phase, kind in (("fwd", split.forward), ("bwd", split.backward)):
            if not kind:
                continue
            if split.comm_on == "output":
                key, size = n.name, f.size[n.name]
            elif float_acts:
                key, size = f.root.get(float_acts[0], float_acts[0]), f.size[float_acts[0]]
            else:
                continue
            if (phase, key) not in done:
                done.add((phase, key))
                lp.comms.append(Comm(kind, size.nbytes, size.numel * min(size.itemsize, 2), phase))
