"""Tensor parallelism with DTensor's ``parallelize_module``: styles as data, one relative plan per
repeated block.

:class:`TPStyle` describes one PyTorch ``ParallelStyle`` as plain data (which class, which layouts);
``build()`` makes the object and ``source()`` the constructor as it is written in the exported
script's settings. Which style each module gets is decided at export time
(:mod:`autopar_nb.planner.styles`); the functions below are what the script runs (they are copied
into it verbatim).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .layouts import (
    PackedColwiseParallel,
    PrepareFirstInput,
    RepeatedColwiseParallel,
    SharedSliceParallel,
    TransposedRowwiseParallel,
    modifiable_output,
)

REPLICATE = "replicate"
"""a layout: the tensor is whole on every TP rank (an int ``d`` is a layout too: sharded on dim
``d``)"""
STYLE_CLASSES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                 "sequence_parallel": SequenceParallel, "prepare_input": PrepareFirstInput,
                 "prepare_output": PrepareModuleOutput, "packed_colwise": PackedColwiseParallel,
                 "transposed_rowwise": TransposedRowwiseParallel,
                 "repeated_colwise": RepeatedColwiseParallel, "shared_slice": SharedSliceParallel}
PLAIN_ARGUMENTS = ("use_local_output", "parts", "transposed", "heads", "start", "stop",
                   "sequence_dim")
"""constructor arguments written as they are (the others are layouts)"""


@dataclass(frozen=True)
class TPStyle:
    """One ``ParallelStyle`` as data. Layouts are ``REPLICATE`` or a dim to shard on; ``None``
    leaves the class default. ``prepare_input``/``prepare_output`` move a module's (single)
    input/output from ``input_layout`` / ``output_layout`` to ``desired_layout``."""

    kind: str
    """colwise | rowwise | sequence_parallel | prepare_input | prepare_output | packed_colwise |
    transposed_rowwise | repeated_colwise | shared_slice (the last four: :mod:`.layouts`)"""
    input_layout: int | str | None = None
    output_layout: int | str | None = None
    desired_layout: int | str | None = None
    use_local_output: bool | None = None
    parts: int | None = None
    """packed_colwise: the equal parts of the output ([q|k|v]: 3), each split over the ranks"""
    transposed: bool | None = None
    """packed_colwise: the weight is stored (in, out) (Hugging Face Conv1D)"""
    heads: int | tuple[int, ...] | None = None
    """repeated_colwise: the heads of the output, fewer than the TP ranks; or the heads of each part
    of a fused multi-query projection (query heads split, key/value heads fewer than the ranks)"""
    start: int | None = None
    """shared_slice: the first output feature every head reads"""
    stop: int | None = None
    """shared_slice: one past the last"""
    sequence_dim: int | None = None
    """sequence_parallel: the dim its input is split on (default 1, the sequence; -2 for a norm
    inside each head)"""

    def __post_init__(self):
        if self.kind not in STYLE_CLASSES:
            raise ValueError(f"TP style kind {self.kind!r} unknown; choose one of "
                             f"{', '.join(STYLE_CLASSES)}")
        for layout in (self.input_layout, self.output_layout, self.desired_layout):
            if not (layout is None or layout == REPLICATE or (isinstance(layout, int) and
                                                               not isinstance(layout, bool))):
                raise ValueError(f"TP layout {layout!r} unknown: {REPLICATE!r} or a dim (int)")
        heads = self.heads if isinstance(self.heads, tuple) else (self.heads,)
        for name, value in (("parts", self.parts), *(("heads", h) for h in heads),
                            ("stop", self.stop)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"TP style {name}={self.heads if name == 'heads' else value!r}: a "
                                 "positive int"
                                 + (" or a tuple of them" if name == "heads" else ""))

    def _arguments(self) -> list[tuple[str, object, bool]]:
        """(keyword, layout or bool, is a tuple of layouts) in constructor order."""
        prepare = self.kind.startswith("prepare_")
        side = "output" if self.kind == "prepare_output" else "input"
        args = []
        if self.input_layout is not None:
            args.append(("input_layouts", self.input_layout, prepare))
        if self.output_layout is not None:
            args.append(("output_layouts", self.output_layout, prepare))
        if self.desired_layout is not None:
            args.append((f"desired_{side}_layouts", self.desired_layout, True))
        if self.use_local_output is not None:
            args.append(("use_local_output", self.use_local_output, False))
        for name in ("sequence_dim", "parts", "transposed", "heads", "start", "stop"):
            if getattr(self, name) is not None:
                args.append((name, getattr(self, name), False))
        return args

    @property
    def class_name(self) -> str:
        return STYLE_CLASSES[self.kind].__name__

    @property
    def defined_by_runtime(self) -> bool:
        """The style class is autopar_nb.runtime's own (the script carries its source), not
        torch's."""
        return not STYLE_CLASSES[self.kind].__module__.startswith("torch.")

    def build(self):
        """The ParallelStyle object."""
        def value(k, v, many):
            if k in PLAIN_ARGUMENTS:
                return v
            placement = Replicate() if v == REPLICATE else Shard(v)
            return (placement,) if many else placement

        return STYLE_CLASSES[self.kind](**{k: value(k, v, many)
                                           for k, v, many in self._arguments()})

    def source(self) -> str:
        """The constructor as Python source: ``ColwiseParallel(input_layouts=Shard(1))``."""
        def text(k, v, many):
            if k in PLAIN_ARGUMENTS:
                return repr(v)
            placement = "Replicate()" if v == REPLICATE else f"Shard({v})"
            return f"({placement},)" if many else placement

        return (f"{self.class_name}("
                f"{', '.join(f'{k}={text(k, v, many)}' for k, v, many in self._arguments())})")

    def placements(self) -> set[str]:
        """Names of the placement classes ``source()`` uses (for the script's imports)."""
        return {"Replicate" if v == REPLICATE else "Shard" for k, v, _ in self._arguments()
                if k not in PLAIN_ARGUMENTS}

    def __repr__(self) -> str:
        return self.source()


