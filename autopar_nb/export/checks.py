"""What the exported script of a plan could not run, refused before anything is written: each
check raises PlanError (or NotImplementedError for what PyTorch cannot run) naming what to change;
a few return the values they checked (the weights folder, the float8 and fused-norm modules).
"""

from __future__ import annotations

import copy
import os

import torch.nn as nn

from ..plan import Plan, PlanError, within
from ..runtime.cp import sequence_tensor
from ..runtime.ep import experts_modules_to_split
from ..runtime.float8 import float8_linears
from ..runtime.fused_norm import apply_fused_norm
from ..runtime.pp import SCHEDULES
from ..source import ModelSource


def samples_divide(plan: Plan, per_sample: int) -> int:
    """The rows a dataset's collate_fn makes of each sample, once the global batch is seen to split
    into the same number of samples on every data-parallel rank."""
    dp, rows = plan.mesh.dp, plan.batch.global_batch
    if rows > 1 and rows % (dp * per_sample):
        raise PlanError(f"batch.global_batch({rows}) must be a multiple of the data-parallel ranks "
                        f"(mesh.dp={dp}) x the rows collate_fn makes of each sample "
                        f"({per_sample}): each rank reads the same number of the dataset's samples "
                        "per step")
    return per_sample



def weights_folder(source: ModelSource, found: list[str]) -> str:
    """``source.weights`` checked: a folder, for a cell that does not name its own checkpoint
    (``from_pretrained``)."""
    if not source.weights:
        return ""
    if found:
        raise ValueError(f"weights={source.weights!r}, but the cell starts from its own checkpoint "
                         f"(from_pretrained({found[-1]!r})): weights= is for a cell that builds "
                         "its model from a config; name one of the two")
    if not os.path.isdir(source.weights):
        raise FileNotFoundError(f"weights={source.weights!r}: no such folder; name a folder of "
                                "safetensors files (what save_pretrained writes)")
    return source.weights


def check_runnable(plan: Plan) -> None:
    m, pr = plan.mesh, plan.precision
    if m.ep > 1 and m.tp > 1:
        raise NotImplementedError(
            f"expert parallelism (ep={m.ep}) runs beside data parallelism (and pipelining) without "
            f"TP, not with tp={m.tp}: the experts' all-to-all is not split by TP (no expert-TP)")
    if plan.sync_batchnorm and m.dp > 1 and m.pp > 1:
        raise NotImplementedError("sync_batchnorm with pipelining is not supported")
    if m.pp > 1 and pr.amp == "fp16":
        raise NotImplementedError("pipelining with fp16 loss scaling is not supported; use bf16")
    if plan.pipeline.schedule not in SCHEDULES:
        raise PlanError(f"pipeline.schedule {plan.pipeline.schedule!r} unknown")


def check_cp(source: ModelSource, inputs, *, tokens: bool) -> None:
    """PlanError unless context parallelism can run the cell: the default loss (``sequence_loss``
    computes it on each rank's part of the sequence) on batches of one (batch, seq) tensor of token
    ids."""
    if source.loss_fn_var:
        raise PlanError(f"mesh.cp > 1, but the cell defines its own {source.loss_fn_var}: context "
                        "parallelism computes the default loss on each rank's part of the sequence "
                        "(a loss of the whole sequence cannot run there); drop it from the cell, "
                        "or use cp=1")
    try:
        sequence_tensor(inputs)
    except ValueError as e:
        raise PlanError(f"mesh.cp > 1: {e}") from None
    if not tokens:
        raise PlanError("mesh.cp > 1 needs token ids as the model's input; use cp=1")


def check_fused_loss(model: nn.Module, head: str, source: ModelSource) -> None:
    """PlanError unless ``plan.fused_loss`` can run: the default loss (no ``loss_fn`` in the cell,
    whose loss the fused op would not compute) and a bias-free nn.Linear at that path (what
    ``apply_fused_loss`` checks)."""
    if source.loss_fn_var:
        raise PlanError(f"plan.fused_loss={head!r}, but the cell defines its own "
                        f"{source.loss_fn_var}: the fused head computes the default next-token "
                        "cross-entropy only; re-plan (the planner does not fuse a cell's own loss) "
                        "or set fused_loss to \"\"")
    try:
        linear = model.get_submodule(head)
    except AttributeError:
        linear = None
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise PlanError(f"plan.fused_loss={head!r} must name a bias-free nn.Linear of the model, "
                        f"found {type(linear).__name__ if linear is not None else 'no such module'}"
                        + (" with a bias" if isinstance(linear, nn.Linear)
                           and linear.bias is not None else ""))


def float8_modules(model: nn.Module, recipe: str) -> tuple[str, list[str]]:
    """(the recipe, the Linear modules ``apply_float8`` will convert), ("", []) without float8;
    PlanError when it would convert none."""
    if recipe == "none":
        return "", []
    found = float8_linears(model)
    if not found:
        raise PlanError(f"precision.float8={recipe!r}, but the model has no nn.Linear with both "
                        "dimensions multiples of 16 besides its output head: set precision.float8 "
                        "to 'none'")
    return recipe, found


def fused_norms(model: nn.Module) -> list[str]:
    """The RMSNorm modules ``apply_fused_norm`` will fuse (found on a copy of the meta model);
    PlanError when there are none."""
    try:
        return apply_fused_norm(copy.deepcopy(model))
    except ValueError as e:
        raise PlanError(str(e)) from None


def check_experts(model: nn.Module, plan: Plan) -> None:
    """PlanError unless every ``plan.experts`` pattern names experts modules that ``apply_ep`` can
    split over ``mesh.ep`` ranks (the checks the script would make, before it is written)."""
    try:
        paths = experts_modules_to_split(model, plan.experts, ep=plan.mesh.ep)
    except (TypeError, ValueError) as e:
        raise PlanError(f"experts: {e}") from None
    selective = [lp.path for lp in plan.layers
                 if lp.recompute == "selective" and any(within(p, lp.path) for p in paths)]
    if selective and plan.mesh.zero_stage >= 1:
        raise NotImplementedError(
            f"selective recompute of layers holding experts ({', '.join(selective[:3])}) with "
            f"ep={plan.mesh.ep} and ZeRO-{plan.mesh.zero_stage} is not supported: the experts' own "
            "FSDP unit sits inside the selectively checkpointed region, and torch's selective "
            "checkpointing then meets FSDP calls in recompute that the forward did not make; use "
            "full recompute for those layers, or ZeRO 0")

