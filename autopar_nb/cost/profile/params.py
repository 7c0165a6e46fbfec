"""Trainable parameters per layer: split by TP or replicated, those another layer owns, and the
stacked per-expert weights expert parallelism splits."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kernels_ext import moe_rules

from ...plan import ITEMSIZE, layer_of
from .facts import Facts, in_layers, numel
from .layers import LayerProfile

GROUPED_MATMULS = frozenset(r.name for r in moe_rules.GROUPED_MATMULS if r.backward_factor)
"""forward grouped matmuls over stacked expert weights (``kernels_ext.moe_rules``; their backward
ops excluded)"""


def count_params(layers: dict[str, LayerProfile], f: Facts, *, split_params: set[str],
                 cast: set[str]) -> None:
    """Trainable parameters per layer, split by TP or replicated; the largest one; their item size;
    those autocast keeps a 16-bit copy of (``cast``); those its ops read that another layer owns
    (:attr:`.layers.LayerProfile.borrowed`)."""
    graph = f.graph
    owner = {m: lay.path for lay in graph.layers for m in lay.modules}
    layer_paths = [lay.path for lay in graph.layers]

    def owning(pi) -> str:
        """The path of the layer owning parameter ``pi``."""
        return owner[pi.module_path] if pi.module_path in owner else \
            layer_of(pi.module_path, layer_paths)

    for pname, pi in graph.params.items():
        if pi.is_buffer or not pi.trainable:
            continue
        lp = layers.get(owning(pi))
        if lp is None:
            continue
        lp.param_itemsize = pi.itemsize
        lp.param_tensors += 1
        lp.largest_param = max(lp.largest_param, pi.numel)
        if pname in split_params:
            lp.params_split += pi.numel
            lp.cast_split += pi.numel if pname in cast else 0
        else:
            lp.params_rep += pi.numel
            lp.cast_rep += pi.numel if pname in cast else 0
    for lp, n in in_layers(layers, f):
        for pname in n.params:
            pi = graph.params.get(pname)
            if pi is None or pi.is_buffer or not pi.trainable:
                continue
            path = owning(pi)
            if path != lp.path and path in layer_paths:
                lp.borrowed[pname] = (pi.numel, pname in split_params, layer_paths.index(path))


def count_experts(layers: dict[str, LayerProfile], f: Facts) -> None:
    """Experts modules: a module whose own trainable parameters are all stacked per expert (>= 3
    dims, the same first dim E >= 2) and which runs a grouped matmul. Per layer: module -> E, their
    parameters, and the token rows the first grouped matmul of each receives ((token x choice) x
    hidden: what expert parallelism sends away)."""
    owned: dict[str, list] = defaultdict(list)
    for pi in f.graph.params.values():
        if not pi.is_buffer and pi.trainable:
            owned[pi.module_path].append(pi)
    first: dict[str, Any] = {}
    for n in f.graph.nodes:
        grouped = n.op.rpartition(".")[0] in GROUPED_MATMULS
        if grouped and n.module_path not in first and n.in_shapes:
            first[n.module_path] = n
    for path, n in first.items():
        lp, ps = layers.get(n.layer), owned.get(path, [])
        heads = {p.shape[0] for p in ps if len(p.shape) >= 3}
        stacked = ps and len(heads) == 1 and all(len(p.shape) >= 3 for p in ps)
        if lp is None or not stacked or min(heads) < 2:
            continue
        rows, item = numel(n.in_shapes[0]), ITEMSIZE.get(n.dtype, 4)
        lp.experts[path] = heads.pop()
        lp.params_experts += sum(p.numel for p in ps)
        lp.dispatch_bytes += rows * item
        lp.dispatch_half += rows * min(item, 2)
