"""The operator registry: what autopar-nb knows about each ATen op.

An :class:`OpRule` gives an op's forward FLOPs and bytes from its argument shapes, how much its backward costs, its
op class (for the efficiency the cost model applies), what autograd keeps of it for backward (activation memory),
the ways its main parameter can be split across tensor-parallel ranks together with the collective each split
implies, and its role when a tensor-parallel shard reaches it (a norm, a reduction, a split). Users add rules for
their own custom ops with :func:`register_op`; a rule describes its op completely, nothing else in autopar-nb knows
ops by name.

This package never imports ``autopar_nb``: the planner and runtime import it, not the other way round.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class TensorMeta(NamedTuple):
    """Shape and dtype of a tensor argument, as the capture step hands it to a rule."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


FlopFn = Callable[[tuple, dict, list[TensorMeta]], float]
"""(args, kwargs, outputs) -> forward FLOPs. Tensor arguments arrive as TensorMeta, everything else as is."""

OP_CLASSES = ("matmul", "conv", "attention", "norm", "elementwise", "reduction", "embedding", "view", "other")

StatsFn = Callable[[list[tuple[int, ...]], list[tuple[int, ...]]], int]
"""(shapes of the tensor arguments in order, shapes of the outputs) -> elements of fp32 statistics saved"""

SAVES = {
    "inputs": "every floating-point activation input (x and w of x @ w; parameters are held anyway)",
    "input": "the first floating-point activation input",
    "qkv": "the first three activation inputs (query, key, value)",
    "operands": "every floating-point activation input when two tensors meet (x * y keeps both; x * 2 keeps none)",
    "output": "the output",
    "stats": "fp32 statistics per normalised row, ``stats(...)`` elements (norm mean/rstd, attention logsumexp)",
    "ids": "the integer ids it looks up (embeddings)",
    "mask": "a 1-byte mask the size of the output (dropout's on CUDA)",
    "temp": "one more tensor the size and dtype of the output (dropout's noise on CPU, a decomposed norm's "
            "normalised input)",
    "bool_arg": "a 1-byte copy of its boolean activation argument (masked_fill's mask, where's condition)",
    "input_sized": "a new tensor the size of its first floating input, in the dtype the op computes in "
                   "(cross-entropy's log-softmax, which its nll_loss keeps)",
}
"""What an op can keep for backward (``OpRule.saves``), following ``tools/autograd/derivatives.yaml``. A token
ending in "@cuda" or "@cpu" counts on that device kind only ("temp@cpu")."""

TP_ROLES = {
    "": "none of the below: a tensor-parallel shard passes through it (elementwise ops, views)",
    "norm": "normalises over the feature dim: a feature-sharded tensor must not reach it; under sequence "
            "parallelism it runs on sequence shards (LayerNorm, RMSNorm)",
    "reduction": "reduces over the feature dim: a feature-sharded tensor must not reach it (sum, mean, losses)",
    "split": "cuts its input into pieces (split, chunk, unbind, slice): a contiguous colwise shard of the last dim "
             "would mix the pieces (q, k and v of a fused QKV), so a projection cut this way is split part by part",
}
"""How tensor parallelism treats an op that is not itself split (``OpRule.tp_role``)."""

LAYOUTS = {
    "": "its result is laid out like its input (or it is not a view)",
    "strided": "a view that may be non-contiguous (transpose, permute, split, slice, expand)",
    "reshape": "a reshape that copies a non-contiguous input (reshape, flatten)",
    "view": "a reshape that never copies (aten.view)",
}
"""How a view op's result is laid out relative to its input (``OpRule.layout``)."""


@dataclass(frozen=True)
class Split:
    """One way to shard an op across ``t`` tensor-parallel ranks.

    ``param_dims`` maps the positional index of a parameter argument to the dim it is split on. ``forward`` and
    ``backward`` name the collective the split needs on the activations ("all_reduce", "all_gather",
    "reduce_scatter" or None) and ``comm_on`` which tensor it moves ("output" or "input")."""

    param_dims: dict[int, int]
    forward: str | None = None
    backward: str | None = None
    comm_on: str = "output"
    note: str = ""


