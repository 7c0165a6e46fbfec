"""What ``torch.autocast`` does to each ATen op: its policy on CPU and on CUDA, as torch 2.13 registers it
(``aten/src/ATen/autocast_mode.cpp``; the CUDA lists are the ``AT_FORALL_*`` macros of the shipped
``torch/include/ATen/autocast_mode.h``). An op autocast does not list falls through: it runs in the dtypes its inputs
have (a test checks these sets against the dispatcher's AutocastCPU/AutocastCUDA kernels and
probes one op of each policy).

Policies (:data:`POLICIES`):

* ``lower``: floating inputs cast to the autocast dtype (a copy each call; leaf parameters' copies cached for the
  autocast region), output in that dtype;
* ``fp32``: floating inputs cast to float32, output float32;
* ``fp32_opt``: run with ``dtype=torch.float32`` unless the call passed a dtype (the op upcasts inside: no input
  copies), output float32;
* ``promote``: inputs cast to the widest floating dtype among them, output in it;
* ``banned``: autocast raises (``binary_cross_entropy`` on CUDA).

Op names are ATen's, with the overload when it is not ``default``: ``linear``, ``softmax.int``, ``pow.Tensor_Scalar``.
"""

from __future__ import annotations

POLICIES = ("lower", "fp32", "fp32_opt", "promote", "banned")
"""what autocast does to an op's dtypes (module docstring); "" for an op it does not list"""

_CONV = ("conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
         "conv_transpose3d.input", "_convolution.deprecated")
_MATMUL = ("addbmm", "addmm", "baddbmm", "bmm", "linalg_vecdot", "linear", "matmul", "mm", "prelu",
           "scaled_dot_product_attention")

LOWER = {
    "cpu": frozenset(_CONV + _MATMUL + ("conv1d.padding", "conv2d.padding", "conv3d.padding", "_addmm_activation",
                                        "_native_multi_head_attention", "mkldnn_rnn_layer")),
    "cuda": frozenset(_CONV + _MATMUL + (
        "_convolution", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "addmv", "addr", "einsum",
        "mv", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
        "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention")),
}
"""ops autocast runs in its lower-precision dtype (AT_FORALL_LOWER_PRECISION_FP; the CPU kernel's own list)"""

_LOSSES = ("binary_cross_entropy_with_logits", "cosine_embedding_loss", "hinge_embedding_loss", "huber_loss", "kl_div",
           "l1_loss", "margin_ranking_loss", "mse_loss", "multi_margin_loss", "multilabel_margin_loss", "nll_loss",
           "nll_loss2d", "poisson_nll_loss", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss")
_CPU_LINALG = ("cholesky", "cholesky_inverse", "cholesky_solve", "geqrf", "inverse", "linalg_cholesky",
               "linalg_cholesky_ex", "linalg_cond", "linalg_cond.p_str", "linalg_eig", "linalg_eigh", "linalg_eigvals",
               "linalg_eigvalsh", "linalg_householder_product", "linalg_inv", "linalg_inv_ex", "linalg_lstsq",
               "linalg_matrix_rank", "linalg_matrix_rank.atol_rtol_float", "linalg_matrix_rank.atol_rtol_tensor",
               "linalg_matrix_rank.tol_tensor", "linalg_qr", "linalg_solve", "linalg_svd", "linalg_svdvals",
               "linalg_tensorinv", "linalg_tensorsolve", "lu_solve", "_lu_with_info", "orgqr", "ormqr", "pinverse",
               "qr", "svd", "triangular_solve")
_CPU_FFT = tuple(f"fft_{k}" for k in ("fft", "fft2", "fftn", "hfft", "ifft", "ifft2", "ifftn", "ihfft", "irfft",
                                      "irfft2", "irfftn", "rfft", "rfft2", "rfftn"))

FP32 = {
    "cpu": frozenset(_LOSSES + _CPU_LINALG + _CPU_FFT + (
        "cross_entropy_loss", "binary_cross_entropy", "ctc_loss.IntList", "ctc_loss.Tensor",
        "multilabel_margin_loss_forward", "adaptive_avg_pool3d", "adaptive_max_pool3d", "avg_pool3d", "max_pool3d",
        "max_unpool2d", "max_unpool3d", "fractional_max_pool2d", "fractional_max_pool3d", "reflection_pad1d",
        "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d", "grid_sampler",
        "grid_sampler_2d", "grid_sampler_3d", "_grid_sampler_2d_cpu_fallback", "cdist", "polar", "prod",
        "prod.dim_int", "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center",
        "trace", "view_as_complex", "fake_quantize_per_tensor_affine")),
    "cuda": frozenset(_LOSSES + (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp", "norm.Scalar", "norm.ScalarOpt_dim",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")),
}
"""ops autocast runs in float32 (AT_FORALL_FP32 on CUDA; the CPU kernel's fp32 list). On CPU norms, softmax and
pow are not listed: they run in their input's dtype."""

FP32_OPT_DTYPE = {
    "cpu": frozenset(),
    "cuda": frozenset(("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                       "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                       "sum.dim_IntList")),
}
"""ops autocast gives ``dtype=torch.float32`` (AT_FORALL_FP32_SET_OPT_DTYPE)"""

PROMOTE = {
    "cpu": frozenset(("cat", "stack", "index_copy")),
    "cuda": frozenset(("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                       "index_put", "tensordot", "scatter_add")),
}
"""ops autocast runs in the widest floating dtype of their inputs (AT_FORALL_PROMOTE)"""

BANNED = {"cpu": frozenset(), "cuda": frozenset(("binary_cross_entropy",))}
"""ops autocast refuses (unsafe to autocast: use the ``_with_logits`` form)"""


def op_key(op: str) -> str:
    """``aten.softmax.int`` / ``aten::softmax.int`` / ``softmax.int`` -> ``softmax.int``; the ``default`` overload
    is dropped (``aten.linear.default`` -> ``linear``)."""
    name = op.removeprefix("aten.").removeprefix("aten::")
    base, _, overload = name.partition(".")
    return base if overload in ("", "default") else f"{base}.{overload}"


def autocast_policy(op: str, device_kind: str) -> str:
    """What autocast does to ``op`` (an ATen overload, any spelling :func:`op_key` reads) on ``device_kind``
    ("cpu"; anything else is costed as CUDA): one of :data:`POLICIES`, or "" when autocast does not list it."""
    kind = "cpu" if device_kind == "cpu" else "cuda"
    key = op_key(op)
    for policy, table in (("lower", LOWER), ("fp32", FP32), ("fp32_opt", FP32_OPT_DTYPE), ("promote", PROMOTE),
                          ("banned", BANNED)):
        if key in table[kind]:
            return policy
    return ""
