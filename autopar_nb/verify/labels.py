"""PyTorch's memory trackers (``MemTracker``; ``FSDPMemTracker`` over an FSDP2 module), subclassed
to label every storage by when it is created.

The tracker's reference types are refined by when a storage is created (:data:`LABELS`), so the peak
splits into the components the cost model predicts: parameters, gradients, optimizer states,
activations (made inside the model's forward, or recomputed in backward), the loss (made after the
model returned: logits copies, log-softmax, and the loss's gradients), backward temporaries, buffers
(made by ``parallelize`` or by DDP/FSDP/pipelining: DDP's buckets; FSDP's all-gather/reduce-scatter
buffers and unsharded parameters and gradients) and step temporaries (clipping, the optimizer's
scratch).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils import checkpoint
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

FREES_LAND_S = 0.002
"""how long a new peak waits for the frees a gloo group's worker threads have pending"""

COMPONENTS = ("params", "grads", "optimizer", "activations", "casts", "loss", "backward", "buffers",
              "step")
"""the measured components, in the order tables show them"""
LABELS = {
    "params": ("Parameter", "Buffer", "Sharded Param"),
    "grads": ("Gradient", "Sharded Grad"),
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "casts": ("Cast",),
    "loss": ("Loss", "Inputs"),
    "backward": ("Temp",), "buffers": ("Setup", "All Gather", "Reduce Scatter", "Unsharded Param",
                                       "Unsharded Grad", "Other"),
    "step": ("Step",),
}
"""component -> the tracker's reference types (MemTracker's and FSDPMemTracker's, plus this module's
Loss, Cast, Setup and Step) it sums"""
_EXTRA = {"LOSS": "Loss", "CAST": "Cast", "SETUP": "Setup", "STEP": "Step",
          "UNSHARDED_PARAM": "Unsharded Param"}
_MEM_TYPES = _RefType("_Labels", {**{m.name: m.value for m in _MemRefType}, **_EXTRA})
_FSDP_TYPES = _RefType("_FSDPLabels", {**{m.name: m.value for m in _FSDPRefType}, **_EXTRA})


def components(snapshot: dict) -> dict[str, float]:
    """A tracker snapshot (reference type -> bytes, for one device) summed into :data:`COMPONENTS`,
    plus ``total``."""
    by_value = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    out = {c: float(sum(by_value.get(lab, 0) for lab in labels)) for c, labels in LABELS.items()}
    out["total"] = float(by_value.get("Total", sum(out.values())))
    return out


def _gloo() -> bool:
    """this process is a rank of a real gloo group (whose collectives run on worker threads)"""
    return dist.is_initialized() and dist.get_backend() == "gloo"


class _GatheredLabel:
    """A plain tracker's label for FSDP2 parameters gathered beside DDP
    (``_label_gathered_parameters``), kept whatever op writes them next."""

    gathered = None
    """their storages (a weak dict)"""

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        if self.gathered and any(st in self.gathered for st in get_untyped_storages(t)):
            reftype = self._ref_class.UNSHARDED_PARAM
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)


