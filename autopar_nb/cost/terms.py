"""What the cost model sums: one layer's per-micro-batch terms (:class:`LayerTerms`), and per
pipeline rank the sums over its layers (:class:`RankSums`) that its step time and memory moments are
made of."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class LayerTerms:
    """One layer's per-micro-batch costs on one rank for a given (TP, SP, AMP, micro-batch size)."""

    fwd: float
    bwd: float
    sel: float
    """seconds selective recompute adds in backward (the memory-bound ops and every other weight
    matmul again)"""
    act: dict[str, float]
    """saved activation bytes by recompute mode"""
    params_local: float
    tp_comm: dict[str, float] = field(default_factory=dict)
    """seconds per micro-batch (forward + backward) by collective kind"""
    out_bytes: float = 0.0
    work_bytes: float = 0.0
    flops: float = 0.0
    """forward + backward FLOPs of one micro-batch as they run (global, not per rank: hardware FLOPs
    but recompute's)"""
    fwd_flops: float = 0.0
    quad_flops: float = 0.0
    """forward FLOPs selective recompute runs again (attention scores, every other weight matmul;
    global)"""
    largest_param: float = 0.0
    """numel of the layer's largest local parameter"""
    tp_exposed: float = 0.0
    """seconds of the TP collectives not hidden behind compute: sum(tp_comm) x (1 - overlap_tp),
    plus expert parallelism's all-to-alls (in tp_comm too), which the tokens wait for"""
    experts_local: float = 0.0
    """numel of the layer's expert parameters on one rank under expert parallelism (ep > 1; else 0:
    they count as any other parameter)"""
    a2a_fwd: float = 0.0
    """seconds of the forward all-to-alls of expert parallelism (full recompute runs them again)"""
    cp_merge: float = 0.0
    """bytes of the copy context parallelism's ring leaves where it merges the attention output's
    chunks (``torch.cat``, transposed back to (B, T, heads, hd)), which the output projection saves
    (part of ``act["none"]``; 0 without cp)"""
    ep_received: float = 0.0
    """bytes of the rows expert parallelism's all-to-all delivers to this rank's experts (its
    output, in the hidden states' dtype), which ``runtime/ep.py``'s dispatch holds until the local
    experts' forward returns: a copy the single-device graph does not make (0 without ep)"""
    tp_step: float = 0.0
    """seconds of TP collectives run once per step, not per micro-batch: the all-reduce of the
    weight gradients of key/value projections TP repeats (``LayerProfile.at_tp``)"""
    freed: float = 0.0
    """saved bytes of this layer already freed at its backward peak (:func:`.memory.peak_op`), with
    ``work_bytes`` the gradients held then"""
    later_params: float = 0.0
    """local parameters (numel) of this layer whose gradients exist at its backward peak (read by
    later ops)"""
    op_deltas: tuple[tuple[int, float, float, float, float], ...] = ()
    """per op of the layer whose backward runs: (its graph index, its working set, the saved bytes
    still alive and the local parameters whose gradients do not exist yet there, each less the peak
    op's, and the local parameters whose gradients its backward makes: :func:`.memory.op_deltas`):
    the layer's moment at that op (:meth:`Evaluator.rank_moments` with ``per_op``)"""
    f8_weights_local: float = 0.0
    """numel of the layer's local weights of float8 Linears (0 without float8): FSDP may gather them
    in float8"""
    cast_local: float = 0.0
    """numel of the layer's local parameters autocast keeps a 16-bit copy of during forward and
    backward (0 unless the precision is "autocast")"""
    forward: dict[str, float] = field(default_factory=dict)
    """recompute ("none", "full", "selective") -> bytes the layer holds at its forward's largest
    moment ("none"), or a recomputed layer beyond what it keeps at its recompute's
    (:func:`.memory.forward_peak`)"""
    whole_grads: float = 0.0
    """numel by which its weight gradients outgrow its local parameters: a vocab-split (rowwise)
    Embedding's gradient is the whole table on every TP rank (DTensor's embedding backward has no
    vocab-split strategy, ``_embedding_ops.embedding_dense_backward_strategy``, torch 2.13: it is
    Partial) until FSDP lays it out as the parameter at its reduction"""
    weight_grads: float = 0.0
    """bytes of gradients a zero-bubble input pass keeps for the weight pass
    (:func:`.memory.input_pass`)"""
    input_work: float = 0.0
    """the most the layer's input pass holds at one op beside its saved tensors"""
    input_ops: tuple[tuple[int, float], ...] = ()
    """per op of the layer: (its graph index, what its input pass holds there less
    ``input_work``)"""
    cpu: dict[str, tuple[float, float]] = field(default_factory=dict)
    """the host's seconds issuing one micro-batch through the layer, by part ("eager ops",
    "tensor parallel"): (forward, backward) (:func:`.cpu.layer_cpu`)"""
    tensors: int = 0
    """trainable parameter tensors of the layer (``LayerProfile.param_tensors``)"""
    model_flops: float = 0.0
    """the model FLOPs of one micro-batch MFU counts (global; :func:`.time.model_flops`)"""

    def cpu_s(self, part: str, recompute: str) -> float:
        """The host's seconds for ``part`` of one micro-batch: forward, backward, and the forward
        again when recomputed (selective recompute runs the memory-bound ops again, most of a
        layer's: counted as all)."""
        fwd, bwd = self.cpu.get(part, (0.0, 0.0))
        return fwd * (2 if recompute != "none" else 1) + bwd

    def recompute_s(self, recompute: str) -> float:
        """Seconds recompute adds in backward: the whole forward again (full, with its all-to-alls)
        or its memory-bound ops and every other weight matmul (selective)."""
        return (self.fwd + self.a2a_fwd if recompute == "full" else self.sel
                if recompute == "selective" else 0.0)

    def recompute_flops(self, recompute: str) -> float:
        """FLOPs recompute adds (hardware FLOPs, not model FLOPs)."""
        return (self.fwd_flops if recompute == "full" else self.quad_flops
                if recompute == "selective" else 0.0)

    def time_s(self, recompute: str) -> float:
        """The layer's time for one micro-batch on one rank: forward + backward + recompute +
        exposed TP comm. The one per-layer time formula: stage balancing uses it, and a pipeline
        rank's time is its sum."""
        return self.fwd + self.bwd + self.recompute_s(recompute) + self.tp_exposed


