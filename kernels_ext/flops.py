"""FLOPs from ``torch.utils.flop_counter``: the formulas PyTorch registers for the ops it counts, called with shapes.

``torch.utils.flop_counter.flop_registry`` maps an ATen overload packet (``torch.ops.aten.mm``) to a formula that
takes the op's arguments with tensors replaced by their shapes, and the output's shape as ``out_shape`` (its
``shape_wrapper``); ``FlopCounterMode`` calls it as ``formula(*args, **kwargs, out_val=out)``. :func:`torch_flops`
calls it the same way with the shapes capture records, so an op torch knows is costed exactly as torch counts it.

torch counts ops after decomposition (mm, bmm, convolution, the fused attention kernels). ``torch.export`` keeps
the composite ops a model calls (linear, matmul, einsum, conv2d, scaled_dot_product_attention); the adapters below
cost each by the formula of the op it runs as, so the arithmetic is torch's in both cases.
"""

from __future__ import annotations

import math
from typing import Any

from .registry import FlopFn, TensorMeta


def formula(op: str):
    """torch's FLOP formula for ``op`` ("aten.mm", or a custom op's "mylib.fused"), raising if it has none."""
    import torch
    from torch.utils.flop_counter import flop_registry

    namespace, _, name = op.partition(".")
    packet = getattr(getattr(torch.ops, namespace), name.split(".")[0], None)
    if packet is None or packet not in flop_registry:
        raise ValueError(f"torch.utils.flop_counter has no FLOP formula for {op}; write one (flops=...) or register "
                         "one with torch.utils.flop_counter.register_flop_formula")
    return flop_registry[packet]


def torch_flops(op: str) -> FlopFn:
    """A rule's ``flops`` that asks torch's formula for ``op`` (looked up on first use, so a custom op may be defined
    after its rule)::

        register_op(OpRule("mylib.fused_mm", "matmul", flops=torch_flops("mylib.fused_mm"), backward_factor=2.0))
    """
    found = []

    def flops(args: tuple, kwargs: dict, outs: list[TensorMeta]) -> float:
        if not found:
            found.append(formula(op))
        out = outs[0].shape if len(outs) == 1 else tuple(o.shape for o in outs)
        return found[0](*_shapes(args), **_shapes(kwargs), out_val=out)

    return flops


def _shapes(value: Any) -> Any:
    """Arguments as torch's formulas take them: every TensorMeta replaced by its shape."""
    if isinstance(value, TensorMeta):
        return value.shape
    if isinstance(value, dict):
        return {k: _shapes(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_shapes(v) for v in value)
    return value


def _mm(a: tuple, b: tuple) -> int:
    return formula("aten.mm")(a, b)


def _bmm(a: tuple, b: tuple) -> int:
    return formula("aten.bmm")(a, b)


# ---- composite ops, costed as the op they run as ----------------------------------------------------------------
def linear(args, kwargs, outs):
    # aten.linear(x (..., k), w (n, k)) runs as mm((tokens, k), (k, n))
    x, w = args[0], args[1]
    return _mm((x.numel // x.shape[-1], x.shape[-1]), (w.shape[1], w.shape[0]))


def matmul(args, kwargs, outs):
    # aten.matmul broadcasts (..., m, k) @ (..., k, n) and runs as bmm((batch, m, k), (batch, k, n)); a 1-d operand
    # has m = 1 (left) or n = 1 (right)
    a, b = args[0].shape, args[1].shape
    m, k, n = (a[-2] if len(a) >= 2 else 1), a[-1], (b[-1] if len(b) >= 2 else 1)
    batch = outs[0].numel // (m * n) if m * n else 0
    return _bmm((batch, m, k), (batch, k, n))


def convolution(transposed: bool) -> FlopFn:
    """aten.conv1d/2d/3d (``transposed=False``) and conv_transpose1d/2d/3d (True) run as aten.convolution."""

    def flops(args, kwargs, outs):
        x, w = args[0], args[1]
        return formula("aten.convolution")(x.shape, w.shape, None, None, None, None, transposed,
                                           out_val=outs[0].shape)

    return flops


def attention(args, kwargs, outs):
    # aten.scaled_dot_product_attention and the CPU flash kernel: QK^T and PV on (batch, heads, seq, dim) tensors,
    # causal masking not halved (as torch counts it), with the query's heads: grouped-query attention's fewer key /
    # value heads are broadcast to them (counted here, not with torch's formula, which refuses them before 2.12)
    (b, h, s_q, d), (_, _, s_k, _), (*_, d_v) = (_four_dims(t.shape) for t in args[:3])
    return 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v


def _four_dims(shape: tuple) -> tuple:
    """(..., seq, dim) as (batch, heads, seq, dim): leading dims folded into the batch."""
    if len(shape) == 4:
        return tuple(shape)
    lead = shape[:-2]
    return (math.prod(lead[:-1]), lead[-1] if lead else 1, *shape[-2:])


def einsum(args, kwargs, outs):
    # aten.einsum(equation, [operands]) contracts pairwise, left to right (torch.einsum without opt_einsum); a pair
    # that sums over shared labels runs as bmm((batch, m, k), (batch, k, n)); a pair with nothing to sum is an
    # elementwise product (torch multiplies: no matmul FLOPs)
    equation, operands = args[0], list(args[1])
    inputs, output = einsum_labels(equation, [t.shape for t in operands])
    size: dict[str, int] = {}
    for labels, t in zip(inputs, operands, strict=True):
        for label, dim in zip(labels, t.shape, strict=True):
            size[label] = max(size.get(label, 1), dim)
    total, left = 0, set(inputs[0])
    for i, right in enumerate(inputs[1:], start=1):
        keep = set(output).union(*inputs[i + 1:])  # labels the output or a later operand needs
        # a label only one side has and nothing later needs is summed out first (a reduction, no matmul FLOPs)
        a = {x for x in left if x in keep or x in right}
        b = {x for x in right if x in keep or x in left}
        summed = (a & b) - keep
        if summed:
            batch, m, k, n = (math.prod(size[x] for x in s) for s in ((a & b) & keep, a - b, summed, b - a))
            total += _bmm((batch, m, k), (batch, k, n))
        left = (a | b) & keep
    return total


def einsum_labels(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Per-operand dim labels and the output labels of an einsum equation; "..." becomes one label per broadcast
    dim, counted from the right ("...0" is the last of them)."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    inputs = [_labels(term, len(shape)) for term, shape in zip(lhs.split(","), shapes, strict=True)]
    if arrow:
        n_dots = max((sum(x.startswith("...") for x in labels) for labels in inputs), default=0)
        return inputs, _labels(rhs, len(rhs.replace("...", "")) + n_dots)
    # implicit output: the broadcast dims, then the letters that appear once, in alphabetical order
    counts: dict[str, int] = {}
    for labels in inputs:
        for x in labels:
            counts[x] = counts.get(x, 0) + 1
    dots = sorted((x for x in counts if x.startswith("...")), key=lambda x: -int(x[3:]))
    return inputs, (*dots, *sorted(x for x, c in counts.items() if c == 1 and not x.startswith("...")))


def _labels(term: str, ndim: int) -> tuple[str, ...]:
    head, dots, tail = term.partition("...")
    n_dots = ndim - len(head) - len(tail) if dots else 0
    return (*head, *(f"...{j}" for j in reversed(range(n_dots))), *tail)
