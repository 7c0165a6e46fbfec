"""One walk over the captured graph that the whole cost model reads: per layer, the FLOPs and bytes by op class
(split into the part tensor parallelism divides and the part it replicates), what autograd saves for backward, the
tensor-parallel styles of its modules, and the collectives those styles imply.

Everything is measured at the captured batch and scales linearly with samples per micro-batch (attention-score
terms with the square of the sequence length). Computed once per (graph, device kind); the planner only does
arithmetic on the result.

Tensor-parallel styles come from :mod:`.tp_styles`.

What each op keeps for backward, how it splits under TP and how a view lays out its result come from its
``kernels_ext`` rule (``OpRule.saves``, ``splits``, ``tp_role``, ``layout``), so a registered custom op is costed like
a built-in one. Saved tensors are counted once per storage: views share their base's storage, a non-contiguous view
that an op flattens (``OpRule.flattens_ndim``) or a reshape copies becomes a copy of its own. On CUDA dropout saves a
1-byte mask and RMSNorm is fused (input + rstd); on CPU dropout saves a noise tensor of the input's dtype and RMSNorm
is decomposed (input, normalised input and rstd are saved).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kernels_ext import moe_rules

from ...plan import ITEMSIZE, layer_of
from ..autocast import NORM_MODULES, AmpDtypes, amp_dtypes
from ..tp_styles import Parts, Walk, packet, part_split, rule_of, sp_check, splits_of, tp_walk

FLOAT = {"float64", "float32", "float16", "bfloat16"}


@dataclass
class Saved:
    """One storage autograd keeps for backward, at the captured batch."""

    nbytes: float
    """bytes at the dtype it has in this precision (:data:`PRECISIONS`)"""
    region: bool
    """inside a tensor-parallel region: divided by the TP degree"""
    gathered: bool = False
    """a replicated input saved by a colwise Linear: with sequence parallel, PyTorch's DTensor saves it gathered
    (full), Megatron-LM saves the sequence shard and re-gathers in backward"""
    quadratic: bool = False
    """attention-score sized (seq x seq): dropped by selective recompute (Korthikanti et al. 2022, sec. 5)"""
    stat: bool = False
    """per-token statistics (norm mean/rstd, attention logsumexp): fp32 even under AMP, never TP-split"""
    sp_only: bool = False
    """held only under sequence parallelism (a row-parallel output's sequence-sharded gradient, all-gathered beside
    it in backward)"""


class Crossing(NamedTuple):
    """A tensor that crosses a pipeline cut before some layer: made before it (or a model input), read there or
    later. Torch's pipeline stages send it contiguous, receive it into a buffer per micro-batch, and keep it (as a
    stage output) until that micro-batch's backward."""

    nbytes: dict[str, float]
    """bytes at the captured batch, per precision (:data:`PRECISIONS`): its own shape, contiguous"""
    grad: bool
    """requires grad: its gradient travels back, into a buffer per micro-batch on the sending stage"""
    made: int
    """index of the layer that makes it (-1: a model input)"""
    saved_in: int | None
    """index of the layer whose op saves it first for backward (it is counted in that layer's saved activations);
    None: nothing saves it"""


class Moment(NamedTuple):
    """The backward of one op of a layer (:attr:`LayerProfile.moments`), or its forward (:attr:`LayerProfile.forward`):
    what is alive beside the layer's earlier saved tensors then."""

    kept: int
    """how many of the layer's saved tensors (``LayerProfile.saved_at``, in the order their first saver runs) are
    still alive: those first saved by this op or an earlier one; the rest were freed by the backward of the ops
    after it (LLaMA's silu x up product, saved only by the down projection, is gone by the product's backward)"""
    work: tuple[Saved, ...]
    """the gradients this op's backward holds at once: its output's and its floating inputs' (a row-parallel
    output's full-size, ``gathered``; a column-parallel op's gathered input's); in a forward moment the tensors
    alive then that nothing has saved yet (:func:`_forward_moment`)"""
    selective: int = 0
    """a forward moment: how many of the tensors selective recompute keeps (:attr:`LayerProfile.selective`) come
    from this op or an earlier one; a recompute has consumed them from its cache by then (those it saves again are
    among the ``kept`` saved tensors, the rest are freed or in ``work``)"""
    later: tuple[int, int] = (0, 0)
    """(TP-split, replicated) numel of the layer's trainable parameters that an op after this one reads: their
    gradients exist by this op's backward (LLaMA's down projection's weight gradient at the silu x up product's)"""
    op: int = -1
    """the op's index in the graph"""
    held: tuple[Saved, ...] = ()
    """a forward moment: the tensors besides ``work`` that only a caller keeps alive then (a module's caller holds its
    arguments until it returns: a LayerNorm's output while the MLP it is passed to runs), in an eager forward and in
    a pipeline stage's unflattened modules alike, whose generated code frees a value once its last reader returned
    (bench/memory.py T5 and GPT-NeoX pp bf16 full recompute: closer with it)"""
    entered: tuple[Saved, ...] = ()
    """a forward moment: the layer's own inputs among ``work`` and the layer's saved tensors so far (a recompute's
    checkpoint keeps them already: :func:`.memory.activation_bytes` counts them)"""
    entered_held: tuple[Saved, ...] = ()
    """the same among ``held``"""


PRECISIONS = ("fp32", "autocast", "autocast_lowp")
"""how a plan runs the forward, which sets every tensor's dtype: float32; ``torch.autocast`` over float32
parameters; autocast over 16-bit parameters (FSDP2's MixedPrecisionPolicy with ``param_dtype``, ZeRO 2/3 under AMP)"""


def precision_of(amp: str, zero_stage: int) -> str:
    """The :data:`PRECISIONS` entry of a plan's ``amp`` ("none", "bf16", "fp16") and ZeRO stage (the planner gives
    FSDP 16-bit parameters under AMP from ZeRO 2 on)."""
    if amp == "none":
        return "fp32"
    return "autocast_lowp" if zero_stage >= 2 else "autocast"


@dataclass
class Comm:
    """A TP collective at the captured batch: kind, bytes of the full (unsharded) tensor, fwd or bwd; or "step":
    once per optimizer step whatever the batch (the weight gradients of a repeated key/value projection)."""

    kind: str
    nbytes: float
    half_bytes: float
    phase: str


class Repeatable(NamedTuple):
    """A key/value projection's terms that change when TP repeats it (its weight whole on every rank)."""

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
    ``low_precision_ops``), at the captured batch: each op at the dtype :mod:`.autocast` gives it there."""

    fp32_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """forward FLOPs by compute class (matmul, conv, attention) that TP divides and that run in float32: an op the
    plan's ``fp32_ops`` keeps there (``OpPrecision`` turns autocast off for it) or autocast's fp32 list casts up.
    The rest of ``LayerProfile.flops_split`` runs at the 16-bit rate: autocast lowers a listed op, and the matmuls
    inside an op it does not list (a composite or custom op, e.g. the zoo's ``grouped_linear``: its loop of
    ``@`` runs in bf16 under autocast, measured)"""
    fp32_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_fp32_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_fp32_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    mem_split: float = 0.0
    """bytes memory-bound ops move inside TP regions, each input, parameter and output at its dtype there"""
    mem_rep: float = 0.0
    cast_split: float = 0.0
    """bytes of the copies autocast (or the plan's lists) make of activation inputs before an op (read at the
    source dtype, written at the target), inside TP regions; forward"""
    cast_rep: float = 0.0
    """the same outside TP regions (divided by TP only with sequence parallel)"""
    cast_whole: float = 0.0
    """the same for the replicated input of a TP-split op (a colwise Linear's: whole on every rank, gathered first
    under sequence parallel)"""
    cast_bwd_split: float = 0.0
    """the same copies' backward (the gradient cast back), for inputs that require grad"""
    cast_bwd_rep: float = 0.0
    cast_bwd_whole: float = 0.0
    casts: int = 0
    """activation copies per forward (one kernel each)"""

    def repeated(self, lp: LayerProfile, fwd: float, bwd: float) -> AmpTime:
        """These terms when TP repeats key/value projections of ``fwd`` / ``bwd`` matmul FLOPs (moved from the
        split to the replicated part; their float32 share is the layer's split matmuls' share)."""
        share = self.fp32_split.get("matmul", 0.0) / lp.flops_split["matmul"] if lp.flops_split.get("matmul") else 0
        bshare = self.bwd_fp32_split.get("matmul", 0.0) / lp.bwd_split["matmul"] if lp.bwd_split.get("matmul") else 0
        out = replace(self, fp32_split=defaultdict(float, self.fp32_split), fp32_rep=defaultdict(float, self.fp32_rep),
                      bwd_fp32_split=defaultdict(float, self.bwd_fp32_split),
                      bwd_fp32_rep=defaultdict(float, self.bwd_fp32_rep))
        out.fp32_split["matmul"] -= fwd * share
        out.fp32_rep["matmul"] += fwd * share
        out.bwd_fp32_split["matmul"] -= bwd * bshare
        out.bwd_fp32_rep["matmul"] += bwd * bshare
        return out


