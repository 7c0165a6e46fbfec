"""Initial weights of the parallel model equal to those of the single-process model built with the
same seed.

Two ways:

* the model fits in host memory: build it for real on every rank with the same seed (identical
  weights), then shard it (TP/FSDP slice the local copy). Nothing to do here.
* it does not fit: build it on the meta device, apply the plan (shards are still meta), then
  :func:`materialize`: ``to_empty`` allocates only the local shards, and the weights are initialised
  module by module in construction order with the seed re-applied, each module's full weights
  existing only while its shard is copied out. The random stream is consumed exactly as the
  single-process constructor consumed it, so the values match.

Modules are initialised by their own ``reset_parameters()``, and a Hugging Face model by replaying
its ``post_init()`` (``_init_weights``, which covers e.g. ``LlamaRMSNorm`` and rotary buffers);
other norm-like modules without an init get weight 1 / bias 0.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

STRIP = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter name without wrapper prefixes (checkpoint wrapper, torch.compile, DDP's
    ``module.``)."""
    for s in STRIP:
        name = name.replace(s, "")
    return name.removeprefix("module.")


def _is_hf(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel``: initialised by ``post_init()`` -> ``_init_weights`` after
    construction."""
    return hasattr(module, "_init_weights") and hasattr(module, "post_init")


def _fallback_init(full: nn.Module) -> None:
    if any(k in type(full).__name__.lower() for k in ("norm", "scale")):
        for name, p in full.named_parameters(recurse=False):
            with torch.no_grad():
                p.fill_(1.0 if name == "weight" else 0.0)
    elif any(True for _ in full.parameters(recurse=False)):
        raise NotImplementedError(
            f"cannot initialise {type(full).__name__} on the meta path: it has no "
            "reset_parameters(); add one (initialising the module's own parameters), or build the "
            "model for real (it fits in host memory)")
    else:
        warnings.warn(f"buffers of {type(full).__name__} are left as allocated (no init method)",
                      stacklevel=3)


INIT_DRAWS = re.compile(
    r"\b(normal_|uniform_|trunc_normal_|xavier_\w+|kaiming_\w+|orthogonal_|randn|rand|randint)\(")
"""calls that draw random numbers, as a constructor's source spells them"""


def _draws_in_init(module: nn.Module) -> bool:
    """Whether the module's constructor draws random numbers (Hugging Face's Conv1D:
    ``nn.init.normal_``) rather than only allocating (Mixtral's experts: ``torch.empty``), read from
    its source; unknown source: it draws."""
    try:
        return bool(INIT_DRAWS.search(inspect.getsource(type(module).__init__)))
    except (OSError, TypeError):
        return True


def _full_copy(module: nn.Module) -> nn.Module:
    """This module alone (no children), full size, on the host."""
    full = copy.copy(module)
    full._modules = {}
    full._parameters = {n: None if p is None
                        else nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                        for n, p in module._parameters.items()}
    full._buffers = {n: None if b is None else torch.empty_like(b, device="cpu")
                     for n, b in module._buffers.items()}
    return full


def _own(module: nn.Module) -> bool:
    return bool(module._parameters or module._buffers)


def _tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The names of each parameter or buffer ``model`` registers under several (a tied embedding and
    output head): its first name (``named_parameters()``'s) -> every name; a later name -> () (what
    is written under it is not the tied value: the first module's is)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return {name: tuple(group) if i == 0 else () for group in names.values() if len(group) > 1
            for i, name in enumerate(group)}


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the full ``value`` into ``target``, or its local shard where ``target`` is a DTensor."""
    if isinstance(target, DTensor):
        shard = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None)  # every rank computed the same full value
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(value)


@torch.no_grad()
def materialize(parts: list[nn.Module], skeleton: nn.Module, *, device: str | torch.device,
                seed: int) -> None:
    """Allocate and initialise the (sharded, meta) parameters of ``parts`` from ``skeleton``.

    ``parts``: the local model pieces after the plan was applied (one per pipeline stage held here,
    or the model); ``skeleton``: the unsharded model on the meta device, in the original module
    structure (its module paths name the parameters of ``parts``).

    The construction is replayed: modules in construction order run their ``reset_parameters()``
    (what their constructors did), and a Hugging Face model's ``post_init()`` is replayed where it
    ran, at the end of each ``PreTrainedModel``'s construction: ``_init_weights`` over its modules
    not yet initialised, children first.
    """
    replay = _Replay(_allocate(parts, device), skeleton)
    torch.manual_seed(seed)
    replay.construct(skeleton, "", None)


def _allocate(parts: list[nn.Module], device: str | torch.device) -> dict[str, torch.Tensor]:
    """Allocate every part's tensors on ``device`` (ties kept): canonical name -> the local
    tensor."""
    local: dict[str, torch.Tensor] = {}
    for part in parts:
        # to_empty() gives every module its own new tensor: remember tied parameters (embedding =
        # output head)
        places: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in part.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    places.setdefault(id(p), []).append((module, name))
        part.to_empty(device=device)
        for (owner, first), *others in (v for v in places.values() if len(v) > 1):
            for module, name in others:
                module._parameters[name] = owner._parameters[first]
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            local[canonical_name(name)] = t
    return local


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Replay:
    """One replay of ``skeleton``'s construction, writing each module's initialised full values into
    the local tensors (their shards)."""

    BUDGET = 2**28
    """elements: 1 GiB in fp32, the largest subtree kept whole for a parent's ``_init_weights``; the
    root (the whole model) never counts as small"""

    def __init__(self, local: dict[str, torch.Tensor], skeleton: nn.Module):
        self.local = local
        # a tied parameter takes the value its first module writes (what the model's own tied tensor
        # ends with: Hugging Face ties the output head to the input embedding), in every local copy
        # (a pipeline stage's own, GPT-2's lm_head)
        self.tied = _tied_names(skeleton)
        self.post_initialised: set[str] = set()
        self.constructed: set[int] = set()
        # some _init_weights re-initialise a child's weights from the parent (GPT-2 scales
        # attn.c_proj); a parent whose subtree is small gets its children's current full values,
        # kept from their own init until the parent's turn
        self.numel = {path: sum(t.numel() for t in [*m.parameters(), *m.buffers()])
                      for path, m in skeleton.named_modules()}
        self.values: dict[str, torch.Tensor] = {}

    def write(self, path: str, full: nn.Module) -> None:
        for name, value in [*full.named_parameters(recurse=False),
                            *full.named_buffers(recurse=False)]:
            key = _join(path, name)
            targets = {id(t): t for k in self.tied.get(key, (key,))
                       if (t := self.local.get(k)) is not None}
            for target in targets.values():  # none: held by another pipeline stage
                _write(target, value)

    def subtree_copy(self, module: nn.Module, path: str) -> nn.Module:
        full = _full_copy(module)
        for name in [*full._parameters, *full._buffers]:
            key = _join(path, name)
            if key in self.values:
                (full._parameters if name in full._parameters else full._buffers)[name].copy_(
                    self.values[key])
        for name, child in module.named_children():
            full._modules[name] = self.subtree_copy(child, _join(path, name))
        return full

    def construct(self, module: nn.Module, path: str, owner: nn.Module | None) -> None:
        if id(module) in self.constructed:  # a shared module is built once
            return
        self.constructed.add(id(module))
        owner = module if _is_hf(module) else owner
        if _own(module):
            full = _full_copy(module)
            if hasattr(full, "reset_parameters"):
                full.reset_parameters()  # draws the random numbers its constructor drew
            elif owner is not None and _draws_in_init(module):
                # e.g. HF Conv1D draws normal_ in __init__, as _init_weights does
                owner._init_weights(full)
            elif owner is None:
                _fallback_init(full)
            # (an HF module that draws nothing in __init__ gets its values from post_init)
            self.write(path, full)
        for name, child in module.named_children():
            self.construct(child, _join(path, name), owner)
        if _is_hf(module):
            self.post_init(module, path, module)

    def post_init(self, module: nn.Module, path: str, owner: nn.Module) -> None:
        for name, child in module.named_children():
            self.post_init(child, _join(path, name), child if _is_hf(child) else owner)
        if path not in self.post_initialised:
            self.post_initialised.add(path)
            self._init_weights(module, path, owner)
        parent = path.rpartition(".")[0] if path else None
        # the parent will not need this subtree
        if parent is not None and self.numel.get(parent, 0) > self.BUDGET:
            for key in [k for k in self.values if k == path or k.startswith(path + ".")]:
                del self.values[key]

    def _init_weights(self, module: nn.Module, path: str, owner: nn.Module) -> None:
        """``owner._init_weights`` on ``module`` (with its children where the subtree is small),
        written out."""
        small = path and self.numel[path] <= self.BUDGET
        full = self.subtree_copy(module, path) if small else _full_copy(module)
        try:
            owner._init_weights(full)
        except AttributeError as e:
            what = path or "the whole model"
            raise NotImplementedError(
                f"{type(owner).__name__}._init_weights({what}) reads the module's children, and "
                f"{what} holds {self.numel[path]:,} elements, more than the meta path builds at "
                f"once ({'it never builds the whole model' if not path else f'{self.BUDGET:,}'}); "
                "build the model for real (export with meta_init=False), or give its modules "
                "reset_parameters()") from e
        for sub, m in full.named_modules():
            where = f"{path}.{sub}".strip(".") if sub else path
            self.write(where, m)
            if small:
                for name, t in [*m.named_parameters(recurse=False),
                                *m.named_buffers(recurse=False)]:
                    self.values[_join(where, name)] = t.detach()
