"""Expert parallelism: the experts of a Mixture-of-Experts layer split over the ranks of an ``ep``
mesh.

Each rank keeps E/ep of the E experts (the per-expert parameters become DTensors sharded on dim 0,
so checkpoints see the full tensors); tokens are sent to the rank holding their expert and the
results come back with two all-to-alls from ``torch.distributed._functional_collectives`` (the
autograd variant, so gradients travel back the same way). The token counts are exchanged first,
since each rank's share is only known after routing.

The experts modules this applies to follow the contract of Hugging Face's experts classes
(``MixtralExperts``, ``Qwen2MoeExperts``, ``DeepseekV3Experts``, ... in transformers 5) and of
``autopar_nb.zoo.GroupedExperts``:

* ``forward(hidden (T, D), top_k_index (T, K), top_k_weights (T, K)) -> (T, D)`` returns, for each
  token, the sum over its k choices of ``weight * expert(hidden)``;
* an attribute ``num_experts`` (E), and every parameter whose first dim is E is per-expert, in
  expert order.

Sharded, the module runs its own forward on the tokens it received, with its local experts, one
choice per token and weight 1; the routing weights are applied where the tokens came from. The
router stays replicated.

Under pipelining, the stages are traced graphs in which an experts module is a graph of its own
forward, which has no experts to shard: :func:`experts_in_stages` gives them back the model's own
modules first.

This file is copied verbatim into exported scripts: it imports only the standard library and torch.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, experts: list[str],
             grad_divide_factor: int | None = None, stage: bool = False) -> list[str]:
    """Shard every experts module named by ``experts`` over the 1-D ``ep_mesh`` and route its tokens
    with all-to-alls. Returns the paths of the modules it sharded.

    ``experts``: module paths or glob patterns (``"layers.*.feed_forward.experts"``,
    ``"model.layers.*.mlp.experts"``). ``stage``: ``model`` is one pipeline stage
    (:func:`experts_in_stages`), which may hold no module of a pattern. ``grad_divide_factor``:
    divide the experts' gradients by this number. An expert's gradient sums the contributions of the
    tokens of every rank of ``ep_mesh``; when each rank's loss is a mean over its own batch and the
    other gradients are averaged over the data-parallel ranks (DDP), pass the data-parallel degree
    so the experts get the same average. Leave it None when FSDP reduces the experts' gradients with
    its own divide factor.

    Call it before FSDP/DDP wrap the model: the expert parameters become DTensors on ``ep_mesh`` and
    must be kept out of DDP (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    with the names :func:`expert_parameters` gives) or sharded by FSDP on the mesh dims other than
    ``ep`` (``replicate_experts`` and ``shard_experts`` do each). A ``foreach`` optimizer (the CUDA
    default) needs them in a parameter group of their own: foreach ops refuse lists mixing DTensors
    and plain tensors (``build_optimizer`` groups them).
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1-D mesh (e.g. mesh['ep']), got {ep_mesh.ndim} dims")
    paths = experts_modules_to_split(model, experts, ep=ep_mesh.size(), every_pattern=not stage)
    for path in paths:
        _make_expert_parallel(model.get_submodule(path), ep_mesh,
                              grad_divide_factor=grad_divide_factor, release=stage)
    return paths


def experts_modules_to_split(model: nn.Module, experts: list[str], *, ep: int,
                             every_pattern: bool = True) -> list[str]:
    """The paths of the modules ``experts`` names (paths or glob patterns), in model order; raises
    unless each pattern names something (``every_pattern``) and each module follows the experts
    contract with a number of experts ``ep`` divides."""
    paths = _match_modules(model, experts, every_pattern=every_pattern)
    for path in paths:
        _check_experts(path, model.get_submodule(path), ep=ep)
    return paths


def experts_in_stages(model: nn.Module, stages: list[nn.Module], *,
                      experts: list[str]) -> list[str]:
    """Give the pipeline ``stages`` (``split_model``'s, traced from ``model``) the model's own
    experts modules that ``experts`` (paths or glob patterns) names, in place of the graphs the
    tracer made of their forwards: a graph has no ``num_experts`` and its all-to-all cannot be
    traced (token counts known only after routing), so :func:`apply_ep` shards the originals. Each
    call passes its inputs in the contract's order again (the tracer orders them by use), told apart
    by their traced values: the integer one is ``top_k_index``, the floating one of its shape
    ``top_k_weights``, the other the hidden states. Call it before the stages are released or
    sharded. Returns the paths swapped."""
    swapped: list[str] = []
    for stage in stages:
        for prefix, parent in list(stage.named_modules()):
            graph = getattr(parent, "graph", None)
            calls = ([n for n in graph.nodes if n.op == "call_module"]
                     if isinstance(graph, fx.Graph) else [])
            for node in calls:
                path = f"{prefix}.{node.target}".lstrip(".")
                if not any(fnmatch.fnmatchcase(path, p) for p in experts) or "." in node.target:
                    continue
                node.args = _in_contract_order(path, node.args, node.kwargs)
                swapped.append(path)
                # (its compiled copy holds it too)
                for holder in (parent, parent.__dict__.get("graph_module")):
                    if isinstance(holder, nn.Module):
                        holder.register_module(node.target, model.get_submodule(path))
                    # its code passes the inputs in the new order
                    if isinstance(holder, fx.GraphModule):
                        holder.recompile()
    return swapped


