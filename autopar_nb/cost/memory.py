"""Per-rank memory: model states by ZeRO stage, TP and PP; activations from what autograd saves;
micro-batches in flight by pipeline schedule; FSDP/TP/PP buffers; the allocator margin.

Units: bytes. Sources: ZeRO (Rajbhandari et al. 2020, sec. 3-5) for model states, Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models") for activations under
TP/SP/recompute, Narayanan et al. 2021 (Megatron-LM PTD-P) for in-flight micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .profile import LayerProfile, Saved
from .schedule import MULTI_STAGE, rank_states


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state (the ZeRO paper's 2 + 2 + K accounting)."""

    param: float
    """the parameters the module holds"""
    grad: float
    """gradients"""
    optimizer: float
    """optimizer states (K in the ZeRO paper), including any fp32 master copy"""


MIXED_ADAM = StateBytes(2, 2, 12)
"""Megatron/DeepSpeed mixed precision: fp16 params and grads, fp32 master params + Adam m, v (ZeRO
paper, K=12)"""
TORCH_ADAM = StateBytes(4, 4, 8)
"""PyTorch training (also under autocast / FSDP2 MixedPrecisionPolicy): fp32 params and grads, Adam
m, v in fp32; 16-bit copies of parameters are transient buffers (FSDP all-gather), not states"""
TORCH_SGD = StateBytes(4, 4, 4)
"""PyTorch SGD with momentum: one fp32 buffer per parameter"""


def state_bytes(optimizer: str, layout: str = "torch") -> StateBytes:
    """The per-parameter accounting: ``layout`` "torch" (what the runtime builds) or "mixed_adam"
    (ZeRO paper)."""
    if layout == "mixed_adam":
        return MIXED_ADAM
    return TORCH_SGD if optimizer == "sgd" else TORCH_ADAM


