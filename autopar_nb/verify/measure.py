"""One rank's memory, component by component, as the plan's exported script runs it: the figures the cost model is
checked against.

The script's ``build_model`` builds the model with real, small tensors (before the tracker starts), then its
``main`` runs a few steps in one process as one rank of a fake process group (``torch.testing._internal.
distributed.fake_pg``: every collective returns at once, leaving its output as it was) inside PyTorch's memory
tracker (``MemTracker``; ``FSDPMemTracker`` once the plan's ``parallelize`` returns an FSDP2 module), which counts
every storage the step creates by what it is. So what is measured is what the script does — its ``parallelize``
(TP styles, recompute, DDP/FSDP, pipeline stages), its loss and ``loss_parallel``, autocast, clipping and optimizer
— not a re-creation of it. Values are meaningless (no collective moves data); sizes are not.

Real tensors, not ``FakeTensorMode``: under fake tensors ``model.to(device)`` fails on Hugging Face models
(``_apply(): Couldn't swap``), DDP's parameter check needs storage and the training loop reads ``.item()``. The
models are small enough (hidden 256, 4 layers) for a real CPU step.

The one thing the harness adds: DDP gets a comm hook that returns its bucket as it is (the fake group's all-reduce
future returns None, which DDP's reducer refuses, ``comm.cpp: expected the hook result is either a Tensor or a
TensorList found None``); the bucket, the memory DDP holds, is unchanged.

The tracker's reference types are refined by when a storage is created (:data:`LABELS`), so the peak splits into the
components the cost model predicts: parameters, gradients, optimizer states, activations (made inside the model's
forward, or recomputed in backward), the loss (made after the model returned: logits copies, log-softmax, and the
loss's gradients), backward temporaries, buffers (made by ``parallelize`` or by DDP/FSDP/pipelining: DDP's buckets;
FSDP's all-gather/reduce-scatter buffers and unsharded parameters and gradients) and step temporaries (clipping,
the optimizer's scratch). The peak of the last step is reported (the first creates the optimizer states).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..export import run_script
from .node_spans import NodeSpans

FREES_LAND_S = 0.002
"""how long a new peak waits for the frees a gloo group's worker threads have pending"""

COMPONENTS = ("params", "grads", "optimizer", "activations", "casts", "loss", "backward", "buffers", "step")
"""the measured components, in the order tables show them"""
LABELS = {
    "params": ("Parameter", "Buffer", "Sharded Param"),
    "grads": ("Gradient", "Sharded Grad"),
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "casts": ("Cast",),
    "loss": ("Loss", "Inputs"),
    "backward": ("Temp",),
    "buffers": ("Setup", "All Gather", "Reduce Scatter", "Unsharded Param", "Unsharded Grad", "Other"),
    "step": ("Step",),
}
"""component -> the tracker's reference types (MemTracker's and FSDPMemTracker's, plus this module's Loss, Cast, Setup
and Step) it sums"""

GROUPS = {
    "params": (("params",), ("params",)),
    "grads": (("grads",), ("grads",)),
    "optimizer": (("optimizer", "optimizer_step_temporaries"), ("optimizer",)),
    "activations + loss": (("saved_activations", "loss_saved", "loss_temporaries", "pipeline_outputs",
                            "forward_working_set", "fsdp_weight_pass_grads"),
                           ("activations", "loss")),
    "weight copies": (("autocast_weight_copies",), ("casts",)),
    "buffers": (("ddp_buckets", "fsdp_unsharded_params", "fsdp_root_params", "fsdp_gathered_units",
                 "fsdp_reduce_scatter", "fsdp_all_gather", "fsdp_unsharded_grads", "pipeline_buffers",
                 "replicate_gathered_experts"),
                ("buffers",)),
    "temporaries": (("backward_working_set", "pipeline_sent_gradients", "weight_pass_gradients",
                     "replicate_reduce_buffers"),
                    ("backward", "step")),
}
"""component shown -> (the predicted fields or MemoryBreakdown.terms it sums, the measured components it sums).
The tracker labels by when a storage is made (this module): the logits and their copies are activations or
loss there, so those two are compared together (and a zero-bubble weight pass's gradients, made in a backward outside
every module, are loss there); what the optimizer's step allocates is optimizer state there (its hooks mark the whole
step), so its temporaries are compared with the states."""