def select(model: nn.Module, patterns) -> list[str]:
    """Module paths of ``model`` matching any of ``patterns`` (``*`` matches one path component, so
    ``"layers.*"`` is every block of ``model.layers``), in model order; a pattern that matches
    nothing is skipped (the module may live on another pipeline stage)."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    out = []
    for path, _ in model.named_modules(remove_duplicate=False):
        depth = path.count(".")
        if path not in out and any(p.count(".") == depth and fnmatch.fnmatchcase(path, p)
                                   for p in patterns):
            out.append(path)
    return out


def apply_tp(model: nn.Module, tp_mesh, plan: dict, *, layer_plans: dict | None = None) -> None:
    """Tensor parallelism as torchtitan writes it: each of ``layer_plans`` (blocks pattern such as
    ``"layers.*"`` -> a plan with paths relative to a block) on every matching block, then ``plan``
    (paths from the root: embeddings, final norm, head). Entries for modules this pipeline stage
    does not hold are skipped, and so are bare ones (GPT-2's first stage names its tied ``lm_head``
    weight so: it never calls it)."""
    held = {path: m for path, m in model.named_modules() if type(m) is not nn.Module}
    for pattern, layer_plan in (layer_plans or {}).items():
        for path in select(model, pattern):
            inside = dict(held[path].named_modules())
            parallelize_module(held[path], tp_mesh,
                               {k: v for k, v in layer_plan.items() if k in inside})
            for k in layer_plan:
                if k in inside:
                    inside[k].register_forward_hook(modifiable_output)
    parallelize_module(model, tp_mesh, {k: v for k, v in plan.items() if k in held})
    for k in plan:
        if k in held:
            held[k].register_forward_hook(modifiable_output)


def tie_parameters(model: nn.Module, ties: list[list[str]]) -> None:
    """Make each group of parameter paths (e.g. ``["wte.weight", "lm_head.weight"]``) one parameter
    again. ``parallelize_module`` gives every module it splits its own new DTensor, which unties
    weights the model shares (an embedding tied to its output head): the sharded copy is kept and
    the others point to it (a module that only holds it, as BERT's prediction head holds its
    decoder's bias); two sharded copies must be laid out alike (vocab rows: rowwise embedding,
    colwise head), and a Linear or Embedding that computes with a whole copy cannot take a shard."""
    held = dict(model.named_parameters(remove_duplicate=False))
    for group in ties:
        present = [p for p in group if p in held]
        sharded = [p for p in present if hasattr(held[p], "placements")]
        if len(present) < 2:
            continue  # the other side is on another pipeline stage
        keep = held[(sharded or present)[0]]
        for path in sharded[1:]:
            if held[path].placements != keep.placements or held[path].shape != keep.shape:
                raise ValueError(f"tied parameters {sharded[0]} and {path} are laid out "
                                 f"differently ({keep.placements} vs {held[path].placements}): "
                                 "shard both on the vocabulary (rowwise embedding, colwise head) "
                                 "or neither")
        for path in present:
            owner, _, name = path.rpartition(".")
            module = model.get_submodule(owner)
            if (sharded and not hasattr(held[path], "placements")
                and isinstance(module, (nn.Linear, nn.Embedding))):
                raise ValueError(f"tied parameters {sharded[0]} (split) and {path} (whole, in a "
                                 f"{type(module).__name__} TP leaves whole) are one weight: split "
                                 "both on the vocabulary (rowwise embedding, colwise head) or "
                                 "neither")
            module.register_parameter(name, keep)
