"""A moment of a rank's step its peak memory can be at (:class:`PeakMoment`), and FSDP2's buffers at
a layer's moment (:func:`fsdp_buffers`): the vocabulary :mod:`.peak` (one stage a rank) and
:mod:`.staged` (several) build their moments of."""

from __future__ import annotations

import bisect
from typing import NamedTuple

from .terms import FsdpUnit


class PeakMoment(NamedTuple):
    """One moment of a rank's step that its peak memory can be at (:meth:`RankMemory.moments`)."""

    phase: str
    """one of "forward" (a layer's, not recomputed), "backward" (a layer's), "recompute" (a layer's
    forward run again in its backward), "loss", "reduce" (a pipelined FSDP stage's gradient
    reduction), "step"."""
    layer: int | None
    """the layer whose backward or recompute it is in"""
    grads: float
    """gradient bytes alive"""
    parts: tuple[dict[str, float], ...]
    """the other bytes alive, by :data:`~autopar_nb.plan.MEMORY_TERMS` name, in the groups the
    moments share (merged by :attr:`terms` only for the moment a peak is at: the planner weighs
    ~10^5 moments a search)"""
    weight: float
    """all of them (what the peak is chosen by)"""
    op: int | None = None
    """in a layer's backward: at the backward of this op (its graph index), not at the layer's
    largest"""
    later: bool | None = None
    """a pipeline rank's backward (or loss) after its first micro-batch's (True), at its first
    (False); None where one moment stands for every micro-batch"""
    action: str | None = None
    """a rank of a multi-stage schedule: the kind of the schedule's action it is in
    (:attr:`.schedule.Held.kind`: "F", "B", "I" an input pass, "W" a weight pass, "R" a reduction);
    None elsewhere"""
    micro_batch: int | None = None
    """there, the micro-batch (from 0) that action runs, of the states alike the heaviest
    (:class:`.staged.StagedRank`)"""

    @property
    def terms(self) -> dict[str, float]:
        """The bytes alive besides the gradients, by term, summed over the parts (saved
        activations at least 0)."""
        out: dict[str, float] = {}
        for part in self.parts:
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        if "saved_activations" in out:
            out["saved_activations"] = max(out["saved_activations"], 0.0)
        return out


def fsdp_buffers(units: list[FsdpUnit], layer: int, *, zero_stage: int, p_item: int, g_item: int,
                 params: float, forward: bool = False, pipelined: bool = False,
                 regathered: bool = False, kept: bool = False) -> dict[str, float]:
    """FSDP2's buffers (bytes) while ``layer`` runs its backward (measured with FSDPMemTracker under
    a fake group, LLaMA and ViT, ZeRO-3 + full recompute, bf16): ZeRO-3 gathers the layer's unit
    again (its unsharded parameters in the compute dtype) and prefetches the unit before it (the
    all-gather's output, ``fsdp_gathered_units``); under ZeRO 2 and 3 the unit after it, whose
    backward ran last, still holds the input of its gradients' reduce-scatter (``reduce_dtype``,
    float32: the unsharded gradients flattened), freed only when the next unit's reduce-scatter
    starts (``fsdp_reduce_scatter``). ``forward``: while it runs its forward, the output of its
    unit's all-gather (``fsdp_all_gather``, measured: ViT, ZeRO 2, bf16) beside, under ZeRO 3, the
    unit's unsharded parameters.

    ZeRO 2 (``reshard_after_forward=False``) keeps every unit's unsharded parameters from its
    forward to the end of its backward (``fsdp_unsharded_params``; ``params``: the rank's
    parameters, its root's included): in a forward all of them (the peak is the last layer's), in a
    layer's backward or recompute all but those of the units after it, whose backward resharded them
    (measured: Mixtral, ZeRO 2, fp32, full recompute, peaking in layer 2 of 4: layer 3's unit
    already freed, 6.8 MiB of buffers over without this).

    ``pipelined``: the units of a pipeline stage, whose backward neither reshards nor
    reduce-scatters (``PipelineStage.backward_maybe_with_nosync``): under ZeRO 2 every unit stays
    unsharded, under ZeRO 3 each unit from its backward until its next forward (those after
    ``layer``; ``regathered``: right after another backward, every unit), and no reduce-scatter
    input is held.

    ``kept``: a ZeRO-2 backward in a micro-batch before the last of gradient accumulation, whose
    units the backward does not reshard (``runtime/train.py`` set_grad_sync:
    ``set_reshard_after_backward(False)``, one all-gather per step): the units after ``layer`` stay
    gathered too (``fsdp_kept_params``; measured: GPT-NeoX, ZeRO 2 over 2 gloo ranks, 4
    micro-batches, full recompute, its second micro-batch's peak in layer 2's backward: every
    unit's parameters alive, 3.0 MiB of buffers over without this)."""
    if zero_stage < 2:
        return {}
    # units are consecutive, in layer order
    at = bisect.bisect_right(units, layer, key=lambda u: u.first) - 1
    unsharded = {}
    if zero_stage == 2:
        later = 0.0 if forward or pipelined else sum(u.numel for u in units[at + 1:])
        unsharded = {"fsdp_unsharded_params": (params - later) * p_item}
        if kept and later:
            unsharded["fsdp_kept_params"] = later * p_item
    elif pipelined:
        kept = units[:max(at - 1, 0)] if regathered else []
        unsharded = {"fsdp_unsharded_params": sum(u.numel
                                                  for u in (*kept, *units[at + 1:])) * p_item}
    # a layer of the root's (embedding, head): no unit of its own
    if at < 0 or units[at].last < layer:
        return unsharded
    if forward:
        gathered = {"fsdp_gathered_units": units[at].numel * p_item} if zero_stage == 3 else {}
        return {"fsdp_all_gather": units[at].numel * p_item, **gathered, **unsharded}
    reducing = at + 1 < len(units) and not pipelined
    out = {"fsdp_reduce_scatter": units[at + 1].numel * g_item if reducing else 0.0, **unsharded}
    if zero_stage == 3:
        out["fsdp_gathered_units"] = (units[at].numel
                                      + (units[at - 1].numel if at else 0.0)) * p_item
    return out