def predicted_groups(mb) -> dict[str, float]:
    """A :class:`~autopar_nb.plan.MemoryBreakdown` (its fields and named terms) summed into :data:`GROUPS`."""
    values = {"params": mb.params, "grads": mb.grads, "optimizer": mb.optimizer, **mb.terms}
    return {g: sum(values.get(k, 0.0) for k in keys) for g, (keys, _) in GROUPS.items()}


def measured_groups(peak: dict) -> dict[str, float]:
    """The tracker's components (:data:`COMPONENTS`, :func:`components`) summed into :data:`GROUPS`."""
    return {g: sum(peak.get(k, 0.0) for k in keys) for g, (_, keys) in GROUPS.items()}


def moment_at(where: str, layer_paths: list[str], moments: list[tuple], op_modules: dict[int, str] | None = None,
              micro_batch: int | None = None, node: str | None = None, op_names: dict[int, str] | None = None):
    """Of one rank's predicted moments (``cost.estimate.peak_moments``: (phase, layer index, breakdown[, op,
    later])), the one a measured peak's ``where`` ("<phase>/<side> in <module>", :attr:`Labelled.where`) is at: the
    optimizer step, the loss (its forward or backward, outside every module), or the forward, backward or recompute
    of the layer whose path holds the module (the largest such moment; the model has a forward moment for the last
    layer of each run of layers without recompute only). With ``micro_batch`` (the measured peak's, counted
    from 0) and per-op moments, a pipeline rank's first micro-batch's moments or a later one's
    (:attr:`~autopar_nb.cost.moment.PeakMoment.later`). With ``op_modules`` (graph index -> module path) and
    per-op moments, a layer's backward at the ops of that very module (by its path within the layer: a repeated
    block's moments carry its first instance's ops), where it has any; with ``node`` (the autograd node running at
    the peak) and ``op_names`` (graph index -> op), at the ops of its kind among them (:func:`op_kind_of_node`:
    Mixtral's experts peak at the backward of their last index op, while all they saved is alive). None where the
    model has no such moment or the module names no layer (a forward in a stage's own graph: its last layer's)."""
    phase, _, module = where.partition(" in ")
    name = _relative(module) if module else ""
    if phase.startswith("step/"):
        want = ("step", None)
    elif phase in ("train/forward", "train/backward") and not module:
        want = ("loss", None)  # after the model returned: the loss's forward or its backward
    elif phase in ("train/forward", "train/backward", "train/recompute") and module:
        layer = _layer_of(module, layer_paths)
        if layer is None and phase == "train/forward" and module.endswith("GraphModule"):  # a TP head's gather
            layer = max((mo[1] for mo in moments if mo[0] == "forward"), default=None)
        if layer is None:
            return None
        want = (phase.removeprefix("train/"), layer)
    else:
        return None
    hits = [mo for mo in moments if (mo[0], mo[1]) == want]
    if micro_batch is not None:  # a pipeline rank's first micro-batch's backward, or a later one's
        hits = [mo for mo in hits if len(mo) < 5 or mo[4] is None or mo[4] == (micro_batch > 0)] or hits
    # a repeated block's per-op moments carry its first instance's ops: an op is matched by its path in its layer
    inner = path_in_layer(name, layer_paths)
    at_op = [mo for mo in hits if len(mo) > 3 and mo[3] is not None
             and path_in_layer((op_modules or {}).get(mo[3], "\0"), layer_paths) == inner]
    if node and op_names:  # the autograd node running names the op's kind (MulBackward0: aten.mul)
        kind = op_kind_of_node(node)
        at_op = [mo for mo in at_op if op_kind(op_names.get(mo[3], "")) == kind] or at_op
    hits = at_op or [mo for mo in hits if len(mo) < 4 or mo[3] is None]
    return max(hits, key=lambda mo: mo[2].total) if hits else None


def op_kind_of_node(node: str) -> str:
    """An autograd node's name as the op it is the backward of: ``NativeLayerNormBackward0`` -> ``nativelayernorm``
    (lower case, no underscores: :func:`op_kind`)."""
    return re.sub(r"Backward\d*$", "", node).replace("_", "").lower()


def op_kind(op: str) -> str:
    """A graph op's name as :func:`op_kind_of_node` makes a node's: ``aten.native_layer_norm.default`` ->
    ``nativelayernorm``."""
    from ..cost.tp_styles import packet

    return packet(op).replace("_", "").lower()


