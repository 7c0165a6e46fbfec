"""A measured peak beside the cost model's: the components both can be compared in (:data:`GROUPS`),
and the predicted moment a measured peak is at (:func:`moment_at`)."""

from __future__ import annotations

import re

from ..plan import layer_of as layer_path_of

GROUPS = {
    "params": (("params",), ("params",)),
    "grads": (("grads",), ("grads",)),
    "optimizer": (("optimizer", "optimizer_step_temporaries"), ("optimizer",)),
    "activations + loss": (("saved_activations", "loss_saved", "loss_temporaries",
                            "pipeline_outputs", "forward_working_set", "fsdp_weight_pass_grads",
                            "ep_received_rows", "cp_merge_copies"),
                           ("activations", "loss")),
    "weight copies": (("autocast_weight_copies",), ("casts",)),
    "buffers": (("ddp_buckets", "fsdp_unsharded_params", "fsdp_kept_params", "fsdp_root_params",
                 "fsdp_gathered_units",
                 "fsdp_reduce_scatter", "fsdp_all_gather", "fsdp_unsharded_grads",
                 "pipeline_buffers", "replicate_gathered_experts"),
                ("buffers",)),
    "temporaries": (("backward_working_set", "pipeline_sent_gradients", "weight_pass_gradients",
                     "replicate_reduce_buffers", "new_weight_gradients"),
                    ("backward", "step")),
}
"""component shown -> (the predicted fields or MemoryBreakdown.terms it sums, the measured
components it sums). The tracker labels by when a storage is made (this module): the logits and
their copies are activations or loss there, so those two are compared together (and a zero-bubble
weight pass's gradients, made in a backward outside every module, are loss there); what the
optimizer's step allocates is optimizer state there (its hooks mark the whole step), so its
temporaries are compared with the states."""


def predicted_groups(mb) -> dict[str, float]:
    """A :class:`~autopar_nb.plan.MemoryBreakdown` (its fields and named terms) summed into
    :data:`GROUPS`."""
    values = {"params": mb.params, "grads": mb.grads, "optimizer": mb.optimizer, **mb.terms}
    return {g: sum(values.get(k, 0.0) for k in keys) for g, (keys, _) in GROUPS.items()}


def measured_groups(peak: dict) -> dict[str, float]:
    """The tracker's components (:data:`COMPONENTS`, :func:`components`) summed into
    :data:`GROUPS`."""
    return {g: sum(peak.get(k, 0.0) for k in keys) for g, (_, keys) in GROUPS.items()}