@dataclass(frozen=True)
class OpRule:
    """What the planner and runtime know about one op (see the module docstring)."""

    name: str
    """ATen overload packet or glob, e.g. "aten.linear" or "mylib.fused_*"."""
    op_class: str
    flops: FlopFn | None = None
    """forward FLOPs; None means 0 (data movement only). For an op ``torch.utils.flop_counter`` has a formula for,
    ``kernels_ext.torch_flops("mylib.op")`` uses torch's."""
    backward_factor: float = 1.0
    """backward FLOPs = factor x forward FLOPs (2 for matmuls: grad wrt input and grad wrt weight)"""
    moves_data: bool = True
    """False for views/metadata ops that read and write nothing"""
    splits: dict[str, Split] = field(default_factory=dict)
    """TP style name ("colwise", "rowwise", ...) -> Split"""
    saves: tuple[str, ...] = ()
    """what autograd keeps for the op's backward: tokens of :data:`SAVES`, e.g. ("inputs",) for a matmul, ("input",
    "stats") for a norm; () keeps nothing"""
    stats: StatsFn | None = None
    """elements of fp32 statistics the "stats" token saves"""
    flattens_ndim: int = 0
    """activation inputs of at least this many dims are flattened first (linear: 3, (..., k) to (tokens, k);
    matmul: 4, batch dims folded), so a non-contiguous one is copied and the copy is what the op saves; 0: never"""
    tp_role: str = ""
    """what a tensor-parallel shard reaching the op means, a key of :data:`TP_ROLES` ("norm", "reduction", "split")"""
    layout: str = ""
    """for view ops: a key of :data:`LAYOUTS` ("strided", "reshape", "view")"""

    def __post_init__(self):
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"op_class {self.op_class!r} unknown; choose one of {', '.join(OP_CLASSES)}")
        if isinstance(self.saves, str):
            raise ValueError(f"saves={self.saves!r} must be a tuple of tokens, e.g. saves=({self.saves!r},)")
        object.__setattr__(self, "saves", tuple(self.saves))
        for token in self.saves:
            what, _, device = token.partition("@")
            if what not in SAVES or device not in ("", "cuda", "cpu"):
                raise ValueError(f"saves token {token!r} unknown; choose from {', '.join(SAVES)}, optionally "
                                 "followed by @cuda or @cpu")
            if what == "stats" and self.stats is None:
                raise ValueError(f"{self.name}: saves 'stats' needs stats=(in_shapes, out_shapes) -> elements")
        if self.tp_role not in TP_ROLES:
            raise ValueError(f"tp_role {self.tp_role!r} unknown; choose one of {', '.join(map(repr, TP_ROLES))}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} unknown; choose one of {', '.join(map(repr, LAYOUTS))}")

    def saves_on(self, device_kind: str) -> tuple[str, ...]:
        """The :data:`SAVES` tokens that count on ``device_kind`` ("cuda" or "cpu"), device suffixes removed."""
        out = []
        for token in self.saves:
            what, _, device = token.partition("@")
            if device in ("", device_kind):
                out.append(what)
        return tuple(out)

    def forward_flops(self, args: tuple, kwargs: dict, outputs: list[TensorMeta]) -> float:
        return float(self.flops(args, kwargs, outputs)) if self.flops else 0.0

    def bytes_moved(self, args: tuple, kwargs: dict, outputs: list[TensorMeta]) -> tuple[int, int]:
        """(bytes read, bytes written) assuming each tensor argument is read once and each output written once."""
        if not self.moves_data:
            return 0, 0
        read = sum(a.nbytes for a in _tensors(args) + _tensors(list(kwargs.values())))
        return read, sum(o.nbytes for o in outputs)


_RULES: dict[str, OpRule] = {}
_GLOBS: list[OpRule] = []


def register_op(rule: OpRule, *, replace: bool = False) -> OpRule:
    """Teach autopar-nb about an op. Example, a custom fused MLP ``mylib.fused_mlp(x, w1, w2)``::

        from kernels_ext import OpRule, Split, register_op

        register_op(OpRule(
            "mylib.fused_mlp", "matmul",
            flops=lambda args, kwargs, outs: 2 * args[0].numel * (args[1].shape[0] + args[2].shape[0]),
            backward_factor=2.0,
            splits={"colwise-rowwise": Split({1: 0, 2: 1}, forward="all_reduce", backward="all_reduce")},
            saves=("inputs",),  # its activation input x (the weights are parameters, held anyway)
        ))

    and a fused RMSNorm ``mylib.rms_norm(x, weight)`` that keeps its input and one fp32 rstd per row::

        register_op(OpRule(
            "mylib.rms_norm", "norm",
            flops=lambda args, kwargs, outs: 4 * outs[0].numel, backward_factor=2.0,
            saves=("input", "stats"), stats=lambda ins, outs: math.prod(outs[0][:-1]),
            tp_role="norm",
        ))

    Names may be globs (``"mylib.*"``); an exact name wins over a glob. Registering a name twice raises unless
    ``replace=True``.
    """
    if not replace and (rule.name in _RULES or any(g.name == rule.name for g in _GLOBS)):
        raise ValueError(f"op {rule.name!r} already has a rule; pass replace=True to override it")
    if any(ch in rule.name for ch in "*?["):
        _GLOBS[:] = [g for g in _GLOBS if g.name != rule.name] + [rule]
    else:
        _RULES[rule.name] = rule
    return rule


def lookup(op_name: str) -> OpRule | None:
    """The rule for ``"aten.linear.default"`` (overload name optional), or None when the op is unknown."""
    packet = op_name.rsplit(".", 1)[0] if op_name.count(".") >= 2 else op_name
    # an in-place variant (aten.div_) costs what its out-of-place op (aten.div) costs
    inplace = packet[:-1] if packet.endswith("_") and not packet.endswith("__") else None
    for key in (op_name, packet, inplace):
        if key in _RULES:
            return _RULES[key]
    for g in _GLOBS:
        if fnmatch.fnmatchcase(op_name, g.name) or fnmatch.fnmatchcase(packet, g.name):
            return g
    return None


def registered() -> list[str]:
    """Names of every registered rule."""
    return sorted(_RULES) + [g.name for g in _GLOBS]


def _tensors(values: Any) -> list[TensorMeta]:
    out: list[TensorMeta] = []
    for v in values:
        if isinstance(v, TensorMeta):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors(v)
    return out