@dataclass
class RankSums:
    """Per pipeline rank (index r), sums over its layers for one micro-batch, and the chain's
    FLOPs."""

    fwdbwd: list[float]
    """forward + backward seconds"""
    rec: list[float]
    """recompute seconds"""
    tpc: list[float]
    """exposed TP collective seconds"""
    tp_kind: list[dict[str, float]]
    """TP collective seconds (before overlap) by kind"""
    acts: list[float]
    """saved activation bytes"""
    params: list[float]
    """local parameters (numel)"""
    work: list[float]
    """the largest working set of one layer's backward (bytes)"""
    units: list[list[FsdpUnit]]
    """the FSDP units (``fully_shard`` groups) in forward order, as ``export.patterns.fsdp_units``
    makes them"""
    largest: list[float]
    """the largest local parameter (numel)"""
    nofsdp: list[float]
    """parameters folded into the root FSDP unit (numel)"""
    p2p: list[tuple[int, int, float]]
    """the cuts between ranks in stage order: (sending rank, receiving rank, bytes of one
    micro-batch)"""
    experts: list[float] = field(default_factory=list)
    """local expert parameters under expert parallelism (numel; part of ``params``)"""
    experts_upto: list[dict[int, float]] = field(default_factory=list)
    """per rank, layer index -> the local expert parameters (numel) of its layers up to that one"""
    ep_received: list[dict[int, float]] = field(default_factory=list)
    """per rank, layer index -> its :attr:`LayerTerms.ep_received`"""
    cp_merges: list[float] = field(default_factory=list)
    """per rank, the :attr:`LayerTerms.cp_merge` copies its layers without recompute save (bytes;
    part of ``acts``)"""
    cp_merges_before: list[dict[int, float]] = field(default_factory=list)
    """per rank, layer index -> the same of its layers before that one"""
    head_tp: bool = False
    """the output head is TP-split (loss_parallel can apply)"""
    model_flops: float = 0.0
    hw_flops: float = 0.0
    tp_step: list[float] = field(default_factory=list)
    """seconds of TP collectives run once per step (``LayerTerms.tp_step``)"""
    f8_weights: list[float] = field(default_factory=list)
    """local weights (numel) of float8 Linears (``LayerTerms.f8_weights_local``)"""
    casts: list[float] = field(default_factory=list)
    """local parameters (numel) autocast keeps 16-bit copies of (``LayerTerms.cast_local``)"""
    whole_grads: list[float] = field(default_factory=list)
    """numel by which its gradients outgrow its local parameters (``LayerTerms.whole_grads``)"""
    cpu_ops: list[float] = field(default_factory=list)
    """the host's seconds issuing one micro-batch's eager ops (``LayerTerms.cpu_s``)"""
    cpu_tp: list[float] = field(default_factory=list)
    """the same for TP's styled modules"""
    tensors: list[float] = field(default_factory=list)
    """trainable parameter tensors"""
    pipe: list[dict[str, float]] = field(default_factory=list)
    """per rank, one micro-batch's bytes of the tensors crossing its pipeline cuts
    (:meth:`Evaluator.pipeline_sums`): ``recv`` (received into a buffer per micro-batch),
    ``recv_saved`` (the part of them its layers' saved activations count already), ``kept`` (its own
    outputs, kept until their backward, that its layers do not save), ``grad_recv`` (the gradients
    sent back to it) and ``grad_sent`` (the gradients of its inputs it sends back)"""
    bwd_layers: list[list[tuple[float, float, float, int, str]]] = field(default_factory=list)
    """per run of layers, the moments its backward holds the most (:func:`moment_layers`), and its
    forward: (saved activation bytes still alive, working set bytes, local parameters (numel) whose
    backward has not run yet, the layer's index, "backward", "recompute" or "forward": its
    backward's largest op, its recompute's largest forward moment, or, not recomputed, the run's
    last layer's forward's largest). Backward runs from the last layer to the first, freeing each
    layer's saved tensors and leaving its gradients: at layer l the saved tensors of later layers
    are gone and their gradients exist; a recomputed layer holds what its recompute re-created"""

    stages: list[list[StageSums]] = field(default_factory=list)
    """per rank holding several stages (:data:`.schedule.MULTI_STAGE`), its stages in chain order"""
    local: dict[int, int] = field(default_factory=dict)
    """layer index -> the position of its stage among its rank's :attr:`stages`"""
    input_layers: list[list[InputLayer]] = field(default_factory=list)
    """per rank, under a zero-bubble schedule, the layers whose input pass its peak can be at"""
    layers: list[float] = field(default_factory=list)
    """per rank, its layers (count)"""
    full_recompute: list[float] = field(default_factory=list)
    """per rank, its layers under full recompute (count): the caching allocator's reserve grows with
    them"""

    @classmethod
    def zeros(cls, pp: int) -> RankSums:
        z = [0.0] * pp
        return cls(list(z), list(z), list(z), [{} for _ in range(pp)], list(z), list(z), list(z),
                   [[] for _ in range(pp)], list(z), list(z), [], list(z), tp_step=list(z),
                   casts=list(z), f8_weights=list(z), cpu_ops=list(z), cpu_tp=list(z),
                   tensors=list(z), bwd_layers=[[] for _ in range(pp)],
                   pipe=[pipe_sums() for _ in range(pp)], stages=[[] for _ in range(pp)],
                   input_layers=[[] for _ in range(pp)], layers=list(z),
                   experts_upto=[{} for _ in range(pp)], ep_received=[{} for _ in range(pp)],
                   cp_merges=list(z), cp_merges_before=[{} for _ in range(pp)],
                   full_recompute=list(z),
                   whole_grads=list(z))

    def add_copies(self, r: int, i: int, cnt: int, lt: LayerTerms, recompute: str) -> None:
        """Rank ``r``'s run of ``cnt`` layers from ``i`` (each ``lt``, under ``recompute``) added
        to :attr:`ep_received` and the cp merges (saved only without recompute)."""
        merge = lt.cp_merge if recompute == "none" else 0.0
        for j in range(cnt):
            self.ep_received[r][i + j] = lt.ep_received
            self.cp_merges_before[r][i + j] = self.cp_merges[r] + j * merge
        self.cp_merges[r] += cnt * merge

    def per_micro_batch(self, r: int) -> float:
        """Rank ``r``'s time for one micro-batch: the sum of its layers'
        :meth:`LayerTerms.time_s`."""
        return self.fwdbwd[r] + self.rec[r] + self.tpc[r]