def _relative(module: str) -> str:
    """A tracker's module name as the model names it: the root's name (its class, DDP's
    ``DistributedDataParallel.module``, a pipeline stage's ``Pipe.split_gm.submod_pp_<n>``) and checkpoint
    wrappers dropped."""
    root, *parts = module.split(".")
    parts = [p for p in parts if p != "_checkpoint_wrapped_module"]
    if len(parts) > 1 and parts[0] == "split_gm" and parts[1].startswith("submod_pp_"):
        parts = parts[2:]
    elif root == "Wrapper" and parts[:1] == ["_export_root"]:  # a pipeline stage's experts: the model's own module,
        parts = parts[1:]  # which torch.export's wrapper named first (runtime/ep.py experts_in_stages)
    elif root == "DistributedDataParallel" and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def path_in_layer(path: str, layer_paths: list[str]) -> str:
    """A module path relative to the layer that holds it ("" for the layer itself; the path where none does):
    ``model.layers.3.mlp`` is ``.mlp`` in every block."""
    best = max((p for p in layer_paths if p and (path == p or path.startswith(p + "."))), key=len, default="")
    return path[len(best):] if best else path


def _layer_of(module: str, layer_paths: list[str]) -> int | None:
    """The index of the layer whose path holds a tracker's module name (:func:`_relative`)."""
    name = _relative(module)
    best = [(len(p), k) for k, p in enumerate(layer_paths) if p and (name == p or name.startswith(p + "."))]
    return max(best)[1] if best else None


def _gloo() -> bool:
    """this process is a rank of a real gloo group (whose collectives run on worker threads)"""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


class _GatheredLabel:
    """A plain tracker's label for FSDP2 parameters gathered beside DDP (``_label_gathered_parameters``), kept
    whatever op writes them next."""

    gathered = None
    """their storages (a weak dict)"""

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        from torch.distributed._tools.common_utils import get_untyped_storages

        if self.gathered and any(st in self.gathered for st in get_untyped_storages(t)):
            reftype = self._ref_class.UNSHARDED_PARAM
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)


