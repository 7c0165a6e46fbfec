"""Built-in rules for the ATen ops that ``torch.export`` produces for typical models.

Matmul, convolution and attention FLOPs are ``torch.utils.flop_counter``'s (:mod:`.flops`): its formula where
torch has one for the op, else the formula of the op it runs as (linear as mm, conv2d as convolution, ...). Bias adds
and softmax/normalisation arithmetic are not matmul FLOPs; torch counts them as 0, the hand formulas below count a
few FLOPs per element for them (they are memory-bound: the cost model times them by bytes).
"""

from __future__ import annotations

import math

from . import flops as tf
from .registry import OpRule, Split, TensorMeta, register_op


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
# addmm(bias, x, w) with w stored (in, out) (Hugging Face's Conv1D, a Linear traced as addmm with w = weight.t()):
# the same two splits with the weight's dims swapped
_ADDMM_SPLITS = {
    "colwise": Split({0: 0, 2: 1}, forward=None, backward="all_reduce", comm_on="input",
                     note="colwise: output sharded on the last dim (Conv1D: PackedColwiseParallel(transposed=True))"),
    "rowwise": Split({2: 0}, forward="all_reduce", backward=None, comm_on="output",
                     note="rowwise: input sharded on the last dim (Conv1D: TransposedRowwiseParallel)"),
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

# What autograd keeps for backward (tools/autograd/derivatives.yaml; tokens in registry.SAVES): a matmul its
# operands, an activation its input or its output, a norm its input and per-row statistics, attention q, k, v, its
# output and the logsumexp; dropout a 1-byte mask on CUDA, a noise tensor of the output's dtype on CPU. The
# dispatch-level ops the eager recorder sees (native_layer_norm, native_batch_norm, ...) keep what their composite
# op keeps.
_OPERANDS = {"saves": ("inputs",)}
_DROPOUT = {"saves": ("mask@cuda", "temp@cpu")}


def _row_stats(k):
    # k fp32 values per row (every output element but the last dim): LayerNorm mean + rstd, RMSNorm rstd, logsumexp
    return lambda ins, outs: k * math.prod(outs[0][:-1] if outs else ())


def _channel_stats(k):
    # k fp32 values per channel (dim 1): BatchNorm / GroupNorm mean + rstd
    return lambda ins, outs: k * (outs[0][1] if outs and len(outs[0]) > 1 else 1)


_ATTENTION = {"saves": ("qkv", "output", "stats"), "stats": _row_stats(1)}

_BUILTIN = [
    OpRule("aten.linear", "matmul", tf.linear, 2.0, splits=_LINEAR_SPLITS, saves=("inputs",), flattens_ndim=3),
    OpRule("aten.mm", "matmul", tf.torch_flops("aten.mm"), 2.0, **_OPERANDS),
    OpRule("aten.addmm", "matmul", tf.torch_flops("aten.addmm"), 2.0, splits=_ADDMM_SPLITS, **_OPERANDS),
    OpRule("aten.bmm", "matmul", tf.torch_flops("aten.bmm"), 2.0, **_OPERANDS),
    OpRule("aten.baddbmm", "matmul", tf.torch_flops("aten.baddbmm"), 2.0, **_OPERANDS),
    OpRule("aten._scaled_mm", "matmul", tf.torch_flops("aten._scaled_mm"), 2.0, **_OPERANDS),
    OpRule("aten.matmul", "matmul", tf.matmul, 2.0, saves=("inputs",), flattens_ndim=4),
    OpRule("aten.einsum", "matmul", tf.einsum, 2.0, saves=("inputs",), flattens_ndim=4),
    OpRule("aten.conv1d", "conv", tf.convolution(transposed=False), 2.0, **_OPERANDS),
    OpRule("aten.conv2d", "conv", tf.convolution(transposed=False), 2.0, **_OPERANDS),
    OpRule("aten.conv3d", "conv", tf.convolution(transposed=False), 2.0, **_OPERANDS),
    OpRule("aten.conv_transpose1d", "conv", tf.convolution(transposed=True), 2.0, **_OPERANDS),
    OpRule("aten.conv_transpose2d", "conv", tf.convolution(transposed=True), 2.0, **_OPERANDS),
    OpRule("aten.conv_transpose3d", "conv", tf.convolution(transposed=True), 2.0, **_OPERANDS),
    OpRule("aten.convolution", "conv", tf.torch_flops("aten.convolution"), 2.0, **_OPERANDS),
    OpRule("aten._convolution", "conv", tf.torch_flops("aten._convolution"), 2.0, **_OPERANDS),
    # backward of attention: dQ, dK, dV and dS recomputation: 5 matmuls vs 2 in forward
    OpRule("aten.scaled_dot_product_attention", "attention", tf.attention, 2.5, **_ATTENTION),
    OpRule("aten._scaled_dot_product_flash_attention", "attention",
           tf.torch_flops("aten._scaled_dot_product_flash_attention"), 2.5, **_ATTENTION),
    OpRule("aten._scaled_dot_product_efficient_attention", "attention",
           tf.torch_flops("aten._scaled_dot_product_efficient_attention"), 2.5, **_ATTENTION),
    OpRule("aten._scaled_dot_product_cudnn_attention", "attention",
           tf.torch_flops("aten._scaled_dot_product_cudnn_attention"), 2.5, **_ATTENTION),
    OpRule("aten._scaled_dot_product_flash_attention_for_cpu", "attention", tf.attention, 2.5, **_ATTENTION),
    OpRule("aten.embedding", "embedding", None, 1.0, splits=_EMBEDDING_SPLITS, saves=("ids",)),
    OpRule("aten.embedding_bag", "embedding", None, 1.0, splits=_EMBEDDING_SPLITS, saves=("ids",)),
    OpRule("aten._embedding_bag", "embedding", None, 1.0, splits=_EMBEDDING_SPLITS, saves=("ids",)),
    OpRule("aten.layer_norm", "norm", _per_output(5), 2.0, splits=_SEQUENCE_SPLITS, saves=("input", "stats"),
           stats=_row_stats(2), tp_role="norm"),
    OpRule("aten.native_layer_norm", "norm", _per_input(5), 2.0, splits=_SEQUENCE_SPLITS, saves=("input", "stats"),
           stats=_row_stats(2), tp_role="norm"),
    # on CPU RMSNorm is decomposed: the normalised input is saved too
    OpRule("aten.rms_norm", "norm", _per_output(4), 2.0, splits=_SEQUENCE_SPLITS,
           saves=("input", "stats", "temp@cpu"), stats=_row_stats(1), tp_role="norm"),
    OpRule("aten._fused_rms_norm", "norm", _per_input(4), 2.0, splits=_SEQUENCE_SPLITS, saves=("input", "stats"),
           stats=_row_stats(1), tp_role="norm"),
    OpRule("aten.group_norm", "norm", _per_output(5), 2.0, saves=("input", "stats"), stats=_channel_stats(2),
           tp_role="norm"),
    OpRule("aten.batch_norm", "norm", _per_output(4), 2.0, saves=("input", "stats"), stats=_channel_stats(2),
           tp_role="norm"),
    OpRule("aten._native_batch_norm_legit_functional", "norm", _per_output(4), 2.0, saves=("input", "stats"),
           stats=_channel_stats(2), tp_role="norm"),
    OpRule("aten.native_batch_norm", "norm", _per_input(4), 2.0, saves=("input", "stats"),
           stats=_channel_stats(2), tp_role="norm"),
    OpRule("aten._native_batch_norm_legit", "norm", _per_input(4), 2.0, saves=("input", "stats"),
           stats=_channel_stats(2), tp_role="norm"),
    OpRule("aten._native_batch_norm_legit_no_training", "norm", _per_output(2), 2.0),
    OpRule("aten.dropout", "elementwise", _per_output(1), 1.0, splits=_SEQUENCE_SPLITS, **_DROPOUT),
    OpRule("aten.native_dropout", "elementwise", _per_output(1), 1.0, **_DROPOUT),
    OpRule("aten.feature_dropout", "elementwise", _per_output(1), 1.0, **_DROPOUT),
    OpRule("aten.alpha_dropout", "elementwise", _per_output(1), 1.0, **_DROPOUT),
    OpRule("aten.feature_alpha_dropout", "elementwise", _per_output(1), 1.0, **_DROPOUT),
    OpRule("aten.softmax", "reduction", _per_output(5), 1.0, saves=("output",)),
    OpRule("aten._softmax", "reduction", _per_output(5), 1.0, saves=("output",)),
    OpRule("aten._safe_softmax", "reduction", _per_output(5), 1.0),
    OpRule("aten.log_softmax", "reduction", _per_output(5), 1.0, saves=("output",)),
    OpRule("aten._log_softmax", "reduction", _per_output(5), 1.0, saves=("output",)),
    # reductions over the feature dim: a TP shard must not reach them
    OpRule("aten.cross_entropy_loss", "reduction", _per_input(5), 1.0, saves=("input_sized",), tp_role="reduction"),
    OpRule("aten.nll_loss_forward", "reduction", _per_input(1), 1.0, tp_role="reduction"),
    OpRule("aten.mse_loss", "reduction", _per_input(3), 1.0, saves=("inputs",), tp_role="reduction"),
    OpRule("aten.sum", "reduction", _per_input(1), 1.0, tp_role="reduction"),
    OpRule("aten.mean", "reduction", _per_input(1), 1.0, tp_role="reduction"),
    OpRule("aten.max_pool2d", "reduction", _per_output(1), 1.0, saves=("input",)),
    OpRule("aten.max_pool2d_with_indices", "reduction", _per_output(1), 1.0, saves=("input",)),
    OpRule("aten.avg_pool2d", "reduction", _per_output(1), 1.0, saves=("input",)),
    OpRule("aten.adaptive_avg_pool2d", "reduction", _per_input(1), 1.0, saves=("input",)),
    OpRule("aten.adaptive_avg_pool1d", "reduction", _per_input(1), 1.0, saves=("input",)),
]
ELEMENTWISE = {
    # keeps its input: the derivative is a function of x
    **dict.fromkeys(("gelu", "silu", "pow", "clamp", "hardtanh", "leaky_relu", "elu", "softplus", "cos", "sin"),
                    ("input",)),
    # keeps its output: the derivative is a function of y (relu: y > 0, sigmoid: y (1 - y), exp: y, ...)
    **dict.fromkeys(("relu", "sigmoid", "tanh", "exp", "rsqrt", "sqrt"), ("output",)),
    # x * y needs y for dx and x for dy
    **dict.fromkeys(("mul", "div"), ("operands",)),
    **dict.fromkeys(("masked_fill", "where"), ("bool_arg",)),
    **dict.fromkeys((
        "add", "sub", "neg", "to", "_to_copy", "type_as", "copy", "clone", "contiguous", "cat", "stack", "pad",
        "constant_pad_nd", "tril", "triu", "cumsum", "gather", "index_select", "index", "scatter", "ones_like",
        "zeros_like", "full_like", "rand_like", "bernoulli", "fill", "zero", "rsub", "abs", "log", "erf", "mish",
        "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or",
        "bitwise_not", "maximum", "minimum", "reciprocal", "sign", "floor", "ceil", "round", "sigmoid_backward",
        "any", "all", "repeat", "repeat_interleave", "roll", "flip", "__and__", "__or__", "diff"), ()),
}
"""elementwise ATen ops -> what each keeps for backward"""
for name, saves in ELEMENTWISE.items():
    _BUILTIN.append(OpRule(f"aten.{name}", "elementwise", _per_output(1), 1.0, saves=saves))
# torch.min(a, b) / torch.max(a, b): elementwise, like minimum / maximum (T5's relative position buckets); the
# packets' other overloads (min.dim, max.default) are reductions and stay unknown
for name in ("aten.min.other", "aten.max.other"):
    _BUILTIN.append(OpRule(name, "elementwise", _per_output(1), 1.0))

# views: a split of a tensor is a strided view, and cutting a TP shard's last dim would mix the pieces
SPLITTING = ("split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "tensor_split",
             "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk")
VIEWS = {
    **dict.fromkeys(("transpose", "permute", "t", "numpy_T", "mT", "mH", "adjoint", "swapaxes", "swapdims",
                     "expand", "expand_as", "movedim", "as_strided", *SPLITTING), "strided"),
    **dict.fromkeys(("reshape", "flatten", "_unsafe_view", "unflatten"), "reshape"),
    "view": "view",
    **dict.fromkeys((
        "unsqueeze", "squeeze", "alias", "detach", "lift_fresh_copy", "arange", "zeros", "ones", "full", "empty",
        "scalar_tensor", "sym_size", "triu_indices", "tril_indices", "empty_like", "new_zeros", "new_ones",
        "new_empty", "zeros_like_", "linspace", "view_as", "_assert_tensor_metadata", "dim", "size"), ""),
}
"""view and metadata ATen ops (no data moved) -> their layout (registry.LAYOUTS)"""
for name, layout in VIEWS.items():
    _BUILTIN.append(OpRule(f"aten.{name}", "view", None, 0.0, moves_data=False, layout=layout,
                           tp_role="split" if name in SPLITTING else ""))

for _rule in _BUILTIN:
    register_op(_rule)