@dataclass
class CommTime:
    """Collective seconds of one step: before overlap by kind, and the part on the critical path."""

    by_kind: dict[str, float] = field(default_factory=dict)
    exposed_by_kind: dict[str, float] = field(default_factory=dict)
    exposed: float = 0.0

    def record(self, kind: str, total: float, exposed: float, contention: float) -> float:
        """Add ``total`` seconds of ``kind``, ``exposed`` of them on the critical path; the rest
        runs beside compute and slows it by ``contention`` seconds per second
        (``Factors.overlap_contention``), kept as the kind "contention" (all of it exposed). Returns
        the seconds the step gains."""
        slowed = contention * max(total - exposed, 0.0)
        for key, t, e in ((kind, total, exposed), ("contention", slowed, slowed)):
            if t:
                self.by_kind[key] = self.by_kind.get(key, 0.0) + t
            if e:
                self.exposed_by_kind[key] = self.exposed_by_kind.get(key, 0.0) + e
        return exposed + slowed


class FsdpUnit(NamedTuple):
    """One ``fully_shard`` group of consecutive layers."""

    first: int
    last: int
    """the indices of its first and last layers"""
    numel: float
    """its local parameters"""


def pipe_sums() -> dict[str, float]:
    """Zeros for the bytes crossing a rank's or a stage's cuts (:attr:`RankSums.pipe`)."""
    return dict.fromkeys(("recv", "recv_saved", "kept", "grad_recv", "grad_sent"), 0.0)


