"""Built-in rules for the ATen ops that ``torch.export`` produces for typical models.

FLOP counts follow the convention of ``torch.utils.flop_counter``: a multiply-add is 2 FLOPs, bias adds and
softmax/normalisation arithmetic are not counted as matmul FLOPs (they are memory-bound and costed by bytes).
"""

from __future__ import annotations

import math

from .registry import OpRule, Split, TensorMeta, register_op


def _linear(args, kwargs, outs):
    # x: (..., k), weight: (n, k)  ->  2 * (tokens) * k * n
    x, w = args[0], args[1]
    return 2 * (x.numel // x.shape[-1]) * w.shape[1] * w.shape[0]


def _mm(args, kwargs, outs):
    a, b = args[0], args[1]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _addmm(args, kwargs, outs):
    return _mm(args[1:], kwargs, outs)


def _bmm(args, kwargs, outs):
    a, b = args[0], args[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


def _baddbmm(args, kwargs, outs):
    return _bmm(args[1:], kwargs, outs)


def _matmul(args, kwargs, outs):
    # general broadcasting matmul: output (..., m, n), contraction k = a.shape[-1]
    a = args[0]
    k = a.shape[-1]
    return 2 * outs[0].numel * k


def _einsum(args, kwargs, outs):
    # aten.einsum(equation, [operands]): contracted pairwise left to right as torch.einsum does (without
    # opt_einsum); each pair that sums over a shared label is a batched matmul, 2 * batch * m * n * k
    equation, operands = args[0], list(args[1])
    inputs, output = _einsum_labels(equation, [t.shape for t in operands])
    size: dict[str, int] = {}
    for labels, t in zip(inputs, operands, strict=True):
        for label, dim in zip(labels, t.shape, strict=True):
            size[label] = max(size.get(label, 1), dim)
    total, left = 0, inputs[0]
    for i, right in enumerate(inputs[1:], start=1):
        keep = set(output).union(*inputs[i + 1:])
        # a label only one side has and nothing later needs is summed out first (no matmul FLOPs)
        a = {x for x in left if x in keep or x in right}
        b = {x for x in right if x in keep or x in left}
        k = (a & b) - keep  # contracted labels
        if k:  # nothing contracted: an elementwise product (torch runs mul, not bmm; no matmul FLOPs)
            total += 2 * math.prod(size[x] for x in a | b)
        left = tuple(sorted((a | b) & keep))
    return total


def _einsum_labels(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Per-operand dim labels and the output labels of an einsum equation; "..." becomes one label per broadcast
    dim, counted from the right ("...0" is the last of them)."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    inputs = []
    for term, shape in zip(lhs.split(","), shapes, strict=True):
        head, dots, tail = term.partition("...")
        n_ell = len(shape) - len(head) - len(tail) if dots else 0
        inputs.append(tuple(head) + tuple(f"...{j}" for j in reversed(range(n_ell))) + tuple(tail))
    if arrow:
        head, dots, tail = rhs.partition("...")
        n_ell = max((sum(x.startswith("...") for x in labels) for labels in inputs), default=0) if dots else 0
        return inputs, tuple(head) + tuple(f"...{j}" for j in reversed(range(n_ell))) + tuple(tail)
    # implicit output: broadcast dims, then the letters that appear once, in alphabetical order
    counts: dict[str, int] = {}
    for labels in inputs:
        for x in labels:
            counts[x] = counts.get(x, 0) + 1
    dots = sorted((x for x in counts if x.startswith("...")), key=lambda x: -int(x[3:]))
    return inputs, tuple(dots) + tuple(sorted(x for x, c in counts.items() if c == 1 and not x.startswith("...")))


def _conv(args, kwargs, outs):
    # x: (N, Cin, ...), weight: (Cout, Cin/groups, *kernel): 2 * out_numel * (Cin/groups) * prod(kernel)
    w = args[1]
    return 2 * outs[0].numel * w.shape[1] * math.prod(w.shape[2:])


def _sdpa(args, kwargs, outs):
    # q: (B, H, L, E), k: (B, H, S, E), v: (B, H, S, Ev): QK^T and PV, 2*B*H*L*S*(E + Ev); causal masking not halved
    q, k, v = args[0], args[1], args[2]
    batch_heads = q.numel // (q.shape[-2] * q.shape[-1])
    return 2 * batch_heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _per_output(c):
    return lambda args, kwargs, outs: c * sum(o.numel for o in outs)


def _per_input(c):
    return lambda args, kwargs, outs: c * args[0].numel if isinstance(args[0], TensorMeta) else 0


# Linear-like: colwise splits the weight's output dim (input replicated; all-reduce of the input grad in backward);
# rowwise splits the input dim (input sharded on its last dim; all-reduce of the output in forward).
_LINEAR_SPLITS = {
    "colwise": Split({1: 0, 2: 0}, forward=None, backward="all_reduce", comm_on="input",
                     note="ColwiseParallel: output sharded on the last dim"),
    "rowwise": Split({1: 1}, forward="all_reduce", backward=None, comm_on="output",
                     note="RowwiseParallel: input sharded on the last dim, partial sums all-reduced"),
}
# Embedding: rowwise = vocab-parallel (each rank holds a slice of the vocabulary, output partial -> all-reduce);
# colwise shards the embedding dim (output gathered).
_EMBEDDING_SPLITS = {
    "rowwise": Split({0: 0}, forward="all_reduce", comm_on="output", note="vocab-parallel embedding"),
    "colwise": Split({0: 1}, forward="all_gather", backward=None, comm_on="output", note="embedding dim sharded"),
}
# Norms and dropout under sequence parallel: activations sharded on the sequence dim; the TP region boundaries turn
# all-reduce into reduce-scatter + all-gather of the same total volume.
_SEQUENCE_SPLITS = {
    "sequence_parallel": Split({}, forward=None, note="SequenceParallel: runs on sequence-sharded activations"),
}

_BUILTIN = [
    OpRule("aten.linear", "matmul", _linear, 2.0, splits=_LINEAR_SPLITS),
    OpRule("aten.mm", "matmul", _mm, 2.0),
    OpRule("aten.addmm", "matmul", _addmm, 2.0),
    OpRule("aten.bmm", "matmul", _bmm, 2.0),
    OpRule("aten.baddbmm", "matmul", _baddbmm, 2.0),
    OpRule("aten.matmul", "matmul", _matmul, 2.0),
    OpRule("aten.einsum", "matmul", _einsum, 2.0),
    OpRule("aten.conv1d", "conv", _conv, 2.0),
    OpRule("aten.conv2d", "conv", _conv, 2.0),
    OpRule("aten.conv3d", "conv", _conv, 2.0),
    OpRule("aten.convolution", "conv", _conv, 2.0),
    # backward of attention: dQ, dK, dV and dS recomputation: 5 matmuls vs 2 in forward
    OpRule("aten.scaled_dot_product_attention", "attention", _sdpa, 2.5),
    OpRule("aten._scaled_dot_product_flash_attention", "attention", _sdpa, 2.5),
    OpRule("aten._scaled_dot_product_efficient_attention", "attention", _sdpa, 2.5),
    OpRule("aten._scaled_dot_product_flash_attention_for_cpu", "attention", _sdpa, 2.5),
    OpRule("aten.embedding", "embedding", None, 1.0, splits=_EMBEDDING_SPLITS),
    OpRule("aten.embedding_bag", "embedding", None, 1.0, splits=_EMBEDDING_SPLITS),
    OpRule("aten._embedding_bag", "embedding", None, 1.0, splits=_EMBEDDING_SPLITS),
    OpRule("aten.layer_norm", "norm", _per_output(5), 2.0, splits=_SEQUENCE_SPLITS),
    OpRule("aten.native_layer_norm", "norm", _per_input(5), 2.0, splits=_SEQUENCE_SPLITS),
    OpRule("aten.rms_norm", "norm", _per_output(4), 2.0, splits=_SEQUENCE_SPLITS),
    OpRule("aten._fused_rms_norm", "norm", _per_input(4), 2.0, splits=_SEQUENCE_SPLITS),
    OpRule("aten.group_norm", "norm", _per_output(5), 2.0),
    OpRule("aten.batch_norm", "norm", _per_output(4), 2.0),
    OpRule("aten._native_batch_norm_legit_functional", "norm", _per_output(4), 2.0),
    OpRule("aten._native_batch_norm_legit_no_training", "norm", _per_output(2), 2.0),
    OpRule("aten.dropout", "elementwise", _per_output(1), 1.0, splits=_SEQUENCE_SPLITS),
    OpRule("aten.softmax", "reduction", _per_output(5), 1.0),
    OpRule("aten._softmax", "reduction", _per_output(5), 1.0),
    OpRule("aten._safe_softmax", "reduction", _per_output(5), 1.0),
    OpRule("aten.log_softmax", "reduction", _per_output(5), 1.0),
    OpRule("aten._log_softmax", "reduction", _per_output(5), 1.0),
    OpRule("aten.cross_entropy_loss", "reduction", _per_input(5), 1.0),
    OpRule("aten.nll_loss_forward", "reduction", _per_input(1), 1.0),
    OpRule("aten.mse_loss", "reduction", _per_input(3), 1.0),
    OpRule("aten.sum", "reduction", _per_input(1), 1.0),
    OpRule("aten.mean", "reduction", _per_input(1), 1.0),
    OpRule("aten.max_pool2d", "reduction", _per_output(1), 1.0),
    OpRule("aten.max_pool2d_with_indices", "reduction", _per_output(1), 1.0),
    OpRule("aten.avg_pool2d", "reduction", _per_output(1), 1.0),
    OpRule("aten.adaptive_avg_pool2d", "reduction", _per_input(1), 1.0),
    OpRule("aten.adaptive_avg_pool1d", "reduction", _per_input(1), 1.0),
]
ELEMENTWISE = (
    "relu", "gelu", "silu", "sigmoid", "tanh", "add", "sub", "mul", "div", "neg", "exp", "pow", "rsqrt",
    "sqrt", "where", "masked_fill", "clamp", "hardtanh", "leaky_relu", "elu", "softplus", "cos", "sin", "to",
    "_to_copy", "type_as", "copy", "clone", "contiguous", "cat", "stack", "pad", "constant_pad_nd", "tril",
    "triu", "cumsum", "gather", "index_select", "index", "scatter", "ones_like", "zeros_like", "full_like",
    "rand_like", "native_dropout", "bernoulli", "fill", "zero", "rsub", "abs", "log", "erf", "mish", "eq",
    "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or",
    "bitwise_not", "maximum", "minimum", "reciprocal", "sign", "floor", "ceil", "round", "sigmoid_backward",
    "any", "all", "repeat", "repeat_interleave", "roll", "flip"
)
for name in ELEMENTWISE:
    _BUILTIN.append(OpRule(f"aten.{name}", "elementwise", _per_output(1), 1.0))
for name in ("view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "flatten",
             "unflatten", "expand", "expand_as", "split", "split_with_sizes", "chunk", "unbind", "slice", "select",
             "narrow", "alias", "detach", "lift_fresh_copy", "arange", "zeros", "ones", "full", "empty",
             "scalar_tensor", "sym_size", "triu_indices", "tril_indices", "empty_like", "new_zeros", "new_ones",
             "new_empty", "zeros_like_", "linspace", "movedim", "as_strided", "view_as", "_assert_tensor_metadata",
             "dim", "size"):
    _BUILTIN.append(OpRule(f"aten.{name}", "view", None, 0.0, moves_data=False))

for _rule in _BUILTIN:
    register_op(_rule)