def model_states(num_params: float, *, dp: int, zero_stage: int, states: StateBytes = MIXED_ADAM
                 ) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes on one rank for ``num_params`` parameters held by its (TP x
    PP) slice.

    ZeRO paper sec. 5: baseline (2 + 2 + K)Psi; P_os 2Psi + 2Psi + K Psi/Nd; P_os+g 2Psi + (2 +
    K)Psi/Nd; P_os+g+p (2 + 2 + K)Psi/Nd.
    """
    p = num_params * states.param
    g = num_params * states.grad
    o = num_params * states.optimizer
    if zero_stage >= 1:
        o /= dp
    if zero_stage >= 2:
        g /= dp
    if zero_stage >= 3:
        p /= dp
    return p, g, o


def activation_bytes(lp: LayerProfile, *, tp: int, sp: bool, recompute: str, scale: float,
                     precision: str = "fp32", quad_scale: float | None = None,
                     megatron_sp: bool = False) -> float:
    """Bytes one micro-batch leaves saved for backward in this layer (Korthikanti et al. 2022, sec.
    4), at the dtypes ``precision`` gives them (:data:`~.profile.PRECISIONS`: under autocast each
    op's saved tensors at the dtype autocast runs it in, and the 16-bit copies it makes of its
    inputs; :mod:`.autocast`).

    ``scale`` = samples per micro-batch / captured samples (times the sequence ratio);
    ``quad_scale`` scales the attention-score terms (sequence ratio squared), default ``scale``.
    Inside TP regions saved tensors divide by ``tp``; outside, only with sequence parallel. With SP,
    PyTorch's DTensor saves the all-gathered input of each colwise Linear (full size); Megatron-LM
    saves the shard and gathers again in backward (``megatron_sp``). ``recompute``: "full" keeps
    only the layer's input (sequence-sharded under SP); "selective" keeps the input and the outputs
    of its matmuls and attention kernels (``runtime/ac.py``'s policy; ``LayerProfile.selective``),
    not Korthikanti's attention-score drop: with fused attention kernels nothing score-sized is
    saved anyway.
    """
    qs = scale if quad_scale is None else quad_scale
    inputs = ((lp.input_bytes if precision == "fp32"
               else lp.input_amp[precision]) * scale / (tp if sp else 1))
    if recompute == "full":
        return inputs
    total = inputs if recompute == "selective" else 0.0
    for s in lp.selective[precision] if recompute == "selective" else lp.saved_at(precision):
        total += on_rank(s, tp=tp, sp=sp, scale=scale, quad_scale=qs, megatron_sp=megatron_sp)
    return total


def on_rank(s: Saved, *, tp: int, sp: bool, scale: float, quad_scale: float,
            megatron_sp: bool = False) -> float:
    """Bytes of one saved tensor (or gradient) on one rank (:func:`activation_bytes`'s rules)."""
    if s.sp_only and not sp:
        return 0.0
    b = s.nbytes * (quad_scale if s.quadratic else scale)
    if s.region or (sp and (megatron_sp or not s.gathered)):
        b /= tp
    return b


def backward_peak(lp: LayerProfile, *, tp: int, sp: bool, scale: float, precision: str = "fp32",
                  quad_scale: float | None = None, megatron_sp: bool = False, grad_item: int = 4
                  ) -> tuple[float, float, float]:
    """(gradient bytes, saved bytes already freed, the layer's local parameters (numel) whose
    gradients exist) at the moment of this layer's backward that holds the most beside its saved
    tensors (:func:`op_moments`, weighed by :func:`peak_op`). Measured with the tracker: LLaMA's
    peak is the silu x up product's backward (its output, saved only by the down projection, freed;
    the down projection's weight gradient made), under TP with sequence parallelism the down
    projection's (its output's gradient all-gathered to full size)."""
    return peak_op(
        op_moments(lp, tp=tp, sp=sp, scale=scale, precision=precision, quad_scale=quad_scale,
                   megatron_sp=megatron_sp), grad_item=grad_item)


def peak_op(moments: list[tuple[int, float, float, float]], *,
            grad_item: int = 4) -> tuple[float, float, float]:
    """Of a layer's per-op backward moments (:func:`op_moments`), the (work, freed, later) of the
    one that holds the most: its gradients, less what the ops after it alone saved (freed by then),
    plus the gradients, ``grad_item`` bytes each, of the parameters the ops after it read; zeros for
    a layer without ops."""
    best, top = (0.0, 0.0, 0.0), 0.0
    for _, work, freed, later in moments:
        if work - freed + later * grad_item > top:
            best, top = (work, freed, later), work - freed + later * grad_item
    return best


OpDelta = tuple[int | None, float, float, float, float]
"""one op of a layer's backward beside its peak op (:attr:`.terms.LayerTerms.op_deltas`): (graph
index, working set, saved bytes alive and parameters (numel) without a gradient yet, each less the
peak op's, and the parameters (numel) whose gradients its backward makes)"""


def op_deltas(moments: list[tuple[int, float, float, float]], peak: tuple[float, float, float],
              params: float) -> tuple[OpDelta, ...]:
    """Each of a layer's per-op backward moments (:func:`op_moments`, in graph order) less its
    ``peak`` (:func:`peak_op`), with the parameters (numel, of the layer's ``params``) whose
    gradients its backward makes: those the ops after the one before it read and the ops after it do
    not (their last reader is the op, or a view of them it reads, such as a Linear weight's
    transpose); the first op's, all the others'."""
    work, freed, later = peak
    out, before = [], params
    for op, w, f, lat in moments:
        out.append((op, w - work, freed - f, later - lat, max(before - lat, 0.0)))
        before = lat
    return tuple(out)


def accumulating_op(ops: tuple[OpDelta, ...], grad_item: float) -> OpDelta:
    """Of a layer's :func:`op_deltas`, the op whose backward holds the most where every parameter's
    gradient exists already (a micro-batch's after the first accumulates into them): its working set
    and saved bytes alive, and the gradients its backward makes, ``grad_item`` bytes each, which
    exist beside the accumulated ones until autograd adds them in place
    (torch/csrc/autograd/functions/accumulate_grad.h, ``accumulateGrad``: ``variable_grad +=
    new_grad`` where a gradient exists and grad mode is off; where none exists it takes the new one
    over, so a first backward makes none beside). As a moment's op: None. Measured with MemTracker
    (a GPT of hidden 128 over 2 pipeline ranks, 4 micro-batches, fp32: 1F1B, interleaved 1F1B,
    looped BFS): a block's later backward peaks at its MLP output projection's (every saved tensor
    of the block alive, that projection's weight gradient made beside the accumulated one) where its
    first peaks at its first LayerNorm's (the saved tensors freed, every other gradient made). Zeros
    for a layer without ops."""
    best, top = (None, 0.0, 0.0, 0.0, 0.0), 0.0
    for _, dw, da, dlater, made in ops:
        if dw + da + made * grad_item > top:
            best, top = (None, dw, da, dlater, made), dw + da + made * grad_item
    return best


def op_moments(lp: LayerProfile, *, tp: int, sp: bool, scale: float, precision: str = "fp32",
               quad_scale: float | None = None,
               megatron_sp: bool = False) -> list[tuple[int, float, float, float]]:
    """Per op of the layer whose backward runs (:attr:`.profile.LayerProfile.moments`): (its index
    in the graph, the gradient bytes its backward holds at once, the layer's saved bytes freed by
    then — those only the ops after it saved —, the local numel of the layer's parameters whose
    gradients exist then — those the ops after it read)."""
    qs = scale if quad_scale is None else quad_scale

    def b(x) -> float:
        return on_rank(x, tp=tp, sp=sp, scale=scale, quad_scale=qs, megatron_sp=megatron_sp)

    saved = lp.saved_at(precision)
    freed = [0.0] * (len(saved) + 1)  # freed[k]: bytes of saved[k:]
    for k in range(len(saved) - 1, -1, -1):
        freed[k] = freed[k + 1] + b(saved[k])
    return [(m.op, sum(map(b, m.work)), freed[m.kept], m.later[0] / tp + m.later[1])
            for m in lp.moments.get(precision, ())]


def input_pass(lp: LayerProfile, *, tp: int, sp: bool, scale: float, precision: str = "fp32",
               quad_scale: float | None = None, megatron_sp: bool = False
               ) -> tuple[float, float, tuple[tuple[int, float], ...]]:
    """A zero-bubble schedule's input-gradient pass through the layer (torch's
    ``stage_backward_input``: ``autograd.grad`` to the stage's inputs with ``retain_graph=True``,
    each op's incoming gradient kept where a parameter's path meets the input's,
    :attr:`.profile.LayerProfile.weight_pass`): (the bytes it keeps for the weight pass, the most
    its backward holds at one op beside the saved tensors — that op's gradients and the kept ones
    of the ops after it, nothing freed —, and per op (graph index, that sum less the most))."""
    qs = scale if quad_scale is None else quad_scale

    def b(x: Saved) -> float:
        return on_rank(x, tp=tp, sp=sp, scale=scale, quad_scale=qs, megatron_sp=megatron_sp)

    kept = [(k, b(g)) for k, g in lp.weight_pass.get(precision, ())]
    moments = [(m.op, sum(map(b, m.work)) + sum(x for k, x in kept if k > m.op))
               for m in lp.moments.get(precision, ())]
    top = max((x for _, x in moments), default=0.0)
    return sum(x for _, x in kept), top, tuple((op, x - top) for op, x in moments)


def forward_peak(lp: LayerProfile, *, tp: int, sp: bool, scale: float, precision: str = "fp32",
                 quad_scale: float | None = None, megatron_sp: bool = False,
                 recompute: str = "none") -> float:
    """Bytes the layer holds at its forward's largest moment
    (:attr:`.profile.LayerProfile.forward`), or, with ``recompute`` "full" or "selective", its
    recompute's, beyond what the recompute keeps from the forward: the layer's saved tensors up to
    that op (re-made by a recompute), and the other storages alive then (its output, the operands
    still to be read, autocast's copies, a math attention's transients, what a module's caller
    holds, :attr:`.profile.Moment.held`), less (selective recompute) the kept outputs of that op and
    the ones before it, which the recompute took from its cache. Measured with MemTracker: ViT's
    forward peak under ZeRO 2 and bf16 autocast; BERT's peak under bf16 autocast and either
    recompute is the end of its recomputed math attention, not a backward op."""
    qs = scale if quad_scale is None else quad_scale

    def b(s: Saved) -> float:
        return on_rank(s, tp=tp, sp=sp, scale=scale, quad_scale=qs, megatron_sp=megatron_sp)

    saved, cached = (lp.saved_at(precision),
                     lp.selective.get(precision, ()) if recompute == "selective" else ())
    upto = [0.0]  # upto[k]: bytes of saved[:k]
    for x in saved:
        upto.append(upto[-1] + b(x))
    dropped = [0.0]
    for x in cached:
        dropped.append(dropped[-1] + b(x))
    moments = lp.forward.get(precision, ())
    if recompute != "none":
        # torch's non-reentrant checkpoint stops its recompute once the last tensor it saves is
        # re-made (early stop): the ops after the layer's last saver do not run again
        last = next((k for k, m in enumerate(moments) if m.kept >= len(saved)), len(moments) - 1)
        moments = moments[:last + 1]
    best = 0.0
    for m in moments:
        held = sum(map(b, m.held))
        # a recompute's checkpoint keeps the layer's inputs already (activation_bytes counts them)
        entered = (0.0 if recompute == "none" else sum(map(b, m.entered))
                   + sum(map(b, m.entered_held)))
        best = max(best, upto[m.kept] + sum(map(b, m.work))
                   + held - entered - dropped[min(m.selective, len(cached))])
    return best


SENDS_HELD = ("gpipe", "1f1b")
"""schedules whose torch implementation (one stage per rank, ``PipelineScheduleSingle``) keeps a
micro-batch's input-gradient sends referenced until after the next micro-batch's backward (1F1B: the
``bwd_sends`` it fuses with the next receive, torch 2.13; GPipe: every send's work until the end).
Under the multi-stage schedules (``_PipelineScheduleRuntime``, which would keep every send, outputs
and input gradients, until the step ends) the runtime's stages issue their sends and let each go
once its peer has received it (``runtime/pp.py`` ``Sends``): an output at its micro-batch's
backward, an input gradient at a lower stage's of the rank, the rank's lowest stage's at the step's
end (:mod:`.staged`)"""


def in_flight(schedule: str, *, pp: int, stage: int, micro_batches: int,
              virtual_stages: int = 1) -> float:
    """Micro-batches whose activations one pipeline rank holds at its peak (in units of all its
    layers).

    GPipe: every micro-batch; 1F1B: pp - stage (Narayanan et al. 2021); a multi-stage
    schedule, at its backward holding the most, each micro-batch a stage holds as 1/v of the
    rank's layers (:func:`.schedule.rank_states`, torch's order: interleaved 1F1B's warm-up of
    (v - 1) pp + 2 (pp - 1 - stage) chunk-forwards, plus one; ZBV's pp on every rank, its input
    passes holding a micro-batch's activations until its weight pass).
    """
    m = micro_batches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in MULTI_STAGE and (virtual_stages > 1 or schedule == "zbv_zero_bubble"):
        v = 2 if schedule == "zbv_zero_bubble" else virtual_stages
        return _most_held(schedule, pp, stage, m, v)
    return float(min(m, pp - stage))


@lru_cache(maxsize=4096)
def _most_held(schedule: str, pp: int, stage: int, m: int, v: int) -> float:
    """:func:`in_flight` of a multi-stage schedule, made once (as :func:`.schedule.rank_states` is):
    the search asks it of every rank of each candidate it costs, floors or bounds, and it reads
    all of the rank's states."""
    states = rank_states(schedule, pp=pp, rank=stage, micro_batches=m, virtual_stages=v)
    return max((sum(h.full) + sum(h.waiting) + 1) / v for h in states if h.kind in "BIW")


def with_margin(subtotal: float, factors, *, full_recompute: float = 0.0) -> float:
    """Allocator margin: a fraction of the predicted bytes (the caching allocator's reserve beyond
    its tensors' peak: fragmentation) plus fixed workspaces. The fraction moves from
    ``margin_fraction`` to ``margin_full_recompute`` with the share of the rank's layers under full
    recompute, whose backward re-allocates each layer's forward beside its gradients and fragments
    the cache."""
    fraction = (factors.margin_fraction
                + full_recompute * (factors.margin_full_recompute - factors.margin_fraction))
    return subtotal * fraction + factors.margin_fixed_bytes