@dataclass
class StageSums:
    """One stage's sums over its layers, on a rank that holds several (one micro-batch)."""

    stage: int
    acts_start: float
    """the saved activation bytes of the rank's stages before it (where its layers' sums start)"""
    params_start: float
    """the local parameters (numel) of the rank's stages before it"""
    acts: float = 0.0
    params: float = 0.0
    weight_grads: float = 0.0
    """bytes a zero-bubble input pass keeps for the weight pass (:attr:`LayerTerms.weight_grads`)"""
    whole_grads: float = 0.0
    """numel by which its gradients outgrow its local parameters (:attr:`LayerTerms.whole_grads`)"""
    sends: bool = False
    """its output goes to another rank (not the last stage, nor the V's turn)"""
    turn: bool = False
    """its output goes to the rank's next stage (the V's turn), which torch hands the output itself
    (``set_local_fwd_input``), and which hands back its input's gradient itself
    (``set_local_bwd_input``): both stay referenced by the stages' receive records
    (``args_recv_info``, ``grad_recv_info``) until the next step replaces them, every micro-batch's,
    where ``LeanStage`` frees the buffers it allocated itself"""
    pipe: dict[str, float] = field(default_factory=pipe_sums)
    """the bytes crossing its cuts (:attr:`RankSums.pipe`); an input its rank's previous stage hands
    over is that stage's output, and its gradient that stage's gradient buffer: counted there"""


class InputLayer(NamedTuple):
    """A layer whose input pass a zero-bubble rank's peak can be at."""

    layer: int
    work: float
    """:attr:`LayerTerms.input_work`"""
    ops: tuple[tuple[int, float], ...]
    """:attr:`LayerTerms.input_ops`"""
    kept_upto: float
    """weight-pass gradients of its stage's layers up to it: those of the layers after it are kept
    when the input pass reaches it"""


def shared_sums(sum_layers):
    """``Evaluator.sum_layers`` made once per evaluator for each candidate alike in what it reads:
    the setting with its ZeRO stage as 0 or 2, and each layer's choices. It reads the stage only
    through ``precision_of`` (16-bit FSDP parameters under AMP from ZeRO 1 on) and the tied
    gradients' dtype (the same test), so ZeRO 1, 2 and 3 sum alike (a test of the floor checks it);
    the search costs most meshes at three stages. The :class:`RankSums` returned is shared: read it,
    never change it."""

    @functools.wraps(sum_layers)
    def shared(ev, s, choices):
        cache = ev.__dict__.setdefault("_shared_sums", {})
        key = (dataclasses.replace(s, zero_stage=0 if s.zero_stage == 0 else 2),
               tuple((c.stage, c.tp, c.recompute, c.fsdp, c.compile) for c in choices))
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= 4096:  # one plan() makes ~1000 (the 1T GPT on 3072 GPUs)
                cache.clear()
            hit = cache[key] = sum_layers(ev, s, choices)
        return hit

    return shared
