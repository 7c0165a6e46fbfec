"""Per-rank head counts and widths for model code that reads global sizes.

After TP a rank's attention module holds ``heads / tp`` heads, but its forward may still read the
global numbers from attributes: GPT-2's ``split_size`` (``c_attn(x).split(self.split_size,
dim=2)``), nanoGPT's ``n_embd`` and ``n_head``, T5's ``n_heads`` (``torch.zeros(1, self.n_heads, q,
k)``), Phi-3's ``config.num_attention_heads``. torchtitan once wrote ``attn.n_heads //= tp``; here
the values are decided at export time from the model and the plan, written in the script as plain
numbers, and set as they are (setting them twice is harmless).

This file is copied verbatim into exported scripts: it imports only the standard library and torch.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.fx as fx
import torch.nn as nn

from .tp import select


def set_local_sizes(model: nn.Module, sizes: dict[str, dict[str, int]]) -> None:
    """Set per-rank sizes: ``sizes`` maps module patterns (``"h.*.attn"``; see :func:`select`) to
    attribute -> value. A dotted attribute (``"config.num_attention_heads"``) is set on the module's
    own shallow copy of that object, so the model's shared config keeps its global values. Patterns
    that match nothing are skipped (the modules may live on another pipeline stage)."""
    for pattern, attributes in sizes.items():
        for path in select(model, pattern):
            module = model.get_submodule(path)
            if isinstance(getattr(module, "graph", None), fx.Graph):
                continue  # traced for a pipeline: no attributes (pp.splits_into_equal_parts)
            for name, value in attributes.items():
                owner, _, attr = name.rpartition(".")
                target = module
                if owner:
                    if "." in owner:
                        raise ValueError(f"{path}: {name!r} is nested too deep; name an attribute "
                                         "of the module or of one object it holds "
                                         "(config.num_attention_heads)")
                    target = copy.copy(getattr(module, owner))
                    setattr(module, owner, target)
                if not hasattr(target, attr):
                    raise AttributeError(f"{path} ({type(module).__name__}) has no attribute "
                                         f"{name!r} to set to its per-rank value; re-export the "
                                         "script for this model")
                setattr(target, attr, value)


def shard_head_tables(model: nn.Module, tp_mesh,
                      tables: dict[str, dict[str, int | tuple[int, int]]]) -> None:
    """Split head-indexed tables with their heads: ``tables`` maps module patterns (see
    :func:`select`) to parameter or buffer name -> its heads dim (a relative-position bias of shape
    (heads, T, T) -> 0, ALiBi slopes (heads,) -> 0, a bias (buckets, heads) -> 1). Each becomes a
    DTensor sharded on that dim, so checkpoints and the optimizer see its global shape; while the
    module runs, its attribute is the rank's local shard (the rank's own heads, as the split
    projections' scores are), taken with ``to_local`` so that gradients flow back to the shard. A
    name that is neither is a keyword input of every head (MPT's ALiBi ``position_bias``): it is cut
    to the rank's heads on the way in (``PrepareModuleInput``, Replicate -> Shard(dim), no
    communication). A keyword input named with (dim, heads) holds the batch and ``heads`` heads
    flattened in ``dim``, the batch outer (Bloom's ALiBi (batch x heads, 1, T), added to the scores
    of ``baddbmm``): it is cut the same way to the rank's block of heads in every batch row
    (:func:`_cut_flattened`)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    for pattern, names in tables.items():
        for path in select(model, pattern):
            module = model.get_submodule(path)
            inputs = {n: d for n, d in names.items() if n not in module._parameters
                      and n not in module._buffers}
            own = {n: d for n, d in names.items() if n not in inputs}
            plain = {n: d for n, d in inputs.items() if isinstance(d, int)}
            if plain:
                parallelize_module(module, tp_mesh, PrepareModuleInput(
                    input_kwarg_layouts={n: Replicate() for n in plain},
                    desired_input_kwarg_layouts={n: Shard(d) for n, d in plain.items()},
                    use_local_output=True))
            flat = {n: tuple(d) for n, d in inputs.items() if n not in plain}
            if flat:
                module.register_forward_pre_hook(
                    functools.partial(_cut_flattened, mesh=tp_mesh, names=flat), with_kwargs=True)
            for name, dim in own.items():
                value = getattr(module, name)
                sharded = distribute_tensor(value.detach(), tp_mesh, [Shard(dim)])
                if isinstance(value, nn.Parameter):
                    module.register_parameter(name, nn.Parameter(sharded,
                                                                 requires_grad=value.requires_grad))
                else:
                    module.register_buffer(
                        name, sharded, persistent=name not in module._non_persistent_buffers_set)
            module.register_forward_pre_hook(functools.partial(_local_tables, names=tuple(own)))
            module.register_forward_hook(functools.partial(_global_tables, names=tuple(own)),
                                         always_call=True)


def _cut_flattened(_module: nn.Module, args: tuple, kwargs: dict, *, mesh,
                   names: dict[str, tuple[int, int]]):
    """The keyword inputs ``names`` (name -> (dim, heads)) cut to this rank's heads: dim ``dim`` of
    size batch x heads is viewed as (batch, heads), the heads sharded as a replicated DTensor (each
    rank keeps its own contiguous block, the heads its colwise-split projections compute; no
    communication) and flattened back, so the result is (batch x heads / tp) on that dim. Through
    the DTensor, a gradient flowing back to the input is gathered over the ranks, as
    ``PrepareModuleInput``'s is."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for name, (dim, heads) in names.items():
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor):
            continue  # not passed on this call
        if t.shape[dim] % heads:
            raise ValueError(f"{name} has {t.shape[dim]} rows in dim {dim}, not the batch times "
                             f"{heads} heads")
        whole = DTensor.from_local(t.unflatten(dim, (t.shape[dim] // heads, heads)), mesh,
                                   [Replicate()], run_check=False)
        kwargs[name] = whole.redistribute(mesh, [Shard(dim + 1)]).to_local().flatten(dim, dim + 1)
    return args, kwargs


def _local_tables(module: nn.Module, _args, *, names: tuple[str, ...]) -> None:
    # an instance attribute is found before nn.Module.__getattr__ looks in _parameters/_buffers: the
    # forward reads the local shard, while state_dict, the optimizer and FSDP keep the DTensor
    # registered under the same name
    for name in names:
        table = module._parameters.get(name)
        table = module._buffers.get(name) if table is None else table
        module.__dict__[name] = table.to_local()


def _global_tables(module: nn.Module, _args, _output, *, names: tuple[str, ...]) -> None:
    for name in names:
        module.__dict__.pop(name, None)
