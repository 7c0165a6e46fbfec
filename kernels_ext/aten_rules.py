"""Built-in rules for the ATen ops that ``torch.export`` produces for typical models.

Matmul, convolution and attention FLOPs are ``torch.utils.flop_counter``'s (:mod:`.torch_flops`): its formula where
torch has one for the op, else the formula of the op it runs as (linear as mm, conv2d as convolution, ...). Bias adds
and softmax/normalisation arithmetic are not matmul FLOPs; torch counts them as 0, the hand formulas below count a
few FLOPs per element for them (they are memory-bound: the cost model times them by bytes).
"""

from __future__ import annotations

from . import torch_flops as tf
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
    OpRule("aten.linear", "matmul", tf.linear, 2.0, splits=_LINEAR_SPLITS),
    OpRule("aten.mm", "matmul", tf.torch_flops("aten.mm"), 2.0),
    OpRule("aten.addmm", "matmul", tf.torch_flops("aten.addmm"), 2.0),
    OpRule("aten.bmm", "matmul", tf.torch_flops("aten.bmm"), 2.0),
    OpRule("aten.baddbmm", "matmul", tf.torch_flops("aten.baddbmm"), 2.0),
    OpRule("aten._scaled_mm", "matmul", tf.torch_flops("aten._scaled_mm"), 2.0),
    OpRule("aten.matmul", "matmul", tf.matmul, 2.0),
    OpRule("aten.einsum", "matmul", tf.einsum, 2.0),
    OpRule("aten.conv1d", "conv", tf.convolution(transposed=False), 2.0),
    OpRule("aten.conv2d", "conv", tf.convolution(transposed=False), 2.0),
    OpRule("aten.conv3d", "conv", tf.convolution(transposed=False), 2.0),
    OpRule("aten.conv_transpose1d", "conv", tf.convolution(transposed=True), 2.0),
    OpRule("aten.conv_transpose2d", "conv", tf.convolution(transposed=True), 2.0),
    OpRule("aten.conv_transpose3d", "conv", tf.convolution(transposed=True), 2.0),
    OpRule("aten.convolution", "conv", tf.torch_flops("aten.convolution"), 2.0),
    OpRule("aten._convolution", "conv", tf.torch_flops("aten._convolution"), 2.0),
    # backward of attention: dQ, dK, dV and dS recomputation: 5 matmuls vs 2 in forward
    OpRule("aten.scaled_dot_product_attention", "attention", tf.attention, 2.5),
    OpRule("aten._scaled_dot_product_flash_attention", "attention",
           tf.torch_flops("aten._scaled_dot_product_flash_attention"), 2.5),
    OpRule("aten._scaled_dot_product_efficient_attention", "attention",
           tf.torch_flops("aten._scaled_dot_product_efficient_attention"), 2.5),
    OpRule("aten._scaled_dot_product_cudnn_attention", "attention",
           tf.torch_flops("aten._scaled_dot_product_cudnn_attention"), 2.5),
    OpRule("aten._scaled_dot_product_flash_attention_for_cpu", "attention", tf.attention, 2.5),
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
