"""One pass over a candidate's chain of layers (runs of identical layers at once): the per
pipeline rank :class:`~.terms.RankSums` that step time (:meth:`.estimate.Evaluator.evaluate`),
peak memory (:mod:`.peak`) and the planner's bounds read."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..plan import DTYPE_NAMES, ITEMSIZE
from .comm import collective_time, link_for
from .loss import gathered_logits
from .peak import moment_layers
from .pipeline import pipeline_sums
from .saved import run_saved
from .schedule import MULTI_STAGE, ZERO_BUBBLE
from .setting import LayerChoice, Setting
from .terms import FsdpUnit, InputLayer, LayerTerms, RankSums, StageSums

EARLY = ("fwdbwd", "rec", "tpc")
"""the per rank sums a run adds to before its memory is counted (the fused head's come after)"""
LATE = ("layers", "full_recompute", "tp_step", "casts", "f8_weights", "tensors", "whole_grads",
        "cpu_ops", "cpu_tp", "nofsdp")
"""those it adds to after; its late row ends with its model and hardware FLOPs (the chain's)"""


def sum_layers(ev, s: Setting, choices: list[LayerChoice]) -> RankSums:
    """One pass over the layer chain of evaluator ``ev`` (runs of identical layers at once): per
    pipeline rank sums."""
    pp = s.pp
    sums, rows = RankSums.zeros(pp), RunRows()
    # the shared inputs a rank's checkpoints keep already
    kept: list[set[str]] = [set() for _ in range(pp)]
    tied = tied_gradients(ev, s, choices)
    for i, cnt, ch in ev.runs(choices):
        r = s.rank_of(ch.stage)
        lt = ev.choice_terms(i, s, ch)
        early, late = run_rows(ev, lt, ch)
        rows.early.append((r, cnt, early))  # time
        if lt.tp_comm:
            kinds = sums.tp_kind[r]
            for kk, v in lt.tp_comm.items():
                kinds[kk] = kinds.get(kk, 0.0) + cnt * v
        head = _run_memory(ev, s, sums, rows, r, i, cnt, ch, lt, kept[r], tied, len(choices))
        rows.late.append((r, cnt, late))
        _run_totals(ev, sums, r, i, cnt, ch, lt)
        sums.head_tp = sums.head_tp or bool(head)  # the head (last run) split by TP
        if pp > 1 and s.schedule in MULTI_STAGE:
            _stage_sums(s, sums, r, i, cnt, ch.stage, lt)
    rows.add_to(sums)
    if pp > 1:
        pipeline_sums(ev, s, choices, sums)
    return sums


class RunRows:
    """The runs' terms that no later run reads, as rows in the order the loop meets them (rank,
    count, per-layer values: :data:`EARLY`, :data:`LATE`), summed at the end as arrays.
    ``np.add.at`` adds one row after another, unbuffered, as ``+=`` run by run would: each sum is
    the same float."""

    def __init__(self):
        self.early: list[tuple[int, int, tuple]] = []
        self.late: list[tuple[int, int, tuple]] = []

    def add_to(self, sums: RankSums) -> None:
        """Each name's per rank sums into ``sums`` (where they were zeros), and the chain's
        FLOPs."""
        pp = len(sums.fwdbwd)
        self._per_rank(sums, self.early, EARLY, pp)
        late = self._per_rank(sums, self.late, LATE, pp)
        chain = np.zeros((1, 2))
        np.add.at(chain, np.zeros(len(late), dtype=int), late[:, len(LATE):])
        sums.model_flops, sums.hw_flops = chain[0].tolist()

    @staticmethod
    def _per_rank(sums: RankSums, rows: list, names: tuple[str, ...], pp: int) -> np.ndarray:
        ranks, counts, values = zip(*rows, strict=True)
        added = np.array(values) * np.array(counts, dtype=float)[:, None]
        per_rank = np.zeros((pp, len(names)))
        np.add.at(per_rank, np.array(ranks), added[:, :len(names)])
        for k, name in enumerate(names):
            setattr(sums, name, per_rank[:, k].tolist())
        return added


def run_rows(ev, lt: LayerTerms, ch: LayerChoice) -> tuple[tuple, tuple]:
    """A layer's values in :class:`RunRows` under the choice ``ch``, made once per evaluator for
    each terms (which the evaluator keeps, so their ids stay theirs) and choice."""
    cache = ev.__dict__.setdefault("_run_rows", {})
    key = id(lt), ch.recompute, ch.fsdp
    hit = cache.get(key)
    if hit is None:
        rec = ch.recompute
        early = lt.fwd + lt.bwd, lt.recompute_s(rec), lt.tp_exposed if lt.tp_comm else 0.0
        late = (1.0, 1.0 if rec == "full" else 0.0, lt.tp_step, lt.cast_local,
                lt.f8_weights_local, float(lt.tensors), lt.whole_grads,
                lt.cpu_s("eager ops", rec), lt.cpu_s("tensor parallel", rec),
                0.0 if ch.fsdp else lt.params_local,
                lt.model_flops, lt.flops + lt.recompute_flops(rec))
        hit = cache[key] = early, late
    return hit


def _run_memory(ev, s: Setting, sums: RankSums, rows: RunRows, r: int, i: int, cnt: int,
                ch: LayerChoice, lt: LayerTerms, kept: set[str], tied: dict[int, float],
                n_layers: int):
    """The run's saved activations and largest working set on rank ``r``, and its moments (each
    layer's backward, recompute, and the run's forward) in ``sums.bwd_layers``; returns whether
    it is the head split by TP (truthy)."""
    acts_before = sums.acts[r]
    saved, whole, held = run_saved(ev, s, i, cnt, ch, lt, kept)
    sums.acts[r] += saved
    # a recomputed layer's backward first runs its forward again: what the plain forward
    # saves and the recompute did not keep is alive again beside the working set
    again = max(lt.act["none"] - lt.act[ch.recompute], 0.0)
    # each op's moment holds the gradients accumulating for what later ops read (profile's
    # _accumulating_gradients): the residual stream's, whose skip the block's last add reads
    wb, freed, ops = lt.work_bytes + again, lt.freed, lt.op_deltas
    if s.fused_loss and i <= ev.head.layer < i + cnt:
        wb, again, freed, ops = fused_head(ev, s, sums, rows, r, ch.recompute, lt,
                                           tp=s.tp if ch.tp else 1), 0.0, 0.0, ()
    if wb > sums.work[r]:
        sums.work[r] = wb
    # the fused LSE
    head_saved = sums.acts[r] - acts_before - whole - cnt * lt.act[ch.recompute] + held[-1]
    moments = sums.bwd_layers[r]
    # a layer's peak is its largest op's backward: the output that op's consumers saved is
    # freed by then (memory.peak_op), the layer's own gradients are still to come. Its last
    # layer runs backward first; by its first, the gradients of the others exist (the peak
    # there when a layer's gradients outweigh what it saves: full recompute, measured on
    # LLaMA)
    for j in moment_layers(cnt):
        saved_j = acts_before + whole + (j + 1) * lt.act[ch.recompute] - held[j] + head_saved
        moments.append((saved_j + again - freed, wb - again + tied.get(i + j, 0.0),
                        sums.params[r] + (j + 1) * lt.params_local - lt.later_params, i + j,
                        "backward", ops))
        replayed = max(lt.forward[ch.recompute], again) if ch.recompute != "none" else 0.0
        if replayed:
            # its recompute, before its backward, beside the gradient of its output: at its
            # end, every tensor it saves again re-made, or where an op's forward holds more
            # (lt.forward), what it has recomputed by then (measured: BERT's math attention
            # under bf16 autocast)
            moments.append((saved_j + replayed, lt.out_bytes + tied.get(i + j, 0.0),
                            sums.params[r] + (j + 1) * lt.params_local, i + j, "recompute", ()))
    prof = ev.prof
    head = (ch.tp and s.tp > 1 and prof.layers[i].vocab and not prof.layers[i].norms
            and i == n_layers - cnt)
    if ch.recompute == "none" and not head_saved:
        # the run's last layer's forward: every earlier layer's saved tensors, and its own
        # forward's largest moment (the storages alive then; no gradient exists yet in a
        # step's first forward)
        gather = gathered_logits(s, prof, ev.seq_ratio) if head else 0.0
        moments.append((acts_before + whole + (cnt - 1) * lt.act["none"],
                        lt.forward["none"] + gather, 0.0, i + cnt - 1, "forward", ()))
    return head


def _run_totals(ev, sums: RankSums, r: int, i: int, cnt: int, ch: LayerChoice,
                lt: LayerTerms) -> None:
    """The run's parameters, expert parameters and FSDP units added to rank ``r``'s sums (later
    runs read them: not in :class:`RunRows`)."""
    if lt.experts_local:
        sums.experts_upto[r].update({i + j: sums.experts[r] + (j + 1) * lt.experts_local
                                     for j in range(cnt)})
    else:
        sums.experts_upto[r].update(dict.fromkeys(range(i, i + cnt), sums.experts[r]))
    sums.experts[r] += cnt * lt.experts_local
    sums.add_copies(r, i, cnt, lt, ch.recompute)
    sums.params[r] += cnt * lt.params_local
    sums.largest[r] = max(sums.largest[r], lt.largest_param)
    if ch.fsdp:
        add_units(ev, sums.units[r], i, cnt, lt.params_local)


def _stage_sums(s: Setting, sums: RankSums, r: int, i: int, cnt: int, stage: int,
                lt: LayerTerms) -> None:
    """After the run of layers ``i`` .. ``i + cnt - 1`` on rank ``r`` is summed: its stage's
    :class:`.terms.StageSums` (a rank of a multi-stage schedule holds its stages' micro-batches
    apart: :mod:`.schedule`) and, under a zero-bubble schedule, the run's input-pass moments."""
    held = sums.stages[r]
    if not held or held[-1].stage != stage:
        last = held[-1] if held else StageSums(-1, 0.0, 0.0)
        held.append(StageSums(stage, last.acts_start + last.acts,
                              last.params_start + last.params))
    st = held[-1]
    for j in range(cnt):
        sums.local[i + j] = len(held) - 1
    if s.schedule in ZERO_BUBBLE:
        for j in moment_layers(cnt):
            sums.input_layers[r].append(InputLayer(i + j, lt.input_work, lt.input_ops,
                                                   st.weight_grads + (j + 1) * lt.weight_grads))
    st.weight_grads, st.whole_grads = (st.weight_grads + cnt * lt.weight_grads,
                                       st.whole_grads + cnt * lt.whole_grads)
    st.acts, st.params = sums.acts[r] - st.acts_start, sums.params[r] - st.params_start


def add_units(ev, units: list[FsdpUnit], i: int, cnt: int, numel: float) -> None:
    """Append layers ``i`` .. ``i + cnt - 1`` (``numel`` local parameters each) to ``units`` as
    the runtime groups them (``export.patterns.fsdp_units``): each layer with parameters its own
    unit, except the last layer joining a final norm just before it (torchtitan's ``[norm,
    output]``)."""
    if not numel:
        return
    layers = ev.prof.layers
    tail = len(layers) - 2
    if (i == tail + 1 and units and units[-1].first == tail
            and layers[tail].path in layers[tail].norms):
        units[-1] = FsdpUnit(tail, i, units[-1].numel + numel)
        return
    units += [FsdpUnit(i + j, i + j, numel) for j in range(cnt)]


def tied_gradients(ev, s: Setting, choices: list[LayerChoice]) -> dict[int, float]:
    """Per layer, the bytes of tied parameters' gradients pending during its backward: a
    parameter two layers of a rank read (a head tied to the embeddings, T5's decoder embedding)
    gets its later reader's gradient first, which autograd holds, to add the earlier reader's
    to, from the later layer's backward to the earlier one's (the tracker's census: BERT's
    decoder weight gradient, a float32 temporary through the whole encoder backward). The
    parameter's dtype: float32, or FSDP's 16-bit unsharded parameter (ZeRO 1-3)."""
    item = s.compute_item if s.zero_stage >= 1 else ITEMSIZE["float32"]
    # (parameter, rank) -> its layers there
    readers: dict[tuple[str, int], list[int]] = defaultdict(list)
    sizes: dict[str, tuple[int, bool]] = {}
    for i, lp in enumerate(ev.prof.layers):
        for name, (numel, split, owner) in lp.borrowed.items():
            readers[name, s.rank_of(choices[owner].stage)].append(owner)
            readers[name, s.rank_of(choices[i].stage)].append(i)
            sizes[name] = numel, split
    out: dict[int, float] = defaultdict(float)
    for (name, rank), layers in readers.items():
        numel, split = sizes[name]
        first, last = min(layers), max(layers)
        for i in range(first, last):
            if s.rank_of(choices[i].stage) == rank:
                out[i] += numel / (s.tp if split and choices[last].tp else 1) * item
    return out


def fused_head(ev, s: Setting, sums: RankSums, rows: RunRows, r: int, recompute: str,
               lt: LayerTerms, *, tp: int = 1) -> float:
    """The fused head + loss on rank ``r`` (:mod:`.loss`): adds the log-sum-exp it saves to
    ``sums``, the logits' recompute (time and hardware FLOPs) to ``rows``; returns the head layer's
    backward working set, the fused op's temporaries in place of the logits' gradient. Split on the
    vocabulary over ``tp`` ranks, a rank computes its rows' logits (FLOPs and chunk buffers /
    tp) and the forward's all-reduces of the log-sum-exp terms
    (:meth:`.loss.FusedHead.tp_forward_bytes`) are added; the hidden states' gradient is
    all-reduced as the colwise head's input gradient is (counted with the layer's TP
    collectives)."""
    half = s.amp != "none"
    head = ev.head
    tokens = head.tokens * s.mb_samples / ev.prof.batch * ev.seq_ratio
    flops = head.recompute_flops(tokens) / tp
    rec = flops / (ev.cluster.device.flops(DTYPE_NAMES[s.amp] if half else "float32")
                   * ev.f.efficiency("matmul", half))
    # every rank's share: the step's hardware FLOPs
    rows.late.append((r, 1, (0.0,) * (len(LATE) + 1) + (flops * tp,)))
    sums.acts[r] += head.saved_bytes(tokens)
    exposed = 0.0
    if tp > 1:
        link = link_for(ev.cluster, size=tp, stride=1)
        t = collective_time("all_reduce", head.tp_forward_bytes(tokens), tp, link,
                            ev.f.eff_link)
        exposed = t * (1 - ev.f.overlap_tp)
        sums.tp_kind[r]["all_reduce"] = sums.tp_kind[r].get("all_reduce", 0.0) + t
    rows.early.append((r, 1, (0.0, rec, exposed)))
    return head.temp_bytes(tokens, half=half, tp=tp) + (lt.act["none"]
                                                        if recompute == "full" else 0.0)
