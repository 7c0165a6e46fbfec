"""The output head's Linear and the default cross-entropy as one fused, chunked op
(``plan.fused_loss``): the full logits (tokens x vocab) and their gradient are never held, only one
chunk of them at a time.

The op is kernels_ext's ``linear_cross_entropy`` (Liger-kernel's Triton kernel on CUDA when
installed, else the chunked ``kernels_ext::linear_cross_entropy`` custom op): one implementation,
which this module calls and does not copy. Under tensor parallelism (:func:`shard_fused_head`) the
head's weight is split on the vocabulary and the loss is kernels_ext's
``vocab_parallel_linear_cross_entropy`` (Megatron-LM's vocab-parallel cross-entropy, chunked: each
rank computes its vocabulary rows' logits; the log-sum-exp is combined with torch.distributed
all-reduces). This file is copied verbatim into exported scripts: it imports only the standard
library and torch at the top; kernels_ext is imported when a plan uses the fused loss, and a script
that needs it says how to install it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from .data import call_model, first_tensor

IGNORE_INDEX = -100
"""targets left out of the loss (``F.cross_entropy``'s default): the last position of a causal LM"""


def fused_op(name: str = "linear_cross_entropy"):
    """``kernels_ext.linear_cross_entropy`` (or another of its functions, ``name``); an ImportError
    that says what to install when it is missing."""
    try:
        import kernels_ext
    except ImportError as e:
        raise ImportError("this plan fuses the output head and the loss (plan.fused_loss) with "
                          "kernels_ext, which is not installed here: pip install autopar-nb (it "
                          "ships kernels_ext), or re-plan with fix fused_loss=False") from e
    return getattr(kernels_ext, name)


class LinearCrossEntropyHead(nn.Module):
    """Stands in for a bias-free ``nn.Linear`` output head, holding the same ``weight`` Parameter
    (names, ties and state dicts unchanged). While :func:`fused_default_loss` runs the model it
    holds the targets and its forward returns the mean cross-entropy of ``hidden @ weight.T``
    against them, chunk by chunk (inside the forward, so FSDP has gathered the weight); otherwise it
    returns the logits, as the Linear did."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.target: torch.Tensor | None = None
        self.op = fused_op()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        split = isinstance(self.weight, DTensor)  # tensor parallelism: this rank's vocabulary rows
        if self.target is None:
            if split:  # the logits, gathered
                whole = DTensor.from_local(hidden, self.weight.device_mesh, (Replicate(),),
                                           run_check=False)
                return F.linear(whole, self.weight).full_tensor()
            return F.linear(hidden, self.weight)
        weight, device = self.weight.to_local() if split else self.weight, hidden.device.type
        if torch.is_autocast_enabled(device):  # the op runs below autocast: cast as F.linear would
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        if split:
            mesh = self.weight.device_mesh
            start = min(mesh.get_local_rank() * math.ceil(self.out_features / mesh.size()),
                        self.out_features)
            return fused_op("vocab_parallel_linear_cross_entropy")(
                hidden, weight, self.target, start=start, vocab=self.out_features,
                group=mesh.get_group(), ignore_index=IGNORE_INDEX)
        return self.op(hidden, weight, self.target, ignore_index=IGNORE_INDEX)


def apply_fused_loss(model: nn.Module, head: str) -> LinearCrossEntropyHead:
    """Replace the bias-free Linear at ``head`` with a :class:`LinearCrossEntropyHead` (before TP,
    compile and data parallelism wrap the modules); returns it."""
    linear = model.get_submodule(head) if head else None
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise ValueError(f"plan.fused_loss={head!r} must name a bias-free nn.Linear below the "
                         f"model, found {type(linear).__name__}"
                         + (" with a bias" if isinstance(linear, nn.Linear) else ""))
    parent, _, name = head.rpartition(".")
    fused = LinearCrossEntropyHead(linear)
    (model.get_submodule(parent) if parent else model).register_module(name, fused)
    return fused


def shard_fused_head(model: nn.Module, head: str, tp_mesh, *, sequence_sharded: bool) -> None:
    """Tensor parallelism for the fused head (after ``apply_tp``, before ``tie_parameters``): its
    weight split on the vocabulary as ``ColwiseParallel`` splits a Linear's (DTensor ``Shard(0)``,
    so an embedding it is tied to, split rowwise, stays one parameter with it), and its input, when
    the layers before it are sequence parallel, gathered whole (``PrepareModuleInput``: ``Shard(1)``
    to ``Replicate``). Its loss is then the vocab-parallel one."""
    module = model.get_submodule(head) if head else None
    if not isinstance(module, LinearCrossEntropyHead):
        raise ValueError(f"shard_fused_head needs the head apply_fused_loss replaced at {head!r}, "
                         f"found {type(module).__name__}")
    module.register_parameter("weight",
                              nn.Parameter(distribute_tensor(module.weight, tp_mesh, [Shard(0)]),
                                           requires_grad=module.weight.requires_grad))
    if sequence_sharded:
        parallelize_module(module, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                               desired_input_layouts=(Replicate(),),
                                                               use_local_output=True))


def fused_default_loss(model, batch, *, causal: bool = True) -> torch.Tensor:
    """``default_loss`` (runtime/data.py) for a model whose head :func:`apply_fused_loss` replaced:
    the head gets the targets (the next token's for a causal LM, the last position ignored; else the
    same position's) and returns the loss, which must reach the model's output unchanged (a tensor,
    or a Hugging Face output's ``logits``). Under pipelining the last stage's loss runs it on a
    ``StageOutput`` (runtime/pp.py), which holds the head; a ``model`` that is no module
    (``model_call``'s stand-in, which records the inputs) is only called."""
    if not isinstance(model, nn.Module):
        return call_model(model, batch)
    head = next((m for m in model.modules() if isinstance(m, LinearCrossEntropyHead)), None)
    if head is None:
        raise ValueError("fused_default_loss needs a model whose head apply_fused_loss replaced")
    ids = first_tensor(batch)
    head.target = (torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
                   if causal else ids)
    try:
        out = call_model(model, batch)
    finally:
        head.target = None
    loss = out.logits if hasattr(out, "logits") else out
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("the fused head's loss did not reach the model's output unchanged (the "
                         "model transforms its head's output): re-plan with fix fused_loss=False")
    return loss