class Labelled:
    """What both trackers add to PyTorch's: the labels of :data:`LABELS`, where and when the peak
    was, and optionally what made the largest storages alive at it."""

    phase = "setup"
    """"setup" (parallelize), "train" (forward, loss, backward), "step" (after backward: clipping,
    optimizer)"""
    spans = None
    """the run's :class:`NodeSpans`: which module's forward made the autograd node running at a
    backward peak"""
    _peak_at: tuple = ("", "", "", None)
    """(phase, side, the tracker's innermost module, the running autograd node's sequence number) at
    the peak"""
    peak_node: str | None = None
    """the name of the autograd node running at the peak (``MulBackward0``); None in a forward"""

    @property
    def where(self) -> str:
        """The phase and module of the peak: "<phase>/<side> in <module>". In backward and
        recompute, the module whose forward made the autograd node running then
        (:class:`NodeSpans`), where one did; the tracker's own module can lag there (a checkpointed
        layer's hooks)."""
        return self._where_of(self._peak_at)[0]

    def _where_of(self, at: tuple) -> tuple[str, int | None]:
        """:attr:`where` and :attr:`micro_batch` of a moment (phase, side, tracker's module, node
        sequence)."""
        phase, side, module, seq = at
        hit = self.spans.module_of(seq) if seq is not None and self.spans is not None else None
        module = hit[0] if hit else module
        return ((f"{phase}/{side}" + (f" in {module}" if module else "") if phase else ""),
                (hit[1] if hit else None))

    def _place_of(self, at: tuple) -> tuple[str, int | None]:
        """A moment's place in the step, as :attr:`moment_peaks` keys it: :meth:`_where_of`, its
        micro-batch in a forward too (which of the step's calls of the module running; outside every
        module, the loss's: the call that finished before it)."""
        where, micro_batch = self._where_of(at)
        phase, side, module, seq = at
        if micro_batch is None and self.spans is not None and phase == "train":
            if side == "forward" and module:
                micro_batch = self.spans.forward_call(module)
            elif side == "forward" and not module:
                micro_batch = self.spans.call_before()
            elif side == "backward" and where == "train/backward" and seq is not None:
                micro_batch = self.spans.call_before(seq)
        return where, micro_batch

    @property
    def micro_batch(self) -> int | None:
        """In backward and recompute, which of the step's forward calls of the :attr:`where` module
        made the node running at the peak (a pipeline stage's micro-batch, counted from 0); None
        elsewhere."""
        return self._where_of(self._peak_at)[1]

    param_cast = False
    """the op being tracked is a ``_to_copy`` of a parameter (autocast's 16-bit copy of a weight)"""
    moment_peaks: dict[tuple, float] | None = None
    """with a dict: the largest total seen at each place of the step so far, (:attr:`where`,
    micro-batch: as :attr:`micro_batch`, and in a forward and the loss's too, :meth:`_place_of`) ->
    bytes (("train/backward in GPT.h.3", 1): its second micro-batch's; :meth:`reset_peak` empties
    it), the measured curve the memory timeline draws; None: not kept (it costs a lookup per op)"""
    census = 0
    """keep this many of the largest storages alive at the peak, each with the op and module that
    made it (:meth:`largest`); 0: none (the origins cost a lookup per op)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.param_cast = (func is torch.ops.aten._to_copy.default and bool(args)
                           and self._is_param(args[0]))
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.param_cast = False
        if self.census:
            self._note_origins(func, out)
        return out

    def _note_origins(self, func, out) -> None:
        if not hasattr(self, "_origins"):
            self._origins = WeakIdKeyDictionary()
        mods = sorted(self._mod_tracker.parents - {"Global"}, key=len)
        side = "backward" if self._mod_tracker.is_bw else "forward"
        # in backward: the autograd node running (its forward op's)
        node = torch._C._current_autograd_node()
        made_by = {"node": f"{node.name()} #{node._sequence_nr()}"} if node is not None else {}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not is_fake(t)
                and t.untyped_storage() not in self._origins):
                self._origins[t.untyped_storage()] = {
                    "op": str(func), "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "module": mods[-1] if mods else "", "side": side, **made_by}

    def largest(self) -> list[dict]:
        """The :attr:`census` largest storages alive at the peak: label (the tracker's reference
        type), MiB and, where an op made it while the tracker ran, that op, its output's shape and
        dtype, the module and side (forward/backward) it ran in, and in backward the autograd node
        that ran it (name and sequence number, which orders the forward ops: an accumulated
        gradient's sum is the later gradient's node's)."""
        return getattr(self, "_at_peak", [])

    def _storages_now(self) -> list[dict]:
        origins = getattr(self, "_origins", {})
        rows = [{
            "label": getattr(w.reftype, "value", str(w.reftype)), "MiB": w.mem_consumed / 2**20,
            **(origins[st] if st in origins else {})
        } for st, (w, _) in self._WINFO.items()]
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
        # the optimizer's states, whenever the tracker's optimizer hook finds them
        if name == "OPT":
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
        # a fake tensor (torch.export's, while a pipeline is traced) says "cpu" but holds no memory:
        # its storage is on meta; the tracker would count it, for as long as the traced graphs keep
        # it
        return (set() if is_fake(t)
                else super()._update_and_maybe_create_winfos(t, reftype, update_existing))

    def _update_peak_stats(self, peak_state):
        if self._rising():
            # a gloo collective's buffer is released by the group's worker thread after wait()
            # returns, and its storage's free (a weakref callback) needs the GIL this thread holds:
            # left alone it lands several ops later, or under load much later (an FSDP all-gather's
            # output seen alive through the next op's backward: +5 % on a pipelined ZeRO-3 rank).
            # NCCL frees it at the copy-
            # out, in stream order; let the workers finish first
            time.sleep(FREES_LAND_S)
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before or self.moment_peaks is not None:
            mods = sorted(self._mod_tracker.parents - {"Global"}, key=len)
            side = ("forward" if not self._mod_tracker.is_bw else "recompute" if self._recomputing()
                    else "backward")
            node = torch._C._current_autograd_node() if side != "forward" else None
            now = (self.phase, side, mods[-1] if mods else "",
                   node._sequence_nr() if node is not None else None)
            if self.moment_peaks is not None and self.phase != "setup":
                place, total = self._place_of(now), max((s["Total"]
                                                         for s in self._curr_mem_snap.values()),
                                                        default=0)
                self.moment_peaks[place] = max(total, self.moment_peaks.get(place, 0))
        if self._peak_mem != before:
            if self.census:
                self._at_peak = self._storages_now()
            self._peak_at = now
            self.peak_node = node.name() if node is not None else None

    def _rising(self) -> bool:
        """this op's allocations lift the total above the peak so far, in a process of a gloo
        group"""
        return _gloo() and any(
            snap["Total"] > self._peak_mem.get(dev, 0) for dev, snap in self._curr_mem_snap.items())

    def _recomputing(self) -> bool:
        """inside a checkpoint's forward run again in backward"""
        return self._in_ac or getattr(self, "recomputing", False)

    restart_roots = False
    """a pipeline stage, or a model under gradient accumulation, is a root module called once per
    micro-batch: MemTracker refuses a root called twice in one step ("multiple iterative calls"), so
    its per-module statistics restart at each forward call (the tracked storages and the peaks are
    kept)"""

    def _pre_fw_hook(self, module, inputs):
        if (self.restart_roots and module in self.memory_tracking and not self._mod_tracker.is_bw
                and set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                == {"Global"}):
            del self.memory_tracking[module]
        return super()._pre_fw_hook(module, inputs)

    def reset_peak(self):
        """Forget the peak so far (the next one is the last step's)."""
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        if self.moment_peaks is not None:
            self.moment_peaks = {}
        if self.census:
            self._at_peak = self._storages_now()


class Tracker(_GatheredLabel, Labelled, MemTracker):
    """The plain tracker, until ``parallelize`` returns an FSDP2 module."""

    def __init__(self):
        super().__init__()
        self._ref_class = _MEM_TYPES


class FSDPTracker(Labelled, FSDPMemTracker):
    """FSDPMemTracker tracks the optimizer it is given; the script builds its optimizer after
    ``parallelize``, so this one hooks every optimizer's step, as MemTracker does (Adam's states are
    optimizer states)."""

    def __init__(self, mod):
        super().__init__(mod)
        self._ref_class = _FSDP_TYPES

    recomputing = False
    """inside a checkpoint's recompute (FSDPMemTracker notices one only through an FSDP unit's
    forward inside the checkpointed region; the runtime wraps the checkpointed module in the unit,
    so its recompute would be labelled backward temporaries)"""

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        """FSDP's own pre-forward hook refuses a root unit called twice in a step as MemTracker's
        does: under ``restart_roots`` its statistics restart there too (a pipeline stage's root,
        once per micro-batch)."""
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def restarting(*args, **kwargs):
            tracker = self._mod_tracker
            if (self.restart_roots and fsdp_mod in self.memory_tracking and not tracker.is_bw
                    and set(tracker.parents) - {tracker.get_known_fqn(fsdp_mod)} == {"Global"}):
                del self.memory_tracking[fsdp_mod]
            return inner(*args, **kwargs)

        return restarting

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_fsdp_param_group_post_backward):
        """Label the gradients a unit accumulates unsharded without reducing them (a pipeline
        stage's backward of every micro-batch) as FSDP's unsharded gradients, as the tracker labels
        those it reduces: under mixed precision FSDP copies them to ``reduce_dtype`` in its
        post-backward, a new storage the tracker would call a backward temporary."""
        inner = super()._fsdp_param_group_post_backward(fsdp_mod,
                                                        orig_fsdp_param_group_post_backward)

        def labelling(*args, **kwargs):
            out = inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group else ():
                if fsdp_param.unsharded_accumulated_grad is not None:
                    self._update_and_maybe_create_winfos(fsdp_param.unsharded_accumulated_grad,
                                                         self._ref_class.UNSHARDED_GRAD,
                                                         update_existing=True)
            return out

        return labelling

    def _label(self, reftype):
        if self.recomputing and getattr(reftype, "name", "") == "TEMP":
            reftype = self._ref_class.ACT
        return super()._label(reftype)

    def __enter__(self):
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

        self._any_optimizer = (
            register_optimizer_step_pre_hook(lambda *a: setattr(self, "_in_opt", True)),
            register_optimizer_step_post_hook(post))
        return self

    def __exit__(self, *args):
        for handle in self._any_optimizer:
            handle.remove()
        hook, enter, leave = self._recompute_hook
        hook.__enter__, hook.__exit__ = enter, leave
        return super().__exit__(*args)