def _tracker_classes():
    """(MemTracker, FSDPMemTracker) subclasses that label storages by when they are created (see the module
    docstring). Built lazily: importing this module must not import torch.distributed."""
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType

    extra = {"LOSS": "Loss", "CAST": "Cast", "SETUP": "Setup", "STEP": "Step", "UNSHARDED_PARAM": "Unsharded Param"}
    mem_types = _RefType("_Labels", {**{m.name: m.value for m in _MemRefType}, **extra})
    fsdp_types = _RefType("_FSDPLabels", {**{m.name: m.value for m in _FSDPRefType}, **extra})

    class Labelled:
        phase = "setup"
        """"setup" (parallelize), "train" (forward, loss, backward), "step" (after backward: clipping, optimizer)"""
        spans = None
        """the run's :class:`NodeSpans`: which module's forward made the autograd node running at a backward peak"""
        _peak_at: tuple = ("", "", "", None)
        """(phase, side, the tracker's innermost module, the running autograd node's sequence number) at the peak"""
        peak_node: str | None = None
        """the name of the autograd node running at the peak (``MulBackward0``); None in a forward"""

        @property
        def where(self) -> str:
            """The phase and module of the peak: "<phase>/<side> in <module>". In backward and recompute, the
            module whose forward made the autograd node running then (:class:`NodeSpans`), where one did; the
            tracker's own module can lag there (a checkpointed layer's hooks)."""
            phase, side, module, seq = self._peak_at
            if seq is not None and self.spans is not None:
                module = (self.spans.module_of(seq) or (module,))[0]
            return f"{phase}/{side}" + (f" in {module}" if module else "") if phase else ""

        @property
        def micro_batch(self) -> int | None:
            """In backward and recompute, which of the step's forward calls of the :attr:`where` module made the
            node running at the peak (a pipeline stage's micro-batch, counted from 0); None elsewhere."""
            seq = self._peak_at[3]
            hit = self.spans.module_of(seq) if seq is not None and self.spans is not None else None
            return hit[1] if hit else None

        param_cast = False
        """the op being tracked is a ``_to_copy`` of a parameter (autocast's 16-bit copy of a weight)"""
        census = 0
        """keep this many of the largest storages alive at the peak, each with the op and module that made it
        (:meth:`largest`); 0: none (the origins cost a lookup per op)"""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.param_cast = func is torch.ops.aten._to_copy.default and bool(args) and self._is_param(args[0])
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.param_cast = False
            if self.census:
                self._note_origins(func, out)
            return out

        def _note_origins(self, func, out) -> None:
            from torch.utils._pytree import tree_leaves
            from torch.utils.weak import WeakIdKeyDictionary

            if not hasattr(self, "_origins"):
                self._origins = WeakIdKeyDictionary()
            mods = sorted(self._mod_tracker.parents - {"Global"}, key=len)
            side = "backward" if self._mod_tracker.is_bw else "forward"
            node = torch._C._current_autograd_node()  # in backward: the autograd node running (its forward op's)
            made_by = {"node": f"{node.name()} #{node._sequence_nr()}"} if node is not None else {}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not is_fake(t) and t.untyped_storage() not in self._origins:
                    self._origins[t.untyped_storage()] = {
                        "op": str(func), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                        "module": mods[-1] if mods else "", "side": side, **made_by}

        def largest(self) -> list[dict]:
            """The :attr:`census` largest storages alive at the peak: label (the tracker's reference type), MiB and,
            where an op made it while the tracker ran, that op, its output's shape and dtype, the module and side
            (forward/backward) it ran in, and in backward the autograd node that ran it (name and sequence number,
            which orders the forward ops: an accumulated gradient's sum is the later gradient's node's)."""
            return getattr(self, "_at_peak", [])

        def _storages_now(self) -> list[dict]:
            origins = getattr(self, "_origins", {})
            rows = [{"label": getattr(w.reftype, "value", str(w.reftype)), "MiB": w.mem_consumed / 2**20,
                     **(origins[st] if st in origins else {})} for st, (w, _) in self._WINFO.items()]
            return sorted(rows, key=lambda r: -r["MiB"])[:self.census]

        def _is_param(self, t) -> bool:
            if not isinstance(t, torch.Tensor):
                return False
            hit = self._WINFO.get(t.untyped_storage())
            return hit is not None and getattr(hit[0].reftype, "name", "") in ("PARAM", "SHARDED_PARAM",
                                                                                "UNSHARDED_PARAM")

        def _label(self, reftype):
            types = self._ref_class
            name = getattr(reftype, "name", "")
            if self.phase == "setup" and name in ("ACT", "TEMP"):
                return types.SETUP
            if self.param_cast and name in ("ACT", "TEMP"):
                return types.CAST
            if name == "OPT":  # the optimizer's states, whenever the tracker's optimizer hook finds them
                return reftype
            if name in ("ACT", "TEMP") and self.phase == "step":
                return types.STEP
            if name == "ACT" and len(self._mod_tracker.parents) <= 1 and not self._in_ac:
                return types.LOSS  # outside the model: the loss's forward
            if name == "TEMP" and not self._mod_tracker.parents - {"Global"} and not self._in_ac:
                return types.LOSS  # the loss's backward, before the model's first module
            return reftype

        def _track(self, reftype, t):
            if not is_fake(t):
                super()._track(self._label(reftype), t)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            # a fake tensor (torch.export's, while a pipeline is traced) says "cpu" but holds no memory: its storage
            # is on meta; the tracker would count it, for as long as the traced graphs keep it
            return set() if is_fake(t) else super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _update_peak_stats(self, peak_state):
            if self._rising():
                # a gloo collective's buffer is released by the group's worker thread after wait() returns,
                # and its storage's free (a weakref callback) needs the GIL this thread holds: left alone it
                # lands several ops later, or under load much later (an FSDP all-gather's output seen alive
                # through the next op's backward: +5 % on a pipelined ZeRO-3 rank). NCCL frees it at the copy-
                # out, in stream order; let the workers finish first
                time.sleep(FREES_LAND_S)
            before = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != before:
                if self.census:
                    self._at_peak = self._storages_now()
                mods = sorted(self._mod_tracker.parents - {"Global"}, key=len)
                side = "forward" if not self._mod_tracker.is_bw else "recompute" if self._recomputing() else "backward"
                node = torch._C._current_autograd_node() if side != "forward" else None
                self._peak_at = (self.phase, side, mods[-1] if mods else "",
                                 node._sequence_nr() if node is not None else None)
                self.peak_node = node.name() if node is not None else None

        def _rising(self) -> bool:
            """this op's allocations lift the total above the peak so far, in a process of a gloo group"""
            return _gloo() and any(
                snap["Total"] > self._peak_mem.get(dev, 0) for dev, snap in self._curr_mem_snap.items())

        def _recomputing(self) -> bool:
            """inside a checkpoint's forward run again in backward"""
            return self._in_ac or getattr(self, "recomputing", False)

        restart_roots = False
        """a pipeline stage is a root module called once per micro-batch: MemTracker refuses a root called twice in
        one step ("multiple iterative calls"), so its per-module statistics restart at each forward call (the
        tracked storages and the peaks are kept)"""

        def _pre_fw_hook(self, module, inputs):
            if (self.restart_roots and module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}):
                del self.memory_tracking[module]
            return super()._pre_fw_hook(module, inputs)

        def reset_peak(self):
            """Forget the peak so far (the next one is the last step's)."""
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
            if self.census:
                self._at_peak = self._storages_now()

    class Tracker(_GatheredLabel, Labelled, MemTracker):
        def __init__(self):
            super().__init__()
            self._ref_class = mem_types

    class FSDPTracker(Labelled, FSDPMemTracker):
        """FSDPMemTracker tracks the optimizer it is given; the script builds its optimizer after ``parallelize``,
        so this one hooks every optimizer's step, as MemTracker does (Adam's states are optimizer states)."""

        def __init__(self, mod):
            super().__init__(mod)
            self._ref_class = fsdp_types

        recomputing = False
        """inside a checkpoint's recompute (FSDPMemTracker notices one only through an FSDP unit's forward inside
        the checkpointed region; the runtime wraps the checkpointed module in the unit, so its recompute would be
        labelled backward temporaries)"""

        def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
            """FSDP's own pre-forward hook refuses a root unit called twice in a step as MemTracker's does: under
            ``restart_roots`` its statistics restart there too (a pipeline stage's root, once per micro-batch)."""
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

            def restarting(*args, **kwargs):
                tracker = self._mod_tracker
                if (self.restart_roots and fsdp_mod in self.memory_tracking and not tracker.is_bw
                        and set(tracker.parents) - {tracker.get_known_fqn(fsdp_mod)} == {"Global"}):
                    del self.memory_tracking[fsdp_mod]
                return inner(*args, **kwargs)

            return restarting

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_fsdp_param_group_post_backward):
            """Label the gradients a unit accumulates unsharded without reducing them (a pipeline stage's backward
            of every micro-batch) as FSDP's unsharded gradients, as the tracker labels those it reduces: under
            mixed precision FSDP copies them to ``reduce_dtype`` in its post-backward, a new storage the tracker
            would call a backward temporary."""
            inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig_fsdp_param_group_post_backward)

            def labelling(*args, **kwargs):
                out = inner(*args, **kwargs)
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                for fsdp_param in group.fsdp_params if group else ():
                    if fsdp_param.unsharded_accumulated_grad is not None:
                        self._update_and_maybe_create_winfos(fsdp_param.unsharded_accumulated_grad,
                                                             self._ref_class.UNSHARDED_GRAD, update_existing=True)
                return out

            return labelling

        def _label(self, reftype):
            if self.recomputing and getattr(reftype, "name", "") == "TEMP":
                reftype = self._ref_class.ACT
            return super()._label(reftype)

        def __enter__(self):
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
            from torch.utils import checkpoint

            super().__enter__()
            hook = checkpoint._recomputation_hook
            self._recompute_hook = (hook, hook.__enter__, hook.__exit__)
            tracker = self

            def enter(h):
                tracker.recomputing = True
                return self._recompute_hook[1](h)

            def leave(h, *exc):
                tracker.recomputing = False
                return self._recompute_hook[2](h, *exc)

            hook.__enter__, hook.__exit__ = enter, leave

            def post(optimizer, args, kwargs):
                self._track_optimizer_states(self._ref_class.OPT, optimizer)
                self._in_opt = False

            self._any_optimizer = (register_optimizer_step_pre_hook(lambda *a: setattr(self, "_in_opt", True)),
                                   register_optimizer_step_post_hook(post))
            return self

        def __exit__(self, *args):
            for handle in self._any_optimizer:
                handle.remove()
            hook, enter, leave = self._recompute_hook
            hook.__enter__, hook.__exit__ = enter, leave
            return super().__exit__(*args)

    return Tracker, FSDPTracker


