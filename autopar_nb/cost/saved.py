"""What a run of identical layers adds to its rank's saved activations (``Evaluator.sum_layers``),
beyond each layer's own saved bytes: the whole replicated input a recomputed first sequence-parallel
block keeps, and the inputs recomputed layers share with an earlier one on the rank, kept once. The
memory floor (:mod:`.floor`) reads them as the full evaluation counts them."""

from __future__ import annotations

from .profile import precision_of
from .setting import LayerChoice, Setting
from .terms import LayerTerms


def run_saved(ev, s: Setting, i: int, cnt: int, ch: LayerChoice, lt: LayerTerms, kept: set[str]
              ) -> tuple[float, float, list[float]]:
    """The saved bytes the run ``i`` .. ``i + cnt - 1`` (its terms ``lt`` under ``ch``) of evaluator
    ``ev`` adds to its rank, its whole replicated input (:func:`replicated_input`) and, per layer,
    the inputs an earlier recomputed layer keeps already (:func:`held_inputs`, which adds the run's
    to ``kept``)."""
    whole, held = replicated_input(ev, s, i, ch, lt), held_inputs(ev, s, i, cnt, ch, kept)
    return cnt * lt.act[ch.recompute] + whole - held[-1], whole, held


def held_inputs(ev, s: Setting, i: int, cnt: int, ch: LayerChoice, kept: set[str]) -> list[float]:
    """Per layer of the run ``i`` .. ``i + cnt - 1``, the bytes of the recomputed layers' inputs up
    to it that an earlier recomputed layer on the rank keeps already
    (:attr:`.profile.LayerProfile.shared_inputs`: one storage, held once, which ``activation_bytes``
    counts per layer); adds the run's to ``kept``. Measured: T5's decoder blocks all keep the
    encoder output and the position biases (tp=2, bf16, full recompute: 11 MiB)."""
    held, total = [], 0.0
    if ch.recompute == "none":
        return [0.0] * cnt
    precision = precision_of(s.amp, s.zero_stage)
    sp_div = s.tp if s.sp and ch.tp and ev.prof.sp_covers(i) else 1  # sequence shards
    per_byte = s.mb_samples / ev.prof.batch * ev.seq_ratio / s.cp / sp_div
    for lp in ev.prof.layers[i:i + cnt]:
        for key, nbytes in lp.shared_inputs.get(precision, {}).items():
            if key in kept:
                total += nbytes * per_byte
            kept.add(key)
        held.append(total)
    return held


def replicated_input(ev, s: Setting, i: int, ch: LayerChoice, lt: LayerTerms) -> float:
    """Bytes a recomputed first block of a sequence-parallel run holds beyond its sequence shard: it
    receives the layer before's replicated output (an embedding's) and shards it itself (the plan's
    ``PrepareFirstInput`` inside the checkpoint wrapper), so the checkpoint keeps the whole input,
    and the recompute its shard beside it (measured: LLaMA tp=2 full recompute, layer 0)."""
    first = i in ev.blocks and (i == 0 or i - 1 not in ev.blocks)
    if not (first and s.sp and ch.tp and ch.recompute != "none" and s.tp > 1):
        return 0.0
    return lt.act["full"] * s.tp
