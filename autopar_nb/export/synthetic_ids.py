"""The range synthetic ids are drawn from, for each integer input of the example: the rows of the
embedding table that input indexes (token ids: the token embedding, whose size is the vocabulary the
head predicts), so that every row is looked up — under TP the second rank's half of a vocabulary too
— where the smallest table of the model (a token-type table of 2 rows) bounded every input before.
An input that reaches several tables, or is also the target of a loss (the default loss predicts the
ids), gets the smallest of their sizes: no draw is out of range anywhere (a RecSys input whose
columns index tables of 400, 200 and 64 rows keeps 64).

Found in one call of the loss on the meta device (the model's real forward, no storage), by a
``TorchFunctionMode`` that follows each integer input through the calls that keep its values (views,
slices, copies, casts: :data:`SAME_VALUES`) to the lookups (``F.embedding``, ``F.embedding_bag``)
and loss targets (``F.cross_entropy``, ``F.nll_loss``) it reaches. Arithmetic ends the trail on
purpose: positions computed from an attention mask (``cumsum(mask) + 2``) index a table, but the
mask's own values must not be drawn up to its size. An input the trail finds nowhere keeps the
smallest table's range, as before. A forward that fails on the meta device (Hugging Face's
attention-mask check calls ``.item()``) leaves what it reached: the lookups at its start.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from ..runtime.data import call_model, smallest_table

SAME_VALUES = frozenset({
    "view", "reshape", "flatten", "unflatten", "contiguous", "clone", "detach", "to", "long", "int",
    "__getitem__", "narrow", "select", "squeeze", "unsqueeze", "expand", "expand_as", "transpose",
    "t", "permute", "repeat", "cat", "stack", "split", "chunk", "tensor_split", "unbind"})
"""functions whose integer outputs hold their inputs' values, rearranged"""
LOOKUPS = frozenset({"embedding", "embedding_bag"})
TARGETS = frozenset({"cross_entropy", "nll_loss"})


class _Trail(TorchFunctionMode):
    """Which example inputs (by leaf index) each integer tensor's values came from, and where they
    ended."""

    def __init__(self, leaves: list[torch.Tensor]):
        super().__init__()
        self.origin = WeakTensorKeyDictionary()
        for i, t in enumerate(leaves):
            self.origin[t] = {i}
        self.bound: dict[int, int] = {}
        """leaf -> the fewest rows of a table it indexed or classes of a loss it was the target
        of"""

    def _from(self, t) -> set[int]:
        return (self.origin.get(t, set()) if isinstance(t, torch.Tensor)
                and not t.is_floating_point() else set())

    def _bound(self, leaves, n: int) -> None:
        for i in leaves:
            self.bound[i] = min(self.bound.get(i, n), n)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        floats = [t for t in tensors if t.is_floating_point()]
        came = set().union(*(self._from(t) for t in tensors))
        if not came:
            return out
        if name in LOOKUPS:
            # F.embedding(ids, w); torch.embedding(w, ids)
            table = next((t for t in floats if t.dim() == 2), None)
            if table is not None:
                self._bound(came, table.shape[0])
        # F.cross_entropy(logits, target): classes on dim 1 (dim 0 unbatched)
        elif name in TARGETS and floats:
            logits = floats[0]
            self._bound(set().union(*map(self._from, tensors[1:2])),
                        logits.shape[min(1, logits.dim() - 1)])
        elif name in SAME_VALUES:
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and not o.is_floating_point():
                    self.origin[o] = self._from(o) | came
        return out


def id_ranges(model: nn.Module, example, *, loss_fn=None):
    """``example`` with, at each integer tensor, the bound synthetic ids are drawn below (None at
    the others), or one int when that bound is the same for all; see the module docstring. ``model``
    and ``example`` are on the meta device; ``loss_fn(model, batch)`` is the loss the script runs
    (default: a plain call of the model)."""
    leaves: list[torch.Tensor] = []
    _walk(example, leaves.append)
    trail = _Trail(leaves)
    try:
        # a forward may cache tensors on its modules: the caller's model stays as built
        probe = copy.deepcopy(model)
        with torch.no_grad(), trail:
            (loss_fn or call_model)(probe, example)
    except Exception:  # data-dependent code, .item() on meta: the lookups before it still count
        pass
    highs = [trail.bound.get(i, smallest_table(model)) for i in range(len(leaves))]
    # one bound for all (synthetic_batch takes an int): the script's plain INT_HIGH = 128
    if len(set(highs)) <= 1:
        return highs[0] if highs else smallest_table(model)
    remaining = iter(highs)
    return _walk(example, lambda t: next(remaining))


def _walk(x, fn):
    """``x`` with ``fn(t)`` at each integer tensor ``t`` and None at any other leaf (in the order
    tree_map visits)."""
    if isinstance(x, dict):
        return {k: _walk(v, fn) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_walk(v, fn) for v in x)
    return fn(x) if isinstance(x, torch.Tensor) and not x.is_floating_point() else None