def components(snapshot: dict) -> dict[str, float]:
    """A tracker snapshot (reference type -> bytes, for one device) summed into :data:`COMPONENTS`, plus ``total``."""
    by_value = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    out = {c: float(sum(by_value.get(lab, 0) for lab in labels)) for c, labels in LABELS.items()}
    out["total"] = float(by_value.get("Total", sum(out.values())))
    return out


class _Session:
    """The tracker a run uses: the plain one until ``parallelize`` returns an FSDP2 module, then an FSDP one over
    it (FSDPMemTracker needs the module; it tracks its parameters and buffers from then on)."""

    def __init__(self, steps: int, census: int = 0):
        self.Tracker, self.FSDPTracker = _tracker_classes()
        self.steps, self.census = steps, census
        self.spans = NodeSpans(lambda module: self.active._mod_tracker.get_known_fqn(module))
        self.active = self.Tracker()
        self.active.census, self.active.spans = census, self.spans

    def switch_to_fsdp(self, roots: list) -> None:
        """Track the FSDP2 modules ``roots`` from now on: a rank's pipeline stages, one root each (an interleaved
        or V schedule's rank holds several), or the one model."""
        import torch.nn as nn

        self.active.__exit__(None, None, None)
        restart_roots = self.active.restart_roots
        self.active = self.FSDPTracker(roots[0])
        self.active.restart_roots = restart_roots
        if len(roots) > 1:  # the tracker instruments what its root's modules() lists: every stage
            self.active._root_mod = nn.ModuleList(roots)
        self.active.census, self.active.spans = self.census, self.spans
        self.active.__enter__()

    def as_setup(self, fn):
        """``fn`` with what it allocates labelled as set-up (buffers): DDP's ``_pre_forward``, which rebuilds the
        gradient buckets in the second step's forward."""

        def inner(*args, **kwargs):
            phase, self.active.phase = self.active.phase, "setup"
            try:
                return fn(*args, **kwargs)
            finally:
                self.active.phase = phase

        return inner

    def name_within(self, modules) -> None:
        """Name the modules inside ``modules`` by their paths under them again: ``parallelize`` wraps a traced
        pipeline stage's layers in checkpoint wrappers after the tracker has seen the stage, and torch's ModTracker
        names a module it meets outside the children it listed as a root of its own ("CheckpointWrapper")."""
        tracker = self.active._mod_tracker
        for mod in modules:
            fqn = tracker.get_known_fqn(mod)
            for name, sub in mod.named_modules() if fqn is not None else ():
                if sub is not mod:
                    tracker._known_modules[sub] = f"{fqn}.{name}"
                    tracker._seen_modules.add(sub)

    # the training loop's observer (runtime/train.py)
    def after_backward(self, step, parts, loss):
        self.active.phase = "step"

    def after_step(self, step, parts):
        self.active.phase = "train"
        if step < self.steps - 1:
            self.active.reset_mod_stats()
            self.active.reset_peak()
            self.spans.new_step()


