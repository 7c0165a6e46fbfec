"""The fused kernels' lines of the explanation: whether the RMSNorms run fused
(``plan.fused_norm``) and the output head fused with the loss (``plan.fused_loss``), why, and what
the other choice costs on the same split (:meth:`.search.Search.norm_variant` and
:meth:`~.search.Search.fused_variant` chose them)."""

from __future__ import annotations

import dataclasses

from ..cost.loss import unfused_loss_bytes
from ..cost.norm import one_kernel
from ..plan import RECOMPUTE
from ..units import fmt_bytes, fmt_time


def fused_norm_lines(best, ev, cons) -> list[str]:
    """Whether the RMSNorm modules run fused (``plan.fused_norm``), why, and what the other choice
    costs on the same split (``cost/norm.py``)."""
    fixed, s = cons.fix.get("fused_norm"), best.setting
    other, c = best.norm_other, best.cost
    if ev.norm_prof is None or fixed is False or not (s.fused_norm or other is not None):
        return []
    if other is not None:
        other = _restated(other, best, ev)
    why = ("fix fused_norm=True" if fixed else "chosen" if s.fused_norm else
           "not chosen: no faster on this split" if one_kernel(ev.prof.device_kind) else
           "not needed: on the CPU the op runs the eager kernels and only saves memory")
    line = (f"RMSNorms {'fused' if s.fused_norm else 'eager'} ({why}; kernels_ext.rms_norm keeps "
            "the input and one fp32 rstd per row, not the normalised input; on CUDA one kernel, "
            f"Liger-kernel's when installed): peak {fmt_bytes(c.peak_memory_bytes)}, "
            f"{fmt_time(c.step_time_s)}/step")
    if other is not None:
        oc = other.cost
        line += (f"; {'eager' if s.fused_norm else 'fused'}, this split needs "
                 f"{fmt_bytes(oc.peak_memory_bytes)}"
                 + (f" ({fmt_bytes(oc.peak_memory_bytes - best.limit)} over the limit)"
                    if not other.fits else
                    f" with {_recompute_words(other)} and takes {fmt_time(oc.step_time_s)}/step"))
    return [line + "."]


def _restated(other, best, ev, field: str = "fused_norm"):
    """``other`` (the search's variant of ``best`` with ``field``, the fused RMSNorms or loss, the
    other way) costed again on ``best``'s setting and compile choices: the levers set after the
    variant was costed (compile, Float8) apply to it too, and only its ``field`` and recompute stay
    its own."""
    setting = dataclasses.replace(best.setting, **{field: getattr(other.setting, field)})
    choices = [dataclasses.replace(b, recompute=o.recompute)
               for b, o in zip(best.choices, other.choices, strict=True)]
    return type(other)(setting, choices, ev.evaluate(setting, choices), best.limit)


def fused_loss_lines(best, ev, cons, why_not: str) -> list[str]:
    """Whether the output head runs fused with the loss (``plan.fused_loss``), why, and what it
    saves: the loss step's bytes fused and unfused (``cost/loss.py``), and the unfused plan of the
    same split when it was costed."""
    s, c, head = best.setting, best.cost, ev.head
    fixed = cons.fix.get("fused_loss")
    if head is None:
        return [f"Loss unfused: {why_not}."] if why_not and fixed is not None else []
    half = s.amp != "none"
    tokens = head.tokens * s.mb_samples / ev.prof.batch * ev.seq_ratio
    unfused = unfused_loss_bytes(tokens * head.vocab, half=half)
    fused = head.temp_bytes(tokens, half=half, tp=s.tp) + head.saved_bytes(tokens)
    split = (f", each of the {s.tp} TP ranks computing its {-(-head.vocab // s.tp)} rows "
             "(vocab-parallel)" if s.tp > 1 else "")
    what = (f"the loss step holds {fmt_bytes(fused)} ({head.chunk(tokens)}-token chunks of the "
            f"{head.vocab}-word vocabulary{split}, the fp32 weight gradient, one log-sum-exp per "
            f"token) instead of {fmt_bytes(unfused / s.tp)} (fp32 log-softmax, its gradient and "
            f"the logits' gradient, {tokens:g} tokens x "
            f"{head.vocab}{f' / {s.tp}' if s.tp > 1 else ''})")
    other = best.other and _restated(best.other, best, ev, "fused_loss")
    if s.fused_loss:
        why = "fix fused_loss=True" if fixed else "chosen"
        line = (f"Output head {head.module} fused with the loss ({why}, "
                f"kernels_ext.linear_cross_entropy): {what}")
        if other is not None:
            oc = other.cost
            if not other.fits:
                line += (f"; unfused, this split needs {fmt_bytes(oc.peak_memory_bytes)}, "
                         f"{fmt_bytes(oc.peak_memory_bytes - best.limit)} over the limit")
            else:
                line += (f"; unfused, this split needs {fmt_bytes(oc.peak_memory_bytes)} with "
                         f"{_recompute_words(other)} and takes {fmt_time(oc.step_time_s)}/step")
        line += (f". Peak {fmt_bytes(c.peak_memory_bytes)}; the logits are computed again in "
                 f"backward ({2 * tokens * head.hidden * head.vocab / s.tp / 1e12:.3g} TFLOP per "
                 f"micro-batch{' and rank' if s.tp > 1 else ''}).")
        return [line]
    if fixed is False:
        return []
    if other is not None:
        oc = other.cost
        return [f"Loss unfused: fusing the output head {head.module} with it would need "
                f"{fmt_bytes(oc.peak_memory_bytes)} and {fmt_time(oc.step_time_s)}/step "
                f"({'does not fit' if not other.fits else 'slower'}); {what}."]
    if s.tp > 1 and s.pp > 1:
        return [f"Loss unfused: fusing the output head {head.module} with it runs vocab-parallel "
                "(tp > 1) or on the last pipeline stage (pp > 1), not both."]
    return []


def _recompute_words(cand) -> str:
    """'full recompute on 12 layers', or 'no recompute'."""
    kinds = [ch.recompute for ch in cand.choices if ch.recompute != "none"]
    if not kinds:
        return "no recompute"
    return ", ".join(f"{k} recompute on {kinds.count(k)} layer(s)" for k in RECOMPUTE
                     if kinds.count(k))