def _in_contract_order(path: str, args: tuple, kwargs: dict) -> tuple:
    """A traced experts call's inputs as ``(hidden, top_k_index, top_k_weights)`` (see
    :func:`experts_in_stages`)."""
    vals = [getattr(a, "meta", {}).get("val") for a in args]
    if kwargs or len(args) != 3 or not all(isinstance(v, torch.Tensor) for v in vals):
        raise ValueError(f"experts_in_stages: the traced call of {path} passes {len(args)} inputs "
                         f"and {sorted(kwargs)} by name, not the (hidden, top_k_index, "
                         "top_k_weights) of the contract")
    index = [i for i, v in enumerate(vals) if not v.is_floating_point()]
    weights = [i for i, v in enumerate(vals) if v.is_floating_point() and index
               and v.shape == vals[index[0]].shape]
    if len(index) != 1 or len(weights) != 1:
        raise ValueError(f"experts_in_stages: cannot tell the inputs of {path} apart by their "
                         f"traced shapes and dtypes {[(tuple(v.shape), v.dtype) for v in vals]}")
    hidden = 3 - index[0] - weights[0]
    return args[hidden], args[index[0]], args[weights[0]]


def _make_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh, *, grad_divide_factor: int | None,
                          release: bool) -> None:
    """Shard one experts module and give it the all-to-all forward (``release``:
    :func:`_shard_experts`)."""
    _shard_experts(module, ep_mesh, release=release)
    # the instance attribute shadows the class's forward, which still computes the local experts
    module.forward = functools.partial(_ep_forward, module, ep_mesh=ep_mesh,
                                       local_forward=type(module).forward)
    if grad_divide_factor and grad_divide_factor != 1:
        for p in module.parameters(recurse=False):
            if isinstance(p, DTensor):
                p.register_hook(functools.partial(_divide, factor=grad_divide_factor))


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters :func:`apply_ep` sharded (name -> DTensor parameter): the ones to keep out of
    DDP and out of the data-parallel gradient averaging."""
    return {name: p for name, p in model.named_parameters()
            if isinstance(p, DTensor)
            and getattr(_owner(model, name), "_ep_mesh", None) is not None}


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules :func:`apply_ep` sharded, in model order (found by the mark it leaves, so
    wrappers that renamed their paths since, such as activation checkpointing's, do not matter)."""
    return [m for m in model.modules() if getattr(m, "_ep_mesh", None) is not None]


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    """The module that holds parameter ``param_name`` directly."""
    return model.get_submodule(param_name.rpartition(".")[0])


def _match_modules(model: nn.Module, patterns: list[str], *,
                   every_pattern: bool = True) -> list[str]:
    """Module paths matching any of the patterns, in model order; every pattern must match something
    where ``every_pattern``."""
    names = [name for name, _ in model.named_modules() if name]
    found: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and every_pattern:
            raise ValueError(
                f"apply_ep: no module matches {pattern!r}; experts modules look like "
                f"{[n for n in names if n.endswith('experts')][:3] or 'nothing in this model'}")
        found += [n for n in hits if n not in found]
    return [n for n in names if n in found]


def _check_experts(path: str, module: nn.Module, *, ep: int) -> None:
    """Raise unless ``module`` follows the experts contract (see the module docstring), E divides by
    ep, and it is not expert-parallel already."""
    if getattr(module, "_ep_mesh", None) is not None:
        raise ValueError(f"apply_ep: {path} is expert-parallel already (apply_ep was called on it "
                         "before)")
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int):
        raise TypeError(f"apply_ep: {path} ({type(module).__name__}) has no int attribute "
                        "num_experts; supported are stacked-weight experts modules called as "
                        "experts(hidden, top_k_index, top_k_weights) (transformers' "
                        "MixtralExperts/Qwen2MoeExperts/..., autopar_nb.zoo.GroupedExperts)")
    if not any(p.shape[:1] == (num,) for p in module.parameters(recurse=False)):
        raise TypeError(f"apply_ep: {path} has no parameter of shape ({num}, ...): its experts are "
                        "not stacked weights (a ModuleList of expert MLPs is not supported)")
    if num % ep:
        raise ValueError(f"apply_ep: {path} has {num} experts, which {ep} ranks cannot split "
                         f"evenly (num_experts({num}) % ep({ep}) = {num % ep}); choose an ep "
                         f"degree that divides {num}")