def measure_script(script: str | Path, *, rank: int = 0, steps: int = 2, real: bool = False,
                   census: int = 0) -> dict[str, Any]:
    """Run the exported script's ``main`` for ``steps`` steps inside the tracker, as rank ``rank`` of a fake process
    group of the plan's world size, or (``real``) as the rank torchrun started this process as, in a real gloo group
    (a pipelined plan: its stages exchange their boundary shapes with ``recv_object_list``, and every micro-batch's
    activations cross between them, which a fake group would not deliver). Returns ``{"peak": components at the peak
    of the last step, "where": its phase and module, "micro_batch": which of the step's calls of that module,
    "node": the autograd node running (both None outside backward), "world": ..., "rank": ...}``, and with
    ``census`` the ``census`` largest storages alive at the peak under ``"largest"`` (``Labelled.largest``: what
    made each). Call it in a fresh process (the process group is global state): :func:`measure` does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    g, runtime = run_script(script, run_name="autopar_measure", build=True)  # the model before the tracker starts
    world = g["PP"] * g["DP"] * g["TP"] * g.get("CP", 1)
    if real:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    session = _Session(steps, census)
    if g["PP"] > 1:
        session.active.restart_roots = True
        _label_pipeline_buffers(session)
    _label_gathered_parameters(session)
    parallelize = g["parallelize"]

    def traced(*args, **kwargs):
        out = parallelize(*args, **kwargs)
        parts = out[0] if isinstance(out, tuple) else out
        root = parts[0] if isinstance(parts, list | tuple) else parts
        if hasattr(root, "register_comm_hook"):  # DDP: keep the bucket as it is (see the module docstring)
            root.register_comm_hook(None, _bucket_as_is)
            root._pre_forward = session.as_setup(root._pre_forward)  # its buckets (rebuilt in the 2nd forward)
        if isinstance(root, FSDPModule):
            session.switch_to_fsdp([p for p in (parts if isinstance(parts, list | tuple) else [parts])
                                    if isinstance(p, FSDPModule)])
        session.name_within(parts if isinstance(parts, list | tuple) else [parts])
        session.active.phase = "train"
        return out

    script_globals = g["parallelize"].__globals__  # main reads these (run_path returns a copy): wrappers, this run
    script_globals["parallelize"] = traced
    if "boundary_values" in script_globals:
        script_globals["boundary_values"] = _without_backward_hooks(script_globals["boundary_values"])
    try:
        with _input_hooks_holding_nothing(), session.spans:
            session.active.__enter__()
            try:
                runtime.Run.observer = session  # train() calls it after each backward and step
                g["main"](["--steps", str(steps)])
            finally:
                session.active.__exit__(None, None, None)
        snap = session.active.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
        out = {"peak": components(snap), "where": session.active.where, "micro_batch": session.active.micro_batch,
               "node": session.active.peak_node, "world": world, "rank": rank}
        return out | ({"largest": session.active.largest()} if census else {})
    finally:
        del g, script_globals
        gc.collect()  # before destroy: a gloo thread taking the GIL at exit aborts the process now and then
        dist.destroy_process_group()


def _label_pipeline_buffers(session) -> None:
    """The buffers torch's pipeline stages receive activations and gradients into (made at the first step, one per
    micro-batch, kept for the run) labelled as buffers (the cost model's ``pipeline_buffers``), not as the loss's or
    activations, which is when they are made."""
    from torch.distributed.pipelining import stage

    stage._make_tensor_from_meta = session.as_setup(stage._make_tensor_from_meta)


def _label_gathered_parameters(session) -> None:
    """FSDP2 replicate's gathered parameters beside DDP (the experts': ``runtime/ddp.py`` replicate_experts),
    labelled as FSDP's tracker labels its units' for as long as they live: the plain tracker labels a storage by
    the last op that wrote it (the all-gather's copy-out, its own parameter hooks: parameters on one rank,
    activations on another). ``FSDPParam.init_unsharded_param`` follows every all-gather's copy-out."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.utils.weak import WeakIdKeyDictionary

    init = FSDPParam.init_unsharded_param

    def labelled(self):
        init(self)
        tracker = session.active
        if not isinstance(tracker, session.FSDPTracker):  # which labels its units' itself
            tracker.gathered = tracker.gathered or WeakIdKeyDictionary()
            for t in self.all_gather_outputs:
                tracker.gathered[t.untyped_storage()] = True
                tracker._update_and_maybe_create_winfos(t, tracker._ref_class.UNSHARDED_PARAM)

    FSDPParam.init_unsharded_param = labelled


