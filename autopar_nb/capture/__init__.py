"""capture(model, example_inputs) -> ModelGraph: trace one forward pass on the meta device into an
operator graph.

``torch.export`` is the tracer. Where it cannot trace a model that still runs eagerly on meta
tensors, a fallback records every ATen call of one eager forward pass with a ``TorchDispatchMode``
(the same machinery ``make_fx`` uses) and module hooks for the module path; a warning says so.
Neither allocates parameter storage when the model lives on the meta device.
The tracers are in :mod:`.tracers`, the graph assembled from what they record in :mod:`.build`,
its layers found in :mod:`.layers`; identical repeated blocks are traced once (:mod:`.blocks`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn
from torch.utils._pytree import tree_map

from ..failures import where_in_model
from ..graph import ModelGraph
from ..runtime.cp import takes_positions
from ..runtime.pp_graph import masks_as_in_eager
from ..runtime.train import switch_off_kv_cache
from . import blocks, tracers
from .build import canonical_names
from .layers import find_layers, repeated_blocks
from .meta_stand_in import stand_in, to_meta


class CaptureError(RuntimeError):
    """The model could not be traced; the message names the module, the source line and what to
    do."""


def capture(model: nn.Module, example_inputs: Any, *, source: str | None = None,
            copy_blocks: bool = True) -> ModelGraph:
    """Trace ``model`` on ``example_inputs`` into a :class:`ModelGraph`.

    ``example_inputs`` is a tensor, a tuple/list of positional tensors, or a dict of keyword
    tensors. When the model is on the meta device, inputs are moved to meta too, so nothing is
    allocated. Identical repeated blocks are traced once and copied (``capture/blocks.py``: the same
    graph); ``copy_blocks=False`` traces every layer.

    >>> with torch.device("meta"):
    ...     m = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
    >>> capture(m, torch.randn(32, 1024)).num_params
    1574400
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture() needs an nn.Module, got {type(model).__name__}")
    args, kwargs = split_inputs(example_inputs)
    if any(p.is_meta for p in model.parameters()):
        args, kwargs = tree_map(to_meta, (args, kwargs))
    paths = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}

    was_training = model.training
    # trace the training graph: dropout and batch-norm statistics are part of the step
    model.train()
    cached = switch_off_kv_cache(model)  # as the script trains it (runtime/train.py)
    try:
        # a plain causal or bidirectional mask skipped, as the eager forward does
        # (runtime/pp_graph.py)
        try:
            with masks_as_in_eager(own_positions="position_ids" not in kwargs):
                graph = _copied_or_full(lambda s: tracers.from_export(model, args, kwargs, s),
                                        model, copy_blocks)
        except Exception as export_error:
            located = where_in_model(export_error, model, paths)
            try:
                graph = _copied_or_full(
                    lambda s: tracers.from_dispatch(model, args, kwargs, paths, s), model,
                    copy_blocks)
            except Exception as eager_error:
                raise _capture_error(eager_error, model, paths) from eager_error
            warnings.warn(f"torch.export could not trace {type(model).__name__} "
                          f"({_first_line(export_error)}{located}); captured by recording one "
                          "eager forward pass instead", stacklevel=2)
    finally:
        model.train(was_training)
        for config in cached:
            config.use_cache = True

    graph.source, graph.takes_positions = source, takes_positions(model)
    # the planner runs its TP layouts on it (planner/forward.py)
    graph.stand_in = stand_in(model, args, kwargs)
    return graph


def _copied_or_full(trace, model: nn.Module, copy_blocks: bool) -> ModelGraph:
    groups = [[(p, model.get_submodule(p)) for p in b.members]
              for b in repeated_blocks(find_layers(model))]
    return blocks.copied_or_full(trace, groups if copy_blocks else [], canonical_names(model))


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """The model's call of ``example_inputs``: (args, kwargs) (a dict is passed by keyword, a tuple
    or list positionally, anything else as the one argument)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _capture_error(e: BaseException, model: nn.Module, paths: dict[int, str]) -> CaptureError:
    where = where_in_model(e, model, paths)
    text = str(e)
    if any(s in text for s in ("data-dependent", "Data dependent", "data dependent", "meta tensors",
                               "GuardOnDataDependent", ".item()", "Tensor.item")):
        hint = ("The forward pass depends on tensor values (an `if` on a tensor, .item(), "
                "nonzero()...), which cannot be known while tracing on the meta device. Rewrite it "
                "with torch.where/torch.cond, or compute it from shapes instead of values.")
    elif any(s in text for s in ("Meta tensors", "fake impl", "Meta kernel", "meta kernel")):
        hint = ("The op has no meta-device implementation: register one in kernels_ext, or capture "
                "on real (small) inputs with ap.capture(model, inputs).")
    else:
        hint = "Check that the model runs on the example inputs (their shapes and dtypes)."
    return CaptureError(f"cannot trace {type(model).__name__}{where}: "
                        f"{_first_line(e).rstrip('.')}. {hint}")