def _shard_experts(module: nn.Module, ep_mesh: DeviceMesh, *, release: bool = False) -> None:
    """Per-expert parameters -> DTensors sharded on dim 0 over ``ep_mesh``: rank r keeps experts
    [r * E/ep, (r + 1) * E/ep). ``release``: empty the unsharded weights' storage once the shard is
    a copy, for every holder: a pipeline stage's trace (torch.export's and pipelining's modules, in
    reference cycles) holds them beside the module."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.shape[:1] == (module.num_experts,):
            sharded = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
            storage = p.untyped_storage()
            if (release and not p.is_meta and storage.resizable()
                    and sharded.to_local().untyped_storage().data_ptr() != storage.data_ptr()):
                storage.resize_(0)
    module._ep_mesh = ep_mesh


def _divide(grad: torch.Tensor, *, factor: int) -> torch.Tensor:
    """Gradient hook: ``grad / factor``."""
    return grad / factor


def _ep_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *, ep_mesh: DeviceMesh, local_forward) -> torch.Tensor:
    """The experts' forward under expert parallelism: dispatch, local experts, combine (shapes as
    the contract)."""
    group = ep_mesh.get_group()
    tokens, k = top_k_index.shape
    order, counts = _sort_by_expert(top_k_index, module.num_experts)
    send, recv, local_ids = _exchange_counts(counts, ep=ep_mesh.size(), group=group)
    routed = all_to_all_single_autograd(hidden[order // k], recv, send, group)  # (sum(recv), D)
    with _local_experts(module):
        ones = torch.ones(routed.shape[0], 1, dtype=top_k_weights.dtype, device=routed.device)
        out = local_forward(module, routed, local_ids.unsqueeze(1), ones)
    back = all_to_all_single_autograd(out, send, recv, group)  # (tokens * k, D), expert-sorted
    return _combine(back, order, top_k_weights=top_k_weights).to(hidden.dtype)


def _sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """(order, counts): the (token, choice) pairs sorted by expert (stable), and the number of pairs
    per expert (E,). Experts are contiguous per rank, so the sorted pairs are also grouped by
    destination rank."""
    flat = top_k_index.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def _exchange_counts(counts: torch.Tensor, *, ep: int, group) -> tuple[list[int], list[int],
                                                                       torch.Tensor]:
    """All-to-all of the per-expert pair counts. Returns (pairs sent to each rank, pairs received
    from each rank, the local expert id of each received pair, in arrival order: by source rank,
    then by expert)."""
    # (source rank, local expert)
    received = all_to_all_single(counts, None, None, group).view(ep, -1)
    send = counts.view(ep, -1).sum(dim=1).tolist()
    recv = received.sum(dim=1).tolist()
    experts = torch.arange(received.shape[1], device=counts.device).repeat(ep)
    return send, recv, experts.repeat_interleave(received.reshape(-1))


@contextlib.contextmanager
def _local_experts(module: nn.Module):
    """Within the block, the module's sharded parameters read as their local shards (differentiable
    views of the DTensors, so gradients reach them) and ``num_experts`` is the local count: its own
    forward then runs the local experts as if they were all of them. This swaps entries of
    ``module._parameters`` the way ``torch.nn.utils.stateless`` and FSDP2 do."""
    saved = dict(module._parameters)
    num = module.num_experts
    local = {name: p.to_local() for name, p in saved.items() if isinstance(p, DTensor)}
    try:
        module._parameters.update(local)
        module.num_experts = num // module._ep_mesh.size()
        yield
    finally:
        module._parameters.update(saved)
        module.num_experts = num


def _combine(back: torch.Tensor, order: torch.Tensor, *,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs in expert-sorted pair order -> (T, D): back to (token, choice) order,
    weighted, summed over k."""
    tokens, k = top_k_weights.shape
    pairs = back[torch.argsort(order)] * top_k_weights.reshape(-1, 1)
    return pairs.view(tokens, k, -1).sum(dim=1)
