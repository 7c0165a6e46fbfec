"""ParallelStyles for projection layouts PyTorch's own styles do not take, each weight a DTensor of
the original layout.

* :class:`PackedColwiseParallel`: a projection whose output holds several equal parts (nanoGPT's and
  GPT-2's fused ``[q|k|v]``, Phi-3's ``[gate|up]``) is split column-wise part by part: rank r holds
  slice r of every part, so its local output is ``[q_r|k_r|v_r]`` and the model's own
  ``split``/``chunk`` cuts it right. DTensor has the placement for this layout, ``_StridedShard(dim,
  split_factor=parts)`` (cut into ``parts`` pieces, each piece into ``tp`` slices, rank r holds
  slice r of every piece; FSDP2 + TP uses it for the same reason), so ``full_tensor()`` is the
  original weight. It also splits weights stored (in, out), as Hugging Face's ``Conv1D`` keeps them
  (``transposed=True``), which ``ColwiseParallel`` refuses.
* :class:`TransposedRowwiseParallel`: ``RowwiseParallel`` for weights stored (in, out) (``Conv1D``).
* :class:`PrepareFirstInput`: ``PrepareModuleInput`` for a module's first input whether the caller
  passes it by position or by keyword (Hugging Face decoder layers call their attention and MLP with
  ``hidden_states=...``, which ``PrepareModuleInput``'s positional layouts never see).
* :class:`RepeatedColwiseParallel`: a key/value projection with fewer heads than TP ranks (Gemma's
  single KV head, GQA with tp > num_key_value_heads) cannot be split by heads; its weight stays
  whole (replicated) and each rank keeps the head its query heads read. A fused multi-query
  projection (Falcon's ``query_key_value``: the query heads, then one key head and one value head)
  is kept the same way, part by part: rank r keeps its share of the query heads and the key/value
  head they read, so its local output is ``[q_r|k|v]``. Each rank's slice feeds only its own query
  heads, so the gradient each rank computes for the replicated weight is a part of the whole: the
  output is handed over with ``to_local(grad_placements=[Partial()])`` and autograd sums the parts
  over the TP ranks.
* :class:`SharedSliceParallel`: a projection kept whole whose output features ``[start, stop)``
  every head of a split attention reads (MLA's rope key: ``kv_a_proj_with_mqa``'s last
  ``qk_rope_head_dim`` outputs, broadcast into every head's key). A rank computes that piece's
  gradient from its own heads only, so the piece is handed over the same way and autograd sums it
  over the TP ranks; the other features reach the heads through colwise projections, whose input
  gradient DTensor already sums.

Parts of different widths (q, k, v under GQA: Phi-3's ``qkv_proj``) have no DTensor placement in
torch 2.13: one placement describes each rank's rows with a single stride.
:mod:`autopar_nb.planner.styles` shards such a weight as one block and gathers its output instead.

Checkpoints: DCP stores one box (offset, size) per rank and tensor, and a ``_StridedShard`` slice is
several boxes, so :func:`dcp_layout` hands DCP those tensors as ``Shard`` on the same dim (the
original layout, one all-gather) and :func:`restore_layout` puts what DCP loaded back into the
parameters' placement.

This file is copied verbatim into exported scripts: it imports only the standard library and torch.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard


def packed_placement(dim: int, parts: int):
    """The placement of a tensor whose ``dim`` holds ``parts`` equal parts, each split over the mesh
    dim: rank r holds slice r of every part (``Shard(dim)`` for one part)."""
    return _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)


def _distribute(module: nn.Module, mesh, placement_of, src_data_rank) -> None:
    """Each parameter of ``module`` itself (not its children) as a DTensor with ``placement_of(name,
    param)``."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placement_of(name, param)],
                                 src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class PackedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a projection whose output holds ``parts`` equal parts (see the module
    docstring).

    ``transposed``: the weight is stored (in, out) (Hugging Face ``Conv1D``): its output features
    are dim 1. ``output_layouts``: None keeps the output as the matmul leaves it (rank r: slice r of
    every part).

    The bias of a projection of several parts stays whole on every rank (DTensor adds each
    rank's slices of it to the local output). Split part by part, FSDP2 would cut a rank's
    ``[q_r|k_r|v_r]`` into contiguous pieces over the data-parallel ranks, which no placement
    describes: it records ``_StridedShard`` over ``_StridedShard``, and ``full_tensor()`` and
    checkpoints read the bias out of order. Whole, it is ``Shard(0)`` under FSDP.
    """

    def __init__(self, *, parts: int = 1, transposed: bool = False, input_layouts=None,
                 output_layouts=None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        self.parts, self.transposed = parts, transposed
        self.output_layouts = None if output_layouts is None else (output_layouts,)

    def _partition_packed_fn(self, name, module, device_mesh):
        def placement_of(pname, param):
            if param.dim() == 1 and self.parts > 1:
                return Replicate()
            return packed_placement(1 if self.transposed and param.dim() == 2 else 0, self.parts)

        _distribute(module, device_mesh, placement_of, self.src_data_rank)

    @staticmethod
    def _prepare_packed_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if output_layouts is not None and outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if isinstance(module, nn.Embedding) or getattr(module, "weight", None) is None:
            raise NotImplementedError("PackedColwiseParallel splits projections (nn.Linear, "
                                      f"Conv1D), not {type(module).__name__}")
        return distribute_module(
            module, device_mesh, self._partition_packed_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_packed_output_fn, self.output_layouts, self.use_local_output))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(parts={self.parts}, transposed={self.transposed})"


class TransposedRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a projection whose weight is stored (in, out) (Hugging Face
    ``Conv1D``): the weight is split on dim 0 (its input features), the bias replicated."""

    def _partition_transposed_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, lambda pname, p: Shard(0) if p.dim() == 2 else Replicate(),
                    self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_transposed_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class PrepareFirstInput(ParallelStyle):
    """The first input of a module, passed by position or by keyword, arrives laid out as
    ``input_layouts[0]`` and is redistributed to ``desired_input_layouts[0]`` (the same arguments as
    ``PrepareModuleInput``); backward redistributes its gradient the other way, as
    ``PrepareModuleInput`` does."""

    def __init__(self, *, input_layouts, desired_input_layouts, use_local_output: bool = True):
        super().__init__()
        self.input_layout, self.desired_layout = input_layouts[0], desired_input_layouts[0]
        self.use_local_output = use_local_output

    # (uneven sequence pieces would fail later, in a collective, on two sizes)
    def _prepare(self, t, mesh):
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, mesh, (self.input_layout,), run_check=False)
        if (isinstance(self.desired_layout, Shard)
            and (n := t.shape[self.desired_layout.dim]) % mesh.size()):
            raise ValueError(f"sequence parallelism splits each sequence over the {mesh.size()} TP "
                             f"ranks, but this batch's are {n} long: give the model sequences "
                             f"whose length divides by {mesh.size()} (make_batch, the dataset), or "
                             "plan without sequence parallelism")
        t = t.redistribute(placements=(self.desired_layout,))
        return t.to_local() if self.use_local_output else t

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters), None)

        def hook(_, args, kwargs):
            if args:
                return (self._prepare(args[0], device_mesh), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: self._prepare(kwargs[first], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class RepeatedColwiseParallel(ParallelStyle):
    """A projection with ``heads`` heads, fewer than the TP ranks (tp % heads == 0): the weight is
    replicated, each rank computes the whole output and keeps head ``rank * heads // tp`` (the one
    its query heads read, as ``repeat_kv`` pairs them). ``heads`` a tuple: the heads of each part of
    a fused output, one head width for all; a part whose heads tp divides is split (rank r keeps its
    r-th share), the others are kept as above. See the module docstring for the gradient."""

    def __init__(self, *, heads: int | tuple[int, ...], input_layouts=None):
        super().__init__()
        if min(heads if isinstance(heads, tuple) else (heads,)) < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        self.heads = heads
        self.input_layouts = (input_layouts or Replicate(),)

    def _partition_replicated_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, lambda pname, p: Replicate(), self.src_data_rank)

    @staticmethod
    def _prepare_input_fn(input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
        return (x.redistribute(placements=(Replicate(),), async_op=True)
                if x.placements != (Replicate(),) else x)

    @staticmethod
    def _prepare_output_fn(heads, mod, outputs, device_mesh):
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        parts = heads if isinstance(heads, tuple) else (heads,)
        if any(h % tp and tp % h for h in parts):
            raise ValueError(f"{heads} heads cannot be repeated over {tp} TP ranks (tp % heads != "
                             "0)")
        # the sum over ranks of the gradients of their slices is the gradient of the whole output
        full = outputs.to_local(grad_placements=(Partial(),))
        width, start, kept = full.shape[-1] // sum(parts), 0, []
        # a part tp divides: the rank's share of its heads; else the one head its queries read
        for h in parts:
            first, count = (rank * h // tp, h // tp) if h % tp == 0 else (rank * h // tp, 1)
            kept.append(full.narrow(-1, (start + first) * width, count * width))
            start += h
        return kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_replicated_fn,
                                 partial(self._prepare_input_fn, self.input_layouts),
                                 partial(self._prepare_output_fn, self.heads))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(heads={self.heads})"


class SharedSliceParallel(ParallelStyle):
    """A projection whose weight stays whole (plain tensors on every rank) and whose output features
    ``[start, stop)`` are read by every head of a split attention. See the module docstring for the
    gradient."""

    def __init__(self, *, start: int, stop: int):
        super().__init__()
        if not 0 <= start < stop:
            raise ValueError(f"the shared features [{start}, {stop}) are empty")
        self.start, self.stop = start, stop

    @staticmethod
    def _sum_piece_gradient(start, stop, device_mesh, module, inputs, output):
        piece = DTensor.from_local(output[..., start:stop], device_mesh, (Replicate(),),
                                   run_check=False)
        return torch.cat([output[..., :start], piece.to_local(grad_placements=(Partial(),)),
                          output[..., stop:]], -1)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_hook(partial(self._sum_piece_gradient, self.start, self.stop,
                                             device_mesh))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(start={self.start}, stop={self.stop})"


class _Alias(torch.autograd.Function):
    """The same values, in a tensor autograd does not count as a view (``detach`` shares the
    storage: no copy)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def modifiable_output(module: nn.Module, inputs, output):
    """A forward hook for a module a TP style wraps: its output, handed over by ``to_local()``, is a
    view made in a custom autograd Function, which autograd forbids modifying in place ("Output 0 of
    _ToTorchTensor is a view and is being modified inplace"), though models do (Falcon's decoder:
    ``mlp_output += attention_output``); an alias that is not a view can be."""
    if (isinstance(output, torch.Tensor) and not isinstance(output, DTensor) and output._is_view()
            and output.requires_grad):
        return _Alias.apply(output)
    return output


def dcp_layout(state):
    """``state`` (nested dicts/lists of tensors, as ``get_state_dict`` returns them) with every
    ``_StridedShard`` DTensor redistributed to ``Shard`` on the same dim: the same values, one
    contiguous box per rank, which is what DCP can store. Other entries are kept as they are (the
    same objects)."""
    if isinstance(state, dict):
        return {k: dcp_layout(v) for k, v in state.items()}
    if isinstance(state, list):
        return [dcp_layout(v) for v in state]
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in state.placements]
        return state.redistribute(placements=placements)
    return state


def restore_layout(loaded, like):
    """What DCP loaded into :func:`dcp_layout`'s tensors, redistributed back to the placements of
    ``like`` (the state :func:`dcp_layout` was given), for ``set_state_dict``."""
    if isinstance(loaded, dict):
        return {k: restore_layout(v, like[k]) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [restore_layout(v, w) for v, w in zip(loaded, like, strict=True)]
    if (isinstance(loaded, DTensor) and isinstance(like, DTensor)
        and loaded.placements != like.placements):
        return loaded.redistribute(placements=like.placements)
    return loaded
