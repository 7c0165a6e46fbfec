"""Operator knowledge shared by the planner and the runtime: per-op FLOP/byte formulas, tensor-parallel split rules
and the collectives they imply, and a registry users extend for their own ops (:func:`register_op`).

``kernels_ext`` never imports ``autopar_nb``.
"""

from . import aten_rules, moe_rules  # noqa: F401  (register the built-in ATen rules, then the MoE ones)
from .registry import OP_CLASSES, OpRule, Split, TensorMeta, lookup, register_op, registered

__all__ = ["OP_CLASSES", "OpRule", "Split", "TensorMeta", "lookup", "register_op", "registered"]
