"""Ops and modules read as what they compute: in the exported graph a view of a parameter
(``weight.T``) is the parameter, and ``input @ weight.T`` in the forward of an ``nn.Linear``
subclass is ``aten.linear``; a subclass of ``nn.Linear`` or ``nn.Embedding`` is the class TP splits
it as."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

import kernels_ext


def param_view(node, placeholder_target: dict[str, str], model: nn.Module) -> str | None:
    """The weight ``node`` transposes (``weight.T``: a transposing view whose one tensor operand is
    the weight of an ``nn.Linear`` subclass with a forward of its own, Falcon's ``FalconLinear``),
    else None. No other view: the graph keeps every other op, whose node names the copied blocks'
    trace matches against a full trace's."""
    rule = kernels_ext.lookup(str(node.target))
    tensors = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, torch.fx.Node)]
    if (node.target not in _TRANSPOSES or rule is None or rule.op_class != "view"
        or len(tensors) != 1):
        return None
    target = placeholder_target.get(tensors[0].name)
    if target is None or not target.endswith(".weight"):
        return None
    try:
        owner = model.get_submodule(target.removesuffix(".weight"))
    except AttributeError:
        return None
    own_forward = isinstance(owner, nn.Linear) and type(owner).forward is not nn.Linear.forward
    return target if own_forward else None


def as_linear(node, op: str, args: tuple, params: list[str], model: nn.Module,
              path: str) -> tuple[str, tuple]:
    """``input @ self.weight.T`` in the forward of an ``nn.Linear`` subclass (Falcon's
    ``FalconLinear``) is what ``F.linear`` computes: recorded as ``aten.linear(input, weight)``, so
    that costs and TP read it as the Linear it is (PyTorch's TP styles split any ``nn.Linear``; the
    planner runs the subclass's own forward on the shards)."""
    if op != "aten.matmul.default" or params != [f"{path}.weight"] or len(node.args) != 2 or \
            not isinstance(node.args[1], torch.fx.Node) or node.args[1].target not in _TRANSPOSES:
        return op, args
    module = model.get_submodule(path) if path else model
    if not isinstance(module, nn.Linear) or tuple(args[1].shape) != (module.in_features,
                                                                     module.out_features):
        return op, args
    return "aten.linear.default", (args[0], module.weight)


_TRANSPOSES = (torch.ops.aten.numpy_T.default, torch.ops.aten.t.default,
               torch.ops.aten.transpose.int)


def class_name(module: nn.Module) -> str:
    """The class name the TP rules read: a subclass of ``nn.Embedding`` or ``nn.Linear`` with its
    own forward (Gemma's embedding, which scales the lookup by sqrt(hidden); Falcon's ``input @
    self.weight.T``) is an "Embedding" or a "Linear", which PyTorch TP splits as one; the planner
    then runs its forward on the shard (``planner/forward_run.py``)."""
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return "Linear" if isinstance(module, nn.Linear) else type(module).__name__