@contextlib.contextmanager
def _input_hooks_holding_nothing():
    """The tracker's module tracker with its hooks on each module's inputs (which mark the module's backward done)
    called at the first input gradient, not once every input's exists. Torch's ``ModTracker`` registers them with
    ``register_multi_grad_hook``'s default mode, "all", which keeps each gradient until the module's other inputs
    have theirs: a module that also takes a tensor every block reads (T5's position bias, its encoder's output)
    keeps its hidden states' gradient until that tensor's, summed over every block, exists at the end of backward
    (measured, T5's decoder: one residual gradient per sub-layer, 4.5 MiB at the peak of a pipeline's last rank),
    memory the script never holds without the tracker."""
    import torch.distributed._tools.mod_tracker as mod_tracker

    hook = mod_tracker.register_multi_grad_hook

    def first_gradient(tensors, fn, *, mode="any"):
        return hook(tensors, fn, mode="any")

    mod_tracker.register_multi_grad_hook = first_gradient
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = hook


def _without_backward_hooks(fn):
    """``fn`` with the tracker's module tracker registering no backward hooks: it hooks every module's outputs to
    notice their backward, and a forward that never runs one (a pipeline's :func:`boundary_values`, which reads the
    shapes crossing each cut) would keep its whole autograd graph (a micro-batch's activations) alive through those
    hooks for the rest of the run, which the script without the tracker frees at once."""
    import torch.distributed._tools.mod_tracker as mod_tracker

    def inner(*args, **kwargs):
        hook, mod_tracker.register_multi_grad_hook = mod_tracker.register_multi_grad_hook, lambda *a, **k: None
        try:
            return fn(*args, **kwargs)
        finally:
            mod_tracker.register_multi_grad_hook = hook

    return inner


