"""Operator knowledge shared by the planner and the runtime: per-op FLOP/byte formulas (torch.utils.flop_counter's
where torch has one), what each op saves for backward, tensor-parallel split rules and the collectives they imply,
and a registry users extend for their own ops (:func:`register_op`).

``kernels_ext`` never imports ``autopar_nb``.
"""

from . import aten_rules, moe_rules  # noqa: F401  (register the built-in ATen rules, then the MoE ones)
from .flops import torch_flops
from .fused import RMSNorm, linear_cross_entropy, rms_norm, vocab_parallel_linear_cross_entropy
from .registry import (
    LAYOUTS,
    OP_CLASSES,
    SAVES,
    TP_ROLES,
    OpRule,
    Split,
    TensorMeta,
    lookup,
    register_op,
    registered,
)

__all__ = ["LAYOUTS", "OP_CLASSES", "SAVES", "TP_ROLES", "OpRule", "RMSNorm", "Split", "TensorMeta",
           "linear_cross_entropy", "lookup", "register_op", "registered", "rms_norm", "torch_flops",
           "vocab_parallel_linear_cross_entropy"]