@dataclass
class LayerProfile:
    """Costs of one layer at the captured batch (see the module docstring)."""

    path: str
    params_split: int = 0
    """trainable parameters TP divides (split Linear / Embedding weights, colwise biases)"""
    params_rep: int = 0
    """trainable parameters every TP rank holds (norms, rowwise biases, replicated modules)"""
    param_itemsize: int = 4
    flops_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """forward FLOPs by op class that TP divides"""
    flops_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_split: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bwd_rep: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    flops_other: float = 0.0
    """forward FLOPs of memory-bound ops (norms, elementwise, softmax): costed by bytes, counted as model FLOPs"""
    bwd_other: float = 0.0
    quad_flops: float = 0.0
    """forward FLOPs of the attention-score ops that selective recompute runs again"""
    mem_split: float = 0.0
    """bytes moved by memory-bound ops inside TP regions"""
    mem_rep: float = 0.0
    """bytes moved by memory-bound ops outside TP regions (divided by TP only with sequence parallel)"""
    n_ops: int = 0
    emb_bwd_split: float = 0.0
    """bytes of dense Embedding-gradient writes in backward (tables TP splits)"""
    emb_bwd_rep: float = 0.0
    saved: list[Saved] = field(default_factory=list)
    """what autograd saves in a float32 forward"""
    saved_amp: dict[str, list[Saved]] = field(default_factory=dict)
    """the same under autocast: precision ("autocast", "autocast_lowp") -> saved tensors at their dtypes there"""
    selective: dict[str, list[Saved]] = field(default_factory=dict)
    """precision -> what selective recompute keeps besides the layer's input, as ``runtime/ac.py`` applies it
    (``SAVE_OPS``: the outputs of matrix multiplies, convolutions and attention kernels, everything else recomputed)"""
    input_bytes: float = 0.0
    """bytes entering the layer (float32 forward)"""
    input_amp: dict[str, float] = field(default_factory=dict)
    """the same under autocast, by precision"""
    shared_inputs: dict[str, dict[str, float]] = field(default_factory=dict)
    """precision ("fp32" or an autocast one) -> the inputs (storage -> bytes) of ``input_bytes`` / ``input_amp``
    that other layers read too (T5's encoder output and position biases, a model's rotary table): the
    checkpoints of recomputed layers keep one storage, which a rank holds once (``cost/estimate.py``)"""
    output_bytes: float = 0.0
    output_amp: dict[str, float] = field(default_factory=dict)
    cast_split: int = 0
    """parameters (numel) TP divides that autocast keeps a 16-bit copy of for the step (read by a lower-precision op:
    Linear and convolution weights and biases; not embeddings or norm weights)"""
    cast_rep: int = 0
    largest_out: float = 0.0
    """bytes of the largest (output + activation inputs) of one op: the gradients its backward holds at once"""
    moments: dict[str, list[Moment]] = field(default_factory=dict)
    """precision -> one :class:`Moment` per op whose backward runs: the candidates for the layer's backward peak"""
    forward: dict[str, list[Moment]] = field(default_factory=dict)
    """precision -> one :class:`Moment` per op of the layer's forward, in order (:func:`_forward_moment`): what the
    layer holds when its forward, or a recompute of it, reaches that op"""
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
    """trainable parameters this layer's ops read that another layer owns (a head tied to the embeddings): name ->
    (numel, TP splits it, the owner's layer index); a pipeline stage holding this layer but not the owner holds its
    own copy"""
    parts: dict[str, Parts] = field(default_factory=dict)
    """colwise module -> its output's parts (``LayerPlan.tp_parts``: heads per part, or features): projections split
    into heads, fused projections cut into pieces, head-indexed embeddings (see :mod:`.tp_styles`)"""
    repeatable: dict[str, Repeatable] = field(default_factory=dict)
    """key/value projections (fewer heads than the query projection beside them): repeated, whole on every rank,
    when the TP degree exceeds their heads (:meth:`at_tp`)"""
    experts: dict[str, int] = field(default_factory=dict)
    """experts module path -> number of experts (stacked per-expert weights run by a grouped matmul: what expert
    parallelism splits, ``runtime/ep.py``'s contract)"""
    params_experts: int = 0
    """trainable parameters of those modules (part of ``params_rep``: TP leaves them whole)"""
    dispatch_bytes: float = 0.0
    """bytes of the token rows the experts modules receive (token x choice pairs x hidden width), summed over the
    modules: what one all-to-all of expert parallelism moves each way (dispatch, combine)"""
    dispatch_half: float = 0.0
    kv_bytes: float = 0.0
    """bytes of the keys and values the layer's attention ops read (whole sequence; in the captured dtype): what
    context parallelism's ring passes round the cp ranks"""
    kv_half: float = 0.0
    time_amp: dict[str, AmpTime] = field(default_factory=dict)
    """precision ("autocast", "autocast_lowp") -> the layer's time terms there, op by op at its dtype"""

    def saved_at(self, precision: str) -> list[Saved]:
        """What autograd saves in this layer under ``precision`` (:data:`PRECISIONS`)."""
        return self.saved if precision == "fp32" else self.saved_amp[precision]

    def layout(self, module: str, tp: int) -> str:
        """How ``tp`` ranks split the colwise ``module``: :func:`.tp_styles.part_split` of its parts ("split" for a
        module without any)."""
        pp = self.parts.get(module)
        if pp is None:
            return "split"
        return part_split(pp.counts, tp, repeatable=module in self.repeatable, packable=not pp.table)

    def at_tp(self, tp: int) -> LayerProfile:
        """This profile as ``tp`` ranks run it: the key/value projections repeated at this degree (fewer heads than
        ranks) compute their whole output on every rank (matmul FLOPs not divided), hold their whole weight
        (parameters, gradients and optimizer states not divided), and all-reduce their weight gradients once per
        step (``runtime/layouts.py``: each rank's gradient is a ``Partial`` part of the whole)."""
        repeated = [r for m, r in self.repeatable.items() if self.layout(m, tp) == "repeated"]
        if not repeated:
            return self
        out = replace(self, flops_split=defaultdict(float, self.flops_split),
                      flops_rep=defaultdict(float, self.flops_rep), bwd_split=defaultdict(float, self.bwd_split),
                      bwd_rep=defaultdict(float, self.bwd_rep), comms=list(self.comms))
        out.time_amp = {k: a.repeated(self, sum(r.fwd for r in repeated), sum(r.bwd for r in repeated))
                        for k, a in self.time_amp.items()}
        for r in repeated:
            out.flops_split["matmul"] -= r.fwd
            out.flops_rep["matmul"] += r.fwd
            out.bwd_split["matmul"] -= r.bwd
            out.bwd_rep["matmul"] += r.bwd
            out.params_split -= r.params
            out.params_rep += r.params
            out.comms.append(Comm("all_reduce", r.grad_bytes, r.grad_bytes, "step"))
        return out


@dataclass
class GraphProfile:
    """Per-layer profiles in model order, plus model-level facts."""

    layers: list[LayerProfile]
    batch: int
    """samples in the captured batch"""
    seq_len: int | None
    loss_parallel: bool
    output_numel: int
    output_itemsize: int
    region_modules: dict[int, list[str]]
    """region id -> modules whose TP styles must change together"""
    device_kind: str
    rep: list[int] = field(default_factory=list)
    """layer index -> index of the first instance of its repeated block (identical costs: computed once)"""
    tp_refused: dict[str, str] = field(default_factory=dict)
    """module path -> why TP must not split it, even on a user's override (see ``tp_styles.tp_walk``)"""
    pp_blocker: str = ""
    """why pipeline stages cannot be cut between the layers ("" when they can; see :func:`_pp_blocker`)"""
    sp_blocker: str = ""
    """why sequence parallelism cannot apply to the TP styles ("" when it can; see ``tp_styles.sp_check``)"""
    cp_blocker: str = ""
    """why context parallelism cannot split this model's sequences ("" when it can; see :func:`cp_blocker`)"""
    crossings: list[list[Crossing]] = field(default_factory=list)
    """layer index k -> the tensors a pipeline cut right before layer k would send (:func:`_count_crossings`)"""

    def layer(self, path: str) -> LayerProfile:
        for lp in self.layers:
            if lp.path == path:
                return lp
        raise KeyError(path)


_PROFILES: dict[int, tuple[weakref.ref, tuple, GraphProfile]] = {}


def profile_of(graph, device_kind: str = "cuda", *, fp32_ops=(), low_precision_ops=()) -> GraphProfile:
    """:func:`profile`, computed once per (graph, device kind, op lists) and kept while the graph lives (the latest
    one per graph)."""
    return once_per_graph(_PROFILES, graph, (device_kind, tuple(fp32_ops), tuple(low_precision_ops)),
                          lambda: profile(graph, device_kind=device_kind, fp32_ops=fp32_ops,
                                          low_precision_ops=low_precision_ops))


def once_per_graph(cache: dict, graph, how: tuple, make):
    """``make()``, kept in ``cache`` for ``graph`` while it lives, and made again when ``how`` (what it depends on
    besides the graph) changes: the latest one per graph."""
    hit = cache.get(id(graph))
    if hit is not None and hit[0]() is graph and hit[1] == how:
        return hit[2]
    with no_cycle_collection():
        value = make()
    key = id(graph)
    try:
        ref = weakref.ref(graph, lambda _r: cache.pop(key, None))
    except TypeError:
        return value
    cache[key] = (ref, how, value)
    return value


