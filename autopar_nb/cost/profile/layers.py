"""What the profile holds: per layer (:class:`LayerProfile`) the FLOPs and bytes by op class, what
autograd saves and what each op's backward holds beside it, parameters, TP styles and collectives;
per model (:class:`GraphProfile`) those layers and model-level facts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..tp_styles import Parts, part_split


@dataclass
class Saved:
    """One storage autograd keeps for backward, at the captured batch."""

    nbytes: float
    """bytes at the dtype it has in this precision (:data:`PRECISIONS`)"""
    region: bool
    """inside a tensor-parallel region: divided by the TP degree"""
    gathered: bool = False
    """a replicated input saved by a colwise Linear: with sequence parallel, PyTorch's DTensor saves
    it gathered (full), Megatron-LM saves the sequence shard and re-gathers in backward"""
    quadratic: bool = False
    """attention-score sized (seq x seq): dropped by selective recompute (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models")"""
    stat: bool = False
    """per-token statistics (norm mean/rstd, attention logsumexp): fp32 even under AMP, never
    TP-split"""
    sp_only: bool = False
    """held only under sequence parallelism (a row-parallel output's sequence-sharded gradient,
    all-gathered beside it in backward)"""
    routed: bool = False
    """one row per (token, choice) pair an experts module runs (``Facts.routed``): under expert
    parallelism, as many as the router sends the rank (:meth:`LayerProfile.at_routing`)"""


class Crossing(NamedTuple):
    """A tensor that crosses a pipeline cut before some layer: made before it (or a model input),
    read there or later. Torch's pipeline stages send it contiguous, receive it into a buffer per
    micro-batch, and keep it (as a stage output) until that micro-batch's backward."""

    nbytes: dict[str, float]
    """bytes at the captured batch, per precision (:data:`PRECISIONS`): its own shape, contiguous"""
    grad: bool
    """requires grad: its gradient travels back, into a buffer per micro-batch on the sending
    stage"""
    made: int
    """index of the layer that makes it (-1: a model input)"""
    saved_in: int | None
    """index of the layer whose op saves it first for backward (it is counted in that layer's saved
    activations); None: nothing saves it"""


class Moment(NamedTuple):
    """The backward of one op of a layer (:attr:`LayerProfile.moments`), or its forward
    (:attr:`LayerProfile.forward`): what is alive beside the layer's earlier saved tensors then."""

    kept: int
    """how many of the layer's saved tensors (``LayerProfile.saved_at``, in the order their first
    saver runs) are still alive: those first saved by this op or an earlier one; the rest were freed
    by the backward of the ops after it (LLaMA's silu x up product, saved only by the down
    projection, is gone by the product's backward)"""
    work: tuple[Saved, ...]
    """the gradients this op's backward holds at once: its output's and its floating inputs' (a
    row-parallel output's full-size, ``gathered``; a column-parallel op's gathered input's); in a
    forward moment the tensors alive then that nothing has saved yet
    (:func:`.moments.forward_moment`)"""
    selective: int = 0
    """a forward moment: how many of the tensors selective recompute keeps
    (:attr:`LayerProfile.selective`) come from this op or an earlier one; a recompute has consumed
    them from its cache by then (those it saves again are among the ``kept`` saved tensors, the rest
    are freed or in ``work``)"""
    later: tuple[int, int] = (0, 0)
    """(TP-split, replicated) numel of the layer's trainable parameters that an op after this one
    reads: their gradients exist by this op's backward (LLaMA's down projection's weight gradient at
    the silu x up product's)"""
    op: int = -1
    """the op's index in the graph"""
    held: tuple[Saved, ...] = ()
    """a forward moment: the tensors besides ``work`` that only a caller keeps alive then (a
    module's caller holds its arguments until it returns: a LayerNorm's output while the MLP it is
    passed to runs), in an eager forward and in a pipeline stage's unflattened modules alike, whose
    generated code frees a value once its last reader returned"""
    entered: tuple[Saved, ...] = ()
    """a forward moment: the layer's own inputs among ``work`` and the layer's saved tensors so far
    (a recompute's checkpoint keeps them already: :func:`..memory.activation_bytes` counts them)"""
    entered_held: tuple[Saved, ...] = ()
    """the same among ``held``"""


PRECISIONS = ("fp32", "autocast", "autocast_lowp")
"""how a plan runs the forward, which sets every tensor's dtype: float32; ``torch.autocast`` over
float32 parameters; autocast over 16-bit parameters (FSDP2's MixedPrecisionPolicy with
``param_dtype``, ZeRO 1-3 under AMP)"""


def precision_of(amp: str, zero_stage: int) -> str:
    """The :data:`PRECISIONS` entry of a plan's ``amp`` ("none", "bf16", "fp16") and ZeRO stage (the
    planner gives FSDP 16-bit parameters under AMP from ZeRO 1 on)."""
    if amp == "none":
        return "fp32"
    return "autocast_lowp" if zero_stage >= 1 else "autocast"


@dataclass
class Comm:
    """A TP collective at the captured batch: kind, bytes of the full (unsharded) tensor, fwd or
    bwd; or "step": once per optimizer step whatever the batch (the weight gradients of a repeated
    key/value projection)."""

    kind: str
    nbytes: float
    half_bytes: float
    phase: str


class Repeatable(NamedTuple):
    """A key/value projection's terms that change when TP repeats it (its weight whole on every
    rank)."""

    heads: int
    fwd: float
    """forward matmul FLOPs"""
    bwd: float
    params: int
    """trainable parameters (weight and bias)"""
    grad_bytes: float
    """bytes of their gradients, all-reduced over the TP ranks once per step"""


@dataclass
class AmpTime:
    """One layer's step-time terms under autocast with the plan's op lists (``precision.fp32_ops`` /
    ``low_precision_ops``), at the captured batch: each op at the dtype :mod:`..autocast` gives it
    there."""

    fp32_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """forward FLOPs by compute class (matmul, conv, attention) that TP divides and that run in
    float32: an op the plan's ``fp32_ops`` keeps there (``OpPrecision`` turns autocast off for it)
    or autocast's fp32 list casts up. The rest of ``LayerProfile.flops_split`` runs at the 16-bit
    rate: autocast lowers a listed op, and the matmuls inside an op it does not list (a composite or
    custom op, e.g. the zoo's ``grouped_linear``: its loop of ``@`` runs in bf16 under autocast,
    measured)"""
    fp32_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_fp32_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_fp32_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    mem_split: float = 0.0
    """bytes memory-bound ops move inside TP regions, each input, parameter and output at its dtype
    there"""
    mem_rep: float = 0.0
    cast_split: float = 0.0
    """bytes of the copies autocast (or the plan's lists) make of activation inputs before an op
    (read at the source dtype, written at the target), inside TP regions; forward"""
    cast_rep: float = 0.0
    """the same outside TP regions (divided by TP only with sequence parallel)"""
    cast_whole: float = 0.0
    """the same for the replicated input of a TP-split op (a colwise Linear's: whole on every rank,
    gathered first under sequence parallel)"""
    cast_bwd_split: float = 0.0
    """the same copies' backward (the gradient cast back), for inputs that require grad"""
    cast_bwd_rep: float = 0.0
    cast_bwd_whole: float = 0.0
    casts: int = 0
    """activation copies per forward (one kernel each)"""

    def repeated(self, lp: LayerProfile, fwd: float, bwd: float) -> AmpTime:
        """These terms when TP repeats key/value projections of ``fwd`` / ``bwd`` matmul FLOPs
        (moved from the split to the replicated part; their float32 share is the layer's split
        matmuls' share)."""
        share = (self.fp32_split.get("matmul", 0.0) / lp.flops_split["matmul"]
                 if lp.flops_split.get("matmul") else 0)
        bshare = (self.bwd_fp32_split.get("matmul", 0.0) / lp.bwd_split["matmul"]
                  if lp.bwd_split.get("matmul") else 0)
        out = replace(self, fp32_split=defaultdict(float, self.fp32_split),
                      fp32_rep=defaultdict(float, self.fp32_rep),
                      bwd_fp32_split=defaultdict(float, self.bwd_fp32_split),
                      bwd_fp32_rep=defaultdict(float, self.bwd_fp32_rep))
        out.fp32_split["matmul"] -= fwd * share
        out.fp32_rep["matmul"] += fwd * share
        out.bwd_fp32_split["matmul"] -= bwd * bshare
        out.bwd_fp32_rep["matmul"] += bwd * bshare
        return out


@dataclass
class LayerProfile:
    """Costs of one layer at the captured batch (see :mod:`autopar_nb.cost.profile`)."""

    path: str
    params_split: int = 0
    """trainable parameters TP divides (split Linear / Embedding weights, colwise biases)"""
    params_rep: int = 0
    """trainable parameters every TP rank holds (norms, rowwise biases, replicated modules)"""
    param_itemsize: int = 4
    param_tensors: int = 0
    """trainable parameter tensors the layer owns (what the optimizer, DDP's hooks and clipping
    loop over)"""
    flops_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """forward FLOPs by op class that TP divides"""
    flops_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    flops_other: float = 0.0
    """forward FLOPs of memory-bound ops (norms, elementwise, softmax): costed by bytes, counted as
    model FLOPs"""
    bwd_other: float = 0.0
    quad_flops: float = 0.0
    """forward FLOPs of the attention-score ops that selective recompute runs again"""
    sel_split: float = 0.0
    """forward FLOPs of the weight matmuls selective recompute runs again (every other one:
    ``runtime/ac.py``) that TP divides"""
    sel_rep: float = 0.0
    mem_split: float = 0.0
    """bytes moved by memory-bound ops inside TP regions"""
    mem_rep: float = 0.0
    """bytes moved by memory-bound ops outside TP regions (divided by TP only with sequence
    parallel)"""
    gemms: tuple = ()
    """the :class:`~autopar_nb.cost.efficiency.Gemm` of each matrix multiply of the forward (their
    shapes: tile and wave quantisation)"""
    attentions: tuple = ()
    """the :class:`~autopar_nb.cost.flash.Attention` of each attention op of the forward (head dim,
    sequence, causal: the fused kernel's speed)"""
    n_ops: int = 0
    """non-view ops of the layer's forward: each a kernel launch, and the host's work issuing it"""
    emb_bwd_split: float = 0.0
    """bytes of dense Embedding-gradient writes in backward (tables TP splits)"""
    emb_bwd_rep: float = 0.0
    saved: list[Saved] = field(default_factory=list)
    """what autograd saves in a float32 forward"""
    saved_amp: dict[str, list[Saved]] = field(default_factory=dict)
    """the same under autocast: precision ("autocast", "autocast_lowp") -> saved tensors at their
    dtypes there"""
    selective: dict[str, list[Saved]] = field(default_factory=dict)
    """precision -> what selective recompute keeps besides the layer's input, as ``runtime/ac.py``
    applies it (``SAVE_OPS``: the outputs of matrix multiplies, convolutions and attention kernels,
    everything else recomputed)"""
    input_bytes: float = 0.0
    """bytes entering the layer (float32 forward)"""
    input_amp: dict[str, float] = field(default_factory=dict)
    """the same under autocast, by precision"""
    shared_inputs: dict[str, dict[str, float]] = field(default_factory=dict)
    """precision ("fp32" or an autocast one) -> the inputs (storage -> bytes) of ``input_bytes`` /
    ``input_amp`` that other layers read too (T5's encoder output and position biases, a model's
    rotary table): the checkpoints of recomputed layers keep one storage, which a rank holds once
    (``cost/estimate.py``)"""
    output_bytes: float = 0.0
    output_amp: dict[str, float] = field(default_factory=dict)
    cast_split: int = 0
    """parameters (numel) TP divides that autocast keeps a 16-bit copy of for the step (read by a
    lower-precision op: Linear and convolution weights and biases; not embeddings or norm
    weights)"""
    cast_rep: int = 0
    f8_flops_split: float = 0.0
    """forward FLOPs of the Linears float8 training takes (:mod:`.float8`) that TP divides"""
    f8_flops_rep: float = 0.0
    f8_in: float = 0.0
    """elements of those Linears' inputs at the captured batch"""
    f8_out: float = 0.0
    f8_weights: float = 0.0
    """elements of their weights"""
    largest_out: float = 0.0
    """bytes of the largest (output + activation inputs) of one op: the gradients its backward holds
    at once"""
    moments: dict[str, list[Moment]] = field(default_factory=dict)
    """precision -> one :class:`Moment` per op whose backward runs: the candidates for the layer's
    backward peak"""
    weight_pass: dict[str, list[tuple[int, Saved]]] = field(default_factory=dict)
    """precision -> (graph index, its output's gradient) of each op that reads a trainable parameter
    and an activation that requires grad: a zero-bubble schedule's input pass (torch's
    ``stage_backward_input``) keeps these gradients, hooked on the ops' autograd nodes, until the
    weight pass starts from them"""
    forward: dict[str, list[Moment]] = field(default_factory=dict)
    """precision -> one :class:`Moment` per op of the layer's forward, in order
    (:func:`.moments.forward_moment`): what the layer holds when its forward, or a recompute of it,
    reaches that op"""
    comms: list[Comm] = field(default_factory=list)
    tp: dict[str, str] = field(default_factory=dict)
    """module path -> style when TP is on"""
    norms: list[str] = field(default_factory=list)
    """norm modules outside TP regions (sequence_parallel when SP is on)"""
    divisors: set[int] = field(default_factory=set)
    """sizes the TP degree must divide (heads, split Linear dims)"""
    heads: set[int] = field(default_factory=set)
    vocab: set[int] = field(default_factory=set)
    """embedding/head vocabulary sizes (uneven sharding allowed)"""
    regions: set[int] = field(default_factory=set)
    embedding_params: int = 0
    """parameters of vocab-parallel (rowwise) Embeddings in this layer"""
    largest_param: int = 0
    """numel of the largest trainable parameter"""
    borrowed: dict[str, tuple[int, bool, int]] = field(default_factory=dict)
    """trainable parameters this layer's ops read that another layer owns (a head tied to the
    embeddings): name -> (numel, TP splits it, the owner's layer index); a pipeline stage holding
    this layer but not the owner holds its own copy"""
    parts: dict[str, Parts] = field(default_factory=dict)
    """colwise module -> its output's parts (``LayerPlan.tp_parts``: heads per part, or features):
    projections split into heads, fused projections cut into pieces, head-indexed embeddings (see
    :mod:`..tp_styles`)"""
    shared: dict[str, list[int]] = field(default_factory=dict)
    """replicated projection -> its output's features [before, shared(, after)]: every head of the
    split attention reads the second piece (MLA's rope key), whose gradient TP sums over its ranks
    (``LayerPlan.tp_parts`` of a ``"shared"`` module)"""
    repeatable: dict[str, Repeatable] = field(default_factory=dict)
    """key/value projections (fewer heads than the query projection beside them): repeated, whole on
    every rank, when the TP degree exceeds their heads (:meth:`at_tp`)"""
    experts: dict[str, int] = field(default_factory=dict)
    """experts module path -> number of experts (stacked per-expert weights run by a grouped matmul:
    what expert parallelism splits, ``runtime/ep.py``'s contract)"""
    params_experts: int = 0
    """trainable parameters of those modules (part of ``params_rep``: TP leaves them whole)"""
    dispatch_bytes: float = 0.0
    """bytes of the token rows the experts modules receive (token x choice pairs x hidden width),
    summed over the modules: what one all-to-all of expert parallelism moves each way (dispatch,
    combine)"""
    dispatch_half: float = 0.0
    kv_bytes: float = 0.0
    """bytes of the keys and values the layer's attention ops read (whole sequence; in the captured
    dtype): what context parallelism's ring passes round the cp ranks"""
    kv_half: float = 0.0
    q_bytes: float = 0.0
    """bytes of the queries the layer's attention ops read, the size of their outputs (captured
    dtype)"""
    q_half: float = 0.0
    attention_ops: tuple[int, ...] = ()
    """graph indices of the layer's attention ops"""
    time_amp: dict[str, AmpTime] = field(default_factory=dict)
    """precision ("autocast", "autocast_lowp") -> the layer's time terms there, op by op at its
    dtype"""

    def saved_at(self, precision: str) -> list[Saved]:
        """What autograd saves in this layer under ``precision`` (:data:`PRECISIONS`)."""
        return self.saved if precision == "fp32" else self.saved_amp[precision]

    def layout(self, module: str, tp: int) -> str:
        """How ``tp`` ranks split the colwise ``module``: :func:`..tp_styles.part_split` of its
        parts ("split" for a module without any)."""
        pp = self.parts.get(module)
        if pp is None:
            return "split"
        return part_split(pp.counts, tp, repeatable=module in self.repeatable,
                          packable=not pp.table)

    def at_tp(self, tp: int) -> LayerProfile:
        """This profile as ``tp`` ranks run it: the key/value projections repeated at this degree
        (fewer heads than ranks) compute their whole output on every rank (matmul FLOPs not
        divided), hold their whole weight (parameters, gradients and optimizer states not divided),
        and all-reduce their weight gradients once per step (``runtime/layouts.py``: each rank's
        gradient is a ``Partial`` part of the whole)."""
        repeated = [r for m, r in self.repeatable.items() if self.layout(m, tp) == "repeated"]
        if not repeated:
            return self
        out = replace(self, flops_split=defaultdict(float, self.flops_split),
                      flops_rep=defaultdict(float, self.flops_rep),
                      bwd_split=defaultdict(float, self.bwd_split),
                      bwd_rep=defaultdict(float, self.bwd_rep), comms=list(self.comms))
        fwd, bwd = sum(r.fwd for r in repeated), sum(r.bwd for r in repeated)
        out.time_amp = {k: a.repeated(self, fwd, bwd) for k, a in self.time_amp.items()}
        for r in repeated:
            out.flops_split["matmul"] -= r.fwd
            out.flops_rep["matmul"] += r.fwd
            out.bwd_split["matmul"] -= r.bwd
            out.bwd_rep["matmul"] += r.bwd
            out.params_split -= r.params
            out.params_rep += r.params
            out.comms.append(Comm("all_reduce", r.grad_bytes, r.grad_bytes, "step"))
        return out

    def at_routing(self, rows: float) -> LayerProfile:
        """This profile where the rank's experts receive ``rows`` times the (token, choice) rows of
        balanced routing (its own pairs): every :attr:`Saved.routed` tensor and gradient it saves,
        holds in backward or in forward scaled by ``rows``."""
        if rows == 1 or not self.experts:
            return self

        def scaled(xs):
            return type(xs)(replace(x, nbytes=x.nbytes * rows) if x.routed else x for x in xs)

        def moment(m: Moment) -> Moment:
            return m._replace(work=scaled(m.work), held=scaled(m.held), entered=scaled(m.entered),
                              entered_held=scaled(m.entered_held))

        return replace(
            self, saved=scaled(self.saved),
            saved_amp={k: scaled(v) for k, v in self.saved_amp.items()},
            selective={k: scaled(v) for k, v in self.selective.items()},
            moments={k: [moment(m) for m in v] for k, v in self.moments.items()},
            forward={k: [moment(m) for m in v] for k, v in self.forward.items()},
            weight_pass={k: [(op, scaled((g,))[0]) for op, g in v]
                         for k, v in self.weight_pass.items()})


@dataclass
class GraphProfile:
    """Per-layer profiles in model order, plus model-level facts."""

    layers: list[LayerProfile]
    batch: int
    """samples in the captured batch"""
    seq_len: int | None
    """tokens per sample (None: the inputs are not token sequences)"""
    loss_parallel: bool
    """the output head is vocab-parallel under TP (the loss can be computed on its shards)"""
    output_numel: int
    """elements of the model's (first) output at the captured batch"""
    output_itemsize: int
    region_modules: dict[int, list[str]]
    """region id -> modules whose TP styles must change together"""
    device_kind: str
    """"cuda" or "cpu": what autograd saves for dropout and RMSNorm, and autocast's op lists"""
    rep: list[int] = field(default_factory=list)
    """layer index -> index of the first instance of its repeated block (identical costs: computed
    once)"""
    tp_refused: dict[str, str] = field(default_factory=dict)
    """module path -> why TP must not split it, even on a user's override (see
    ``tp_styles.tp_walk``)"""
    tp_whole: dict[str, str] = field(default_factory=dict)
    """module path -> why TP keeps it whole (replicated): every Linear or Embedding the walk does
    not split, in words (``tp_styles.Walk.whole``)"""
    pp_blocker: str = ""
    """why pipeline stages cannot be cut between the layers ("" when they can; see
    :func:`.blockers.pp_blocker`)"""
    sp_blocker: str = ""
    """why sequence parallelism cannot apply to the TP styles ("" when it can; see
    ``tp_sequence.sp_extent``)"""
    sp_last: int | None = None
    """index of the last layer whose outputs may stay sequence shards (None: every layer's); the
    runtime gathers the sequence at the input of the next layer with parameters"""
    sp_gather: int | None = None
    """index of the layer after :attr:`sp_last` that gathers the sequence at its input (the first
    with parameters: ``planner.styles``' ``GATHER``)"""
    sp_gather_comms: list[Comm] = field(default_factory=list)
    """the collectives of that gather: the sequence shards all-gathered in forward, their gradient
    reduce-scattered in backward (the tensors crossing into :attr:`sp_gather`)"""
    sp_end: str = ""
    """why sequence parallelism ends at :attr:`sp_last`: what a shard would run wrong after it"""
    sp_before: list[int] = field(default_factory=list)
    """indices of the layers with parameters before the first split block, embeddings aside (a norm
    of the embeddings alone): the runtime cuts the sequence at that block, so they run on whole
    activations"""
    cp_blocker: str = ""
    """why context parallelism cannot split this model's sequences ("" when it can; see
    :func:`.blockers.cp_blocker`)"""
    crossings: list[list[Crossing]] = field(default_factory=list)
    """layer index k -> the tensors a pipeline cut right before layer k would send
    (:func:`.crossings.count_crossings`)"""
    pp_glued: dict[int, str] = field(default_factory=dict)
    """layer index -> why no pipeline stage may start there: it stays in the stage of the layer
    before (:func:`.crossings.stage_start_refusals`)"""

    def sp_covers(self, i: int) -> bool:
        """Whether layer ``i``'s activations may be sequence shards under sequence parallelism."""
        return i not in self.sp_before and (self.sp_last is None or i <= self.sp_last)

    def layer(self, path: str) -> LayerProfile:
        """The profile of the layer at ``path``."""
        for lp in self.layers:
            if lp.path == path:
                return lp
        raise KeyError(path)

