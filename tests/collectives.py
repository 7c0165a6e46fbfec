"""Collectives counted as they run: a dispatch mode that sees the functional collectives DTensor and the
expert-parallel all-to-alls issue, keyed by op name ("all_reduce", "all_to_all_single", ...).

torch's ``CommDebugMode`` counts the same ops, but its module tracker registers a forward hook per module *name*
and pops a stack in each: a module object called under two names (transformers >= 5.25 with the ``kernels``
package wraps ``apply_rotary_pos_emb`` and friends in one shared ``Func`` module per layer call site) pops twice
and raises ``IndexError`` in ``_fw_set_module_hook``. These tests need the counts, not the module table."""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# the functional collectives' namespaces: native (_c10d_functional), its autograd twin, and the legacy one
NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


class CollectiveCounts(TorchDispatchMode):
    """``with CollectiveCounts() as comm: ...``; then ``comm.counts`` maps an op's name to how often it ran."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into its collectives; they come back here as plain tensors
        if isinstance(func, torch._ops.OpOverload) and func.namespace in NAMESPACES:
            name = func._overloadpacket.__name__
            if name != "wait_tensor" and not name.startswith("_"):  # not waits nor helpers (_wrap_tensor_autograd)
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))
