"""Tensor parallelism with DTensor's ``parallelize_module``, for arbitrary module names.

The plan says, per module, ``colwise`` | ``rowwise`` | ``sequence_parallel`` | ``replicate``, and per layer whether
activations between TP regions are sequence-sharded. :func:`tp_styles` turns that into the text of PyTorch
``ParallelStyle`` constructors (``"ColwiseParallel(input_layouts=Shard(1))"``); the runtime builds the objects from
that text and the exported script writes the same text out, so both apply exactly the same thing.

Rules (Megatron-LM / torchtitan):

* ``nn.Linear`` colwise shards the output features, rowwise the input features; a colwise Linear with no rowwise
  Linear beside it in the same parent (an output head) gathers its output, or keeps it vocab-sharded for
  ``loss_parallel``.
* ``nn.Embedding`` rowwise = vocab-parallel (rows), colwise = embedding dim; both take replicated ids.
* with sequence parallelism in a layer, norms run on sequence shards (``SequenceParallel``), rowwise Linears
  reduce-scatter to ``Shard(1)``, embeddings output ``Shard(1)``, and the module that holds the layer's colwise
  Linears all-gathers its input (``PrepareModuleInput``) so code inside it sees the whole sequence.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

STYLE_NAMES = {
    "ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel, "SequenceParallel": SequenceParallel,
    "PrepareModuleInput": PrepareModuleInput, "Shard": Shard, "Replicate": Replicate,
}


def tp_styles(model: nn.Module, tp_plan: dict[str, str], *, sp_layers: list[str] = (),
              loss_parallel: bool = False) -> dict[str, str]:
    """Module path -> ParallelStyle constructor text, in model order.

    ``tp_plan``: module path -> style from the plan; ``sp_layers``: layer paths whose activations are
    sequence-sharded; ``loss_parallel``: the head's logits stay sharded on the vocabulary for ``loss_parallel()``.
    """
    modules = dict(model.named_modules())
    for path in tp_plan:
        if path not in modules:
            raise ValueError(f"the plan shards module {path!r}, which the model does not have; "
                             f"re-capture the model or fix the override")
    ordered = [p for p in modules if tp_plan.get(p, "replicate") != "replicate"]
    # parents of rowwise Linears: a colwise Linear beside one feeds it; one without is an output head
    row_parents = {p.rpartition(".")[0] for p in ordered
                   if tp_plan[p] == "rowwise" and isinstance(modules[p], nn.Linear)}

    def in_sp(path: str) -> str | None:
        """The sequence-parallel layer that contains ``path``, if any."""
        for layer in sp_layers:
            if path == layer or path.startswith(layer + "."):
                return layer
        return None

    styles: dict[str, str] = {}
    for path in ordered:
        module, style, sp = modules[path], tp_plan[path], in_sp(path)
        seq = "Shard(1)" if sp else "Replicate()"
        if isinstance(module, nn.EmbeddingBag):
            raise NotImplementedError(f"{path}: PyTorch TP does not shard nn.EmbeddingBag; keep it 'replicate' "
                                      "and shard it with FSDP (zero_stage >= 2), or use nn.Embedding")
        if style == "sequence_parallel":
            styles[path] = "SequenceParallel()"
        elif isinstance(module, nn.Embedding):
            cls = "RowwiseParallel" if style == "rowwise" else "ColwiseParallel"
            styles[path] = f"{cls}(input_layouts=Replicate(), output_layouts={seq})"
        elif not isinstance(module, nn.Linear):
            raise NotImplementedError(f"{path} is a {type(module).__name__}: TP styles colwise/rowwise apply to "
                                      "nn.Linear and nn.Embedding; use 'sequence_parallel' for norms or 'replicate'")
        elif style == "rowwise":
            styles[path] = f"RowwiseParallel(output_layouts={seq})" if sp else "RowwiseParallel()"
        elif path.rpartition(".")[0] not in row_parents:  # an output head: no rowwise Linear consumes its shard
            if loss_parallel:
                styles[path] = f"ColwiseParallel(input_layouts={seq}, output_layouts=Shard(-1), use_local_output=False)"
            else:
                styles[path] = f"ColwiseParallel(input_layouts={seq}, output_layouts=Replicate())"
        else:
            parent = path.rpartition(".")[0]
            if sp and parent != sp and parent.startswith(sp + "."):
                # gather the sequence once at the entry of the block that holds the colwise Linears
                styles.setdefault(parent, "PrepareModuleInput(input_layouts=(Shard(1),), "
                                          "desired_input_layouts=(Replicate(),), use_local_output=True)")
                styles[path] = "ColwiseParallel()"
            else:
                styles[path] = f"ColwiseParallel(input_layouts={seq})"
    # parents first, so the order reads top-down like a hand-written plan
    return dict(sorted(styles.items(), key=lambda kv: list(modules).index(kv[0])))


def build_style(text: str):
    """The ParallelStyle object for constructor text made by :func:`tp_styles`."""
    return eval(text, {"__builtins__": {}}, STYLE_NAMES)  # text made by tp_styles only


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, styles: dict[str, str]) -> nn.Module:
    """``parallelize_module`` with the styles from :func:`tp_styles` (module path -> constructor text)."""
    if styles:
        parallelize_module(model, tp_mesh, {path: build_style(text) for path, text in styles.items()})
    return model
