"""The float8 pass: per layer, the Linear matmuls torchao's float8 training takes
(``runtime/float8.py``'s rule: an ``nn.Linear`` with both dimensions multiples of 16, the output
head kept) and the elements its casts read."""

from __future__ import annotations

from ...runtime.float8 import float8_eligible
from .facts import Facts, in_layers, numel
from .layers import LayerProfile


def float8_head(graph) -> str:
    """The output head ``runtime/float8.py``'s ``output_head`` keeps in bf16 (the last ``nn.Linear``
    the model registers), as the graph shows it: the module of the last Linear the forward calls,
    which is that one in the language models people bring (a head tied to the embedding has no
    parameter of its own in the graph)."""
    return next((n.module_path for n in reversed(graph.nodes)
                 if n.op.startswith("aten.linear") and n.module_type == "Linear"), "")


def count_float8(layers: dict[str, LayerProfile], f: Facts) -> None:
    """Each layer's :attr:`LayerProfile.f8_flops_split` / ``f8_flops_rep`` (forward FLOPs of the
    Linears float8 takes, those TP divides and those it does not), ``f8_in`` / ``f8_out`` (elements
    of their inputs and outputs: what the casts of the input and of the output's gradient read) and
    ``f8_weights``."""
    head = float8_head(f.graph)
    for lp, n in in_layers(layers, f):
        if not n.op.startswith("aten.linear") or n.module_type != "Linear" or n.module_path == head:
            continue
        out_features, in_features = n.in_shapes[1][:2] if len(n.in_shapes[1]) == 2 else (1, 1)
        if not float8_eligible(in_features, out_features):
            continue
        if n.name in f.tp.sharded or n.name in f.tp.styles:
            lp.f8_flops_split += n.flops
        else:
            lp.f8_flops_rep += n.flops
        lp.f8_in += numel(n.in_shapes[0])
        lp.f8_out += numel(n.out_shapes[0])
        lp.f8_weights += numel(n.in_shapes[1])