@contextlib.contextmanager
def no_cycle_collection():
    """Python's cyclic garbage collector paused (as it was after): a profile makes hundreds of thousands of small
    tuples (a forward moment per op and precision), and each pass of the collector's oldest generation walks every
    object a large graph holds. LLaMA-3 8B on 64 x H100, the first plan() call: 0.44 s with it, 0.26 s paused (0.21
    before the forward moments). A profile makes no reference cycles for it to free."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def profile(graph, *, device_kind: str = "cuda", fp32_ops=(), low_precision_ops=()) -> GraphProfile:
    """Walk ``graph`` once (see the module docstring). ``device_kind`` is "cuda" or "cpu" (what autograd saves for
    dropout and RMSNorm differs, and autocast's op lists). ``fp32_ops`` / ``low_precision_ops``: the plan's op lists
    (``precision.fp32_ops`` / ``low_precision_ops``), which change the dtypes saved under autocast."""
    refused: dict[str, str] = {}
    f = _facts(graph, refused, device_kind)
    amp = {p: _amp_facts(f, device_kind, low_params=p == "autocast_lowp", fp32_ops=fp32_ops,
                         low_precision_ops=low_precision_ops) for p in PRECISIONS[1:]}
    layers = {lay.path: LayerProfile(lay.path) for lay in graph.layers}
    _count_compute(layers, f)
    for precision, fa in amp.items():
        for lp, terms in _count_amp_time(layers, f, fa, low_params=precision == "autocast_lowp"):
            lp.time_amp[precision] = terms
    first_saver: dict[str, str] = {}  # storage -> the layer saving it first (float32 forward)
    lives = _lifetimes(f)
    for precision, fp in (("fp32", f), *amp.items()):
        moments: dict[str, list[Moment]] = {path: [] for path in layers}
        forward: dict[str, list[Moment]] = {path: [] for path in layers}
        for lp, saved in _count_saved(layers, fp, device_kind, moments, forward,
                                      first_saver if precision == "fp32" else None, lives):
            if precision == "fp32":
                lp.saved = saved
            else:
                lp.saved_amp[precision] = saved
            lp.moments[precision] = moments[lp.path]
            lp.forward[precision] = forward[lp.path]
    for precision, fp in (("fp32", f), *amp.items()):
        for lp, kept in _count_selective(layers, fp, device_kind):
            lp.selective[precision] = kept
    _count_comms(layers, f)
    _count_boundaries(layers, f, amp)
    split_params = _count_tp(layers, f)
    _count_params(layers, f, split_params=split_params, cast=amp["autocast"].autocast.cast_params)
    _count_later_gradients(layers, f, split_params)
    _count_experts(layers, f)
    _count_keys_values(layers, f)
    out = graph.outputs[0] if graph.outputs else None
    region_modules: dict[int, list[str]] = defaultdict(list)
    for name, rid in f.tp.region_of.items():
        region_modules[rid].append(f.by_name[name].module_path)
    index = {lay.path: i for i, lay in enumerate(graph.layers)}
    rep = [index[graph.block_of(lay.path).members[0]] if graph.block_of(lay.path) else i
           for i, lay in enumerate(graph.layers)]
    return GraphProfile([layers[lay.path] for lay in graph.layers], graph.batch_size, graph.seq_len,
                        bool(f.tp.head), out.numel if out else 0, out.itemsize if out else 4,
                        dict(region_modules), device_kind, rep,
                        {f.by_name[k].module_path: why for k, why in refused.items()}, _pp_blocker(f),
                        sp_check(graph, f.by_name, f.tp.styles, f.tp.sharded), cp_blocker(graph),
                        _count_crossings(f, amp, first_saver))


# ---- what every pass reads ------------------------------------------------------------------------------------------
class _Size(NamedTuple):
    numel: int
    itemsize: int
    floating: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


_TP = Walk
"""The TP styles :func:`.tp_styles.tp_walk` derives from dataflow (styles, head, sharded, regions, heads, parts)."""


@dataclass
class _Facts:
    """What the passes of :func:`profile` read about the graph's tensors, computed once."""

    graph: Any
    by_name: dict[str, Any]
    size: dict[str, _Size]
    """tensor (a node's first output or a graph input) -> numel, itemsize, floating point"""
    dtype: dict[str, str]
    """tensor -> its dtype (as captured; under autocast in the facts :func:`_amp_facts` makes)"""
    root: dict[str, str]
    """node -> the node whose storage it is a view of (itself when it owns one)"""
    noncontig: dict[str, bool]
    """node -> a non-contiguous view"""
    scores: set[str]
    """attention-score sized nodes (seq x seq)"""
    param_views: set[str]
    """views of parameters (an expert weight's transpose): held as parameters, never saved as activations"""
    tp: _TP
    grad: set[str] = field(default_factory=set)
    """nodes whose output requires grad (a trainable parameter upstream): only their ops are recorded by autograd;
    the rest (masks, rotary cos/sin, position ids) save nothing"""
    autocast: AmpDtypes | None = None
    """the dtypes under autocast (None: the captured, float32 forward)"""


def _facts(graph, refused: dict[str, str], device_kind: str = "cuda") -> _Facts:
    by_name = {n.name: n for n in graph.nodes}
    size, dtype = _sizes(graph)
    tp = _TP(*tp_walk(graph, by_name, {n.name: size[n.name].numel for n in graph.nodes}, refused))
    root, noncontig = _storages(graph.nodes, device_kind, dtype)
    scores, param_views = _attention_scores(graph.nodes), _parameter_views(graph.nodes)
    return _Facts(graph, by_name, size, dtype, root, noncontig, scores, param_views, tp, _requires_grad(graph))


def _amp_facts(f: _Facts, device_kind: str, *, low_params: bool, fp32_ops=(), low_precision_ops=()) -> _Facts:
    """``f`` as the forward runs under bf16 autocast (fp16 has the same sizes): every tensor at its dtype there
    (:mod:`.autocast`), views and no-op casts resolved again (a ``.to(float32)`` of a 16-bit tensor copies).
    ``low_params``: the parameters themselves are 16-bit (FSDP's MixedPrecisionPolicy)."""
    amp = amp_dtypes(f.graph, f.dtype, device_kind=device_kind, param_dtype="bfloat16" if low_params else None,
                     fp32_ops=fp32_ops, low_precision_ops=low_precision_ops)
    size = {k: v._replace(itemsize=ITEMSIZE[amp.dtype[k]]) if v.floating and k in amp.dtype else v
            for k, v in f.size.items()}
    graph, by_name = f.graph, f.by_name
    if amp.reads:  # the inputs ops really read there (AmpDtypes.reads)
        graph = copy.copy(f.graph)
        graph.nodes = [replace(n, inputs=amp.reads[n.name]) if n.name in amp.reads else n for n in f.graph.nodes]
        by_name = {n.name: n for n in graph.nodes}
    root, noncontig = _storages(graph.nodes, device_kind, amp.dtype)
    return replace(f, graph=graph, by_name=by_name, size=size, dtype=amp.dtype, root=root, noncontig=noncontig,
                   autocast=amp)


def _requires_grad(graph) -> set[str]:
    """Nodes with a floating output that depends on a trainable parameter (autograd's requires_grad)."""
    trainable = {name for name, p in graph.params.items() if p.trainable}
    grad: set[str] = set()
    for n in graph.nodes:
        if n.dtype in FLOAT and (any(p in trainable for p in n.params) or any(i in grad for i in n.inputs)):
            grad.add(n.name)
    return grad


def _sizes(graph) -> tuple[dict[str, _Size], dict[str, str]]:
    """Sizes and dtypes of every node's (first) output and of the graph inputs. A graph input is named by the nodes
    that read it; it takes the example inputs in the order the nodes first read one."""
    size = {n.name: _Size(_numel(n.out_shapes[0]) if n.out_shapes else 0, ITEMSIZE.get(n.dtype, 4), n.dtype in FLOAT)
            for n in graph.nodes}
    dtype = {n.name: n.dtype for n in graph.nodes}
    inputs = list(graph.inputs)
    placeholders = 0
    for n in graph.nodes:
        for name in n.inputs:
            if name not in size:
                ti = inputs[min(placeholders, len(inputs) - 1)] if inputs else None
                size[name] = _Size(ti.numel, ti.itemsize, ti.dtype in FLOAT) if ti else _Size(0, 4, True)
                dtype[name] = ti.dtype if ti else "float32"
                placeholders += 1
    return size, dtype


def _storages(nodes, device_kind: str, dtype: dict[str, str]) -> tuple[dict[str, str], dict[str, bool]]:
    """(node -> the node that owns its storage, node -> a non-contiguous view), from each view's rule layout and
    each tensor's ``dtype``."""
    root: dict[str, str] = {}
    noncontig: dict[str, bool] = {}
    attention_out: set[str] = set()
    permuted = _permuted(nodes)
    for n in nodes:
        if n.op_class == "attention" and not _math_attention(n, device_kind) and (
                device_kind != "cpu" or (n.inputs and n.inputs[0] in permuted)):
            # CUDA's fused kernels write (B, T, nh, hd); the CPU flash kernel follows the query's layout
            attention_out.add(n.name)
        src = n.inputs[0] if n.inputs else None
        if src is not None and _returns_input(n, dtype.get(src), dtype.get(n.name), noncontig.get(src, False)):
            root[n.name], noncontig[n.name] = root.get(src, src), noncontig.get(src, False)
            if src in attention_out:
                attention_out.add(n.name)
        elif n.op_class == "view" and src is not None:
            rule = rule_of(n.op)
            layout = rule.layout if rule is not None else ""
            base_nc = noncontig.get(src, False)
            if packet(n.op) == "transpose" and src in attention_out:
                # fused attention kernels return (B, nh, T, hd) as a transposed view of a (B, T, nh, hd) buffer:
                # transposing back is contiguous, and the out-projection saves it without a copy
                root[n.name], noncontig[n.name] = root.get(src, src), False
            elif layout == "strided":
                root[n.name], noncontig[n.name] = root.get(src, src), True
            elif layout == "reshape" and base_nc:
                root[n.name], noncontig[n.name] = n.name, False  # reshape of a non-contiguous view copies
            else:
                root[n.name], noncontig[n.name] = root.get(src, src), base_nc
        else:
            root[n.name], noncontig[n.name] = n.name, False
    return root, noncontig


def _permuted(nodes) -> set[str]:
    """Tensors laid out transposed in memory: a transpose's view, and what an elementwise op makes from one (its
    output follows its first full-size input's strides, as TensorIterator orders dimensions); a second transpose
    undoes it, a copy (contiguous, reshape, cat) ends it."""
    out: set[str] = set()
    shape = {n.name: tuple(n.out_shapes[0]) if n.out_shapes else () for n in nodes}
    for n in nodes:
        src = n.inputs[0] if n.inputs else None
        if src is None:
            continue
        name = packet(n.op)
        if name == "transpose":
            if src not in out:
                out.add(n.name)
        elif n.op_class == "view" and name not in ("reshape", "view", "flatten", "_unsafe_view"):
            if src in out:
                out.add(n.name)
        elif n.op_class == "elementwise" and name not in ("cat", "stack", "contiguous", "clone"):
            full = [i for i in n.inputs if shape.get(i) == shape[n.name]]
            if full and full[0] in out:
                out.add(n.name)
    return out


_NO_OP_IF_SAME = ("to", "_to_copy", "type_as", "contiguous")
"""ops that return their input itself when nothing changes (same dtype; contiguous already)"""


def _returns_input(n, src_dtype: str | None, dtype: str | None, src_noncontig: bool) -> bool:
    """The op returns its input tensor: ``x.to(x.dtype)``, ``x.contiguous()`` of a contiguous ``x``, dropout with
    p = 0 (ATen's ``dropout`` returns the input then: nothing is saved), a reshape to the same shape."""
    if n.dropout_p == 0.0 and n.op_class != "attention":
        return True
    name = packet(n.op)
    if name in _NO_OP_IF_SAME and src_dtype == dtype and not (name == "contiguous" and src_noncontig):
        return name != "_to_copy"  # _to_copy always copies; .to() is the op that may return self
    return name in ("reshape", "view") and len(n.in_shapes) == 1 and n.out_shapes and \
        tuple(n.in_shapes[0]) == tuple(n.out_shapes[0])


def _parameter_views(nodes) -> set[str]:
    """View nodes of parameters only (``w.transpose(-2, -1)``, and views of those)."""
    views: set[str] = set()
    for n in nodes:
        if n.op_class == "view" and (n.params or n.inputs) and all(i in views for i in n.inputs):
            views.add(n.name)
    return views


def _attention_scores(nodes) -> set[str]:
    """Attention scores by dataflow: the output of an activation x activation matmul (q @ k^T), carried through the
    ops that follow (scale, mask, softmax, dropout) until the next such matmul (scores @ v) consumes it."""
    scores: set[str] = set()
    for n in nodes:
        if n.op_class == "matmul" and not n.params and len(n.inputs) >= 2:
            if not any(i in scores for i in n.inputs) and n.out_shapes and len(n.out_shapes[0]) >= 3:
                scores.add(n.name)
        elif n.op_class not in ("attention", "matmul") and any(i in scores for i in n.inputs):
            scores.add(n.name)
    return scores


def _pp_blocker(f: _Facts) -> str:
    """Why pipeline stages cannot be cut between layers ("" when they can): ``runtime/pp.py`` traces the model with
    ``torch.export`` (torch's ``pipeline()``), so a model only the eager fallback of capture could record cannot be
    split. Anything else the layers pass on is a tensor the stages send (a non-contiguous view as its contiguous
    copy, a value read further on passed through the stages between)."""
    if f.graph.tracer != "torch.export":
        return (f"pipelining traces the model with torch.export, which could not trace {f.graph.model_type} (capture "
                "recorded an eager forward pass instead); make the model exportable (torch.export.export) to "
                "pipeline it")
    return ""


def _in_layers(layers: dict[str, LayerProfile], f: _Facts):
    """(layer profile, node) for every node of a profiled layer, in graph order."""
    for n in f.graph.nodes:
        lp = layers.get(n.layer)
        if lp is not None:
            yield lp, n


# ---- the passes -----------------------------------------------------------------------------------------------------
def _count_compute(layers: dict[str, LayerProfile], f: _Facts) -> None:
    """FLOPs by op class (split or replicated under TP), bytes of memory-bound ops, the largest backward step."""
    for lp, n in _in_layers(layers, f):
        in_region, split_op = n.name in f.tp.sharded, n.name in f.tp.styles
        if n.op_class != "view":
            lp.n_ops += 1
        nbytes = n.bytes_read + n.bytes_written
        if n.op_class == "embedding" and n.params and n.params[0] in f.graph.params:
            # a lookup reads the rows it gathers, not the table; its backward writes a dense gradient of the whole
            # table (nn.Embedding without sparse=True: zero-fill + index_add)
            w = f.graph.params[n.params[0]]
            nbytes = 2 * n.bytes_written + sum(f.size[i].nbytes for i in n.inputs)
            if split_op:
                lp.emb_bwd_split += w.numel * w.itemsize
            else:
                lp.emb_bwd_rep += w.numel * w.itemsize
        if n.op_class in ("matmul", "conv", "attention"):
            fwd, bwd = (lp.flops_split, lp.bwd_split) if in_region or split_op else (lp.flops_rep, lp.bwd_rep)
            fwd[n.op_class] += n.flops
            bwd[n.op_class] += n.bwd_flops
            if n.name in f.scores:
                lp.quad_flops += n.flops
        elif n.op_class != "view":
            lp.flops_other += n.flops
            lp.bwd_other += n.bwd_flops
            if in_region:
                lp.mem_split += nbytes
            else:
                lp.mem_rep += nbytes
            if n.name in f.scores:
                lp.quad_flops += n.flops
        if n.out_shapes and n.op_class != "view":
            # backward of this op holds the gradient of its output and of its activation inputs at once
            step = f.size[n.name].nbytes + sum(f.size[i].nbytes for i in n.inputs if f.size[i].floating)
            lp.largest_out = max(lp.largest_out, step)


def _count_amp_time(layers: dict[str, LayerProfile], f: _Facts, fa: _Facts, *, low_params: bool):
    """(layer, :class:`AmpTime`) for each layer under the autocast facts ``fa`` (``f``: the captured, float32 ones):
    compute ops kept in float32 at the float32 rate (:attr:`AmpTime.fp32_split`), memory-bound ops' bytes at their
    tensors' dtypes, the copies autocast inserts; a layer with no op of its own (a tied table whose ops another
    layer runs, T5's ``shared``) has none."""
    amp = fa.autocast
    out = {path: AmpTime() for path in layers}
    for lp, n in _in_layers(layers, f):
        t = out[lp.path]
        in_region = n.name in f.tp.sharded
        if n.op_class in ("matmul", "conv", "attention"):
            if amp.target.get(n.name) == "float32":
                split = in_region or n.name in f.tp.styles  # as _count_compute splits the op's FLOPs
                fwd, bwd = (t.fp32_split, t.bwd_fp32_split) if split else (t.fp32_rep, t.bwd_fp32_rep)
                fwd[n.op_class] += n.flops
                bwd[n.op_class] += n.bwd_flops
        elif n.op_class != "view":
            nbytes = _amp_bytes(n, f, fa, low_params=low_params)
            if in_region:
                t.mem_split += nbytes
            else:
                t.mem_rep += nbytes
        for i in dict.fromkeys(n.inputs):
            to = amp.cast(n.name, i)
            if to is None or not f.size[i].floating:
                continue
            copy = f.size[i].numel * (ITEMSIZE[fa.dtype[i]] + ITEMSIZE[to])
            t.casts += 1
            where = "split" if i in f.tp.sharded else "whole" if n.name in f.tp.styles else "rep"
            setattr(t, f"cast_{where}", getattr(t, f"cast_{where}") + copy)
            if i in f.grad:
                setattr(t, f"cast_bwd_{where}", getattr(t, f"cast_bwd_{where}") + copy)
    return [(layers[k], v) for k, v in out.items()]


def _amp_bytes(n, f: _Facts, fa: _Facts, *, low_params: bool) -> float:
    """Bytes one memory-bound op moves under autocast: its captured bytes (as :func:`_count_compute` counts them),
    each activation input read at the dtype it has when the op runs (autocast's copy when it makes one), each
    floating parameter at its 16-bit copy's or 16-bit own size, its output at its dtype there."""
    amp = fa.autocast
    read = 0
    for i in n.inputs:
        if i in f.size and f.size[i].floating:
            now = amp.cast(n.name, i) or fa.dtype.get(i, f.dtype[i])
            read += f.size[i].numel * (ITEMSIZE[now] - f.size[i].itemsize)
    lower = amp.target.get(n.name) in ("bfloat16", "float16")
    for p in n.params:
        pi = f.graph.params.get(p)
        if pi is not None and pi.dtype in FLOAT and (low_params or lower):
            read += pi.numel * (2 - pi.itemsize)
    written = f.size[n.name].numel * (fa.size[n.name].itemsize - f.size[n.name].itemsize) if n.out_shapes else 0
    if n.op_class == "embedding" and n.params and n.params[0] in f.graph.params:
        return 2 * (n.bytes_written + written) + sum(fa.size[i].nbytes for i in n.inputs)
    return n.bytes_read + n.bytes_written + read + written


class _Keep(NamedTuple):
    """A tensor one op keeps for backward, before storages are deduplicated."""

    key: str
    """the storage it keeps alive (the same key from two ops counts once)"""
    size: _Size
    region: bool
    gathered: bool = False
    quadratic: bool = False
    stat: bool = False


def _count_saved(layers: dict[str, LayerProfile], f: _Facts, device_kind: str,
                 moments: dict[str, list[Moment]] | None = None, forward: dict[str, list[Moment]] | None = None,
                 first: dict[str, str] | None = None, lives: dict[str, tuple[int, int, int]] | None = None
                 ) -> list[tuple[LayerProfile, list[Saved]]]:
    """What autograd saves in each layer at the dtypes of ``f``, each storage once (in the layer of the first op
    that saves it). An op no trainable parameter reaches is not recorded (saves nothing), nor one that returns its
    input (p = 0 dropout). ``moments``: filled with each layer's :class:`Moment` per op; ``forward``: with its
    forward moments (:attr:`LayerProfile.forward`; ``lives``: :func:`_lifetimes`); ``first``: with each saved
    storage's layer."""
    seen: set[str] = set()
    out = {path: [] for path in layers}
    cached = dict.fromkeys(layers, 0)  # how many tensors selective recompute keeps from the layer's ops so far
    accumulating = _accumulating_gradients(f) if moments is not None else {}
    index = {n.name: k for k, n in enumerate(f.graph.nodes)}
    alive = _Alive(lives or {}) if forward is not None else None
    entering = _entering(layers, f) if forward is not None else {}
    own: dict[str, set[str]] = {path: set() for path in layers}  # the storages each layer saves (their keys)
    for lp, n in _in_layers(layers, f):
        cached[lp.path] += len(_selective_kept(n, f, device_kind))
        rule = rule_of(n.op)
        recorded = rule is not None and n.name in f.grad and (f.root.get(n.name, n.name) == n.name
                                                              or n.op_class == "view")
        for keep in _kept_by(n, rule, f, device_kind) if recorded else ():
            if keep.key in seen or keep.size.numel == 0:
                continue
            seen.add(keep.key)
            own[lp.path].add(keep.key)
            if first is not None:
                first[keep.key] = lp.path
            out[lp.path].append(Saved(keep.size.numel * keep.size.itemsize, keep.region, keep.gathered,
                                      keep.quadratic, keep.stat))
        if recorded and moments is not None and n.op_class != "view" and n.out_shapes:
            grads = _math_attention_gradients(n, f, device_kind) or _gradients_of(n, f)
            moments[lp.path].append(Moment(len(out[lp.path]), grads + accumulating.get(n.name, ()),
                                           op=index[n.name]))
        if alive is not None and n.op_class != "view" and n.out_shapes:
            work, held, entered, entered_held = _forward_moment(n, index[n.name], f, alive, seen, device_kind,
                                                                entering[lp.path], own[lp.path])
            forward[lp.path].append(Moment(len(out[lp.path]), work, cached[lp.path], op=index[n.name], held=held,
                                           entered=entered, entered_held=entered_held))
    return [(lp, out[path]) for path, lp in layers.items()]


def _lifetimes(f: _Facts) -> dict[str, tuple[int, int, int]]:
    """Each storage the forward makes (a node owning its storage, :attr:`_Facts.root`; not a parameter's view) ->
    (the index of the op making it, of its last reader — a reader of any view of it —, and of the last op of the
    outermost module call, begun after it was made, that reads it): a module's caller holds the arguments it passes
    until the call returns, so in an eager forward a storage lives to the later of the two."""
    nodes = f.graph.nodes
    calls = _module_calls(nodes)
    life: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        for i in dict.fromkeys(n.inputs):
            lf = life.get(f.root.get(i, i))
            if lf is not None:
                lf[1] = k
                lf[2] = max(lf[2], next((end for start, end in calls[k] if start > lf[0]), k))
        if f.root.get(n.name, n.name) == n.name and n.out_shapes and n.name not in f.param_views:
            life[n.name] = [k, k, k]
    return {r: tuple(v) for r, v in life.items()}


def _module_calls(nodes) -> list[list[tuple[int, int]]]:
    """Per op, the (first op, last op) of each module call it runs in, outermost first: a call is a maximal run of
    consecutive ops whose ``module_path`` is the module's or inside it (the model's own forward, "", is none)."""
    spans: list[list[list[int]]] = []
    open_: dict[str, list[int]] = {}
    for k, n in enumerate(nodes):
        parts = n.module_path.split(".") if n.module_path else []
        paths = [".".join(parts[:d]) for d in range(1, len(parts) + 1)]
        for p in [p for p in open_ if p not in paths]:
            del open_[p]  # its call has ended (its span's end is the last op it saw)
        row = []
        for p in paths:
            span = open_.setdefault(p, [k, k])
            span[1] = k
            row.append(span)
        spans.append(row)
    return [[(s, e) for s, e in row] for row in spans]


class _Alive:
    """The storages alive as the forward reaches each op (:func:`_lifetimes`), swept in graph order."""

    def __init__(self, lives: dict[str, tuple[int, int, int]]):
        self.lives = lives
        self.made: dict[int, list[str]] = defaultdict(list)
        for r, (k, _, _) in lives.items():
            self.made[k].append(r)
        self.upto, self.now = -1, {}

    def at(self, k: int) -> list[tuple[str, bool]]:
        """(storage, alive only through a caller's argument) for each storage alive at op ``k`` (increasing)."""
        for j in range(self.upto + 1, k + 1):
            for r in self.made.get(j, ()):
                self.now[r] = self.lives[r]
        self.upto = max(self.upto, k)
        for r in [r for r, (_, _, held) in self.now.items() if held < k]:  # (held >= last)
            del self.now[r]
        return [(r, last < k) for r, (_, last, _) in self.now.items()]


def _entering(layers: dict[str, LayerProfile], f: _Facts) -> dict[str, set[str]]:
    """layer -> the storages entering it (made outside it, read by one of its ops; :func:`_boundary_bytes`)."""
    layer_of_node = {n.name: n.layer for n in f.graph.nodes}
    out: dict[str, set[str]] = {path: set() for path in layers}
    for lp, n in _in_layers(layers, f):
        out[lp.path].update(f.root.get(i, i) for i in n.inputs if layer_of_node.get(i) != n.layer)
    return out


def _forward_moment(n, k: int, f: _Facts, alive: _Alive, seen: set[str], device_kind: str,
                    entering: set[str] = frozenset(), own: set[str] = frozenset()
                    ) -> tuple[tuple[Saved, ...], tuple[Saved, ...], tuple[Saved, ...], tuple[Saved, ...]]:
    """What op ``n`` (the graph's ``k``-th) holds in forward besides the saved tensors (``seen``): (the storages the
    graph still reads — its inputs, its output, those read later — and the copies autocast makes of its inputs, none
    of them saved yet, and the CPU math attention's own transients; the storages only a caller keeps alive then,
    :attr:`Moment.held`; the layer's inputs (``entering``) among the first or among what the layer saved so far
    (``own``), and among the second: :attr:`Moment.entered`). Measured with MemTracker: ViT's forward peak under
    ZeRO 2 and bf16 autocast, at its last block's MLP."""
    work, held, entered, entered_held = [], [], [], []
    for r, by_caller in alive.at(k):
        if r not in seen:
            x = Saved(f.size[r].nbytes, r in f.tp.sharded, quadratic=r in f.scores)
            (held if by_caller else work).append(x)
            if r in entering:
                (entered_held if by_caller else entered).append(x)
        elif r in entering and r in own:
            entered.append(Saved(f.size[r].nbytes, r in f.tp.sharded, quadratic=r in f.scores))
    cast = f.autocast.cast if f.autocast is not None else None
    for i in dict.fromkeys(n.inputs) if cast is not None else ():
        to = cast(n.name, i) if i in f.size and f.size[i].floating else None
        if to is not None and f"cast:{n.name}:{i}" not in seen:
            work.append(Saved(f.size[i].numel * ITEMSIZE[to], i in f.tp.sharded or n.name in f.tp.sharded,
                              quadratic=i in f.scores))
    return (*work, *_math_attention_transients(n, f, device_kind)), tuple(held), tuple(entered), tuple(entered_held)


def _accumulating_gradients(f: _Facts) -> dict[str, tuple[Saved, ...]]:
    """Per op, the gradients alive during its backward besides its own (:func:`_gradients_of`): those of the tensors
    made before it and read after it (the residual stream a block's skip reads, an encoder's output every
    cross-attention reads, a position bias), whose later readers' backward has begun their gradient, and, for an
    input read again after the op, the sum its new gradient is accumulated into (autograd adds out of place).
    Measured with the tracker's census: T5's decoder backward holds the encoder output's gradient, that sum and the
    incoming part at once. A view's gradient is its own until the view's backward (Mixtral's experts read the up
    half of their fused gate/up output after the gate half's SiLU: half of it). An add's backward hands its output's
    gradient itself to each operand: the operands of the adds a gradient has reached so far hold one storage (a
    parallel residual's input and attention output, GPT-NeoX; an output projection's output and the skip beside it,
    LLaMA). Summed per TP kind (bytes split or not, score-sized or not)."""
    nodes = f.graph.nodes
    readers: dict[str, list[int]] = defaultdict(list)
    for k, n in enumerate(nodes):
        for i in dict.fromkeys(n.inputs):
            readers[i].append(k)
    last = {t: ks[-1] for t, ks in readers.items()}
    made = {n.name: k for k, n in enumerate(nodes)}

    def passes_through(t: str, k: int) -> bool:  # op k is an add whose backward hands t its output's gradient
        n = nodes[k]
        return (n.op == "aten.add.Tensor" and f.size.get(n.name) == f.size.get(t)
                and f.dtype.get(n.name) == f.dtype.get(t))

    def storage(t: str, k: int) -> str:  # whose gradient t's is at op k's backward (t read after k)
        later = [r for r in readers.get(t, ()) if r > k]
        while len(later) == 1 and passes_through(t, later[0]):
            t = nodes[later[0]].name
            later = readers.get(t, [])
        return t

    tracked = {t for t, k in last.items()  # a gradient-carrying tensor some op after its maker reads
               if t in made and k > made[t] and t in f.grad and t not in f.param_views and f.size[t].floating}
    ends: dict[int, list[str]] = defaultdict(list)
    for t in tracked:
        ends[last[t]].append(t)
    live: dict[str, None] = {}  # made before the current op, read after it (insertion ordered)
    out: dict[str, tuple[Saved, ...]] = {}
    for k, n in enumerate(nodes):
        for t in ends.get(k, ()):
            live.pop(t, None)
        sums: dict[tuple[bool, bool], float] = defaultdict(float)
        held = {storage(n.name, k)}  # the op's own output's gradient is in _gradients_of
        for t in live:
            if (g := storage(t, k)) not in held:
                held.add(g)
                sums[t in f.tp.sharded, t in f.scores] += f.size[t].nbytes
        for t in dict.fromkeys(n.inputs):
            if t in live:
                sums[t in f.tp.sharded, t in f.scores] += f.size[t].nbytes
        if sums and n.op_class != "view":
            out[n.name] = tuple(Saved(b, region, quadratic=quad) for (region, quad), b in sums.items())
        if n.name in tracked:
            live[n.name] = None
    return out


def _gradients_of(n, f: _Facts) -> tuple[Saved, ...]:
    """The gradients op ``n``'s backward holds at once (:attr:`Moment.work`), at the dtypes of ``f``."""
    style = f.tp.styles.get(n.name)
    out = f.size[n.name]
    grads = [Saved(out.nbytes, n.name in f.tp.sharded, gathered=style == "rowwise", quadratic=n.name in f.scores)]
    if style == "rowwise":
        grads.append(Saved(out.nbytes, False, sp_only=True))
    for i in n.inputs:
        if i in f.grad and i not in f.param_views and f.size[i].floating:
            grads.append(Saved(f.size[i].nbytes, i in f.tp.sharded, gathered=style == "colwise",
                               quadratic=i in f.scores))
    if packet(n.op) == "index" and n.inputs and n.inputs[0] in f.grad and f.size[n.inputs[0]].floating:
        # IndexBackward0 puts the gradient into zeros of the input's size out of place (index_put): the zeros and
        # the result are alive at once (dispatch log, torch 2.13; Mixtral's experts under ZeRO 2/3 bf16 full
        # recompute peak there: 4 MiB of temporaries short without it)
        grads.append(Saved(f.size[n.inputs[0]].nbytes, n.inputs[0] in f.tp.sharded, quadratic=n.inputs[0] in f.scores))
    return tuple(grads)


def _count_selective(layers: dict[str, LayerProfile], f: _Facts, device_kind: str) -> list[tuple[LayerProfile,
                                                                                              list[Saved]]]:
    """What the runtime's selective recompute (``runtime/ac.py``: torch's selective checkpoint with a policy that
    must save mm/addmm/bmm/convolution/attention outputs) keeps per layer, besides the inputs the checkpoint holds
    (:func:`_selective_kept` of each op), at the dtypes of ``f``."""
    out = {path: [] for path in layers}
    for lp, n in _in_layers(layers, f):
        out[lp.path] += _selective_kept(n, f, device_kind)
    return [(lp, out[path]) for path, lp in layers.items()]


def _selective_kept(n, f: _Facts, device_kind: str) -> list[Saved]:
    """What selective recompute keeps of op ``n``: the output of a matmul, convolution or attention op (a fused
    attention kernel's log-sum-exp with it; the CPU math kernel's two bmm outputs, float32 under autocast); nothing
    of other ops. A row-parallel output is its local partial sum, full size even under sequence parallelism
    (``gathered``)."""
    if n.op_class not in ("matmul", "conv", "attention") or not n.out_shapes:
        return []
    size, region = f.size[n.name]._replace(floating=True), n.name in f.tp.sharded
    if _math_attention(n, device_kind):
        item = max(size.itemsize, 4)
        return [Saved(_scores_numel(n) * item, region, quadratic=True), Saved(size.numel * item, region)]
    kept = [Saved(size.nbytes, region, gathered=f.tp.styles.get(n.name) == "rowwise")]
    rule = rule_of(n.op)
    if n.op_class == "attention" and rule is not None and rule.stats is not None:
        kept.append(Saved(rule.stats(n.in_shapes, n.out_shapes) * 4, region, stat=True))
    return kept


def _kept_by(n, rule, f: _Facts, device_kind: str) -> list[_Keep]:
    """The tensors op ``n`` keeps for its backward: its rule's ``saves`` tokens (``kernels_ext.SAVES``) on this
    device kind, resolved against the graph."""
    in_region, scores = n.name in f.tp.sharded, n.name in f.scores
    acts = [i for i in n.inputs if i not in f.param_views]  # a parameter's view is held with the parameter
    trainable = f.graph.params
    reads_param = any(trainable[p].trainable for p in n.params if p in trainable) or len(acts) < len(n.inputs)
    floats = [i for i in acts if f.size[i].floating]
    # an operand is kept only for another operand's gradient: x * cos keeps cos, not x, when cos needs none
    needed = [i for k, i in enumerate(acts) if f.size[i].floating
              and (reads_param or any(j in f.grad for m, j in enumerate(acts) if m != k))]
    out = f.size[n.name]
    colwise = f.tp.styles.get(n.name) == "colwise"

    cast_to = f.autocast.cast if f.autocast is not None else lambda _n, _i: None

    def kept_input(i: str) -> _Keep:
        nd = len(f.by_name[i].out_shapes[0]) if i in f.by_name and f.by_name[i].out_shapes else 2
        to = cast_to(n.name, i)
        if to is not None:  # autocast (or the plan's op lists) hands the op a copy in another dtype: it saves that
            key, size = f"cast:{n.name}:{i}", f.size[i]._replace(itemsize=ITEMSIZE[to])
        elif rule.flattens_ndim and nd >= rule.flattens_ndim and f.noncontig.get(i, False):
            key, size = f"copy:{n.name}:{i}", f.size[i]  # the op makes a contiguous copy and saves that
        else:
            key = f.root.get(i, i)
            size = f.size[key]  # a view keeps its whole base storage alive
        return _Keep(key, size, i in f.tp.sharded or key in f.tp.sharded, colwise, i in f.scores)

    if _math_attention(n, device_kind):
        return _math_attention_saves(n, f, kept_input)
    kept: list[_Keep] = []
    if f.autocast is not None and n.name in f.autocast.keeps_all:
        # OpPrecision's WithoutAutocast holds the op's (float32) inputs and its output until backward
        kept += [kept_input(i) for i in floats]
        kept.append(_Keep(n.name, out._replace(floating=True), in_region, quadratic=scores))
    for what in rule.saves_on(device_kind):
        if what == "inputs" or (what == "operands" and (len(floats) >= 2 or (floats and reads_param))):
            kept += [kept_input(i) for i in needed]
        elif what == "input":
            kept += [kept_input(i) for i in floats[:1]]
        elif what == "qkv":
            kept += [kept_input(i if k == 0 else _unrepeated(i, f)) for k, i in enumerate(acts[:3])]
        elif what == "output":
            kept.append(_Keep(n.name, out._replace(floating=True), in_region, quadratic=scores))
        elif what == "stats":
            # float32, but ATen's CPU norm kernels keep them 16-bit when input and weight are both 16-bit (a
            # registered op such as kernels_ext's fused RMSNorm computes its rstd in float32 whatever it reads)
            low = device_kind == "cpu" and n.op_class == "norm" and n.op.startswith("aten.") and \
                f.autocast is not None and n.name in f.autocast.all_low
            stats = _Size(rule.stats(n.in_shapes, n.out_shapes), 2 if low else 4, True)
            kept.append(_Keep(f"stats:{n.name}", stats, in_region, stat=True))
        elif what == "ids":
            kept += [_Keep(f.root.get(i, i), f.size[i]._replace(floating=False), False) for i in acts[:1]]
        elif what == "mask":
            kept.append(_Keep(f"mask:{n.name}", _Size(out.numel, 1, False), in_region, quadratic=scores))
        elif what == "temp":
            kept.append(_Keep(f"temp:{n.name}", out._replace(floating=True), in_region, quadratic=scores))
        elif what == "input_sized" and floats:
            to = cast_to(n.name, floats[0])
            size = f.size[floats[0]]._replace(itemsize=ITEMSIZE[to]) if to else f.size[floats[0]]
            kept.append(_Keep(f"temp:{n.name}", size, in_region))
        elif what == "bool_arg":
            mask = next((i for i in acts if not f.size[i].floating), None)
            if mask is not None:
                kept.append(_Keep(f"bool:{n.name}", _Size(f.size[mask].numel, 1, False), False))
    return kept


def _math_attention(n, device_kind: str) -> bool:
    """SDPA that runs PyTorch's math kernel: on CPU with dropout (the CPU flash kernel has no dropout). It saves
    scaled copies of q and k, v, and three score-sized tensors (softmax output, dropout noise, dropped weights),
    not its output, which it returns contiguous in (B, nh, T, hd)."""
    return device_kind == "cpu" and n.op_class == "attention" and bool(n.dropout_p)


def _math_attention_saves(n, f: _Facts, kept_input) -> list[_Keep]:
    """What :func:`_math_attention` keeps (measured with autograd's saved tensors, torch 2.13 CPU). With 16-bit
    inputs (autocast) the CPU math kernel computes in float32: q, k and v are converted first (v then saved as its
    float32 copy) and the score-sized tensors are float32. A non-contiguous v (heads transposed out of a projection's
    output) is copied when ``scores @ v`` folds its batch dims, and that copy is what it saves."""
    region = n.name in f.tp.sharded
    q, k, v = (n.inputs + [None] * 3)[:3]
    item = max(f.size[n.name].itemsize, 4)
    scores = _Size(_scores_numel(n), item, True)
    upcast = f.size[n.name].itemsize < item
    return [_Keep(f"q:{n.name}", f.size[q]._replace(itemsize=item), region),
            _Keep(f"k:{n.name}", f.size[k]._replace(itemsize=item), region),
            _Keep(f"v:{n.name}", f.size[v]._replace(itemsize=item), region) if upcast or f.noncontig.get(v, False)
            else kept_input(v),
            *(_Keep(f"{what}:{n.name}", scores, region, quadratic=True) for what in ("softmax", "noise", "dropped"))]


def _math_attention_transients(n, f: _Facts, device_kind: str) -> tuple[Saved, ...]:
    """What :func:`_math_attention` holds at its end beyond its operands, its output and what it saves, when it
    computes a 16-bit attention in float32 (measured with MemTracker in BERT's recomputed layer under bf16 autocast,
    torch 2.13 CPU; the peak of a fully recomputed BERT step): float32 copies of q, k and v and the scaled q, the
    16-bit copy of the dropped weights it makes, and its float32 output (its 16-bit q, k, v and output are among
    the storages alive, :func:`_forward_moment`). Empty when it computes in its inputs' dtype (not measured)."""
    if not _math_attention(n, device_kind) or f.size[n.name].itemsize >= 4 or len(n.inputs) < 3:
        return ()
    region = n.name in f.tp.sharded
    q, k, v = n.inputs[:3]
    upcast = [Saved(f.size[i].numel * 4, region) for i in (q, k, v, q)]
    dropped = Saved(_scores_numel(n) * f.size[n.name].itemsize, region, quadratic=True)
    return (*upcast, dropped, Saved(f.size[n.name].numel * 4, region))


def _scores_numel(n) -> int:
    """Elements of attention op ``n``'s score matrix: the query's leading dims and length times the keys' length."""
    (*lead, _), kshape = n.in_shapes[0], n.in_shapes[1]
    return _numel(lead) * kshape[-2]


def _math_attention_gradients(n, f: _Facts, device_kind: str) -> tuple[Saved, ...]:
    """The gradients :func:`_math_attention`'s backward holds at its peak, the backward of ``weights @ v`` (its
    first): the output's gradient, the weights' gradient (score-sized, in the kernel's compute dtype: float32 for
    16-bit inputs) and v's (compute dtype), and for 16-bit inputs the output gradient's float32 copy; q's and k's
    do not exist yet. Measured with a dispatch-mode census of SDPA's backward on CPU (B 4, 8 heads, T 256, head 32,
    bf16, dropout 0.1, torch 2.13): 8 MiB + 1 + 1 + 0.5 beside its saved tensors, where the generic rule
    (:func:`_gradients_of`: the output's and q's, k's, v's gradients) has 2 MiB and no score-sized one (BERT's
    pipelined stage under bf16 autocast peaks there, bench/memory.py). Empty for other ops."""
    if not _math_attention(n, device_kind) or len(n.inputs) < 3:
        return ()
    region, out = n.name in f.tp.sharded, f.size[n.name]
    item = max(out.itemsize, 4)
    grads = [Saved(out.nbytes, region), Saved(_scores_numel(n) * item, region, quadratic=True),
             Saved(f.size[n.inputs[2]].numel * item, region)]
    if out.itemsize < item:
        grads.append(Saved(out.numel * item, region))
    return tuple(grads)


def _unrepeated(name: str, f: _Facts) -> str:
    """Key/value heads that ``repeat_kv`` expanded (``x[:, :, None].expand(...).reshape(...)``) before attention:
    the tensor before the expansion, which is what attention saves when it runs on the key/value heads itself.
    Hugging Face passes them to SDPA with ``enable_gqa=True`` when there is no attention mask
    (``transformers/integrations/sdpa_attention.py``, ``use_gqa_in_sdpa``); the captured graph shows the expansion
    because ``torch.export`` materialises the causal mask."""
    cur, expanded = name, False
    while cur in f.by_name and f.by_name[cur].op_class == "view" and f.by_name[cur].inputs:
        n = f.by_name[cur]
        if packet(n.op) == "expand" and f.size[n.inputs[0]].numel < f.size[cur].numel:
            expanded = True
        cur = n.inputs[0]
    return cur if expanded else name


def _count_comms(layers: dict[str, LayerProfile], f: _Facts) -> None:
    """TP collectives: what the kernels_ext Split of each styled op says its style implies, one per distinct
    tensor (q/k/v, w1/w3 share their input). A head-indexed embedding keeps its output split (no collective); a
    projection with parts of different widths all-gathers its output in forward, and its rowwise partner, reading
    the whole (replicated) result, all-gathers that input's gradient in backward (DTensor's Replicate -> Shard(-1)
    and back; counted with CommDebugMode)."""
    done: set[tuple[str, str]] = set()
    gathered = {f.tp.region_of[k] for k, pp in f.tp.parts.items() if pp.gathered}
    for lp, n in _in_layers(layers, f):
        style = f.tp.styles.get(n.name)
        split = splits_of(n.op).get(style) if style else None
        pp = f.tp.parts.get(n.name)
        if split is None or (pp is not None and pp.table):
            continue
        size = f.size[n.name]
        if pp is not None and pp.gathered:
            lp.comms.append(Comm("all_gather", size.nbytes, size.numel * min(size.itemsize, 2), "fwd"))
        float_acts = [i for i in n.inputs if f.size[i].floating]
        if style == "rowwise" and f.tp.region_of.get(n.name) in gathered and float_acts and \
                float_acts[0] not in f.tp.sharded:
            whole = f.size[float_acts[0]]
            lp.comms.append(Comm("all_gather", whole.nbytes, whole.numel * min(whole.itemsize, 2), "bwd"))
        for phase, kind in (("fwd", split.forward), ("bwd", split.backward)):
            if not kind:
                continue
            if split.comm_on == "output":
                key, size = n.name, f.size[n.name]
            elif float_acts:
                key, size = f.root.get(float_acts[0], float_acts[0]), f.size[float_acts[0]]
            else:
                continue
            if (phase, key) not in done:
                done.add((phase, key))
                lp.comms.append(Comm(kind, size.nbytes, size.numel * min(size.itemsize, 2), phase))


def _count_boundaries(layers: dict[str, LayerProfile], f: _Facts, amp: dict[str, _Facts]) -> None:
    """Bytes entering each layer (each storage once) and leaving it (read by a later layer, or the model output),
    in the float32 forward and under each autocast precision."""
    for path, (inp, out, shared) in _boundary_bytes(layers, f).items():
        layers[path].input_bytes, layers[path].output_bytes = inp, out
        layers[path].shared_inputs["fp32"] = shared
    for precision, fa in amp.items():
        for path, (inp, out, shared) in _boundary_bytes(layers, fa).items():
            layers[path].input_amp[precision], layers[path].output_amp[precision] = inp, out
            layers[path].shared_inputs[precision] = shared


def _boundary_bytes(layers: dict[str, LayerProfile], f: _Facts
                    ) -> dict[str, tuple[float, float, dict[str, float]]]:
    """layer -> (bytes entering it, bytes leaving it, the entering storages other layers read too -> their bytes)
    at the dtypes of ``f``."""
    consumers: dict[str, list[str]] = defaultdict(list)
    for n in f.graph.nodes:
        for i in n.inputs:
            consumers[i].append(n.name)
    layer_of_node = {n.name: n.layer for n in f.graph.nodes}
    last = f.graph.nodes[-1] if f.graph.nodes else None
    entered: set[tuple[str, str]] = set()
    out = {path: [0.0, 0.0] for path in layers}
    for lp, n in _in_layers(layers, f):
        for i in n.inputs:
            key = f.root.get(i, i)
            if layer_of_node.get(i) != n.layer and (n.layer, key) not in entered:
                entered.add((n.layer, key))  # an input read by several ops is held once
                out[lp.path][0] += f.size[key].nbytes
        readers = consumers.get(n.name, [])
        if n.op_class == "view" and readers:
            continue
        elsewhere = [c for c in readers if layer_of_node.get(c) != n.layer]
        if n.out_shapes and n.dtype in FLOAT and (elsewhere or (n is last and not readers)):
            out[lp.path][1] += f.size[n.name].nbytes
    n_readers = Counter(key for _, key in entered)
    shared: dict[str, dict[str, float]] = defaultdict(dict)
    for layer, key in entered:
        if n_readers[key] > 1 and layer in out:
            shared[layer][key] = float(f.size[key].nbytes)
    return {k: (v[0], v[1], shared.get(k, {})) for k, v in out.items()}


def _count_crossings(f: _Facts, amp: dict[str, _Facts], first_saver: dict[str, str]) -> list[list[Crossing]]:
    """Per layer index k, the tensors a pipeline cut right before layer k sends, as ``runtime/pp.py``'s
    ``chain_stages`` passes them: every value made before k (or a model input) that an op at or after k reads,
    once each (a value read further on is passed through every stage between). A node outside every layer (code in
    a model's own forward between its modules) belongs to the layer before it, as a cut at the next layer's start
    leaves it. Only a layer's first call moves the position: T5's stacks call their dropout again after the final
    norm, and that second call runs where the graph has it, in the layer before."""
    index = {lay.path: i for i, lay in enumerate(f.graph.layers)}
    where: dict[str, int] = {name: -1 for name in f.size if name not in f.by_name}  # model inputs
    last_read: dict[str, int] = {}
    at, called = 0, set()
    for n in f.graph.nodes:
        if n.layer in index and n.layer not in called:
            called.add(n.layer)
            at = index[n.layer]
        where[n.name] = at
        for i in n.inputs:
            last_read[i] = max(last_read.get(i, -1), at)
    out: list[list[Crossing]] = [[] for _ in f.graph.layers]
    for name, last in last_read.items():
        made = where.get(name)
        if made is None or f.size.get(name) is None:
            continue
        saver = first_saver.get(f.root.get(name, name))
        crossing = Crossing({"fp32": float(f.size[name].nbytes),
                             **{p: float(fa.size[name].nbytes) for p, fa in amp.items()}},
                            name in f.grad, made, index.get(saver) if saver is not None else None)
        for k in range(max(made, 0) + 1, last + 1):
            out[k].append(crossing)
    return out


def _count_tp(layers: dict[str, LayerProfile], f: _Facts) -> set[str]:
    """Per layer: module TP styles, their parts, regions, what the TP degree must divide (split Linear dims, head
    counts, parts), the key/value projections it may repeat instead, vocabularies, vocab-parallel embedding
    parameters, norms outside TP regions. Returns the parameters TP splits."""
    split_params: set[str] = set()
    params = f.graph.params
    kv = _key_value_projections(f)
    for lp, n in _in_layers(layers, f):
        style = f.tp.styles.get(n.name)
        if style:
            lp.tp[n.module_path] = style
            lp.regions.add(f.tp.region_of.get(n.name, -1))
            for pname in n.params:
                pi = params.get(pname)
                if pi is not None and not pi.is_buffer and not (pname.endswith("bias") and style == "rowwise"):
                    split_params.add(pname)
            # the weight: the first 2-D parameter (addmm, Conv1D's op, reads its bias first)
            w = next((params[q] for q in n.params if q in params and len(params[q].shape) == 2),
                     params.get(n.params[0]) if n.params else None)
            is_embedding = n.op_class == "embedding"
            if w is not None and is_embedding and style == "rowwise" and w.trainable:
                lp.embedding_params += w.numel
            pp = f.tp.parts.get(n.name)
            if pp is not None:
                lp.parts[n.module_path] = pp
            if n.name in kv:  # tp divides its heads (split) or is a multiple of them (repeated): search.tp_blockers
                ps = [params[q] for q in n.params if q in params and not params[q].is_buffer and params[q].trainable]
                lp.repeatable[n.module_path] = Repeatable(pp.counts[0], n.flops, n.bwd_flops, sum(q.numel for q in ps),
                                                          sum(q.numel * q.itemsize for q in ps))
            elif w is not None and len(w.shape) == 2:
                if (is_embedding or n.name == f.tp.head) and not (pp is not None and pp.table):
                    lp.vocab.add(w.shape[0])
                elif not is_embedding:
                    out_dim = 1 if n.module_type == "Conv1D" else 0  # Conv1D stores its weight (in, out)
                    lp.divisors.add(w.shape[out_dim] if style == "colwise" else w.shape[1 - out_dim])
            if pp is not None and n.name not in kv:
                lp.divisors.update(pp.counts)
                if pp.heads:
                    lp.heads.update(pp.counts)
        norm_op = n.op_class == "norm" and "sequence_parallel" in splits_of(n.op)
        if (norm_op or _python_norm(n)) and n.name not in f.tp.sharded and n.module_path and n.params and \
                n.module_path not in lp.norms:
            lp.norms.append(n.module_path)
    owner = {m: lay.path for lay in f.graph.layers for m in lay.modules}
    for module, style in f.tp.holders.items():  # holds a shared weight without running: split with its users
        if owner.get(module) in layers:
            layers[owner[module]].tp[module] = style
    for lp, n in _in_layers(layers, f):
        hc = f.tp.heads.get(n.name)
        if hc:
            lp.heads.add(hc)
            lp.divisors.add(hc)
    return split_params


def _key_value_projections(f: _Facts) -> set[str]:
    """Colwise ``nn.Linear`` nodes split into fewer heads than the query projection of their region (GQA/MQA's key
    and value projections): TP may repeat them (their weight whole on every rank) when it exceeds their heads."""
    most: dict[int, int] = {}
    single = {k: pp.counts[0] for k, pp in f.tp.parts.items() if len(pp.counts) == 1 and pp.heads and not pp.table}
    for k, h in single.items():
        r = f.tp.region_of[k]
        most[r] = max(most.get(r, 0), h)
    return {k for k, h in single.items() if f.by_name[k].module_type == "Linear" and h < most[f.tp.region_of[k]] and
            most[f.tp.region_of[k]] % h == 0}


def _python_norm(n) -> bool:
    """A node of a norm module written in Python that reads its weight."""
    return bool(n.module_type) and n.module_type.endswith(NORM_MODULES) and n.op_class == "elementwise"


def _count_later_gradients(layers: dict[str, LayerProfile], f: _Facts, split_params: set[str]) -> None:
    """Each backward moment's :attr:`Moment.later`: the layer's own trainable parameters read by an op after the
    moment's op (a parameter's gradient exists from its last reader's backward on)."""
    graph = f.graph
    last: dict[str, dict[str, int]] = {path: {} for path in layers}  # layer -> its parameter -> its last reader
    for k, n in enumerate(graph.nodes):
        lp = layers.get(n.layer)
        for pname in n.params if lp is not None else ():
            pi = graph.params.get(pname)
            if pi is not None and not pi.is_buffer and pi.trainable and pname not in lp.borrowed:
                last[lp.path][pname] = k
    for path, lp in layers.items():
        readers = sorted((k, pname) for pname, k in last[path].items())
        for precision, moments in lp.moments.items():
            lp.moments[precision] = [m._replace(later=_numel_after(m.op, readers, graph, split_params))
                                     for m in moments]


def _numel_after(op: int, readers: list[tuple[int, str]], graph, split_params: set[str]) -> tuple[int, int]:
    split = rep = 0
    for k, pname in readers:
        if k > op:
            n = graph.params[pname].numel
            split, rep = (split + n, rep) if pname in split_params else (split, rep + n)
    return split, rep


def _count_params(layers: dict[str, LayerProfile], f: _Facts, *, split_params: set[str], cast: set[str]) -> None:
    """Trainable parameters per layer, split by TP or replicated; the largest one; their item size; those autocast
    keeps a 16-bit copy of (``cast``)."""
    graph = f.graph
    owner = {m: lay.path for lay in graph.layers for m in lay.modules}
    layer_paths = [lay.path for lay in graph.layers]
    for pname, pi in graph.params.items():
        if pi.is_buffer or not pi.trainable:
            continue
        path = owner[pi.module_path] if pi.module_path in owner else layer_of(pi.module_path, layer_paths)
        lp = layers.get(path)
        if lp is None:
            continue
        lp.param_itemsize = pi.itemsize
        lp.largest_param = max(lp.largest_param, pi.numel)
        if pname in split_params:
            lp.params_split += pi.numel
            lp.cast_split += pi.numel if pname in cast else 0
        else:
            lp.params_rep += pi.numel
            lp.cast_rep += pi.numel if pname in cast else 0
    for lp, n in _in_layers(layers, f):
        for pname in n.params:
            pi = graph.params.get(pname)
            if pi is None or pi.is_buffer or not pi.trainable:
                continue
            path = owner[pi.module_path] if pi.module_path in owner else layer_of(pi.module_path, layer_paths)
            if path != lp.path and path in layer_paths:
                lp.borrowed[pname] = (pi.numel, pname in split_params, layer_paths.index(path))


GROUPED_MATMULS = frozenset(r.name for r in moe_rules.GROUPED_MATMULS if r.backward_factor)
"""forward grouped matmuls over stacked expert weights (``kernels_ext.moe_rules``; their backward ops excluded)"""


def _count_keys_values(layers: dict[str, LayerProfile], f: _Facts) -> None:
    """Bytes of the keys and values every attention op reads (SDPA's second and third inputs)."""
    for lp, n in _in_layers(layers, f):
        if n.op_class == "attention" and len(n.in_shapes) >= 3:
            numel = _numel(n.in_shapes[1]) + _numel(n.in_shapes[2])
            lp.kv_bytes += numel * f.size[n.name].itemsize
            lp.kv_half += numel * 2


def cp_blocker(graph) -> str:
    """Why context parallelism (``runtime/cp.py``: torch's ring attention over SDPA, each rank holding a
    load-balanced part of every sequence) cannot run this model; "" when it can: one (batch, seq) input of token
    ids, attention only through ``scaled_dot_product_attention`` without a mask, and no position computed with
    ``torch.arange`` inside forward (it would number the rank's part, not the sequence)."""
    if graph.seq_len is None or len(graph.inputs) != 1 or len(graph.inputs[0].shape) != 2 or \
            graph.inputs[0].dtype in FLOAT:
        return "the model does not take one (batch, seq) tensor of token ids"
    attention = [n for n in graph.nodes if n.op_class == "attention"]
    if not attention or any("scaled_dot_product" not in n.op for n in attention):
        return "its attention is not torch's scaled_dot_product_attention (which the ring replaces)"
    masked = next((n for n in attention if len(n.inputs) > 3), None)
    if masked is not None:
        return f"the attention of {masked.module_path or 'the model'} takes a mask (ring attention takes none)"
    arange = next((n for n in graph.nodes if n.op.startswith("aten.arange")), None)
    if arange is not None:
        return (f"{arange.module_path or 'the model'} computes positions with torch.arange inside forward (each rank "
                "would number its own part of the sequence)")
    return ""


def _count_experts(layers: dict[str, LayerProfile], f: _Facts) -> None:
    """Experts modules: a module whose own trainable parameters are all stacked per expert (>= 3 dims, the same
    first dim E >= 2) and which runs a grouped matmul. Per layer: module -> E, their parameters, and the token rows
    the first grouped matmul of each receives ((token x choice) x hidden: what expert parallelism sends away)."""
    owned: dict[str, list] = defaultdict(list)
    for pi in f.graph.params.values():
        if not pi.is_buffer and pi.trainable:
            owned[pi.module_path].append(pi)
    first: dict[str, Any] = {}
    for n in f.graph.nodes:
        if n.op.rpartition(".")[0] in GROUPED_MATMULS and n.module_path not in first and n.in_shapes:
            first[n.module_path] = n
    for path, n in first.items():
        lp, ps = layers.get(n.layer), owned.get(path, [])
        heads = {p.shape[0] for p in ps if len(p.shape) >= 3}
        if lp is None or not ps or len(heads) != 1 or any(len(p.shape) < 3 for p in ps) or min(heads) < 2:
            continue
        rows, item = _numel(n.in_shapes[0]), ITEMSIZE.get(n.dtype, 4)
        lp.experts[path] = heads.pop()
        lp.params_experts += sum(p.numel for p in ps)
        lp.dispatch_bytes += rows * item
        lp.dispatch_half += rows * min(item, 2)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