def _bucket_as_is(state, bucket):
    """DDP comm hook for the fake group: the bucket, unreduced."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def measure(source, plan, *, ranks: tuple[int, ...] = (0,), steps: int = 2, timeout: float = 600,
            census: int = 0) -> list[dict]:
    """Measure ``plan`` on ``source`` (a :class:`~autopar_nb.source.ModelSource`) for each of ``ranks``: the plan's
    script is exported to a temporary directory and :func:`measure_script` runs it, each rank in a fresh process of
    a fake group, or every rank of a real one started by torchrun (:func:`measure_real`) for a plan whose ranks
    need each other's data: a pipeline (its stages' boundary shapes and activations) and expert parallelism (the
    token counts each rank routes to the others' experts: a fake group leaves the all-to-all's output as it was
    allocated, so the received counts, and with them the experts' activations, were whatever memory held; Mixtral
    under DDP had 3270 to 5362 tokens per expert group where routing sends about 4096).
    ``census``: also list that many of the largest storages at each rank's peak (:func:`measure_script`)."""
    from ..export import export

    with tempfile.TemporaryDirectory(prefix="autopar-measure-") as tmp:
        script = export(source, plan, Path(tmp) / "train.py", quiet=True).script
        if plan.mesh.pp > 1 or plan.mesh.ep > 1:
            got = measure_real(script, world=plan.mesh.world_size, steps=steps, timeout=timeout, census=census)
            return [got[r] for r in ranks]
        return [measure_in_subprocess(script, rank=r, steps=steps, timeout=timeout, census=census) for r in ranks]


def _child(args: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """``python args...`` in this process's working directory (a notebook kernel's: the cell's relative paths hold
    there, as in verify's and launch's ranks), one thread per process."""
    from .check import kernel_cwd

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=kernel_cwd())


def _results(proc: subprocess.CompletedProcess, what: str) -> list[dict]:
    got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not got or proc.returncode:
        raise RuntimeError(f"memory measurement of {what} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return got


def measure_in_subprocess(script, *, rank: int = 0, steps: int = 2, timeout: float = 600, census: int = 0) -> dict:
    """:func:`measure_script` in a child process, one rank of a fake group (one JSON line back)."""
    proc = _child(["-m", "autopar_nb.verify.measure", str(Path(script).resolve()), str(rank), str(steps), str(census)],
                  timeout=timeout)
    return _results(proc, f"{script} (rank {rank})")[-1]


def measure_real(script, *, world: int, steps: int = 2, timeout: float = 600, census: int = 0) -> dict[int, dict]:
    """:func:`measure_script` on every rank of a real gloo group of ``world`` processes on this machine (torchrun,
    loopback only): rank -> its result (each rank writes its own file: the ranks' printed lines can interleave)."""
    with tempfile.TemporaryDirectory(prefix="autopar-measure-ranks-") as out:
        proc = _child(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                       "-m", "autopar_nb.verify.measure", str(Path(script).resolve()), "real", str(steps), str(census),
                       out],
                      timeout=timeout)
        got = {}
        for f in Path(out).glob("rank*.json"):
            d = json.loads(f.read_text())
            got[d["rank"]] = d
    if proc.returncode or len(got) != world:
        raise RuntimeError(f"memory measurement of {script} ({world} processes, {len(got)} reported) failed "
                           f"(rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return got


if __name__ == "__main__":
    # script, rank (or "real": torchrun's, then the folder its result goes to), steps, census
    _script, _rank, _steps, _census = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if _rank == "real":
        _out = measure_script(_script, steps=_steps, real=True, census=_census)
        (Path(sys.argv[5]) / f"rank{_out['rank']}.json").write_text(json.dumps(_out))
    else:
        print(json.dumps(measure_script(_script, rank=int(_rank), steps=_steps, census=_census)), flush=True)