def moment_at(where: str, layer_paths: list[str], moments: list[tuple],
              op_modules: dict[int, str] | None = None, micro_batch: int | None = None,
              node: str | None = None, op_names: dict[int, str] | None = None):
    """Of one rank's predicted moments (``cost.estimate.peak_moments``: (phase, layer index,
    breakdown[, op, later])), the one a measured peak's ``where`` ("<phase>/<side> in <module>",
    :attr:`Labelled.where`) is at: the optimizer step, the loss (its forward or backward, outside
    every module), or the forward, backward or recompute of the layer whose path holds the module
    (the largest such moment; the model has a forward moment for the last layer of each run of
    layers without recompute only). With ``micro_batch`` (the measured peak's, counted from 0) and
    per-op moments, a pipeline rank's first micro-batch's moments or a later one's
    (:attr:`~autopar_nb.cost.moment.PeakMoment.later`); with moments in a multi-stage rank's actions
    (a timeline's keys: (kind, micro-batch) sixth), the moment of that very micro-batch (None where
    the cost model lists it under another: alike states merge), none for a place of no known
    micro-batch. With ``op_modules`` (graph index -> module path) and per-op moments, a layer's
    backward at the ops of that very module (by its path within the layer: a repeated block's
    moments carry its first instance's ops), where it has any; with ``node`` (the autograd node
    running at the peak) and ``op_names`` (graph index -> op), at the ops of its kind among them
    (:func:`op_kind_of_node`: Mixtral's experts peak at the backward of their last index op, while
    all they saved is alive). None where the model has no such moment or the module names no layer
    (a forward in a stage's own graph: its last layer's)."""
    phase, _, module = where.partition(" in ")
    name = _relative(module) if module else ""
    if phase.startswith("step/"):
        want = ("step", None)
    elif phase in ("train/forward", "train/backward") and not module:
        want = ("loss", None)  # after the model returned: the loss's forward or its backward
    elif phase in ("train/forward", "train/backward", "train/recompute") and module:
        layer = layer_of(module, layer_paths)
        # a TP head's gather
        if layer is None and phase == "train/forward" and module.endswith("GraphModule"):
            layer = max((mo[1] for mo in moments if mo[0] == "forward"), default=None)
        if layer is None:
            return None
        want = (phase.removeprefix("train/"), layer)
    else:
        return None
    hits = [mo for mo in moments if (mo[0], mo[1]) == want]
    # a multi-stage rank's: that micro-batch's alone
    if any(_action_micro_batch(mo) is not None for mo in hits):
        hits = ([mo for mo in hits if _action_micro_batch(mo) == micro_batch]
                if micro_batch is not None else [])
    # a pipeline rank's first micro-batch's backward, or a later one's
    elif micro_batch is not None:
        hits = [mo for mo in hits if len(mo) < 5 or mo[4] is None
                or mo[4] == (micro_batch > 0)] or hits
    # a repeated block's per-op moments carry its first instance's ops: an op is matched by its path
    # in its layer
    inner = path_in_layer(name, layer_paths)
    at_op = [mo for mo in hits if len(mo) > 3 and mo[3] is not None
             and path_in_layer((op_modules or {}).get(mo[3], "\0"), layer_paths) == inner]
    if node and op_names:  # the autograd node running names the op's kind (MulBackward0: aten.mul)
        kind = op_kind_of_node(node)
        at_op = [mo for mo in at_op if op_kind(op_names.get(mo[3], "")) == kind] or at_op
    hits = at_op or [mo for mo in hits if len(mo) < 4 or mo[3] is None]
    return max(hits, key=lambda mo: mo[2].total) if hits else None


def _action_micro_batch(mo: tuple) -> int | None:
    """The micro-batch of the action a multi-stage rank's moment is in (a timeline's key: its sixth
    item); None where the moment stands for no one micro-batch."""
    return mo[5][1] if len(mo) > 5 and mo[5] else None


def op_kind_of_node(node: str) -> str:
    """An autograd node's name as the op it is the backward of: ``NativeLayerNormBackward0`` ->
    ``nativelayernorm`` (lower case, no underscores: :func:`op_kind`)."""
    return re.sub(r"Backward\d*$", "", node).replace("_", "").lower()


def op_kind(op: str) -> str:
    """A graph op's name as :func:`op_kind_of_node` makes a node's:
    ``aten.native_layer_norm.default`` -> ``nativelayernorm``."""
    # here, not at the top: a measured rank reads this module's layer_of and needs none of cost
    from ..cost.tp_styles import packet

    return packet(op).replace("_", "").lower()


def _relative(module: str) -> str:
    """A tracker's module name as the model names it: the root's name (its class, DDP's
    ``DistributedDataParallel.module``, a pipeline stage's ``Pipe.split_gm.submod_pp_<n>``) and
    checkpoint wrappers dropped."""
    root, *parts = module.split(".")
    parts = [p for p in parts if p != "_checkpoint_wrapped_module"]
    if len(parts) > 1 and parts[0] == "split_gm" and parts[1].startswith("submod_pp_"):
        parts = parts[2:]
    # a pipeline stage's experts: the model's own module,
    elif root == "Wrapper" and parts[:1] == ["_export_root"]:
        # which torch.export's wrapper named first (runtime/ep.py experts_in_stages)
        parts = parts[1:]
    elif root == "DistributedDataParallel" and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def path_in_layer(path: str, layer_paths: list[str]) -> str:
    """A module path relative to the layer that holds it ("" for the layer itself; the path where
    none does): ``model.layers.3.mlp`` is ``.mlp`` in every block."""
    best = layer_path_of(path, [p for p in layer_paths if p])
    return path[len(best):] if best else path


def layer_of(module: str, layer_paths: list[str]) -> int | None:
    """The index of the layer whose path holds a tracker's module name: :func:`_relative` of it,
    then :func:`autopar_nb.plan.layer_of` over the layers but the root's ("" would hold every
    name: a module outside every other layer names none)."""
    path = layer_path_of(_relative(module), [p for p in layer_paths if p])
    return None if path is None else layer_paths.index(path)
